"""SGLang's own classes around the pagekv backend, on CPU, for tests/engines/test_sglang.py.

* host pools: SGLang's ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (pin_memory=False),
  built from small stand-in device buffers (the host pool only reads their geometry);
* ``Controller``: SGLang's ``HiCacheController`` storage machinery, unmodified: its
  ``attach_storage_backend`` (the ``dynamic`` factory, ``register_mem_pool_host``, the
  interface_v1 switch, the four storage threads), ``prefetch`` (prefetch query thread:
  ``batch_exists``; prefetch I/O thread: ``batch_get_v1``) and ``write_storage`` (backup
  thread: ``batch_set_v1``). The object is made without ``__init__``, which wants a GPU
  device pool and process groups, and given the state the storage path reads. What this
  stands in for is the scheduler's part: allocating host pages for a prefetch hit.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any

from . import sglang_env

sglang_env.stub_torchvision()

import torch  # noqa: E402
import xxhash  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
WAIT_S = 30.0  # bound on any one wait for a controller thread


def extra_config(endpoints: list[str], **more: Any) -> dict:
    """The README's extra config (what ``--hicache-storage-backend-extra-config`` carries)."""
    return {
        "backend_name": "pagekv",
        "module_path": "pagekv.connector.sglang",
        "class_name": "PagekvStorage",
        "interface_v1": 1,
        "store": endpoints,
        **more,
    }


def storage_config(
    extra: dict,
    *,
    mla: bool = False,
    layout: str = "page_first",
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "test-model",
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=dict(extra),
    )  # fmt: skip


