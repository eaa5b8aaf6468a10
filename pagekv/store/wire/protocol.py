"""Wire protocol between store clients (DEALER) and store nodes (ROUTER). See docs/protocol.md.

A message is one msgpack header frame followed by raw payload frames, sent and received with
``copy=False``. A value may be several frames (e.g. a page's K and V regions): one key, one
checksum over all its frames in order, frames kept and returned as they were sent. Request::

    {"v": 2, "id": <uint>, "op": "PUT"|"GET"|"EXISTS"|"DELETE"|"STATS"|"PING"|"LOCATE"|...,
     "keys": [bytes...],
     "counts": [frames per key...], "sizes": [bytes per frame...], "sums": [xxh3 per key...]}
                                                                  # counts/sizes/sums: PUT only

Reply header::

    {"v": 2, "id": <same>, "code": <Code>, "error": str, "status": [Status per key],
     "sums": [int per found key], "counts": [frames per found key], "hits": <leading hits>,
     "stats": {...}}                       # GET: the found values' frames follow, in key order

A node started with ``--shm`` advertises its shared segment in PING replies (``shm``: path,
size, inode, host id, ...) and answers LOCATE: per found key where its frames lie in the segment
(``offs``, ``counts``, ``sizes`` per frame, ``sums``, ``gens``); RESERVE (``counts``, ``sizes``
as a PUT's, no payload): per key room for its value in the segment (``offs``, ``gens``), which
the client writes itself; COMMIT (``sums``): store the values written; see docs/protocol.md.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from pagekv.errors import ProtocolError

__all__ = [
    "MAX_KEY_BYTES",
    "PROTOCOL_VERSION",
    "SHARED_BUFFER_BYTES",
    "Code",
    "Op",
    "ProtocolError",
    "Reply",
    "Request",
    "Status",
    "checksum",
    "checksum_frames",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
]

PROTOCOL_VERSION = 2
MAX_KEY_BYTES = 256
MAX_HEADER_BYTES = 1 << 20
SHARED_BUFFER_BYTES = 8192  # libzmq's receive batch: smaller frames may live inside one


class Op(str, enum.Enum):
    PUT = "PUT"
    GET = "GET"
    EXISTS = "EXISTS"
    DELETE = "DELETE"
    STATS = "STATS"
    PING = "PING"
    LOCATE = "LOCATE"  # --shm nodes: where found values lie in the shared segment
    RESERVE = "RESERVE"  # --shm nodes: room in the segment for values a client writes itself
    COMMIT = "COMMIT"  # --shm nodes: the reserved values are written; store them


class Code(enum.IntEnum):
    """Request-level outcome."""

    OK = 0
    BAD_HEADER = 1  # not msgpack, not a map, or a field of the wrong type
    BAD_VERSION = 2
    BAD_OP = 3
    BAD_FRAMES = 4  # payload frame count or sizes do not match the header
    TOO_LARGE = 5  # message over the node's limits
    INTERNAL = 6


class Status(enum.IntEnum):
    """Per-key outcome."""

    OK = 0
    NOT_FOUND = 1
    EXISTS = 2  # PUT of a present key: acknowledged, not rewritten (blocks are immutable)
    TOO_LARGE = 3  # block over --max-block-size
    NO_SPACE = 4  # cannot fit even after evicting every unpinned block
    BAD_CHECKSUM = 5  # payload does not match the checksum sent with it
    BAD_KEY = 6  # empty or over MAX_KEY_BYTES
    UNAVAILABLE = 7  # client side: no replica could be reached
    DEFERRED = 8  # GET: found, but left out of this reply (over the reply size limit): ask again


def checksum(data: Any) -> int:
    """xxh3-64 of a block (bytes-like)."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_frames(frames: Sequence[Any]) -> int:
    """xxh3-64 of a value's frames read in order (the same as of their concatenation)."""
    if len(frames) == 1:
        return xxhash.xxh3_64_intdigest(frames[0])
    state = xxhash.xxh3_64()
    for frame in frames:
        state.update(frame)
    return state.intdigest()


@dataclass
class Request:
    """``sizes`` has one entry per payload frame, ``counts`` the number of frames of each key
    (PUT; empty ``counts`` encodes as one frame per key), ``sums`` one checksum per key."""

    op: Op
    id: int
    keys: list[bytes] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    sums: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


@dataclass
class Reply:
    id: int
    code: Code = Code.OK
    error: str = ""
    status: list[int] = field(default_factory=list)
    sums: list[int] = field(default_factory=list)
    hits: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)  # GET: frames of each found value
    limits: dict[str, int] = field(default_factory=dict)  # PING: what requests may carry
    shm: dict[str, Any] = field(default_factory=dict)  # PING, LOCATE: the node's segment
    offs: list[int] = field(default_factory=list)  # LOCATE, RESERVE: byte offset of each value
    gens: list[int] = field(default_factory=list)  # LOCATE, RESERVE: generation of each value
    sizes: list[int] = field(default_factory=list)  # LOCATE: bytes of each found frame
    ports: list[int] = field(default_factory=list)  # PING: the node's per-stream TCP ports
    bulk: int = 0  # PING: the TCP port of the node's bulk lane (0: none)


