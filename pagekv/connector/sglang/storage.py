"""``PagekvStorage``: an SGLang HiCache L3 storage backend on pagekv's store (SGLang 0.5.23).

SGLang owns the GPU and the host tier (its host pools, layouts and kernels); this backend moves
host pool pages to and from pagekv store nodes. Load it with SGLang's ``dynamic`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "pagekv", "module_path": "pagekv.connector.sglang",
        "class_name": "PagekvStorage", "interface_v1": 1, "store": ["tcp://kv-store-0:7400"]}'

Pools. SGLang registers the KV anchor pool (``register_mem_pool_host``), then every pool of the
model's stack by name (``register_mem_host_pool_v2``: the anchor again as ``kv``; hybrid models'
``swa``, ``mamba``, ``indexer``, ``draft``, ... pools). Plain models use the v1 calls
(``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``) on the KV pool; hybrid models add the v2
calls (``PoolTransfer`` per pool), with each pool's pages under its own keys. A logical KV anchor
(DeepSeek-V4: slots, no bytes) is not stored: the v1 calls on it answer every page done and its
side pools decide every hit. A pool that cannot be stored (:mod:`.pages`; or pages that differ per
TP rank in an MLA model, whose pools SGLang writes from rank 0 only) turns the storage tier off for
the model, said once at start-up: every call is then a miss, and SGLang serves from its device
and host tiers.

One page = one key = one store value of one or more frames (see :mod:`.pages`); keys are SGLang's
own chained page hashes namespaced by model, pool, page format and rank (:meth:`_namespace_for`).

Failure rules (SGLang turns an exception into a miss of the whole batch): no backend call
raises; a page that cannot be read or written is ``False`` (``None`` for legacy reads, a shorter
leading count for ``batch_exists``). A read returns within about ``(replicas + 1) * timeout_s``,
a write within ``(replicas + 2) * timeout_s``, and every call at once while every node is known
to be down (a miss, counted as ``store_down``). Each call's pages are complete or untouched: a
page is filled only from a value whose checksum matched, and nothing writes into a pool after
the call returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from pagekv.connector.hashing import KeyNamespace
from pagekv.errors import ConfigError
from pagekv.store import Status, StoreClient

from .clients import BackendStats, ThreadClients
from .config import SGLangBackendConfig
from .pages import KV_POOL, PageFormat, PoolPages

__all__ = ["PagekvStorage"]

log = logging.getLogger(__name__)
_STORED = (Status.OK, Status.EXISTS)
_MAMBA = "mamba"  # SGLang's PoolName.MAMBA: state sharded over TP ranks even in MLA models


def _is_logical(pool: Any) -> bool:
    """A logical KV anchor: SGLang's slots of a hybrid stack, no KV buffer and no bytes per
    token (a pool without its buffer but with bytes per token, e.g. an MLA pool in SGLang's
    allocator-only "dummy" mode, is not one: it stores nothing, and turns the tier off)."""
    return getattr(pool, "kv_buffer", True) is None and not getattr(pool, "size_per_token", 0)


@dataclass(frozen=True)
class _Pool:
    """A stored pool: its pages and the key namespace they live in."""

    pages: PoolPages
    namespace: KeyNamespace

    def keys(self, hashes: Sequence[str]) -> list[bytes]:
        return self.namespace.derive_keys(hashes)


class PagekvStorage(HiCacheStorage):
    """Built by SGLang's ``StorageBackendFactory`` as ``PagekvStorage(storage_config, kwargs)``;
    the host pools arrive through :meth:`register_mem_pool_host` and
    :meth:`register_mem_host_pool_v2`. Raises :class:`~pagekv.errors.ConfigError` from the
    constructor on a bad extra config (SGLang then refuses to start, naming it); never from a
    pool registration. Thread-safe."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.config = SGLangBackendConfig.from_extra_config(
            storage_config.extra_config, storage_config.model_name
        )
        self.mem_pool_host = None
        self._pools: dict[str, _Pool] = {}  # replaced whole, never changed in place
        self._off: str | None = None  # why the storage tier is off, once a pool is refused
        self._epoch = 0
        self._clients = ThreadClients(self.config.client_config())
        self._stats = BackendStats()
        self._errors = _ErrorLog()
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            log.info('pagekv: "interface_v1": 1 is not set; SGLang will copy pages (legacy path)')

    # ---- set-up -------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's KV anchor pool. A hybrid model's logical anchor (DeepSeek-V4: no
        buffer of its own) stores nothing itself: the v1 calls on it move no bytes and answer
        every page done, and its side pools, registered through
        :meth:`register_mem_host_pool_v2` and moved by the v2 calls, decide every hit."""
        super().register_mem_pool_host(mem_pool_host)
        if not self._logical_kv:
            self._adopt(KV_POOL, mem_pool_host)

    @property
    def _logical_kv(self) -> bool:
        """The registered KV anchor is logical (see :meth:`register_mem_pool_host`)."""
        return _is_logical(self.mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Adopt one pool of the model's stack (the KV anchor comes again as ``kv``)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == KV_POOL and _is_logical(host_pool):
            return
        known = self._pools.get(name)
        if known is None or known.pages.pool is not host_pool:
            self._adopt(name, host_pool)

    def on_host_pools_registered(self) -> None:
        """Say, in one line, what this backend stores (or why it stores nothing)."""
        if self._off is not None:
            return  # said when the pool was refused
        pools = ", ".join(f"{n} ({p.pages.format.label}, {p.pages.format.page_bytes} B pages)"
                          for n, p in self._pools.items())  # fmt: skip
        log.info("pagekv: storing %s in %s", pools or "no pool", ", ".join(self.config.store))

    def _adopt(self, name: str, pool: Any) -> None:
        try:
            pages = PoolPages(pool, name)
            self._check_writers(name, pages.format)
            stored = _Pool(pages, self._namespace_for(name, pages.format, self._epoch))
            for address, nbytes in pages.regions():  # zero-copy (Mooncake); once per pool
                self._clients.register(address, nbytes)
        except ConfigError as e:
            if self._off is None:
                self._off = str(e)
                log.warning("pagekv: %s -- SGLang runs without the storage tier for this model", e)
            return
        self._pools = {**self._pools, name: stored}

    def _rank0_writes(self, name: str) -> bool:
        """SGLang writes an MLA model's pools from TP rank 0 only, but Mamba state from every
        rank (its controller's ``should_backup``)."""
        return bool(self.storage_config.is_mla_model) and name != _MAMBA

    def _check_writers(self, name: str, fmt: PageFormat) -> None:
        """A pool that rank 0 alone writes but whose pages differ per rank (an MHA draft of an
        MLA model) would never be found by the other ranks, and SGLang takes the smallest hit
        of all ranks. Raises ConfigError for such a pool."""
        sc = self.storage_config
        if self._rank0_writes(name) and sc.tp_size > 1 and fmt.kind == "mha":
            raise ConfigError(
                f"pagekv: SGLang host pool {name} ({fmt.label}) holds pages that differ per "
                f"TP rank, but SGLang writes this MLA model's pools from rank 0 only: ranks "
                f"1..{sc.tp_size - 1} would never find theirs"
            )

    def _namespace_for(self, name: str, fmt: PageFormat, epoch: int) -> KeyNamespace:
        """Model, pool, page format (layout, dtype, geometry, frame plan), TP rank and size
        (left out for pages every rank holds alike: MLA models' pools but Mamba state and
        K/V pools), PP rank, attention-CP rank, the configured namespace and the clear
        epoch."""
        sc = self.storage_config
        parts = [("ns", self.config.namespace)] if self.config.namespace else []
        if name != KV_POOL:
            parts.append(("pool", name))
        if sc.attn_cp_size > 1:
            parts.append(("cp", f"{sc.attn_cp_rank}/{sc.attn_cp_size}"))
        if epoch:
            parts.append(("epoch", str(epoch)))
        shared = self._rank0_writes(name) and fmt.kind != "mha"
        return KeyNamespace(
            self.config.model_id, fmt.geometry, sc.tp_rank, sc.tp_size,
            pp_rank=sc.pp_rank, pp_size=sc.pp_size, layout=fmt.label,
            extra="|".join(f"{part}:{len(value)}:{value}" for part, value in parts),
            rank_shared=shared,
        )  # fmt: skip

    # ---- zero-copy interface (interface_v1): the KV pool ------------------------------------
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Number of leading KV pages stored: one batched EXISTS."""
        return self._guard("exists", len(keys), 0, self._exists, keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Fill the KV pages at ``host_indices`` from the store, in place; a bool per page."""
        if self._logical_kv:
            return [True] * len(keys)
        transfers = [PoolTransfer(KV_POOL, host_indices=host_indices, keys=keys)]
        return self._guard("get", len(keys), _failed(transfers), self._get, transfers)[KV_POOL]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the KV pages at ``host_indices`` (sent from the pool, no copy); pages already
        stored are not sent again. A bool per page (stored or already present)."""
        if self._logical_kv:
            return [True] * len(keys)
        transfers = [PoolTransfer(KV_POOL, host_indices=host_indices, keys=keys)]
        return self._guard("set", len(keys), _failed(transfers), self._set, transfers)[KV_POOL]

    # ---- multi-pool interface (hybrid models: v2) ---------------------------------------------
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of ``keys`` (SGLang's page hashes): the leading KV pages, cut
        where a pool of ``pool_transfers`` cannot serve it by its ``hit_policy``
        (``all_pages``: every page up to there; ``trailing_pages``: the last
        ``len(transfer.keys)`` pages before it; ``block_groups``: reported, never a cut).
        ``restorable_prefix_pages`` lists every usable prefix length (trailing windows leave
        holes). One batched EXISTS for all pools."""
        transfers = list(pool_transfers or [])
        empty = PoolTransferResult(0, {}, [])
        return self._guard("exists", len(keys), empty, self._exists_v2, keys, transfers)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Fill each transfer's pages (``host_indices``, one page per key) of its pool from
        the store: one batched GET for all pools; a bool per page per pool."""
        return self._guard("get", _pages(transfers), _failed(transfers), self._get, transfers)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages of its pool (pages already stored are not sent
        again); a bool per page per pool."""
        return self._guard("set", _pages(transfers), _failed(transfers), self._set, transfers)

    # ---- legacy interface (flat page copies; same keys and values as the zero-copy one) ----
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Flat KV pages (``target_locations[i]`` filled if it is a flat page, else a new
        one), None per miss."""
        return self._guard("get", len(keys), [None] * len(keys), self._get_flat, keys,
                           target_locations)  # fmt: skip

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat KV pages (``get_data_page(i, flat=True)``); True if every page is
        stored."""
        if values is None or len(values) != len(keys):
            self._errors.report("set", ValueError("batch_set needs one flat page per key"))
            return False
        return all(self._guard("set", len(keys), [False] * len(keys), self._set_flat, keys, values))

    # ---- management -------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every page stored so far, for this backend: keys move to a new epoch, so
        pages written before are never read again here (they stay in the store, shared with
        other servers, until evicted). Every rank gets the call, so ranks stay in step. To
        retire pages fleet-wide (new weights under the same model name) change ``namespace``."""
        self._epoch += 1
        self._pools = {
            name: _Pool(p.pages, self._namespace_for(name, p.pages.format, self._epoch))
            for name, p in self._pools.items()
        }
        log.info("pagekv: HiCache storage cleared (key epoch %d)", self._epoch)

    def store_keys(self, keys: Sequence[str], pool: str = KV_POOL) -> list[bytes]:
        """The store keys of SGLang page hashes (16 bytes each) of ``pool`` in the current
        namespace. Raises :class:`ConfigError` for a pool that is not stored."""
        return self._pool(pool).keys(keys)

    def stats(self) -> dict[str, Any]:
        """Counters per operation (calls, pages, hits, misses, bytes, skipped, errors,
        store_down, off, latency), the stored pools' formats, why the tier is off if it is, and
        the store clients' own counters."""
        out = self._stats.snapshot()
        out["epoch"] = self._epoch
        out["pools"] = {name: p.pages.format.label for name, p in self._pools.items()}
        out["format"] = out["pools"].get(KV_POOL)
        out["off"] = self._off
        return out

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (per-call pages and GB/s since the last call), with
        :meth:`stats` attached as ``.pagekv``."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        metrics = StorageMetrics()
        for name, values in self._stats.drain_samples().items():
            getattr(metrics, name).extend(values)
        metrics.pagekv = self.stats()
        return metrics

    def close(self) -> None:
        """Close the store clients (SGLang calls this on detach, with its threads stopped)."""
        self._clients.close()

    # ---- the calls --------------------------------------------------------------------------
    def _guard(self, op: str, n: int, failed: Any, fn: Callable, *args: Any) -> Any:
        """Run ``fn(client, *args) -> (value, counts)``; any error, the tier turned off, or a
        store known to be down, gives ``failed``. Never raises."""
        if n == 0:
            return failed
        start = time.perf_counter()
        self._stats.begin()
        counts: dict[str, int] = {"pages": n}
        try:
            if self._off is not None:
                counts["off"] = n
                return failed
            if not self._pools:
                raise ConfigError("no host pool registered")
            client = self._clients.get()
            if self._clients.all_down(client):
                counts["store_down"] = n
                return failed
            value, more = fn(client, *args)
            counts.update(more)
            return value
        except Exception as e:
            counts["errors"] = 1
            self._errors.report(op, e)
            return failed
        finally:
            self._stats.end(op, time.perf_counter() - start, **counts)

    def _pool(self, name: Any) -> _Pool:
        pool = self._pools.get(str(name))
        if pool is None:
            raise ConfigError(f"no host pool {name!s} registered")
        return pool

    def _exists(self, client: StoreClient, keys: list[str]) -> tuple[int, dict]:
        hits = client.exists_many(self._pool(KV_POOL).keys(keys)).leading
        return hits, {"hits": hits, "misses": len(keys) - hits}

    def _exists_v2(self, client: StoreClient, keys: list[str], transfers: list[PoolTransfer]):
        kv = self._pools.get(KV_POOL)
        asked = [(KV_POOL, kv)] if kv is not None else []
        asked += [(str(t.name), self._pools.get(str(t.name))) for t in transfers]
        store_keys = [k for _, pool in asked if pool is not None for k in pool.keys(keys)]
        found = iter(client.exists_many(store_keys).found if store_keys else [])
        present = {name: [next(found) for _ in keys] if pool is not None else [False] * len(keys)
                   for name, pool in asked}  # fmt: skip
        kv_pages = _leading(present[KV_POOL]) if kv is not None else len(keys)
        hit_pages = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in transfers:
            usable, boundary = _usable_prefixes(t, present[str(t.name)][:kv_pages])
            if boundary:
                hit_pages[str(t.name)] = boundary
            if usable is not None:
                restorable &= usable
        pages = max(restorable, default=0)
        result = PoolTransferResult(pages, hit_pages, sorted(restorable))
        return result, {"hits": pages, "misses": len(keys) - pages}

    def _get(self, client: StoreClient, transfers: list[PoolTransfer]):
        """One GET for every transfer's pages; each pool's pages filled in place (copied
        pools: finished into the pool)."""
        keys, frames, plan = [], [], []
        for t in transfers:
            pool, n = self._pool(t.name), len(t.keys or [])
            targets, finish = pool.pages.targets(t.host_indices, n)
            keys += pool.keys(t.keys or [])
            frames += targets
            plan.append((str(t.name), n, finish, pool.pages.format.page_bytes))
        ok = client.get_many(keys, into=frames)
        out, at, hits, size = {}, 0, 0, 0
        for name, n, finish, page_bytes in plan:
            out[name] = ok[at : at + n]
            finish(out[name])
            at += n
            hits += sum(out[name])
            size += sum(out[name]) * page_bytes
        return out, {"hits": hits, "misses": len(ok) - hits, "bytes": size}

    def _set(self, client: StoreClient, transfers: list[PoolTransfer]):
        keys, values, plan = [], [], []
        for t in transfers:
            pool, n = self._pool(t.name), len(t.keys or [])
            values += pool.pages.sources(t.host_indices, n)
            keys += pool.keys(t.keys or [])
            plan.append((str(t.name), n, pool.pages.format.page_bytes))
        sizes = [page_bytes for _, n, page_bytes in plan for _ in range(n)]
        ok, counts = self._put(client, keys, values, sizes)
        out, at = {}, 0
        for name, n, _ in plan:
            out[name] = ok[at : at + n]
            at += n
        return out, counts

    def _get_flat(self, client: StoreClient, keys: list[str], targets: Any):
        kv = self._pool(KV_POOL)
        targets = [None] * len(keys) if targets is None else list(targets)
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
        pages = [t if self._is_flat_page(t) else self.mem_pool_host.get_dummy_flat_data_page()
                 for t in targets]  # fmt: skip
        ok = client.get_many(kv.keys(keys), into=[kv.pages.flat_frames(p) for p in pages])
        page_bytes = kv.pages.format.page_bytes
        hits = sum(ok)
        counts = {"hits": hits, "misses": len(ok) - hits, "bytes": hits * page_bytes}
        return [p if hit else None for p, hit in zip(pages, ok)], counts

    def _set_flat(self, client: StoreClient, keys: list[str], values: Sequence[torch.Tensor]):
        kv = self._pool(KV_POOL)
        pages = [v.contiguous() for v in values]
        sizes = [kv.pages.format.page_bytes] * len(keys)
        return self._put(client, kv.keys(keys), [kv.pages.flat_frames(p) for p in pages], sizes)

    def _put(self, client: StoreClient, keys: list[bytes], values: list[list[memoryview]],
             sizes: list[int]):  # fmt: skip
        n = len(keys)
        ok = client.exists_many(keys).found if self.config.skip_existing else [False] * n
        if self.config.skip_existing and self._clients.all_down(client):
            return [False] * n, {"store_down": n}
        todo = [i for i in range(n) if not ok[i]]
        if todo:
            statuses = client.put_many([keys[i] for i in todo], [values[i] for i in todo])
            for i, status in zip(todo, statuses):
                ok[i] = status in _STORED
        stored = [i for i in todo if ok[i]]
        counts = {"skipped": n - len(todo), "stored": len(stored), "failed": n - sum(ok)}
        counts["bytes"] = sum(sizes[i] for i in stored)
        return ok, counts

    def _is_flat_page(self, t: Any) -> bool:
        return (
            isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
            and t.nbytes == self._pool(KV_POOL).pages.format.page_bytes
        )  # fmt: skip


def _pages(transfers: list[PoolTransfer]) -> int:
    return sum(len(t.keys or []) for t in transfers)


def _failed(transfers: list[PoolTransfer]) -> dict[str, list[bool]]:
    return {str(t.name): [False] * len(t.keys or []) for t in transfers}


def _leading(found: Sequence[bool]) -> int:
    return next((i for i, f in enumerate(found) if not f), len(found))


def _usable_prefixes(transfer: PoolTransfer, present: list[bool]) -> tuple[set[int] | None, int]:
    """(prefix lengths, in pages, that ``transfer``'s pool can serve, or None for "no cut";
    the pool's own boundary) given which of the KV hit's pages the pool holds."""
    policy = PoolHitPolicy(transfer.hit_policy)
    if policy == PoolHitPolicy.ALL_PAGES:
        boundary = _leading(present)
        return set(range(1, boundary + 1)), boundary
    if policy == PoolHitPolicy.TRAILING_PAGES:
        window = max(1, len(transfer.keys or ()))
        usable = {end for end in range(1, len(present) + 1)
                  if all(present[max(0, end - window) : end])}  # fmt: skip
        return usable, max(usable, default=0)
    group = max(1, transfer.group_pages)  # BLOCK_GROUPS: its own verdict, never a cut
    groups = _leading([all(present[i : i + group]) for i in range(0, len(present) - group + 1,
                                                                  group)])  # fmt: skip
    return None, groups * group


class _ErrorLog:
    """Logs a failing call's error at most every ``every_s`` seconds (with the count since)."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._count = 0

    def report(self, op: str, error: BaseException) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            count, self._count, self._last = self._count, 0, now
        log.warning("pagekv: %s failed (%d call(s) since the last report), pages count as "
                    "misses: %r", op, count, error, exc_info=error)  # fmt: skip
