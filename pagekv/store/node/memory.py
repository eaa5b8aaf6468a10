"""glibc malloc settings for processes that hold many large blocks (store nodes, clients).

Blocks arrive as ZeroMQ frames that libzmq allocates with malloc. By default glibc serves
2 MiB requests with fresh mmaps (or trims freed heap memory back to the OS), so every block
received costs 512 page faults and the kernel zeroing 2 MiB, which on a 2-core machine takes
as long as moving the bytes. Keeping blocks up to 32 MiB in the heap and not trimming it lets
freed (evicted, delivered) blocks be reused without faults; a node's resident memory then
plateaus at about its capacity instead of returning to the OS between bursts.

Threads other than the main one (libzmq's I/O threads, the bulk lane's) allocate from their
own arenas, built of 64 MiB heaps, and glibc unmaps such a heap as soon as all of it is free
and shrinks it by its free top, whatever the trim threshold, unless the arena's top pad covers
it. With two I/O threads a node re-faulted half of every block it received (0.52 faults per
4 KiB page, each round of puts and deletes, on the 2-core dev machine); a 64 MiB top pad took
that to 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import resource

from pagekv import env

__all__ = ["minor_faults", "raise_fd_limit", "rss_bytes", "tune_malloc_for_blocks", "trim_heap"]

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_TRIM_THRESHOLD = (1 << 31) - 1
_DEFAULT_TRIM_THRESHOLD = 128 << 10  # glibc's
_DEFAULT_TOP_PAD = 128 << 10  # glibc's (DEFAULT_TOP_PAD)
_tuned_trim_threshold = 0  # set by tune_malloc_for_blocks
_tuned_top_pad = 0


def tune_malloc_for_blocks(
    mmap_threshold: int = 32 << 20,
    trim_threshold: int = _TRIM_THRESHOLD,
    arena_max: int = 2,
    top_pad: int = 64 << 20,
) -> bool:
    """Apply the settings above to this process (glibc only). Returns whether they took.
    ``PAGEKV_MALLOC_ARENAS`` and ``PAGEKV_MALLOC_TOP_PAD`` (bytes) override ``arena_max`` and
    ``top_pad`` (an operator's or a benchmark's knobs)."""
    if env.MALLOC_ARENAS.raw() is not None:
        arena_max = env.MALLOC_ARENAS.get()
    if env.MALLOC_TOP_PAD.raw() is not None:
        top_pad = env.MALLOC_TOP_PAD.get()
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_ARENA_MAX, arena_max),
            (_M_TOP_PAD, top_pad),
        )
    )
    if not ok:
        log.warning("pagekv: mallopt refused the block-friendly malloc settings")
    global _tuned_trim_threshold, _tuned_top_pad
    _tuned_trim_threshold = trim_threshold if ok else 0
    _tuned_top_pad = top_pad if ok else 0
    return ok


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def trim_heap(keep_trimming: bool | None = None) -> bool:
    """Give free heap memory back to the OS (glibc ``malloc_trim``), e.g. after an abusive
    peer's queued bytes were dropped, so that resident memory falls back. ``malloc_trim``
    cannot shrink the top of a thread's arena (where libzmq's I/O thread allocates); freeing
    does, while the trim threshold and the top pad are low: ``keep_trimming=True`` lowers them
    to glibc's defaults (until called with False, which restores the block-friendly settings).
    Returns whether it ran."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    if keep_trimming is not None and hasattr(libc, "mallopt"):
        threshold = _tuned_trim_threshold or _DEFAULT_TRIM_THRESHOLD
        pad = _tuned_top_pad or _DEFAULT_TOP_PAD
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD if keep_trimming else threshold)
        libc.mallopt(_M_TOP_PAD, _DEFAULT_TOP_PAD if keep_trimming else pad)
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim(0)
    return True


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (``/proc/<pid>/statm``)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def minor_faults(pid: int | str = "self") -> int:
    """Minor page faults of a whole process so far (``/proc/<pid>/stat``): each a page the
    kernel mapped in, zeroed first when it was fresh memory."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("pagekv: could not raise the descriptor limit above %d", soft)
    return soft
