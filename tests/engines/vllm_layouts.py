"""vLLM 0.32's KV cache views rebuilt without vLLM (for the CPU unit tests and the GPU layout
tests, whose machine has no vLLM).

vLLM allocates one buffer per group of same-shaped layers and gives each layer the logical view
``[B * r, H, n, C]`` (``r`` kernel blocks of ``n`` tokens per manager block of ``N = r * n``
tokens; C = K|V fused per token and head). The layout name orders the logical axes
``L, B, H, N, C`` from outermost to innermost in memory: LBHNC (vLLM CPU), LBNHC (the GPU
default), BLHNC / BLNHC (a block of all layers contiguous), BHLNC (a layer's block is not).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def vllm_layer_views(
    layout: str,
    num_layers: int,
    num_blocks: int,
    heads: int,
    block_size: int,
    cell: int,
    dtype: torch.dtype,
    *,
    ratio: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(raw buffer, per-layer views ``[num_blocks * ratio, heads, block_size // ratio, cell]``)
    laid out as ``layout`` says, filled with random bytes (finite values for float dtypes)."""
    if sorted(layout) != sorted("LBHNC"):
        raise ValueError(f"not a layout: {layout}")
    n = block_size // ratio
    sizes = dict(L=num_layers, B=num_blocks * ratio, H=heads, N=n, C=cell)
    strides, step = {}, 1
    for axis in reversed(layout):
        strides[axis] = step
        step *= sizes[axis]
    g = torch.Generator().manual_seed(seed)
    total = math.prod(sizes.values())
    if dtype.is_floating_point and dtype.itemsize >= 2:
        raw = torch.randn(total, generator=g).to(dtype)
    else:
        raw = torch.randint(0, 256, (total * dtype.itemsize,),
                            generator=g, dtype=torch.uint8).view(dtype)  # fmt: skip
    raw = raw.to(device)
    shape = tuple(sizes[a] for a in "BHNC")
    stride = tuple(strides[a] for a in "BHNC")
    views = [raw.as_strided(shape, stride, layer * strides["L"]) for layer in range(num_layers)]
    return raw, views


def fake_kv_cache_config(layer_lists: list[list[str]], *, groups: int = 1, num_blocks: int = 8):
    """The parts of vLLM's ``KVCacheConfig`` the adapter reads."""
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(layer_names=[n for ls in layer_lists for n in ls])]
        * groups,
        kv_cache_tensors=[SimpleNamespace(layers=list(ls), host_resident=False)
                          for ls in layer_lists],
    )  # fmt: skip


def worker_over(views, num_blocks: int, geometry, endpoint: str, *, model: str = "test-model",
                load_timeout_s: float = 2.0, host_pages: int = 64,
                store_timeout_s: float = 1.0):  # fmt: skip
    """A vLLM-connector worker half (TP rank 0 of 1) over vLLM-shaped cache views; its store
    client gives a node ``store_timeout_s`` to answer."""
    from pagekv.connector import KVConnector
    from pagekv.connector.vllm.blocks import block_views
    from pagekv.connector.vllm.namespace import EngineLayout
    from pagekv.connector.vllm.worker import WorkerSide
    from pagekv.kernels import DeviceKV
    from pagekv.store import ClientConfig

    block = views[0].shape[2] * (views[0].shape[0] // num_blocks)
    layout = EngineLayout(model, "vllm-v1|test", (geometry,), block, 1, 1, False)
    kv = DeviceKV.from_caches(geometry, block_views(views, num_blocks, geometry))
    conn = KVConnector(geometry, kv, ClientConfig((endpoint,), timeout_s=store_timeout_s),
                       host_pages=host_pages, namespace=layout.namespace(0, 0))  # fmt: skip
    names = {f"model.layers.{i}.self_attn.attn": i for i in range(geometry.num_layers)}
    return WorkerSide(conn, lambda epoch: layout.namespace(0, 0, epoch), names,
                      load_timeout_s=load_timeout_s, save=True)  # fmt: skip
