"""From vLLM's configs to the facts that name and shape pages (:class:`EngineLayout`), computed the
same way in the scheduler process and in every worker process. vLLM is imported lazily."""

from __future__ import annotations

import logging
import os
from typing import Any

from pagekv.errors import ConfigError

from .blocks import attention_layer_names, block_geometry
from .config import VllmConnectorConfig
from .namespace import EngineLayout, layout_id

__all__ = ["engine_layout", "required_layout"]

log = logging.getLogger("vllm.pagekv")  # under vLLM's logger: its handlers and format


def _cpu_isa(vllm_config: Any, spec: Any) -> str:
    """The packing of a block on vLLM CPU (its attention backend's choice of ISA kernel)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as e:  # a vLLM whose CPU backend moved: refuse rather than guess
        raise ConfigError(f"cannot tell vLLM CPU's block packing: {e}") from None
    model = vllm_config.model_config
    return _get_attn_isa(model.dtype, spec.block_size, spec.head_size,
                         vllm_config.cache_config.cache_dtype)  # fmt: skip


def _stage_layers(vllm_config: Any, num_layers: int) -> list[int]:
    """Layers of each PP stage: this config's own count without PP, else vLLM's split."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return [num_layers]
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return [end - start for start, end in (get_pp_indices(total, r, pp) for r in range(pp))]


def engine_layout(
    vllm_config: Any, kv_cache_config: Any, *, model_id: str, attn_backend: str
) -> EngineLayout:
    """The page layout of this engine. ``model_id`` and ``attn_backend``: the identity the
    workers report (:func:`.identity.model_identity`, :func:`.identity.attention_backends`),
    so that the scheduler and every worker name pages alike. Raises ``ConfigError`` for setups
    the connector does not support (several KV cache groups, a group that is not full
    attention, decode/prefill context parallelism, a block size that is not a multiple of the
    hash block size)."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    par, cache = vllm_config.parallel_config, vllm_config.cache_config
    model = vllm_config.model_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(par, name, 1) != 1:
            raise ConfigError(f"pagekv's vLLM connector does not support {name} > 1")
    names = attention_layer_names(kv_cache_config)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec):  # e.g. a model whose every layer is local
        raise ConfigError(
            f"pagekv's vLLM connector needs a full-attention KV cache group, this model's is "
            f"{type(spec).__name__}"
        )
    block_size = spec.block_size
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
    if block_size % hash_block:
        raise ConfigError(f"block size {block_size} is not a multiple of {hash_block}")
    device = current_platform.device_type
    isa = _cpu_isa(vllm_config, spec) if device == "cpu" else "-"
    block_bytes = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
    layout = layout_id(
        kv_layout=kv_cache_config.kv_cache_layout or cache.kv_cache_layout or "default",
        device=device, isa=isa, cache_dtype=cache.cache_dtype, block_size=block_size,
        hash_algo=cache.prefix_caching_hash_algo, attn_backend=attn_backend,
    )  # fmt: skip
    if cache.prefix_caching_hash_algo != "sha256" and os.getenv("PYTHONHASHSEED") is None:
        log.warning("pagekv: vLLM's %s block hashes are random per process unless "
                    "PYTHONHASHSEED is set: no engine will hit another's pages",
                    cache.prefix_caching_hash_algo)  # fmt: skip
    return EngineLayout(
        model_id=model_id, layout=layout,
        geometry_of=tuple(block_geometry(n, block_bytes, spec.dtype)
                          for n in _stage_layers(vllm_config, len(names))),
        block_size=block_size, hash_ratio=block_size // hash_block,
        tp_size=par.tensor_parallel_size, rank_shared=bool(model.use_mla),
    )  # fmt: skip


def required_layout(vllm_config: Any, cfg: VllmConnectorConfig) -> str | None:
    """The KV layout to ask vLLM for: CPU: LBHNC (its only one); GPU: BLHNC (a page's layers
    side by side in one block) unless MLA or ``kv_layout`` says otherwise."""
    if cfg.kv_layout == "none":
        return None
    if cfg.kv_layout != "auto":
        return cfg.kv_layout
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        return "LBHNC"
    if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
        return None
    return "BLHNC"
