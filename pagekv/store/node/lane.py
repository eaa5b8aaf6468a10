"""A node's bulk lane: PUT and GET payloads over plain TCP, received straight into place.

Why (H100 host, 16 cores): with K connections between one client process and one node
process, a thread per connection receiving each frame into its final memory with one
``recv_into(MSG_WAITALL)`` moved 0.69 of the K-stream loopback ceiling for K = 4 and 8, where
the same pattern over ZeroMQ (frames received into libzmq's buffers, then copied into place)
moved 0.57 and 0.38: every frame crossed memory once more, and the bytes of all streams met in
a few threads. PUTs: ZeroMQ's I/O thread writes each frame into new, uncached memory; the
lane's native receive lands each 256 KiB in a cached bounce and streams it into the new block
(a helper thread doing that while the next chunk arrives, where the cores allow): a client's
PUTs moved 1.04-1.15x (1 stream) and 1.11-1.16x (2 to 8 streams) what the same PUTs moved over
ZeroMQ (one node, pairs taking turns, two H100 machines; docs/benchmarks.md). The lane is the
node's second listener and carries PUT and GET only;
ZeroMQ carries everything else (PING, EXISTS, DELETE, LOCATE, STATS, ...). The node offers
a lane only with the native library (:mod:`..wire.native`), which its receive needs.

One thread per connection runs a loop: read a message's head (:mod:`..wire.lane`), then

* a GET (no payload): have the node answer it (:data:`Answer`: under the node's store lock,
  with the same dispatch as its ZeroMQ loop), send the reply (``sendmsg`` straight from the
  stored frames), and only then mark the send done (a ``--shm`` node frees or reuses the
  blocks' space only after that; see :meth:`.block_store.BlockStore.sent`);
* a PUT whose header declares exactly the frames that follow: hand the node the request and
  this connection's receive (:data:`StorePut`): the node keeps room for the bytes on their way
  in, the receive puts each frame into a new buffer of its own (hashed as it lands when the
  node verifies PUTs), and the node stores those buffers as the blocks, checked against the
  request's checksums; then send the reply.

A connection holds at most one request (its payload: ``max_message_size``) and one reply (views
of stored blocks; docs/protocol.md, "Node memory"). Connections over ``bulk_connections`` are
closed at once. A message over the limits or not in the lane's framing, payload frames with
anything but such a PUT, or a receive that fails mid-payload is answered with an error (when
the connection still carries one) and the connection closed: nothing of it is stored. Any op
but PUT and GET gets ``BAD_OP``; a peer that stalls mid-message for ``handshake_s`` is dropped.
Never raises into the node: every failure ends one connection.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagekv.errors import ProtocolError

from ..config import lane_receive_helpers
from ..wire import native
from ..wire.lane import (
    HEAD_BYTES,
    Head,
    PeerClosed,
    new_buffer,
    read_head,
    recv_values,
    send_message,
    size_socket_buffers,
    timeval,
)
from ..wire.protocol import Code, Op, Reply, Request, decode_request, encode_reply

__all__ = ["Answer", "BulkServer", "LaneLimits", "Receive", "SendDone", "StorePut"]

log = logging.getLogger("pagekv.store")
COUNTERS = ("bulk_connections", "bulk_refused", "bulk_requests", "bulk_puts", "bulk_bad_messages",
            "bulk_bytes_in", "bulk_bytes_out", "bulk_dropped")  # fmt: skip


class SendDone:
    """A reply's send, as :meth:`.block_store.BlockStore.sent` tracks it: ``done`` is set once
    the kernel holds every byte (``sendmsg`` returned) or the send failed."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


# The node's answer to one GET (called on a connection's thread, any number at once): the reply,
# its payload frames (views of stored blocks, valid while referenced) and, when they are views
# of the node's segment, the tracker whose ``done`` the lane sets once they are sent. It never
# raises on input (a bad request is an error reply).
Answer = Callable[[Request], "tuple[Reply, list[Any], SendDone | None]"]

# A PUT's payload, received by the lane when the node calls it: ``receive(hashed)`` returns the
# frames (new buffers, the request's sizes in order, each the node's to keep as a block) and,
# with ``hashed``, the xxh3-64 of each value as it landed (else None). It raises ``OSError`` or
# ``PeerClosed`` when the connection fails mid-payload (nothing of it may be stored then).
Receive = Callable[[bool], "tuple[list[Any], list[int] | None]"]

