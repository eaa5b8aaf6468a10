"""What a node does with a well-formed PUT or GET (the loop, parsing and replies are in
:mod:`.server`). Functions of the store they act on; they raise ``ProtocolError`` for a request
whose frames do not match its header, and nothing else on input.

With a disk tier, a GET whose found values include some on disk is answered in two steps:
:func:`get` returns a :class:`DiskGet` (what memory answered, the keys to read), the node reads
them off its loop, and :func:`finish_get` makes the reply."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import msgpack
import zmq
from xxhash import xxh3_64_intdigest

from ..config import NodeConfig
from ..wire.copies import parallel_map
from ..wire.protocol import (
    SHARED_BUFFER_BYTES,
    Code,
    ProtocolError,
    Reply,
    Request,
    Status,
    checksum_frames,
)
from .block_store import Block, BlockStore

if TYPE_CHECKING:
    from .disk import DiskBlock, DiskTier

__all__ = ["DiskGet", "best_effort_id", "commit", "finish_get", "get", "locate", "put", "reserve"]


def put(
    store: BlockStore, config: NodeConfig, req: Request, payloads: list[Any],
    pool: Executor | None = None, disk: DiskTier | None = None,
    digests: list[int] | None = None,
) -> Reply:  # fmt: skip
    """Store a PUT's values. The frames are checked against the header as a whole first (count,
    every size: ``BAD_FRAMES``, nothing stored); then each key gets its own status. With a
    ``pool``, the checksums of a large request are computed on several threads first;
    ``digests`` (one per value, taken as the frames landed: the bulk lane) are used instead.
    A key the ``disk`` tier holds is ``EXISTS`` (blocks are immutable), as one in memory."""
    if len(payloads) != len(req.sizes):
        raise ProtocolError(
            Code.BAD_FRAMES, f"header declares {len(req.sizes)} frames, got {len(payloads)}"
        )
    for i, (frame, size) in enumerate(zip(payloads, req.sizes)):
        if len(frame) != size:
            raise ProtocolError(Code.BAD_FRAMES, f"frame {i} has {len(frame)} bytes, not {size}")
    verify, most, store_put = config.verify_puts, config.max_block_size, store.put
    if disk is not None:
        store_put = _put_unless_on(disk, store)
    status = []
    if len(payloads) == len(req.keys):  # one frame per value: the common case, made lean
        bad = int(Status.BAD_CHECKSUM)
        datas = [own(frame) for frame in payloads]
        if digests is None and verify:
            digests = parallel_map(xxh3_64_intdigest, datas, sum(req.sizes), pool)
        sums = digests or []
        for j, (key, data, size, cs) in enumerate(zip(req.keys, datas, req.sizes, req.sums)):
            if verify and size <= most and sums[j] != cs:
                status.append(bad)
            else:
                status.append(store_put(key, (data,), size, cs))
        return Reply(req.id, status=status)
    start = 0
    for j, (key, count, cs) in enumerate(zip(req.keys, req.counts, req.sums)):
        frames = [own(f) for f in payloads[start : start + count]]
        size = sum(req.sizes[start : start + count])
        start += count
        got = digests[j] if digests is not None else checksum_frames(frames) if verify else cs
        if verify and size <= most and got != cs:
            status.append(int(Status.BAD_CHECKSUM))
            continue
        status.append(store_put(key, tuple(frames), size, cs))
    return Reply(req.id, status=status)


def _put_unless_on(disk: DiskTier, store: BlockStore) -> Callable[..., Any]:
    contains, store_put, exists = disk.contains, store.put, int(Status.EXISTS)

    def put_one(key: bytes, frames: tuple[Any, ...], size: int, checksum: int) -> Any:
        if key not in store and contains(key):
            return exists
        return store_put(key, frames, size, checksum)

    return put_one


class DiskGet:
    """A GET whose found values include some on disk, as far as the node got without waiting
    on the disk: the reply up to key ``start`` as memory answered it (``status``, ``sums``,
    ``counts``, payload ``out``), then one slot per key from ``start`` on: a memory
    :class:`Block` (held here: its frames stay alive; with a segment, the node keeps its space
    from reuse until the reply is sent), an ``int`` j (``keys[j]``, to be read from disk) or a
    :class:`Status` (``NOT_FOUND``, ``DEFERRED``). ``nbytes``: the reply's payload when every
    read succeeds; ``deferred``: values left out for room."""

    __slots__ = ("counts", "deferred", "keys", "nbytes", "out", "req", "slots", "status", "sums")

    def __init__(self, req: Request, status: list, sums: list, counts: list, out: list) -> None:
        self.req, self.status, self.sums, self.counts, self.out = req, status, sums, counts, out
        self.slots: list[Block | int | Status] = []
        self.keys: list[bytes] = []
        self.nbytes = self.deferred = 0


def get(
    store: BlockStore, room: int, req: Request, sent: list[Any] | None = None,
    disk: DiskTier | None = None,
) -> tuple[Reply, list[Any], int] | DiskGet:  # fmt: skip
    """Found values in key order while the reply's payload stays within ``room`` bytes; the
    found ones after that are ``DEFERRED`` (the client asks again). Returns the reply, its
    payload frames and how many values were deferred. ``sent`` (with a segment) gets the
    blocks whose views the reply carries (see :meth:`BlockStore.sent`). With a ``disk``
    tier, a key memory lacks may be there: the first such key makes it return a
    :class:`DiskGet` instead (its room taken by the block's size on disk; a block on disk over
    ``store.max_block_bytes`` is ``NOT_FOUND``, so the first found value always fits)."""
    status, sums, counts, out, deferred, limit = [], [], [], [], 0, room
    for key in req.keys:
        block = store.get(key)
        if block is None:
            if disk is not None and disk.contains(key):
                planned = DiskGet(req, status, sums, counts, out)
                planned.deferred, planned.nbytes = deferred, limit - room
                return _plan(planned, store, disk, room, len(status), sent)
            status.append(int(Status.NOT_FOUND))
        elif block.size > room:
            status.append(int(Status.DEFERRED))
            deferred += 1
        else:
            room -= block.size
            status.append(int(Status.OK))
            sums.append(block.checksum)
            counts.append(len(block.frames))
            out.extend(block.frames)
            if sent is not None:
                sent.append(block)
    return Reply(req.id, status=status, sums=sums, counts=counts), out, deferred


def _plan(planned: DiskGet, store: BlockStore, disk: DiskTier, room: int, start: int,
          sent: list[Any] | None) -> DiskGet:  # fmt: skip
    """:func:`get`'s slots from key ``start`` on (memory missed it, the disk has it)."""
    slots, keys, most = planned.slots, planned.keys, store.max_block_bytes
    for i in range(start, len(planned.req.keys)):
        key = planned.req.keys[i]
        block = store.get(key) if i > start else None
        if block is not None:
            size = block.size
        else:
            size = disk.size_of(key)
            if size is None or size > most:  # gone meanwhile; or over this node's limit
                slots.append(Status.NOT_FOUND)
                continue
        if size > room:
            slots.append(Status.DEFERRED)
            planned.deferred += 1
            continue
        room -= size
        planned.nbytes += size
        if block is not None:
            slots.append(block)
            if sent is not None:
                sent.append(block)
        else:
            slots.append(len(keys))
            keys.append(key)
    return planned


