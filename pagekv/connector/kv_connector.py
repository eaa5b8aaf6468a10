"""KVConnector: what an engine plugs in to reuse KV pages across engines and machines.

    engine ──lookup/prefetch/load/save──► KVConnector ──► PageCache (pinned host pages)
                                              │                 ▲
                                              │   kernels.load/save (GPU) or torch (CPU)
                                              └──► AsyncStoreClient ──► store nodes

The connector runs its own asyncio loop in a daemon thread: store I/O (prefetch fetches, the
write-back queue) never runs on the engine's thread, and ``prefetch``/``flush`` can be awaited
from any loop. Store failures (node down, timeout, corrupt block) become misses and counters,
never exceptions in the engine's step and never wrong data.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagekv.geometry import KVGeometry
from pagekv.kernels import DeviceKV, load, save
from pagekv.store import AsyncStoreClient, ClientConfig, StoreError

from .hashing import KeyNamespace, page_keys
from .host_pool import HostPagePool, PoolExhausted
from .layerwise import LayerLoad
from .page_cache import PageCache
from .writeback import WriteBack

__all__ = ["KVConnector", "Prefetch"]

log = logging.getLogger("pagekv.connector")
Tokens = Sequence[int] | torch.Tensor


@dataclass
class Prefetch:
    """Pages of a prefix held in the host pool until :meth:`KVConnector.release`.

    ``num_tokens`` (a multiple of the page size) is what is ready to load.
    """

    keys: list[bytes]
    page_ids: list[int]
    page_size: int
    released: bool = False
    fetched: int = field(default=0)  # pages that came from the store (the rest were local)

    @property
    def num_tokens(self) -> int:
        return len(self.page_ids) * self.page_size


class KVConnector:
    """Lookup, prefetch, layer-wise load and asynchronous save of prefix pages.

    ``kv_caches``: the engine's layer-first cache, a :class:`DeviceKV` or ``(k, v)`` /
    ``(latent,)`` as accepted by :meth:`DeviceKV.from_caches`. ``store``: a
    :class:`ClientConfig` or endpoint(s). Raises ``ValueError``/``TypeError`` for bad arguments.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        kv_caches: DeviceKV | Sequence[Any],
        store: ClientConfig | str | Sequence[str],
        *,
        host_pages: int,
        namespace: KeyNamespace,
        max_pending_writes: int = 1024,
    ) -> None:
        if not isinstance(namespace, KeyNamespace):
            raise TypeError(f"namespace must be a KeyNamespace, got {type(namespace).__name__}")
        if namespace.geometry != geometry:
            raise ValueError("namespace.geometry differs from geometry")
        self.geometry, self.namespace = geometry, namespace
        self.kv = kv_caches if isinstance(kv_caches, DeviceKV) else DeviceKV.from_caches(
            geometry, *kv_caches
        )  # fmt: skip
        self.pool = HostPagePool(geometry, host_pages)
        self.cache = PageCache(self.pool)
        # MLA pages are the same on every rank: one rank writes them, all read them
        self.writes_to_store = not geometry.is_mla or namespace.tp_rank == 0
        self.stats_counters: dict[str, float] = dict.fromkeys(
            ("lookups", "lookup_tokens", "hit_tokens_host", "hit_tokens_store", "prefetches",
             "prefetch_seconds", "bytes_in", "bytes_out", "saves", "save_pool_full",
             "store_errors", "pages_saved"), 0,
        )  # fmt: skip
        cfg = store if isinstance(store, ClientConfig) else ClientConfig(
            tuple([store] if isinstance(store, str) else store)
        )  # fmt: skip
        self._inflight: dict[bytes, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.store = self._call(self._make_client(cfg))
        self.writeback = WriteBack(self, max_pending_writes)
        self._stream = torch.cuda.Stream(self.kv.device) if self.kv.device.type == "cuda" else None

    async def _make_client(self, cfg: ClientConfig) -> AsyncStoreClient:
        return AsyncStoreClient(cfg.endpoints, config=cfg)

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the connector loop from a synchronous caller."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _on_loop(self, coro: Any) -> Any:
        """Await a coroutine that runs on the connector loop, from any loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def keys(self, token_ids: Tokens) -> list[bytes]:
        return page_keys(token_ids, self.namespace)

    # ---- lookup ----------------------------------------------------------------------------
    def lookup(self, token_ids: Tokens) -> int:
        """Tokens of the longest page-aligned prefix held in the host pool or the store
        (one batched EXISTS, local hits first). No side effects on the cache."""
        keys = self.keys(token_ids)
        local = self.cache.match_prefix(keys)
        remote = 0
        if local < len(keys):
            remote = self._call(self._exists_leading(keys[local:]))
        self.stats_counters["lookups"] += 1
        self.stats_counters["lookup_tokens"] += (local + remote) * self.geometry.page_size
        return (local + remote) * self.geometry.page_size

    async def _exists_leading(self, keys: list[bytes]) -> int:
        try:
            return (await self.store.exists_many(keys)).leading
        except StoreError as e:
            self.stats_counters["store_errors"] += 1
            log.warning("pagekv: store lookup failed: %s", e)
            return 0

    # ---- prefetch --------------------------------------------------------------------------
    async def prefetch(
        self, token_ids: Tokens, *, deadline: float | None = None, min_tokens: int = 0
    ) -> Prefetch:
        """Bring the prefix's pages into pinned host pages and hold them.

        Stops at the first missing or corrupt page. Overlapping prefetches share in-flight
        fetches. ``deadline`` (``time.monotonic()`` seconds): return what arrived by then.
        Fewer than ``min_tokens`` ready: nothing is held and ``num_tokens`` is 0. Cancelling
        releases the pages this call held.
        """
        keys = self.keys(token_ids)
        done = asyncio.run_coroutine_threadsafe(
            self._prefetch(keys, deadline, min_tokens), self._loop
        )
        try:  # shielded: the fetch finishes on the connector loop whatever happens here
            return await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            done.add_done_callback(self._release_orphan)  # its holds go when it is done
            raise

    def _release_orphan(self, done: Any) -> None:
        if not done.cancelled() and done.exception() is None:
            self.release(done.result())

    async def _prefetch(
        self, keys: list[bytes], deadline: float | None, min_tokens: int
    ) -> Prefetch:
        start = time.monotonic()
        handle = Prefetch(keys, self.cache.acquire(keys), self.geometry.page_size)
        local = len(handle.page_ids)
        try:
            waits = [self._fetch_shared(k, keys[local:]) for k in keys[local:]]
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if waits:
                await asyncio.wait(waits, timeout=timeout)
            for key, fut in zip(keys[local:], waits):
                if not fut.done() or fut.cancelled() or fut.result() is None:
                    break
                held = self.cache.acquire([key])  # the fetch published it: take our hold
                if not held:
                    break
                handle.page_ids += held
                handle.fetched += 1
        except BaseException:
            self.cache.release(handle.page_ids)
            handle.page_ids, handle.released = [], True
            raise
        if handle.num_tokens < min_tokens:
            self.release(handle)
            handle.page_ids = []
        self.stats_counters["prefetches"] += 1
        self.stats_counters["prefetch_seconds"] += time.monotonic() - start
        self.stats_counters["hit_tokens_host"] += (
            min(local, len(handle.page_ids)) * handle.page_size
        )
        self.stats_counters["hit_tokens_store"] += handle.fetched * handle.page_size
        return handle

    def _fetch_shared(self, key: bytes, batch: list[bytes]) -> asyncio.Future:
        """A future for ``key``'s page (True when cached, None when missing or corrupt): the
        fetch in flight, or a new one started together with the rest of ``batch``."""
        if key not in self._inflight:
            todo = [k for k in batch if k not in self._inflight and k not in self.cache]
            futures = {k: self._loop.create_future() for k in todo}
            self._inflight.update(futures)
            task = self._loop.create_task(self._fetch(todo, futures))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if key not in futures:  # became cached meanwhile
                done = self._loop.create_future()
                done.set_result(True)
                return done
        return asyncio.shield(self._inflight[key])  # a cancelled waiter leaves the fetch be

    async def _fetch(self, keys: list[bytes], futures: dict[bytes, asyncio.Future]) -> None:
        """Fetch ``keys`` into newly allocated pages and publish the good ones. Every future
        is resolved whatever happens, so no waiter can hang."""
        pages: list[int] = []
        ok = [False] * len(keys)
        try:
            pages = self.cache.allocate(len(keys))
            views = [self.pool.page_view(p) for p in pages]
            ok = await self.store.get_many(keys, into=views)
        except (PoolExhausted, StoreError) as e:
            self.stats_counters["store_errors"] += isinstance(e, StoreError)
            log.debug("pagekv: fetch of %d pages failed: %s", len(keys), e)
        finally:
            for i, key in enumerate(keys):
                good = bool(ok[i]) and bool(pages)
                if good and self.cache.publish(key, pages[i]):
                    self.stats_counters["bytes_in"] += self.pool.page_bytes
                self._inflight.pop(key, None)
                if not futures[key].done():
                    futures[key].set_result(True if good else None)
            if pages:
                self.cache.release(pages)  # published pages stay cached, the rest go back

    def release(self, prefetch: Prefetch) -> None:
        """Drop the prefetch's holds (its pages stay cached until evicted). Idempotent."""
        if not prefetch.released:
            prefetch.released = True
            self.cache.release(prefetch.page_ids)

    # ---- load ------------------------------------------------------------------------------
    def _slots(self, prefetch: Prefetch, device_slots: Any) -> torch.Tensor:
        if prefetch.released:
            raise ValueError("prefetch was released; its pages may be reused")
        slots = torch.as_tensor(device_slots)
        n = prefetch.num_tokens
        if slots.dim() != 1 or slots.numel() < n:
            raise ValueError(f"device_slots needs {n} slots (1-D), got shape {tuple(slots.shape)}")
        return slots[:n].view(len(prefetch.page_ids), self.geometry.page_size)

    def load(self, prefetch: Prefetch, device_slots: Any) -> None:
        """Copy the prefetched pages to the device slots, all layers, on the current stream."""
        if prefetch.page_ids:
            load(self.pool.buffer, prefetch.page_ids, self.kv, self._slots(prefetch, device_slots))

    def load_async(self, prefetch: Prefetch, device_slots: Any) -> LayerLoad:
        """Layer by layer on a side stream, one event per layer: ``wait_layer(i)`` before
        computing layer ``i``. The pages stay held until released."""
        slots = self._slots(prefetch, device_slots) if prefetch.page_ids else None
        return LayerLoad(self, prefetch.page_ids, slots, self._stream)

    # ---- save ------------------------------------------------------------------------------
    def save(self, token_ids: Tokens, device_slots: Any) -> int:
        """Save the full pages of ``token_ids`` (device -> host pool on a side stream), then
        write them back to the store in the background. Returns pages newly saved. Never
        blocks on the network; a full pool skips the save (counted)."""
        keys = self.keys(token_ids)
        slots = torch.as_tensor(device_slots)
        if slots.dim() != 1 or slots.numel() < len(keys) * self.geometry.page_size:
            raise ValueError(f"device_slots needs {len(keys) * self.geometry.page_size} slots")
        new = [i for i, k in enumerate(keys) if k not in self.cache]
        self.stats_counters["saves"] += 1
        if not new:
            return 0
        try:
            pages = self.cache.allocate(len(new))
        except PoolExhausted:
            self.stats_counters["save_pool_full"] += 1
            return 0
        table = slots[: len(keys) * self.geometry.page_size].view(len(keys), -1)[new]
        event = None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
            with torch.cuda.stream(self._stream):
                save(self.kv, table.to(self.kv.device), self.pool.buffer, pages)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            save(self.kv, table, self.pool.buffer, pages)
        published = []
        for i, page in zip(new, pages):
            if self.cache.publish(keys[i], page):
                published.append((keys[i], page))
            else:
                self.cache.release([page])
        self.stats_counters["pages_saved"] += len(published)
        if self.writes_to_store and published:
            self._loop.call_soon_threadsafe(self.writeback.submit, published, event)
        else:
            self.cache.release([p for _, p in published])
        return len(published)

    async def flush(self) -> None:
        """Wait until every queued write-back has been written (or dropped)."""
        await self._on_loop(self.writeback.drain())

    def flush_sync(self, timeout: float | None = None) -> None:
        self._call(self.writeback.drain(), timeout)

    # ---- stats and lifetime ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = dict(self.stats_counters)
        out.update(self.writeback.stats(), store=dict(self.store.counters))
        out.update(host_pages=self.pool.num_pages, host_cached=len(self.cache),
                   host_held=self.cache.num_held)  # fmt: skip
        return out

    def log_stats_every(self, seconds: float) -> None:
        """Log :meth:`stats` at INFO every ``seconds`` until :meth:`close`."""

        async def report() -> None:
            while True:
                await asyncio.sleep(seconds)
                log.info("pagekv connector: %s", self.stats())

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(report()))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self.writeback.drain(), timeout=30)
        self._call(self._cancel_tasks(), timeout=10)  # the stats logger, stray fetches
        self.store.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self.pool.close()

    @staticmethod
    async def _cancel_tasks() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
