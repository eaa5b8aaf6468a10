"""glibc malloc settings for processes that hold many large blocks (store nodes, clients).

Blocks arrive as ZeroMQ frames that libzmq allocates with malloc. By default glibc serves
2 MiB requests with fresh mmaps (or trims freed heap memory back to the OS), so every block
received costs 512 page faults and the kernel zeroing 2 MiB, which on a 2-core machine takes
as long as moving the bytes. Keeping blocks up to 32 MiB in the heap and not trimming it lets
freed (evicted, delivered) blocks be reused without faults; a node's resident memory then
plateaus at about its capacity instead of returning to the OS between bursts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc_for_blocks"]

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_malloc_for_blocks(
    mmap_threshold: int = 32 << 20, trim_threshold: int = (1 << 31) - 1, arena_max: int = 2
) -> bool:
    """Apply the settings above to this process (glibc only). Returns whether they took."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return False
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_ARENA_MAX, arena_max),
        )
    )
    if not ok:
        log.warning("pagekv: mallopt refused the block-friendly malloc settings")
    return ok
