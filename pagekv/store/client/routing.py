"""The client's cluster logic, free of I/O: sharding, failover, node health and limits.

Keys are sharded by rendezvous hashing: each key ranks every node by ``xxh3_64(node || key)``.
Writes go to the first ``replicas`` usable nodes of that ranking, reads and lookups try up to
``replicas + 1`` usable nodes in ranking order. Any failure of one node for a request (no
answer in time, an error code, a malformed reply, an unknown status, missing checksums) moves
that request's keys on to their next node; a key is a miss (``None``, ``False``,
``Status.UNAVAILABLE``) only when no node could answer for it. Nothing else escapes: a reply is
validated before any of it is used.

Node health: a node that fails is backed off (exponentially). While backed off it is used only
as a last resort (after the usable nodes of a key) and only while the client's connection to it
is up again (``link(node)``, from the client's socket): a dead node costs one timeout, not one
per call, and a node that comes back is read from again at once. Each node's limits (keys,
frames, bytes and header size per request; requests in flight) are learned from its PING reply
on first use and requests are cut to fit them.

Each operation (:mod:`.operations`) is a generator: it yields batches of :class:`Call`,
receives ``{request id: (Reply, frames) | None}`` (None: no answer in time) and returns its
result. The client hands each batch's calls to the transports of their nodes
(:mod:`.transport`), which call ``Call.prepare`` and ``Call.on_reply`` as soon as a reply
arrives (a GET's values are checked and copied out while later replies are still on the wire).
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, fields
from typing import Any

import xxhash

from pagekv.errors import StoreError, StoreUnavailable

from ..wire.protocol import Code, Op, Reply, Request, Status, encode_request

__all__ = [
    "Batch",
    "Call",
    "ExistsResult",
    "Limits",
    "Link",
    "NodeHealth",
    "OpGen",
    "Results",
    "Router",
    "StoreError",
    "StoreUnavailable",
    "reply_shape_problem",
    "request_header",
]

Results = dict[int, "tuple[Reply, list[Any]] | None"]
log = logging.getLogger("pagekv.store.client.routing")


@dataclass
class Call:
    node: int
    request: Request
    payloads: list[Any]
    idxs: list[int]  # positions of the request's keys in the caller's key list
    nbytes: int = 0  # bytes this request moves (payload out + expected reply): its timeout
    on_reply: Callable[[Reply, list[Any]], None] | None = None
    # The reply's heavy work (copies, checksums), run by a client with a copy pool on a pool
    # thread before ``on_reply``; it writes only into the caller's buffers of this call's keys
    # and must be finished before the call counts as over (the client waits for it).
    prepare: Callable[[Reply, list[Any]], None] | None = None
    handled: bool = False
    # GET with destinations: per key of the request, the views its frames go to. A transport
    # that writes a reply's frames straight into them (the bulk lane, the same-host shortcut)
    # hands those same view objects back as the frames (``prepare``/``on_reply`` then only
    # verify them).
    sinks: list[list[memoryview]] | None = None
    # set by such a transport: per found value of the reply, the xxh3-64 of the frames as
    # they landed
    digests: list[int] | None = None
    # Run once, right before the request's header is encoded (:func:`request_header`): a PUT
    # fills in its values' checksums there, so hashing the next request's values overlaps the
    # sending of this one's.
    before_send: Callable[[], None] | None = None
    # a node that has not answered within this many seconds of the call's start fails it (a
    # lookup with a budget shorter than the client's timeout); None: the client's timeouts
    answer_s: float | None = None


def ready(call: Call) -> None:
    """Run ``call``'s ``before_send`` (once: later calls do nothing)."""
    if call.before_send is not None:
        prepare, call.before_send = call.before_send, None
        prepare()


def request_header(call: Call) -> bytes:
    """``call``'s request encoded for the wire, after the call's ``before_send`` (run once)."""
    ready(call)
    return encode_request(call.request)


Batch = list[Call]
OpGen = Generator[Batch, Results, Any]


class Link(enum.Enum):
    """The client's connection to a node, as its socket sees it."""

    UP = "up"  # connected (ZMTP handshake done)
    CONNECTING = "connecting"  # not yet, but the socket is young: worth waiting for
    DOWN = "down"  # not connected for longer than the connect timeout