def finish_get(
    planned: DiskGet, blocks: Sequence[DiskBlock | None]
) -> tuple[Reply, list[Any]]:  # fmt: skip
    """The reply to ``planned`` once its keys were read (``blocks``: one per key, None where
    the read missed: ``NOT_FOUND``), and its payload frames: memory blocks' frames and the
    read blocks' (buffers of their own, which the reply keeps alive while it is sent)."""
    status, sums, counts, out = planned.status, planned.sums, planned.counts, planned.out
    ok, missing = int(Status.OK), int(Status.NOT_FOUND)
    for slot in planned.slots:
        if isinstance(slot, Status):
            status.append(int(slot))
            continue
        found = blocks[slot] if type(slot) is int else slot
        if found is None:
            status.append(missing)
            continue
        status.append(ok)
        sums.append(found.checksum)
        counts.append(len(found.frames))
        out.extend(found.frames)
    return Reply(planned.req.id, status=status, sums=sums, counts=counts), out


def locate(store: BlockStore, req: Request, advert: dict[str, Any],
           later: frozenset[bytes] = frozenset()) -> Reply:  # fmt: skip
    """Where each found value lies in the shared segment: per found key, in key order, its byte
    offset (``offs``), frame count (``counts``) and frame lengths (``sizes``, frames back to
    back), checksum (``sums``) and generation (``gens``); the segment itself in ``shm``. Keys
    memory lacks that are in ``later`` (on disk, not promoted for this LOCATE) are
    ``DEFERRED`` when some key was found (a reply deferring all would be a failing node's),
    else ``NOT_FOUND``."""
    if store.segment is None:
        raise ProtocolError(Code.BAD_OP, "LOCATE: this node keeps no shared segment (--shm)")
    rep = Reply(req.id, shm=advert)
    status, ok, missing = rep.status, int(Status.OK), int(Status.NOT_FOUND)
    offset = store.segment.offset
    for key in req.keys:
        block = store.locate(key)
        if block is None:
            status.append(missing)
            continue
        status.append(ok)
        rep.offs.append(offset(block.extent))
        rep.gens.append(block.gen)
        rep.sums.append(block.checksum)
        rep.counts.append(len(block.frames))
        rep.sizes.extend(len(f) for f in block.frames)
    if later and rep.sums:
        deferred = int(Status.DEFERRED)
        rep.status = [deferred if s == missing and k in later else s
                      for k, s in zip(req.keys, status)]  # fmt: skip
    return rep


