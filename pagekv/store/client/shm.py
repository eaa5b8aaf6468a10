"""The same-host transport: GETs from a ``--shm`` node on this host, read straight out of its
segment (:mod:`..node.segment`).

Chosen for a node (:meth:`ShmTransport.take`) when its PING advertises a segment (``shm``) on
this host (same host id), in a file this process can open and map read-only (same user: the
file is mode 0600); else the node's GETs go over TCP. A GET call is then a LOCATE over ZeroMQ
(where each found value lies, its checksum and generation), a checked copy of each value out of
the mapping into its destination (or into a new buffer for ``get_many`` without ``into``), and
the check that the generations of the value's granules are still the LOCATE's (see
:mod:`..node.segment` for why a torn copy cannot pass): a value whose space was reused during
the copy was evicted meanwhile, and is a miss on this node (``NOT_FOUND``; its next replica is
asked), counted in ``shm_evicted``. The checksum of what was copied is compared by the GET as
for any transport (a mismatch is a miss, ``checksum_mismatch``). A LOCATE that fails, or whose
reply does not make sense or names another segment (the node restarted), fails the call as any
node failure (the node is PINGed again before its next use). A value the LOCATE defers (a node's
disk tier holds more of the call's values than it brings into memory at once) is ``DEFERRED``
in the GET reply: asked for again, as a GET's deferred values are.

Copies start as LOCATEs are answered (a node answers a run's LOCATEs in the order they were
sent, which is key order), in chunks of whole calls of about ``CHUNK_BYTES``, ``PIPELINE``
chunks at once: each chunk one call of the native checked copy on ``workers // PIPELINE``
threads (or, without it, numpy copies on a small pool), on driver threads, so that while the
loop takes the next LOCATE replies and hands one chunk's values on, the next ones are being
copied. A call's reply is handed on (``prepare``, ``on_reply``) once its chunk is copied; the
run is not over until every copy it started is (they write into the caller's buffers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import mmap
import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

try:
    import numpy as np
except ImportError:  # the store alone (pip install pagekv, no numpy): no shortcut
    np = None

from ..config import default_shm_threads
from ..wire import native
from ..wire.copies import copy_checksum
from ..wire.protocol import Code, Op, Reply, Request, Status
from ..wire.shm import ADVERT, host_id
from .routing import Call, Results, Router
from .transport import Transport, gather_all
from .zeromq import ZmqTransport

__all__ = ["COUNTERS", "ShmTransport"]

COUNTERS = ("shm_hits", "shm_evicted", "shm_puts")
PARALLEL_BYTES = 4 << 20  # runs smaller than this are copied on the loop's thread
# Replies are handed on after each chunk of copies. Each native call ends with its threads
# waiting for its last values, so smaller chunks are slower and larger ones announce later
# (H100 host, 4 GiB of 2 MiB values, interleaved rounds: raw get_many medians 27.3 / 31.0 /
# 25.7 GB/s for 64 / 128 / 256 MiB chunks; bench_connector --shm prefetch 27.5-28.0 /
# 29.6-29.9 / 28.6-30.2 GB/s for 64 / 128 / 192 MiB, the load overlapped with it done 0.17-0.19
# / 0.16-0.17 / 0.23 s after the call).
CHUNK_BYTES = 128 << 20
# A GET or PUT call to a node this transport took carries at most CHUNK_BYTES of values (the
# client sets Router.get_bytes / put_bytes): its LOCATE's reply, RESERVE and COMMIT carry none,
# so the message limits do not bound it, and their round trips and replies cost the loop once
# per chunk instead of once per 16 MiB. 4 GiB of 2 MiB values, one --shm node, H100, two
# clients taking turns: GETs 32.6 / 31.8 against 27.4 / 26.4 GB/s with 16 MiB calls (14 pairs
# twice, ahead in 12 and 14), PUTs 15.6 against 10.5 GB/s (12 pairs, ahead in all).
# Chunks copied at once (at least 2: the next chunk is copied while this one is handed on).
# Two at once: prefetch 0.199-0.221 s against 0.248-0.261 s one at a time; three were no better
# than two.
PIPELINE = 2


@dataclass
class Mapped:
    """A mapping of one node's segment file (writable where the node takes values written by
    its clients and this process may write the file)."""

    advert: dict[str, Any]
    bytes: Any  # numpy uint8 over the whole file
    gens: Any  # numpy uint64 per granule of the data area
    writable: bool = False


@dataclass
class _Job:
    """One value to copy: key ``k`` of ``call``, found at ``offset`` (frames of ``sizes``) with
    ``checksum`` and generation ``gen``, into ``targets``. ``why`` and ``digest`` are set by
    the copy: "" (copied), "size" (frames do not match the destination: not copied), "evicted"
    (its space was reused during the copy) or "bad_reply" (outside the segment)."""

    call: Call
    k: int
    mapped: Mapped
    offset: int
    sizes: list[int]
    checksum: int
    gen: int
    targets: list[Any]
    why: str = ""
    digest: int = 0
    sources: list[Any] | None = None  # views of the segment, set by _sources
    granules: tuple[int, int] = (0, 0)  # [first, last) granules the value covers


@dataclass
class _Plan:
    """A GET call's LOCATE answer: its reply's statuses and its jobs (found values)."""

    call: Call
    located: Reply
    jobs: list[_Job]


class ShmTransport(Transport):
    """GETs of the ``--shm`` nodes of this host that this client took (:meth:`take`); their
    LOCATEs go over ``zmq``. Counters go to the router's."""

    name = "shm"

    def __init__(self, router: Router, zmq: ZmqTransport, workers: int | None = None) -> None:
        self.router, self.zmq = router, zmq
        self.counters = router.counters
        for name in COUNTERS:
            self.counters.setdefault(name, 0)
        self.host = host_id()
        self.workers = workers or default_shm_threads()
        self._mapped: dict[int, Mapped] = {}
        self._driver: ThreadPoolExecutor | None = None  # the chunks' copies
        self._pool: ThreadPoolExecutor | None = None  # numpy copies, without the native one
        self._slots: asyncio.Semaphore | None = None  # chunks in copy at once (PIPELINE)

    def take(self, node: int, advert: dict[str, Any]) -> str | None:
        """Carry ``node``'s GETs (and its PUTs, where it takes values written by clients and
        this process may write the file) through the segment its PING advertised: "" when
        taken, else why not (None: it advertises none)."""
        mapped = self._mapped.pop(node, None)
        if not advert:
            return None
        if np is None:
            return "no numpy (pip install numpy)"
        if any(type(advert.get(k)) is not t for k, t in ADVERT.items()):
            return "a malformed advert"
        if advert["host"] != self.host:
            return "another host"
        if mapped is None or mapped.advert != advert:
            mapped, why = _map(advert)
            if mapped is None:
                return why
        self._mapped[node] = mapped
        return ""

    def writes(self, node: int) -> bool:
        """Whether ``node``'s PUTs are written into its segment by this client."""
        mapped = self._mapped.get(node)
        return mapped is not None and mapped.writable

    def close(self) -> None:
        """Unmap the segments (once no call in flight uses them) and end the copy threads.
        The client may be used again: its nodes are PINGed again first (which maps their
        segments anew), and copy threads are made again on first use."""
        for node in self._mapped:
            self.router.forget(node)
        self._mapped.clear()
        for pool in (self._driver, self._pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self._driver = self._pool = self._slots = None

    # ---- calls -----------------------------------------------------------------------------
    async def run(self, calls: list[Call]) -> Results:
        gets = [call for call in calls if call.request.op is Op.GET]
        puts = [call for call in calls if call.request.op is Op.PUT]
        parts = await gather_all(
            [
                job
                for job in (self._gets(gets) if gets else None, self._puts(puts) if puts else None)
                if job
            ]
        )
        return {rid: result for part in parts for rid, result in part.items()}

    async def _gets(self, calls: list[Call]) -> Results:
        """LOCATE every call over ZeroMQ; copy the calls' values as their LOCATEs are answered,
        in the order of each call's first key across the nodes (the leading values come first
        from three nodes as from one), in chunks (see the module docstring). A call whose
        LOCATE failed or made no sense is a failed call (None)."""
        results: Results = {}
        located: asyncio.Queue[_Plan | None] = asyncio.Queue()
        order = sorted(range(len(calls)), key=lambda k: calls[k].idxs[0] if calls[k].idxs else 0)
        rank = {k: r for r, k in enumerate(order)}
        answers: list[_Plan | bool | None] = [False] * len(calls)  # False: not answered yet
        ready = 0  # answers[order[:ready]] have gone to ``located``

        def release() -> None:
            nonlocal ready
            while ready < len(order) and answers[order[ready]] is not False:
                plan = answers[order[ready]]
                if plan is None:
                    results[calls[order[ready]].request.id] = None
                else:
                    located.put_nowait(plan)
                ready += 1

        def answered(k: int, reply: Reply, frames: list[Any]) -> None:
            answers[k] = self._plan(calls[k], (reply, frames))
            if rank[k] == ready:
                release()

        def over(_: asyncio.Future) -> None:  # the LOCATEs not answered failed
            for k in range(len(calls)):
                if answers[k] is False:
                    answers[k] = None
            release()
            located.put_nowait(None)

        locates = [Call(c.node, Request(Op.LOCATE, self.router.next_id(), c.request.keys), [],
                        c.idxs, answer_s=c.answer_s, on_reply=functools.partial(answered, k))
                   for k, c in enumerate(calls)]  # fmt: skip
        locating = asyncio.ensure_future(self.zmq.run(locates))
        locating.add_done_callback(over)
        try:
            await self._copy_as_located(located, results)
        finally:
            if not locating.done():
                locating.cancel()
        await locating  # its failures were handled in over(); a raise goes to the caller
        return results

    async def _copy_as_located(
        self, located: asyncio.Queue[_Plan | None], results: Results
    ) -> None:
        """Take the plans as their LOCATEs are answered (None: no more) into chunks of about
        ``CHUNK_BYTES``; copy each on a driver thread, ``PIPELINE`` at a time (a chunk under
        ``PARALLEL_BYTES`` with nothing else in flight, or without threads to spare, on the
        loop's thread), and hand each chunk's replies on in order."""
        loop = asyncio.get_running_loop()
        started: asyncio.Queue[tuple[list[_Plan], concurrent.futures.Future | None] | None]
        started = asyncio.Queue()
        futures: list[concurrent.futures.Future] = []

        async def start_chunks() -> None:
            chunk: list[_Plan] = []
            nbytes, more = 0, True
            while more:
                plan = await located.get()
                more = plan is not None
                if plan is not None:
                    chunk.append(plan)
                    nbytes += sum(sum(job.sizes) for job in plan.jobs)
                if chunk and (nbytes >= CHUNK_BYTES or not more):
                    started.put_nowait((chunk, await self._start(chunk, nbytes, futures, loop)))
                    chunk, nbytes = [], 0
            started.put_nowait(None)

        async def hand_on() -> None:
            while (item := await started.get()) is not None:
                chunk, future = item
                if future is not None:
                    await asyncio.wrap_future(future)
                self._hand_on(chunk, results)

        try:
            await gather_all([start_chunks(), hand_on()])
        finally:  # never return while a copy still writes into the caller's buffers
            running = [fut for fut in futures if not fut.done()]
            if running:
                concurrent.futures.wait(running)

    async def _start(
        self,
        chunk: list[_Plan],
        nbytes: int,
        futures: list[concurrent.futures.Future],
        loop: asyncio.AbstractEventLoop,
    ) -> concurrent.futures.Future | None:
        """Start ``chunk``'s copy on a driver thread once one of the ``PIPELINE`` slots is
        free; None when it was copied here instead (small, or no threads to spare)."""
        jobs = [job for plan in chunk for job in plan.jobs]
        for job in jobs:
            _sources(job)  # here, on the loop: the copy's thread then needs no GIL
        idle = all(fut.done() for fut in futures)
        if self.workers < 2 or (nbytes < PARALLEL_BYTES and idle):
            self._copy(jobs)
            return None
        driver, slots = self._drivers()
        await slots.acquire()
        try:
            future = driver.submit(self._copy, jobs)
        except RuntimeError:  # shut down: the client was closed meanwhile; copied here
            slots.release()
            self._copy(jobs)
            return None
        future.add_done_callback(lambda _f: loop.call_soon_threadsafe(slots.release))
        futures.append(future)
        return future

    async def _puts(self, calls: list[Call]) -> Results:
        """PUT calls written straight into the segments: a RESERVE of each call's values over
        ZeroMQ, a checked copy of each reserved value into its place (its digest computed as
        it is written), then a COMMIT of those digests. Each call's reply is the PUT's: a
        status per key (RESERVE's for the values not reserved, COMMIT's for the others)."""
        results: Results = {}
        reserves = [Call(c.node, Request(Op.RESERVE, self.router.next_id(), c.request.keys,
                                         c.request.sizes, [], c.request.counts), [], c.idxs,
                         answer_s=c.answer_s) for c in calls]  # fmt: skip
        reserved = await self.zmq.run(reserves)
        writes: list[tuple[Call, Reply, list[int], list[tuple[list[Any], list[Any]]]]] = []
        for call, reservation in zip(calls, reserves):
            plan = self._put_plan(call, reserved.get(reservation.request.id))
            if plan is None:
                results[call.request.id] = None
            else:
                writes.append((call, *plan))
        values = [value for *_, jobs in writes for value in jobs]
        digests = iter(await self._write(values))
        commits, commit_of = [], {}
        for call, _reply, keys, jobs in writes:
            if keys:
                sums = [next(digests) for _ in jobs]
                commit = Call(call.node, Request(Op.COMMIT, self.router.next_id(), keys, [],
                                                 sums), [], [], answer_s=call.answer_s)  # fmt: skip
                commits.append(commit)
                commit_of[call.request.id] = commit
        committed = await self.zmq.run(commits) if commits else {}
        for call, reply, keys, _ in writes:
            commit = commit_of.get(call.request.id)
            if commit is not None:
                done = _committed(committed.get(commit.request.id), len(keys))
                if done is None:
                    self.router.counters["bad_replies"] += 1
                    results[call.request.id] = None
                    continue
                taken = iter(done)
                reply.status = [next(taken) if st == Status.OK else st for st in reply.status]
            self.counters["shm_puts"] += sum(st == Status.OK for st in reply.status)
            results[call.request.id] = (reply, [])
            if call.on_reply is not None:
                call.on_reply(reply, [])
        return results

    def _put_plan(self, call: Call, result: Any) -> tuple[Reply, list[bytes], list] | None:
        """From one RESERVE's result: the PUT reply to fill in (RESERVE's statuses), the keys
        reserved and, per reserved value, ``(targets in the segment, the value's frames)``;
        None when the RESERVE failed or its reply does not make sense (a node failure)."""
        mapped = self._mapped.get(call.node)
        if result is None or mapped is None or not mapped.writable:
            return None
        reply, frames = result
        req = call.request
        ok = reply.status.count(Status.OK)
        if (reply.code is not Code.OK or reply.shm != mapped.advert or frames
                or len(reply.status) != len(req.keys) or len(reply.offs) != ok
                or len(reply.gens) != ok or not _RESERVED.issuperset(reply.status)):  # fmt: skip
            self.router.counters["bad_replies"] += 1
            return None
        keys, jobs, j, start = [], [], 0, 0
        adv, whole = mapped.advert, mapped.bytes
        for key, st, count in zip(req.keys, reply.status, req.counts):
            sizes = req.sizes[start : start + count]
            sources = call.payloads[start : start + count]
            start += count
            if st != Status.OK:
                continue
            off = reply.offs[j]
            j += 1
            if off < adv["data_offset"] or off + sum(sizes) > adv["size"]:
                self.router.counters["bad_replies"] += 1
                return None  # a place outside the segment: nothing is written
            targets, pos = [], off
            for n in sizes:
                targets.append(whole[pos : pos + n])
                pos += n
            keys.append(key)
            jobs.append((targets, sources))
        return Reply(req.id, status=list(reply.status)), keys, jobs

    async def _write(self, values: list[tuple[list[Any], list[Any]]]) -> list[int]:
        """Copy each value's frames into its targets and return the digest of what was
        written, value by value (the native checked copy on the transport's threads, on a
        driver thread; inline when small). Returns only once every copy is done."""
        nbytes = sum(sum(memoryview(f).nbytes for f in sources) for _, sources in values)
        if nbytes < PARALLEL_BYTES or self.workers < 2:
            return [copy_checksum(targets, sources) for targets, sources in values]
        try:
            fut = self._drivers()[0].submit(self._write_all, values)
        except RuntimeError:  # shut down: the client was closed meanwhile; copied here
            return self._write_all(values)
        try:
            return await asyncio.wrap_future(fut)
        finally:  # never return while a copy still reads the caller's buffers
            if not fut.done():
                concurrent.futures.wait([fut])

    def _write_all(self, values: list[tuple[list[Any], list[Any]]]) -> list[int]:
        lib = native.load()
        if lib is not None:
            return lib.copy_verify(values, threads=min(self.workers, native.MAX_THREADS))
        return list(self._numpy_pool().map(lambda value: copy_checksum(*value), values))

    def _plan(self, call: Call, result: Any) -> _Plan | None:
        """The copy jobs of one GET call from its LOCATE's result; None when the LOCATE
        failed or its reply does not make sense (a node failure)."""
        mapped = self._mapped.get(call.node)
        if result is None or mapped is None:
            return None
        reply, frames = result
        n, found = len(call.idxs), reply.status.count(Status.OK)
        if (reply.code is not Code.OK or reply.shm != mapped.advert or len(reply.status) != n
                or len(reply.offs) != found or len(reply.gens) != found
                or len(reply.sums) != found or len(reply.counts) != found
                or sum(reply.counts) != len(reply.sizes) or frames
                or any(s not in _LOCATED for s in reply.status)):  # fmt: skip
            self.router.counters["bad_replies"] += 1
            return None
        jobs, j, start = [], 0, 0
        for k, st in enumerate(reply.status):
            if st != Status.OK:
                continue
            count = reply.counts[j]
            sizes = reply.sizes[start : start + count]
            jobs.append(_Job(call, k, mapped, reply.offs[j], sizes, reply.sums[j], reply.gens[j],
                             _targets(call, k, sizes)))  # fmt: skip
            j, start = j + 1, start + count
        return _Plan(call, reply, jobs)

    def _copy(self, jobs: list[_Job]) -> None:
        """Copy ``jobs`` whose sources are set (:func:`_sources`; any thread): each job's
        ``digest`` is set; :func:`_verify` follows on the loop (:meth:`_hand_on`). A batch worth
        spreading goes to the native checked copy in one call on its share of the threads (the
        GIL released for the whole copy: a driver thread runs no other Python that could wait
        for it), else job by job (on the pool without it)."""
        ready = [job for job in jobs if job.sources is not None]
        nbytes = sum(sum(job.sizes) for job in ready)
        lib = native.load()
        if lib is not None and len(ready) > 1 and nbytes >= PARALLEL_BYTES and self.workers > 1:
            threads = min(max(1, self.workers // PIPELINE), native.MAX_THREADS)
            digests = lib.copy_verify([(job.targets, job.sources) for job in ready],
                                      threads=threads)  # fmt: skip
            for job, digest in zip(ready, digests):
                job.digest = digest
            return
        if lib is None and len(ready) > 1 and nbytes >= PARALLEL_BYTES and self.workers > 1:
            list(self._numpy_pool().map(_copy_one, ready))
            return
        for job in ready:
            _copy_one(job)

    def _drivers(self) -> tuple[ThreadPoolExecutor, asyncio.Semaphore]:
        """The threads chunks and PUT batches are copied on (``PIPELINE``), made on first use
        with the ``_slots`` that bound the chunks in copy at once."""
        if self._driver is None or self._slots is None:
            self._driver = ThreadPoolExecutor(PIPELINE, thread_name_prefix="pagekv-shm-driver")
            weakref.finalize(self, self._driver.shutdown, wait=False)
            self._slots = asyncio.Semaphore(PIPELINE)
        return self._driver, self._slots

    def _numpy_pool(self) -> ThreadPoolExecutor:
        """The threads of numpy copies, without the native checked copy (made on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pagekv-shm")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def _hand_on(self, chunk: list[_Plan], results: Results) -> None:
        """Each call's reply as a GET reply: the copied values found (frames: their
        destinations, digests: as they were copied), the evicted ones not; then the call's
        ``prepare`` and ``on_reply`` (the GET's checks and callbacks)."""
        for plan in chunk:
            call, located = plan.call, plan.located
            if any(job.why == "bad_reply" for job in plan.jobs):
                self.router.counters["bad_replies"] += 1
                results[call.request.id] = None
                continue
            status = list(located.status)
            reply = Reply(call.request.id, status=status)
            frames: list[Any] = []
            call.digests = []
            for job in plan.jobs:
                if not job.why:
                    job.why = _verify(job)
                if job.why == "evicted":
                    status[job.k] = int(Status.NOT_FOUND)
                    self.counters["shm_evicted"] += 1
                    continue
                reply.sums.append(job.checksum)
                reply.counts.append(len(job.sizes))
                frames.extend(job.targets)
                call.digests.append(job.digest)
                self.counters["shm_hits"] += not job.why
            if not reply.sums and Status.DEFERRED in status:  # its found ones all evicted
                status[:] = [int(Status.NOT_FOUND) if s == Status.DEFERRED else s for s in status]
            results[call.request.id] = (reply, frames)
            if call.prepare is not None:
                call.prepare(reply, frames)
            if call.on_reply is not None:
                call.on_reply(reply, frames)


_LOCATED = frozenset(int(s) for s in (Status.OK, Status.NOT_FOUND, Status.DEFERRED))
_RESERVED = frozenset(int(s) for s in (Status.OK, Status.EXISTS, Status.TOO_LARGE,
                                         Status.NO_SPACE, Status.BAD_KEY))  # fmt: skip
_COMMITTED = frozenset(int(s) for s in (Status.OK, Status.EXISTS, Status.NO_SPACE,
                                          Status.BAD_CHECKSUM))  # fmt: skip


def _committed(result: Any, n: int) -> list[int] | None:
    """A COMMIT's statuses (``n`` of them), or None when it failed or makes no sense."""
    if result is None:
        return None
    reply, frames = result
    if reply.code is not Code.OK or frames or len(reply.status) != n:
        return None
    if not _COMMITTED.issuperset(reply.status):
        return None
    return list(reply.status)


def _targets(call: Call, k: int, sizes: Sequence[int]) -> list[Any]:
    """Where key ``k``'s frames go: the call's destination views when they match the located
    sizes, else new buffers (numpy's, not written: only the GET's size check sees them when
    there was a destination; without one, ``get_many`` returns them)."""
    if call.sinks is not None:
        targets = call.sinks[k]
        if len(targets) == len(sizes) and all(t.nbytes == n for t, n in zip(targets, sizes)):
            return list(targets)
    return [np.empty(n, np.uint8) for n in sizes]


def _sources(job: _Job) -> None:
    """Set ``job.sources`` (views of the segment) and ``job.granules`` (those the value covers),
    or ``job.why`` when it is not copied ("size": frames do not match the destination;
    "bad_reply": outside the segment)."""
    targets = job.call.sinks[job.k] if job.call.sinks is not None else None
    if targets is not None and not all(t is s for t, s in zip(job.targets, targets)):
        job.why = "size"
        return
    adv = job.mapped.advert
    total, granule = sum(job.sizes), adv["granule"]
    first, rem = divmod(job.offset - adv["data_offset"], granule)
    last = first + max(1, -(-total // granule))
    if job.offset < adv["data_offset"] or rem or last > adv["granules"]:
        job.why = "bad_reply"
        return
    sources, pos = [], job.offset
    for n in job.sizes:
        sources.append(job.mapped.bytes[pos : pos + n])
        if sources[-1].size != n:  # a frame past the file's end: a lying reply
            job.why = "bad_reply"
            return
        pos += n
    job.sources, job.granules = sources, (first, last)


def _verify(job: _Job) -> str:
    """After the copy (see pagekv.store.node.segment): "" when the granules' generations are
    still the LOCATE's, else "evicted"."""
    first, last = job.granules
    return "" if (job.mapped.gens[first:last] == job.gen).all() else "evicted"


def _copy_one(job: _Job) -> None:
    job.digest = copy_checksum(job.targets, job.sources)  # each chunk hashed as it lands


def _map(advert: dict[str, Any]) -> tuple[Mapped | None, str]:
    """A mapping of the advertised file (writable where the node takes values written by its
    clients and the file opens for writing), or None and why not."""
    writable = bool(advert.get("writes"))
    try:
        fd = os.open(advert["path"], (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except PermissionError:
        return _map_read_only(advert) if writable else (None, "no access (another user)")
    except OSError:
        return None, "the segment file is gone"
    return _mapped(advert, fd, writable)


def _map_read_only(advert: dict[str, Any]) -> tuple[Mapped | None, str]:
    try:
        fd = os.open(advert["path"], os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        return None, "no access (another user)"
    except OSError:
        return None, "the segment file is gone"
    return _mapped(advert, fd, False)


def _mapped(advert: dict[str, Any], fd: int, writable: bool) -> tuple[Mapped | None, str]:
    try:
        st = os.fstat(fd)
        size, granules = advert["size"], advert["granules"]
        if (st.st_ino != advert["inode"] or st.st_size != size or advert["granule"] <= 0
                or advert["data_offset"] < 8 * granules
                or advert["data_offset"] + granules * advert["granule"] > size):  # fmt: skip
            return None, "the segment file is gone"  # another file by that name, or nonsense
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    except (OSError, ValueError):
        return None, "the segment file is gone"
    finally:
        os.close(fd)
    data = np.frombuffer(mm, dtype=np.uint8)
    gens = np.frombuffer(mm, dtype=np.uint64, count=granules)
    return Mapped(dict(advert), data, gens, writable), ""
