"""Zero-copy sends on the lane: a node's large GET reply hands the kernel references to the
pages of its stored blocks (``vmsplice`` into a pipe of the connection's, ``splice`` from the
pipe into the socket), so the node's thread copies no payload byte; the receiving side's kernel
copies them straight out of the node's memory.

The rule that comes with it: the kernel reads those pages until the *receiver* has read the
bytes (over loopback they wait in the receiver's socket queue as references to the node's
pages), not only until the send returns. So a block must not be freed, nor its memory reused,
while a reply that spliced it may still be unread. The node's lane keeps each spliced reply's
blocks (and a ``--shm`` node's send tracker not done) until the request *two after it* arrives
on its connection, or the connection ends: a lane client reads a reply whole before it sends the
request two after it (``client.lane.DEPTH`` is 2; docs/protocol.md, "Bulk lane"). A client that
broke the rule could read bytes of a later block: every value's xxh3-64, computed when it was
put, then fails, and the value is a miss, never wrong data.

Replies under ``SPLICE_MIN_BYTES`` of payload are sent with ``sendmsg`` (copied into the socket)
as before: for them the pipe's two extra system calls cost more than the copy.

Measured (H100 host, 16 cores, loopback, 2026-11-27, ``scripts/diag_splice_send.c``, 3 rounds,
each of K pairs sending 256 MiB of its own memory): into a receive buffer that stays in cache,
as the lane's bounce, 8 streams moved 26.4-33.1 GB/s spliced against 21.8-23.3 sent; one
stream into memory of its own 4.7-4.9 against 2.8-3.2.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from . import native

__all__ = ["SPLICE_MIN_BYTES", "Splicer", "available"]

log = logging.getLogger("pagekv.store")
PIPE_BYTES = 1 << 20  # the pipe's size asked for: up to this much is spliced per pair of calls
SPLICE_MIN_BYTES = 256 << 10  # a reply's payload from which its frames are spliced


class Splicer:
    """One connection's pipe, used by that connection's thread alone, and the native call that
    splices through it (one call per message, the GIL released); :meth:`close` it when the
    connection ends. After :meth:`send` raised, the pipe may hold bytes of the failed message:
    the connection is over (close both)."""

    def __init__(self, lib: native.NativeCopy) -> None:
        self.lib = lib
        self.pipe = os.pipe()
        try:
            fcntl.fcntl(self.pipe[1], fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # over this user's pipe quota: the default size, more calls per frame
        self.capacity = fcntl.fcntl(self.pipe[1], fcntl.F_GETPIPE_SZ)

    def close(self) -> None:
        for fd in self.pipe:
            os.close(fd)

    def send(self, sock: socket.socket, frames: Sequence[Any]) -> None:
        """Splice ``frames`` (buffers; read, never written) into ``sock`` in order. Raises
        ``OSError`` (``TimeoutError`` when the socket's ``SO_SNDTIMEO`` passed)."""
        self.lib.splice_send(sock.fileno(), self.pipe, self.capacity, frames)


@functools.cache
def available(lib: native.NativeCopy) -> bool:
    """Whether this process can splice into a TCP socket (Linux, no filter refusing the calls):
    tried once, on a loopback connection of its own."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return False
    payload = os.urandom(3 << 16)
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            with socket.create_connection(server.getsockname()[:2], timeout=5) as out:
                peer, _ = server.accept()
                with peer:
                    peer.settimeout(5)
                    splicer = Splicer(lib)
                    try:
                        splicer.send(out, [payload])
                    finally:
                        splicer.close()
                    got = bytearray()
                    while len(got) < len(payload):
                        chunk = peer.recv(len(payload) - len(got))
                        if not chunk:
                            break
                        got += chunk
        if bytes(got) == payload:
            return True
        log.warning("pagekv: spliced bytes arrived changed: the lane copies its replies")
    except OSError as e:
        log.info("pagekv: no zero-copy lane replies (%s): the lane copies them", e)
    return False
