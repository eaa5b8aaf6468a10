"""The copies of the same-host shortcut (:mod:`.shm_reader`): one located value, or a chunk of
them, copied out of a ``--shm`` node's mapped segment into its destination, then verified: the
generations of the granules it covers must still be the LOCATE's (checked after the copy: see
:mod:`.shm`) and the checksum of what was copied must be the value's. A job is
``(i, mapped, offset, sizes, checksum, gen)``; ``mapped`` a :class:`.shm_reader.Mapped`.
Nothing here raises for a bad reply: it is a fallback reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..wire import native
from ..wire.copies import copy_checksum

__all__ = ["copy_batch", "copy_one", "in_chunks"]


def _prepare(job: tuple, targets: list[memoryview]) -> tuple[list[Any], int, int] | str:
    """The sources of one job's copy (views of the segment) and the granules it covers, or
    the fallback reason when the reply does not fit the destination or the segment."""
    _i, mapped, offset, sizes, _cs, _gen = job
    adv = mapped.advert
    if len(targets) != len(sizes) or any(t.nbytes != n for t, n in zip(targets, sizes)):
        return "size"
    total, granule = sum(sizes), adv["granule"]
    first, rem = divmod(offset - adv["data_offset"], granule)
    last = first + max(1, -(-total // granule))
    if offset < adv["data_offset"] or rem or last > adv["granules"]:
        return "bad_reply"
    sources, pos = [], offset
    for n in sizes:
        sources.append(mapped.bytes[pos : pos + n])
        if sources[-1].size != n:  # a frame past the file's end: a lying reply
            return "bad_reply"
        pos += n
    return sources, first, last


def _verify(job: tuple, first: int, last: int, copied: int) -> str:
    """After the copy (see pagekv.store.node.segment): the granules' generations are still the
    LOCATE's and the checksum of what was copied is the value's."""
    if not (job[1].gens[first:last] == job[5]).all() or copied != job[4]:
        return "mismatch"
    return ""


def copy_one(job: tuple, targets: list[memoryview]) -> str:
    """Copy one value out of the segment into ``targets``, then verify it. Never raises."""
    plan = _prepare(job, targets)
    if isinstance(plan, str):
        return plan
    sources, first, last = plan
    try:  # one pass: each chunk hashed as it lands (pagekv.store.wire.copies)
        copied = copy_checksum(targets, sources)
    except ValueError:  # pragma: no cover - _prepare checked the sizes
        return "bad_reply"
    return _verify(job, first, last, copied)


def copy_batch(
    lib: native.NativeCopy, jobs: list[tuple], into: Sequence[list[memoryview]], threads: int
) -> list[str]:
    """:func:`copy_one` for each job, the copies all in one native call on ``threads``."""
    why, plans = [""] * len(jobs), []
    for k, job in enumerate(jobs):
        plan = _prepare(job, into[job[0]])
        if isinstance(plan, str):
            why[k] = plan
        else:
            plans.append((k, *plan))
    values = [(into[jobs[k][0]], sources) for k, sources, _, _ in plans]
    digests = lib.copy_verify(values, threads=min(threads, native.MAX_THREADS))
    for (k, _, first, last), copied in zip(plans, digests):
        why[k] = _verify(jobs[k], first, last, copied)
    return why


def in_chunks(jobs: list[tuple], chunk_bytes: int) -> list[list[tuple]]:
    """Consecutive runs of jobs of about ``chunk_bytes`` each (at least one job a run)."""
    chunks: list[list[tuple]] = []
    nbytes = chunk_bytes
    for job in jobs:
        if nbytes >= chunk_bytes:
            chunks.append([])
            nbytes = 0
        chunks[-1].append(job)
        nbytes += sum(job[3])
    return chunks