@dataclass(frozen=True)
class Limits:
    """What one request to a node may carry, as the node advertises it (PING ``limits``)."""

    max_keys: int
    max_frames: int
    max_message_size: int
    max_block_size: int
    max_header_size: int
    window: int

    @classmethod
    def parse(cls, raw: dict) -> Limits | None:
        values = {f.name: raw.get(f.name) for f in fields(cls)}
        if not all(type(v) is int and v > 0 for v in values.values()):
            return None
        return cls(**values)


# Only for a node whose PING reply carries no usable limits (an older node): small on purpose.
FALLBACK_LIMITS = Limits(512, 512, 8 << 20, 8 << 20, 256 << 10, 4)


@dataclass(frozen=True)
class ExistsResult:
    """``found[i]``: key i is stored on some node. ``unanswered``: keys no node could answer
    for (down, timed out, malformed replies): counted as not found, but a caller that must
    tell "the store is unreachable" from "not stored" looks here."""

    found: list[bool]
    unanswered: int = 0

    @property
    def leading(self) -> int:
        """Number of leading keys found (the prefix that can be loaded)."""
        return next((i for i, f in enumerate(self.found) if not f), len(self.found))


class NodeHealth:
    def __init__(self, backoff_min: float, backoff_max: float) -> None:
        self.backoff_min, self.backoff_max = backoff_min, backoff_max
        self.down_until = 0.0
        self.backoff = 0.0
        self.failures = 0

    def is_up(self, now: float) -> bool:
        return now >= self.down_until

    def failed(self, now: float) -> None:
        """A failure doubles the back-off when the node was up (its back-off had run out);
        failures while it is backed off (concurrent calls, last-resort tries) extend it."""
        if self.is_up(now):
            self.failures += 1
            self.backoff = min(self.backoff_max, max(self.backoff_min, self.backoff * 2))
        self.down_until = max(self.down_until, now + self.backoff)

    def succeeded(self) -> None:
        self.down_until, self.backoff = 0.0, 0.0


