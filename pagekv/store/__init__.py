"""pagekv.store: ZeroMQ store nodes and clients moving page blocks (see docs/protocol.md)."""

from .client.blocking import StoreClient
from .client.client import AsyncStoreClient
from .client.routing import ExistsResult, StoreError, StoreUnavailable
from .config import ClientConfig, CurveClientKeys, NodeConfig, parse_size
from .node.server import StoreNode
from .wire.protocol import PROTOCOL_VERSION, Code, Op, ProtocolError, Status

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncStoreClient",
    "ClientConfig",
    "Code",
    "CurveClientKeys",
    "ExistsResult",
    "NodeConfig",
    "Op",
    "ProtocolError",
    "Status",
    "StoreClient",
    "StoreError",
    "StoreNode",
    "StoreUnavailable",
    "parse_size",
]
