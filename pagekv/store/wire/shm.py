"""The shared segment of a ``--shm`` node as both ends see it: what its PING and LOCATE replies
advertise (``shm``), and which host a process is on (a client reads a segment only where the
node's host id is its own). The node's side is :mod:`..node.segment`, the client's
:mod:`..client.shm`."""

from __future__ import annotations

import socket

__all__ = ["ADVERT", "GRANULE", "host_id"]

GRANULE = 4096  # allocation unit (bytes) and the span one generation covers
# the fields of an advert (PING and LOCATE ``shm``) and their types
ADVERT = {"path": str, "size": int, "inode": int, "host": str, "data_offset": int,
          "granule": int, "granules": int}  # fmt: skip


def host_id() -> str:
    """This host and boot: /etc/machine-id (else the host name) and the kernel's boot id. Two
    processes see the same segment files only where these match."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append(socket.gethostname() if path.startswith("/etc") else "")
    return ":".join(parts)
