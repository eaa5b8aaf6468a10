"""``PagekvStorage``: an SGLang HiCache L3 storage backend on pagekv's store (SGLang 0.5.23).

SGLang owns the GPU and the host tier (its host pool, layouts and kernels); this backend moves
host pool pages to and from pagekv store nodes. Load it with SGLang's ``dynamic`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "pagekv", "module_path": "pagekv.connector.sglang",
        "class_name": "PagekvStorage", "interface_v1": 1, "store": ["tcp://kv-store-0:7400"]}'

One page = one key = one store value of several frames (see :mod:`.pages`); keys are SGLang's
own chained page hashes namespaced by model, page format and rank (:meth:`_namespace_for`).

Failure rules (SGLang turns an exception into a miss of the whole batch): no backend call
raises; a page that cannot be read or written is ``False`` (``None`` for legacy reads, a shorter
leading count for ``batch_exists``). A read returns within about ``(replicas + 1) * timeout_s``,
a write within ``(replicas + 2) * timeout_s``, and every call at once while every node is known
to be down (a miss, counted as ``store_down``). Each call's pages are complete or untouched: a
page is filled only from a value whose checksum matched, and nothing writes into the pool after
the call returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from pagekv.connector.hashing import KeyNamespace
from pagekv.errors import ConfigError
from pagekv.store import Status, StoreClient

from .clients import BackendStats, ThreadClients
from .config import SGLangBackendConfig
from .pages import PageFormat, PoolPages

__all__ = ["PagekvStorage"]

log = logging.getLogger(__name__)
_STORED = (Status.OK, Status.EXISTS)


class PagekvStorage(HiCacheStorage):
    """Built by SGLang's ``StorageBackendFactory`` as ``PagekvStorage(storage_config, kwargs)``;
    the host pool arrives through :meth:`register_mem_pool_host`. Raises
    :class:`~pagekv.errors.ConfigError` from those two on a bad extra config or an unsupported
    pool (SGLang then refuses to start, naming it). Thread-safe."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.config = SGLangBackendConfig.from_extra_config(
            storage_config.extra_config, storage_config.model_name
        )
        self.mem_pool_host = None
        self._pages: PoolPages | None = None
        self._namespace: KeyNamespace | None = None
        self._epoch = 0
        self._clients = ThreadClients(self.config.client_config())
        self._stats = BackendStats()
        self._errors = _ErrorLog()
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            log.info('pagekv: "interface_v1": 1 is not set; SGLang will copy pages (legacy path)')

    # ---- set-up -------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's host pool: its page format names the keys."""
        pages = PoolPages(mem_pool_host)
        namespace = self._namespace_for(pages.format, self._epoch)
        super().register_mem_pool_host(mem_pool_host)
        self._pages, self._namespace = pages, namespace
        fmt, store = pages.format, ", ".join(self.config.store)
        log.info("pagekv: host pool %s, %d B pages, store %s", fmt.label, fmt.page_bytes, store)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Sidecar pools of hybrid models (Mamba, SWA, indexer: SGLang's v2 calls) are not
        stored by this backend; raises :class:`ConfigError` so SGLang says so at start-up."""
        raise ConfigError(
            f"pagekv: hybrid-model host pool {host_pool_name!s} (SGLang's v2 storage calls) "
            "is not supported; pagekv stores MHA and MLA KV pages only"
        )

    def _namespace_for(self, fmt: PageFormat, epoch: int) -> KeyNamespace:
        """Model, page format (layout, dtype, geometry, frame plan), TP rank and size (left
        out for MLA: every rank holds the same latent), PP rank, attention-CP rank, the
        configured namespace and the clear epoch."""
        sc = self.storage_config
        parts = [("ns", self.config.namespace)] if self.config.namespace else []
        if sc.attn_cp_size > 1:
            parts.append(("cp", f"{sc.attn_cp_rank}/{sc.attn_cp_size}"))
        if epoch:
            parts.append(("epoch", str(epoch)))
        return KeyNamespace(
            self.config.model_id, fmt.geometry(), sc.tp_rank, sc.tp_size,
            pp_rank=sc.pp_rank, pp_size=sc.pp_size, layout=fmt.label,
            extra="|".join(f"{name}:{len(value)}:{value}" for name, value in parts),
            rank_shared=bool(sc.is_mla_model),
        )  # fmt: skip

    # ---- zero-copy interface (interface_v1) -------------------------------------------------
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Number of leading pages stored: one batched EXISTS."""
        return self._guard("exists", len(keys), 0, self._exists, keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Fill the pages at ``host_indices`` from the store, in place; a bool per page."""
        return self._guard("get", len(keys), [False] * len(keys), self._get_v1, keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages at ``host_indices`` (sent from the pool, no copy); pages already
        stored are not sent again. A bool per page (stored or already present)."""
        return self._guard("set", len(keys), [False] * len(keys), self._set_v1, keys, host_indices)

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
        """Flat pages (``target_locations[i]`` filled if it is a flat page, else a new one),
        None per miss."""
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
        """Store flat pages (``get_data_page(i, flat=True)``); True if every page is stored."""
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
        if self._pages is not None:
            self._namespace = self._namespace_for(self._pages.format, self._epoch)
        log.info("pagekv: HiCache storage cleared (key epoch %d)", self._epoch)

    def store_keys(self, keys: Sequence[str]) -> list[bytes]:
        """The store keys of SGLang page hashes (16 bytes each) in the current namespace.
        Raises :class:`ConfigError` before a host pool is registered."""
        if self._namespace is None:
            raise ConfigError("no host pool registered")
        return self._namespace.derive_keys(keys)

    def stats(self) -> dict[str, Any]:
        """Counters per operation (calls, pages, hits, misses, bytes, skipped, errors,
        store_down, latency) and the store clients' own counters."""
        out = self._stats.snapshot()
        out["epoch"] = self._epoch
        out["format"] = self._pages.format.label if self._pages else None
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
        """Run ``fn(client, *args) -> (value, counts)``; any error, or a store known to be
        down, gives ``failed``. Never raises."""
        if n == 0:
            return failed
        start = time.perf_counter()
        self._stats.begin()
        counts: dict[str, int] = {"pages": n}
        try:
            if self._pages is None:
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

    def _exists(self, client: StoreClient, keys: list[str]) -> tuple[int, dict]:
        hits = client.exists_many(self.store_keys(keys)).leading
        return hits, {"hits": hits, "misses": len(keys) - hits}

    def _get_v1(self, client: StoreClient, keys: list[str], host_indices: torch.Tensor):
        frames = self._pages.frames(host_indices, len(keys))
        ok = client.get_many(self.store_keys(keys), into=frames)
        return ok, self._read_counts(ok)

    def _set_v1(self, client: StoreClient, keys: list[str], host_indices: torch.Tensor):
        return self._put(client, self.store_keys(keys), self._pages.frames(host_indices, len(keys)))

    def _get_flat(self, client: StoreClient, keys: list[str], targets: Any):
        targets = [None] * len(keys) if targets is None else list(targets)
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
        pages = [t if self._is_flat_page(t) else self.mem_pool_host.get_dummy_flat_data_page()
                 for t in targets]  # fmt: skip
        ok = client.get_many(
            self.store_keys(keys), into=[self._pages.flat_frames(p) for p in pages]
        )
        return [p if hit else None for p, hit in zip(pages, ok)], self._read_counts(ok)

    def _set_flat(self, client: StoreClient, keys: list[str], values: Sequence[torch.Tensor]):
        pages = [v.contiguous() for v in values]
        return self._put(client, self.store_keys(keys), [self._pages.flat_frames(p) for p in pages])

    def _put(self, client: StoreClient, keys: list[bytes], values: list[list[memoryview]]):
        n = len(keys)
        ok = client.exists_many(keys).found if self.config.skip_existing else [False] * n
        if self.config.skip_existing and self._clients.all_down(client):
            return [False] * n, {"store_down": n}
        todo = [i for i in range(n) if not ok[i]]
        if todo:
            statuses = client.put_many([keys[i] for i in todo], [values[i] for i in todo])
            for i, status in zip(todo, statuses):
                ok[i] = status in _STORED
        stored = sum(ok[i] for i in todo)
        counts = {"skipped": n - len(todo), "stored": stored, "failed": n - sum(ok)}
        counts["bytes"] = stored * self._pages.format.page_bytes
        return ok, counts

    def _read_counts(self, ok: list[bool]) -> dict[str, int]:
        hits = sum(map(bool, ok))
        page_bytes = self._pages.format.page_bytes
        return {"hits": hits, "misses": len(ok) - hits, "bytes": hits * page_bytes}

    def _is_flat_page(self, t: Any) -> bool:
        return (
            isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
            and t.nbytes == self._pages.format.page_bytes
        )  # fmt: skip


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
