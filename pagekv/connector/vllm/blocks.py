"""A vLLM block as a pagekv page: one page = one block of every layer, copied as opaque bytes.

vLLM 0.32 hands each attention layer's cache as a 4-D view ``[num_blocks * r, H, N, C]`` (``r``
kernel blocks per manager block) into one shared buffer. Inside a block the bytes are the
attention backend's business: on CPU they are packed per ISA (K transposed ``[D, N]`` then V
``[N, D]`` per head with AVX2), so the only correct copy is the whole block. pagekv therefore
describes the cache as an MLA-shaped geometry with ``page_size=1``: one *item* is one block of
one layer, ``latent_dim`` = the block's element count, and the device "slot" of a page is the
vLLM block id. Loads and saves then move ``num_layers`` contiguous block ranges per page (torch
index ops on CPU, the CUDA kernels on GPU), whatever the layout (LBHNC, BLHNC, ...).

Requirement: each layer's manager block is one contiguous range of memory (vLLM guarantees it
when it splits blocks into kernel blocks; unsplit blocks are always contiguous).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagekv.errors import ConfigError
from pagekv.geometry import SUPPORTED_DTYPES, KVGeometry

__all__ = ["attention_layer_names", "block_geometry", "block_views", "carrier_dtype"]

_CARRIERS = {1: "float8_e4m3fn", 2: "float16", 4: "float32"}


def carrier_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype pagekv moves the blocks as: ``dtype`` itself when pagekv supports it, else a
    supported dtype of the same element size (bytes are copied, never converted)."""
    if dtype in SUPPORTED_DTYPES.values():
        return dtype
    size = dtype.itemsize
    name = _CARRIERS.get(size)
    if name is None or name not in SUPPORTED_DTYPES:
        raise ConfigError(f"KV cache dtype {dtype} ({size} bytes) has no pagekv carrier dtype")
    return SUPPORTED_DTYPES[name]


def block_geometry(num_layers: int, block_bytes: int, dtype: torch.dtype) -> KVGeometry:
    """The page geometry of ``num_layers`` layers whose blocks hold ``block_bytes`` bytes of
    ``dtype`` each. Raises ``ConfigError`` when the bytes do not split into whole elements."""
    carrier = carrier_dtype(dtype)
    size = carrier.itemsize
    if block_bytes <= 0 or block_bytes % size or block_bytes % 4:
        raise ConfigError(f"a KV block of {block_bytes} bytes is not a whole number of words")
    return KVGeometry.mla(num_layers, page_size=1, latent_dim=block_bytes // size, dtype=carrier)


def attention_layer_names(kv_cache_config: Any) -> list[str]:
    """Names of the layers that own KV storage, in vLLM's allocation order (the order of the
    items in a page: every process of every rank derives the same order from the config).

    Raises ``ConfigError`` for configurations the whole-block adapter does not cover: several
    KV cache groups (hybrid models) or host-resident groups.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"pagekv's vLLM connector supports one KV cache group, this model has {len(groups)}"
        )
    names: list[str] = []
    for tensor in kv_cache_config.kv_cache_tensors:
        if getattr(tensor, "host_resident", False):
            raise ConfigError("host-resident KV cache tensors are not supported")
        names += [n for n in tensor.layers if n not in names]
    if not names:
        raise ConfigError("the KV cache config names no layers")
    return names


def block_views(
    caches: Sequence[torch.Tensor], num_blocks: int, geometry: KVGeometry
) -> list[torch.Tensor]:
    """Per layer, a ``[num_blocks, geometry.head_dim]`` view of vLLM's cache tensor (aliasing
    it: loads write the engine's cache); row ``b`` is block ``b``'s memory, in memory order.
    Raises ``ConfigError`` when a layer's blocks are not contiguous ranges of the expected
    size."""
    carrier = geometry.dtype
    views = []
    for i, t in enumerate(caches):
        if t.dim() < 2 or t.shape[0] % num_blocks:
            raise ConfigError(
                f"layer {i}: cache of shape {tuple(t.shape)} is not [num_blocks * r, ...] "
                f"with num_blocks={num_blocks}"
            )
        if t.element_size() != carrier.itemsize:
            raise ConfigError(f"layer {i}: dtype {t.dtype} does not match the page dtype")
        grouped = t.view(carrier).unflatten(0, (num_blocks, -1))  # manager blocks first
        # inside a block, memory order (LBNHC keeps N outside H): the row is the block's bytes
        inner = sorted(range(1, grouped.dim()), key=lambda d: -grouped.stride(d))
        try:
            view = grouped.permute(0, *inner).view(num_blocks, -1)
        except RuntimeError:
            raise ConfigError(
                f"layer {i}: a block of the cache (shape {tuple(t.shape)}, stride "
                f"{t.stride()}) is not one contiguous range"
            ) from None
        if view.shape[1] != geometry.head_dim:
            raise ConfigError(
                f"layer {i}: a block holds {view.shape[1]} elements, the page geometry "
                f"expects {geometry.head_dim}"
            )
        views.append(view)
    return views