# The node's answer to one PUT whose header declares the frames that follow (called on a
# connection's thread, any number at once): keeps room for the payload, calls ``receive`` once,
# outside its store lock, and stores what it got; returns the reply. Raises only what
# ``receive`` raised.
StorePut = Callable[[Request, Receive], Reply]


@dataclass(frozen=True)
class LaneLimits:
    """What the lane enforces: connections served at once, keys per request, how long a peer
    may stall mid-message (seconds), and a PUT's frames, bytes per frame and payload bytes;
    ``socket_buffer``: each connection's SO_SNDBUF/SO_RCVBUF (0: a same-host connection's send
    buffer ``SAME_HOST_SOCKET_BUFFER``, the rest the kernel's autotuning; see
    :func:`size_socket_buffers`)."""

    connections: int
    max_keys: int
    stall_s: float
    max_frames: int
    max_frame_bytes: int
    max_payload_bytes: int
    socket_buffer: int = 0


class BulkServer:
    """The bulk listener of one node (``host``: the node's TCP host; ``port`` 0: any free port,
    read back from :attr:`port`), answering GETs with ``answer`` and PUTs with ``store``,
    receiving with ``lib`` (the native receive). :meth:`start` after the node is built,
    :meth:`close` when it stops (closes the listener and every connection; their threads end
    on their own)."""

    def __init__(self, answer: Answer, store: StorePut, lib: native.NativeCopy,
                 limits: LaneLimits, host: str, port: int = 0) -> None:  # fmt: skip
        self.answer, self.store, self.lib, self.limits = answer, store, lib, limits
        self.listener = socket.create_server((host, port), backlog=128)
        if limits.socket_buffer:  # accepted connections take the listener's buffers
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                self.listener.setsockopt(socket.SOL_SOCKET, option, limits.socket_buffer)
        self.port: int = self.listener.getsockname()[1]
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="pagekv-bulk-accept",
                                          daemon=True)  # fmt: skip

    def start(self) -> None:
        if not self._acceptor.is_alive() and not self._closed:
            self._acceptor.start()

    def close(self) -> None:
        self._closed = True
        for sock in (self.listener, *self._connections()):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv
            except OSError:
                pass  # not connected (any more): nothing to wake
        self.listener.close()

    def _connections(self) -> list[socket.socket]:
        with self._conns_lock:
            return list(self._conns)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # ---- connections -----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # EMFILE and the like: the listener stays; try again shortly
                continue
            with self._conns_lock:
                full = len(self._conns) >= self.limits.connections or self._closed
                if not full:
                    self._conns.add(conn)
            if full:
                self.counters["bulk_refused"] += 1
                conn.close()
                continue
            self.counters["bulk_connections"] += 1
            threading.Thread(target=self._serve, args=(conn,), name="pagekv-bulk",
                             daemon=True).start()  # fmt: skip

    def _serve(self, conn: socket.socket) -> None:
        stall = timeval(self.limits.stall_s)
        bounce: list[Any] = []  # this connection's receive bounce, made for its first PUT
        head = bytearray(HEAD_BYTES)  # each request's head lands here (read_head)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
            size_socket_buffers(conn, self.limits.socket_buffer, replies_out=True)
            while not self._closed and self._one(conn, head, bounce):
                pass
        except (PeerClosed, OSError):
            pass  # the client went, stalled, or the node is stopping: this connection ends
        except Exception:  # a bug: log it; the node and its other connections go on
            log.exception("pagekv node: bulk connection failed")
            self._count(bulk_dropped=1)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _one(self, conn: socket.socket, buffer: bytearray, bounce: list[Any]) -> bool:
        """Read one request and answer it; False when the connection must be closed."""
        lim = self.limits
        try:
            head = read_head(conn, self.lib, buffer, max_frames=lim.max_frames,
                             max_frame_bytes=lim.max_frame_bytes,
                             max_payload_bytes=lim.max_payload_bytes, idle_ok=True)  # fmt: skip
        except ProtocolError as e:  # over a limit or not our framing: say why, then hang up
            return self._refuse(conn, Reply(0, code=e.code, error=str(e)))
        if head is None:
            return True  # idle: wait on
        try:
            req: Request | ProtocolError = decode_request(head.header)
        except ProtocolError as e:
            req = e
        if isinstance(req, Request) and req.op is Op.PUT:
            problem = _put_problem(req, head, lim.max_keys)
            if problem is not None:  # its frames cannot be taken as its values: not read
                return self._refuse(conn, Reply(req.id, code=problem.code, error=str(problem)))
            receive = functools.partial(self._receive, conn, head, req, bounce)
            rep, out, done = self.store(req, receive), [], None
            self._count(bulk_puts=1, bulk_bytes_in=head.payload_bytes)
        elif head.sizes:  # payload with anything but a PUT: not read, the stream is lost
            rid, code = (req.id, Code.BAD_FRAMES) if isinstance(req, Request) else (0, req.code)
            return self._refuse(conn, Reply(rid, code=code, error="payload frames with no PUT "
                                            "request declaring them"))  # fmt: skip
        elif isinstance(req, Request) and req.op is not Op.GET:
            self._count(bulk_bad_messages=1)
            error = f"{req.op.value} over the lane: it takes PUT and GET only"
            rep, out, done = Reply(req.id, code=Code.BAD_OP, error=error), [], None
        else:
            rep, out, done = self._answer(req)
        try:
            sent = send_message(conn, encode_reply(rep), out)
        finally:
            if done is not None:
                done.done = True  # the blocks' space may be reused from now on
        self._count(bulk_requests=1, bulk_bytes_out=sent)
        return True

    def _refuse(self, conn: socket.socket, reply: Reply) -> bool:
        """Answer a message that cannot be read on with ``reply``, then hang up: False."""
        self._count(bulk_bad_messages=1)
        send_message(conn, encode_reply(reply), [])
        _linger(conn)
        return False

    def _receive(self, conn: socket.socket, head: Head, req: Request, bounce: list[Any],
                 hashed: bool) -> tuple[list[Any], list[int] | None]:  # fmt: skip
        """A PUT's frames (:data:`Receive`): each into a new buffer, by the native receive
        through this connection's bounce (with a helper thread where the node's open
        connections leave cores for it)."""
        frames = [new_buffer(size) for size in head.sizes]
        if not bounce:
            bounce.append(bytearray(native.BLOCK_BYTES * native.RECV_SLOTS))
        ring = bounce[0] if lane_receive_helpers(self.open_connections) else (
            memoryview(bounce[0])[: native.BLOCK_BYTES])  # fmt: skip
        return frames, recv_values(conn, frames, req.counts if hashed else None, self.lib, ring)

    def _count(self, **amounts: int) -> None:
        with self._conns_lock:  # several connection threads count: += is not atomic
            for name, n in amounts.items():
                self.counters[name] += n

    def _answer(self, req: Request | ProtocolError) -> tuple[Reply, list[Any], SendDone | None]:
        """The reply to a GET (or to a request that could not be read), by the node."""
        if isinstance(req, Request) and len(req.keys) > self.limits.max_keys:
            req = ProtocolError(Code.TOO_LARGE, f"{len(req.keys)} keys is over the limit")
        if isinstance(req, ProtocolError):
            self._count(bulk_bad_messages=1)
            return Reply(0, code=req.code, error=str(req)), [], None
        return self.answer(req)


