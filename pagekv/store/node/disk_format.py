"""The disk tier's bytes on disk: segment files of records, and each sealed segment's directory.

A tier's directory holds::

    lock                  flock()ed by the one process serving from it (its pid inside)
    format                "pagekv-disk 1": what this directory holds, and in which format
    00000000000000a1.seg  a segment: a header page, then records back to back (ids increase,
                          never reused; the oldest are reclaimed first)
    00000000000000a1.dir  the directory of a sealed segment: one entry per record (checkpoint)

Segment file: ``SEGMENT_HEADER`` (magic, version, id, created; its own checksum) padded to
``PAGE`` bytes, then records, each starting at a multiple of ``RECORD_ALIGN``::

    record header  RECORD_FIXED: magic, flags, key_len, nframes, header_len, seq, payload_len,
                   checksum (xxh3-64 of the payload: the block's checksum); the key; one u64
                   size per frame (only for blocks of several frames); zeros to a multiple of
                   8; header_sum (xxh3-64 of every header byte before it): ``header_len`` bytes
    payload        ``payload_len`` bytes: the block's frames back to back

``seq`` is the tier's write sequence number: it grows with every record ever written to the
directory, so of two records of one key the later wins, and an index entry names exactly one
record (a read checks the record it finds carries the key and seq it expects). A tombstone
(``FLAG_TOMBSTONE``, no payload) records a DELETE, so the key stays deleted after a restart.

Directory file (``.dir``): ``DIRECTORY_HEADER`` (magic, version, segment id, the segment's data
end, entry count), ``DIRECTORY_ENTRY`` per record (seq, offset, payload_len, checksum,
header_len, key_len, flags), the keys back to back, and an xxh3-64 of everything before it. It is
written (to a temporary name, synced, renamed) only after its segment's data was synced, so it
never names bytes that might not be on disk.

Every function here is pure (bytes in, values out) and thread-safe.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import xxhash

from ..wire.protocol import MAX_KEY_BYTES

__all__ = [
    "DIRECTORY_ENTRY",
    "FLAG_TOMBSTONE",
    "FORMAT_TEXT",
    "PAGE",
    "RECORD_ALIGN",
    "RECORD_FIXED",
    "Record",
    "RecordHeader",
    "align_up",
    "check_record_header",
    "directory_name",
    "directory_rows",
    "header_bytes",
    "pack_directory",
    "pack_record_header",
    "pack_segment_header",
    "parse_directory",
    "parse_record_header",
    "parse_segment_header",
    "record_bytes",
    "segment_id_of",
    "segment_name",
]

FORMAT_VERSION = 1
FORMAT_TEXT = f"pagekv-disk {FORMAT_VERSION}\n"
PAGE = 4096  # O_DIRECT reads are aligned to this: a device's logical block is 512 or 4096
RECORD_ALIGN = 64  # records start on this: dense (a 64 KiB block costs 64 KiB + 128 B)
FLAG_TOMBSTONE = 1
MAX_FRAMES = 1 << 16

RECORD_MAGIC = 0x5256_4B50  # "PKVR" little-endian
RECORD_FIXED = struct.Struct("<IHHIIQQQ")  # 40 bytes, then the key, the sizes, the header_sum
_SIZE = struct.Struct("<Q")

SEGMENT_MAGIC = b"PKVDSEG1"
SEGMENT_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, page, id, created_ns, sum
DIRECTORY_MAGIC = b"PKVDDIR1"
DIRECTORY_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, 0, segment id, data end, count
DIRECTORY_ENTRY = struct.Struct("<QQQQIHH")  # seq, offset, payload_len, checksum, hlen, klen, flags


def align_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def header_bytes(key_len: int, nframes: int) -> int:
    """Length of a record's header."""
    sizes = 8 * nframes if nframes > 1 else 0
    return align_up(RECORD_FIXED.size + key_len + sizes, 8) + 8


def record_bytes(key_len: int, nframes: int, payload_len: int) -> int:
    """Bytes of a record's header and payload (its start is aligned apart)."""
    return header_bytes(key_len, nframes) + payload_len


