"""Client side of the bulk lane (:mod:`.bulk_server`): a client's GET requests, and its PUTs
with ``ClientConfig.bulk_puts`` (the default where it has a copy pool), to a node that
advertises a lane (PING ``bulk``) go over plain TCP connections, one thread per connection.
A PUT's values are hashed on the lanes' hasher while the call before it on its connection is
sent (:meth:`BulkLanes.hash_ahead`), so a connection's turn is the send alone.

Each connection's thread sends a request and reads the reply's frames straight into the GET's
destinations (``Call.sinks``) when their sizes match, each value hashed as it lands: with the
native library, all of a reply's frames in one call without the GIL, each 256 KiB hashed right
after it arrived (:func:`.bulk_wire.recv_values`); without it, one ``recv_into`` per frame, then
xxhash (on the copy pool while the next frame arrives, when the client has at most half as
many connections as the pool has threads). Then it runs the call's ``prepare`` there (which
compares those digests). Up to ``DEPTH`` requests are out on a
connection, so the node starts the next reply while this thread checks the last. The result
goes back through a ``concurrent.futures.Future``: ``(reply, frames)``, ``None`` (the node
failed this request: no answer in time, a reset, a malformed reply; its keys move on like any
node failure) or :data:`FALLBACK` (the lane cannot be reached at all: the client sends the call
over ZeroMQ instead, and leaves the lane alone for ``RECHECK_S``).

Ownership: a call's ``sinks`` and ``payloads`` are used by its connection's thread until its
future is done; a client that stops waiting early (cancelled, interrupted) must
:meth:`BulkLanes.abort` the node's connections and wait for the futures before it returns (an
aborted connection ends its calls at once). Not thread-safe apart from the futures: one
``BulkLanes`` per client, used on the client's thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import socket
import threading
import time
from typing import Any

from pagekv.errors import ProtocolError

from .bulk_wire import (
    ClosedBetweenMessages,
    load_native,
    new_buffer,
    new_ring,
    read_head,
    recv_values,
    send_message,
    stages,
    timeval,
)
from .config import ClientConfig
from .protocol import Code, Op, Status, decode_reply
from .routing import FALLBACK_LIMITS, Call, Router, request_header

__all__ = ["COUNTERS", "DEPTH", "FALLBACK", "BulkLanes"]

log = logging.getLogger("pagekv.store")
DEPTH = 2  # requests out on one connection: the next reply streams while the last is checked
RECHECK_S = 30.0  # a lane that could not be reached is left alone this long
FALLBACK: Any = type("Fallback", (), {"__repr__": lambda self: "FALLBACK"})()
COUNTERS = ("bulk_requests", "bulk_bytes_in", "bulk_failures", "bulk_fallbacks")
# GETs always; PUTs with ClientConfig.bulk_puts. Until a611580 a lane connection hashed each
# PUT right before sending it, and PUTs went slower over the lane than over ZeroMQ, whose I/O
# thread sends while the client hashes (H100 host, one stream 2.0 against 3.0 GB/s; ba69fc9).
_LANE_OPS = (Op.GET,)


class _Conn:
    """One connection of a client to a node's bulk lane and the thread that works it."""

    def __init__(self, address: tuple[str, int], config: ClientConfig, router: Router,
                 node: int, lanes: BulkLanes) -> None:  # fmt: skip
        self.address, self.config, self.router, self.node = address, config, router, node
        self.lanes = lanes
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        # abort() counts up (client's thread); the connection's thread compares before each
        # send: a socket shut down while this thread was idle is replaced, not sent on
        self.aborts = self.aborts_seen = 0
        self.ring: Any = None  # made by the connection's thread, which alone uses it
        # the queued call taken ahead of its turn (its PUT values hashing on the lanes' hasher
        # while the call before it is sent), or the closing sentinel taken early
        self.ahead: list[Any] = []
        self.thread = threading.Thread(target=self._run, name="pagekv-bulk-client", daemon=True)
        self.thread.start()

    def submit(self, call: Call) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.queue.put((call, fut))
        return fut

    def abort(self) -> None:
        """End the calls on this connection now (each gets None); the next call reconnects
        (also when the connection was idle: its socket is shut down all the same)."""
        self.aborts += 1
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in recv/send
            except OSError:
                pass  # not connected (any more): nothing to wake

    def close(self) -> None:
        self.queue.put(None)
        self.abort()

    # ---- the connection's thread -----------------------------------------------------------
    def _run(self) -> None:
        load_native()  # before the first request goes out: no node waits on a compiler
        # this thread's staging ring (config.staged_receive), written now: in its cache, faulted
        self.ring = new_ring() if self.config.staged_receive else None
        out: collections.deque = collections.deque()  # (call, future): requests sent
        closing = False
        resent: set[int] = set()  # requests sent again after their connection went stale
        while out or not closing:
            while len(out) < DEPTH and not closing:
                try:
                    item = self._next(block=not out)
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                call, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                self._look_ahead()
                outcome = self._send(call, idle=not out)
                if outcome is not True:
                    fut.set_result(outcome)
                    self._fail(out, queued=outcome is None)
                    continue
                out.append((call, fut))
            if not out:
                continue
            call, fut = out.popleft()
            try:
                result = self._receive(call)
            except ClosedBetweenMessages:
                # nothing of the reply came: the node may have restarted and never read the
                # request. GETs are idempotent: send them again on a new connection (once;
                # twice stale, e.g. a node at its connection cap: ZeroMQ takes this call)
                again = resent.isdisjoint({call.request.id})
                resent.add(call.request.id)
                self._resend([(call, fut), *out], out, again)
                continue
            except (OSError, ProtocolError) as e:
                log.debug("pagekv store: bulk lane to %s failed: %s", self.address, e)
                self._fail(out, queued=True)
                result = None
            except Exception:  # a bug: this call fails like a node failure, the lane goes on
                log.exception("pagekv store: bulk lane reply could not be handled")
                self._fail(out, queued=True)
                result = None
            if self.sock is None:  # dropped while answering: the rest sent on it are lost
                self._fail(out)
            fut.set_result(result)
        self._drop()

    def _resend(self, calls: list, out: collections.deque, again: bool) -> None:
        """Send ``calls`` (their connection went stale) on a new connection; those that
        cannot be sent get their outcome (FALLBACK when the lane cannot be reached)."""
        self._drop()
        out.clear()
        if not again:
            self.lanes.mark_down(self.node, "connections closed before any reply")
        for call, fut in calls:
            outcome = self._send(call)
            if outcome is True:
                out.append((call, fut))
            else:
                fut.set_result(outcome)

    def _fail(self, out: collections.deque, queued: bool = False) -> None:
        """The connection is unusable: drop it and fail the calls whose requests went out and,
        with ``queued`` (the node did not answer in time), those waiting to be sent: each
        would otherwise wait one more timeout on a new connection to the same node (the
        ZeroMQ path fails a stream's whole part of a batch the same way)."""
        self._drop()
        while out:
            out.popleft()[1].set_result(None)
        while queued:
            try:
                item = self._next(block=False)
            except queue.Empty:
                return
            if item is None:
                self.ahead.append(None)  # closing: leave the sentinel for the loop
                return
            if item[1].set_running_or_notify_cancel():
                item[1].set_result(None)

    def _next(self, block: bool) -> Any:
        """The next queued item: the one taken ahead, else from the queue (``queue.Empty``
        when none is there and not ``block``)."""
        if self.ahead:
            return self.ahead.pop()
        return self.queue.get(block=block)

    def _look_ahead(self) -> None:
        """Take the next queued call now, before this thread sends the current one, and start
        hashing its PUT values on the lanes' hasher (:meth:`BulkLanes.hash_ahead`): by the time
        the current send returns its checksums are ready and its bytes are in the cache, where
        hashing right before its own send would add the hash to every request's turn."""
        if self.ahead or self.lanes.hasher is None:
            return
        try:
            item = self.queue.get_nowait()
        except queue.Empty:
            return
        self.ahead.append(item)
        if item is not None:
            self.lanes.hash_ahead(item[0])

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _connect(self) -> bool:
        if self.lanes.down(self.node):
            return False
        cfg = self.config
        try:
            sock = socket.create_connection(self.address, timeout=cfg.connect_timeout_s)
        except OSError as e:
            self.lanes.mark_down(self.node, f"{self.address[0]}:{self.address[1]}: {e}")
            return False
        sock.settimeout(None)  # blocking: MSG_WAITALL waits for whole frames
        limits = self.router.limits[self.node] or FALLBACK_LIMITS
        wait = timeval(cfg.timeout_for(limits.max_message_size))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, wait)
        self.sock = sock
        return True

    def _send(self, call: Call, idle: bool = False) -> Any:
        """Send ``call``'s request: True, else its result (FALLBACK: no connection; None).
        ``idle``: no request is out on this connection. A kept connection that turns out to
        be closed or reset by the node while idle (it restarted, or dropped the connection)
        is replaced and the request sent once more: the node cannot have answered any of it
        (a PUT stored twice stores the same bytes)."""
        if self.aborts != self.aborts_seen:  # shut down by abort(): never send on it
            self.aborts_seen = self.aborts
            self._drop()
        kept = self.sock is not None
        if not kept and not self._connect():
            return FALLBACK
        header = request_header(call)
        try:
            send_message(self.sock, header, call.payloads)
        except ConnectionError as e:
            if not (kept and idle):
                log.debug("pagekv store: bulk send to %s failed: %s", self.address, e)
                return None
            self._drop()  # stale: a new connection (or FALLBACK when the lane moved or went)
            return self._send(call)
        except OSError as e:
            log.debug("pagekv store: bulk send to %s failed: %s", self.address, e)
            return None
        return True

    def _receive(self, call: Call) -> tuple[Any, list[Any]]:
        """Read ``call``'s reply, its frames into the call's sinks where they fit, and run its
        ``prepare``. Raises ``ProtocolError`` for a reply to another request or over the
        node's limits (the connection is then dropped), ``OSError`` for the rest."""
        limits = self.router.limits[self.node] or FALLBACK_LIMITS
        wait = timeval(self.config.timeout_for(call.nbytes))  # as the ZeroMQ path's deadline
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
        head = read_head(self.sock, max_frames=max(1, len(call.request.keys)) * limits.max_frames,
                         max_frame_bytes=limits.max_message_size,
                         max_payload_bytes=limits.max_message_size)  # fmt: skip
        reply = decode_reply(head.header)
        if reply.id != call.request.id:
            if reply.id == 0 and reply.code is not Code.OK and not head.sizes:
                self._drop()  # the node refused the message and hung up: its answer stands
                return reply, []
            raise ProtocolError(Code.BAD_HEADER, f"reply {reply.id} to request {call.request.id}")
        frames = _places(call, reply, head.sizes)
        counts = reply.counts if call.request.op is Op.GET and reply.code is Code.OK else None
        pool = self.router.pool if self.lanes.pool_hashing() else None
        ring = self.ring if self.ring is not None and stages(head.payload_bytes) else None
        call.digests = recv_values(self.sock, frames, counts, pool, ring)
        if call.prepare is not None:
            call.prepare(reply, frames)
        return reply, frames


