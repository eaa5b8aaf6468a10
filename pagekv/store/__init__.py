"""pagekv.store: ZeroMQ store nodes and clients moving page blocks (see docs/protocol.md).

Layout (data flow order): :mod:`.client` (the client and its transports), :mod:`.wire` (what
both ends share: protocol, lane framing, checked copies), :mod:`.node` (``pagekv serve``),
:mod:`.cli` (the ``pagekv`` command); :mod:`.config` holds both ends' configs and
:mod:`.launch` starts real node processes for tests and benchmarks.
"""

from .client.blocking import StoreClient
from .client.client import AsyncStoreClient
from .client.routing import ExistsResult, StoreError, StoreUnavailable
from .client.transport import Route
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
    "Route",
    "Status",
    "StoreClient",
    "StoreError",
    "StoreNode",
    "StoreUnavailable",
    "parse_size",
]
