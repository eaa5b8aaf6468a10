"""A store node's disk tier: blocks leaving memory are kept in a directory on a local disk, read
back on a miss, and found again after a restart.

How the node uses it (every call is cheap and never waits on the disk, except :meth:`save` and
:meth:`close` at shutdown):

* an evicted block -> :meth:`DiskTier.offer` (queued for the writer; dropped, and counted, when
  the queue is full; skipped when the disk holds the key already);
* EXISTS -> :meth:`~DiskTier.contains` for the keys memory lacks;
* GET of keys memory lacks -> :meth:`~DiskTier.read_many` with a token; each batch completes on
  a reader thread, which queues ``(token, blocks)`` and wakes :attr:`~DiskTier.wakeup_fd`
  (poll it beside the socket), and the node takes them with :meth:`~DiskTier.completed`;
  a thread that may block (the bulk lane) uses :meth:`~DiskTier.read_many_wait`;
* DELETE -> :meth:`~DiskTier.delete`; STATS -> :meth:`~DiskTier.stats` and
  :meth:`~DiskTier.histograms`;
* KV events (:mod:`.events`): :attr:`~DiskTier.on_stored` and :attr:`~DiskTier.on_removed`
  are called, under the tier's lock, as a key becomes readable here (queued for writing) and
  as it stops being readable (deleted, dropped from the queue, reclaimed, corrupt, tier off);
  :meth:`~DiskTier.keys` lists what is readable;
* SIGTERM -> :meth:`~DiskTier.save` (memory's blocks, most recently used first, within a time
  bound), then :meth:`~DiskTier.close` (the queue written, the last segment sealed).

Threads: one writer (appends records to the active segment in large sequential writes, seals
full segments, reclaims the oldest when the disk is over capacity), ``read_threads`` readers
(a batch's keys in up to ``read_threads`` shares; records lying back to back, as a prefix's
pages evicted together do, are read with one ``preadv`` into a new buffer; then each record's
header and checksum are checked). The tier's lock guards the index, the queue and the segment
table; no disk I/O is ever done while holding it, so the node's loop waits on it for
microseconds at most.

Failures: a full disk reclaims the oldest segment and tries once more, then drops the block;
any other I/O error (EIO, a read-only file system...) turns the tier off with one log line (every
call then misses or does nothing; the node serves from memory); a record that does not match
its checksum, key or sequence number is a miss, and its key is dropped. Nothing read is handed
out unchecked. A second process opening the same directory gets :class:`DiskDirLocked`.

Formats on disk: :mod:`.disk_format`; segment files: :mod:`.disk_segment`; the index and its
rebuild: :mod:`.disk_index`.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from pagekv.env import parse_size
from pagekv.errors import ConfigError, PagekvError

from .disk_format import (
    FLAG_TOMBSTONE,
    FORMAT_TEXT,
    PAGE,
    RECORD_ALIGN,
    Record,
    align_up,
    check_record_header,
    directory_name,
    pack_record_header,
    record_bytes,
    segment_name,
)
from .disk_index import (
    NO_DESCRIPTOR,
    NO_SPACE,
    DiskIndex,
    Entry,
    Recovered,
    entry_of,
    recover,
    write_directory,
)
from .disk_segment import IOV_MAX, FileOps, Segment, payload_checksum

__all__ = ["DiskBlock", "DiskConfig", "DiskDirLocked", "DiskFormatError", "DiskTier",
           "DiskTierError", "FileOps"]  # fmt: skip

log = logging.getLogger("pagekv.store.disk")

_MISCONFIGURED = (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG,
                  errno.ELOOP)  # fmt: skip
WRITE_BATCH_BYTES = 16 << 20  # one pwritev carries at most this (and IOV_MAX pieces)
MAX_TOMBSTONES = 1 << 16  # queued deletes beyond the byte-bounded blocks
# the buckets of the node's request histogram (metrics.LATENCY_BUCKETS)
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                   5e-2, 0.1, 0.25, 0.5, 1.0)  # fmt: skip
_ZEROS = bytes(RECORD_ALIGN)


class DiskTierError(PagekvError, RuntimeError):
    """The disk tier cannot use its directory (the message says why and what to do)."""


class DiskDirLocked(DiskTierError):
    """Another process (the message gives its pid) serves from this directory."""


class DiskFormatError(DiskTierError):
    """The directory holds something other than this version's disk tier."""


