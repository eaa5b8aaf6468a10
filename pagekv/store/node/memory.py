"""glibc malloc settings for processes that hold many large blocks (store nodes; clients that
receive values into new buffers), and the warming of a node's heap.

Blocks arrive as ZeroMQ frames that libzmq allocates with malloc. By default glibc serves
2 MiB requests with fresh mmaps (or trims freed heap memory back to the OS), so every block
received costs 512 page faults and the kernel zeroing 2 MiB, which on a 2-core machine takes
as long as moving the bytes. Rules (:func:`tune_malloc_for_blocks`):

* Blocks up to 32 MiB come from the heap, and the heap is not trimmed, so freed (evicted,
  delivered) blocks are reused without faults; a node's resident memory plateaus at about its
  capacity instead of returning to the OS between bursts.
* A node has one arena for every thread (``arena_max=1``): libzmq's I/O threads and the bulk
  lane's allocate from the heap it warms. The settings must take before the process starts its
  first thread (``pagekv serve`` applies them first thing): a thread keeps the arena it first
  allocated in. Elsewhere two arenas (the default), so that receiving threads do not all wait on
  one lock; a thread's own arena is built of 64 MiB heaps, which glibc unmaps as soon as one is
  all free, whatever the trim threshold, unless the top pad (64 MiB) covers it (without it, a
  thread receiving blocks re-faulted half of every block each round of puts and deletes).
* A node warms its heap once it serves (:class:`HeapWarmer`): it faults in the memory its
  blocks will take (90% of its capacity) and hands it back to malloc, so that the first fill
  of a fresh node lands on mapped pages as later ones do. Unwarmed, a node's first 4 GiB cost
  ~1M faults, each a trap and a page zeroed on the receiving thread: on the H100 host a
  connector's write-back of 4 GiB to fresh nodes took 0.93 s (one node) and 0.51 s (three)
  against 0.37 s warmed (medians of 3 interleaved rounds, docs/benchmarks.md).
* ``malloc_trim`` (:func:`trim_heap`: the connection guard, after an abusive peer's bytes were
  dropped) gives free memory back to the OS, warmed memory included; blocks then fault again.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import threading
from collections.abc import Callable

from pagekv import env

__all__ = [
    "HeapWarmer",
    "minor_faults",
    "raise_fd_limit",
    "rss_bytes",
    "trim_heap",
    "tune_malloc_for_blocks",
]

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
    """Apply the settings above to this process (glibc only), before it starts a thread.
    Returns whether they took. ``PAGEKV_MALLOC_TOP_PAD`` (bytes) overrides ``top_pad``."""
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
    """The C library, from the symbols this process already has (glibc's malloc functions on
    Linux): no search, no descriptor (the guard trims a node out of descriptors)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


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
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in, writable, without touching it
_WARM_CHUNK = 16 << 20  # below the mmap threshold: heap memory
_RESERVE_FRACTION = 0.05  # warming stops while the host has less than this much available
# Of the room for blocks, the share warmed: a block also holds memory outside the heap (its
# Python objects: about a quarter of the cost of a 512-byte block, 1% of a 64 KiB one), and
# heap warmed for bytes that never land there would take a node of small blocks past its bound
# (capacity + 10%: 1.27x with every byte of the room warmed, 512-byte blocks).
WARM_SHARE = 0.9