class Router:
    """Node selection, limits, failover bookkeeping. Not thread-safe (one per client)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        replicas: int,
        backoff: tuple[float, float],
        max_message_bytes: int = 16 << 20,
        get_keys_per_request: int = 8,
        link: Callable[[int], Link] | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.max_message_bytes = max_message_bytes
        self.get_keys_per_request = get_keys_per_request
        self.replicas = replicas
        self.link = link or (lambda node: Link.UP)
        self.health = [NodeHealth(*backoff) for _ in self.endpoints]
        self.limits: list[Limits | None] = [None] * len(self.endpoints)
        # per node, the bytes of values one GET / PUT request may carry when its transport moves
        # them outside the request's messages (the same-host shortcut: a LOCATE's reply, a
        # RESERVE and a COMMIT carry none); None: the message limits. Set by the client as it
        # chooses transports.
        self.get_bytes: list[int | None] = [None] * len(self.endpoints)
        self.put_bytes: list[int | None] = [None] * len(self.endpoints)
        self.pool: Executor | None = None  # the client's copy pool (see .copies); None: inline
        # called with each node's PING reply (on the client's loop): the client chooses the
        # node's transports from it
        self.on_ping: Callable[[int, Reply], None] | None = None
        self._salt = [ep.encode() for ep in self.endpoints]
        self._ids = itertools.count(1)
        self.counters = dict.fromkeys(
            ("checksum_mismatch", "node_failures", "size_mismatch", "bad_replies",
             "error_replies", "send_errors", "unanswered_keys"), 0,
        )  # fmt: skip

    def next_id(self) -> int:
        return next(self._ids)

    def ranking(self, key: bytes) -> list[int]:
        """All node indices, best first, for ``key`` (rendezvous hashing)."""
        if len(self.endpoints) == 1:
            return [0]
        scores = [xxhash.xxh3_64_intdigest(salt + key) for salt in self._salt]
        return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)

    # ---- health ----------------------------------------------------------------------------
    def usable(self) -> list[bool]:
        """Per node: may it be sent requests now (up and reachable, or backed off but
        connected again)? A node up in name whose connection stays down is marked failed."""
        now, out = time.monotonic(), []
        for node, health in enumerate(self.health):
            state = self.link(node)
            if health.is_up(now) and state is Link.DOWN:
                self.failed(node, "is not connected")
            out.append(state is Link.UP or (health.is_up(now) and state is Link.CONNECTING))
        return out

    def candidates(self, keys: Sequence[bytes], k: int, usable: list[bool]) -> list[list[int]]:
        """Per key: up to ``k`` usable healthy nodes of its ranking, then the backed-off but
        connected ones among its first ``k`` (last resort). Lists may be shared: read only."""
        if len(self.endpoints) == 1:
            return [[0] if usable[0] else []] * len(keys)
        now = time.monotonic()
        healthy = [usable[n] and h.is_up(now) for n, h in enumerate(self.health)]
        resort = [usable[n] and not healthy[n] for n in range(len(self.endpoints))]
        out, shared = [], {}  # one list per distinct answer: a batch's keys share a few
        for key in keys:
            ranked = self.ranking(key)
            up = [n for n in ranked if healthy[n]]
            nodes = up[:k] + [n for n in ranked[:k] if resort[n]]
            out.append(shared.setdefault(tuple(nodes), nodes))
        return out

    def failed(self, node: int, why: str = "did not answer") -> None:
        now = time.monotonic()
        health = self.health[node]
        if health.is_up(now):  # logged once per back-off period, not per request
            self.counters["node_failures"] += 1
            health.failed(now)
            log.warning("pagekv store: %s %s (down, unreachable or refusing this client's key);"
                        " backing off %.2g s", self.endpoints[node], why,
                        health.backoff)  # fmt: skip
        else:
            health.failed(now)

    def succeeded(self, node: int) -> None:
        health = self.health[node]
        if health.failures and health.backoff:
            log.info("pagekv store: %s answers again", self.endpoints[node])
        health.succeeded()

    def reply_problem(self, call: Call, result: tuple[Reply, list[Any]] | None) -> str | None:
        """Why a result cannot be used (and the node's health updated), or None if it can."""
        if result is None:
            self.failed(call.node)
            return "no answer"
        reply, frames = result
        if reply.code is not Code.OK:
            self.counters["error_replies"] += 1
            if reply.code is Code.TOO_LARGE:
                self.forget(call.node)  # learn its limits again before the next request
            return f"{reply.code.name}: {reply.error}"
        problem = _shape_problem(call.request.op, len(call.idxs), reply, len(frames))
        if problem is not None:
            self.counters["bad_replies"] += 1
            self.failed(call.node, f"sent a malformed reply ({problem})")
            return problem
        self.succeeded(call.node)
        return None

    # ---- limits ----------------------------------------------------------------------------
    def learn(self, nodes: dict[int, int], answer_s: float | None = None) -> OpGen:
        """Ask the nodes whose limits are unknown for them (PING); a node that does not
        answer is marked failed and keeps ``None``. ``nodes``: node -> bytes the operation
        will move there (the PING is its first round trip, and gets its time bound)."""
        batch = [Call(n, Request(Op.PING, self.next_id()), [], [], nbytes, answer_s=answer_s)
                 for n, nbytes in nodes.items() if self.limits[n] is None]  # fmt: skip
        if not batch:
            return
        results = yield batch
        for call in batch:
            result = results.get(call.request.id)
            if self.reply_problem(call, result) is None:
                self.learn_ping(call.node, result[0])

    def learn_ping(self, node: int, reply: Reply) -> None:
        """What a PING reply tells of a node: its limits here, its transports (``on_ping``)."""
        self.limits[node] = Limits.parse(reply.limits) or FALLBACK_LIMITS
        if self.on_ping is not None:
            self.on_ping(node, reply)

    def forget(self, node: int) -> None:
        """PING the node again before its next request (its limits, ports or transports may
        have changed: it restarted, or refused a request as too large)."""
        self.limits[node] = None

    def message_bytes(self, limits: Limits) -> int:
        """The most payload one request message to a node with ``limits`` carries."""
        return min(limits.max_message_size, self.max_message_bytes)

    def cut(
        self,
        keys: Sequence[bytes],
        idxs: list[int],
        limits: Limits,
        *,
        key_extra: int = 3,
        frame_extra: int = 0,
        frames: Sequence[int] | None = None,
        nbytes: Sequence[int] | None = None,
        most_keys: int | None = None,
        most_bytes: int | None = None,
    ) -> list[list[int]]:
        """Split ``idxs`` into requests within a node's limits: keys, header bytes (each key
        costs its length + ``key_extra`` + ``frame_extra`` per frame), frames and payload bytes
        (``most_bytes`` when given, else the message limits; one item over the byte limit goes
        alone; the caller refuses items that never fit)."""
        max_keys = min(limits.max_keys, most_keys or limits.max_keys)
        max_head = limits.max_header_size - 1024
        if frames is None and nbytes is None:  # keys only: equal runs sized for the longest key
            longest = max((len(keys[i]) for i in idxs), default=1) + key_extra
            step = max(1, min(max_keys, max_head // longest))
            return [idxs[start : start + step] for start in range(0, len(idxs), step)]
        max_bytes = most_bytes or self.message_bytes(limits)
        parts, part, head, nframes, total = [], [], 0, 0, 0
        for i in idxs:
            f = frames[i] if frames is not None else 0
            h = len(keys[i]) + key_extra + frame_extra * f
            b = nbytes[i] if nbytes is not None else 0
            if part and (len(part) >= max_keys or head + h > max_head
                         or nframes + f > limits.max_frames or total + b > max_bytes):  # fmt: skip
                parts.append(part)
                part, head, nframes, total = [], 0, 0, 0
            part.append(i)
            head, nframes, total = head + h, nframes + f, total + b
        if part:
            parts.append(part)
        return parts

    def each_node(self, op: Op, answer_s: float | None = None) -> OpGen:
        """PING or STATS every node; None for a node that is unreachable or did not answer
        (within ``answer_s`` when given)."""
        usable = self.usable()
        batch = [Call(n, Request(op, self.next_id()), [], [], answer_s=answer_s)
                 for n in range(len(self.endpoints)) if usable[n]]  # fmt: skip
        results = (yield batch) if batch else {}
        out: list[dict | None] = [None] * len(self.endpoints)
        for call in batch:
            result = results.get(call.request.id)
            if self.reply_problem(call, result) is None:
                out[call.node] = result[0].stats
                if op is Op.PING:
                    self.learn_ping(call.node, result[0])
        return out


def reply_shape_problem(call: Call, reply: Reply, frames: list[Any]) -> str | None:
    """What is wrong with the shape of ``call``'s reply (None: its statuses, checksums and
    frame counts agree with the request and the frames). Pure: no counters, no health."""
    return _shape_problem(call.request.op, len(call.idxs), reply, len(frames))


def _shape_problem(op: Op, nkeys: int, reply: Reply, nframes: int) -> str | None:
    """What is wrong with a reply's shape for its request, or None."""
    allowed = _ALLOWED[op]
    if op in (Op.PING, Op.STATS):
        return "payload frames on a reply that takes none" if nframes else None
    if len(reply.status) != nkeys:
        return f"{len(reply.status)} statuses for {nkeys} keys"
    if not allowed.issuperset(reply.status):
        return "unknown or unexpected status"
    found = reply.status.count(Status.OK) if op is Op.GET else 0
    counts = reply.counts if op is Op.GET else []
    if op is Op.GET and (len(reply.sums) != found or len(counts) != found):
        return "checksums or frame counts missing"
    if any(c < 1 for c in counts) or sum(counts) != nframes:
        return "frame counts do not match the frames"
    if op is Op.GET and not found and Status.DEFERRED in reply.status:
        return "every value deferred"
    return None


def _allowed() -> dict[Op, frozenset[int]]:
    put = {Status.OK, Status.EXISTS, Status.TOO_LARGE, Status.NO_SPACE, Status.BAD_CHECKSUM,
           Status.BAD_KEY}  # fmt: skip
    found = {Status.OK, Status.NOT_FOUND}
    return {Op.PUT: frozenset(put), Op.GET: frozenset({*found, Status.DEFERRED}),
            Op.EXISTS: frozenset(found), Op.DELETE: frozenset(found), Op.PING: frozenset(),
            Op.STATS: frozenset()}  # fmt: skip


_ALLOWED = _allowed()