@dataclass(frozen=True)
class DiskConfig:
    """A disk tier. ``capacity``: bytes its files may take (segments and their directories);
    ``segment_bytes``: size of one segment file, the unit of writing and of reclaiming;
    ``write_queue_bytes``: evicted blocks waiting for the writer (memory the node holds beyond
    its capacity); ``read_threads``: reads in flight; ``direct_reads``: read sealed segments with
    O_DIRECT (the page cache is left to memory); ``rewrite_fraction``: a block offered again
    (evicted from memory after a disk hit promoted it) whose record lies in this oldest
    fraction of the segments is written again, so it outlives their reclaim;
    ``verify_scan``: a restart checks the payload checksum of every record it scans."""

    dir: str
    capacity: int | str
    segment_bytes: int | str = 128 << 20
    write_queue_bytes: int | str = 128 << 20
    read_threads: int = 4
    direct_reads: bool = True
    rewrite_fraction: float = 0.5
    verify_scan: bool = True

    def __post_init__(self) -> None:
        for name in ("capacity", "segment_bytes", "write_queue_bytes"):
            try:
                object.__setattr__(self, name, parse_size(getattr(self, name)))
            except ValueError as e:
                raise ConfigError(f"DiskConfig.{name}: {e}") from None
        if self.segment_bytes < (1 << 20) or self.segment_bytes % PAGE:
            raise ConfigError(f"DiskConfig.segment_bytes must be >= 1 MiB and a multiple of "
                              f"{PAGE}, got {self.segment_bytes}")  # fmt: skip
        if self.capacity < 2 * self.segment_bytes:
            raise ConfigError(f"DiskConfig.capacity ({self.capacity}) must hold at least two "
                              f"segments ({self.segment_bytes} bytes each)")  # fmt: skip
        if self.write_queue_bytes <= 0 or not 1 <= self.read_threads <= 64:
            raise ConfigError("DiskConfig: write_queue_bytes > 0 and 1 <= read_threads <= 64")
        if not 0 <= self.rewrite_fraction < 1:
            raise ConfigError("DiskConfig.rewrite_fraction must be in [0, 1)")
        if not self.dir:
            raise ConfigError("DiskConfig.dir: a directory is needed")

    def fits(self, key_len: int, nframes: int, size: int) -> bool:
        """Whether a block's record fits in a segment (beside the segment's header page)."""
        return PAGE + record_bytes(key_len, nframes, size) <= self.segment_bytes


class DiskBlock(NamedTuple):
    """A block read back: its frames, payload bytes and xxh3-64 checksum, and ``held``: bytes
    of the buffer its frames keep alive. The frames are read-only memoryviews over a buffer
    that belongs to whoever holds them (the tier never touches it again), shared by the
    blocks read in the same run (at most ``MAX_RUN_BYTES``; ``held`` says how much): a
    node that keeps one (promotes it to memory) counts ``held``, or copies the frames when
    ``held`` is much larger than ``size``. A block still queued for writing comes back as the
    frames it was offered with (``held`` = ``size``)."""

    frames: tuple[Any, ...]
    size: int
    checksum: int
    held: int


class _Write:
    """A queued record: a block, or a tombstone (no frames, ``FLAG_TOMBSTONE``)."""

    __slots__ = ("checksum", "flags", "frames", "key", "size", "t")

    def __init__(self, key: bytes, frames: tuple, size: int, checksum: int, flags: int) -> None:
        self.key, self.frames, self.size, self.checksum, self.flags = (key, frames, size,
                                                                       checksum, flags)  # fmt: skip
        self.t = time.perf_counter()


class _Batch:
    """One :meth:`DiskTier._submit`, read by ``left`` jobs: ``done`` is called once, by the
    last job to finish."""

    __slots__ = ("done", "left", "lock", "results")

    def __init__(self, results: list, left: int, done: Callable[[list], None]) -> None:
        self.results, self.left, self.done, self.lock = results, left, done, threading.Lock()

    def finish(self, found: list[tuple[int, DiskBlock | None]]) -> None:
        for i, block in found:
            self.results[i] = block
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            try:
                self.done(self.results)
            except Exception:  # the caller's callback: said, never lost in the pool
                log.exception("pagekv disk: a read batch's completion failed")


class _Histogram:
    """Counts per bucket of :data:`LATENCY_BUCKETS` (and above), their sum. The tier's lock."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        return {"buckets": list(LATENCY_BUCKETS), "counts": list(self.counts), "sum": self.sum}


class _Completions:
    """Finished read batches, from reader threads to the node's loop, which polls :attr:`fd`.
    A push appends, then signals; a drain clears the signal, then takes everything: no batch
    is left behind without a signal."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self.closed = False
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._wfd = self.fd
        else:  # pragma: no cover - Linux has eventfd
            self.fd, self._wfd = os.pipe()
            os.set_blocking(self.fd, False)

    def push(self, item: Any) -> None:
        self._items.append(item)
        if not self.closed:
            os.write(self._wfd, (1).to_bytes(8, "little"))

    def drain(self) -> list:
        try:
            os.read(self.fd, 1 << 12)
        except BlockingIOError:
            pass
        items = self._items
        return [items.popleft() for _ in range(len(items))]

    def close(self) -> None:
        self.closed = True
        for fd in {self.fd, self._wfd}:
            os.close(fd)


