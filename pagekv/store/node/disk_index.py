"""The disk tier's index (key -> its newest record) and its rebuild at start.

The checkpoint of the index is per segment: when the writer seals a segment it writes the
segment's directory (:func:`write_directory`: every record's key and place, synced, renamed into
place). A restart (:func:`recover`) loads the directories of sealed segments (one read and one
``struct`` pass each, no data read) and scans only the segments that have none: the one that was
being written when the process stopped, whose torn tail (a record whose write had not
completed) is cut off. Records are applied in write order (segment ids, then offsets, grow with
``seq``), so a key's later record wins and a tombstone deletes it.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .disk_format import (
    FLAG_TOMBSTONE,
    PAGE,
    directory_name,
    directory_rows,
    pack_directory,
    parse_directory,
    segment_id_of,
)
from .disk_segment import FileOps, Segment, scan_segment

__all__ = [
    "NO_DESCRIPTOR",
    "NO_SPACE",
    "DiskIndex",
    "Entry",
    "Recovered",
    "load_directory",
    "recover",
    "write_directory",
]

log = logging.getLogger("pagekv.store.disk")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)  # for a moment: a flood of peers holds them all


class Entry(NamedTuple):
    """Where a key's record lies. Made with ``tuple.__new__`` on hot paths."""

    seg: int
    offset: int
    header_len: int
    size: int  # payload bytes
    checksum: int
    seq: int


_new_entry = tuple.__new__


def entry_of(seg_id: int, record: Any) -> Entry:
    return _new_entry(Entry, (seg_id, record.offset, record.header_len, record.payload_len,
                              record.checksum, record.seq))  # fmt: skip


class DiskIndex:
    """key -> :class:`Entry`, and the payload bytes of the entries. Not thread-safe: the tier
    uses it under its lock (but ``in`` and :meth:`get` are single dict operations, which other
    threads may make without it)."""

    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> Entry | None:
        return self.entries.get(key)

    def put(self, key: bytes, entry: Entry) -> None:
        old = self.entries.get(key)
        if old is not None:
            self.bytes -= old.size
        self.entries[key] = entry
        self.bytes += entry.size

    def pop(self, key: bytes) -> Entry | None:
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        return old

    def drop(self, key: bytes, entry: Entry) -> bool:
        """Remove ``key`` if ``entry`` is still its record (not a later one)."""
        if self.entries.get(key) is not entry:
            return False
        del self.entries[key]
        self.bytes -= entry.size
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def write_directory(io: FileOps, directory: str, seg: Segment) -> int:
    """Write ``seg``'s directory (call after its data was synced); its size in bytes, or 0
    when the file system has no room or no descriptor for it now (nothing left behind:
    without its directory the next start scans the segment, slower and as correct). Raises
    ``OSError`` for the rest."""
    data = pack_directory(seg.id, seg.end, seg.records)
    path = os.path.join(directory, directory_name(seg.id))
    tmp = path + ".tmp"
    try:
        fd = io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view, offset = memoryview(data), 0
            while offset < len(data):
                offset += io.pwritev(fd, [view[offset:]], offset)
            io.fdatasync(fd)
        finally:
            io.close(fd)
        io.replace(tmp, path)
    except OSError as e:
        if e.errno not in NO_SPACE + NO_DESCRIPTOR:
            raise
        try:
            io.unlink(tmp)
        except OSError:
            pass  # never made, or the file system refuses even this: a restart removes it
        return 0
    return len(data)


def load_directory(io: FileOps, path: str) -> tuple[int, int, list[bytes], list[tuple]] | None:
    """A directory file's contents (:func:`.disk_format.parse_directory`), or None when it is
    missing or not intact."""
    try:
        fd = io.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        buf, got = bytearray(size), 0
        while got < size:
            n = io.preadv(fd, [memoryview(buf)[got:]], got)
            if n == 0:
                return None
            got += n
    finally:
        io.close(fd)
    return parse_directory(bytes(buf))


@dataclass
class Recovered:
    """What :func:`recover` found: sealed segments (id order), the index, what comes next."""

    segments: list[Segment] = field(default_factory=list)
    index: DiskIndex = field(default_factory=DiskIndex)
    directory_bytes: int = 0  # of the directory files
    next_seq: int = 1
    next_id: int = 1
    scanned_bytes: int = 0  # segment bytes read because they had no directory
    torn: int = 0  # segments cut back to their last intact record
    damaged: int = 0  # records skipped by a scan: a whole header, a payload failing its checksum
    seconds: float = 0.0