def segment_name(seg_id: int) -> str:
    return f"{seg_id:016x}.seg"


def directory_name(seg_id: int) -> str:
    return f"{seg_id:016x}.dir"


def segment_id_of(name: str, suffix: str) -> int | None:
    """The id in a file name made by :func:`segment_name` / :func:`directory_name`, else None."""
    stem, dot, ext = name.partition(".")
    if dot and ext == suffix.lstrip(".") and len(stem) == 16:
        try:
            return int(stem, 16)
        except ValueError:
            return None
    return None


class RecordHeader(NamedTuple):
    flags: int
    key: bytes
    seq: int
    payload_len: int
    checksum: int
    header_len: int
    frame_sizes: tuple[int, ...]  # one entry per frame; (payload_len,) for one frame


class Record(NamedTuple):
    """Where a record lies, as the index and the directories keep it."""

    key: bytes
    flags: int
    seq: int
    offset: int  # of its header, in the segment file
    header_len: int
    payload_len: int
    checksum: int


def pack_record_header(
    key: bytes, seq: int, frame_sizes: Sequence[int], checksum: int, flags: int = 0
) -> bytes:
    """A record's header (``header_len`` = its length, a multiple of 8)."""
    nframes = len(frame_sizes)
    header_len = header_bytes(len(key), nframes)
    head = bytearray(RECORD_FIXED.pack(RECORD_MAGIC, flags, len(key), nframes, header_len, seq,
                                       sum(frame_sizes), checksum))  # fmt: skip
    head += key
    if nframes > 1:
        head += struct.pack(f"<{nframes}Q", *frame_sizes)
    head += bytes(header_len - 8 - len(head))
    head += _SIZE.pack(xxhash.xxh3_64_intdigest(head))
    return bytes(head)


def parse_record_header(buf: memoryview | bytes | bytearray, pos: int = 0) -> RecordHeader | None:
    """The header at ``buf[pos:]``, or None when it is not a whole, intact one (bytes short,
    wrong magic, lengths out of range, header checksum off): never raises on any bytes."""
    if len(buf) - pos < RECORD_FIXED.size:
        return None
    magic, flags, klen, nframes, hlen, seq, plen, checksum = RECORD_FIXED.unpack_from(buf, pos)
    if magic != RECORD_MAGIC or not 0 < klen <= MAX_KEY_BYTES or nframes > MAX_FRAMES:
        return None
    if hlen != header_bytes(klen, nframes) or len(buf) - pos < hlen or not _summed(buf, pos, hlen):
        return None
    start = pos + RECORD_FIXED.size
    key = bytes(buf[start : start + klen])
    if nframes > 1:
        sizes = struct.unpack_from(f"<{nframes}Q", buf, start + klen)
        if sum(sizes) != plen:
            return None
    else:
        sizes = (plen,) if nframes == 1 else ()
    if (flags & FLAG_TOMBSTONE) != (nframes == 0) or (nframes == 0 and plen):
        return None
    return RecordHeader(flags, key, seq, plen, checksum, hlen, sizes)


def check_record_header(
    buf: memoryview, key: bytes, seq: int, header_len: int, payload_len: int, checksum: int
) -> tuple[int, ...] | None:
    """The frame sizes in the header at the start of ``buf`` when it is intact and is the
    block record the index names: ``key``, ``seq``, lengths and ``checksum``; else None.
    (The read path's check: leaner than :func:`parse_record_header`.)"""
    if len(buf) < RECORD_FIXED.size:
        return None
    magic, flags, klen, nframes, hlen, rseq, plen, rsum = RECORD_FIXED.unpack_from(buf)
    if (magic != RECORD_MAGIC or flags or rseq != seq or plen != payload_len or rsum != checksum
            or klen != len(key) or not 0 < nframes <= MAX_FRAMES or hlen != header_len
            or len(buf) < hlen or hlen != header_bytes(klen, nframes)):  # fmt: skip
        return None
    start = RECORD_FIXED.size
    if buf[start : start + klen] != key or not _summed(buf, 0, hlen):
        return None
    if nframes == 1:
        return (plen,)
    sizes = struct.unpack_from(f"<{nframes}Q", buf, start + klen)
    return sizes if sum(sizes) == plen else None


