"""The ZeroMQ transport: every call to a node that no faster transport takes (see
:mod:`.transport`), over ``ClientConfig.streams`` DEALER sockets ("links") per node.

A node's links are shared by every concurrent call of the client; a call's requests to a node
are dealt over its links, starting where the node's previous batch left off (so one-request
calls, too, use every stream). Each link's socket is watched by the loop, which hands each
reply to the request waiting for its id, so calls never wait on each other's replies; a
request's frames are sent in one go (no other send can come between them), and at most the
node's ``window`` requests are in flight on a link. Each call gives up on a link on its own
deadline (``timeout_for`` the bytes it has in flight there, or its ``answer_s``), so k
concurrent calls to a dead node each finish within one timeout; the first to give up resets
that link, which fails the others' requests on it at once (requests on the node's other links
are untouched). A reply's ``prepare`` runs on the copy pool
when the client has one (``ClientConfig.copy_threads`` > 1), else inline, then ``on_reply`` on
the loop.

Ownership: a PUT's values go out zero-copy, read by libzmq's I/O thread from the caller's
buffers after ``send`` returned. A run that ends with requests unanswered (cancelled, timed out,
a callback raised) with frames libzmq still holds closes that link and waits until libzmq has
let go of them before it returns: the caller may then reuse its buffers.

Link state: a node counts as connected (:meth:`ZmqTransport.link_state`) only while every
stream's socket is; stream s connects to the node's port for stream s when the node advertises
per-stream ports (PING ``ports``), else to its endpoint.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq

from ..config import ClientConfig
from ..wire.protocol import ProtocolError, decode_reply
from .routing import Call, Link, Results, Router, request_header
from .transport import Transport, gather_all

__all__ = ["ZmqTransport", "shared_context"]

log = logging.getLogger("pagekv.store")

_CONTEXTS: dict[tuple[type, int, int], zmq.Context] = {}


def shared_context(kind: type[zmq.Context], io_threads: int) -> zmq.Context:
    """The process's context of class ``kind`` with ``io_threads`` I/O threads (one I/O thread:
    ``kind.instance()``). Clients of the same stream count share one, so a client costs
    sockets, never threads of its own, and closing it (its sockets, linger 0) leaves nothing
    behind; a forked child gets fresh contexts. Never terminated (like ``instance()``)."""
    if io_threads == 1:
        return kind.instance()
    key = (kind, io_threads, os.getpid())
    ctx = _CONTEXTS.get(key)
    if ctx is None or ctx.closed:
        ctx = _CONTEXTS[key] = kind(io_threads=io_threads)
    return ctx


LET_GO_S = 5.0  # the longest a cancelled PUT waits for libzmq to let go of its buffers
_MORE, _MORE_NOW, _NOW = int(zmq.SNDMORE), int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)


def _send(sock: zmq.Socket, call: Call) -> list[zmq.MessageTracker]:
    """Send ``call``'s request (header, then its payloads as zero-copy frames) as one message;
    raises ``zmq.Again`` (nothing sent) while the node is not connected. A loop over ``send``:
    ``send_multipart`` costs microseconds per frame in flag arithmetic, which a million
    one-byte values feel. Returns the trackers of the frames libzmq holds (pyzmq copies
    frames under its copy threshold: their trackers are done at once): each is done once
    libzmq has let go of its frame."""
    header, payloads = request_header(call), call.payloads
    sock.send(header, _MORE_NOW if payloads else _NOW)
    held = []
    send, last = sock.send, len(payloads) - 1
    for k, frame in enumerate(payloads):
        tracker = send(frame, _MORE if k < last else 0, copy=False, track=True)
        if not tracker.done:
            held.append(tracker)
    return held


class _Link:
    """A socket to one node, the replies awaited on it and its window of requests.

    The socket is a plain (blocking-API) one driven from the loop: its ``ZMQ_FD`` is watched
    with ``add_reader``, and every wake-up drains what the socket holds (the FD is edge
    triggered: after each send or receive the socket's ``EVENTS`` are looked at again). Sends
    are ``NOBLOCK``: a connected socket (``SNDHWM`` 0, ``IMMEDIATE``) takes a whole message at
    once, and a sender waits for ``POLLOUT`` only while the node is not connected. Leaner than
    pyzmq's asyncio sockets (a trivial call spent ~0.5 ms of CPU more there on the 2-core dev
    machine)."""

    def __init__(self, sock: zmq.Socket, node: int, stream: int, endpoint: str,
                 on_bad_reply: Callable[[_Link], None]) -> None:  # fmt: skip
        self.sock, self.created = sock, time.monotonic()
        self.node, self.stream, self.endpoint = node, stream, endpoint
        self.on_bad_reply = on_bad_reply
        self.was_up = False  # connected when last looked at (see ZmqTransport.link_state)
        self.pending: dict[int, asyncio.Future] = {}
        self.inflight = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.sendable: list[asyncio.Future] = []  # senders waiting for the connection
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.retired = False  # replaced by a link to another endpoint: close once idle

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have ``loop`` call :meth:`ready` whenever the socket may have something."""
        if self.loop is None:
            self.loop = loop
            loop.add_reader(self.sock.getsockopt(zmq.FD), self.ready)

    def ready(self) -> None:
        """Hand each reply to the request waiting for it; wake senders once connected. A
        reply that cannot be read resets the link (its requests fail and move on)."""
        sock, pending = self.sock, self.pending
        while not self.closed:
            events = sock.getsockopt(zmq.EVENTS)
            if events & _POLLOUT and self.sendable:
                for fut in self.sendable:
                    if not fut.done():
                        fut.set_result(None)
                self.sendable.clear()
            if not events & _POLLIN:
                return
            frames = sock.recv_multipart(_NOW, copy=False)
            try:
                reply = decode_reply(frames[0].buffer)
            except ProtocolError:
                self.on_bad_reply(self)
                return
            fut = pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result((reply, frames[1:]))

    async def send(self, call: Call) -> list[zmq.MessageTracker]:
        """Send ``call``'s request, once the socket is connected (its payloads' trackers: see
        :func:`_send`). Raises ``zmq.ZMQError`` when it fails (the caller resets the link),
        ``ConnectionError`` when the link closed while waiting."""
        while True:
            if self.closed:
                raise ConnectionError("link closed")
            try:
                trackers = _send(self.sock, call)
                break
            except zmq.Again:  # not connected (yet): POLLOUT tells when
                fut = self.loop.create_future()
                self.sendable.append(fut)
                self.loop.call_soon(self.ready)  # in case the connection is already there
                await fut
        self.ready()  # the FD is edge triggered: look again after a send
        return trackers

    async def acquire(self, window: int) -> None:
        while self.inflight >= window and not self.closed:
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
        self.inflight += 1

    def close_if_idle(self) -> None:
        if self.retired and not self.closed and not self.inflight and not self.pending:
            self.close()

    def release(self) -> None:
        self.inflight -= 1
        if self.retired:
            self.close_if_idle()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Fail every request waiting on this socket (None) and close it."""
        if self.closed:
            return
        self.closed = True
        for fut in [*self.pending.values(), *self.waiters, *self.sendable]:
            if not fut.done():
                fut.set_result(None)
        self.pending.clear()
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        self.sock.close(linger=0)


class ZmqTransport(Transport):
    """The client's ZeroMQ links to every node (see the module docstring)."""

    name = "zmq"

    def __init__(self, config: ClientConfig, router: Router) -> None:
        self.config, self.router = config, router
        self.ctx = shared_context(zmq.Context, config.streams)
        self._links: dict[int, list[_Link | None]] = {}  # node -> its links, one per stream
        self._turn: dict[int, int] = {}  # node -> the stream its next batch starts on
        self._ports: list[list[int]] = [[] for _ in config.endpoints]  # PING "ports"

    # ---- links -----------------------------------------------------------------------------
    def take(self, node: int, ports: Sequence[int]) -> None:
        """The node's advertised per-stream ports (PING ``ports``; valid TCP ports only, on a
        tcp:// endpoint, else none): links not on their stream's endpoint are moved."""
        tcp = self.config.endpoints[node].startswith("tcp://")
        ports = [p for p in ports if 0 < p < 65536] if tcp else []
        if ports != self._ports[node]:
            self._ports[node] = ports
            self._move_streams(node)

    def _forget_ports(self, node: int, why: str) -> None:
        """The node's stream ports do not connect (a firewall, a restarted node): use its main
        endpoint, and PING it again (limits, ports, transports) before its next request."""
        if self._ports[node]:
            log.warning("pagekv store: %s: %s; using its main port", self.config.endpoints[node],
                        why)  # fmt: skip
            self._ports[node] = []
            self.router.forget(node)
            self._move_streams(node)

    def _endpoint(self, node: int, stream: int) -> str:
        endpoint, ports = self.config.endpoints[node], self._ports[node]
        if not ports:
            return endpoint
        return f"{endpoint.rsplit(':', 1)[0]}:{ports[stream % len(ports)]}"

    def _move_streams(self, node: int) -> None:
        for stream, link in enumerate(self._links.get(node, [])):
            if link is not None and link.endpoint != self._endpoint(node, stream):
                self._retire(link)
                self._open(node, stream)

    def _open(self, node: int, stream: int) -> _Link:
        endpoint = self._endpoint(node, stream)
        link = _Link(self._new_socket(endpoint, stream), node, stream, endpoint, self._bad_reply)
        self._links.setdefault(node, [None] * self.config.streams)[stream] = link
        return link

    def _new_socket(self, endpoint: str, stream: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        # Stream s on I/O thread s: left to libzmq, connections opened together all land on
        # the first I/O thread (its load is counted only once a connection is set up), and
        # every stream's bytes then go through one thread (measured: 2-3 GB/s for 1-8 streams)
        sock.setsockopt(zmq.AFFINITY, 1 << (stream % self.config.streams))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a node not connected
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.config.socket_buffer:  # 0: leave it to the kernel's TCP autotuning
            sock.setsockopt(zmq.SNDBUF, self.config.socket_buffer)
            sock.setsockopt(zmq.RCVBUF, self.config.socket_buffer)
        if self.config.curve is not None:
            sock.curve_serverkey = self.config.curve.server_public
            sock.curve_publickey = self.config.curve.public
            sock.curve_secretkey = self.config.curve.secret
        sock.connect(endpoint)
        return sock

    def _retire(self, link: _Link) -> None:
        """A call that already holds ``link`` may still send on it: it is closed when its
        last request is released, or on the next turn of the loop if nothing takes it."""
        link.retired = True
        try:
            asyncio.get_running_loop().call_soon(link.close_if_idle)
        except RuntimeError:  # no running loop: nothing can be using it
            link.close_if_idle()

    def _reset(self, link: _Link) -> None:
        """Replace ``link`` (its requests fail at once); the node's other links go on."""
        node, stream = link.node, link.stream
        if self._links.get(node, [None] * (stream + 1))[stream] is link:
            link.close()
            self._open(node, stream)  # reconnecting starts now

    def reset_node(self, node: int) -> None:
        """Replace every link of ``node``: it must complete a new handshake (which a stopped
        node cannot) before it counts as connected again."""
        for link in list(self._links.get(node, [])):
            if link is not None:
                self._reset(link)

    def _link(self, node: int, stream: int) -> _Link:
        links = self._links.setdefault(node, [None] * self.config.streams)
        return links[stream] or self._open(node, stream)

    def link_state(self, node: int) -> Link:
        """UP only when every stream is connected: a stream replaced after a timeout must
        complete its handshake (which a stopped node cannot) before the node counts as up
        again; the streams that were not replaced still look connected to a stopped node."""
        links = [self._link(node, s) for s in range(self.config.streams)]
        # SNDHWM 0 and IMMEDIATE: a link can take a request exactly while it is connected
        up = [bool(link.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT) for link in links]
        lost = False
        for link, ok in zip(links, up):
            lost = lost or (link.was_up and not ok)
            link.was_up = ok
        if all(up):
            return Link.UP
        if lost and self._ports[node]:
            # the node dropped a connection: it may have restarted with new stream ports,
            # which the old links would never reach. Back to its main port now (and a PING
            # learns the ports again); a node that is really down stays CONNECTING there,
            # then DOWN, as any other
            self._forget_ports(node, "lost a stream connection")
            return Link.CONNECTING
        newest = max(link.created for link in links)
        if time.monotonic() - newest < min(self.config.connect_timeout_s,
                                           self.config.timeout_s):  # fmt: skip
            return Link.CONNECTING
        if self._ports[node]:  # maybe only the stream ports are unreachable
            self._forget_ports(node, "its stream ports do not connect")  # fresh links
            return Link.CONNECTING
        return Link.DOWN

    def close(self) -> None:
        for links in self._links.values():
            for link in links:
                if link is not None:
                    link.close()
        self._links.clear()

    # ---- calls -----------------------------------------------------------------------------
    async def run(self, calls: list[Call]) -> Results:
        per_node: dict[int, list[Call]] = {}
        for call in calls:
            per_node.setdefault(call.node, []).append(call)
        parts = [(node, stream, part) for node, node_calls in per_node.items()
                 for stream, part in self._spread(node, node_calls)]  # fmt: skip
        if len(parts) == 1:
            return await self._stream_calls(*parts[0])
        done = await gather_all([self._stream_calls(*part) for part in parts])
        return {rid: result for part in done for rid, result in part.items()}

    def _let_go(self, link: _Link, trackers: Iterable[list[zmq.MessageTracker]]) -> None:
        """Return only once libzmq reads none of the payloads of this run's unanswered
        requests (it sends them zero-copy from the caller's buffers, which the caller reuses
        once the call returns): those still queued or being sent end with the link, which is
        replaced (the other requests on it fail, as after a timeout)."""
        held = [tracker for request in trackers for tracker in request if not tracker.done]
        if not held:
            return
        self._reset(link)  # replaced where it is the node's current link
        link.close()  # (a retired one too) with linger 0: libzmq drops what it still holds
        deadline = time.monotonic() + LET_GO_S
        try:
            for tracker in held:
                tracker.wait(max(0.0, deadline - time.monotonic()))
        except zmq.NotDone:  # never seen: libzmq frees a closed socket's messages at once
            log.error("pagekv store: libzmq still held a PUT's buffers %.0f s after its "
                      "connection closed", LET_GO_S)  # fmt: skip

    def _spread(self, node: int, calls: list[Call]) -> list[tuple[int, list[Call]]]:
        """(stream, calls) pairs: ``calls`` dealt round-robin over the node's streams, starting
        where the node's previous batch left off."""
        streams = self.config.streams
        if streams == 1:
            return [(0, calls)]
        first = self._turn.get(node, 0)
        self._turn[node] = (first + len(calls)) % streams
        parts: dict[int, list[Call]] = {}
        for j, call in enumerate(calls):
            parts.setdefault((first + j) % streams, []).append(call)
        return list(parts.items())

    def _window(self, node: int) -> int:
        limits = self.router.limits[node]
        return limits.window if limits is not None else 1

    def _bad_reply(self, link: _Link) -> None:
        self.router.counters["bad_replies"] += 1
        self._reset(link)

    async def _request(self, link: _Link, call: Call, clock: dict) -> Any:
        """Send one request when the window allows and wait for its reply (None: failed)."""
        await link.acquire(self._window(link.node))
        rid = call.request.id
        try:
            if link.closed:
                return None
            loop = asyncio.get_running_loop()
            link.watch(loop)
            fut = link.pending[rid] = loop.create_future()
            clock["sending"] += 1
            clock["wake"]()  # the deadline is now the connection's
            try:
                trackers = await link.send(call)
            except ConnectionError:  # the link was reset while this request waited
                return None
            except zmq.ZMQError:  # failed mid-message (the peer went): the socket may hold
                # part of a message, so it is replaced, and this request failed (never
                # raised to the caller)
                self.router.counters["send_errors"] += 1
                self._reset(link)
                return None
            finally:
                clock["sending"] -= 1
            if not clock["bytes"]:
                clock["progress"] = time.monotonic()
            clock["bytes"] += call.nbytes + 1
            clock["wake"]()  # a send completed: the deadline moves (bytes in flight)
            if trackers:
                clock["trackers"][rid] = trackers
            result = await fut
            if result is not None:  # answered: the node has every byte, libzmq is done
                clock["trackers"].pop(rid, None)
            clock["bytes"] -= call.nbytes + 1
            clock["progress"] = time.monotonic()
            pool = self.router.pool
            if result is not None and call.prepare is not None and pool is not None:
                job = pool.submit(call.prepare, *result)
                clock["jobs"].append(job)  # waited for by _stream_calls, even if cancelled
                try:
                    await asyncio.wrap_future(job)
                except Exception:  # a bug in a prepare: on_reply does its work instead
                    log.exception("pagekv store: a reply's copies failed")
            if result is not None and call.on_reply is not None:
                call.on_reply(*result)
            return result
        finally:
            link.pending.pop(rid, None)
            link.release()

    async def _stream_calls(self, node: int, stream: int, calls: list[Call]) -> Results:
        """Run ``calls`` on one link of ``node`` until all are answered or their deadline
        passes (see the module doc; the unanswered ones are None). Waits on one event that
        completions, sends and the deadline timer set: O(1) work per wake-up (a wait over
        every task each time cost O(tasks) and took the engine's GIL)."""
        link = self._link(node, stream)
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        waker = asyncio.Event()
        left_calls = len(calls)

        def finished(task: asyncio.Future) -> None:
            nonlocal left_calls, raised
            left_calls -= 1
            raised = raised or (not task.cancelled() and task.exception() is not None)
            waker.set()

        raised = False  # an on_reply raised (the caller's callback): hand nothing more on

        clock = {"progress": start, "bytes": 0, "sending": 0, "wake": waker.set, "jobs": [],
                 "trackers": {}}  # fmt: skip
        tasks: dict[asyncio.Future, Call] = {}
        cfg = self.config
        total = sum(c.nbytes for c in calls)
        cap = start + cfg.timeout_for(total) + cfg.timeout_s
        stretch = cfg.timeout_per_mib_s * total / (1 << 20)
        budgets = [c.answer_s for c in calls if c.answer_s is not None]
        answer_by = start + min(budgets) if budgets else None
        try:
            for call in calls:
                task = asyncio.ensure_future(self._request(link, call, clock))
                task.add_done_callback(finished)
                tasks[task] = call
                if call.before_send is not None and len(tasks) < len(calls):
                    # A PUT's values are hashed as it is sent, on this loop: let the node's
                    # other streams send their first requests before this one's next. Made all
                    # at once, one stream's requests were hashed and sent before the next
                    # stream's first (H100, 4 streams, 512 MiB: the fourth began at 42 ms).
                    await asyncio.sleep(0)
            while left_calls and not raised:
                if clock["bytes"]:
                    deadline = clock["progress"] + cfg.timeout_for(clock["bytes"])
                elif clock["sending"]:  # waiting for the connection (stretched by the bytes)
                    connect = min(cfg.connect_timeout_s, cfg.timeout_s)
                    deadline = clock["progress"] + connect + stretch
                else:  # waiting for window slots held by other calls (each on its deadline)
                    deadline = cap
                if answer_by is not None:
                    deadline = min(deadline, answer_by)
                left = deadline - time.monotonic()
                if left <= 0:
                    if clock["bytes"]:  # a request went out: fail the socket's requests
                        self._reset(link)
                    break  # (none did: the socket is kept, its age tells the node is down)
                waker.clear()
                timer = loop.call_later(left, waker.set)
                try:
                    await waker.wait()
                finally:
                    timer.cancel()
        finally:
            for task in tasks:
                task.cancel()
            # A prepare running on the copy pool writes into the caller's buffers: the call is
            # over only when none is left (a queued one is cancelled with its task; a running
            # one finishes within a copy of one reply, milliseconds)
            running = [job for job in clock["jobs"] if not job.cancel() and not job.done()]
            if running:
                concurrent.futures.wait(running)
            self._let_go(link, clock["trackers"].values())
        results: Results = dict.fromkeys((c.request.id for c in calls), None)
        for t, c in tasks.items():
            if t.done() and not t.cancelled():
                if t.exception() is not None:
                    raise t.exception()  # an on_reply that raised: the caller's error
                results[c.request.id] = t.result()
        return results