def recover(directory: str, io: FileOps, *, direct: bool, verify: bool) -> Recovered:
    """Rebuild the index of ``directory`` (which the caller has locked): directories where
    intact, scans elsewhere; torn tails cut off, scanned segments synced and given their
    directory (so the next start reads it), leftover temporary and orphan files removed.
    The cyclic garbage collector is paused meanwhile (a pass per 700 new index entries made
    the rebuild twice as slow). Raises ``OSError`` from the file system."""
    start = time.perf_counter()
    out = Recovered()
    names = os.listdir(directory)
    ids = sorted(i for i in (segment_id_of(n, ".seg") for n in names) if i is not None)
    for name in names:
        seg_id = segment_id_of(name, ".dir")
        if name.endswith(".tmp") or (seg_id is not None and seg_id not in ids):
            io.unlink(os.path.join(directory, name))
    collecting = gc.isenabled()
    gc.disable()
    try:
        for seg_id in ids:
            keys, rows, seg = _recover_segment(directory, seg_id, io, direct, verify, out)
            if seg is None:
                continue
            out.segments.append(seg)
            seg.keys = keys
            _apply(out.index, seg_id, keys, rows)
            if rows:
                out.next_seq = max(out.next_seq, rows[-1][0] + 1)
    except BaseException:
        for seg in out.segments:
            seg.close()
        raise
    finally:
        if collecting:
            gc.enable()
    if ids:
        out.next_id = ids[-1] + 1
    out.seconds = time.perf_counter() - start
    return out


def _recover_segment(
    directory: str, seg_id: int, io: FileOps, direct: bool, verify: bool, out: Recovered
) -> tuple[list[bytes], list[tuple], Segment | None]:
    """One segment: its keys and directory rows, and the segment opened sealed (None: it
    held nothing and was removed)."""
    path = os.path.join(directory, f"{seg_id:016x}.seg")
    dir_path = os.path.join(directory, directory_name(seg_id))
    size = os.stat(path).st_size
    found = load_directory(io, dir_path)
    if found is not None and found[0] == seg_id and found[1] <= size:
        _, end, keys, rows = found
        if end < size:  # appended after its directory was written: never done; cut it
            _truncate(io, path, end)
        seg = Segment.open_sealed(path, seg_id, end, io, direct)
        seg.dir_bytes = os.stat(dir_path).st_size
        out.directory_bytes += seg.dir_bytes
        return keys, rows, seg
    fd = io.open(path, os.O_RDWR)
    try:
        records, end, damaged = scan_segment(io, fd, size, verify)
        out.scanned_bytes += size
        if damaged:
            log.warning("pagekv disk: %s: %d damaged record(s) skipped (their payload fails "
                        "its checksum)", path, damaged)  # fmt: skip
            out.damaged += damaged
        if not records:  # created, nothing written (or not even its header): of no use
            if size > PAGE:
                log.warning("pagekv disk: %s: no intact record in %d bytes; removed", path, size)
            io.close(fd)
            fd = -1
            io.unlink(path)
            return [], [], None
        if end < size:
            log.warning("pagekv disk: %s: cut at %d of %d bytes (a write that had not "
                        "completed)", path, end, size)  # fmt: skip
            io.ftruncate(fd, end)
            out.torn += 1
        io.fdatasync(fd)
    finally:
        if fd >= 0:
            io.close(fd)
    seg = Segment.open_sealed(path, seg_id, end, io, direct)
    seg.records = records
    seg.dir_bytes = write_directory(io, directory, seg)
    out.directory_bytes += seg.dir_bytes
    seg.records = []
    return (*directory_rows(records), seg)


def _truncate(io: FileOps, path: str, length: int) -> None:
    fd = io.open(path, os.O_RDWR)
    try:
        io.ftruncate(fd, max(length, PAGE))
    finally:
        io.close(fd)


def _apply(index: DiskIndex, seg_id: int, keys: list[bytes], rows: list[tuple]) -> None:
    """Index one segment's records, in write order (a later record of a key wins)."""
    entries, total, new = index.entries, index.bytes, tuple.__new__
    for key, (seq, offset, plen, checksum, hlen, _, flags) in zip(keys, rows):
        old = entries.pop(key, None)
        if old is not None:
            total -= old.size
        if not flags & FLAG_TOMBSTONE:
            entries[key] = new(Entry, (seg_id, offset, hlen, plen, checksum, seq))
            total += plen
    index.bytes = total
