"""The lane transport: a client's PUTs and GETs to a node that advertises a bulk lane (PING
``bulk``, :mod:`..node.lane`) over plain TCP connections, ``ClientConfig.streams`` per node, one
thread each, when this process has the native receive (:mod:`..wire.native`). A node's calls
wait in one queue, and each connection takes the next whenever it has room (``DEPTH``).

Each connection's thread sends a request (a PUT's values straight from the caller's buffers:
``sendmsg``, no copy in user space) and reads the reply without the GIL: its head and, when its
frames are exactly the call's destinations (``Call.sinks``), its frames into them, in one native
call (:func:`..wire.lane.read_head`); else, after the head, each frame into its destination when
the sizes match (:func:`..wire.lane.recv_values`). Each 256 KiB is hashed right after it arrived
(large frames through the connection's bounce buffer; by a helper thread while the next ones
arrive, where the client's connections leave cores for it:
:func:`..config.lane_receive_helpers`). The thread then runs the call's ``prepare`` (which
compares those digests). A PUT's checksums are computed on the loop's thread as its call is
handed to the connection (:meth:`LaneTransport.run`), so the next request's values are hashed
while this one is sent. Up to ``DEPTH`` requests are out on a connection, so the node starts the
next while this thread checks the last reply. Each result
goes back to the loop through a ``concurrent.futures.Future``: ``(reply, frames)``; ``None``
when the node failed the request (no answer in time, a reset, a malformed reply: as any node
failure, its keys move on); or :data:`.transport.MOVED` when the lane's port could not be
connected to (the node restarted with its lane elsewhere, or is down: the client PINGs it,
which tells).

A kept connection the node closed (a send that fails, or a reply that never starts) is
replaced and the requests out on it whose replies were not read are sent once more with the
one being sent (the node restarted: it has none of them; PUTs and GETs may be repeated: a
value stored once is ``EXISTS`` the second time). A connection that
:meth:`_Conn.abort` shut down is never taken for one the node closed: the calls on it of a
run that ended early (``_NodeLane.abandoned``) or of a closed lane end, and the others (of
operations still waiting) are sent again on a new connection, as often as aborts land (an
abort is not the node's failure).

Ownership: a call's ``payloads`` are read and its ``sinks`` written by its connection's thread
until its future is done; :meth:`LaneTransport.run` returning early (cancelled, or a callback
raised) cancels its calls not yet taken up, marks the others abandoned, shuts down the
connections of the lanes they went to (:meth:`_NodeLane.abort`) and waits for their futures.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import socket
import threading
import time
from typing import Any

from pagekv.errors import ProtocolError

from ..config import ClientConfig, lane_receive_helpers
from ..wire import native
from ..wire.lane import (
    HEAD_BYTES,
    ClosedBetweenMessages,
    new_buffer,
    read_head,
    recv_values,
    send_message,
    size_socket_buffers,
    timeval,
)
from ..wire.protocol import Code, Op, Status, decode_reply
from .routing import FALLBACK_LIMITS, Call, Limits, Results, Router, ready, request_header
from .transport import MOVED, Transport

__all__ = ["COUNTERS", "DEPTH", "LaneTransport"]

log = logging.getLogger("pagekv.store")
DEPTH = 2  # requests out on one connection: the next reply streams while the last is checked
_STALLED = object()  # a send the node did not take in time (its socket's send timeout)
_STALE = object()  # a kept connection the node closed, found by a send behind others out on it
_ABORTED = object()  # a send that abort() cut short or forestalled
CLOSE_WAIT_S = 5.0  # close() waits this long for the connections' threads
COUNTERS = ("bulk_requests", "bulk_bytes_in", "bulk_bytes_out", "bulk_failures")


class _Conn:
    """One connection of a client to a node's bulk lane and the thread that works it: the
    thread takes the node's next call from its lane's queue (shared by the node's
    connections) whenever fewer than ``DEPTH`` of its own are out, so a connection that runs faster
    carries more and every connection ends within about a call of the others."""

    def __init__(self, address: tuple[str, int], config: ClientConfig, router: Router,
                 node: int, lib: native.NativeCopy, bounce_slots: int,
                 lane: _NodeLane) -> None:  # fmt: skip
        self.address, self.config, self.router, self.node = address, config, router, node
        self.limits = router.limits[node] or FALLBACK_LIMITS  # see _limits
        self.lib = lib  # the native receive
        self.lane = lane  # whether it was closed, and what a call taken after that gets
        self.queue = lane.work  # (call, future) items and closing sentinels (None), one each
        self.sock: socket.socket | None = None
        # abort() counts up (client's thread); the connection's thread compares before each
        # send: a socket shut down while this thread was idle is replaced, not sent on
        self.aborts = self.aborts_seen = 0
        # abort()'s count and shutdown, their consuming (_aborted) and the socket's swaps
        # (_connect, _drop) never interleave: an abort shuts down the socket it was counted
        # for, never a new one made after its count was consumed
        self._abort_lock = threading.Lock()
        # the receive's bounce buffer (see recv_values): this connection's thread's alone;
        # RECV_SLOTS chunks give its receives a helper thread, one chunk none
        self.bounce = bytearray(native.BLOCK_BYTES * bounce_slots)
        self.head = bytearray(HEAD_BYTES)  # each reply's head lands here (read_head)
        self.thread = threading.Thread(target=self._run, name="pagekv-bulk-client", daemon=True)
        self.thread.start()

    def abort(self) -> None:
        """Shut this connection down now: the calls on it of runs that ended early end (None),
        the others go again on a new connection (:meth:`_end_aborted`); the next call
        reconnects (also when the connection was idle)."""
        with self._abort_lock:
            self.aborts += 1
            if self.sock is not None:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in recv/send
                except OSError:
                    pass  # not connected (any more): nothing to wake

    def join(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for this connection's thread to end after :meth:`close`:
        from then on nothing reads or writes a call's buffers, and no thread of the client is
        left running when its process exits."""
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    # ---- the connection's thread -----------------------------------------------------------
    def _run(self) -> None:
        out: collections.deque = collections.deque()  # (call, future): requests sent
        closing = False
        resent: set[int] = set()  # requests sent again after their connection went stale
        while out or not closing:
            # after an abort, the requests out on the shut-down socket end first: a request
            # sent on a new socket meanwhile would have its reply read as theirs
            while len(out) < DEPTH and not closing and not (out and self._abort_pending()):
                try:
                    item = self.queue.get(block=not out)
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                call, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                if self.lane.closed:  # the client closed, or the node's lane moved: not sent
                    fut.set_result(self.lane.left)
                    continue
                outcome = self._send(call, idle=not out)
                if outcome is _ABORTED:
                    self._end_aborted([*out, (call, fut)], out)
                    continue
                if outcome is _STALE:  # none of what is out on it was answered: sent again
                    ids = {c.request.id for c, _ in out} | {call.request.id}
                    again = resent.isdisjoint(ids)
                    resent.update(ids)
                    self._resend([*out, (call, fut)], out, again)
                    continue
                if outcome is not True:
                    fut.set_result(None if outcome is _STALLED else outcome)
                    self._fail(out, queued=outcome is _STALLED)
                    continue
                out.append((call, fut))
            if not out:
                continue
            call, fut = out.popleft()
            try:
                result = self._receive(call)
            except ClosedBetweenMessages:
                if self._aborted():  # shut down by abort(), not by the node
                    self._end_aborted([(call, fut), *out], out)
                    continue
                # nothing of the reply came: the node may have restarted and never read the
                # request. PUTs and GETs may be repeated: send them again on a new connection
                # (once; twice stale, e.g. a node at its connection cap, is a node failure)
                again = resent.isdisjoint({call.request.id})
                resent.add(call.request.id)
                self._resend([(call, fut), *out], out, again)
                continue
            except (OSError, ProtocolError) as e:
                if self._aborted():  # cut short by abort(), not by the node
                    self._end_aborted([(call, fut), *out], out)
                    continue
                log.debug("pagekv store: bulk lane to %s failed: %s", self.address, e)
                self._fail(out, queued=isinstance(e, TimeoutError))
                result = None
            except Exception:  # a bug: this call fails like a node failure, the lane goes on
                log.exception("pagekv store: bulk lane reply could not be handled")
                self._fail(out)
                result = None
            if self.sock is None:  # dropped while answering: the rest sent on it are lost
                self._fail(out)
            fut.set_result(result)
        self._drop()

    def _end_aborted(self, calls: list, out: collections.deque) -> None:
        """:meth:`abort` shut this connection down under ``calls`` (those sent on it, in
        order, and the one about to be): those of operations still waiting go again on a new
        connection (an abort for another operation is not the node's failure, and does not
        use up a call's one sending again after a stale connection), the rest end."""
        self._resend(self._still_wanted(calls), out, again=True)

    def _still_wanted(self, calls: list) -> list:
        """End the calls of a run that ended early (the lane's ``abandoned``), or all of them
        when the lane is closed (None each); return the others, in order."""
        keep = []
        for call, fut in calls:
            if self.lane.closed or call.request.id in self.lane.abandoned:
                fut.set_result(None)
            else:
                keep.append((call, fut))
        return keep

    def _resend(self, calls: list, out: collections.deque, again: bool) -> None:
        """Send ``calls`` (their connection went stale or was aborted) on a new connection
        (``again``; else they fail). A send that fails ends the new connection as in
        :meth:`_run`: that call, those sent before it and those after it end (MOVED each when no
        new connection could be made, else None; one that stalled also fails the node's
        waiting calls): nothing is sent behind a message the node got only part of. An abort
        that lands meanwhile sorts those sent and those still to send again
        (:meth:`_still_wanted`) and starts over."""
        self._drop()
        out.clear()
        for i, (call, fut) in enumerate(calls):
            outcome = self._send(call) if again else None
            if outcome is True:
                out.append((call, fut))
                continue
            if outcome is _ABORTED:  # sort those sent and those left anew, and start over
                self._resend(self._still_wanted([*out, *calls[i:]]), out, again)
                return
            left = outcome if outcome is MOVED else None
            for _, unsent in calls[i:]:
                unsent.set_result(left)
            self._fail(out, queued=outcome is _STALLED)
            return

    def _fail(self, out: collections.deque, queued: bool = False) -> None:
        """The connection is unusable: drop it and fail the calls whose requests went out and,
        with ``queued`` (the node did not answer in time), every call of the node's waiting
        to be sent: each would otherwise wait one more timeout on a connection to the same
        node (a lane that fails is a node failure: the keys move on). Any other failure (a
        reset, a bad reply) leaves the waiting calls to the node's connections."""
        self._drop()
        while out:
            out.popleft()[1].set_result(None)
        while queued:
            try:
                item = self.queue.get(block=False)
            except queue.Empty:
                return
            if item is None:  # closing: a sentinel is taken by a thread's loop, one each
                self.queue.put(None)
                return
            if item[1].set_running_or_notify_cancel():
                item[1].set_result(None)

    def _limits(self) -> Limits:
        """The node's limits: the router's, or while the loop has forgotten them (it PINGs
        the node again before its next call) the last ones it had, never the fallback."""
        limits = self.router.limits[self.node]
        if limits is not None:
            self.limits = limits
        return self.limits

    def _abort_pending(self) -> bool:
        """Whether :meth:`abort` shut the socket down since :meth:`_aborted` last looked."""
        return self.aborts != self.aborts_seen

    def _aborted(self) -> bool:
        """Whether :meth:`abort` shut the socket down since this was last asked (a closed
        connection is then ours, not the node's: :meth:`_end_aborted` sorts its calls)."""
        with self._abort_lock:
            if self.aborts == self.aborts_seen:
                return False
            self.aborts_seen = self.aborts
            return True

    def _drop(self) -> None:
        with self._abort_lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def _connect(self) -> bool:
        cfg = self.config
        try:
            sock = socket.create_connection(self.address, timeout=cfg.connect_timeout_s)
        except OSError as e:
            log.debug("pagekv store: bulk lane %s:%s: %s", *self.address, e)
            return False
        sock.settimeout(None)  # blocking: MSG_WAITALL waits for whole frames
        limits = self._limits()
        wait = timeval(cfg.timeout_for(limits.max_message_size))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, wait)
        size_socket_buffers(sock, cfg.socket_buffer, replies_out=False)
        with self._abort_lock:
            self.sock = sock
        return True

    def _send(self, call: Call, idle: bool = False) -> Any:
        """Send ``call``'s request: True, else its result (None: the node failed it; MOVED: no
        connection could be made to the lane's port; ``_STALLED``: the node did not take it
        in time; ``_STALE``: a kept connection the node closed, with requests out on it).
        ``idle``: no request is out on this connection. A kept connection that turns out to
        be closed or reset by the node while idle (it restarted, or dropped the connection)
        is replaced and the request sent once more: the node cannot have answered any of
        it."""
        if self._aborted():  # shut down by abort(): never sent on (the caller sorts the calls)
            self._drop()
            return _ABORTED
        kept = self.sock is not None
        if not kept and not self._connect():
            return MOVED
        if not kept and self._aborted():  # ended while the connection was being made
            self._drop()
            return _ABORTED
        header = request_header(call)
        try:
            send_message(self.sock, header, call.payloads)
        except ConnectionError as e:
            if self._aborted():
                return _ABORTED
            if not kept:
                log.debug("pagekv store: bulk send to %s failed: %s", self.address, e)
                return None
            if not idle:  # requests are out on it: they go again with this one (the caller)
                return _STALE
            self._drop()  # stale: a new connection (or MOVED when the lane moved or went)
            return self._send(call)
        except OSError as e:
            log.debug("pagekv store: bulk send to %s failed: %s", self.address, e)
            return _STALLED if isinstance(e, TimeoutError) else None  # the wire's timeouts
        return True

    def _receive(self, call: Call) -> tuple[Any, list[Any]]:
        """Read ``call``'s reply, its frames into the call's sinks where they fit, and run its
        ``prepare``. Raises ``ProtocolError`` for a reply to another request or over the
        node's limits (the connection is then dropped), ``OSError`` for the rest."""
        limits = self._limits()
        timeout = self.config.timeout_for(call.nbytes)  # as the ZeroMQ path's deadline
        deadline_ns = time.monotonic_ns() + int(timeout * 1e9)  # the whole reply's
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(timeout))
        # where the reply's frames go when every key is found as expected: they are received
        # there in the call that reads the head (no hand-over of the GIL in between)
        sinks = [view for views in call.sinks for view in views] if call.sinks else []
        head = read_head(self.sock, self.lib, self.head,
                         max_frames=max(1, len(call.request.keys)) * limits.max_frames,
                         max_frame_bytes=limits.max_message_size,
                         max_payload_bytes=limits.max_message_size, into=sinks,
                         counts=[len(views) for views in call.sinks] if sinks else None,
                         bounce=self.bounce, deadline_ns=deadline_ns)  # fmt: skip
        reply = decode_reply(head.header)
        if reply.id != call.request.id:
            if reply.id == 0 and reply.code is not Code.OK and not head.sizes:
                self._drop()  # the node refused the message and hung up: its answer stands
                return reply, []
            raise ProtocolError(Code.BAD_HEADER, f"reply {reply.id} to request {call.request.id}")
        frames = _places(call, reply, head.sizes)
        if head.landed:  # frame i is in sinks[i]; the digests are per key of the sinks
            if all(f is s for f, s in zip(frames, sinks)):
                call.digests = head.digests  # every key found, each frame in its own sink
            else:  # placed otherwise by the header (rare): each key's frames are taken from
                # copies of where they landed, made before any is copied into its place
                frames, call.digests = [bytearray(s) for s in sinks], None
        else:
            counts = reply.counts if reply.code is Code.OK else None
            call.digests = recv_values(self.sock, frames, counts, self.lib, self.bounce,
                                       deadline_ns)  # fmt: skip
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