def _summed(buf: Any, pos: int, hlen: int) -> bool:
    """Whether the header at ``pos`` (``hlen`` bytes) matches its trailing header_sum."""
    view = memoryview(buf)[pos : pos + hlen - 8]
    return xxhash.xxh3_64_intdigest(view) == _SIZE.unpack_from(buf, pos + hlen - 8)[0]


def pack_segment_header(seg_id: int, created_ns: int) -> bytes:
    """The segment's first ``PAGE`` bytes."""
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, PAGE, seg_id, created_ns, 0)
    summed = xxhash.xxh3_64_intdigest(head[:-8])
    head = head[:-8] + _SIZE.pack(summed)
    return head + bytes(PAGE - len(head))


def parse_segment_header(buf: bytes) -> int | None:
    """The segment id in a segment's first page, or None when it is not an intact header."""
    if len(buf) < SEGMENT_HEADER.size:
        return None
    magic, version, page, seg_id, _created, summed = SEGMENT_HEADER.unpack_from(buf)
    if magic != SEGMENT_MAGIC or version != FORMAT_VERSION or page != PAGE:
        return None
    if xxhash.xxh3_64_intdigest(buf[: SEGMENT_HEADER.size - 8]) != summed:
        return None
    return seg_id


def pack_directory(seg_id: int, data_end: int, records: Sequence[Record]) -> bytes:
    """A sealed segment's directory file: its records in write order."""
    parts = [DIRECTORY_HEADER.pack(DIRECTORY_MAGIC, FORMAT_VERSION, 0, seg_id, data_end,
                                   len(records))]  # fmt: skip
    pack = DIRECTORY_ENTRY.pack
    parts.extend(pack(r.seq, r.offset, r.payload_len, r.checksum, r.header_len, len(r.key),
                      r.flags) for r in records)  # fmt: skip
    parts.extend(r.key for r in records)
    body = b"".join(parts)
    return body + _SIZE.pack(xxhash.xxh3_64_intdigest(body))


def parse_directory(data: bytes) -> tuple[int, int, list[bytes], list[tuple]] | None:
    """(segment id, data end, keys, rows) of a directory file's bytes: per record its key and
    its ``DIRECTORY_ENTRY`` fields (seq, offset, payload_len, checksum, header_len, key_len,
    flags); None when the bytes are not an intact directory (short, torn, wrong magic or
    version, checksum off)."""
    if len(data) < DIRECTORY_HEADER.size + 8:
        return None
    body = memoryview(data)[:-8]
    if xxhash.xxh3_64_intdigest(body) != _SIZE.unpack_from(data, len(data) - 8)[0]:
        return None
    magic, version, _, seg_id, data_end, count = DIRECTORY_HEADER.unpack_from(data)
    fixed_end = DIRECTORY_HEADER.size + count * DIRECTORY_ENTRY.size
    if magic != DIRECTORY_MAGIC or version != FORMAT_VERSION or fixed_end > len(body):
        return None
    rows = list(DIRECTORY_ENTRY.iter_unpack(body[DIRECTORY_HEADER.size : fixed_end]))
    keys, at = [], fixed_end
    for row in rows:
        keys.append(data[at : at + row[5]])
        at += row[5]
    if at != len(body):
        return None
    return seg_id, data_end, keys, rows


def directory_rows(records: Sequence[Record]) -> tuple[list[bytes], list[tuple]]:
    """The keys and ``DIRECTORY_ENTRY`` rows of ``records`` (as :func:`parse_directory`)."""
    rows = [(r.seq, r.offset, r.payload_len, r.checksum, r.header_len, len(r.key), r.flags)
            for r in records]  # fmt: skip
    return [r.key for r in records], rows
