"""One segment file of the disk tier: appended by one writer, read by many, scanned at restart.

Writes are buffered (``pwritev`` of a record's header and the block's frames as they are, no
copy in Python, the GIL released): the kernel holds them from the moment the call returns, so a
process killed at any point loses only records whose write had not returned. A segment is
synced (``fdatasync``) when it is sealed, after which its pages are dropped from the page cache
and it is read with ``O_DIRECT`` (where the file system has it): a read costs one aligned
``preadv`` straight into the buffer the reply is sent from, and the node's memory stays its own.
The active (unsealed) segment is read through the page cache, where its recent records are.

:class:`FileOps` is every system call the tier makes on its files: the one seam where tests
inject ``ENOSPC``, ``EIO`` and ``EROFS`` (``tests/test_store_disk.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash

from .disk_format import (
    FLAG_TOMBSTONE,
    PAGE,
    RECORD_ALIGN,
    Record,
    align_up,
    pack_segment_header,
    parse_record_header,
    parse_segment_header,
)

__all__ = ["FileOps", "Segment", "aligned_buffer", "payload_checksum", "scan_segment"]

IOV_MAX = 1024  # iovecs per pwritev (Linux's UIO_MAXIOV)
SCAN_CHUNK = 16 << 20  # a restart scan reads this much per call


class FileOps:
    """The file system calls of the disk tier. Thread-safe (no state). Tests subclass it to make
    chosen calls fail; every method raises ``OSError`` as the system call would."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fadvise_dontneed(self, fd: int) -> None:
        """Drop the file's pages from the page cache: advice, so never an error."""
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "posix_memalign"):
        return None
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                    ctypes.c_size_t]  # fmt: skip
    libc.posix_memalign.restype = ctypes.c_int
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


