"""Framing of the bulk lane: pagekv messages over a plain TCP connection (see :mod:`..node.lane`
and :mod:`..client.lane`; docs/protocol.md, "Bulk lane").

The bulk lane carries the same messages as the ZeroMQ socket (a msgpack header, then payload
frames; :mod:`.protocol`), framed so that the receiver knows every frame's size before it reads
a byte of payload, and can therefore receive each frame into its final place (a client's
destination page; large frames through a cached bounce buffer, see :func:`recv_values`), hashing
it as it lands (the native receive)::

    prefix   "<4sIIQ": magic b"PKB1", header bytes, frame count, payload bytes (sum of sizes)
    sizes    "<{count}Q": bytes of each payload frame
    header   msgpack (a protocol Request or Reply)
    frames   the payload frames, back to back

Both ends check the prefix and the sizes against their limits before reading on
(:func:`read_head`); a message that breaks them is answered (node) or dropped (client) and the
connection closed: a stream cannot be resynchronised without reading what it declared.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from pagekv.errors import ProtocolError

try:  # buffers for large frames without zero-filling them (bytearray writes every byte first)
    import numpy as np
except ImportError:  # pragma: no cover - a store-only install
    np = None

from . import native
from .protocol import MAX_HEADER_BYTES, SHARED_BUFFER_BYTES, Code

__all__ = ["HEAD_BYTES", "MAGIC", "SAME_HOST_SOCKET_BUFFER", "Head", "PeerClosed", "new_buffer",
           "read_head", "recv_exact", "recv_values", "send_message", "size_socket_buffers",
           "timeval"]  # fmt: skip

log = logging.getLogger("pagekv.store")
MAGIC = b"PKB1"
PREFIX = struct.Struct("<4sIIQ")


class PeerClosed(ConnectionError):
    """The peer closed the connection (or it was shut down), possibly mid-message."""


class ClosedBetweenMessages(PeerClosed):
    """The connection ended (closed or reset) before any byte of the next message: a request
    sent on it may never have been read (e.g. the node restarted)."""


@dataclass(frozen=True)
class Head:
    """A message's prefix, sizes and header, read and checked; its frames are still to read
    unless ``landed`` (received into the frames the reader expected, ``digests`` per value:
    see :func:`read_head`)."""

    header: bytes
    sizes: tuple[int, ...]
    payload_bytes: int
    landed: bool = False
    digests: list[int] | None = None


HEAD_BYTES = 64 << 10  # a reader's head buffer: heads up to this size come in one native call


def new_buffer(size: int) -> Any:
    """A new writable buffer of ``size`` bytes for a frame to be received into (numpy's, not
    zero-filled, for large frames when numpy is there)."""
    if np is not None and size > SHARED_BUFFER_BYTES:
        return np.empty(size, np.uint8)
    return bytearray(size)


# The buffers of a same-host connection's GET-reply direction where none is configured. Over
# loopback there is no bandwidth-delay product to cover, and what autotuning lets pile up in a
# connection's buffers (megabytes) leaves the cache between the sender's copy in and the
# receiver's copy out: 8-stream GETs moved 1.12x as much with 256 KiB (H200, both directions,
# 8 interleaved rounds, higher in all 8; 512 KiB 1.10x, 1 MiB 1.03x, 128 KiB 1.05x, 4 MiB 0.99x:
# scripts/diag_socket_buffer.py), one-stream GETs 1.26-1.52x on 2 cores. PUTs moved less with
# both directions small on 2 cores (0.85-0.94x), so their direction keeps autotuning. Across
# hosts autotuning stays: a fixed buffer caps a connection at buffer / RTT.
SAME_HOST_SOCKET_BUFFER = 256 << 10


def size_socket_buffers(sock: socket.socket, configured: int, replies_out: bool) -> None:
    """Size a connected lane socket's buffers: both to ``configured`` where it is not 0; else,
    when both ends have one address (loopback, or one of the host's own addresses, which the
    kernel also delivers locally), the direction that carries GET replies to
    :data:`SAME_HOST_SOCKET_BUFFER` (``replies_out``: the node's SO_SNDBUF; else the client's
    SO_RCVBUF); the rest keeps the kernel's autotuning (PUTs moved less with small buffers)."""
    if configured:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, configured)
        return
    try:
        same_host = sock.getsockname()[0] == sock.getpeername()[0]
    except OSError:
        return  # no longer connected: whoever uses it next finds out
    if same_host:
        option = socket.SO_SNDBUF if replies_out else socket.SO_RCVBUF
        sock.setsockopt(socket.SOL_SOCKET, option, SAME_HOST_SOCKET_BUFFER)


