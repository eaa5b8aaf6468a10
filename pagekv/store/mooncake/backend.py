""":class:`MooncakeBackend`: the :class:`~pagekv.store.backend.StoreBackend` of a Mooncake Store.

Each value is one Mooncake object (its frames then pagekv's 16-byte trailer, see
:mod:`.values`), put from and got into the caller's buffers directly with Mooncake's
multi-buffer calls (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``) when
their frames lie in memory registered with :meth:`register` (the host pool, once); values
elsewhere (small records such as the index's epoch, test buffers) go through Mooncake's copying
calls (``put_batch`` / ``get_batch``), checked the same way. Lookups are ``batch_is_exist``; deletes
``batch_remove(force=True)`` (forced: a key read in the last ``--default_kv_lease_ttl`` would
refuse; a reader racing the removal gets a torn object, which its trailer turns into a miss).

Bounds (see :mod:`.handle` for what Mooncake itself does): every Mooncake call runs on the
handle's threads; ``exists_many`` answers within ``answer_s`` (default ``timeout_s``) whatever
Mooncake does; gets and puts are cut into calls of at most ``max_call_bytes``, run ``workers``
at a time, each verified on its thread (the hash pass), and a get hands each verified value to
``on_arrival`` as its call ends. A get or put returns only when no Mooncake call of it still
runs (also when cancelled): its buffers are never written or read after it returns. Mooncake's
own timeouts (set from ``timeout_s``) bound how long that is.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pagekv.errors import StoreError

from ..backend import StoreBackend, byte_views, check_keys
from ..client.routing import ExistsResult
from ..wire.protocol import Status
from . import values
from .config import MooncakeConfig
from .handle import (
    MASTER_ERRORS,
    MAX_CALL_KEYS,
    Busy,
    MooncakeHandle,
    NotRun,
    release,
    shared_handle,
)

__all__ = ["MooncakeBackend"]

log = logging.getLogger("pagekv.store.mooncake")
T = TypeVar("T")

_PING_KEY = b"pagekv-ping"  # looked up, never stored
# the share of local_buffer one copying put may stage (measured, 0.3.13, 16 MiB: 14.0 MiB of
# values fit, 14.4 do not; one 12 MiB value fits, one 14 MiB value does not)
COPY_SHARE = (3, 4)
NO_AVAILABLE_HANDLE = -200  # Mooncake: no segment has room for the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705


async def _result(job: concurrent.futures.Future[T], bound: float | None = None) -> T:
    """The result of a job on the handle's threads. ``StoreError`` when the pool never ran it
    (cancelled, or :class:`~.handle.NotRun`: the client closed), ``asyncio.TimeoutError`` past
    ``bound`` (the job runs on, its answer dropped); cancelling the caller raises
    ``CancelledError`` as usual, never the job's own cancellation."""
    waiting = asyncio.wrap_future(job)
    done, _ = await asyncio.wait([waiting], timeout=bound)
    if not done:
        waiting.cancel()  # (a job not started yet is not run)
        raise asyncio.TimeoutError
    if job.cancelled():
        raise StoreError("the Mooncake client closed before the call ran")
    return job.result()


@dataclass
class _Part:
    """One Mooncake call of a get or put: key indices and their trailer slots."""

    idxs: list[int]
    slots: list[int]


