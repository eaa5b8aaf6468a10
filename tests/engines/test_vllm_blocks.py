"""The whole-block adapter of the vLLM connector, without vLLM: per-layer cache views shaped and
strided exactly as vLLM 0.32 builds them (one shared buffer, ``[B*r, H, N, C]`` per layer, in
the LBHNC, BLHNC and kernel-block-split forms), and the connector settings."""

from __future__ import annotations

import pytest
import torch

from pagekv.connector.vllm.blocks import (
    attention_layer_names,
    block_geometry,
    block_views,
    carrier_dtype,
)
from pagekv.connector.vllm.config import VllmConnectorConfig
from pagekv.errors import ConfigError
from pagekv.kernels import DeviceKV

from .vllm_layouts import fake_kv_cache_config, vllm_layer_views


# vLLM splits manager blocks into kernel blocks only for layer-outermost layouts
@pytest.mark.parametrize(
    "layout, ratio",
    [("LBHNC", 1), ("LBNHC", 1), ("BLHNC", 1), ("BLNHC", 1), ("LBHNC", 2), ("LBNHC", 4)],
)
def test_views_alias_each_layers_blocks(layout, ratio):
    """A view's row b is exactly the memory of vLLM block b of that layer, written through."""
    L, B, H, N, D = 3, 6, 2, 16, 8
    raw, views = vllm_layer_views(layout, L, B, H, N, 2 * D, torch.float32, ratio=ratio)
    geo = block_geometry(L, H * N * 2 * D * 4, torch.float32)
    rows = block_views(views, B, geo)
    kv = DeviceKV.from_caches(geo, rows)  # same slot stride for every layer
    assert kv.num_slots == B
    for layer, (view, row) in enumerate(zip(views, rows)):
        grouped = view.unflatten(0, (B, -1))  # vLLM's group_kernel_blocks
        for b in range(B):
            expect = torch.full_like(row[b], float(layer * 100 + b))
            row[b].copy_(expect)
            assert torch.equal(grouped[b].reshape(-1), expect)  # all of block b, nothing else
    for layer, view in enumerate(views):  # no row overlapped another block or layer
        grouped = view.unflatten(0, (B, -1))
        assert all(grouped[b].eq(layer * 100 + b).all() for b in range(B))
    assert raw.data_ptr() <= rows[0].data_ptr() < raw.data_ptr() + raw.numel()


def test_views_refuse_a_block_that_is_not_contiguous():
    # BHLNC: a block of one layer is H separate pieces
    _, views = vllm_layer_views("BHLNC", 2, 4, 2, 16, 16, torch.float32)
    geo = block_geometry(2, 2 * 16 * 16 * 4, torch.float32)
    with pytest.raises(ConfigError, match="contiguous"):
        block_views(views, 4, geo)


def test_views_refuse_the_wrong_block_size_or_block_count():
    _, views = vllm_layer_views("LBHNC", 2, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ConfigError, match="elements"):
        block_views(views, 4, block_geometry(2, 2 * 16 * 16 * 4 * 2, torch.float32))
    with pytest.raises(ConfigError, match="num_blocks"):
        block_views(views, 3, block_geometry(2, 2 * 16 * 16 * 4, torch.float32))


def test_fp8_and_byte_caches_move_as_a_same_size_carrier():
    assert carrier_dtype(torch.bfloat16) == torch.bfloat16
    assert carrier_dtype(torch.uint8) == torch.float8_e4m3fn
    assert carrier_dtype(torch.int16) == torch.float16
    _, views = vllm_layer_views("LBHNC", 2, 4, 2, 16, 16, torch.uint8)
    geo = block_geometry(2, 2 * 16 * 16, torch.uint8)
    rows = block_views(views, 4, geo)
    before = [v.clone() for v in views]
    rows[1][2].view(torch.uint8).fill_(0xAB)
    assert views[1][2].eq(0xAB).all()
    assert torch.equal(views[1][[0, 1, 3]], before[1][[0, 1, 3]])
    assert torch.equal(views[0], before[0])


def test_layer_names_follow_the_allocation_order_and_refuse_hybrid_models():
    cfg = fake_kv_cache_config([["model.layers.1.attn", "model.layers.0.attn"]])
    assert attention_layer_names(cfg) == ["model.layers.1.attn", "model.layers.0.attn"]
    with pytest.raises(ConfigError, match="one KV cache group"):
        attention_layer_names(fake_kv_cache_config([["a"]], groups=2))


def test_config_from_extra_validates_every_key():
    cfg = VllmConnectorConfig.from_extra({"store": ["tcp://127.0.0.1:7400"], "host_bytes": "1GiB"})
    assert cfg.host_bytes == 1 << 30 and cfg.load_timeout_s == 2.0 and cfg.load_async
    assert cfg.client_config().endpoints == ("tcp://127.0.0.1:7400",)
    with pytest.raises(ConfigError, match="store"):
        VllmConnectorConfig.from_extra({})
    with pytest.raises(ConfigError, match="unknown keys"):
        VllmConnectorConfig.from_extra({"store": ["tcp://h:1"], "host_byte": "1GiB"})
    with pytest.raises(ConfigError):
        VllmConnectorConfig.from_extra({"store": ["http://h:1"]})
    with pytest.raises(ConfigError, match="load_timeout_s"):
        VllmConnectorConfig.from_extra({"store": ["tcp://h:1"], "load_timeout_s": 0})
    with pytest.raises(ConfigError, match="kv_layout"):
        VllmConnectorConfig.from_extra({"store": ["tcp://h:1"], "kv_layout": "XYZ"})