def encode_request(req: Request) -> bytes:
    head: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": req.id, "op": req.op.value}
    if req.keys:
        head["keys"] = req.keys
    if req.op in (Op.PUT, Op.RESERVE):
        head["counts"] = req.counts or [1] * len(req.keys)
        head["sizes"] = req.sizes
    if req.op in (Op.PUT, Op.COMMIT):
        head["sums"] = req.sums
    return msgpack.packb(head, use_bin_type=True)


def _field(head: dict, name: str, kind: type, default: Any = None) -> Any:
    value = head.get(name, default)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(Code.BAD_HEADER, f"field {name!r} must be {kind.__name__}")
    return value


def _int_list(head: dict, name: str, n: int, least: int = 0) -> list[int]:
    values = _field(head, name, list, [])
    if len(values) != n or not all(type(x) is int and x >= least for x in values):
        raise ProtocolError(Code.BAD_HEADER, f"field {name!r} must be {n} ints >= {least}")
    return values


def decode_request(frame: bytes | memoryview) -> Request:
    """Parse and validate a request header. Raises ``ProtocolError``."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(Code.TOO_LARGE, f"header of {len(frame)} bytes")
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(Code.BAD_HEADER, f"header is not msgpack: {e}") from None
    if not isinstance(head, dict):
        raise ProtocolError(Code.BAD_HEADER, "header must be a msgpack map")
    if head.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(Code.BAD_VERSION, f"protocol version {head.get('v')!r} unsupported")
    rid = _field(head, "id", int)
    if rid < 0:
        raise ProtocolError(Code.BAD_HEADER, "field 'id' must be >= 0")
    try:
        op = Op(head.get("op"))
    except ValueError:
        raise ProtocolError(Code.BAD_OP, f"unknown op {head.get('op')!r}") from None
    keys = _field(head, "keys", list, [])
    if not all(isinstance(k, bytes) for k in keys):
        raise ProtocolError(Code.BAD_HEADER, "field 'keys' must be a list of bytes")
    req = Request(op, rid, keys)
    if op in (Op.PUT, Op.RESERVE):
        req.counts = _int_list(head, "counts", len(keys), least=1)
        req.sizes = _int_list(head, "sizes", sum(req.counts))
    if op in (Op.PUT, Op.COMMIT):
        req.sums = _int_list(head, "sums", len(keys))
    return req


def encode_reply(rep: Reply) -> bytes:
    head: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": rep.id, "code": int(rep.code)}
    if rep.error:
        head["error"] = rep.error
    if rep.status:
        head["status"] = rep.status
    if rep.sums:
        head["sums"] = rep.sums
    if rep.counts:
        head["counts"] = rep.counts
    if rep.hits:
        head["hits"] = rep.hits
    if rep.stats:
        head["stats"] = rep.stats
    if rep.limits:
        head["limits"] = rep.limits
    if rep.shm:
        head["shm"] = rep.shm
    if rep.offs:
        head["offs"], head["gens"], head["sizes"] = rep.offs, rep.gens, rep.sizes
    if rep.ports:
        head["ports"] = rep.ports
    if rep.bulk:
        head["bulk"] = rep.bulk
    return msgpack.packb(head, use_bin_type=True)


def _uint_list(head: dict, name: str) -> list[int]:
    values = head.get(name, [])
    # (checked in C: a per-element generator was most of a 1,024-key reply's decode)
    if not isinstance(values, list) or (values and (set(map(type, values)) != _INT
                                                    or min(values) < 0)):  # fmt: skip
        raise ProtocolError(Code.BAD_HEADER, f"reply field {name!r} must be a list of uints")
    return values


_INT = {int}


def decode_reply(frame: bytes | memoryview) -> Reply:
    """Parse and type-check a reply header. Raises ``ProtocolError`` (never anything else)
    for a malformed one: not msgpack, unknown version or code, fields of the wrong type."""
    try:
        head = msgpack.unpackb(frame, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(Code.BAD_HEADER, f"reply is not msgpack: {e}") from None
    if not isinstance(head, dict) or head.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(Code.BAD_VERSION, "reply has no supported protocol version")
    rid, code, hits = head.get("id"), head.get("code", 0), head.get("hits", 0)
    bulk = head.get("bulk", 0)
    if any(type(x) is not int for x in (rid, code, hits, bulk)) or not 0 <= bulk < 65536:
        raise ProtocolError(Code.BAD_HEADER, "reply id, code, hits and bulk must be ints")
    if code not in Code._value2member_map_:
        raise ProtocolError(Code.BAD_HEADER, f"reply code {code} unknown")
    error, stats, limits = head.get("error", ""), head.get("stats", {}), head.get("limits", {})
    shm = head.get("shm", {})
    if not isinstance(error, str) or not all(isinstance(d, dict) for d in (stats, limits, shm)):
        raise ProtocolError(Code.BAD_HEADER, "reply error/stats/limits/shm of the wrong type")
    return Reply(
        id=rid,
        code=Code(code),
        error=error,
        status=_uint_list(head, "status"),
        sums=_uint_list(head, "sums"),
        hits=hits,
        stats=stats,
        counts=_uint_list(head, "counts"),
        limits=limits,
        shm=shm,
        offs=_uint_list(head, "offs"),
        gens=_uint_list(head, "gens"),
        sizes=_uint_list(head, "sizes"),
        ports=_uint_list(head, "ports"),
        bulk=bulk,
    )