class MooncakeBackend(StoreBackend):
    """Mooncake Store as a pagekv store (see the module docstring). Backends of one config in
    one process share one Mooncake client (:func:`.handle.shared_handle`)."""

    kind = "mooncake"

    def __init__(self, config: MooncakeConfig) -> None:
        from .handle import import_mooncake

        import_mooncake()  # ConfigError naming the extra to install, at start-up
        self.config = config
        self._handle: MooncakeHandle | None = shared_handle(config)
        self._counters: dict[str, int] = dict.fromkeys(
            ("exists_calls", "get_calls", "put_calls", "delete_calls", "keys_found",
             "hits", "misses_not_found", "misses_checksum", "misses_size", "misses_error",
             "unanswered_keys", "lookup_timeouts", "puts_ok", "puts_no_space", "puts_failed",
             "bytes_in", "bytes_out"), 0,
        )  # fmt: skip

    # ---- StoreBackend: plain calls ------------------------------------------------------------
    @property
    def endpoints(self) -> tuple[str, ...]:
        return (self.config.name,)

    @property
    def counters(self) -> dict[str, int]:
        handle = self._handle
        return {**self._counters, **(handle.counters if handle is not None else {})}

    def register(self, address: int, nbytes: int) -> None:
        self._live().register(address, nbytes)

    def nodes_down(self) -> list[bool]:
        handle = self._handle
        return [handle is None or handle.down()]

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            release(handle)

    def _live(self) -> MooncakeHandle:
        if self._handle is None:
            raise StoreError("this Mooncake backend is closed")
        return self._handle

    def _key(self, key: bytes) -> str:
        return values.object_key(self.config.prefix, key)

    # ---- running Mooncake calls --------------------------------------------------------------
    def _usable(self) -> MooncakeHandle | None:
        """The handle, or None when calls must be misses at once (closed, backed off)."""
        handle = self._handle
        if handle is None:
            return None
        if handle.down():
            handle.counters["calls_refused_down"] += 1
            return None
        return handle

    def _codes(self, handle: MooncakeHandle, codes: Sequence[int]) -> None:
        """Back off after master-level failures; a clean answer ends a back-off."""
        if any(c in MASTER_ERRORS for c in codes):
            handle.failed()
        else:
            handle.answered()

    async def _all(self, futures: list[concurrent.futures.Future]) -> None:
        """Wait until every one of ``futures`` is over, cancellation or not: they write into
        or read the caller's buffers. Cancelled again meanwhile: still waits, then raises."""
        cancelled = False
        pending = [f for f in futures if not f.done()]
        for f in pending:
            f.cancel()  # those not started never will
        while pending:
            try:
                await asyncio.wait([asyncio.wrap_future(f) for f in pending])
            except asyncio.CancelledError:
                cancelled = True
            pending = [f for f in pending if not f.done()]
        if cancelled:
            raise asyncio.CancelledError

    async def _run_parts(
        self, handle: MooncakeHandle, sizes: list[int], job: Callable[[_Part], T],
        take: Callable[[T], None],
    ) -> None:  # fmt: skip
        """Run ``job`` for each part of the keys (:meth:`_parts` of their ``sizes``) on the
        handle's data threads, at most ``workers`` parts in flight, handing each result to
        ``take`` in order, on this loop. Parts not started when the pool is full or the store
        has failed (backed off) are not run: their keys stay misses. Returns (or raises what
        ``take`` raised, or CancelledError) only when none of its jobs runs any more."""
        parts = iter(self._parts(sizes))
        running: collections.deque[concurrent.futures.Future[T]] = collections.deque()
        try:
            while True:
                while len(running) < self.config.workers and not handle.down():
                    idxs = next(parts, None)
                    if idxs is None:
                        break
                    try:
                        running.append(self._submit(handle, idxs, job))
                    except Busy:
                        handle.counters["calls_refused_busy"] += 1
                        parts = iter(())
                        break
                if not running:
                    return
                try:
                    result = await _result(running[0])
                except StoreError:  # not run (the client closed): its keys stay misses
                    parts = iter(())
                else:
                    take(result)
                running.popleft()
        finally:
            await self._all(list(running))

    @staticmethod
    def _submit(
        handle: MooncakeHandle, idxs: list[int], job: Callable[[_Part], T]
    ) -> concurrent.futures.Future[T]:
        """``job`` of these keys with trailer slots of their own (given back by the job)."""
        slots = handle.trailers.take(len(idxs))
        try:
            future = handle.data.submit(job, _Part(idxs, slots))
        except BaseException:
            handle.trailers.give(slots)
            raise
        # a job that runs gives its slots back itself; one that never ran (cancelled, or
        # NotRun: the client closed first) never will
        future.add_done_callback(
            lambda f: (
                (f.cancelled() or isinstance(f.exception(), NotRun)) and handle.trailers.give(slots)
            )
        )
        return future

    def _parts(self, sizes: list[int]) -> list[list[int]]:
        """Key indices cut into calls of at most ``max_call_bytes`` (a larger value alone)
        and :data:`MAX_CALL_KEYS` keys."""
        parts: list[list[int]] = [[]]
        total = 0
        for i, size in enumerate(sizes):
            part = parts[-1]
            if part and (total + size > self.config.max_call_bytes or len(part) >= MAX_CALL_KEYS):
                parts.append([])
                total = 0
            parts[-1].append(i)
            total += size
        return [p for p in parts if p]

    # ---- StoreBackend: the data calls --------------------------------------------------------
    async def exists_many(
        self, keys: Sequence[bytes], *, answer_s: float | None = None
    ) -> ExistsResult:
        check_keys(keys, None, "")
        self._counters["exists_calls"] += 1
        if not keys:
            return ExistsResult([])
        handle = self._usable()
        if handle is None:
            return self._unanswered(len(keys))
        names = [self._key(k) for k in keys]
        try:
            job = handle.lookups.submit(self._exists_job, handle, names)
        except Busy:
            handle.counters["calls_refused_busy"] += 1
            return self._unanswered(len(keys))
        bound = self.config.timeout_s if answer_s is None else answer_s
        try:  # no buffers: a late answer is simply dropped
            codes = await _result(job, bound)
        except asyncio.TimeoutError:
            self._counters["lookup_timeouts"] += 1
            handle.failed()
            return self._unanswered(len(keys))
        except StoreError:
            return self._unanswered(len(keys))
        self._codes(handle, codes)
        found = [c == 1 for c in codes]
        unanswered = sum(1 for c in codes if c < 0)
        self._counters["keys_found"] += sum(found)
        self._counters["unanswered_keys"] += unanswered
        return ExistsResult(found, unanswered)

    def _unanswered(self, n: int) -> ExistsResult:
        self._counters["unanswered_keys"] += n
        return ExistsResult([False] * n, n)

    @staticmethod
    def _exists_job(handle: MooncakeHandle, names: list[str]) -> list[int]:
        return list(handle.store().batch_is_exist(names))

    async def get_many(
        self,
        keys: Sequence[bytes],
        into: Sequence[Any] | None = None,
        on_arrival: Callable[[int], None] | None = None,
    ) -> list[Any]:
        check_keys(keys, into, "into buffers")
        self._counters["get_calls"] += 1
        if into is None:
            return await self._get_copied(keys, on_arrival)
        targets = [byte_views(b, True, "get_many") for b in into]
        out: list[Any] = [False] * len(keys)
        handle = self._usable()
        if handle is None or not keys:
            self._counters["misses_error"] += len(keys)
            return out
        names = [self._key(k) for k in keys]
        sizes = [sum(f.nbytes for f in t) for t in targets]

        def take(hits: list[int]) -> None:
            for i in hits:
                out[i] = True
                if on_arrival is not None:
                    on_arrival(i)

        await self._run_parts(handle, sizes, lambda part: self._get_job(handle, part, names,
                                                                        targets), take)  # fmt: skip
        self._counters["hits"] += sum(out)
        self._counters["bytes_in"] += sum(s for s, hit in zip(sizes, out) if hit)
        return out

    def _get_job(
        self, handle: MooncakeHandle, part: _Part, names: list[str], targets: list[list[memoryview]]
    ) -> list[int]:
        """One Mooncake get of ``part``'s keys: straight into their frames (and trailers) where
        the frames are registered memory, else through Mooncake's copy; the indices whose
        object checked out."""
        trailers = handle.trailers
        try:
            direct = [(i, s) for i, s in zip(part.idxs, part.slots) if _in(handle, targets[i])]
            copied = [i for i in part.idxs if not _in(handle, targets[i])]
            try:
                hits = self._get_direct(handle, direct, names, targets)
                return hits + self._get_through_copy(handle, copied, names, targets)
            except StoreError:
                self._counters["misses_error"] += len(part.idxs)
                return []
        finally:
            trailers.give(part.slots)

    def _get_direct(
        self, handle: MooncakeHandle, keyed: list[tuple[int, int]], names: list[str],
        targets: list[list[memoryview]],
    ) -> list[int]:  # fmt: skip
        if not keyed:
            return []
        trailers = handle.trailers
        ptrs, lens, want = [], [], []
        for i, slot in keyed:
            ptrs.append([_address(f) for f in targets[i]] + [trailers.address + 16 * slot])
            lens.append([f.nbytes for f in targets[i]] + [values.TRAILER_BYTES])
            want.append(sum(lens[-1]))
        codes = handle.store().batch_get_into_multi_buffers([names[i] for i, _ in keyed],
                                                            ptrs, lens)  # fmt: skip
        self._codes(handle, codes)
        hits = []
        for (i, slot), code, size in zip(keyed, codes, want):
            ok = code == size and values.check(targets[i], names[i], trailers.view(slot))
            if ok:
                hits.append(i)
            else:
                self._count_miss(code, size)
        return hits

    def _get_through_copy(
        self, handle: MooncakeHandle, idxs: list[int], names: list[str],
        targets: list[list[memoryview]],
    ) -> list[int]:  # fmt: skip
        if not idxs:
            return []
        raw = handle.store().get_batch([names[i] for i in idxs])
        hits = []
        for i, data in zip(idxs, raw):
            data = memoryview(data or b"")
            size = sum(f.nbytes for f in targets[i]) + values.TRAILER_BYTES
            body, tail = data[: -values.TRAILER_BYTES], data[-values.TRAILER_BYTES :]
            if len(data) == size and values.check([body], names[i], tail):
                start = 0
                for frame in targets[i]:
                    frame[:] = body[start : start + frame.nbytes]
                    start += frame.nbytes
                hits.append(i)
            else:
                self._count_miss(len(data) if len(data) else OBJECT_NOT_FOUND, size)
        return hits

    def _count_miss(self, code: int, size: int) -> None:
        if code == OBJECT_NOT_FOUND:
            self._counters["misses_not_found"] += 1
        elif code >= 0 and code != size:
            self._counters["misses_size"] += 1
        elif code >= 0:
            self._counters["misses_checksum"] += 1
        else:
            self._counters["misses_error"] += 1

    async def _get_copied(
        self, keys: Sequence[bytes], on_arrival: Callable[[int], None] | None
    ) -> list[Any]:
        """Values without destinations (small records: the epoch): Mooncake copies them out
        through its own buffer; checked like the others."""
        handle = self._usable()
        out: list[Any] = [None] * len(keys)
        if handle is None or not keys:
            return out
        names = [self._key(k) for k in keys]
        try:
            job = handle.data.submit(lambda: list(handle.store().get_batch(names)))
        except Busy:
            handle.counters["calls_refused_busy"] += 1
            return out
        try:
            raw = await _result(job)
        except StoreError:
            return out
        finally:
            await self._all([job])
        for i, (name, data) in enumerate(zip(names, raw)):
            data = memoryview(bytes(data or b""))
            body = data[: -values.TRAILER_BYTES]
            if len(data) >= values.TRAILER_BYTES and values.check(
                [body], name, data[-values.TRAILER_BYTES :]
            ):
                out[i] = body.toreadonly()
                self._counters["hits"] += 1
                if on_arrival is not None:
                    on_arrival(i)
            else:
                self._counters["misses_not_found" if not len(data) else "misses_checksum"] += 1
        return out

    async def put_many(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        check_keys(keys, buffers, "buffers")
        sources = [byte_views(b, False, "put_many") for b in buffers]
        self._counters["put_calls"] += 1
        out = [Status.UNAVAILABLE] * len(keys)
        handle = self._usable()
        if handle is None or not keys:
            self._counters["puts_failed"] += len(keys)
            return out
        names = [self._key(k) for k in keys]
        sizes = [sum(f.nbytes for f in s) for s in sources]

        def take(statuses: dict[int, Status]) -> None:
            for i, status in statuses.items():
                out[i] = status

        await self._run_parts(handle, sizes, lambda part: self._put_job(handle, part, names,
                                                                        sources), take)  # fmt: skip
        stored = [s for s, st in zip(sizes, out) if st in (Status.OK, Status.EXISTS)]
        self._counters["puts_ok"] += len(stored)
        self._counters["puts_no_space"] += out.count(Status.NO_SPACE)
        self._counters["puts_failed"] += out.count(Status.UNAVAILABLE)
        self._counters["bytes_out"] += sum(stored)
        return out

    def _put_job(
        self, handle: MooncakeHandle, part: _Part, names: list[str], sources: list[list[memoryview]]
    ) -> dict[int, Status]:
        """One Mooncake put of ``part``'s values and fresh trailers: straight from their frames
        where those are registered memory, else through Mooncake's copy. A value whose put
        failed is ``UNAVAILABLE`` (never reported stored)."""
        trailers = handle.trailers
        try:
            direct = [(i, s) for i, s in zip(part.idxs, part.slots) if _in(handle, sources[i])]
            copied = [i for i in part.idxs if not _in(handle, sources[i])]
            try:
                out = self._put_direct(handle, direct, names, sources)
                out.update(self._put_through_copy(handle, copied, names, sources))
                return self._confirmed(handle, out, names)
            except StoreError as e:
                log.debug("pagekv: Mooncake put failed: %s", e)
                return dict.fromkeys(part.idxs, Status.UNAVAILABLE)
        finally:
            trailers.give(part.slots)

    def _confirmed(
        self, handle: MooncakeHandle, out: dict[int, Status], names: list[str]
    ) -> dict[int, Status]:
        """Mooncake answers 0 for a put of a key whose first put is still in flight, though
        nothing may come of it: a key put OK is looked up, and is OK only once readable."""
        done = [i for i, status in out.items() if status is Status.OK]
        if done:
            codes = list(handle.store().batch_is_exist([names[i] for i in done]))
            self._codes(handle, codes)
            for i, code in zip(done, codes):
                if code != 1:
                    out[i] = Status.UNAVAILABLE
        return out

    def _put_direct(
        self, handle: MooncakeHandle, keyed: list[tuple[int, int]], names: list[str],
        sources: list[list[memoryview]],
    ) -> dict[int, Status]:  # fmt: skip
        if not keyed:
            return {}
        trailers = handle.trailers
        ptrs, lens = [], []
        for i, slot in keyed:
            trailers.view(slot)[:] = values.trailer(sources[i], names[i])
            ptrs.append([_address(f) for f in sources[i]] + [trailers.address + 16 * slot])
            lens.append([f.nbytes for f in sources[i]] + [values.TRAILER_BYTES])
        store = handle.store()
        codes = store.batch_put_from_multi_buffers([names[i] for i, _ in keyed], ptrs, lens,
                                                   self._replicate())  # fmt: skip
        self._codes(handle, codes)
        return {i: _put_status(c) for (i, _), c in zip(keyed, codes)}

    def _put_through_copy(
        self, handle: MooncakeHandle, idxs: list[int], names: list[str],
        sources: list[list[memoryview]],
    ) -> dict[int, Status]:  # fmt: skip
        """Mooncake stages a copying put whole in its ``local_buffer``: values are put in
        groups that fit it; a value that cannot fit is ``UNAVAILABLE`` (register its memory)."""
        out: dict[int, Status] = {}
        room = self.config.local_buffer * COPY_SHARE[0] // COPY_SHARE[1]
        groups: list[list[int]] = [[]]
        used = 0
        for i in idxs:
            size = sum(f.nbytes for f in sources[i]) + values.TRAILER_BYTES
            if size > room:
                log.warning("pagekv: a value of %d bytes cannot be put through Mooncake's "
                            "local_buffer (%d bytes): register its memory, or raise "
                            "local_buffer", size, self.config.local_buffer)  # fmt: skip
                out[i] = Status.UNAVAILABLE
                continue
            if used + size > room:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += size
        store = handle.store()
        for group in filter(None, groups):
            data = [b"".join(sources[i]) + values.trailer(sources[i], names[i]) for i in group]
            code = store.put_batch([names[i] for i in group], data, self._replicate())
            self._codes(handle, [code])
            out.update(dict.fromkeys(group, _put_status(code)))
        return out

    def _replicate(self) -> Any:
        from .handle import import_mooncake

        cfg = import_mooncake().ReplicateConfig()
        cfg.replica_num = self.config.replicas
        return cfg

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys, None, "")
        self._counters["delete_calls"] += 1
        handle = self._usable()
        if handle is None or not keys:
            return [False] * len(keys)
        names = [self._key(k) for k in keys]
        try:
            job = handle.data.submit(lambda: list(handle.store().batch_remove(names, True)))
            codes = await _result(job)
        except StoreError:  # Busy included
            return [False] * len(keys)
        self._codes(handle, codes)
        return [c == 0 for c in codes]

    async def stats(self) -> list[dict | None]:
        """The master's view is not exposed by Mooncake's Python client: this client's
        counters (one entry: the master)."""
        return [self.counters]

    async def ping(self, *, answer_s: float | None = None) -> list[bool]:
        handle = self._handle
        if handle is None:
            return [False]
        bound = self.config.timeout_s if answer_s is None else min(answer_s, self.config.timeout_s)
        name = self._key(_PING_KEY)
        try:  # a lookup: a round trip to the master now (health_check() only reads a flag)
            job = handle.lookups.submit(lambda: list(handle.store().batch_is_exist([name])))
            (code,) = await _result(job, bound)
        except (StoreError, asyncio.TimeoutError):  # Busy included
            return [False]
        self._codes(handle, [code])
        return [code >= 0]


def _in(handle: MooncakeHandle, frames: list[memoryview]) -> bool:
    """Whether every frame lies in memory registered with Mooncake."""
    return all(handle.registered(_address(f), f.nbytes) for f in frames)


def _address(view: memoryview) -> int:
    """The address of a contiguous byte view (its owner keeps it alive for the call)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _put_status(code: int) -> Status:
    if code == 0:
        return Status.OK
    if code == OBJECT_ALREADY_EXISTS:
        return Status.EXISTS
    if code == NO_AVAILABLE_HANDLE:
        return Status.NO_SPACE
    return Status.UNAVAILABLE