def make_backend(pool: Any, extra: dict, **config: Any) -> Any:
    """A backend the way SGLang's controller makes one: the ``dynamic`` factory, then the
    host pool (wrapped in SGLang's fault injector when its test variables are set)."""
    cfg = storage_config(extra, layout=pool.layout, **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    *,
    pages: int,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 8,
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool with ``pages`` pages (plus none spare)."""
    dev = [torch.empty(page_size, heads, head_dim, dtype=dtype) for _ in range(2 * layers)]
    k, v = tuple(dev[:layers]), tuple(dev[layers:])
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=page_size, start_layer=0, end_layer=layers,
        host_token_capacity=pages * page_size,
    )  # fmt: skip


def mla_pool(
    layout: str,
    *,
    pages: int,
    layers: int = 3,
    lora_rank: int = 32,
    rope_dim: int = 8,
    page_size: int = 8,
    dtype: torch.dtype = torch.bfloat16,
) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (latent width ``lora_rank + rope_dim``)."""
    width = lora_rank + rope_dim
    bufs = tuple(torch.empty(page_size, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=lora_rank,
        qk_rope_head_dim=rope_dim, kv_cache_dim=width, dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return MLATokenToKVPoolHost(
        info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=page_size, start_layer=0, end_layer=layers,
        target_layer_num=layers, host_token_capacity=pages * page_size,
    )  # fmt: skip


def page_bytes(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes read through SGLang's own ``get_data_page`` (the oracle)."""
    starts = host_indices[:: pool.page_size].tolist()
    return [pool.get_data_page(s, flat=True).view(torch.uint8).numpy().tobytes() for s in starts]


def flat_bytes(page: torch.Tensor) -> bytes:
    return page.contiguous().view(torch.uint8).numpy().tobytes()


def page_digests(pool: Any, host_indices: torch.Tensor) -> list[int]:
    """xxh3-64 of each page's bytes (SGLang's ``get_data_page``), for big pools."""
    starts = host_indices[:: pool.page_size].tolist()
    pages = (pool.get_data_page(s, flat=True).view(torch.uint8).numpy() for s in starts)
    return [xxhash.xxh3_64_intdigest(p) for p in pages]


def fill_random(pool: Any, host_indices: torch.Tensor, gen: torch.Generator) -> None:
    """Fresh random bytes in the given pages (through SGLang's ``set_from_flat_data_page``)."""
    flat = pool.get_dummy_flat_data_page()
    for start in host_indices[:: pool.page_size].tolist():
        data = torch.randint(0, 256, (flat.nbytes,), dtype=torch.uint8, generator=gen)
        pool.set_from_flat_data_page(start, data.view(flat.dtype))


def poison(pool: Any, host_indices: torch.Tensor, byte: int = 0x5A) -> None:
    flat = pool.get_dummy_flat_data_page()
    data = torch.full((flat.nbytes,), byte, dtype=torch.uint8).view(flat.dtype)
    for start in host_indices[:: pool.page_size].tolist():
        pool.set_from_flat_data_page(start, data)


def random_tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, 1 << 17, (n,), generator=gen).tolist()


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's own storage keys for ``tokens`` (chained SHA-256 hex per page)."""
    return get_storage_hash_str(tokens, None, page_size=page_size)


class Controller:
    """SGLang's HiCacheController storage threads around ``pool`` (see the module docstring)."""

    _ids = itertools.count()

    def __init__(
        self,
        pool: Any,
        extra: dict,
        *,
        mla: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        model: str = "test-model",
        prefetch_threshold: int = 1,
    ) -> None:
        ctl = HiCacheController.__new__(HiCacheController)
        ctl.tp_group = ctl.attn_cp_group = ctl.attn_tp_group = ctl.pp_group = None
        ctl.host_memory_mode = "cache"
        ctl.mem_pool_host = ctl.storage_host_pool = pool
        ctl.mem_pool_device = MLATokenToKVPool.__new__(MLATokenToKVPool) if mla else object()
        ctl.page_size = pool.page_size
        ctl.enable_storage, ctl.storage_backend, ctl.storage_backend_type = False, None, None
        ctl.enable_storage_metrics = True
        ctl.storage_stop_event = threading.Event()
        ctl.prefetch_hits_sync_groups, ctl.prefetch_completion_sync_groups = [], []
        ctl.page_get_func, ctl.page_set_func = ctl._generic_page_get, ctl._generic_page_set
        ctl.ack_prefetch_queue = queue.Queue()
        ctl.host_write_staged_tokens_fn = None
        ranks = dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1,
                     attn_dcp_rank=0)  # fmt: skip
        with get_parallel().override(**ranks):
            ctl.attach_storage_backend("dynamic", prefetch_threshold, model, dict(extra))
        self.ctl, self.pool = ctl, pool
        self._lock = threading.Lock()
        self._boxes: dict[str, dict] = {"backup": {}, "hit": {}, "ack": {}}

    @property
    def backend(self) -> Any:
        return self.ctl.storage_backend

    def backup(self, host_indices: torch.Tensor, tokens: list[int]) -> int:
        """Back pages up the way the radix cache does (``write_storage`` → backup thread →
        ``batch_set_v1``). Returns the tokens the controller reports as written."""
        hashes = page_hashes(tokens, self.pool.page_size)
        op_id = self.ctl.write_storage(host_indices, tokens, hash_value=hashes)
        (op,) = self._collect("backup", self.ctl.ack_backup_queue, lambda op: op.id, op_id)
        return op.completed_tokens

    def prefetch(self, tokens: list[int]) -> tuple[int, torch.Tensor | None]:
        """Prefetch the way the radix cache does: ``prefetch`` (query thread: ``batch_exists``
        per 128 pages), host pages for the hit (poisoned first), then the I/O thread
        (``batch_get_v1`` per 128 pages) and the ack thread. Returns (tokens the controller
        reports loaded, the host slots they were loaded into)."""
        rid = f"req-{next(self._ids)}"
        self.ctl.prefetch(rid, tokens)
        (op,) = self._collect("hit", self.ctl.prefetch_hit_queue, lambda op: op.request_id, rid)
        if op.storage_hit_count == 0:
            return 0, None
        with self._lock:
            host = self.pool.alloc(op.storage_hit_count)
        if host is None:
            raise RuntimeError("host pool full")
        poison(self.pool, host)
        op.host_indices = host
        self.ctl.prefetch_buffer.put(op)
        acks = self._collect("ack", self.ctl.ack_prefetch_queue, lambda a: a.rid, rid,
                             done=lambda acks: any(a.completed_req for a in acks))  # fmt: skip
        return max(a.completed_tokens or 0 for a in acks), host

    def _collect(self, box: str, source: queue.Queue, key_of, key, done=None) -> list:
        """The items of ``source`` whose key is ``key`` (once ``done(items)``), keeping other
        threads' items for them. Bounded by ``WAIT_S``."""
        items = self._boxes[box]
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if key in items and (done is None or done(items[key])):
                    return items.pop(key)
                try:
                    item = source.get(timeout=0.05)
                except queue.Empty:
                    continue
                items.setdefault(key_of(item), []).append(item)
        raise TimeoutError(f"controller {box} for {key} not seen in {WAIT_S} s")

    def close(self) -> None:
        self.ctl.detach_storage_backend()