class _Freed:
    """Frees its memory when the array holding it (and so every view of it) is gone."""

    __slots__ = ("address", "free")

    def __init__(self, address: int, free: Any) -> None:
        self.address, self.free = address, free

    def __del__(self) -> None:
        self.free(self.address)


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` at a ``PAGE``-aligned address, not zeroed (its bytes are
    unspecified until written). It lives as long as any view of it does. From ``posix_memalign``
    (no memset under the GIL, reused from malloc's heap), else a bytearray cut to alignment."""
    libc = _libc()
    if libc is not None and nbytes > 0:
        address = ctypes.c_void_p()
        if libc.posix_memalign(ctypes.byref(address), PAGE, nbytes) == 0:
            array = (ctypes.c_char * nbytes).from_address(address.value)
            array._freed = _Freed(address.value, libc.free)
            return memoryview(array).cast("B")
    raw = bytearray(nbytes + PAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % PAGE
    return memoryview(raw)[start : start + nbytes]


def payload_checksum(payload: memoryview) -> int:
    """xxh3-64 of a payload (the streaming form: it releases the GIL on large inputs)."""
    state = xxhash.xxh3_64()
    state.update(payload)
    return state.intdigest()


def _write_all(io: FileOps, fd: int, buffers: list[memoryview], offset: int) -> None:
    """``pwritev`` until every byte of ``buffers`` is written at ``offset``."""
    while buffers:
        done = io.pwritev(fd, buffers[:IOV_MAX], offset)
        offset += done
        while buffers and done >= len(buffers[0]):
            done -= len(buffers[0])
            buffers.pop(0)
        if done:
            buffers[0] = buffers[0][done:]


class Segment:
    """A segment file. The tier's writer thread is the only one to :meth:`append` and
    :meth:`seal`; any thread may :meth:`read` a record of it while it holds a reference
    (``refs``, counted by the tier under its lock), and the files are closed only when the
    segment is dead (reclaimed) and no reference is left. ``keys``: every key written into it
    (what reclaiming it drops from the index); ``records``: its records, for the directory."""

    def __init__(self, path: str, seg_id: int, fd: int, end: int, io: FileOps) -> None:
        self.path, self.id, self.fd, self.end, self.io = path, seg_id, fd, end, io
        self.dfd = -1  # O_DIRECT descriptor, once sealed (where the file system has it)
        self.sealed = False
        self.dead = False
        self.refs = 0
        self.dir_bytes = 0  # of its directory file, once written
        self.keys: list[bytes] = []
        self.records: list[Record] = []

    @classmethod
    def create(
        cls, directory: str, name: str, seg_id: int, created_ns: int, io: FileOps
    ) -> Segment:
        path = os.path.join(directory, name)
        fd = io.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            _write_all(io, fd, [memoryview(pack_segment_header(seg_id, created_ns))], 0)
        except BaseException:
            io.close(fd)
            io.unlink(path)
            raise
        return cls(path, seg_id, fd, PAGE, io)

    @classmethod
    def open_sealed(cls, path: str, seg_id: int, end: int, io: FileOps, direct: bool) -> Segment:
        seg = cls(path, seg_id, io.open(path, os.O_RDONLY), end, io)
        seg.sealed = True
        if direct:
            seg.open_direct()
        return seg

    def open_direct(self) -> None:
        """Read from here on with ``O_DIRECT``, where the file system allows it."""
        try:
            self.dfd = self.io.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError as e:  # reads then go through the page cache: no O_DIRECT here (tmpfs
            # before Linux 6.6), or no descriptor free for the moment
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EMFILE, errno.ENFILE):
                raise

    def append(self, buffers: list[memoryview], offset: int) -> None:
        _write_all(self.io, self.fd, buffers, offset)

    def truncate(self, length: int) -> None:
        self.io.ftruncate(self.fd, length)

    def sync(self) -> None:
        self.io.fdatasync(self.fd)

    def read(self, offset: int, length: int) -> memoryview | None:
        """The ``length`` bytes at ``offset`` in a buffer of their own (the caller's from here
        on), or None when the file ends before them. Raises ``OSError`` from the read."""
        fd = self.dfd
        if fd >= 0:
            start = offset - offset % PAGE
            stop = align_up(offset + length, PAGE)
        else:
            fd, start, stop = self.fd, offset, offset + length
        buf = aligned_buffer(stop - start)
        need, got = offset + length - start, 0
        while got < need:  # more than one call only at the end of the file, or interrupted
            n = self.io.preadv(fd, [buf[got:]], start + got)
            if n == 0:
                return None
            got += n
        return buf[offset - start : offset - start + length]

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                try:
                    self.io.close(fd)
                except OSError:
                    pass  # closing is best effort: the descriptor is gone either way
        self.fd = self.dfd = -1


def scan_segment(io: FileOps, fd: int, size: int, verify: bool) -> tuple[list[Record], int, int]:
    """The intact records of a segment file of ``size`` bytes read through ``fd``, in order;
    where the last of them ends; and how many records before it were damaged (a whole
    header whose payload fails its checksum: skipped, the scan goes on). The scan stops at
    the first record that is not whole (a torn tail: a write cut short by a crash); damaged
    records after the last intact one are that tail too. ``verify``: also check each payload
    against its checksum (else only headers and lengths)."""
    head = _pread(io, fd, 0, PAGE)
    if parse_segment_header(head) is None:
        return [], 0, 0
    records, pos, damaged, tail = [], PAGE, 0, 0
    for record, end in _records(io, fd, size, verify):
        if record is None:
            tail += 1
            continue
        records.append(record)
        pos, damaged, tail = end, damaged + tail, 0
    return records, pos, damaged


def _records(io: FileOps, fd: int, size: int, verify: bool) -> Iterator[tuple[Record | None, int]]:
    """Each whole record (None for one whose payload fails its checksum) and where it ends."""
    window, base, pos = bytearray(), 0, PAGE
    while pos < size:
        need = min(size - pos, 1 << 20)  # the largest header (65536 frames) fits
        if pos - base + need > len(window):  # the header (and more) from a fresh window
            window, base = _pread(io, fd, pos, max(need, SCAN_CHUNK)), pos
        header = parse_record_header(window, pos - base)
        if header is None:
            return
        start, end = pos + header.header_len, pos + header.header_len + header.payload_len
        if end > size:
            return
        intact = True
        if verify and not header.flags & FLAG_TOMBSTONE:
            if end - base > len(window):
                window, base = _pread(io, fd, pos, max(end - pos, SCAN_CHUNK)), pos
            payload = memoryview(window)[start - base : end - base]
            intact = payload_checksum(payload) == header.checksum
        record = Record(header.key, header.flags, header.seq, pos, header.header_len,
                        header.payload_len, header.checksum)  # fmt: skip
        yield (record if intact else None), end
        pos = align_up(end, RECORD_ALIGN)


def _pread(io: FileOps, fd: int, offset: int, length: int) -> bytearray:
    """Up to ``length`` bytes at ``offset`` (fewer at the end of the file)."""
    buf = bytearray(length)
    got = 0
    while got < length:
        n = io.preadv(fd, [memoryview(buf)[got:]], offset + got)
        if n == 0:
            break
        got += n
    del buf[got:]
    return buf