def reserve(store: BlockStore, req: Request, advert: dict[str, Any],
            disk: DiskTier | None = None) -> Reply:  # fmt: skip
    """Room in the shared segment for each value of a RESERVE (``counts``, ``sizes``): per key
    a status, and for each reserved one (``OK``), in key order, where its frames go (``offs``:
    the byte offset of its first frame, the others back to back) and its generation
    (``gens``); the segment in ``shm``. A key the ``disk`` tier holds is ``EXISTS``."""
    if store.segment is None:
        raise ProtocolError(Code.BAD_OP, "RESERVE: this node keeps no shared segment (--shm)")
    rep = Reply(req.id, shm=advert)
    start = 0
    for key, count in zip(req.keys, req.counts):
        sizes = tuple(req.sizes[start : start + count])
        start += count
        if disk is not None and key not in store and disk.contains(key):
            status, held = Status.EXISTS, None
        else:
            status, held = store.reserve(key, sizes)
        rep.status.append(int(status))
        if held is not None:
            rep.offs.append(store.segment.offset(held.extent))
            rep.gens.append(held.gen)
    return rep


def commit(store: BlockStore, config: NodeConfig, req: Request, pool: Executor | None) -> Reply:
    """Store each reserved value of a COMMIT under its ``sums``: checked against the bytes in
    the segment first when the node verifies PUTs (several values at once on ``pool``)."""
    if store.segment is None:
        raise ProtocolError(Code.BAD_OP, "COMMIT: this node keeps no shared segment (--shm)")
    digests: dict[bytes, int] = {}
    if config.verify_puts:
        held = [(key, store.pending(key)) for key in req.keys]
        held = [(key, r) for key, r in held if r is not None]
        seg = store.segment
        views = [seg.views(seg.offset(r.extent), list(r.sizes)) for _, r in held]
        nbytes = sum(sum(r.sizes) for _, r in held)
        digests = dict(zip((key for key, _ in held),
                           parallel_map(checksum_frames, views, nbytes, pool)))  # fmt: skip
    status = []
    for key, cs in zip(req.keys, req.sums):
        check = None  # the node does not verify PUTs
        if config.verify_puts:  # the digest computed above (a key repeated: hashed again)
            check = _known(digests.pop(key)) if key in digests else checksum_frames
        status.append(int(store.commit(key, cs, check)))
    return Reply(req.id, status=status)


def _known(digest: int) -> Callable[[Any], int]:
    return lambda _views: digest


def own(frame: Any) -> Any:
    """A stored frame: small ones as bytes, never a view into libzmq's shared receive buffer
    (a 512-byte frame kept by reference would pin the whole ~18 KiB buffer it arrived in) nor a
    mutable buffer (the bulk lane's receive buffers)."""
    if isinstance(frame, bytes) or len(frame) > SHARED_BUFFER_BYTES:
        return frame
    return bytes(frame)


def best_effort_id(header: zmq.Frame) -> int:
    """The request id of a header we could not fully parse, when it can be read; else 0."""
    try:
        head = msgpack.unpackb(header.buffer, raw=False)
        rid = head.get("id") if isinstance(head, dict) else None
        return rid if type(rid) is int and rid >= 0 else 0
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError):
        return 0