@dataclasses.dataclass(eq=False)
class _NodeLane:
    """A node's lane as a client uses it: its port, the calls waiting for a connection, and
    the connections (with their threads) that take them."""

    port: int
    work: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    conns: list[_Conn] = dataclasses.field(default_factory=list)
    closed: bool = False
    left: Any = None  # what a call taken after close() gets: None, or MOVED (the lane moved)
    # requests out whose run ended early (cancelled, or a callback raised): an abort ends
    # them; the other requests on an aborted connection are sent again
    abandoned: set[int] = dataclasses.field(default_factory=set)

    def close(self, left: Any = None) -> None:
        """End every connection: the calls out and waiting end (``left``; those out: None),
        then each thread (one sentinel each)."""
        self.left, self.closed = left, True
        for _ in self.conns:
            self.work.put(None)
        self.abort()

    def abort(self) -> None:
        """Shut every connection down now (:meth:`_Conn.abort`)."""
        for conn in self.conns:
            conn.abort()


class LaneTransport(Transport):
    """A client's bulk lane connections: ``streams`` per node whose lane it took
    (:meth:`take`), made on first use and replaced when the node advertises another port."""

    name = "lane"

    def __init__(self, config: ClientConfig, router: Router) -> None:
        self.config, self.router = config, router
        self._lib: native.NativeCopy | None = None  # the native receive, loaded by take()
        self._ports: dict[int, int] = {}  # node -> its lane's port, for the nodes taken
        self._lanes: dict[int, _NodeLane] = {}  # node -> its lane in use
        self._closed = False  # by close(): no lane is made again
        for name in COUNTERS:
            router.counters.setdefault(name, 0)

    def take(self, node: int, port: int) -> str | None:
        """Carry ``node``'s PUTs and GETs over its lane at ``port`` (its PING ``bulk``): ""
        when taken, else why not (None: the node offers no lane)."""
        self._ports.pop(node, None)
        if not port:
            return None
        if not self.config.endpoints[node].startswith("tcp://"):
            return "not a tcp:// node"
        self._lib, why = _native_receive()
        if self._lib is None:
            return why
        self._ports[node] = port
        return ""

    def carries(self, node: int) -> bool:
        """Whether ``node``'s lane was taken (its PUTs go over it)."""
        return node in self._ports

    async def run(self, calls: list[Call]) -> Results:
        """Send each call on one of its node's connections (the first free one takes it) and
        hand each result on as it comes: one loop callback per call, no task per call (what a
        prefetch of thousands of pages spent its loop's time on). A PUT's checksums are
        computed here, on the loop, as its call is handed on, and the loop runs its other work
        before the next PUT's."""
        loop = asyncio.get_running_loop()
        results: Results = {}
        if not calls:
            return results
        ended = loop.create_future()
        left = len(calls)

        def take(call: Call, fut: concurrent.futures.Future) -> None:
            nonlocal left
            if ended.done():
                return  # the run ended (an error, or the caller was cancelled)
            try:
                result = None if fut.cancelled() else fut.result()
                self._count(call, result)
                results[call.request.id] = result
                if result is not None and result is not MOVED and call.on_reply is not None:
                    call.on_reply(*result)
            except Exception as e:  # e.g. the caller's on_arrival raised: get_many raises it
                ended.set_exception(e)
                return
            left -= 1
            if not left:
                ended.set_result(None)

        def done(fut: concurrent.futures.Future, call: Call) -> None:  # a connection's thread
            try:
                loop.call_soon_threadsafe(take, call, fut)
            except RuntimeError:  # the loop closed: the run ended, nothing to hand on
                return

        futures: list[concurrent.futures.Future] = []
        placed: list[tuple[Call, _NodeLane | None]] = []  # each call and the lane it went to
        try:
            for call in calls:
                hashed = call.before_send is not None
                ready(call)  # a PUT's checksums: the calls handed on before it are being sent
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.add_done_callback(functools.partial(done, call=call))
                futures.append(fut)
                if self._closed:  # closed meanwhile (another task, while this one yielded)
                    fut.set_running_or_notify_cancel()
                    fut.set_result(None)
                    placed.append((call, None))
                else:
                    lane = self._lane_for(call.node)
                    placed.append((call, lane))
                    lane.work.put((call, fut))
                if hashed:  # the loop's other work runs between one request's hashing and the next
                    await asyncio.sleep(0)
            await ended
        finally:
            running = {fut for fut in futures if not fut.done() and not fut.cancel()}
            if running:  # sent, or being sent (those not yet taken up were cancelled)
                # marked before the abort: a connection that sees the abort sees them too
                mine = [(c, lane) for (c, lane), f in zip(placed, futures) if f in running]
                for call, lane in mine:
                    lane.abandoned.add(call.request.id)
                for lane in {lane for _, lane in mine}:
                    lane.abort()
                concurrent.futures.wait(running)
                for call, lane in mine:
                    lane.abandoned.discard(call.request.id)
        return results

    def _lane_for(self, node: int) -> _NodeLane:
        """The node's lane in use (made, or remade for a new port, here)."""
        port = self._ports[node]
        lane = self._lanes.get(node)
        if lane is None or lane.port != port:
            if lane is not None:
                lane.close(MOVED)  # its calls are run again on what the node's PING tells
            host = self.config.endpoints[node][len("tcp://") :].rsplit(":", 1)[0].strip("[]")
            connections = self.config.streams * len(self.config.endpoints)
            slots = native.RECV_SLOTS if lane_receive_helpers(connections) else 1
            lane = self._lanes[node] = _NodeLane(port)
            lane.conns = [_Conn((host, port), self.config, self.router, node, self._lib, slots,
                                lane) for _ in range(self.config.streams)]  # fmt: skip
        return lane

    def _count(self, call: Call, result: Any) -> None:
        counters = self.router.counters
        if result is None or result is MOVED:
            counters["bulk_failures"] += 1
        else:
            counters["bulk_requests"] += 1
            counters["bulk_bytes_in"] += sum(memoryview(f).nbytes for f in result[1])
            counters["bulk_bytes_out"] += call.nbytes if call.request.op is Op.PUT else 0

    def abort(self, nodes: set[int]) -> None:
        """Shut ``nodes``' connections down now (:meth:`_Conn.abort`)."""
        for node in nodes:
            lane = self._lanes.get(node)
            if lane is not None:
                lane.abort()

    def close(self) -> None:
        """Close every connection and wait for their threads (each ends at once: its socket is
        shut down), at most ``CLOSE_WAIT_S`` in all."""
        self._closed = True
        lanes = list(self._lanes.values())
        self._lanes.clear()
        for lane in lanes:
            lane.close()
        conns = [conn for lane in lanes for conn in lane.conns]
        deadline = time.monotonic() + CLOSE_WAIT_S
        for conn in conns:
            conn.join(max(0.0, deadline - time.monotonic()))
        if any(conn.thread.is_alive() for conn in conns):
            log.warning("pagekv store: bulk lane threads still running %.0f s after close",
                        CLOSE_WAIT_S)  # fmt: skip


def _native_receive() -> tuple[native.NativeCopy | None, str]:
    """The native receive the lane needs (built or found in the cache on first use), or None
    and why not (said once)."""
    lib, why = native.load_or_reason()
    if lib is not None:
        return lib, ""
    _say_no_lane(why)
    return None, f"no native receive: {why.splitlines()[0]}"


@functools.cache
def _say_no_lane(why: str) -> None:
    log.warning("pagekv store: this client uses no bulk lane: %s", why)