class DiskTier:
    """The disk tier over ``config.dir``: locks it, rebuilds its index, starts its threads.

    Raises :class:`DiskDirLocked` when another process serves from the directory,
    :class:`DiskFormatError` when it holds another format, :class:`DiskTierError` when it cannot
    be made or opened (permissions, not a directory). Any other I/O error on the way leaves the
    tier off (:attr:`on` False, one log line): the node starts and serves from memory.

    Thread-safety: every method may be called from any thread; the node's loop calls the cheap
    ones (offer, contains, size_of, read_many, completed, delete, stats). ``io`` replaces the
    file system calls (:class:`FileOps`: tests inject failures there).

    ``on_stored(key)`` / ``on_removed(key)``: see the module's docstring (KV events); called
    with the tier's lock held, from any of its threads or callers: they must not call back.
    """

    def __init__(self, config: DiskConfig, *, io: FileOps | None = None) -> None:
        self.config = config
        self.io = io or FileOps()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the writer waits for the queue
        self._room = threading.Condition(self._lock)  # save() waits for room in the queue
        self._index = DiskIndex()
        self._segments: dict[int, Segment] = {}  # id order: oldest first; the active one last
        self._active: Segment | None = None  # written by the writer only
        self._pending: dict[bytes, _Write] = {}  # queued or being written: readable from here
        self._queue: deque[_Write | threading.Event] = deque()
        self._queue_bytes = self._tombstones = 0
        self._used = 0  # bytes of segment and directory files
        self._rewrite_below = 0  # entries in segments with a smaller id are rewritten if offered
        self._error: str | None = None
        self._closing = False
        self._close_deadline = 0.0
        self._writer_done = self._release_when_done = False  # see close()
        self._seq = self._next_id = 1
        self._lock_fd = -1
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.on_stored: Callable[[bytes], Any] | None = None
        self.on_removed: Callable[[bytes], Any] | None = None
        self._read_latency, self._write_latency = _Histogram(), _Histogram()
        self.rebuild_seconds = 0.0
        self._open()
        self._completions = _Completions()
        self._pool = ThreadPoolExecutor(config.read_threads, thread_name_prefix="pagekv-disk-read")
        self._writer = threading.Thread(target=self._run, name="pagekv-disk-writer", daemon=True)
        self._writer.start()

    # ---- opening -----------------------------------------------------------------------------
    def _open(self) -> None:
        cfg = self.config
        try:
            os.makedirs(cfg.dir, exist_ok=True)
            self._lock_fd = _lock_directory(cfg.dir)
            _check_format(cfg.dir)
            self._adopt(recover(cfg.dir, self.io, direct=cfg.direct_reads, verify=cfg.verify_scan))
        except DiskTierError:
            self._release_lock()
            raise
        except OSError as e:
            if e.errno in _MISCONFIGURED:
                self._release_lock()
                raise DiskTierError(f"disk tier directory {cfg.dir}: {e}") from None
            self._io_failed(f"opening {cfg.dir}", e)
            return
        log.info("pagekv disk tier %s: %d blocks, %d bytes in %d segments, index rebuilt in "
                 "%.3f s", cfg.dir, len(self._index), self._used, len(self._segments),
                 self.rebuild_seconds)  # fmt: skip

    def _adopt(self, found: Recovered) -> None:
        """Serve what :func:`recover` found (reclaiming down to a capacity set lower since)."""
        self._index, self._seq, self._next_id = found.index, found.next_seq, found.next_id
        self._segments = {seg.id: seg for seg in found.segments}
        self._used = sum(seg.end for seg in found.segments) + found.directory_bytes
        self.rebuild_seconds = found.seconds
        self.counters.update(rebuild_scanned_bytes=found.scanned_bytes, rebuild_torn=found.torn,
                             rebuild_damaged=found.damaged,
                             rebuild_blocks=len(found.index))  # fmt: skip
        while self._used > self.config.capacity and self._reclaim_oldest():
            pass
        self._update_rewrite_threshold()

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ---- the node's calls --------------------------------------------------------------------
    @property
    def on(self) -> bool:
        """Whether the tier serves: False once it turned itself off (see :attr:`error`)."""
        return self._error is None and not self._closing

    @property
    def error(self) -> str | None:
        """Why the tier turned itself off, or None."""
        return self._error

    @property
    def wakeup_fd(self) -> int:
        """Readable when :meth:`completed` has batches (an eventfd: poll it, never read it)."""
        return self._completions.fd

    def offer(
        self, key: bytes, frames: Sequence[Any], size: int, checksum: int, *, copy: bool = False
    ) -> bool:
        """Queue a block (evicted from memory) for writing; whether it was queued. Never waits.
        ``frames`` (bytes-like, ``size`` bytes in all, ``checksum`` their xxh3-64) are kept by
        reference until written: the caller must not change them (blocks are immutable).
        ``copy``: the caller reuses their memory once this returns (a ``--shm`` segment's
        space): a queued block's frames are copied first (one memcpy, on the calling thread).
        Not queued: the tier is off; the block is larger than a segment; the key is queued
        already, or on disk in a segment young enough; the queue is full (counted)."""
        if self._error is not None or self._closing:
            return False
        if not self.config.fits(len(key), len(frames), size):
            self.counters["write_too_large"] += 1
            return False
        with self._lock:
            return self._enqueue(key, tuple(frames), size, checksum, copy)

    def _enqueue(self, key: bytes, frames: tuple, size: int, checksum: int,
                 copy: bool = False, rewrite: bool = False) -> bool:  # fmt: skip
        """Under the lock: queue a block (a key on disk only where ``rewrite``, or where its
        segment is old enough to be rewritten); whether it was queued."""
        if key in self._pending or self._error is not None:
            return False
        entry = self._index.get(key)
        if entry is not None and not rewrite and entry.seg >= self._rewrite_below:
            self.counters["write_skipped"] += 1
            return False
        if self._queue_bytes + size > self.config.write_queue_bytes:
            self.counters["write_dropped"] += 1
            return False
        if copy:
            frames = tuple(bytes(f) for f in frames)
        item = _Write(key, frames, size, checksum, 0)
        self._pending[key] = item
        self._queue.append(item)
        self._queue_bytes += size
        self.counters["rewrites"] += entry is not None
        if entry is None and self.on_stored is not None:
            self.on_stored(key)
        self._work.notify()
        return True

    def queue_room(self) -> int:
        """Bytes the write queue takes before :meth:`offer` drops blocks (0 when off)."""
        if self._error is not None or self._closing:
            return 0
        return max(0, self.config.write_queue_bytes - self._queue_bytes)

    def keys(self) -> list[bytes]:
        """The keys readable here (on disk or queued for writing), a copy."""
        with self._lock:
            return list(self._index.entries) + [k for k in self._pending if k not in self._index]

    def _gone(self, key: bytes) -> None:
        """Under the lock: ``key`` left the index or the queue; said if it is readable no more."""
        if self.on_removed is not None and key not in self._pending and key not in self._index:
            self.on_removed(key)

    def contains(self, key: bytes) -> bool:
        """Whether a GET of ``key`` may find it here (on disk, or queued for writing)."""
        return key in self._pending or key in self._index

    def holds(self, key: bytes, checksum: int) -> bool:
        """Whether ``key``'s block here (on disk, or queued for writing) is the value with
        ``checksum``: a block read before a DELETE (or a DELETE and a new PUT) is not."""
        item = self._pending.get(key)
        if item is not None:
            return item.checksum == checksum
        entry = self._index.get(key)
        return entry is not None and entry.checksum == checksum

    def size_of(self, key: bytes) -> int | None:
        """Payload bytes of ``key``'s block here, or None: what a GET reply would carry."""
        item = self._pending.get(key)
        if item is not None:
            return item.size
        entry = self._index.get(key)
        return entry.size if entry is not None else None

    def read_many(self, keys: Sequence[bytes], token: Any, *, own: bool = False) -> None:
        """Read ``keys``' blocks; when all are done, ``(token, [DiskBlock or None per key])``
        is queued for :meth:`completed` and :attr:`wakeup_fd` is signalled. Never waits;
        every call completes exactly once (None for a key missing, corrupt, or the tier off).
        ``own``: each block read with others (one buffer for the run) is copied out of it on
        the reader thread, so no block keeps another's bytes alive (``held`` is its record's
        read at most: for blocks the caller keeps, e.g. promotes to memory)."""
        self._submit(keys, lambda blocks: self._completions.push((token, blocks)), own)

    def completed(self) -> list[tuple[Any, list[DiskBlock | None]]]:
        """The read batches finished since the last call, as ``(token, blocks)``."""
        return self._completions.drain()

    def read_many_wait(
        self, keys: Sequence[bytes], timeout_s: float, *, own: bool = False
    ) -> list[DiskBlock | None]:
        """:meth:`read_many` for a thread that may block: the blocks (None where missing), or
        None for every key whose read had not finished within ``timeout_s``."""
        done = threading.Event()
        box: list[list] = []
        self._submit(keys, lambda blocks: (box.append(blocks), done.set()), own)
        if done.wait(timeout_s):
            return list(box[0])
        return [None] * len(keys)

    def delete(self, key: bytes) -> bool:
        """Forget ``key`` (a tombstone is queued, so it stays deleted after a restart);
        whether it was here."""
        with self._lock:
            queued = self._pending.pop(key, None) is not None
            found = self._index.pop(key) is not None or queued
            if found:
                self._gone(key)
            if found and self._error is None:
                if self._tombstones < MAX_TOMBSTONES:
                    self._queue.append(_Write(key, (), 0, 0, FLAG_TOMBSTONE))
                    self._tombstones += 1
                    self._work.notify()
                else:
                    self._unsaved_deletes(1, "too many deletes queued")
            return found

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued before this call is written and synced; whether that
        happened within ``timeout_s`` (False too when the tier is off)."""
        marker = threading.Event()
        with self._lock:
            if self._error is not None:
                return False
            self._queue.append(marker)
            self._work.notify()
        return marker.wait(timeout_s) and self._error is None

    def save(
        self, blocks: Iterable[tuple[bytes, Sequence[Any], int, int]], timeout_s: float
    ) -> int:
        """At shutdown: queue ``blocks`` (``(key, frames, size, checksum)``, most wanted first),
        waiting for room in the queue, until ``timeout_s`` has passed or the blocks so far
        would fill the disk but two segments (more would reclaim the first ones saved, the
        most wanted); how many were queued. A block on disk already is skipped where its
        segment outlives the save's own writes, else written again (the save reclaims the
        oldest segments). :meth:`close` then writes the queue."""
        deadline = time.monotonic() + timeout_s
        room = self.config.capacity - 2 * self.config.segment_bytes
        chosen, incoming = [], 0
        for key, frames, size, checksum in blocks:
            if not self.config.fits(len(key), len(frames), size):
                continue
            need = record_bytes(len(key), len(frames), size)
            if incoming + need > room:
                break
            chosen.append((key, frames, size, checksum))
            incoming += need
        with self._lock:
            kept = self._kept_through(incoming)
        queued = 0
        for key, frames, size, checksum in chosen:
            with self._lock:
                while self._queue_bytes + size > self.config.write_queue_bytes:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._error is not None:
                        return queued
                    self._room.wait(left)
                entry = self._index.get(key)
                if key in self._pending or (entry is not None and entry.seg in kept):
                    continue
                queued += self._enqueue(key, tuple(frames), size, checksum, rewrite=True)
        return queued

    def _kept_through(self, incoming: int) -> set[int]:
        """Under the lock: the segments that writing ``incoming`` more bytes leaves in place,
        at least (the newest, as many as fit in the capacity beside a new segment for every
        ``segment_bytes`` of it and one more: each is made only with that much room)."""
        seg_bytes = self.config.segment_bytes
        room = self.config.capacity - (-(-incoming // seg_bytes) + 1) * seg_bytes
        kept: set[int] = set()
        for seg in reversed(self._segments.values()):
            room -= seg.end + seg.dir_bytes
            if room < 0:
                break
            kept.add(seg.id)
        return kept

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write what is queued (what is left after ``timeout_s`` is dropped), seal the active
        segment (synced, its directory written: the next start scans nothing), wait for reads
        in flight, release the directory (a writer still stuck releases it when it ends).
        Whether the queue was written in full (every delete among it: see
        :meth:`_unsaved_deletes`). Idempotent. The node stops polling :attr:`wakeup_fd` before
        calling it."""
        with self._lock:
            if self._closing:
                return False
            self._closing = True
            self._close_deadline = time.monotonic() + timeout_s
            self._work.notify_all()
        self._writer.join(timeout_s + 5.0)
        dropped = self.counters["write_dropped_at_close"] + self.counters["deletes_unsaved"]
        with self._lock:  # the writer, when it ends, releases the directory in its place
            stuck = self._release_when_done = not self._writer_done
        if stuck:
            log.warning("pagekv disk: the writer is still busy %.0f s after close; leaving it, "
                        "and the directory locked until it ends (a node started on it "
                        "meanwhile could read what it still writes)",
                        timeout_s + 5.0)  # fmt: skip
        self._pool.shutdown(wait=True)
        with self._lock:
            segments = [s for s in self._segments.values() if s.refs == 0]
            for seg in segments:
                seg.dead = True
        for seg in segments:
            seg.close()
        if not stuck:
            self._release_lock()
        clean = not stuck and dropped == 0
        self._completions.close()
        return clean and self._error is None

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """Counters and gauges, each named ``disk_*`` (the node merges them into its stats)."""
        with self._lock:
            out = {f"disk_{k}": v for k, v in self.counters.items()}
            out.update(disk_on=int(self.on), disk_blocks=len(self._index),
                       disk_bytes=self._index.bytes, disk_used_bytes=self._used,
                       disk_capacity=self.config.capacity, disk_segments=len(self._segments),
                       disk_queue_blocks=len(self._pending), disk_queue_bytes=self._queue_bytes,
                       disk_rebuild_s=round(self.rebuild_seconds, 4))  # fmt: skip
        return out

    def histograms(self) -> dict[str, dict[str, Any]]:
        """Latency histograms: ``read`` (a disk read, from its submission to its block checked)
        and ``write`` (a block, from :meth:`offer` to its record written)."""
        with self._lock:
            return {"read": self._read_latency.snapshot(), "write": self._write_latency.snapshot()}

    # ---- reads (reader threads) --------------------------------------------------------------
    def _submit(self, keys: Sequence[bytes], done: Callable[[list], None],
                own: bool = False) -> None:  # fmt: skip
        """Read ``keys`` on up to ``read_threads`` jobs (each a share of them, in order)."""
        results: list[DiskBlock | None] = [None] * len(keys)
        todo = []
        with self._lock:
            if self._error is None and not self._closing:
                for i, key in enumerate(keys):
                    item = self._pending.get(key)
                    if item is not None:
                        results[i] = DiskBlock(item.frames, item.size, item.checksum, item.size)
                        self.counters["hits"] += 1
                    elif key in self._index:
                        todo.append(i)
                    else:
                        self.counters["misses"] += 1
        if not todo:
            done(results)
            return
        jobs = min(len(todo), self.config.read_threads)
        batch = _Batch(results, jobs, done)
        submitted = time.perf_counter()
        for n in range(jobs):  # contiguous shares: records written together stay together
            share = todo[n * len(todo) // jobs : (n + 1) * len(todo) // jobs]
            try:
                self._pool.submit(self._read_job, batch, share, keys, submitted, own)
            except RuntimeError:  # closed meanwhile: these are misses
                batch.finish([])

    def _read_job(self, batch: _Batch, share: list[int], keys: Sequence[bytes], t: float,
                  own: bool) -> None:  # fmt: skip
        """Read a share of a batch: its records looked up (and their segments pinned) at once,
        then read run by run (records next to each other in a segment: one read)."""
        found: list[tuple[int, DiskBlock | None]] = []
        try:
            plan = []
            with self._lock:
                for i in share:
                    entry = self._index.get(keys[i]) if self._error is None else None
                    if entry is None:
                        self.counters["misses"] += 1
                        continue
                    seg = self._segments[entry.seg]
                    seg.refs += 1
                    plan.append((keys[i], i, entry, seg))
            for run in _runs(plan):
                found += self._read_run(run, t, own)
        except BaseException as e:  # a bug: said once, tier off, the batch still completes
            self._disable(f"a read failed unexpectedly: {e!r}", exc=e)
        batch.finish(found)

    def _read_run(self, run: list[tuple[bytes, int, Entry, Segment]], submitted: float,
                  own: bool = False) -> list[tuple[int, DiskBlock | None]]:  # fmt: skip
        """Read records lying back to back in one segment (pinned by the caller, unpinned
        here) with one read, and check each: a bad one is a miss and is dropped. ``own``:
        the blocks of a run of several are copied out of its buffer."""
        seg, start, last = run[0][3], run[0][2].offset, run[-1][2]
        try:
            data: memoryview | OSError | None = seg.read(
                start, last.offset + last.header_len + last.size - start
            )
        except OSError as e:
            data = e
        found = []
        for key, i, entry, _ in run:
            block = None
            if isinstance(data, memoryview):
                at = entry.offset - start
                record = data[at : at + entry.header_len + entry.size]
                block = _checked(record, key, entry, len(data))
                if own and block is not None and len(run) > 1:
                    block = _owned(block)
            found.append((i, block))
        bad = self._settle(run, found, submitted, dropped=not isinstance(data, OSError))
        if isinstance(data, OSError):
            self._io_failed(f"reading {seg.path}", data)
        elif bad is not None:
            log.warning("pagekv disk: %s: the record at offset %d does not match its checksum "
                        "or key; dropped (a miss)", seg.path, bad.offset)  # fmt: skip
        return found

    def _settle(self, run: list, found: list, submitted: float, dropped: bool) -> Entry | None:
        """Unpin the run's segment and count its outcome: hits, and misses (dropped from the
        index, as corrupt, unless the read failed); the first corrupt entry to be said (the
        first 10 are), or None."""
        now, seg, bad = time.perf_counter(), run[0][3], None
        with self._lock:
            self.counters["read_ops"] += 1
            seg.refs -= len(run)
            last = seg.dead and seg.refs == 0
            for (key, _, entry, _), (_, block) in zip(run, found):
                if block is not None:
                    self.counters["hits"] += 1
                    self.counters["read_bytes"] += entry.size
                    self._read_latency.observe(now - submitted)
                    continue
                self.counters["misses"] += 1
                if dropped:
                    if self._index.drop(key, entry):
                        self._gone(key)
                    self.counters["corrupt"] += 1
                    if bad is None and self.counters["corrupt"] <= 10:
                        bad = entry
        if last:
            seg.close()
        return bad

    def _unref(self, seg: Segment) -> None:
        with self._lock:
            seg.refs -= 1
            last = seg.dead and seg.refs == 0
        if last:
            seg.close()

    # ---- writes (the writer thread) ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                taken = self._take()
                if taken is None:
                    break
                batch, marker = taken
                if batch:
                    self._write(batch)
                if marker is not None:
                    if self._active is not None:
                        self._active.sync()
                    marker.set()
            if self._error is None and self._active is not None:
                self._seal(self._active)
        except OSError as e:
            self._io_failed("writing", e)
        except BaseException as e:
            self._disable(f"the writer failed unexpectedly: {e!r}", exc=e)
        finally:
            if self._active is not None:
                seg, self._active = self._active, None
                self._unref(seg)
            with self._lock:  # close() gave up waiting: the directory is released here
                self._writer_done, release = True, self._release_when_done
            if release:
                self._release_lock()

    def _take(self) -> tuple[list[_Write], threading.Event | None] | None:
        """The next records to write, in queue order (at most one pwritev's worth), or a flush
        marker; None when the writer should stop."""
        with self._lock:
            while not self._queue and not self._closing and self._error is None:
                self._work.wait()
            if self._error is not None or not self._queue:
                return None
            if self._closing and time.monotonic() > self._close_deadline:
                self._drop_blocks("write_dropped_at_close")  # deletes are still written
                if not self._queue:
                    return None
            batch: list[_Write] = []
            nbytes = pieces = 0
            while self._queue:
                item = self._queue[0]
                if isinstance(item, threading.Event):
                    if batch:
                        break
                    self._queue.popleft()
                    return [], item
                if batch and (nbytes + item.size > WRITE_BATCH_BYTES
                              or pieces + len(item.frames) + 2 > IOV_MAX):  # fmt: skip
                    break
                self._queue.popleft()
                if item.flags & FLAG_TOMBSTONE:
                    self._tombstones -= 1
                elif self._pending.get(item.key) is not item:  # deleted since it was queued
                    self._queue_bytes -= item.size
                    continue
                batch.append(item)
                nbytes += item.size
                pieces += len(item.frames) + 2
            return batch, None

    def _write(self, batch: list[_Write]) -> None:
        """Append ``batch``'s records, segment by segment, one pwritev per segment touched."""
        i = 0
        while i < len(batch) and self._error is None:
            seg = self._room_for(_span(batch[i]))
            if isinstance(seg, str):
                self._drop(batch[i:], seg)
                return
            pieces, records, end = self._lay_out(seg, batch[i:])
            if not records:  # larger than a segment: offer() lets none through
                self._drop(batch[i : i + 1], "write_too_large")
                i += 1
            elif self._append(seg, pieces, seg.end, end):
                self._publish(seg, batch[i : i + len(records)], records, end)
            else:
                self._drop(batch[i : i + len(records)], "write_nospace")
            i += len(records)

    def _lay_out(self, seg: Segment, items: list[_Write]) -> tuple[list, list[Record], int]:
        """The pieces to write at ``seg.end`` for the leading ``items`` that fit in ``seg``."""
        pieces: list[Any] = []
        records: list[Record] = []
        pos = seg.end
        for item in items:
            start = align_up(pos, RECORD_ALIGN)
            frames = [memoryview(f) for f in item.frames]
            header = pack_record_header(item.key, self._seq, [f.nbytes for f in frames],
                                        item.checksum, item.flags)  # fmt: skip
            if start + len(header) + item.size > self.config.segment_bytes:
                break
            if start > pos:
                pieces.append(_ZEROS[: start - pos])
            pieces.append(header)
            pieces.extend(frames)
            records.append(Record(item.key, item.flags, self._seq, start, len(header),
                                  item.size, item.checksum))  # fmt: skip
            self._seq += 1
            pos = start + len(header) + item.size
        return pieces, records, pos

    def _append(self, seg: Segment, pieces: list, offset: int, end: int) -> bool:
        """Write ``pieces`` at ``offset``; on a full disk, cut the partial write off, reclaim
        the oldest segment and try once more. Whether they were written."""
        for attempt in (0, 1):
            try:
                seg.append(list(pieces), offset)
                return True
            except OSError as e:
                if e.errno not in NO_SPACE:
                    raise
                seg.truncate(offset)
                if attempt or not self._reclaim_oldest():
                    return False
        return False

    def _publish(self, seg: Segment, items: list[_Write], records: list[Record], end: int) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._error is not None:
                return
            for item, record in zip(items, records):
                seg.records.append(record)
                seg.keys.append(item.key)
                if item.flags & FLAG_TOMBSTONE:
                    continue
                self._queue_bytes -= item.size
                if self._pending.get(item.key) is item:  # indexed first: never in neither
                    self._index.put(item.key, entry_of(seg.id, record))
                    del self._pending[item.key]
                self._write_latency.observe(now - item.t)
                self.counters["writes"] += 1
                self.counters["write_bytes"] += item.size
            self._used += end - seg.end
            seg.end = end
            self._room.notify_all()

    def _drop(self, items: list[_Write], counter: str) -> None:
        with self._lock:
            if self._error is not None:
                return
            tombstones = 0
            for item in items:
                if item.flags & FLAG_TOMBSTONE:
                    tombstones += 1
                    continue
                self._queue_bytes -= item.size
                if self._pending.get(item.key) is item:
                    del self._pending[item.key]
                    self._gone(item.key)
                self.counters[counter] += 1
            if tombstones:
                self._unsaved_deletes(tombstones, counter.removeprefix("write_"))
            self._room.notify_all()

    def _drop_blocks(self, counter: str) -> None:
        """Under the lock: forget the blocks queued, keep the deletes (a few bytes each)."""
        kept: deque = deque()
        rest: deque = deque()
        for item in self._queue:
            tombstone = not isinstance(item, threading.Event) and item.flags & FLAG_TOMBSTONE
            (kept if tombstone else rest).append(item)
        self._queue = rest
        self._drop_queue(counter)
        self._queue, self._tombstones = kept, len(kept)

    def _unsaved_deletes(self, count: int, why: str) -> None:
        """Under the lock: ``count`` deletes that no tombstone records on disk: their keys
        come back after a restart. Counted, said (as the count reaches each power of two),
        and the shutdown is not clean."""
        before = self.counters["deletes_unsaved"]
        self.counters["deletes_unsaved"] = before + count
        if (before + count).bit_length() > before.bit_length():
            log.warning(
                "pagekv disk tier %s: %d delete(s) not saved (%s): those keys are "
                "served again after a restart",
                self.config.dir,
                before + count,
                why,
            )

    def _drop_queue(self, counter: str) -> None:
        """Under the lock: forget everything queued (flush markers are set)."""
        tombstones = 0
        for item in self._queue:
            if isinstance(item, threading.Event):
                item.set()
            elif not item.flags & FLAG_TOMBSTONE:
                self.counters[counter] += 1
            else:
                tombstones += 1
        if tombstones:
            self._unsaved_deletes(tombstones, counter.removeprefix("write_"))
        self._queue.clear()
        pending, self._pending = self._pending, {}
        for key in pending:
            self._gone(key)
        self._queue_bytes = self._tombstones = 0
        self._room.notify_all()

    # ---- segments (the writer thread) --------------------------------------------------------
    def _room_for(self, span: int) -> Segment | str:
        """The active segment, with room for a record of ``span`` bytes: the current one, or a
        new one (the full one sealed, the oldest reclaimed while the disk is over capacity).
        Else the counter of the blocks that costs: ``write_nospace`` (the disk is full and
        nothing is left to reclaim), ``write_no_descriptor`` (none free to open a segment)."""
        seg = self._active
        if seg is not None and align_up(seg.end, RECORD_ALIGN) + span <= self.config.segment_bytes:
            return seg
        if seg is not None:
            self._seal(seg)
        # room for a full segment and its directory (as large as the largest so far)
        with self._lock:
            reserve = max((s.dir_bytes for s in self._segments.values()), default=0)
        while self._used + self.config.segment_bytes + reserve > self.config.capacity:
            if not self._reclaim_oldest():
                break
        for attempt in (0, 1):
            try:
                seg = Segment.create(self.config.dir, segment_name(self._next_id), self._next_id,
                                     time.time_ns(), self.io)  # fmt: skip
                break
            except OSError as e:
                if e.errno in NO_DESCRIPTOR:
                    return "write_no_descriptor"
                if e.errno not in NO_SPACE:
                    raise
                if attempt or not self._reclaim_oldest():
                    return "write_nospace"
        self._next_id += 1
        seg.refs = 1  # the writer's, until it seals the segment
        with self._lock:
            self._segments[seg.id] = seg
            self._used += seg.end
            self._update_rewrite_threshold()
        self._active = seg
        return seg

    def _seal(self, seg: Segment) -> None:
        """Sync the segment, write its directory, read it from disk from here on."""
        seg.sync()
        dir_bytes = write_directory(self.io, self.config.dir, seg)  # 0: none, for now
        seg.records = []
        self.io.fadvise_dontneed(seg.fd)
        if self.config.direct_reads:
            seg.open_direct()
        with self._lock:
            seg.sealed = True
            seg.dir_bytes = dir_bytes
            self._used += dir_bytes
        self._active = None
        self._unref(seg)

    def _reclaim_oldest(self) -> bool:
        """Remove the oldest sealed segment and its blocks from the index; whether one was."""
        with self._lock:
            seg = next((s for s in self._segments.values() if s is not self._active), None)
            if seg is None:
                return False
            del self._segments[seg.id]
            dropped = 0
            for key in seg.keys:
                entry = self._index.get(key)
                if entry is not None and entry.seg == seg.id:
                    self._index.pop(key)
                    self._gone(key)
                    dropped += 1
            seg.dead = True
            self._used -= seg.end + seg.dir_bytes
            close = seg.refs == 0
            self.counters["reclaimed_segments"] += 1
            self.counters["reclaimed_blocks"] += dropped
            self.counters["reclaimed_bytes"] += seg.end
            self._update_rewrite_threshold()
        if close:
            seg.close()
        for path in (seg.path, os.path.join(self.config.dir, directory_name(seg.id))):
            try:
                self.io.unlink(path)
            except FileNotFoundError:
                pass
        return True

    def _update_rewrite_threshold(self) -> None:
        """Under the lock: the segment id below which an offered block is written again."""
        ids = list(self._segments)
        old = int(len(ids) * self.config.rewrite_fraction)
        self._rewrite_below = ids[old] if 0 < old < len(ids) else 0

    # ---- turning off -------------------------------------------------------------------------
    def _io_failed(self, what: str, error: OSError) -> None:
        self._disable(f"{what}: {error.strerror or error} (errno {error.errno})")

    def _disable(self, reason: str, exc: BaseException | None = None) -> None:
        """Turn the tier off for good (said once): every later call misses or does nothing."""
        with self._lock:
            if self._error is not None:
                return
            # said before the tier reads as off (``on``, ``error``) and before anyone waiting
            # (flush, save) is woken: whoever sees it off finds the line
            log.error("pagekv disk tier %s off: %s; serving from memory only", self.config.dir,
                      reason, exc_info=exc)  # fmt: skip
            self._error = reason
            self._drop_queue("write_dropped_off")
            gone = list(self._index.entries) if self.on_removed is not None else []
            self._index.clear()
            for key in gone:
                self._gone(key)
            idle = [s for s in self._segments.values() if s.refs == 0]
            for seg in self._segments.values():
                seg.dead = True
            self._segments.clear()
            self._used = 0
            self._work.notify_all()
        for seg in idle:
            seg.close()


_COUNTERS = (
    "hits", "misses", "read_bytes", "read_ops", "corrupt", "writes", "write_bytes", "write_skipped",
    "rewrites", "write_dropped", "write_nospace", "write_no_descriptor",
    "write_too_large", "write_dropped_at_close", "deletes_unsaved",
    "write_dropped_off", "reclaimed_segments", "reclaimed_blocks", "reclaimed_bytes",
    "rebuild_blocks", "rebuild_scanned_bytes", "rebuild_torn", "rebuild_damaged",
)  # fmt: skip


MAX_RUN_BYTES = 4 << 20  # records read together: the blocks share this buffer while held


def _runs(plan: list[tuple[bytes, int, Entry, Segment]]) -> list[list]:
    """``plan``'s records in disk order, cut into runs of records that lie back to back in one
    segment, each at most ``MAX_RUN_BYTES`` (or one record)."""
    runs: list[list] = []
    end = -1
    for item in sorted(plan, key=lambda p: (p[2].seg, p[2].offset)):
        entry = item[2]
        run = runs[-1] if runs else None
        if (run is not None and run[-1][2].seg == entry.seg and entry.offset == end
                and entry.offset + entry.header_len + entry.size - run[0][2].offset
                <= MAX_RUN_BYTES):  # fmt: skip
            run.append(item)
        else:
            runs.append([item])
        end = align_up(entry.offset + entry.header_len + entry.size, RECORD_ALIGN)
    return runs


def _span(item: _Write) -> int:
    return record_bytes(len(item.key), len(item.frames), item.size)


def _checked(record: memoryview, key: bytes, entry: Entry, held: int) -> DiskBlock | None:
    """The block in ``record`` (its header and payload, as read, in a buffer of ``held``
    bytes) when it is intact and is the one the index names (key, sequence number, lengths,
    checksum), else None."""
    sizes = check_record_header(record, key, entry.seq, entry.header_len, entry.size,
                                entry.checksum)  # fmt: skip
    if sizes is None:
        return None
    payload = record[entry.header_len :].toreadonly()
    if payload_checksum(payload) != entry.checksum:
        return None
    if len(sizes) == 1:
        return DiskBlock((payload,), entry.size, entry.checksum, held)
    frames, pos = [], 0
    for size in sizes:
        frames.append(payload[pos : pos + size])
        pos += size
    return DiskBlock(tuple(frames), entry.size, entry.checksum, held)


def _owned(block: DiskBlock) -> DiskBlock:
    """``block`` with its frames copied into one buffer of its own (``held`` = its size)."""
    view = memoryview(b"".join(block.frames))
    frames, pos = [], 0
    for frame in block.frames:
        frames.append(view[pos : pos + frame.nbytes])
        pos += frame.nbytes
    return DiskBlock(tuple(frames), block.size, block.checksum, block.size)


def _lock_directory(directory: str) -> int:
    """An exclusive flock on ``directory/lock`` (held until its descriptor is closed), with
    this process's pid in it. Raises :class:`DiskDirLocked` naming the holder's pid."""
    path = os.path.join(directory, "lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiskDirLocked(
            f"disk tier directory {directory} is in use by another process "
            f"(pid {holder}); give each node a directory of its own"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _check_format(directory: str) -> None:
    """Write the format file into a new directory; refuse one that holds another format."""
    path = os.path.join(directory, "format")
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(FORMAT_TEXT)
        os.replace(tmp, path)
        return
    if text != FORMAT_TEXT:
        raise DiskFormatError(f"{path} says {text.strip()!r}; this pagekv reads "
                              f"{FORMAT_TEXT.strip()!r}: point the disk tier at another "
                              "directory, or empty this one")  # fmt: skip
