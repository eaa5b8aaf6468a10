"""A node's bulk lane: GET replies over plain TCP, which clients receive straight into place.

Why (H100 host, 16 cores): with K connections between one client process and one node
process, a thread per connection receiving each frame into its final memory with one
``recv_into(MSG_WAITALL)`` moved 0.69 of the K-stream loopback ceiling for K = 4 and 8, where
the same pattern over ZeroMQ (frames received into libzmq's buffers, then copied into place)
moved 0.57 and 0.38: every frame crossed memory once more, and the bytes of all streams met in
a few threads. The lane is the node's second listener and carries GETs only;
ZeroMQ carries everything else (PUT, PING, EXISTS, LOCATE, STATS, ...).

One thread per connection runs a loop: read a request (:mod:`..wire.lane`: a GET header, no
payload), have the node answer it (:data:`Answer`, the one callable the lane is given: the node
answers under its store lock, with the same dispatch as its ZeroMQ loop), send the reply
(``sendmsg`` straight from the stored frames), and only then mark the send done (a ``--shm``
node frees or reuses the blocks' segment space only after that; see
:meth:`.block_store.BlockStore.sent`). A connection holds at most one
request header and one reply (views of stored blocks; docs/protocol.md, "Node memory").
Connections over ``bulk_connections`` are closed at once. A message with payload frames, over
the limits or not in the lane's framing is answered with an error and its connection closed; any
op but GET gets ``BAD_OP``; a peer that stalls mid-message for ``handshake_s`` is dropped. Never
raises into the node: every failure ends one connection.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagekv.errors import ProtocolError

from ..wire.lane import PeerClosed, read_head, send_message, timeval
from ..wire.protocol import Code, Op, Reply, Request, decode_request, encode_reply

__all__ = ["Answer", "BulkServer", "LaneLimits", "SendDone"]

log = logging.getLogger("pagekv.store")
COUNTERS = ("bulk_connections", "bulk_refused", "bulk_requests", "bulk_bad_messages",
            "bulk_bytes_out", "bulk_dropped")  # fmt: skip


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


@dataclass(frozen=True)
class LaneLimits:
    """What the lane enforces: connections served at once, keys per request, and how long a
    peer may stall mid-message (seconds)."""

    connections: int
    max_keys: int
    stall_s: float


class BulkServer:
    """The bulk listener of one node (``host``: the node's TCP host; ``port`` 0: any free port,
    read back from :attr:`port`), answering GETs with ``answer``. :meth:`start` after the node
    is built, :meth:`close` when it stops (closes the listener and every connection; their
    threads end on their own)."""

    def __init__(self, answer: Answer, limits: LaneLimits, host: str, port: int = 0) -> None:
        self.answer, self.limits = answer, limits
        self.listener = socket.create_server((host, port), backlog=128)
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
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
            while not self._closed and self._one(conn):
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

    def _one(self, conn: socket.socket) -> bool:
        """Read one request and answer it; False when the connection must be closed."""
        try:  # a GET carries no payload: any declared frame is over the limit
            head = read_head(conn, max_frames=0, max_frame_bytes=0, max_payload_bytes=0,
                             idle_ok=True)  # fmt: skip
        except ProtocolError as e:  # over a limit or not our framing: say why, then hang up
            self._count(bulk_bad_messages=1)
            error = f"{e} (the lane takes GET requests only)" if e.code is Code.TOO_LARGE else e
            send_message(conn, encode_reply(Reply(0, code=e.code, error=str(error))), [])
            _linger(conn)
            return False
        if head is None:
            return True  # idle: wait on
        try:
            req: Request | ProtocolError = decode_request(head.header)
        except ProtocolError as e:
            req = e
        if isinstance(req, Request) and req.op is not Op.GET:
            self._count(bulk_bad_messages=1)
            error = f"{req.op.value} over the lane: it takes GET only"
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
