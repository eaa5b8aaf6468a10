"""A node's bulk lane: PUT and GET payloads over plain TCP, read straight into place.

Measured on the lent H100 host (16 cores, 2026-11-25): with K connections between one client
process and one node process, a thread per connection receiving each frame into its final
memory with one ``recv_into(MSG_WAITALL)`` moved 0.69 of the K-stream loopback ceiling for
K = 4 and 8, where the same pattern over ZeroMQ (frames received into libzmq's buffers, then
copied into place) moved 0.57 and 0.38: every frame crossed memory once more, and the bytes of
all streams met in a few threads. The lane is the node's second listener; ZeroMQ stays the
control path (PING, EXISTS, LOCATE, STATS, ...) and every client's fallback.

One thread per connection runs a loop: read a message (:mod:`.bulk_wire`; each payload frame
into its own new buffer, which becomes the stored block), answer it with the node's store under
:attr:`StoreNode.lock` (the same dispatch as the ZeroMQ loop's), send the reply outside the
lock (``sendmsg`` straight from the stored frames), and only then release the reply's blocks
(a ``--shm`` node frees or reuses their segment space only after that; see
:meth:`.block_store.BlockStore.sent`). A connection holds at most one request and one reply:
``max_message_size`` plus header bytes in, views of stored blocks out (docs/protocol.md,
"Node memory"). Connections over ``bulk_connections`` are closed at once. A message that breaks
the limits is answered with an error and its connection closed; a peer that stalls mid-message
for ``handshake_s`` is dropped. Never raises into the node: every failure ends one connection.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from pagekv.errors import ProtocolError

from .bulk_wire import (
    PeerClosed,
    load_native,
    new_buffer,
    new_ring,
    read_head,
    recv_values,
    send_message,
    stages,
    timeval,
)
from .handlers import SHARED_BUFFER_BYTES
from .protocol import Code, Op, Reply, Request, decode_request, encode_reply

if TYPE_CHECKING:
    from .server import StoreNode

__all__ = ["BulkServer", "SendDone"]

log = logging.getLogger("pagekv.store")
COUNTERS = ("bulk_connections", "bulk_refused", "bulk_requests", "bulk_bad_messages",
            "bulk_bytes_in", "bulk_bytes_out", "bulk_dropped", "bulk_staged")  # fmt: skip


class SendDone:
    """A reply's send, as :meth:`.block_store.BlockStore.sent` tracks it: ``done`` is set once
    the kernel holds every byte (``sendmsg`` returned) or the send failed."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class BulkServer:
    """The bulk listener of one node (``host``: the node's TCP host; ``port`` 0: any free port,
    read back from :attr:`port`). :meth:`start` after the node is built, :meth:`close` when it
    stops (closes the listener and every connection; their threads end on their own)."""

    def __init__(self, node: StoreNode, host: str, port: int = 0) -> None:
        self.node = node
        self.config = node.config
        self.listener = socket.create_server((host, port), backlog=128)
        self.port: int = self.listener.getsockname()[1]
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._closed = False
        # lane PUTs received through a ring at once (each keeps a helper core busy); the rest
        # are received in place
        self._staging = threading.BoundedSemaphore(max(1, self.config.staged_receives))
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
        load_native()  # before the first connection is served (it waits in the backlog)
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # EMFILE and the like: the listener stays; try again shortly
                continue
            with self._conns_lock:
                full = len(self._conns) >= self.config.bulk_connections or self._closed
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
        stall = timeval(self.config.handshake_s)
        ring: list[Any] = []  # this connection's staging ring, made for its first staged PUT
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
            while not self._closed and self._one(conn, ring):
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

    def _one(self, conn: socket.socket, ring: list[Any]) -> bool:
        """Read one request and answer it; False when the connection must be closed. A PUT
        is received through the connection's ``ring`` (made on first use) while one of the
        node's ``staged_receives`` turns is free."""
        cfg = self.config
        try:
            head = read_head(conn, max_frames=cfg.max_frames, max_frame_bytes=cfg.max_frame_size,
                             max_payload_bytes=cfg.max_message_size, idle_ok=True)  # fmt: skip
        except ProtocolError as e:  # over a limit or not our framing: say why, then hang up
            self._count(bulk_bad_messages=1)
            send_message(conn, encode_reply(Reply(0, code=e.code, error=str(e))), [])
            return False
        if head is None:
            return True  # idle: wait on
        try:
            req: Request | ProtocolError = decode_request(head.header)
        except ProtocolError as e:
            req = e
        frames = [new_buffer(size) for size in head.sizes]
        put = isinstance(req, Request) and req.op is Op.PUT and self.config.verify_puts
        # without the native receive: hash on the pool while connections are few, else inline
        few = self.open_connections < self.config.verify_threads
        pool = self.node.verify_pool if few else None
        staged = (put and self.config.staged_receives > 0 and stages(head.payload_bytes)
                  and self._staging.acquire(False))  # fmt: skip
        try:
            if staged and not ring:
                ring.append(new_ring())
            digests = recv_values(conn, frames, req.counts if put else None, pool,
                                  ring[0] if staged else None)  # fmt: skip
        finally:
            if staged:
                self._staging.release()
        if staged:
            self._count(bulk_staged=1)  # before the reply: a client that saw it sees this
        frames = [bytes(f) if len(f) <= SHARED_BUFFER_BYTES else f for f in frames]
        rep, out, done = self._answer(req, frames, digests)
        try:
            sent = send_message(conn, encode_reply(rep), out)
        finally:
            if done is not None:
                done.done = True  # the blocks' space may be reused from now on
        self._count(bulk_requests=1, bulk_bytes_in=head.payload_bytes, bulk_bytes_out=sent)
        return True

    def _count(self, **amounts: int) -> None:
        with self._conns_lock:  # several connection threads count: += is not atomic
            for name, n in amounts.items():
                self.counters[name] += n

    def _answer(
        self, req: Request | ProtocolError, frames: list[Any], digests: list[int] | None
    ) -> tuple[Reply, list[Any], SendDone | None]:
        """The node's reply to one request (``digests``: a PUT's values' checksums, computed
        as they landed), its payload frames and, when they are views of the node's segment,
        the tracker that holds their space until they are sent."""
        node, start = self.node, time.perf_counter()
        if isinstance(req, Request) and len(req.keys) > self.config.max_keys:
            req = ProtocolError(Code.TOO_LARGE, f"{len(req.keys)} keys is over the limit")
        if isinstance(req, ProtocolError):
            self._count(bulk_bad_messages=1)
            return Reply(0, code=req.code, error=str(req)), [], None
        op = req.op
        with node.lock:
            rep, out, sent = node.dispatch_locked(req, frames, digests)
            done = None
            if sent and out:
                done = SendDone()
                node.store.sent(sent, done)
            if node.observe is not None:
                node.observe(op, rep, time.perf_counter() - start)
        return rep, out, done