def timeval(seconds: float) -> bytes:
    """``seconds`` as the ``struct timeval`` of ``SO_RCVTIMEO`` / ``SO_SNDTIMEO``."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` (writable bytes) from ``sock``: one ``recv_into`` that waits for all of it
    (``MSG_WAITALL``, the GIL released for the whole frame), repeated only when the kernel
    returns early (a signal, the socket's ``SO_RCVTIMEO`` with part of it read). Raises
    ``PeerClosed`` at end of stream, ``TimeoutError`` when a wait ends with nothing read
    (``SO_RCVTIMEO``), ``OSError`` for the rest."""
    got, n = 0, view.nbytes
    while got < n:
        try:
            step = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO ran out with nothing read
            raise TimeoutError(f"no data for the socket's receive timeout ({got}/{n})") from None
        if step == 0:
            raise PeerClosed(f"connection closed after {got} of {n} bytes")
        got += step


def recv_values(
    sock: socket.socket, frames: Sequence[Any], counts: Sequence[int] | None,
    lib: native.NativeCopy, bounce: Any, deadline_ns: int = 0,
) -> list[int] | None:  # fmt: skip
    """Receive ``frames`` (writable buffers, in order) from the blocking ``sock`` with the native
    receive ``lib`` (:meth:`.native.NativeCopy.recv_verify`: one C call, the GIL released, each
    256 KiB hashed right after it lands, while it is still in the cache; ``bounce``: the calling
    thread's buffer of ``RECV_SLOTS`` chunks, see there) and, when ``counts``
    (frames per value, adding up to ``len(frames)``) is given, return the xxh3-64 of each value
    as it landed; else None. On the H100 host (a 4 GiB GET in 2 MiB blocks over K connections
    of one process) that moved 3.2-3.7 / 11.0-12.5 / 17.4-19.9 GB/s for K = 1 / 4 / 8, where
    ``recv_into`` then xxhash per frame moved 2.7-2.8 / 9.3-9.4 / 15.5-15.8.

    Raises ``PeerClosed`` at end of stream, ``TimeoutError`` when the socket's receive timeout
    passes with nothing read or ``deadline_ns`` (``time.monotonic_ns()``; 0: none) passes,
    ``OSError`` for the rest."""
    if counts is not None and (sum(counts) != len(frames) or min(counts, default=0) < 0):
        counts = None  # not a valid split of these frames: received, not hashed
    if not frames:  # nothing to receive (a reply without values)
        return None if counts is None else [xxhash.xxh3_64_intdigest(b"") for _ in counts]
    try:
        return lib.recv_verify(sock.fileno(), frames, counts, bounce=bounce,
                               deadline_ns=deadline_ns)  # fmt: skip
    except EOFError as e:
        raise PeerClosed(str(e)) from None
    except BlockingIOError:  # SO_RCVTIMEO ran out with nothing read
        raise TimeoutError("no data for the socket's receive timeout") from None


def send_message(sock: socket.socket, header: bytes, frames: Sequence[Any]) -> int:
    """Send one message (prefix, sizes, header, frames) with as few system calls as the kernel
    allows (``sendmsg`` gathers the frames straight from their memory: no copy in user space);
    returns the payload bytes sent. Raises ``OSError`` (``TimeoutError`` on ``SO_SNDTIMEO``)."""
    views = [memoryview(f).cast("B") for f in frames]
    sizes = [v.nbytes for v in views]
    total = sum(sizes)
    head = PREFIX.pack(MAGIC, len(header), len(sizes), total)
    parts = [memoryview(head + struct.pack(f"<{len(sizes)}Q", *sizes) + header), *views]
    while parts:
        try:
            sent = sock.sendmsg(parts[:64])  # IOV_MAX is 1024; fewer keeps each call short
        except BlockingIOError:
            raise TimeoutError("the peer did not read for the socket's send timeout") from None
        while sent:  # drop what went out; a part sent in part is kept from where it stopped
            if sent >= parts[0].nbytes:
                sent -= parts.pop(0).nbytes
            else:
                parts[0], sent = parts[0][sent:], 0
    return total


