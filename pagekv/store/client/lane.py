"""Client side of the bulk lane (:mod:`.bulk_server`): a client's GET requests to a node that
advertises a lane (PING ``bulk``) go over plain TCP connections, one thread per connection,
when this process has the native library (:mod:`.native`; without it the client uses no lane).

Each connection's thread sends a request and reads the reply's frames straight into the GET's
destinations (``Call.sinks``) when their sizes match, all of a reply's frames in one native
call without the GIL, each 256 KiB hashed right after it arrived (:func:`.bulk_wire.recv_values`).
Then it runs the call's ``prepare`` there (which compares those digests). Up to ``DEPTH``
requests are out on a connection, so the node starts the next reply while this thread checks
the last. The result goes back through a ``concurrent.futures.Future``: ``(reply, frames)``,
``None`` (the node failed this request: no answer in time, a reset, a malformed reply; its keys
move on like any node failure) or :data:`FALLBACK` (the lane cannot be reached at all: the
client sends the call over ZeroMQ instead, and leaves the lane alone for ``RECHECK_S``).

Ownership: a call's ``sinks`` are written by its connection's thread until its future is done;
a client that stops waiting early (cancelled, interrupted) must :meth:`BulkLanes.abort` the
node's connections and wait for the futures before it returns (an aborted connection ends its
calls at once). Not thread-safe apart from the futures: one ``BulkLanes`` per client, used on
the client's thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import queue
import socket
import threading
import time
from typing import Any

from pagekv.errors import NativeCopyUnavailable, ProtocolError

from ..config import ClientConfig
from ..wire import native
from ..wire.lane import (
    ClosedBetweenMessages,
    new_buffer,
    read_head,
    recv_values,
    send_message,
    timeval,
)
from ..wire.protocol import Code, Op, Status, decode_reply
from .routing import FALLBACK_LIMITS, Call, Router, request_header

__all__ = ["COUNTERS", "DEPTH", "FALLBACK", "BulkLanes"]

log = logging.getLogger("pagekv.store")
DEPTH = 2  # requests out on one connection: the next reply streams while the last is checked
RECHECK_S = 30.0  # a lane that could not be reached is left alone this long
FALLBACK: Any = type("Fallback", (), {"__repr__": lambda self: "FALLBACK"})()
COUNTERS = ("bulk_requests", "bulk_bytes_in", "bulk_failures", "bulk_fallbacks")


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
        self.ahead: list[Any] = []  # the closing sentinel, taken early by _fail
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
        is replaced and the request sent once more: the node cannot have answered any of it."""
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
        counts = reply.counts if reply.code is Code.OK else None
        call.digests = recv_values(self.sock, frames, counts)
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
        """Whether ``call`` goes over the lane: a GET to a node offering one, from a process
        that has the native receive."""
        return (self.on and call.request.op is Op.GET and self.router.bulk_ports[call.node] > 0
                and not self.down(call.node) and _native_receive())  # fmt: skip

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


def _native_receive() -> bool:
    """Whether this process has the native receive the lane needs (built or found in the cache
    on first use; never raises: ``PAGEKV_NATIVE_COPY=on`` without it is logged, no lane)."""
    try:
        return native.load() is not None
    except (NativeCopyUnavailable, ValueError) as e:
        _say_no_lane(str(e))
        return False


@functools.cache
def _say_no_lane(why: str) -> None:
    log.warning("pagekv store: this client uses no bulk lane: %s", why)
