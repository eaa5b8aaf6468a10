"""A node's shared-memory segment (``pagekv serve --shm``): one file under /dev/shm holding the
bytes of every block, so that clients on the same host and of the same user copy them straight
out of it (:mod:`.shm_reader`) instead of receiving them over TCP.

Layout of the file: a generation table (one native-order uint64 per granule of the data area),
then the data area (``capacity`` bytes rounded up to whole granules) at ``data_offset``. An
allocation is a run of whole granules; when it is made, every granule it covers gets a fresh
generation number (a counter that only grows) *before* any byte of its data is written.

Why a reader can never accept torn bytes: a reader is told a block's offset, frame lengths,
checksum and generation ``g`` (LOCATE). It copies the bytes, then reads the generations of the
block's granules. Any later allocation that overlaps the block (the only way its bytes can
change: blocks are immutable and freeing writes nothing) stores a new generation ``g' > g``
into every granule it covers before writing its data. Stores become visible in program order
and loads are not reordered with other loads on x86-64 (TSO), so if the reader still sees ``g``
in every granule after its copy, no overlapping write was visible during the copy. The
checksum of the copied bytes is checked as well (on weakly ordered CPUs, where the argument
above needs fences Python cannot issue, it is what stands between a torn read and the caller).

The node owns the file: created with ``O_EXCL``, mode 0600 (only this user can map it), its
space reserved up front (``posix_fallocate``: a full /dev/shm is an error at start, never a
SIGBUS later), never truncated while the node runs (a client's mapping of a shortened file
would SIGBUS on access), unlinked at exit. A node killed with SIGKILL cannot unlink it; the
next node started by the same user removes segments whose node process is gone.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pagekv.errors import ConfigError

from ..wire.shm import GRANULE

__all__ = ["GRANULE", "Extent", "FreeSpace", "Segment"]

log = logging.getLogger("pagekv.store")

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^pagekv-seg-(\d+)-[0-9a-f]+$")


@dataclass(frozen=True)
class Extent:
    """A run of granules of the data area: ``start`` and ``count`` in granules."""

    start: int
    count: int


class FreeSpace:
    """Best-fit allocator over ``total`` granules with coalescing of freed neighbours.
    Free runs are indexed by start, by end and in a sorted list of ``(count, start)``."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free_granules = total
        self._by_start: dict[int, int] = {0: total} if total else {}
        self._by_end: dict[int, int] = {total: 0} if total else {}
        self._sizes: list[tuple[int, int]] = [(total, 0)] if total else []

    def alloc(self, count: int) -> Extent | None:
        """The smallest free run that holds ``count`` granules (its head), or None."""
        i = bisect.bisect_left(self._sizes, (count, -1))
        if i == len(self._sizes):
            return None
        size, start = self._sizes.pop(i)
        del self._by_start[start], self._by_end[start + size]
        if size > count:
            self._add(start + count, size - count)
        self.free_granules -= count
        return Extent(start, count)

    def free(self, extent: Extent) -> None:
        start, count = extent.start, extent.count
        self.free_granules += count
        after = self._by_start.get(start + count)
        if after is not None:
            self._remove(start + count, after)
            count += after
        before = self._by_end.get(start)
        if before is not None:
            self._remove(before, start - before)
            count += start - before
            start = before
        self._add(start, count)

    def _add(self, start: int, count: int) -> None:
        self._by_start[start], self._by_end[start + count] = count, start
        bisect.insort(self._sizes, (count, start))

    def _remove(self, start: int, count: int) -> None:
        del self._by_start[start], self._by_end[start + count]
        self._sizes.pop(bisect.bisect_left(self._sizes, (count, start)))


class Segment:
    """The node's segment file, mapped read-write. Owned by the node's loop thread."""

    def __init__(self, capacity: int, directory: str = SHM_DIR) -> None:
        self.granules = -(-capacity // GRANULE)
        table = -(-self.granules * 8 // GRANULE) * GRANULE
        self.data_offset = table
        self.size = table + self.granules * GRANULE
        remove_stale_segments(directory)
        self.path = os.path.join(directory, f"pagekv-seg-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                raise ConfigError(
                    f"--shm: cannot reserve {self.size} bytes in {directory} ({e.strerror}); "
                    "lower --capacity or make the tmpfs larger"
                ) from None
            self.inode = os.fstat(fd).st_ino
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.view = memoryview(self._map)
        self.gens = self.view[: self.granules * 8].cast("Q")  # native order: same host only
        self.space = FreeSpace(self.granules)
        self._next_gen = 1

    def advert(self, host: str) -> dict[str, Any]:
        """What a PING or LOCATE reply tells clients about this segment (``shm``)."""
        return {"path": self.path, "size": self.size, "inode": self.inode, "host": host,
                "data_offset": self.data_offset, "granule": GRANULE,
                "granules": self.granules, "writes": 1}  # fmt: skip

    def alloc(self, nbytes: int) -> tuple[Extent, int] | None:
        """Room for ``nbytes`` (whole granules) and its fresh generation, stamped into every
        granule it covers before the caller writes a byte; None when no free run is large
        enough (the caller evicts and tries again)."""
        extent = self.space.alloc(max(1, -(-nbytes // GRANULE)))
        if extent is None:
            return None
        gen, self._next_gen = self._next_gen, self._next_gen + 1
        self.gens[extent.start : extent.start + extent.count] = (
            array.array("Q", [gen]) * extent.count
        )
        return extent, gen

    def offset(self, extent: Extent) -> int:
        """Byte offset in the file of an extent's first byte."""
        return self.data_offset + extent.start * GRANULE

    def write(self, offset: int, frames: tuple[Any, ...]) -> tuple[memoryview, ...]:
        """Copy ``frames`` one after another from ``offset``; returns read-only views of the
        copies (kept by the block; valid while the segment lives)."""
        views, pos, whole = [], offset, self.view
        for frame in frames:
            n = len(frame)
            whole[pos : pos + n] = memoryview(frame)  # a zmq.Frame itself crashes pyzmq 27 here
            views.append(whole[pos : pos + n].toreadonly())
            pos += n
        return tuple(views)

    def views(self, offset: int, sizes: list[int]) -> tuple[memoryview, ...]:
        """Read-only views of frames of ``sizes`` lying back to back from ``offset``."""
        views, pos = [], offset
        for n in sizes:
            views.append(self.view[pos : pos + n].toreadonly())
            pos += n
        return tuple(views)

    def used_bytes(self) -> int:
        return (self.space.total - self.space.free_granules) * GRANULE

    def free_bytes(self) -> int:
        return self.space.free_granules * GRANULE

    def unlink(self) -> None:
        """Remove the file's name (mappings stay valid); the node calls it at exit."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def remove_stale_segments(directory: str = SHM_DIR) -> int:
    """Unlink this user's segments left by nodes that no longer run (killed with SIGKILL).
    A live pid (even reused by another process) keeps its file. Returns how many went."""
    removed, uid = 0, os.getuid()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            match = _NAME.match(name)
            if match is None or _alive(int(match.group(1))):
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if os.stat(path).st_uid == uid:
                    os.unlink(path)
                    removed += 1
    if removed:
        log.info("pagekv node: removed %d segment(s) of nodes no longer running", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