def read_head(
    sock: socket.socket,
    lib: native.NativeCopy,
    buffer: Any,
    *,
    max_frames: int,
    max_frame_bytes: int,
    max_payload_bytes: int,
    idle_ok: bool = False,
    into: Sequence[Any] = (),
    counts: Sequence[int] | None = None,
    bounce: Any = None,
    deadline_ns: int = 0,
) -> Head | None:
    """Read and check a message's prefix, sizes and header with the native receive ``lib``
    (:meth:`.native.NativeCopy.recv_message`: one call, the GIL released), into ``buffer``
    (the calling thread's, ``HEAD_BYTES``; a larger head is read on after its prefix). With
    ``into`` (where the message's payload is expected to go: the writable frames of a reply
    the caller waits for), a payload whose frames are exactly those (as many, each of the same
    size) is received into them in the same call, hashed per value of ``counts`` (frames per
    value) through ``bounce``, ``deadline_ns`` as :func:`recv_values`'s: ``Head.landed``;
    otherwise it is left to read. Returns None, with ``idle_ok``, when the receive timeout
    passes with no byte of a new message (the caller decides whether to wait on). Raises
    ``ClosedBetweenMessages`` when the connection ends (closed, shut down or reset) before a
    byte of the message, ``PeerClosed`` when it ends within it, ``ProtocolError``
    (``BAD_HEADER``: not a bulk message; ``TOO_LARGE``: over a limit; nothing more is read),
    ``TimeoutError`` when a receive timeout passes within the message (or its deadline), the
    ``OSError`` of a failed receive for the rest."""
    got = lib.recv_message(sock.fileno(), buffer, max_header=MAX_HEADER_BYTES,
                           max_frames=max_frames, max_frame_bytes=max_frame_bytes,
                           max_payload=max_payload_bytes, frames=into, counts=counts,
                           bounce=bounce, deadline_ns=deadline_ns)  # fmt: skip
    code = got.code
    if code == 1:
        raise ClosedBetweenMessages("connection closed")
    if code == 2:
        raise PeerClosed(f"connection closed after {got.received} bytes of a message")
    if code == 3:
        raise ProtocolError(Code.BAD_HEADER, "not a pagekv bulk message")
    if code < 0:
        err = -code
        if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ETIMEDOUT):
            if got.received == 0 and err != errno.ETIMEDOUT:
                if idle_ok:
                    return None
                raise TimeoutError("no message for the socket's receive timeout")
            raise TimeoutError(f"a message stalled after {got.received} bytes")
        raise OSError(err, os.strerror(err))
    _, header_bytes, count, payload = PREFIX.unpack_from(buffer)
    if code == 4:
        if header_bytes > MAX_HEADER_BYTES or count > max_frames or payload > max_payload_bytes:
            raise ProtocolError(
                Code.TOO_LARGE,
                f"message of {header_bytes} header bytes, {count} frames, {payload} payload "
                f"bytes is over the limits ({MAX_HEADER_BYTES}, {max_frames}, "
                f"{max_payload_bytes})",
            )
        raise ProtocolError(Code.TOO_LARGE, "frame sizes over the limit or not adding up")
    view = memoryview(buffer)
    if code == 5:  # larger than the buffer: its prefix came, the rest is read here
        whole = bytearray(got.head_bytes)
        whole[: PREFIX.size] = view[: PREFIX.size]
        recv_exact(sock, memoryview(whole)[PREFIX.size :])
        view = memoryview(whole)
    sizes = struct.unpack_from(f"<{count}Q", view, PREFIX.size)
    if code == 5 and (sum(sizes) != payload or (sizes and max(sizes) > max_frame_bytes)):
        raise ProtocolError(Code.TOO_LARGE, "frame sizes over the limit or not adding up")
    header = bytes(view[PREFIX.size + 8 * count : PREFIX.size + 8 * count + header_bytes])
    return Head(header, sizes, payload, got.landed, got.digests)
