"""A node's blocks in memory: key -> immutable block, capacity by real cost, LRU eviction.

Blocks are kept as the objects they arrived in (ZeroMQ frames received with ``copy=False``; the
node copies only small frames out of libzmq's shared receive buffers), so storing costs no
copy. Capacity counts what a block really costs in memory: its payload and key plus a fixed
overhead per block and per frame (index entry, Python objects, allocator headers; measured, see
``BLOCK_OVERHEAD``), so a node full of 512-byte blocks stays within its capacity too. When a put
would take usage over the high watermark, least recently used blocks are evicted down to the
low watermark. A block being sent stays alive until the send completes: pyzmq holds a reference
to every zero-copy frame until libzmq has written it, even when the index has dropped it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

from .protocol import MAX_KEY_BYTES, Status

__all__ = ["BLOCK_OVERHEAD", "FRAME_OVERHEAD", "Block", "BlockStore", "block_cost"]

# Measured on CPython 3.11 / pyzmq 27 / glibc (tests/test_store_memory.py checks the sum stays
# within 10% of resident memory for 512 B .. 8 MiB blocks): the index entry, key object, Block
# and tuple; and per frame its Python object, libzmq message header and malloc rounding.
BLOCK_OVERHEAD = 320
FRAME_OVERHEAD = 448


def block_cost(key: bytes, size: int, nframes: int) -> int:
    """Bytes of memory a block of ``size`` payload bytes in ``nframes`` frames really holds."""
    return size + len(key) + BLOCK_OVERHEAD + FRAME_OVERHEAD * nframes


class Block(NamedTuple):
    """One stored value (immutable). Made with ``tuple.__new__`` in :meth:`BlockStore.put`:
    a class with an ``__init__`` costs microseconds per block, which a million blocks feel."""

    frames: tuple[Any, ...]  # zmq.Frames or bytes-like objects, as received
    size: int  # bytes over all frames
    checksum: int  # xxh3-64 over all frames in order
    cost: int  # what it counts against capacity (block_cost)


_new_block = tuple.__new__


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
        self.used = 0  # real cost of the blocks held (block_cost)
        self.payload = 0  # their payload and key bytes (stats "bytes", as before protocol 2)
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
        need = size + len(key) + BLOCK_OVERHEAD + FRAME_OVERHEAD * len(frames)  # block_cost
        if need > self.capacity:
            return Status.NO_SPACE
        if self.used + need > self.high:
            self._evict_to(min(self.low, self.capacity - need))
        self._blocks[key] = _new_block(Block, (tuple(frames), size, checksum, need))
        self.used += need
        self.payload += size + len(key)
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
        self.used -= block.cost
        self.payload -= block.size + len(key)
        return True

    def _evict_to(self, target: int) -> None:
        while self._blocks and self.used > target:
            key, block = self._blocks.popitem(last=False)
            self.used -= block.cost
            self.payload -= block.size + len(key)
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {
            "blocks": len(self._blocks),
            "bytes": self.payload,  # payload + keys
            "used_bytes": self.used,  # their real cost, what capacity limits
            "capacity": self.capacity,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