class HeapWarmer:
    """Warms this process's malloc heap on a thread of its own (see the module's rules): takes
    chunks of :data:`_WARM_CHUNK` from malloc and has the kernel fault each in, while their
    bytes stay under :data:`WARM_SHARE` of ``room()`` (the bytes the node may still take: its
    capacity less what its store holds) and the host keeps 5% of its memory available; then
    keeps a few bytes of the last chunk as a fence and frees the rest. The freed chunks merge
    into one free region below the fence, which malloc serves later blocks from; never the
    heap's top, so freeing them trims nothing back to the OS. :meth:`stop` ends it early (what
    it holds is freed). ``warmed``: resident memory it added (its chunks, less memory that was
    resident already); ``done``: it has finished."""

    def __init__(self, room: Callable[[], int]) -> None:
        self.room = room
        self.warmed = 0
        self.done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagekv-heap-warmer", daemon=True)

    def start(self) -> HeapWarmer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _wants(self, chunks: int) -> bool:
        """Whether to hold ``chunks`` warmed chunks."""
        return (not self._stop.is_set() and chunks * _WARM_CHUNK <= WARM_SHARE * self.room()
                and _spare_bytes() >= _WARM_CHUNK)  # fmt: skip

    def _run(self) -> None:
        # At the process's own priority, never lower: faulting a chunk in holds the address
        # space's lock, and malloc the heap's; a warmer starved by busy neighbours while it
        # holds them stalls every thread of the node (seconds, on a busy 2-core machine).
        libc, chunks, before = _libc(), [], rss_bytes()
        try:
            if libc is None:
                return
            malloc, free, realloc = _heap_calls(libc)
            while self._wants(len(chunks) + 1) and (ptr := malloc(_WARM_CHUNK)):
                chunks.append(ptr)
                _populate(libc, ptr, _WARM_CHUNK)
            if chunks:
                realloc(chunks.pop(), 64)  # the fence: shrunk in place, kept for good
            while chunks:
                free(chunks.pop())
        except Exception:  # warming is an optimisation: say so, serve on
            log.exception("pagekv node: warming the heap failed")
            while chunks:
                libc.free(chunks.pop())
        finally:
            self.warmed = max(0, rss_bytes() - before)
            self.done = True
        log.info("pagekv node: %d MiB of heap warmed for blocks", self.warmed >> 20)


@functools.cache
def _heap_calls(libc: ctypes.CDLL) -> tuple[Callable, Callable, Callable]:
    libc.malloc.restype = libc.realloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.malloc, libc.free, libc.realloc


def _populate(libc: ctypes.CDLL, ptr: int, size: int) -> None:
    """Fault ``[ptr, ptr + size)`` in: one ``madvise`` for its whole pages, else a write."""
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + size) // _PAGE * _PAGE
    if end <= start or libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
        ctypes.memset(ptr, 0, size)  # kernels before 5.14


# cgroup v2, then v1: (the limit, the usage) of this process's memory cgroup
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def memory_limit() -> int:
    """Bytes this process may use at most: physical RAM, or a smaller cgroup memory limit."""
    limit = os.sysconf("SC_PHYS_PAGES") * _PAGE
    for limit_path, _ in _CGROUP_FILES:
        text = _read(limit_path)
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def _spare_bytes() -> int:
    """Memory the host (and this process's cgroup) can still give before 5% of it is left."""
    total = os.sysconf("SC_PHYS_PAGES") * _PAGE
    spare = total  # without /proc/meminfo: no bound from it
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            spare = (int(line.split()[1]) << 10) - int(_RESERVE_FRACTION * total)
    for limit_path, used_path in _CGROUP_FILES:
        limit, used = _read(limit_path), _read(used_path)
        if limit.isdigit() and used.isdigit() and int(limit) < total:
            spare = min(spare, int(limit) - int(used) - int(_RESERVE_FRACTION * int(limit)))
    return spare


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (``/proc/<pid>/statm``). A process reads its own through
    a descriptor it opened once: a node whose peers hold all its descriptors for a moment still
    runs its memory checks."""
    if pid != "self":
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    return int(os.pread(_own_statm(), 256, 0).split()[1]) * _PAGE


_statm: tuple[int, int] | None = None  # (pid, descriptor of its /proc/<pid>/statm)
_statm_lock = threading.Lock()


def _own_statm() -> int:
    global _statm
    with _statm_lock:
        if _statm is None or _statm[0] != os.getpid():  # first read, or a forked child's
            if _statm is not None:
                os.close(_statm[1])  # the parent's, inherited
            fd = os.open(f"/proc/{os.getpid()}/statm", os.O_RDONLY | os.O_CLOEXEC)
            _statm = (os.getpid(), fd)
        return _statm[1]


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
