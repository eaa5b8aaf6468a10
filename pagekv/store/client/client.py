""":class:`AsyncStoreClient`: the store client (asyncio). :class:`.blocking.StoreClient` runs one
on a loop thread of its own for synchronous callers.

A client takes one endpoint or several (sharded by rendezvous hashing, ``replicas`` copies each;
see :mod:`.routing`). A value is one bytes-like or a sequence of bytes-likes (its frames, e.g. a
page's K and V regions): one key, one checksum over all frames. Puts send the caller's buffers
(host pool page views) as zero-copy frames: do not change them until the call returns. Gets
verify each value's xxh3-64 checksum (a mismatch is a miss, counted) and either scatter its
frames into the caller's buffers (``into=``) or return read-only views of them.

One path for every call: an operation (:mod:`.operations`) yields batches of calls; each call
goes to its node's transport (:mod:`.transport`: PUT and GET payloads over the transports chosen
from the node's PING reply, ZeroMQ for the rest); the replies go back to the operation, which moves
a failed node's keys on to their next node. Requests are cut to each node's advertised limits
(learned by that PING on first use), at most the node's ``window`` of them are in flight per
connection, and a node that does not answer within ``ClientConfig.timeout_for(bytes in
flight)`` fails: its keys move on to their next replica, its connection is replaced (a late
reply can never be read as an answer to a later request) and it is backed off. Node failures
never raise from the data calls (put_many, get_many, exists_many, delete_many): a key no node
could answer is ``Status.UNAVAILABLE`` / ``None`` / ``False``. ``stats`` and ``ping`` raise
``StoreUnavailable`` (``AuthenticationFailed`` for refused CURVE keys) when no node answers.
Bad arguments raise ``ValueError``/``TypeError`` before anything is sent.

Concurrency: calls of one client may run at once on its event loop (they share its
connections); a client is used from one event loop. Cancelling a call is safe: it returns once
nothing writes into its buffers any more, and a reply that arrives later is discarded.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from pagekv.errors import AuthenticationFailed

from ..backend import StoreBackend, byte_views, check_keys
from ..config import ClientConfig, CurveClientKeys
from ..wire.copies import shared_pool
from ..wire.protocol import Op, Reply, Request, Status
from . import operations
from . import shm as shm_transport
from .lane import LaneTransport
from .routing import Batch, Call, ExistsResult, OpGen, Results, Router, StoreUnavailable
from .shm import ShmTransport
from .transport import MOVED, Route, Transport, choose, gather_all
from .zeromq import ZmqTransport

# PUT requests of a client without a copy pool (``copy_threads`` 1: fewer than 4 cores) carry up
# to this many bytes, not the message limit: its loop hashes each request before the request's
# first byte is sent, and on 2 cores smaller requests keep the client's hashing, its sending and
# the node's receiving going side by side. A user's put_many of 32 fresh 2 MiB values on the
# 2-core machine: 1.8-2.1 GB/s in 4 MiB requests against 1.4-1.9 in 16 MiB ones (5 rounds; 2 and
# 8 MiB alike). With a pool (16 cores) the pool hashes a request in parallel and requests stay at
# the limit: 4 MiB ones moved 0.55-0.69x as much over 8 streams there, and the connector's
# write-back took 2-2.6x as long.
INLINE_PUT_BYTES = 4 << 20

__all__ = ["AsyncStoreClient", "raise_unavailable"]


class AsyncStoreClient(StoreBackend):
    """asyncio store client (see the module docstring for what raises and what does not): the
    :class:`~pagekv.store.backend.StoreBackend` of pagekv store nodes."""

    kind = "pagekv"

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        replicas: int = 1,
        timeout_s: float = 5.0,
        curve: CurveClientKeys | None = None,
        config: ClientConfig | None = None,
        streams: int | None = None,
    ) -> None:
        self.config = cfg = config or ClientConfig(
            tuple([endpoints] if isinstance(endpoints, str) else endpoints),
            replicas=replicas,
            timeout_s=timeout_s,
            curve=curve,
            streams=streams,
        )
        self.router = Router(cfg.endpoints, cfg.replicas, (cfg.backoff_min_s, cfg.backoff_max_s),
                             cfg.max_message_bytes)  # fmt: skip
        self.router.pool = shared_pool(cfg.copy_threads)  # None: copies on the loop's thread
        self.router.on_ping = self._choose
        self._zmq = ZmqTransport(cfg, self.router)
        self.router.link = self._zmq.link_state
        self._lane = LaneTransport(cfg, self.router) if cfg.bulk else None
        self._shm = ShmTransport(self.router, self._zmq) if cfg.shm else None
        self._routes = [Route("zmq", "not PINGed yet") for _ in cfg.endpoints]
        self._by_name: dict[str, Transport] = {"zmq": self._zmq}
        for transport in (self._lane, self._shm):
            if transport is not None:
                self._by_name[transport.name] = transport
        # the lane's connection threads and the shortcut's pools end with the client
        weakref.finalize(self, _close_all, list(self._by_name.values()))

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.config.endpoints

    @property
    def counters(self) -> dict[str, int]:
        """Counts of what happened (failures, misses by cause, transports' traffic)."""
        return self.router.counters

    def routes(self) -> list[Route]:
        """Per node, how its GETs travel and why not faster (as of its last PING)."""
        return list(self._routes)

    def nodes_down(self) -> list[bool]:
        """Per node, whether it failed lately and is being backed off (used again only as a
        last resort until its back-off is over)."""
        now = time.monotonic()
        return [not health.is_up(now) for health in self.router.health]

    def home_down(self, key: bytes) -> bool:
        """Whether ``key``'s first node by rendezvous hashing is backed off."""
        return not self.router.health[self.router.ranking(key)[0]].is_up(time.monotonic())

    # ---- transports ------------------------------------------------------------------------
    def _choose(self, node: int, reply: Reply) -> None:
        """A node's transports, from its PING reply and this client's settings."""
        self._zmq.take(node, reply.ports)
        shm = self._shm.take(node, reply.shm) if self._shm is not None else None
        lane = self._lane.take(node, reply.bulk) if self._lane is not None else None
        self._routes[node] = route = choose(shm, lane)
        # a LOCATE's reply, a RESERVE and a COMMIT carry no values: one a chunk of copies
        chunk = shm_transport.CHUNK_BYTES
        self.router.get_bytes[node] = chunk if route.get == "shm" else None
        writes = self._shm is not None and self._shm.writes(node)
        self.router.put_bytes[node] = chunk if writes else self._put_bytes(node)

    def _put_bytes(self, node: int) -> int | None:
        """The most a PUT request to ``node`` (its limits known: PING sets them before it
        calls :meth:`_choose`) carries over the wire: the message limits (None), or
        INLINE_PUT_BYTES within them where this client hashes on its loop (no copy pool)."""
        if self.router.pool is not None:
            return None
        return min(INLINE_PUT_BYTES, self.router.message_bytes(self.router.limits[node]))

    def _transport(self, call: Call) -> Transport:
        op = call.request.op
        if op is Op.GET:
            return self._by_name[self._routes[call.node].get]
        if op is Op.PUT and self._shm is not None and self._shm.writes(call.node):
            return self._shm
        if op is Op.PUT and self._lane is not None and self._lane.carries(call.node):
            return self._lane
        return self._zmq

    async def _exchange(self, batch: Batch) -> Results:
        """Run a batch: each call on its node's transport, all transports at once."""
        results = await self._dispatch(batch)
        moved = [call for call in batch if results.get(call.request.id) is MOVED]
        if moved:
            results.update(await self._again(moved))
        return results

    async def _dispatch(self, batch: Batch) -> Results:
        groups: dict[Transport, Batch] = {}
        for call in batch:
            groups.setdefault(self._transport(call), []).append(call)
        parts = await gather_all([t.run(calls) for t, calls in groups.items()])
        results: Results = {}
        for (transport, calls), part in zip(groups.items(), parts):
            results.update(part)
            if transport is not self._zmq:
                self._after_payload_transport(calls, part)
        return results

    def _after_payload_transport(self, calls: Batch, results: Results) -> None:
        """A payload transport that failed a node's call: as after a ZeroMQ timeout, the node must
        connect again (a handshake a stopped node cannot complete) before it is used even as a
        last resort, and it is PINGed again before its next use (its transports chosen
        again)."""
        for node in {c.node for c in calls if results.get(c.request.id) is None}:
            self._zmq.reset_node(node)
            self.router.forget(node)

    async def _again(self, calls: Batch) -> Results:
        """Calls whose node's payload transport found its address gone (a node restarted, its
        lane on another port, or down): PING each such node (its transports chosen again) and
        run the calls once more on what was chosen; a node that does not answer the PING fails
        them (None), as does one found moved again."""
        results: Results = {}
        nodes = {call.node for call in calls}
        pings = [Call(n, Request(Op.PING, self.router.next_id()), [], []) for n in nodes]
        answers = await self._zmq.run(pings)
        answered = set()
        for ping in pings:
            result = answers.get(ping.request.id)
            if self.router.reply_problem(ping, result) is None:
                self.router.learn_ping(ping.node, result[0])
                answered.add(ping.node)
        retry = [call for call in calls if call.node in answered]
        results.update({c.request.id: None for c in calls if c.node not in answered})
        if retry:
            again = await self._dispatch(retry)
            results.update({rid: (None if r is MOVED else r) for rid, r in again.items()})
        return results

    async def _run(self, gen: OpGen) -> Any:
        try:
            batch = next(gen)
            while True:
                batch = gen.send(await self._exchange(batch))
        except StopIteration as done:
            return done.value

    # ---- the calls -------------------------------------------------------------------------
    async def put_many(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        """Store each value under its key on ``replicas`` nodes; a status per key.

        ``buffers[i]`` is a bytes-like or a sequence of bytes-likes (the value's frames, sent
        as separate zero-copy frames and kept as such by the node). The caller must not change
        them until the call returns. Raises ``ValueError``/``TypeError`` for bad arguments,
        never for node failures (those are ``Status.UNAVAILABLE``)."""
        check_keys(keys, buffers, "buffers")
        views = [byte_views(b, False, "put_many") for b in buffers]
        return await self._run(operations.put(self.router, keys, views))

    async def get_many(
        self,
        keys: Sequence[bytes],
        into: Sequence[Any] | None = None,
        on_arrival: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """With ``into``: scatter each found value's frames into ``into[i]`` (a writable
        buffer, or a sequence of them, one per frame with matching sizes) and return a bool per
        key; a size or frame-count mismatch or a bad checksum is a miss (counted). A value is
        checked as it is copied (one pass over memory), so after a miss ``into[i]`` holds
        unspecified bytes (untouched, partly or wholly written): use it only on True. Without:
        per found key a read-only memoryview (a single-frame value) or a list of them (one per
        frame), None per miss; the views stay valid as long as they are referenced.
        ``on_arrival(i)``, if given, is called on the client's loop as soon as key i's value is
        verified and in place, while later keys are still on their way; if it raises, the call
        stops and raises that error once nothing writes into ``into`` any more."""
        check_keys(keys, into, "into buffers")
        targets = None if into is None else [byte_views(b, True, "get_many") for b in into]
        return await self._run(operations.get(self.router, keys, targets, on_arrival))

    async def exists_many(
        self, keys: Sequence[bytes], *, answer_s: float | None = None
    ) -> ExistsResult:
        """Which keys some node holds; ``.leading`` is the count of leading hits,
        ``.unanswered`` of keys no node could answer for. ``answer_s``: a node that has not
        answered this call within it is treated as after a missed deadline (failed, backed off,
        its keys asked of their next node or unanswered): a lookup with a budget shorter than
        the client's timeout."""
        check_keys(keys, None, "")
        return await self._run(operations.exists(self.router, keys, answer_s))

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete each key wherever it may be; True where some node held it."""
        check_keys(keys, None, "")
        return await self._run(operations.delete(self.router, keys))

    async def stats(self) -> list[dict | None]:
        """Each node's stats (None for a node that did not answer)."""
        stats = await self._run(self.router.each_node(Op.STATS))
        if all(st is None for st in stats):
            await asyncio.to_thread(raise_unavailable, self.config)
        return stats

    async def ping(self, *, answer_s: float | None = None) -> list[bool]:
        """Whether each node answers a PING (its transports chosen again from it); a node that
        has not answered within ``answer_s`` is treated as after a missed deadline (failed,
        backed off), whatever the others do."""
        return [s is not None for s in await self._run(self.router.each_node(Op.PING, answer_s))]

    def close(self) -> None:
        """Close every connection (calls in flight fail); the shared ZeroMQ context and copy
        pools stay (see :func:`.zeromq.shared_context`)."""
        _close_all(list(self._by_name.values()))


def _close_all(transports: list[Transport]) -> None:
    for transport in transports:
        transport.close()


def raise_unavailable(cfg: ClientConfig) -> None:
    """No node answered: probe each (a PING watched by a socket monitor) and raise
    ``AuthenticationFailed`` if a node refused this client's CURVE keys, else
    ``StoreUnavailable``, naming each node's outcome. Blocking (at most ~2 s per node)."""
    from .probe import Outcome, probe

    results = [probe(ep, curve=cfg.curve, timeout_s=min(cfg.timeout_s, 2.0))
               for ep in cfg.endpoints]  # fmt: skip
    why = "; ".join(f"{r.endpoint}: {r}" for r in results)
    if any(r.outcome is Outcome.AUTH_FAILED for r in results):
        raise AuthenticationFailed(f"store authentication failed ({why})")
    raise StoreUnavailable(f"no store node answered ({why})")
