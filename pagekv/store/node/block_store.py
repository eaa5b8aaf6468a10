"""A node's blocks in memory: key -> immutable block, capacity by real cost, LRU eviction.

Blocks are kept as the objects they arrived in (ZeroMQ frames received with ``copy=False``; the
node copies only small frames out of libzmq's shared receive buffers), so storing costs no
copy. Capacity counts what a block really costs in memory: its payload and key plus a fixed
overhead per block and per frame (index entry, Python objects, allocator headers; measured, see
``BLOCK_OVERHEAD``), so a node full of 512-byte blocks stays within its capacity too. When a put
would take usage over the high watermark, least recently used blocks are evicted down to the
low watermark. A block being sent stays alive until the send completes: pyzmq holds a reference
to every zero-copy frame until libzmq has written it, even when the index has dropped it.

With a shared segment (``--shm``, :mod:`.shm`) a block's frames are copied into the segment on
put and the block holds read-only views of them; its space is freed when it is evicted or
deleted, but not before every reply that was sending those views has been written
(:meth:`BlockStore.sent`); space freed is reused only after its granules get a new generation.
A client on the same host may write a value into the segment itself: :meth:`BlockStore.reserve`
allocates its space (counted as used, stamped with a fresh generation before the client writes)
and :meth:`BlockStore.commit` stores it once written; a reservation not committed within
``RESERVATION_S`` is freed (:meth:`BlockStore.expire`).

A node with a disk tier sets :attr:`BlockStore.on_evict`: each block evicted for space (never
one deleted) is handed to it as it leaves memory. A node publishing KV events sets
:attr:`BlockStore.on_stored` and :attr:`BlockStore.on_removed` (:mod:`.events`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ..wire.protocol import MAX_KEY_BYTES, Status
from .segment import GRANULE, Extent, Segment

__all__ = ["BLOCK_OVERHEAD", "FRAME_OVERHEAD", "Block", "BlockStore", "block_cost"]

# Measured on CPython 3.11 / pyzmq 27 / glibc (tests/test_store_memory.py checks the sum stays
# within 10% of resident memory for 512 B .. 8 MiB blocks): the index entry, key object, Block
# and tuple; and per frame its Python object, libzmq message header and malloc rounding.
BLOCK_OVERHEAD = 320
FRAME_OVERHEAD = 448
SHM_FRAME_OVERHEAD = 192  # with --shm: a frame is a memoryview into the segment
RESERVATION_S = 60.0  # a reservation not committed by then is freed


class Reservation(NamedTuple):
    """Room in the segment for one value a client writes itself (see :meth:`BlockStore.reserve`)."""

    extent: Extent
    gen: int
    sizes: tuple[int, ...]  # its frames' sizes, back to back
    cost: int
    expires: float  # monotonic


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
    extent: Extent | None  # with --shm: where its bytes lie in the segment (frames back to back)
    gen: int  # with --shm: the generation of its extent (0 without)


_new_block = tuple.__new__


class BlockStore:
    """Not thread-safe: the node's event loop is its only user.

    ``on_evict(key, block)``, when set, is called with each block evicted for space (not
    deleted), once it has left the index and before its segment space (``--shm``) is freed:
    a hook that keeps the frames of a block with an ``extent`` must copy them before it
    returns. It must not call back into the store.

    ``on_stored(key)`` / ``on_removed(key)``, when set, are called as a key enters memory (a put
    or commit that stored it) and as it leaves (evicted, after ``on_evict``; deleted); in the
    order the store changes. They must not call back into the store."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        max_block_bytes: int,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        segment: Segment | None = None,
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
        # bytes of requests on their way in (received, not yet stored; set by the node before
        # each PUT): room kept for them, so that blocks plus arrivals stay within the watermarks
        self.arriving = 0
        self.segment = segment
        self._pending: dict[bytes, Reservation] = {}  # reserved, not committed yet
        self._sending: dict[int, list[Any]] = {}  # extent start -> trackers of replies
        self._quarantine: list[tuple[Extent, list[Any]]] = []  # freed, replies still sending
        self.on_evict: Callable[[bytes, Block], Any] | None = None
        self.on_stored: Callable[[bytes], Any] | None = None
        self.on_removed: Callable[[bytes], Any] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def statuses(self, keys: list[bytes]) -> list[int]:
        """``Status.OK`` / ``Status.NOT_FOUND`` per key, without touching LRU order."""
        blocks, ok, missing = self._blocks, int(Status.OK), int(Status.NOT_FOUND)
        return [ok if k in blocks else missing for k in keys]

    def put(self, key: bytes, frames: tuple[Any, ...], size: int, checksum: int,
            held: int = 0) -> Status:  # fmt: skip
        """Store the value ``frames`` (kept by reference, ``size`` bytes in all) under ``key``.
        A present key is acknowledged with ``Status.EXISTS`` and not rewritten. ``held``: bytes
        of the buffer the frames keep alive, when more than ``size`` (a block read from disk:
        its record's header and alignment); counted in its cost. Frames copied into a
        segment (``--shm``) hold nothing more."""
        if not key or len(key) > MAX_KEY_BYTES:
            return Status.BAD_KEY
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return Status.EXISTS
        if size > self.max_block_bytes:
            return Status.TOO_LARGE
        if self.segment is not None:
            return self._put_shared(key, frames, size, checksum)
        need = size + len(key) + BLOCK_OVERHEAD + FRAME_OVERHEAD * len(frames)  # block_cost
        if held > size:
            need += held - size
        if need > self.capacity:
            return Status.NO_SPACE
        self._keep_room(need)
        self._blocks[key] = _new_block(Block, (tuple(frames), size, checksum, need, None, 0))
        self.used += need
        self.payload += size + len(key)
        if self.on_stored is not None:
            self.on_stored(key)
        return Status.OK

    def make_room(self) -> None:
        """What :meth:`put` does before storing a value, for :attr:`arriving` alone: room made
        before a payload is received rather than after (no segment: its space is found per
        value)."""
        if self.segment is None:
            self._keep_room(0)

    def _keep_room(self, need: int) -> None:
        """Evict down to the low watermark (or to what leaves ``need``) less :attr:`arriving`
        when blocks, ``need`` and arrivals pass the high watermark."""
        if self.used + need + self.arriving > self.high:
            self._evict_to(max(0, min(self.low, self.capacity - need) - self.arriving))

    def _put_shared(self, key: bytes, frames: tuple[Any, ...], size: int, checksum: int) -> Status:
        """Copy the value into the segment: evict (LRU) until a free run holds it."""
        place = self._room(key, size, len(frames))
        if isinstance(place, Status):
            return place
        extent, gen, need = place
        views = self.segment.write(self.segment.offset(extent), frames)
        self._blocks[key] = _new_block(Block, (views, size, checksum, need, extent, gen))
        self.used += need
        self.payload += size + len(key)
        if self.on_stored is not None:
            self.on_stored(key)
        return Status.OK

    def _room(self, key: bytes, size: int, nframes: int) -> tuple[Extent, int, int] | Status:
        """Space in the segment for a value (LRU evicted until a free run holds it): its
        extent, generation and cost (counted as used by the caller), or why not."""
        seg = self.segment
        span = max(1, -(-size // GRANULE)) * GRANULE
        need = span + len(key) + BLOCK_OVERHEAD + SHM_FRAME_OVERHEAD * nframes
        if need > self.capacity or span > seg.granules * GRANULE:
            return Status.NO_SPACE
        if self.used + need > self.high:
            self._evict_to(min(self.low, self.capacity - need))
        place = seg.alloc(size)
        while place is None:
            if not self._reclaim() and not self._evict_one():
                return Status.NO_SPACE  # the rest is still being sent: transient
            place = seg.alloc(size)
        return (*place, need)

    def reserve(self, key: bytes, sizes: tuple[int, ...], now: float | None = None
                ) -> tuple[Status, Reservation | None]:  # fmt: skip
        """Room in the segment for a value of frames of ``sizes`` that the caller will write
        itself: ``(Status.OK, reservation)`` (its bytes start at the extent's offset, frames
        back to back; counted as used from now), else a status (``EXISTS``: stored, or being
        written by another reservation)."""
        if self.segment is None:
            raise RuntimeError("reserve: this store keeps no segment")
        if not key or len(key) > MAX_KEY_BYTES:
            return Status.BAD_KEY, None
        if key in self._blocks or key in self._pending:
            return Status.EXISTS, None
        size = sum(sizes)
        if size > self.max_block_bytes:
            return Status.TOO_LARGE, None
        place = self._room(key, size, len(sizes))
        if isinstance(place, Status):
            return place, None
        extent, gen, need = place
        expires = (time.monotonic() if now is None else now) + RESERVATION_S
        self._pending[key] = reservation = Reservation(extent, gen, tuple(sizes), need, expires)
        self.used += need
        return Status.OK, reservation

    def commit(self, key: bytes, checksum: int,
               digest: Callable[[tuple[Any, ...]], int] | None = None) -> Status:  # fmt: skip
        """Store the value written into ``key``'s reservation, under ``checksum``; with
        ``digest`` (the checksum of frames: a node verifying PUTs), only if the bytes there have
        that checksum (else ``BAD_CHECKSUM`` and the space is freed). ``NO_SPACE`` when there is
        no reservation (it expired); ``EXISTS`` when the key was stored meanwhile."""
        held = self._pending.pop(key, None)
        if held is None:
            return Status.NO_SPACE
        seg = self.segment
        views = seg.views(seg.offset(held.extent), list(held.sizes))
        if key in self._blocks or (digest is not None and digest(views) != checksum):
            self.used -= held.cost
            seg.space.free(held.extent)
            return Status.EXISTS if key in self._blocks else Status.BAD_CHECKSUM
        size = sum(held.sizes)
        self._blocks[key] = _new_block(Block, (views, size, checksum, held.cost, held.extent,
                                               held.gen))  # fmt: skip
        self.payload += size + len(key)
        if self.on_stored is not None:
            self.on_stored(key)
        return Status.OK

    def pending(self, key: bytes) -> Reservation | None:
        return self._pending.get(key)

    def expire(self, now: float | None = None) -> int:
        """Free the reservations not committed in time; returns how many."""
        now = time.monotonic() if now is None else now
        late = [key for key, held in self._pending.items() if held.expires <= now]
        for key in late:
            held = self._pending.pop(key)
            self.used -= held.cost
            self.segment.space.free(held.extent)
        return len(late)

    def sent(self, blocks: list[Block], tracker: Any) -> None:
        """``blocks``' views are in a reply tracked by ``tracker``: their space is not freed
        before it is done."""
        for block in blocks:
            trackers = self._sending.get(block.extent.start)
            if trackers is None:
                self._sending[block.extent.start] = [tracker]
            else:
                trackers[:] = [t for t in trackers if not t.done]
                trackers.append(tracker)

    def _release(self, block: Block) -> None:
        if block.extent is None:
            return
        trackers = [t for t in self._sending.pop(block.extent.start, ()) if not t.done]
        if trackers:
            self._quarantine.append((block.extent, trackers))
        else:
            self.segment.space.free(block.extent)

    def _reclaim(self) -> bool:
        """Free the quarantined space whose replies are done; whether any was."""
        keep, freed = [], False
        for extent, trackers in self._quarantine:
            if all(t.done for t in trackers):
                self.segment.space.free(extent)
                freed = True
            else:
                keep.append((extent, trackers))
        self._quarantine = keep
        return freed

    def _evict_one(self) -> bool:
        if not self._blocks:
            return False
        key, block = self._blocks.popitem(last=False)
        self.used -= block.cost
        self.payload -= block.size + len(key)
        self.evictions += 1
        self._evicted(key, block)
        return True

    def _evicted(self, key: bytes, block: Block) -> None:
        """A block left memory for space: the hook, then its segment space freed."""
        try:
            if self.on_evict is not None:
                self.on_evict(key, block)
        finally:
            if self.on_removed is not None:
                self.on_removed(key)
            self._release(block)

    def keys(self) -> list[bytes]:
        """The keys held, oldest first (a copy)."""
        return list(self._blocks)

    def newest_first(self) -> Iterator[tuple[bytes, Block]]:
        """The blocks, most recently used first (do not change the store while iterating)."""
        return reversed(self._blocks.items())

    def locate(self, key: bytes) -> Block | None:
        """Like :meth:`get` (LRU touched, hit or miss counted), for a LOCATE."""
        return self.get(key)

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
        if self.on_removed is not None:
            self.on_removed(key)
        self._release(block)
        return True

    def _evict_to(self, target: int) -> None:
        while self._blocks and self.used > target:
            key, block = self._blocks.popitem(last=False)
            self.used -= block.cost
            self.payload -= block.size + len(key)
            self.evictions += 1
            self._evicted(key, block)

    def stats(self) -> dict[str, int]:
        shared = {}
        if self.segment is not None:
            self._reclaim()
            shared = {
                "shm_bytes_used": self.segment.used_bytes(),
                "shm_bytes_free": self.segment.free_bytes(),
                "shm_bytes_quarantined": sum(e.count for e, _ in self._quarantine) * GRANULE,
                "shm_reserved": len(self._pending),
            }
        return {
            **shared,
            "blocks": len(self._blocks),
            "bytes": self.payload,  # payload + keys
            "used_bytes": self.used,  # their real cost, what capacity limits
            "capacity": self.capacity,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
