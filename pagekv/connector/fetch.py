"""Fetching pages from the store into the host tier, shared between overlapping prefetches.

Runs on the connector's loop. One fetch per key at a time (``inflight``): a prefetch that wants
a key another one is already fetching waits for that fetch. Pages are *handed over*: when a
fetched page is published, every prefetch still waiting for it gets its own hold at once (under
the cache lock), so nothing can evict the page between its arrival and its use. The keys a
prefetch fetches go to the store in key order, as a few batches (``get_many`` calls, a task each):
the first of ``FIRST_BATCH_BYTES``, each next twice the last, up to ``MOST_BATCH_BYTES``, so
that over the bulk lane the first requests leave while the client still prepares the later
ones (a batch's preparation costs a few microseconds a key: on the H200 host a 4 GiB prefetch
of 2048 pages from 3 nodes had its first page 24 ms after the call instead of 32, at the same
GB/s; see :meth:`Fetcher._fetch_in_batches` for the other routes). Each
page is published the moment it arrives (the client's per-key ``on_arrival``), so a prefetch
with a deadline returns the leading pages that came in time. When the pool is short, the
leading keys that fit are fetched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pagekv.errors import StoreError
from pagekv.store.backend import StoreBackend

from .host_pool import HostPagePool
from .page_cache import PageCache

__all__ = ["FIRST_BATCH_BYTES", "MOST_BATCH_BYTES", "Fetcher", "Waiter", "batches"]

log = logging.getLogger("pagekv.connector")
FIRST_BATCH_BYTES = 128 << 20  # a fetch's first get_many: its requests leave soonest
MOST_BATCH_BYTES = 1 << 30  # each next batch doubles up to this


def batches(count: int, page_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of a fetch of ``count`` pages, in order: the first of about
    ``FIRST_BATCH_BYTES`` (at least one page), each next twice as long, up to
    ``MOST_BATCH_BYTES``."""
    runs, start = [], 0
    size = max(1, FIRST_BATCH_BYTES // page_bytes)
    most = max(size, MOST_BATCH_BYTES // page_bytes)
    while start < count:
        runs.append((start, min(count, start + size)))
        start, size = start + size, min(most, 2 * size)
    return runs


@dataclass(eq=False)
class Waiter:
    """One prefetch's claim on in-flight keys: ``held`` gets a held page per key handed over.
    ``on_handed`` (loop thread, must not raise) runs right after pages were handed over, from
    inside the store client's arrival callback: a prefetch takes its leading pages and starts
    their load there, between the arrivals of a burst (the same-host shortcut publishes a
    whole chunk of values from one callback, during which no coroutine runs)."""

    held: dict[bytes, int] = field(default_factory=dict)
    on_handed: Callable[[], None] | None = None


@dataclass(eq=False)
class _Inflight:
    future: asyncio.Future
    waiters: set[Waiter] = field(default_factory=set)


@dataclass(eq=False)
class _Batch:
    """Keys being fetched into their pages, in key order, and which of them have ended (handed
    over, or ended as a miss)."""

    pairs: list[tuple[bytes, int]]  # (key, page)
    ended: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.ended = [False] * len(self.pairs)


class Fetcher:
    def __init__(
        self, cache: PageCache, pool: HostPagePool, store: StoreBackend, counters: dict[str, float]
    ) -> None:
        self.cache, self.pool, self.store, self.counters = cache, pool, store, counters
        self.inflight: dict[bytes, _Inflight] = {}
        self._tasks: set[asyncio.Task] = set()

    def want(self, keys: list[bytes], waiter: Waiter) -> list[asyncio.Future]:
        """A future per key (True: page handed to ``waiter``; None: missing, corrupt or no
        room). Keys cached now are handed over at once; keys in flight are joined; the leading
        rest that fit in the pool are fetched. Loop thread only."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        todo: list[bytes] = []
        fresh = [key for key in dict.fromkeys(keys) if key not in self.inflight]
        cached = dict(zip(fresh, self.cache.acquire_each(fresh)))  # one lock for them all
        for key in keys:
            entry = self.inflight.get(key)
            if entry is not None:
                entry.waiters.add(waiter)
                futures.append(entry.future)
                continue
            fut = loop.create_future()
            page = cached.pop(key, None)
            if page is not None:
                waiter.held[key] = page
                fut.set_result(True)
            elif key in waiter.held:  # a repeat of a key handed over above
                fut.set_result(True)
            else:
                self.inflight[key] = _Inflight(fut, {waiter})
                todo.append(key)
            futures.append(fut)
        if todo:
            try:
                pages = self.cache.allocate(len(todo), partial=True)
            except BaseException:  # no waiter may hang on a key that is never fetched
                for key in todo:
                    self._resolve(key, None)
                raise
            for key in todo[len(pages) :]:  # no room: a miss for this prefetch, not an error
                self._resolve(key, None)
            if len(pages) < len(todo):
                self.counters["prefetch_pool_short"] += len(todo) - len(pages)
            if pages:
                whole = _Batch(list(zip(todo, pages)))
                self._start(self._fetch_in_batches(whole), whole)
        return futures

    def _start(self, job: Coroutine[Any, Any, None], batch: _Batch) -> None:
        """Run ``job`` (over ``batch``) as a task. When it ends, the keys of ``batch`` not ended
        yet end as misses (:meth:`_miss_rest`): all of them where it was cancelled before its
        first step (the connector closing: such a task runs no ``finally`` of its own), none
        where a fetch ran to its end, the keys not yet handed to a batch where the
        coordinator was cancelled."""
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._miss_rest(batch))

    def _miss_rest(self, batch: _Batch) -> None:
        """End each key of ``batch`` not ended yet as a miss (its waiters told None) and
        release its page. Idempotent."""
        rest = [i for i, ended in enumerate(batch.ended) if not ended]
        for i in rest:
            batch.ended[i] = True
            self._resolve(batch.pairs[i][0], None)
        self.cache.release([batch.pairs[i][1] for i in rest])

    def forget(self, waiter: Waiter) -> None:
        """``waiter`` stops waiting (done or out of time): no page is handed to it any more."""
        for entry in self.inflight.values():
            entry.waiters.discard(waiter)

    async def _fetch_in_batches(self, whole: _Batch) -> None:
        """Start the fetch's :func:`batches` in order, each once the last one has run up to its
        first wait. Over the bulk lane to a node already known (a lookup PINGed it) that wait
        comes after its requests are queued to the lane's connections, so the first requests
        leave before the later batches are prepared; elsewhere (ZeroMQ, the same-host
        shortcut, a node to PING first) a batch waits earlier and the next ones are prepared
        before its requests leave, in key order all the same. A key handed to a batch is ended
        in ``whole`` (its batch ends it); those never handed (cancelled) end as misses."""
        for start, end in batches(len(whole.pairs), self.pool.page_bytes):
            batch = _Batch(whole.pairs[start:end])
            whole.ended[start:end] = [True] * (end - start)
            self._start(self._fetch(batch), batch)
            await asyncio.sleep(0)  # that batch runs now, up to its first wait

    async def _fetch(self, batch: _Batch) -> None:
        """Fetch keys into their pages; each page is published and handed over the moment its
        value is verified and in place (``on_arrival``), so a prefetch with a deadline keeps
        the leading pages that came in time. Every key is ended whatever happens (missing,
        corrupt, failed or cancelled: :meth:`_miss_rest`), so no waiter can hang."""

        def arrived(i: int) -> None:
            key, page = batch.pairs[i]
            fresh = self.cache.publish(key, page)  # raising: the key ends as a miss, below
            batch.ended[i] = True
            if fresh:
                self.counters["bytes_in"] += self.pool.page_bytes
                self._resolve(key, page, own=True)  # this fetch's hold goes to a waiter
            else:  # cached meanwhile by a save: hand that one over
                self._resolve(key, None, existing=True)
                self.cache.release([page])

        try:
            views = self.pool.page_views([p for _, p in batch.pairs])
            keys = [k for k, _ in batch.pairs]
            await self.store.get_many(keys, into=views, on_arrival=arrived)
        except StoreError as e:
            self.counters["store_errors"] += 1
            log.debug("pagekv: fetch of %d pages failed: %s", len(batch.pairs), e)
        finally:
            self._miss_rest(batch)

    def _resolve(
        self, key: bytes, page: int | None, *, existing: bool = False, own: bool = False
    ) -> None:
        """End ``key``'s fetch: give each waiter its own hold on ``page`` (or, ``existing``,
        on the page cached under ``key`` by someone else), then wake them and run their
        ``on_handed``. ``own``: the caller's hold on the published ``page`` is handed to the
        first waiter (released, the page left cached and evictable, when none waits), so
        the common case, one prefetch waiting, takes no lock here."""
        entry = self.inflight.pop(key)
        told: list[Waiter] = []  # those handed a page
        for waiter in entry.waiters:
            if page is not None:
                if own:
                    own = False
                else:
                    self.cache.hold(page)
                waiter.held[key] = page
                told.append(waiter)
            elif existing and (held := self.cache.acquire([key])):
                waiter.held[key] = held[0]
                told.append(waiter)
        if own:
            self.cache.release([page])
        if not entry.future.done():
            entry.future.set_result(True if told or page is not None else None)
        for waiter in told:
            if waiter.on_handed is not None:
                waiter.on_handed()

    async def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