def _places(call: Call, reply: Any, sizes: tuple[int, ...]) -> list[Any]:
    """Where each frame of a reply goes: the call's own sink views (the same objects) for a
    found key whose frame count and sizes match its destination, else new buffers."""
    sinks = call.sinks
    found = [k for k, st in enumerate(reply.status) if st == Status.OK]
    if (sinks is None or reply.code is not Code.OK or len(reply.status) != len(sinks)
            or len(reply.counts) != len(found) or sum(reply.counts) != len(sizes)):  # fmt: skip
        return [new_buffer(n) for n in sizes]
    frames: list[Any] = []
    for k, count in zip(found, reply.counts):
        targets, mine = sinks[k], sizes[len(frames) : len(frames) + count]
        if len(targets) == count and all(t.nbytes == n for t, n in zip(targets, mine)):
            frames.extend(targets)
        else:
            frames.extend(new_buffer(n) for n in mine)
    return frames


class BulkLanes:
    """A client's bulk connections: ``streams`` per node that advertises a lane, made on first
    use and moved when the node advertises another port (a restarted node)."""

    def __init__(self, config: ClientConfig, router: Router) -> None:
        self.config, self.router = config, router
        self.on = config.bulk
        self._conns: dict[int, tuple[int, list[_Conn]]] = {}  # node -> (port, connections)
        # node -> (monotonic time until which its lane is not tried, the port that failed)
        self._down: dict[int, tuple[float, int]] = {}
        for name in COUNTERS:
            router.counters.setdefault(name, 0)
        # hashes lane PUTs' values one call ahead of each connection's sends (a client with a
        # copy pool, i.e. a few cores to spare; at most a thread per connection)
        self.hasher: concurrent.futures.ThreadPoolExecutor | None = None
        if config.bulk_puts and config.copy_threads > 1:
            workers = min(config.copy_threads, config.streams * len(router.endpoints))
            self.hasher = concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="pagekv-bulk-hash"
            )

    def hash_ahead(self, call: Call) -> None:
        """Start ``call``'s ``before_send`` (a PUT's checksums) on :attr:`hasher` now; the
        sender's ``request_header`` then waits for it, or runs it itself if it has not started
        (on any transport: a call the lane hands to ZeroMQ too). Called by the one connection
        thread that owns ``call``. The hash only reads the call's payloads and writes its
        request's checksums; one running when its call fails or is abandoned (an aborted
        batch) finishes on its own, a few milliseconds later, and its result goes unused."""
        fill = call.before_send
        if fill is None or self.hasher is None:
            return
        job = self.hasher.submit(fill)

        def ready() -> None:
            if job.cancel():  # not started (or the hasher was shut down): hash here
                fill()
            else:
                job.result()  # started: wait for it (raises what the hash raised)

        call.before_send = ready

    def pool_hashing(self) -> bool:
        """Whether received values are hashed on the copy pool when the native receive is not
        there (:func:`.bulk_wire.recv_values`; with it, the pool is never used): only while the
        client has at most half as many connections as the pool has threads. With more, the
        connections' own threads keep the cores busy and every hand-off costs. Measured on the
        H100 host (scripts/diag_lane.py, 4 GiB GET, 8 copy threads): 1, 2 or 4 connections to
        one node about equal either way (one stream earlier: 2.6 GB/s inline, 3.1 on the pool);
        6 connections (3 nodes x 2) 9.8 / 11.5 GB/s inline against 8.6 / 10.2 on the pool in
        two runs; 8 streams to one node 13.8 inline, 10.6 on the pool."""
        return 2 * sum(len(c) for _, c in self._conns.values()) <= self.config.copy_threads

    def down(self, node: int) -> bool:
        """Whether the node's lane failed to connect lately (at the port it still offers)."""
        until, port = self._down.get(node, (0.0, 0))
        return time.monotonic() < until and port == self.router.bulk_ports[node]

    def mark_down(self, node: int, why: str) -> None:
        """Called from a connection's thread: the lane cannot be reached."""
        if not self.down(node):
            log.warning("pagekv store: bulk lane %s not reachable (%s); using ZeroMQ for %.0f s",
                        self.router.endpoints[node], why, RECHECK_S)  # fmt: skip
        self._down[node] = (time.monotonic() + RECHECK_S, self.router.bulk_ports[node])

    def takes(self, call: Call) -> bool:
        """Whether ``call`` goes over the lane: a GET (and a PUT with ``bulk_puts``) to a node
        offering one."""
        ops = (*_LANE_OPS, Op.PUT) if self.config.bulk_puts else _LANE_OPS
        return (self.on and call.request.op in ops and self.router.bulk_ports[call.node] > 0
                and not self.down(call.node))  # fmt: skip

    def submit(self, node: int, stream: int, call: Call) -> concurrent.futures.Future:
        port = self.router.bulk_ports[node]
        have = self._conns.get(node)
        if have is None or have[0] != port:
            if have is not None:
                for conn in have[1]:
                    conn.close()
            host = self.router.endpoints[node][len("tcp://") :].rsplit(":", 1)[0].strip("[]")
            conns = [_Conn((host, port), self.config, self.router, node, self)
                     for _ in range(self.config.streams)]  # fmt: skip
            have = self._conns[node] = (port, conns)
        return have[1][stream % len(have[1])].submit(call)

    def count(self, call: Call, result: Any) -> None:
        """Count one finished call (on the client's thread)."""
        counters = self.router.counters
        if result is FALLBACK:
            counters["bulk_fallbacks"] += 1
            self.router.limits[call.node] = None  # PING again first: maybe a new bulk port
        elif result is None:
            counters["bulk_failures"] += 1
        else:
            counters["bulk_requests"] += 1
            counters["bulk_bytes_in"] += sum(memoryview(f).nbytes for f in result[1])

    def abort(self, nodes: set[int]) -> None:
        for node in nodes:
            for conn in self._conns.get(node, (0, []))[1]:
                conn.abort()

    def close(self) -> None:
        for _, conns in self._conns.values():
            for conn in conns:
                conn.close()
        self._conns.clear()
        if self.hasher is not None:  # a queued hash is cancelled; its sender would run it
            self.hasher.shutdown(wait=False, cancel_futures=True)
