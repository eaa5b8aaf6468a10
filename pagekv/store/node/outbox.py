"""Replies leaving a node, with a bound on the bytes each connection has in flight.

Every reply with payload is sent zero-copy with its last frame tracked (libzmq releases a
message's frames in order, so the last one's release means the whole reply has been written to
the kernel). A connection whose replies in flight reach ``budget`` bytes gets no more replies
with payload for the moment: its GET requests are parked (at most ``max_parked``; beyond that
they are dropped and counted) and answered as its earlier replies drain. A reader that never
reads therefore pins at most ``budget`` plus one reply, however many requests it sends;
evicted blocks it was being sent are freed once its replies drain or it disconnects.
Header-only replies (PUT, EXISTS, ...) are copied, untracked, and bounded by the socket's send
high-water mark; past it they are dropped. A reply being read from the disk tier counts as in
flight from the moment its reads are started (:meth:`Outbox.hold`), so a connection's disk
reads are bounded by the same budget.
"""

from __future__ import annotations

import collections
import errno
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

__all__ = ["Outbox"]


@dataclass
class _Peer:
    inflight: collections.deque = field(default_factory=collections.deque)  # (tracker, bytes)
    bytes: int = 0  # of the replies in flight and those held
    held: int = 0  # bytes of replies being read from disk (hold, release)
    parked: collections.deque = field(default_factory=collections.deque)  # parked requests


class Outbox:
    """Owned by the node's loop thread (not thread-safe). ``counters`` is the node's dict."""

    def __init__(self, sock: zmq.Socket, budget: int, max_parked: int, counters: dict) -> None:
        self.sock, self.budget, self.max_parked = sock, budget, max_parked
        self.counters = counters
        self._peers: dict[bytes, _Peer] = {}
        self.parked = 0  # requests parked over all peers
        self.last_tracker: Any = None  # of the last reply with payload sent (done: written)

    def sweep(self) -> None:
        """Forget connections with nothing in flight and nothing parked (call now and then)."""
        for ident, peer in list(self._peers.items()):
            self._drain(peer)
            if not peer.parked and not peer.inflight and not peer.held:
                del self._peers[ident]

    def inflight_bytes(self) -> int:
        return sum(p.bytes for p in self._peers.values())

    def must_park(self, ident: bytes) -> bool:
        """Whether a GET from ``ident`` has to wait (its replies in flight are at the budget,
        or earlier GETs of it are already waiting)."""
        peer = self._peers.get(ident)
        if peer is None:
            return False
        self._drain(peer)
        return bool(peer.parked) or peer.bytes >= self.budget

    def park(self, ident: bytes, request: Any) -> bool:
        """Keep ``request`` until :meth:`ready` hands it back; False (dropped) when full."""
        peer = self._peers.setdefault(ident, _Peer())
        if len(peer.parked) >= self.max_parked:
            self.counters["dropped_requests"] += 1
            return False
        peer.parked.append(request)
        self.parked += 1
        return True

    def ready(self) -> Iterator[tuple[bytes, Any]]:
        """Parked requests whose connection is under budget again, oldest first. The caller
        answers each (with :meth:`send`) before taking the next."""
        for ident, peer in list(self._peers.items()):
            self._drain(peer)
            while peer.parked and peer.bytes < self.budget:
                self.parked -= 1
                yield ident, peer.parked.popleft()
            if not peer.parked and not peer.inflight and not peer.held:
                self._peers.pop(ident, None)

    def hold(self, ident: bytes, nbytes: int) -> _Peer:
        """Count ``nbytes`` (a reply whose values are being read) as in flight to ``ident``
        until :meth:`release` with the peer returned (who may have gone meanwhile)."""
        peer = self._peers.setdefault(ident, _Peer())
        peer.bytes += nbytes
        peer.held += nbytes
        return peer

    @staticmethod
    def release(peer: _Peer, nbytes: int) -> None:
        """End a :meth:`hold` (before sending the reply it was for)."""
        peer.bytes -= nbytes
        peer.held -= nbytes

    def send(self, ident: bytes, header: bytes, payloads: list[Any]) -> bool:
        """Send one reply; False if it was dropped (peer gone, or its queue at the high-water
        mark). ``payloads`` are zmq.Frames or bytes-likes; none is copied unless small."""
        try:
            self.sock.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            self.counters["dropped_replies"] += 1
            return False
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer has gone
            self.counters["dropped_replies"] += 1
            if e.errno == errno.EHOSTUNREACH:
                gone = self._peers.pop(ident, None)
                if gone is not None:
                    self.parked -= len(gone.parked)
                    gone.parked.clear()
            return False
        if not payloads:  # header only: copied, bounded by the high-water mark, untracked
            self.sock.send(header, 0, copy=True)
            return True
        parts = [header, *payloads]
        for part in parts[:-1]:  # large frames of a shared segment (memoryviews): zero-copy
            zero = isinstance(part, zmq.Frame) or (type(part) is memoryview and len(part) > 65536)
            self.sock.send(part, zmq.SNDMORE, copy=not zero)
        last = parts[-1]
        view = last.buffer if isinstance(last, zmq.Frame) else memoryview(last)
        tracker = self.sock.send(view, 0, copy=False, track=True)
        self.last_tracker = tracker
        nbytes = len(header) + sum(len(p) for p in payloads)
        peer = self._peers.setdefault(ident, _Peer())
        peer.inflight.append((tracker, nbytes))
        peer.bytes += nbytes
        return True

    @staticmethod
    def _drain(peer: _Peer) -> None:
        while peer.inflight and peer.inflight[0][0].done:
            peer.bytes -= peer.inflight.popleft()[1]