def _put_problem(req: Request, head: Head, max_keys: int) -> ProtocolError | None:
    """Why a PUT's declared frames cannot be received as its values (None: they can; its
    counts and checksums match its keys, as :func:`..wire.protocol.decode_request` checked)."""
    if len(req.keys) > max_keys:
        return ProtocolError(Code.TOO_LARGE, f"{len(req.keys)} keys is over the limit")
    if tuple(req.sizes) != head.sizes:
        return ProtocolError(Code.BAD_FRAMES, f"the header declares {len(req.sizes)} frames of "
                             f"{sum(req.sizes)} bytes, the message {len(head.sizes)} of "
                             f"{head.payload_bytes}")  # fmt: skip
    return None


LINGER_BYTES = 64 << 20  # what a refused sender may still have in flight, read and dropped


def _linger(conn: socket.socket) -> None:
    """Before closing a connection whose sender is still sending (a refused message): end our
    side and drop what arrives until the peer closes, ``LINGER_BYTES`` or the connection's
    receive timeout. Closed with unread bytes, the kernel would reset the connection, and the
    peer might lose the error reply that says why."""
    try:
        conn.shutdown(socket.SHUT_WR)
        dropped = 0
        while dropped < LINGER_BYTES:
            got = len(conn.recv(1 << 20))
            if not got:
                return
            dropped += got
    except OSError:
        return  # reset, timed out or gone: nothing more to wait for
