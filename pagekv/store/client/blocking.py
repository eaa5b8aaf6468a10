"""Store clients: :class:`StoreClient` (blocking) and, in :mod:`.async_client`,
:class:`AsyncStoreClient` (asyncio). Both offer the same batch API over :mod:`.operations`.

Both take one endpoint or several (sharded by rendezvous hashing, ``replicas`` copies each; see
:mod:`.routing`). A value is one bytes-like or a sequence of bytes-likes (its frames, e.g. a
page's K and V regions): one key, one checksum over all frames. Puts send the caller's buffers
(host pool page views) as zero-copy frames: do not change them until the call returns. Gets
verify each value's xxh3-64 checksum (a mismatch is a miss, counted) and either scatter its
frames into the caller's buffers (``into=``) or return read-only views of the received frames.

Requests are cut to each node's advertised limits (learned by a PING on first use), at most the
node's ``window`` of them are in flight per node, and a node that does not answer within
``ClientConfig.timeout_for(bytes in flight)`` fails: its requests' keys move on to their next
replica, its socket is replaced (a late reply can never be read as an answer to a later
request) and it is backed off. Node failures never raise from the data calls (put_many,
get_many, exists_many, delete_many): a key no node could answer is ``Status.UNAVAILABLE`` /
``None`` / ``False``. ``stats`` and ``ping`` raise ``StoreUnavailable`` when no node answers.
Bad arguments raise ``ValueError``/``TypeError`` before anything is sent. Neither client is
thread-safe: use one per thread (or per event loop).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..config import ClientConfig
from ..wire.protocol import Op, ProtocolError, Status, decode_reply
from .base import _Base, shared_context
from .routing import Batch, Call, ExistsResult, OpGen, Results, request_header

__all__ = ["StoreClient"]

log = logging.getLogger("pagekv.store")


_MORE, _MORE_NOW, _NOW = int(zmq.SNDMORE), int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)


def _send_request(sock: zmq.Socket, call: Call) -> None:
    """Header and payloads as one message, zero-copy; raises ``zmq.Again`` (nothing sent) if
    the node is not connected. (A loop over ``send``: ``send_multipart`` costs microseconds
    per frame in flag arithmetic, which a million one-byte values feel.)"""
    header, payloads = request_header(call), call.payloads
    if not payloads:
        sock.send(header, _NOW)
        return
    sock.send(header, _MORE_NOW)
    send = sock.send
    for frame in payloads[:-1]:
        send(frame, _MORE, copy=False)
    send(payloads[-1], 0, copy=False)


@dataclass
class _Link:
    sock: zmq.Socket
    created: float
    endpoint: str = ""
    was_up: bool = False  # connected when last looked at (see _Base._link_state)

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass(eq=False)  # flows are compared by identity
class _Flow:
    """One link's part of a batch in :meth:`StoreClient._exchange` (a node's stream)."""

    node: int
    stream: int
    link: _Link
    window: int
    progress: float  # last time the node answered (or was first sent to)
    unsent: list[Call] = field(default_factory=list)
    outstanding: dict[int, Call] = field(default_factory=dict)
    out_bytes: int = 0
    sent: bool = False  # a request went out on this socket during the batch

    def deadline(self, config: ClientConfig) -> float:
        if self.outstanding:
            return self.progress + config.timeout_for(self.out_bytes)
        # waiting for the connection: the connect bound, stretched by the bytes to move
        waiting = self.unsent[0].nbytes if self.unsent else 0
        connect = min(config.connect_timeout_s, config.timeout_s)
        return self.progress + connect + config.timeout_per_mib_s * waiting / (1 << 20)


@dataclass
class _Job:
    """A reply whose ``prepare`` runs on the copy pool; ``on_reply`` follows on this thread."""

    future: concurrent.futures.Future
    call: Call
    reply: Any
    frames: list[Any]

    def finish(self, block: bool) -> bool:
        """Hand the reply on once its prepare is done (waiting for it if ``block``); True
        when handed on. A prepare that raised (a bug) leaves its work to ``on_reply``."""
        if not block and not self.future.done():
            return False
        if self.future.exception() is not None:
            log.error("pagekv store: a reply's copies failed", exc_info=self.future.exception())
        if self.call.on_reply is not None:
            self.call.on_reply(self.reply, self.frames)
        return True


class StoreClient(_Base):
    """Blocking client. See the module docstring for what raises and what does not."""

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        self.ctx = shared_context(zmq.Context, self.config.streams)

    def _open(self, node: int, stream: int) -> _Link:
        endpoint = self._endpoint(node, stream)
        link = _Link(self._new_socket(self.ctx, endpoint, stream), time.monotonic(), endpoint)
        self._links.setdefault(node, [None] * self.config.streams)[stream] = link
        return link

    def _retire(self, link: _Link) -> None:
        link.close()  # between exchanges: nothing is in flight on it

    def _reset(self, node: int, stream: int) -> None:
        link = self._links.get(node, [None] * (stream + 1))[stream]
        if link is not None:
            link.close()
        self._open(node, stream)  # reconnecting starts now, so recovery shows in the link state

    def _exchange(self, batch: Batch) -> Results:
        """Run a batch: its PUTs and GETs over the bulk lanes of the nodes that offer one (and
        over ZeroMQ where a lane cannot be reached), the rest over ZeroMQ."""
        bulk, rest = self._bulk_split(batch)
        results = self._exchange_zmq(rest) if rest else {}
        if bulk:
            fallback = self._collect_bulk(bulk, results)
            if fallback:
                results.update(self._exchange_zmq(fallback))
        return results

    def _collect_bulk(self, bulk: list[tuple[Call, concurrent.futures.Future]],
                      results: Results) -> Batch:  # fmt: skip
        """Hand each bulk call's result on as it completes (``on_reply`` on this thread);
        returns the calls whose lane could not be reached. Every connection ends each call
        within its socket timeouts; if this thread is interrupted, the transfers (which write
        into the caller's buffers) are stopped and waited for before it goes on."""
        futures = {fut: call for call, fut in bulk}
        fallback: Batch = []
        failed: set[int] = set()
        try:
            for fut in concurrent.futures.as_completed(futures):
                call = futures[fut]
                if self._take_bulk(call, fut.result(), results, fallback):
                    failed.add(call.node)
        except BaseException:
            self.bulk.abort({call.node for call in futures.values()})
            concurrent.futures.wait(futures)
            raise
        for node in failed:  # as after a ZeroMQ timeout: the node must connect again (a
            for stream in range(self.config.streams):  # handshake a stopped node cannot
                self._reset(node, stream)  # complete) before it is used even as a last resort
        return fallback

    def _exchange_zmq(self, batch: Batch) -> Results:
        """Send each node its requests, dealt over its streams (at most its window in flight
        on each), and collect the replies; a stream whose node does not answer in time fails
        all its requests of the batch (None)."""
        results: Results = {}
        now = time.monotonic()
        per_node: dict[int, list[Call]] = {}
        for call in batch:
            per_node.setdefault(call.node, []).append(call)
        flows: dict[tuple[int, int], _Flow] = {}
        for node, calls in per_node.items():
            for stream, part in self._spread(node, calls):
                link = self._link(node, stream)
                flow = _Flow(node, stream, link, self._window(node), now, unsent=part)
                flows[node, stream] = flow
        by_sock = {flow.link.sock: flow for flow in flows.values()}
        jobs: list[_Job] = []  # replies whose prepare runs on the copy pool
        while flows or jobs:
            jobs[:] = [job for job in jobs if not job.finish(block=not flows)]
            if not flows:
                continue
            poller, now = zmq.Poller(), time.monotonic()
            broken = self._send_in_turn(list(flows.values()), now)
            for flow in list(flows.values()):
                if flow in broken or now >= flow.deadline(self.config):
                    self._fail(flow, flows, results)
                    continue
                blocked = flow.unsent and len(flow.outstanding) < flow.window
                poller.register(flow.link.sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
            if not flows:
                break
            wait = min(flow.deadline(self.config) for flow in flows.values()) - now
            wait_ms = 1 if jobs else max(0.0, wait) * 1000 + 1  # jobs: look at them often
            for sock, _ in poller.poll(wait_ms):
                flow = by_sock[sock]
                if (flow.node, flow.stream) in flows:
                    self._receive(flow, flows, results, jobs)
        return results

    def _send_in_turn(self, flows: list[_Flow], now: float) -> list[_Flow]:
        """Send what the flows' windows allow, one request per flow in turn (a PUT's requests
        are hashed as they are sent: flow by flow, the last stream started only once the
        others' requests were all hashed); returns the flows whose socket failed."""
        broken: list[_Flow] = []
        while flows:
            for flow in list(flows):
                left = len(flow.unsent)
                if not self._send_one(flow, now):
                    broken.append(flow)
                if flow in broken or len(flow.unsent) == left or not flow.unsent:
                    flows.remove(flow)  # failed, blocked (window, Again) or done
        return broken

    def _send_one(self, flow: _Flow, now: float) -> bool:
        """Send the flow's next request if its window allows; False when the socket failed
        (the flow must fail)."""
        if not flow.unsent or len(flow.outstanding) >= flow.window:
            return True
        call = flow.unsent[0]
        try:
            _send_request(flow.link.sock, call)
        except zmq.Again:
            return True  # not connected (yet): POLLOUT tells when
        except zmq.ZMQError:  # failed mid-message (the peer went): the socket may hold
            self.router.counters["send_errors"] += 1  # part of one, so _fail replaces it
            flow.sent = True
            return False
        if not flow.outstanding:
            flow.progress = now
        flow.unsent.pop(0)
        flow.sent = True
        flow.outstanding[call.request.id] = call
        flow.out_bytes += call.nbytes
        return True

    def _receive(self, flow: _Flow, flows: dict, results: Results, jobs: list[_Job]) -> None:
        while flow.outstanding:
            try:
                frames = flow.link.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = decode_reply(frames[0].buffer)
            except ProtocolError:
                self.router.counters["bad_replies"] += 1
                self._fail(flow, flows, results)
                return
            call = flow.outstanding.pop(reply.id, None)
            if call is None:
                continue  # a late answer to a request given up earlier
            flow.progress = time.monotonic()
            flow.out_bytes -= call.nbytes
            results[reply.id] = (reply, frames[1:])
            if call.prepare is not None and self.router.pool is not None:
                jobs.append(_Job(self.router.pool.submit(call.prepare, reply, frames[1:]),
                                 call, reply, frames[1:]))  # fmt: skip
            elif call.on_reply is not None:
                call.on_reply(reply, frames[1:])
        if not flow.unsent:
            del flows[flow.node, flow.stream]

    def _fail(self, flow: _Flow, flows: dict, results: Results) -> None:
        """Give up on a stream for this batch: None for each of its requests. Its socket is
        replaced if a request went out (a late reply must never be read as an answer to a
        later one); one that never connected is kept, so its age tells the node is down."""
        for call in [*flow.outstanding.values(), *flow.unsent]:
            results[call.request.id] = None
        flows.pop((flow.node, flow.stream), None)
        if flow.sent:
            self._reset(flow.node, flow.stream)

    def _run(self, gen: OpGen) -> Any:
        try:
            batch = next(gen)
            while True:
                batch = gen.send(self._exchange(batch))
        except StopIteration as done:
            return done.value

    def put_many(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        """Store each value under its key on ``replicas`` nodes; a status per key.

        ``buffers[i]`` is a bytes-like or a sequence of bytes-likes (the value's frames, sent
        as separate zero-copy frames and kept as such by the node). The caller must not
        change them until the call returns. Raises ``ValueError``/``TypeError`` for bad
        arguments, never for node failures (those are ``Status.UNAVAILABLE``)."""
        return self._run(self._plan_put(keys, buffers))

    def get_many(
        self,
        keys: Sequence[bytes],
        into: Sequence[Any] | None = None,
        on_arrival: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """With ``into``: scatter each found value's frames into ``into[i]`` (a writable
        buffer, or a sequence of them, one per frame with matching sizes) and return a bool
        per key; a size or frame-count mismatch or a bad checksum is a miss (counted). A
        value is checked as it is copied (one pass over memory), so after a miss ``into[i]``
        holds unspecified bytes (untouched, partly or wholly written): use it only on True.
        Without: per found key a read-only memoryview (a single-frame value) or a list of
        them (one per frame), None per miss; the views hold the received frames and stay
        valid as long as they are referenced.
        ``on_arrival(i)``, if given, is called (on the calling thread) as soon as key i's value
        is verified and in place, while later keys are still on their way; it must not raise."""
        return self._run(self._plan_get(keys, into, on_arrival))

    def exists_many(self, keys: Sequence[bytes]) -> ExistsResult:
        """Which keys some node holds; ``.leading`` is the count of leading hits."""
        return self._run(self._plan_exists(keys))

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete each key wherever it may be; True where some node held it."""
        return self._run(self._plan_delete(keys))

    def stats(self) -> list[dict | None]:
        """Each node's stats (None for a node that did not answer)."""
        return self._stats_or_raise(self._run(self.router.each_node(Op.STATS)))

    def ping(self) -> list[bool]:
        return [s is not None for s in self._run(self.router.each_node(Op.PING))]

    def close(self) -> None:
        """Close every link; the shared context stays (:func:`.client_base.shared_context`)."""
        self._close_links()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
