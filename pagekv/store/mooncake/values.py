"""How a pagekv value is laid out in a Mooncake object, and how it is checked.

Mooncake keeps no checksum of an object's bytes. pagekv carries its own: an object is the
value's frames back to back, then a 16-byte trailer

    bytes 0-7    xxh3-64 (seed 0, little-endian) of the frames' bytes followed by the object key
    bytes 8-11   b"pkv1"
    bytes 12-15  the frames' total length, little-endian uint32 (modulo 2**32)

written from a small registered buffer beside the frames (Mooncake's multi-buffer calls), so
the frames themselves go out of and into the host pool with no copy. A read is accepted only
when Mooncake returns exactly frames + 16 bytes and the trailer matches the bytes now in the
destination and the key asked for: a torn object (a put that died midway, an object removed
while being read), bit rot, or an object stored under another key is a miss.

Object keys: ``PREFIX/`` + the hex of pagekv's key (Mooncake keys are strings).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import xxhash

__all__ = ["MAGIC", "TRAILER_BYTES", "check", "object_key", "trailer"]

MAGIC = b"pkv1"
_TRAILER = struct.Struct("<Q4sI")
TRAILER_BYTES = _TRAILER.size  # 16


def object_key(prefix: str, key: bytes) -> str:
    return f"{prefix}/{key.hex()}"


def digest(frames: Sequence[Any], key: str) -> int:
    """xxh3-64 of the frames' bytes then the object key (xxhash releases the GIL on large
    inputs: worker threads hash in parallel)."""
    state = xxhash.xxh3_64()
    for frame in frames:
        state.update(frame)
    state.update(key.encode())
    return state.intdigest()


def trailer(frames: Sequence[Any], key: str) -> bytes:
    length = sum(memoryview(f).nbytes for f in frames)
    return _TRAILER.pack(digest(frames, key), MAGIC, length & 0xFFFFFFFF)


def check(frames: Sequence[Any], key: str, tail: Any) -> bool:
    """Whether ``tail`` (the 16 bytes read after ``frames``) is the trailer of these bytes
    under this key."""
    try:
        value, magic, length = _TRAILER.unpack(bytes(tail))
    except struct.error:
        return False
    if magic != MAGIC or length != sum(memoryview(f).nbytes for f in frames) & 0xFFFFFFFF:
        return False
    return value == digest(frames, key)
