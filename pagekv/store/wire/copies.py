"""Checked copies of values, and the thread pool that runs them on several cores.

A value read from the store (a TCP reply's frames, or its bytes in a ``--shm`` node's segment)
is copied into its destination chunk by chunk, each chunk hashed right after it is written,
while it is still in the core's cache: memory is read once, not twice (a copy, then a checksum
pass over the same bytes, was half the cost of the same-host shortcut). The work is done by
the native checked copy (:mod:`.native`: C, one call per value, no GIL) when it is available,
else by numpy's copy and xxhash's update per chunk; both release the GIL, so values checked by
several pool threads use several cores while the client's own thread goes on receiving.

The pool is shared by every client of a process with the same thread count (a client costs no
threads of its own) and is made again in a forked child.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import xxhash

from . import native

try:  # numpy comes with pagekv[connector] (engines); a store-only install copies under the GIL
    import numpy as np
except ImportError:  # pragma: no cover - the test environment has numpy
    np = None

__all__ = ["PARALLEL_BYTES", "copy_checksum", "parallel_map", "shared_pool"]

# A frame is copied then hashed in pieces of at most this: 2 MiB pages whole. Smaller pieces
# keep the hash in L2 but cost a GIL hand-off each, and with 8 copy threads those dominate:
# on the H100 host, 64 x 2 MiB through the shm shortcut gave 6.8 GB/s in 256 KiB pieces,
# 9.9 in 1 MiB, 10.8 in 2 MiB and 10.7 in 4 MiB (bench_shm --chunks-kib, same run).
CHUNK_BYTES = 4 << 20
SMALL_BYTES = 64 << 10  # frames below this are copied in one go (Python overhead dominates)
PARALLEL_BYTES = 4 << 20  # work below this is done on the calling thread

_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(threads: int) -> ThreadPoolExecutor | None:
    """The process's pool of ``threads`` copy threads (None for fewer than 2: copy inline).
    Never shut down (idle threads cost nothing); a forked child gets a fresh one."""
    if threads < 2:
        return None
    key = (threads, os.getpid())
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="pagekv-copy")
        return pool


def parallel_map(
    fn: Callable[[Any], int], items: Sequence[Any], nbytes: int, pool: Executor | None
) -> list[int]:
    """``[fn(x) for x in items]`` (checksums: xxhash releases the GIL), on ``pool`` when there
    is one and the items are several and ``nbytes`` (their total) is worth spreading."""
    if pool is None or len(items) < 2 or nbytes < PARALLEL_BYTES:
        return [fn(x) for x in items]
    return list(pool.map(fn, items, chunksize=max(1, len(items) // 64)))


def copy_checksum(targets: Sequence[memoryview], sources: Sequence[Any]) -> int:
    """Copy ``sources[k]`` into ``targets[k]`` (equal byte sizes: the caller checks) and return
    the xxh3-64 of the bytes written, read back from each target chunk right after it was
    written: the checksum is of what the destination now holds.

    Mutates ``targets`` whatever the checksum turns out to be: a caller that finds a mismatch
    must treat the destination's contents as unspecified. Sources may be any buffer (zmq frame
    buffers, numpy arrays over a mapped segment). Raises ``ValueError`` for sizes that differ
    (before anything is copied on the native path). Native (:mod:`.native`) for values of at
    least ``SMALL_BYTES`` when it is available (``PAGEKV_NATIVE_COPY``; ``on`` and not
    buildable raises ``NativeCopyUnavailable``); the same digest either way.
    """
    if len(targets) != len(sources):
        raise ValueError(f"{len(sources)} source frames for {len(targets)} targets")
    if np is not None and sum(memoryview(t).nbytes for t in targets) >= SMALL_BYTES:
        lib = native.load()
        if lib is not None:
            return lib.copy_verify([(targets, sources)])[0]
    state = xxhash.xxh3_64()
    for target, source in zip(targets, sources):
        n = memoryview(target).nbytes
        if np is None or n < SMALL_BYTES:
            memoryview(target).cast("B")[:] = memoryview(source).cast("B")
            state.update(target)
            continue
        dst = np.frombuffer(target, np.uint8)
        src = np.frombuffer(source, np.uint8)
        if src.size != n:
            raise ValueError(f"source of {src.size} bytes for a target of {n}")
        for start in range(0, n, CHUNK_BYTES):
            part = dst[start : start + CHUNK_BYTES]
            np.copyto(part, src[start : start + CHUNK_BYTES])
            state.update(part)
    return state.intdigest()
