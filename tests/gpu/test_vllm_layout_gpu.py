"""The vLLM connector's worker half on vLLM 0.32's GPU cache views, rebuilt without vLLM (the GPU
machine has none): one buffer per layer group, per layer ``[B * r, H, n, C]`` views laid out
LBNHC (vLLM's GPU default), BLHNC / BLNHC (what the connector asks for: a block's layers side by
side), a kernel-block split, an fp8 (byte) cache and an MLA-shaped cache. Each case saves blocks
of one "engine" through a real store node, overwrites them on the engine's stream right after
the save (the save must already own its copy), and loads them into other blocks of a second,
poisoned engine: synchronous layer-wise (``wait_for_layer_load`` per layer) and asynchronous.
The CPU variants run in the main suite; the CUDA ones on the GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import time

import pytest
import torch

from pagekv.connector.vllm.blocks import block_geometry
from pagekv.connector.vllm.metadata import BlockTransfer, PagekvMetadata
from pagekv.store.launch import NodeProcess
from tests.engines.vllm_layouts import vllm_layer_views, worker_over

LAYERS, NUM_BLOCKS = 4, 64
SRC_BLOCKS, DST_BLOCKS = (3, 17, 40, 5), (10, 11, 50, 63)
CASES = {  # name: (layout, kernel blocks per block, dtype, heads, block_size, cell)
    "flash-default-LBNHC": ("LBNHC", 1, torch.bfloat16, 8, 16, 256),
    "requested-BLHNC": ("BLHNC", 1, torch.bfloat16, 8, 16, 256),
    "BLNHC-fp16": ("BLNHC", 1, torch.float16, 4, 16, 128),
    "kernel-split-LBNHC": ("LBNHC", 2, torch.bfloat16, 8, 32, 256),
    "fp8-bytes-LBHNC": ("LBHNC", 1, torch.uint8, 8, 16, 256),
    "mla-BLHNC": ("BLHNC", 1, torch.bfloat16, 1, 64, 576),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module")
def node():
    n = NodeProcess("--capacity", "1GiB").start(warm=True)
    yield n
    n.stop()


def engine(case: str, device: str, node, seed: int, poison: bool = False):
    layout, ratio, dtype, heads, block, cell = CASES[case]
    raw, views = vllm_layer_views(layout, LAYERS, NUM_BLOCKS, heads, block, cell, dtype,
                                  ratio=ratio, device=device, seed=seed)  # fmt: skip
    if poison:
        raw.view(torch.uint8).fill_(0x5A)
    block_bytes = heads * block * cell * dtype.itemsize
    geo = block_geometry(LAYERS, block_bytes, dtype)
    # these tests are about layouts: a node slow to answer on a loaded host (8 test workers
    # beside GPU tests) is not a failure of theirs, so the store gets seconds, not the 1 s
    worker = worker_over(views, NUM_BLOCKS, geo, node.address, model=f"gpu-{case}",
                         host_pages=32, store_timeout_s=10.0, load_timeout_s=20.0)  # fmt: skip
    return worker, views


def blocks_of(views, block_ids) -> list[torch.Tensor]:
    """Bytes of the given blocks of every layer (manager blocks, as vLLM groups them)."""
    out = []
    for v in views:
        grouped = v.unflatten(0, (NUM_BLOCKS, -1))
        out += [grouped[b].contiguous().view(torch.uint8).cpu() for b in block_ids]
    return out


def load(worker, spec: BlockTransfer) -> None:
    meta = PagekvMetadata(loads=[spec])
    worker.bind(meta)
    worker.start_load(meta)
    deadline = time.monotonic() + 20
    while worker.pending_async and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine runs other steps meanwhile
        worker.start_load(None)  # each step copies in the prefetches that finished
    for name in worker.layer_index:  # what vLLM's attention layers call, in order
        worker.wait_for_layer(name)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("load_async", [False, True], ids=["sync-layerwise", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_blocks_round_trip_through_the_store(case, device, load_async, node):
    src_worker, src = engine(case, device, node, seed=1)
    dst_worker, dst = engine(case, device, node, seed=2, poison=True)
    try:
        hashes = tuple(bytes([i]) * 32 for i in range(len(SRC_BLOCKS)))
        expect = blocks_of(src, SRC_BLOCKS)
        untouched = blocks_of(dst, (0, 1, 62))
        src_worker.save(PagekvMetadata(saves=[BlockTransfer("r", SRC_BLOCKS, hashes)]))
        for v in src:  # vLLM reuses the blocks at once, on its stream
            v.unflatten(0, (NUM_BLOCKS, -1))[list(SRC_BLOCKS)].view(torch.uint8).fill_(0xEE)
        src_worker.conn.flush_sync(timeout=30)
        assert src_worker.counters["save_blocks"] == len(SRC_BLOCKS)
        load(dst_worker, BlockTransfer("r", DST_BLOCKS, hashes, load_async=load_async))
        assert dst_worker.take_errors() == set()
        assert dst_worker.take_finished() == ({"r"} if load_async else set())
        got = blocks_of(dst, DST_BLOCKS)
        assert all(torch.equal(g, e) for g, e in zip(got, expect)), "loaded bytes differ"
        assert all(torch.equal(a, b) for a, b in zip(blocks_of(dst, (0, 1, 62)), untouched))
    finally:
        src_worker.close()
        dst_worker.close()
