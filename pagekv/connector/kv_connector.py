"""KVConnector: what an engine's worker plugs in to reuse KV pages across engines and machines.

    engine ──lookup/prefetch/load/save──► KVConnector ──► PageCache (pinned host pages)
                                              │                 ▲
                                              │   kernels.load/save (GPU) or torch (CPU)
                                              └──► KVIndex / StoreBackend ──► store nodes
                                                                            or Mooncake Store

The contract with the engine (tested in tests/gpu/test_engine_contract_gpu.py):

1. **Save vs slot reuse.** After :meth:`save` returns, the engine may overwrite the saved
   slots on its current stream: by default that stream waits (GPU-side) on the save's
   device -> host copy. ``engine_waits=False`` leaves the ordering to the engine, which then
   waits on :attr:`SaveHandle.event` itself (vLLM's ``wait_for_save``).
2. **Publish after completion.** A saved page is indexed at once, with the copy's event as its
   ready event: every load of it first waits on that event, so a host-tier hit right after a
   save loads the saved bytes.
3. **No reuse of a host page while a copy uses it.** Pages a copy reads or writes are released
   only after the copy's event (a failed publish, a non-writer rank, :meth:`release` after
   :meth:`load`/:meth:`load_async`); held pages are never evicted or refilled.
4. **Layer-wise load lifetimes.** Index tensors of :meth:`load_async` live on the load stream
   until its kernels finish (see :mod:`.layerwise`).
5. **No hidden host syncs.** :meth:`save`, :meth:`load` and :meth:`load_async` validate CPU
   indices on the CPU and either hand them to the copy engine as they are (where
   ``PAGEKV_COPY_BACKEND=auto`` and the measured table pick it: :mod:`.transfer_indices`) or
   upload them for the kernel (the default) from a pinned ring
   allocated once (a page-locked allocation or a pageable upload would synchronise the
   device); saves and loads run on separate streams.
6. **Bounded waits.** :meth:`lookup` returns within ``lookup_timeout_s``; store failures are
   misses and counters (``stats()['store_errors']``), never exceptions in the engine's step.
7. **Pool pressure.** A prefetch takes the longest prefix that fits; fetched pages are handed
   to their prefetch under the cache lock (see :mod:`.fetch`); eviction is O(1) per page.
8. **Prefetch into device slots.** ``prefetch(..., device_slots=)`` loads the leading pages on
   the load stream while later ones still arrive (:mod:`.streaming_load`), after the caller's
   stream as it was at the call. Chunks may still be landing when it returns, short or not
   (``num_tokens`` 0 included): the engine's stream calls ``handle.wait_loaded()`` before
   reading or writing those slots (tests/gpu/test_streaming_load_gpu.py).

The connector runs its own asyncio loop in a daemon thread (store I/O never runs on the
engine's thread); ``prefetch``/``flush`` can be awaited from any loop, ``prefetch_sync`` and
``flush_sync`` called from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagekv.errors import ConnectorClosed, PoolExhausted
from pagekv.geometry import KVGeometry
from pagekv.kernels import DeviceKV, calibrate, load, save
from pagekv.kernels.jit import copy_backend_setting, load_library
from pagekv.kernels.layout import check_slots
from pagekv.store import ClientConfig
from pagekv.store.wire import native

from .copy_issuer import AllOf, CopyIssuer
from .fetch import Fetcher, Waiter
from .handles import Prefetch, SaveHandle
from .hashing import KeyNamespace, page_keys
from .host_pool import HostPagePool
from .index import KVIndex, client_config
from .layerwise import LayerLoad
from .lifecycle import drain_writeback, register_exit_flush
from .loop import LoopThread
from .page_cache import PageCache
from .policy import FetchPolicy
from .staging import IndexStaging
from .streaming_load import StreamingLoad
from .transfer_indices import host_ids, launch
from .writeback import WriteBack, notify

__all__ = ["KVConnector", "Prefetch", "SaveHandle"]

log = logging.getLogger("pagekv.connector")
Tokens = Sequence[int] | torch.Tensor
_COUNTERS = (
    "lookups", "lookup_tokens", "hit_tokens_host", "hit_tokens_store", "prefetches",
    "prefetch_seconds", "prefetch_pool_short", "bytes_in", "bytes_out", "saves",
    "save_pool_full", "store_errors", "pages_saved", "pages_written_again",
)  # fmt: skip


class KVConnector:
    """Lookup, prefetch, layer-wise load and asynchronous save of prefix pages (see module
    docstring for the contract).

    ``kv_caches``: the engine's layer-first cache, a :class:`DeviceKV` or ``(k, v)`` /
    ``(latent,)`` as accepted by :meth:`DeviceKV.from_caches`. ``store``: a
    :class:`ClientConfig`, endpoint(s), a ``mooncake://`` address or a ``MooncakeConfig``
    (the backend is chosen once from it; the host pool is registered with it once, for
    zero-copy transfers). Raises ``ValueError``/``TypeError`` for bad arguments; a failed
    constructor leaves no thread behind. ``on_stored(keys)``: called on the connector's loop
    thread with the keys of each write-back the store confirmed holding (see
    :class:`~.writeback.WriteBack`); ``on_unsaved(keys)``: with the keys a :meth:`save` was
    given that will not reach the store (a full pool, a host page evicted before its write
    again, a write-back refused, failed or dropped), on the loop or on the caller's thread.
    Both must be quick, thread-safe and must not raise.
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
        lookup_timeout_s: float = 0.05,
        close_timeout_s: float = 30.0,
        on_stored: Callable[[list[bytes]], Any] | None = None,
        on_unsaved: Callable[[list[bytes]], Any] | None = None,
    ) -> None:
        if not isinstance(namespace, KeyNamespace):
            raise TypeError(f"namespace must be a KeyNamespace, got {type(namespace).__name__}")
        if namespace.geometry != geometry:
            raise ValueError("namespace.geometry differs from geometry")
        self.geometry, self.namespace = geometry, namespace
        self.kv = kv_caches if isinstance(kv_caches, DeviceKV) else DeviceKV.from_caches(
            geometry, *kv_caches
        )  # fmt: skip
        cfg = client_config(store)  # validated before any thread or pinned memory exists
        self.close_timeout_s = close_timeout_s
        self.writes_to_store = namespace.is_writer
        self.stats_counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self.pool = HostPagePool(geometry, host_pages)
        self.cache = PageCache(self.pool)
        self._loop = LoopThread("pagekv-connector")
        try:
            self.index = KVIndex(namespace, cfg, lookup_timeout_s=lookup_timeout_s,
                                 loop=self._loop)  # fmt: skip
            self.store = self.index.store
            self.store.register(self.pool.address, self.pool.nbytes)
            self.fetcher = Fetcher(self.cache, self.pool, self.store, self.stats_counters)
            self.writeback = WriteBack(self.cache, self.pool, self.store, max_pending_writes,
                                       self.stats_counters, on_stored, on_unsaved)  # fmt: skip
            self.on_unsaved = on_unsaved
        except BaseException:
            self._loop.close()
            self.pool.close()
            raise
        cuda = self.kv.device.type == "cuda"
        self._save_stream = torch.cuda.Stream(self.kv.device) if cuda else None
        self._load_stream = torch.cuda.Stream(self.kv.device) if cuda else None
        self._staging = IndexStaging() if cuda else None  # the only page-locked allocation
        # enqueues the copy-engine transfers of load_async, streaming loads and saves
        self._issuer = CopyIssuer(self.kv.device) if cuda else None
        if cuda and load_library() is not None:
            self.kv.pointer_table(self.kv.device)  # made here (a sync), not by the first kernel
        self._closed = False
        # host <-> device copies (load, load_async, save) by the backend they used
        self.transfer_backends: collections.Counter[str] = collections.Counter()
        # a fetch-or-recompute policy the engine consults; its decisions and their inputs show
        # in stats()["policy"]
        self.policy: FetchPolicy | None = None
        register_exit_flush(self)

    # ---- keys and arguments ----------------------------------------------------------------
    def keys(self, token_ids: Tokens) -> list[bytes]:
        return page_keys(token_ids, self.namespace)

    def _keys(self, token_ids: Tokens | None, keys: Sequence[bytes] | None) -> list[bytes]:
        if self._closed:
            raise ConnectorClosed("KVConnector is closed")
        if (token_ids is None) == (keys is None):
            raise ValueError("pass exactly one of token_ids and keys")
        return self.keys(token_ids) if keys is None else list(keys)

    def _slot_table(self, device_slots: Any, num_pages: int, skips: bool = True) -> torch.Tensor:
        """``[num_pages, page_size]`` slots; CPU slots are range-checked here, on the CPU
        (negative ones, which skip a token, refused unless ``skips``)."""
        if isinstance(device_slots, torch.Tensor) and device_slots.is_cuda:
            s = device_slots.view(-1)[: num_pages * self.geometry.page_size]
            return check_slots(s, num_pages, self.geometry.page_size, self.kv.num_slots,
                               check_values=False)  # fmt: skip
        s = torch.as_tensor(device_slots)
        if s.dim() == 2:
            s = s.reshape(-1)
        need = num_pages * self.geometry.page_size
        if s.dim() != 1 or s.numel() < need:
            raise ValueError(f"device_slots needs {need} slots (1-D), got shape {tuple(s.shape)}")
        return check_slots(s[:need], num_pages, self.geometry.page_size, self.kv.num_slots,
                           skips=skips)  # fmt: skip

    def _count(self, backend: str) -> None:
        self.transfer_backends[backend] += 1

    # ---- lookup ----------------------------------------------------------------------------
    def connect(self, timeout_s: float = 5.0) -> bool:
        """Connect to the store's nodes now (see :meth:`KVIndex.connect`), so that the first
        bounded lookup does not pay for the connections, and load (or build, ~1 s) the store's
        native checked copy, so that the first fetch does not pay for that. True when every
        node answered; never raises on store trouble (``NativeCopyUnavailable`` only with
        ``PAGEKV_NATIVE_COPY=on`` and no library). On CUDA with ``PAGEKV_COPY_BACKEND=auto``
        it also reads (or measures, ~30 s once per GPU and driver) the table that picks each
        copy's backend (:func:`pagekv.kernels.calibrate`), which the first load or save would do
        otherwise; a table measured on a busy host is provisional: a start-up that finds it
        cached runs a 2-4 s trial (one between the processes starting together) and measures
        again if the host is quiet. Call at start-up, not per request."""
        native.load()
        cuda = self.kv.device.type == "cuda" and load_library() is not None
        if cuda and copy_backend_setting() == "auto":
            calibrate(self.kv.device.index)
        return self.index.connect(timeout_s)

    def lookup(
        self, token_ids: Tokens | None = None, *, keys: Sequence[bytes] | None = None
    ) -> int:
        """Tokens of the longest page-aligned prefix held in the host pool or the store (host
        tier first, then one batched EXISTS bounded by ``lookup_timeout_s``: on timeout the
        host-tier hit). No side effects on the cache; never raises on store trouble."""
        keys = self._keys(token_ids, keys)
        local = self.cache.match_prefix(keys)
        remote = self.index.lookup_pages([keys[local:]]) if local < len(keys) else 0
        self.stats_counters["lookups"] += 1
        self.stats_counters["lookup_tokens"] += (local + remote) * self.geometry.page_size
        return (local + remote) * self.geometry.page_size

    # ---- prefetch --------------------------------------------------------------------------
    async def prefetch(
        self,
        token_ids: Tokens | None = None,
        *,
        keys: Sequence[bytes] | None = None,
        deadline: float | None = None,
        min_tokens: int = 0,
        device_slots: Any = None,
    ) -> Prefetch:
        """Bring the prefix's pages into pinned host pages and hold them.

        Stops at the first missing or corrupt page, and takes no more pages than fit in the
        free and evictable pool. Overlapping prefetches share in-flight fetches. ``deadline``
        (``time.monotonic()`` seconds): return the leading pages that arrived by then. Fewer
        than ``min_tokens`` ready: nothing is held and ``num_tokens`` is 0. Cancelling releases
        the pages this call held.

        ``device_slots`` (as for :meth:`load`, for every full page of the prompt; copied at the
        call): also load the leading pages there while later pages still arrive, in chunks on
        the load stream (contract 8). ``handle.loaded_tokens`` says how many tokens were
        loaded; the engine's stream calls ``handle.wait_loaded()`` before it reads or writes
        those slots, in every case. Cancelling then stops further chunks and makes the current
        stream of the cancelled caller wait on those launched.
        """
        keys = self._keys(token_ids, keys)
        loader = self._streaming(device_slots, len(keys))
        done = self._loop.submit(self._prefetch(keys, deadline, min_tokens, loader))
        try:  # shielded: the fetch finishes on the connector loop whatever happens here
            return await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            if loader is not None:
                loader.stop()
                loader.wait()
            done.add_done_callback(self._release_orphan)  # its holds go when it is done
            raise

    def prefetch_sync(
        self,
        token_ids: Tokens | None = None,
        *,
        keys: Sequence[bytes] | None = None,
        timeout_s: float,
        min_tokens: int = 0,
        device_slots: Any = None,
    ) -> Prefetch:
        """:meth:`prefetch` from a synchronous caller (any thread), returning within about
        ``timeout_s`` with the leading pages that arrived by then."""
        keys = self._keys(token_ids, keys)
        loader = self._streaming(device_slots, len(keys))
        deadline = time.monotonic() + timeout_s
        done = self._loop.submit(self._prefetch(keys, deadline, min_tokens, loader))
        try:
            return done.result(timeout_s + 1.0)
        except (
            concurrent.futures.TimeoutError
        ):  # the loop is stuck: never block the engine, release later
            if loader is not None:
                loader.stop()  # wait_loaded on the handle below covers every chunk launched
            done.add_done_callback(self._release_orphan)
            return Prefetch(keys, [], self.geometry.page_size, released=True, streaming=loader)

    def _streaming(self, device_slots: Any, num_pages: int) -> StreamingLoad | None:
        if device_slots is None:
            return None
        table = self._slot_table(device_slots, num_pages)
        return StreamingLoad(self.kv, self.pool.buffer, self.cache, table, self._load_stream,
                             self._staging, self._issuer)  # fmt: skip

    def _release_orphan(self, done: Any) -> None:
        if not done.cancelled() and done.exception() is None:
            self.release(done.result())

    async def _prefetch(
        self,
        keys: list[bytes],
        deadline: float | None,
        min_tokens: int,
        loader: StreamingLoad | None = None,
    ) -> Prefetch:
        start = time.monotonic()
        handle = Prefetch(keys, self.cache.acquire(keys), self.geometry.page_size, streaming=loader)
        local = len(handle.page_ids)
        rest = keys[local:]
        failed: list[Exception] = []

        def take() -> None:
            """Move the leading pages handed over so far into the handle (key order), each
            launching the chunk it completes (a gap filled late, replies arriving out of order,
            releases many pages at once: still one launch per chunk). Also run by
            ``waiter.on_handed``, inside the store's arrival callbacks, where what it raises
            waits for this coroutine."""
            while handle.fetched < len(rest):
                page = waiter.held.pop(rest[handle.fetched], None)
                if page is None:
                    break
                handle.page_ids.append(page)
                handle.fetched += 1
                if loader is not None:
                    loader.advance(handle)

        def on_handed() -> None:
            if not failed:
                try:
                    take()
                except Exception as e:  # a failed load launch: the prefetch raises it
                    failed.append(e)

        waiter = Waiter(on_handed=on_handed)
        try:
            if loader is not None:
                loader.advance(handle)
            futures = self.fetcher.want(rest, waiter) if rest else []
            while handle.fetched < len(futures) and not failed:
                at, fut = handle.fetched, futures[handle.fetched]
                if not fut.done():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    try:
                        await asyncio.wait_for(asyncio.shield(fut), left)
                    except asyncio.TimeoutError:
                        break
                take()
                if handle.fetched == at:  # key ``at`` is missing: the leading run ends there
                    break
            if failed:
                raise failed[0]
            if loader is not None and handle.num_tokens >= min_tokens:
                loader.advance(handle, final=True)
        except BaseException:
            if loader is not None:
                loader.stop()
            self.cache.release(handle.page_ids, after=handle.loads)
            handle.page_ids, handle.released = [], True
            raise
        finally:
            self.fetcher.forget(waiter)
            if waiter.held:  # handed over but not leading (after a miss or the deadline)
                self.cache.release(list(waiter.held.values()))
        if handle.num_tokens < min_tokens:
            self.release(handle)
            handle.page_ids = []
        counters = self.stats_counters
        counters["prefetches"] += 1
        counters["prefetch_seconds"] += time.monotonic() - start
        counters["hit_tokens_host"] += min(local, len(handle.page_ids)) * handle.page_size
        counters["hit_tokens_store"] += handle.fetched * handle.page_size
        return handle

    def release(self, prefetch: Prefetch) -> None:
        """Drop the prefetch's holds; safe right after :meth:`load`/:meth:`load_async`: the
        pages stay held until those copies complete (their events). Idempotent."""
        if not prefetch.released:
            self.cache.release(prefetch.page_ids, after=prefetch.loads)
            prefetch.released = True

    # ---- load ------------------------------------------------------------------------------
    def _load_slots(self, prefetch: Prefetch, device_slots: Any) -> torch.Tensor:
        if prefetch.released:
            raise ValueError("prefetch was released; its pages may be reused")
        return self._slot_table(device_slots, prefetch.num_pages)

    def load(self, prefetch: Prefetch, device_slots: Any) -> None:
        """Copy the prefetched pages to the device slots, all layers, on the current stream
        (after any save still filling them)."""
        if not prefetch.page_ids:
            return
        slots = self._load_slots(prefetch, device_slots)
        if self._load_stream is None:
            self._count(load(self.pool.buffer, prefetch.page_ids, self.kv, slots))
            return
        stream = torch.cuda.current_stream(self.kv.device)
        for event in self.cache.ready_events(prefetch.page_ids):
            stream.wait_event(event)
        # on the caller's stream, which the caller's later work follows: never deferred
        out = launch(True, self.kv, self.pool.buffer, prefetch.page_ids, slots, self._staging,
                     None)  # fmt: skip
        self._count(out.backend)
        prefetch.loads.append(out.events[0])

    def load_async(self, prefetch: Prefetch, device_slots: Any) -> LayerLoad:
        """Layer by layer on the load stream, one event per layer: ``wait_layer(i)`` before
        computing layer ``i``. No host sync; :meth:`release` may follow at once."""
        if not prefetch.page_ids:
            return LayerLoad(self.kv, self.pool.buffer, [], None, None)
        slots = self._load_slots(prefetch, device_slots)
        ready = self.cache.ready_events(prefetch.page_ids) if self._load_stream else []
        layers = LayerLoad(self.kv, self.pool.buffer, prefetch.page_ids, slots,
                           self._load_stream, ready, self._staging, self._issuer)  # fmt: skip
        if layers.done_event is not None:
            prefetch.loads.append(layers.done_event)
        self._count(layers.backend)
        return layers

    # ---- save ------------------------------------------------------------------------------
    def save(
        self,
        token_ids: Tokens | None = None,
        device_slots: Any = None,
        *,
        keys: Sequence[bytes] | None = None,
        engine_waits: bool = True,
        write_through: bool = False,
    ) -> SaveHandle:
        """Save the full pages of ``token_ids`` (or ``keys``) from ``device_slots``: device ->
        host pool on the save stream, then write-back to the store in the background.

        Never blocks on the network or the GPU; a full pool skips the save (counted). With
        ``engine_waits`` (default) the engine's current stream waits on the copy, so the slots
        may be overwritten right away; else the caller orders that on ``handle.event``.
        ``write_through``: pages already in the host tier are written back again too (from the
        host tier; the write-back skips those the store holds), for a caller that knows or
        suspects the store lacks them (a restarted node).

        Every slot must hold a token of its page: a negative slot (which a load skips) would
        publish a page with rows never written; ``InvalidSlotError`` for CPU slots, a
        caller's rule for CUDA ones (checking them would wait for the GPU).
        """
        keys = self._keys(token_ids, keys)
        if device_slots is None:
            raise ValueError("save needs device_slots")
        table = self._slot_table(device_slots, len(keys), skips=False)
        self.stats_counters["saves"] += 1
        new = [i for i, k in enumerate(keys) if k not in self.cache]
        if write_through and self.writes_to_store and len(new) < len(keys):
            fresh = set(new)
            self._write_again([k for i, k in enumerate(keys) if i not in fresh])
        if not new:
            return SaveHandle(0)
        try:
            pages = self.cache.allocate(len(new))
        except PoolExhausted:
            self.stats_counters["save_pool_full"] += 1
            if self.writes_to_store:
                notify(self.on_unsaved, [keys[i] for i in new])
            return SaveHandle(0)
        event = self._copy_out(table, new, pages, engine_waits)
        published, duplicates = [], []
        for i, page in zip(new, pages):
            if self.cache.publish(keys[i], page, ready=event):
                published.append((keys[i], page))
            else:
                duplicates.append(page)
        self.cache.release(duplicates, after=event)
        self.stats_counters["pages_saved"] += len(published)
        if self.writes_to_store and published:
            self._loop.call_soon(self.writeback.submit, published, event)
        else:
            self.cache.release([p for _, p in published], after=event)
        return SaveHandle(len(published), event)

    def _write_again(self, keys: list[bytes]) -> None:
        """Queue the write-back of host-tier pages (held until written, after the copies that
        filled them)."""
        pages = self.cache.acquire_each(keys)
        notify(self.on_unsaved, [k for k, p in zip(keys, pages) if p is None])
        held = [(k, p) for k, p in zip(keys, pages) if p is not None]
        if not held:
            return
        events = self.cache.ready_events([p for _, p in held])
        self.stats_counters["pages_written_again"] += len(held)
        self._loop.call_soon(self.writeback.submit, held, AllOf(events) if events else None)

    def _copy_out(
        self, table: torch.Tensor, rows: list[int], pages: list[int], engine_waits: bool
    ) -> torch.cuda.Event | None:
        """Device slots ``table[rows]`` -> host ``pages``; the copy's event (None on CPU)."""
        if self._save_stream is None:
            self._count(save(self.kv, table[rows], self.pool.buffer, pages))
            return None
        engine = torch.cuda.current_stream(self.kv.device)
        stream = self._save_stream
        stream.wait_stream(engine)  # the step that wrote the slots comes first
        upload, dev = self._staging.upload, self.kv.device
        with torch.cuda.stream(stream):  # index tensors allocated (and freed) on this stream
            rows_t = host_ids(rows)
            slots = table[upload(rows_t, dev)] if table.is_cuda else table[rows]
            # deferred to the issuer unless the engine's stream waits on the copy now (its host
            # would wait for the issuer then)
            out = launch(False, self.kv, self.pool.buffer, pages, slots, self._staging,
                         None if engine_waits else self._issuer)  # fmt: skip
            self._count(out.backend)
            event = out.events[0]
        if engine_waits:
            engine.wait_event(event)
        return event

    async def flush(self) -> None:
        """Wait until every queued write-back has been written (or dropped). Raises
        ``WriteBackFailed`` if the write-back worker stopped on an error."""
        await self._loop.wrap(self.writeback.drain())

    def flush_sync(self, timeout: float | None = None) -> None:
        """:meth:`flush` from a synchronous caller; ``TimeoutError`` after ``timeout``."""
        self._loop.call(self.writeback.drain(), timeout)

    # ---- stats and lifetime ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stats_counters)
        out["store_errors"] += self.index.counters["store_errors"]
        out["lookup_timeouts"] = self.index.counters["lookup_timeouts"]
        out["lookups_skipped"] = self.index.counters["lookups_skipped"]
        out.update(self.writeback.stats())
        out.update(self.cache.describe(), host_pages=self.pool.num_pages)
        out["store"] = dict(self.store.counters)
        out["transfer_backends"] = dict(self.transfer_backends)
        if self._issuer is not None:
            out["copy_issuer"] = dict(self._issuer.counters)
        if self.policy is not None:
            out["policy"] = self.policy.stats()
        return out

    def log_stats_every(self, seconds: float) -> None:
        """Log :meth:`stats` at INFO every ``seconds`` until :meth:`close`."""

        async def report() -> None:
            while True:
                await asyncio.sleep(seconds)
                log.info("pagekv connector: %s", self.stats())

        self._loop.call_soon(lambda: self._loop.loop.create_task(report()))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float | None = None) -> None:
        """Drain the write-back (at most ``timeout_s``, default ``close_timeout_s``; what is
        left is dropped and logged), stop the loop, wait for the streams, unregister the pinned
        pool. Idempotent; never raises on store trouble."""
        if self._closed:
            return
        self._closed = True
        timeout_s = self.close_timeout_s if timeout_s is None else timeout_s
        drain_writeback(self._loop, self.writeback, timeout_s)
        try:
            self._loop.call(self.fetcher.cancel(), 5.0)
        except TimeoutError:
            log.warning("pagekv: close: fetches did not stop within 5 s")
        self.index.close()
        self._loop.close()
        if self._issuer is not None:
            self._issuer.close()  # what it was given is enqueued and done
        for stream in (self._save_stream, self._load_stream):
            if stream is not None:
                stream.synchronize()  # no copy may touch the pool once it is unregistered
        self.pool.close()
