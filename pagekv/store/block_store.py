"""A node's blocks in memory: key -> immutable block, byte-accurate capacity, LRU eviction.

Blocks are kept as the objects they arrived in (ZeroMQ frames received with ``copy=False``), so
storing costs no copy. Capacity counts payload plus key bytes. When a put would take usage over
the high watermark, least recently used blocks are evicted down to the low watermark. A block
being sent stays alive until the send completes: pyzmq holds a reference to every zero-copy
frame until libzmq has written it, even when the index has dropped it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .protocol import MAX_KEY_BYTES, Status

__all__ = ["Block", "BlockStore"]


@dataclass(frozen=True)
class Block:
    frames: tuple[Any, ...]  # zmq.Frames or bytes-like objects, as received; never mutated
    size: int  # bytes over all frames
    checksum: int  # xxh3-64 over all frames in order


class BlockStore:
    """Not thread-safe: the node's event loop is its only user."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        max_block_bytes: int,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
    ) -> None:
        if capacity_bytes <= 0 or max_block_bytes <= 0:
            raise ValueError("capacity and max block size must be positive")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        self.capacity = capacity_bytes
        self.max_block_bytes = max_block_bytes
        self.high = int(capacity_bytes * high_watermark)
        self.low = int(capacity_bytes * low_watermark)
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # oldest first
        self.used = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def statuses(self, keys: list[bytes]) -> list[int]:
        """``Status.OK`` / ``Status.NOT_FOUND`` per key, without touching LRU order."""
        blocks, ok, missing = self._blocks, int(Status.OK), int(Status.NOT_FOUND)
        return [ok if k in blocks else missing for k in keys]

    def put(self, key: bytes, frames: tuple[Any, ...], size: int, checksum: int) -> Status:
        """Store the value ``frames`` (kept by reference, ``size`` bytes in all) under ``key``.
        A present key is acknowledged with ``Status.EXISTS`` and not rewritten."""
        if not key or len(key) > MAX_KEY_BYTES:
            return Status.BAD_KEY
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return Status.EXISTS
        if size > self.max_block_bytes:
            return Status.TOO_LARGE
        need = size + len(key)
        if need > self.capacity:
            return Status.NO_SPACE
        if self.used + need > self.high:
            self._evict_to(min(self.low, self.capacity - need))
        self._blocks[key] = Block(tuple(frames), size, checksum)
        self.used += need
        return Status.OK

    def get(self, key: bytes) -> Block | None:
        """The block (LRU touched), or None; counts a hit or a miss."""
        block = self._blocks.get(key)
        if block is None:
            self.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.hits += 1
        return block

    def delete(self, key: bytes) -> bool:
        block = self._blocks.pop(key, None)
        if block is None:
            return False
        self.used -= block.size + len(key)
        return True

    def _evict_to(self, target: int) -> None:
        while self._blocks and self.used > target:
            key, block = self._blocks.popitem(last=False)
            self.used -= block.size + len(key)
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {
            "blocks": len(self._blocks),
            "bytes": self.used,
            "capacity": self.capacity,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
