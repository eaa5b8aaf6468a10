"""A node's connection guard: connection count, descriptor limit, and what peers make libzmq hold.

libzmq bounds a frame (``ZMQ_MAXMSGSIZE``) and the number of complete messages queued per
connection (``ZMQ_RCVHWM``), but it shows a multipart message to the application only once its
last frame has arrived, so a peer that never finishes a message (or sends a huge one) makes it
buffer without limit, out of the node's sight. The guard closes that gap on TCP connections:

* **Held bytes.** For each connection it compares the bytes the kernel has received on it
  (``TCP_INFO.tcpi_bytes_received``) minus those still in the kernel's queue (``FIONREAD``)
  with the wire size of the messages the node has read from it (exact ZMTP framing, NULL or
  CURVE). The difference is what libzmq holds for that peer; over ``limit`` (a full receive
  queue of largest requests, which no well-behaved peer exceeds) the connection is shut down,
  libzmq closes it and frees what it held, and the heap is trimmed.
* **Resident memory.** If the node's RSS goes over its start-up RSS + 1.1 x capacity +
  ``connection_bound`` per connection (e.g. a flood of empty frames costs libzmq more per wire
  byte), the connection holding the most is shut down.
* **Connections.** At most ``max_connections`` (kept 64 below the descriptor limit, which is
  raised to its hard limit first): further ones are shut down as they are accepted, so
  ``accept`` never fails for want of descriptors (libzmq retries a failed accept in a loop).

Checks run every ``guard_interval_s``, at most 32 connections per check (round robin). Linux
only (``TCP_INFO``); on other systems and ipc:// connections only the count limit applies.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..config import NodeConfig
from ..wire.protocol import MAX_HEADER_BYTES
from .memory import raise_fd_limit, rss_bytes, trim_heap

__all__ = ["ConnectionGuard", "source_fd", "wire_bytes"]

log = logging.getLogger("pagekv.store")

FD_RESERVE = 64  # descriptors kept for the node itself (sockets' mailboxes, logs, monitor)
HANDSHAKE_SLACK = 64 << 10  # greeting, handshake commands, ZMTP heartbeats
ABSORB_BYTES, ABSORB_EVERY_S = 1024, 60.0  # heartbeat bytes forgiven per connection and minute
CHECKS_PER_TICK = 32
UNCONFIRMED_S = 1.0  # a descriptor tracked from a message alone, with no ACCEPTED for it: dropped
_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in struct tcp_info (Linux >= 4.1)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED


def wire_bytes(sizes: list[int], curve: bool = False) -> int:
    """Bytes that frames of these sizes took on the wire (ZMTP 3 framing; CURVE boxes them)."""
    total = 0
    for size in sizes:
        body = size + 33 if curve else size  # CURVE: "\x07MESSAGE", nonce, MAC, flags
        total += body + (2 if body < 256 else 9)
    return total


def source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection ``frame`` came on, or None where libzmq did not record
    it: it does (the ``__fd`` property behind ``ZMQ_SRCFD``) only for a connection that did a
    ZMTP 3 handshake and whose peer address ``getpeername`` gave when libzmq took it over;
    otherwise ``zmq_msg_get`` fails with EINVAL."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError as e:
        if e.errno != errno.EINVAL:
            raise
        return None


@dataclass
class _Conn:
    fd: int
    peer: object  # getpeername() at first sight: a reused descriptor shows as another peer
    seen: int = 0  # wire bytes of messages the node has read from it
    forgiven: int = HANDSHAKE_SLACK
    absorbed_at: float = 0.0
    held: int = 0  # what it held at its last check
    since: float = 0.0  # tracked since


class ConnectionGuard:
    """Owned by the node's loop. Poll :attr:`monitor` for POLLIN and call :meth:`on_events`;
    call :meth:`seen` for each message read and :meth:`tick` every loop turn.

    It owns the socket's monitor (libzmq allows one): ``listener(kind, value)`` is given every
    event, those of ``listener_events`` too (the metrics' :class:`ConnectionMonitor`)."""

    def __init__(
        self, sock: zmq.Socket, config: NodeConfig, counters: dict,
        listener: Callable[[int, int], None] | None = None, listener_events: int = 0,
    ) -> None:  # fmt: skip
        self.config, self.counters = config, counters
        self.curve = bool(config.curve_secret_key)
        self.max_connections = min(config.max_connections, raise_fd_limit() - FD_RESERVE)
        self.limit = (config.recv_hwm + 1) * (config.max_message_size + MAX_HEADER_BYTES)
        self.listener = listener
        self.monitor = sock.get_monitor_socket(_EVENTS | listener_events)
        self.baseline_rss = rss_bytes()
        self.capacity = config.capacity
        self.conns: dict[int, _Conn] = {}
        # per descriptor: ACCEPTED events less DISCONNECTED ones (see on_event), 0 left out
        self._balance: dict[int, int] = {}
        self._order: list[int] = []
        self._next_check, self._cursor, self._trimmed_at = 0.0, 0, 0.0
        self._trim_until = 0.0  # after a close: libzmq frees what it held over the next moments
        counters.update(refused_connections=0, accept_failed=0, guard_closed=0)

    # ---- events ----------------------------------------------------------------------------
    def on_events(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_event(int(event["event"]), int(event["value"]))

    def on_event(self, kind: int, fd: int) -> None:
        """One monitor event. libzmq hands an accepted connection to an I/O thread before its
        listener's thread reports it ACCEPTED, so a peer that hangs up at once can be reported
        DISCONNECTED first, and its descriptor taken by another socket before the ACCEPTED is
        read: a descriptor's connection is open while more ACCEPTED than DISCONNECTED events
        have named it, whatever their order."""
        if self.listener is not None:
            self.listener(kind, fd)
        if kind == zmq.EVENT_ACCEPTED:
            if self._count_event(fd, +1) <= 0:
                return  # reported gone already
            if len(self.conns) >= self.max_connections:
                self.counters["refused_connections"] += 1
                _shutdown(fd)
            else:
                self._track(fd)
        elif kind == zmq.EVENT_DISCONNECTED:
            if self._count_event(fd, -1) <= 0:
                self.conns.pop(fd, None)
        elif kind == zmq.EVENT_ACCEPT_FAILED:  # value is errno
            self.counters["accept_failed"] += 1
            if fd in (errno.EMFILE, errno.ENFILE) and self.conns:
                newest = max(self.conns)
                log.warning("pagekv node: out of descriptors; closing a connection")
                self._close(newest)

    def _count_event(self, fd: int, step: int) -> int:
        """Add ``step`` to ``fd``'s ACCEPTED-less-DISCONNECTED count; the new count."""
        n = self._balance.get(fd, 0) + step
        if n:
            self._balance[fd] = n
        else:
            self._balance.pop(fd, None)
        return n

    def _track(self, fd: int) -> _Conn | None:
        try:
            with _borrowed(fd) as s:
                peer = s.getpeername()
        except OSError:
            return None
        conn = self.conns.get(fd)
        if conn is None or conn.peer != peer:
            now = time.monotonic()
            conn = self.conns[fd] = _Conn(fd, peer, absorbed_at=now, since=now)
        return conn

    def seen(self, fd: int | None, wire: int) -> None:
        """Count ``wire`` bytes read from connection ``fd`` (None: unknown, not counted). A
        descriptor not tracked yet is tracked from here: its ACCEPTED may still be on its way.
        A message read after its connection was reported gone names a descriptor that may be
        another socket's by now: :meth:`tick` drops what no ACCEPTED confirms within
        :data:`UNCONFIRMED_S`."""
        if fd is None:
            return
        conn = self.conns.get(fd) or self._track(fd)
        if conn is not None:
            conn.seen += wire

    # ---- checks ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if now < self._next_check:
            return
        self._next_check = now + self.config.guard_interval_s
        fds = list(self.conns)
        if len(fds) > CHECKS_PER_TICK:
            start = self._cursor % len(fds)
            fds = (fds[start:] + fds[:start])[:CHECKS_PER_TICK]
            self._cursor += CHECKS_PER_TICK
        for fd in fds:
            conn = self.conns.get(fd)
            if conn and self._balance.get(fd, 0) <= 0 and now - conn.since >= UNCONFIRMED_S:
                del self.conns[fd]  # no connection of the socket's holds the descriptor
                continue
            held = self.held(fd, now)
            conn = self.conns.get(fd)
            if conn is not None:
                conn.held = held or 0
            if held is not None and held > self.limit:
                log.warning("pagekv node: closing a connection holding %d unread bytes", held)
                self._close(fd)
        if self._trim_until and now >= self._trim_until:
            self._trim_until = 0.0  # what the closed connections held has been given back
            trim_heap(keep_trimming=False)
        self._check_rss(now)

    @property
    def held_bytes(self) -> int:
        """Bytes of requests libzmq holds for the node's connections, unread, as of each
        connection's last check: memory the blocks they carry take before they are stored."""
        # a copy first (atomic under the GIL): bulk lane threads ask while the loop adds
        return sum(conn.held for conn in list(self.conns.values()))

    def held(self, fd: int, now: float | None = None) -> int | None:
        """Bytes libzmq holds for connection ``fd`` that the node has not read, beyond what
        the handshake and heartbeats explain (None: unknown)."""
        conn, raw = self.conns.get(fd), self.unexplained(fd)
        if conn is None or raw is None:
            return None
        if now is not None and now - conn.absorbed_at >= ABSORB_EVERY_S:
            conn.absorbed_at, conn.forgiven = now, conn.forgiven + ABSORB_BYTES
        return max(0, raw - conn.forgiven)

    def unexplained(self, fd: int) -> int | None:
        """Bytes the kernel received on ``fd`` and passed on, minus the wire size of what the
        node has read from it (None: not a tracked TCP connection)."""
        conn = self.conns.get(fd)
        if conn is None:
            return None
        try:
            with _borrowed(fd) as s:
                if s.getpeername() != conn.peer:
                    self.conns.pop(fd, None)  # the descriptor now belongs to another connection
                    return None
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return None
        if len(info) < _TCPI_BYTES_RECEIVED + 8:
            return None
        (received,) = struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)
        return received - queued - conn.seen

    def allowed_rss(self) -> int:
        per_conn = self.config.connection_bound * max(1, len(self.conns))
        return self.baseline_rss + int(self.capacity * 1.1) + per_conn

    def _check_rss(self, now: float) -> None:
        if rss_bytes() <= self.allowed_rss() or now - self._trimmed_at < 1.0:
            return
        self._trimmed_at = now
        trim_heap()
        if rss_bytes() <= self.allowed_rss():
            return
        held = {fd: self.held(fd) or 0 for fd in self.conns}
        worst = max(held, key=held.__getitem__, default=None)
        if worst is not None and held[worst] > (1 << 20):
            log.warning("pagekv node: over its memory bound; closing the connection holding most")
            self._close(worst)

    def _close(self, fd: int) -> None:
        self.conns.pop(fd, None)
        self.counters["guard_closed"] += 1
        self._trim_until = time.monotonic() + 1.0
        trim_heap(keep_trimming=True)  # libzmq frees what it held over the next moments
        _shutdown(fd)

    def close(self) -> None:
        self.monitor.close(linger=0)


class _borrowed:
    """A socket object over a descriptor libzmq owns, released (never closed) on exit."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)

    def __enter__(self) -> socket.socket:
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.detach()


def _shutdown(fd: int) -> None:
    """End a connection libzmq owns: it sees the end of stream, closes it and frees its queues."""
    try:
        with _borrowed(fd) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone
