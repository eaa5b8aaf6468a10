"""pagekv.store: ZeroMQ store nodes and clients moving page blocks (see docs/protocol.md)."""

from .async_client import AsyncStoreClient
from .client import StoreClient
from .config import ClientConfig, CurveClientKeys, NodeConfig, parse_size
from .protocol import PROTOCOL_VERSION, Code, Op, ProtocolError, Status
from .routing import ExistsResult, StoreError, StoreUnavailable
from .server import StoreNode

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
