"""Connector on the CUDA kernels: a store node on this machine's loopback, a round trip into a
GPU cache, and the layer-wise load overlapped with a matmul per layer."""

import asyncio

import pytest
import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store.launch import NodeProcess
from tests.helpers import bits_equal, kv_caches

pytestmark = pytest.mark.cuda
GEO = KVGeometry(8, 16, 8, 128, "bf16")
SLOTS = 8192


@pytest.fixture(scope="module")
def node():
    n = NodeProcess("--capacity", "4GiB").start()
    yield n
    n.stop()


def caches(poisoned=False):
    return kv_caches(GEO, SLOTS, "cuda", poisoned=poisoned)


def test_round_trip_on_cuda_kernels(node):
    src, dst = caches(), caches(poisoned=True)
    ns = KeyNamespace("gpu-model", GEO)
    a = KVConnector(GEO, src, node.address, host_pages=512, namespace=ns)
    # the round trip is under test, not the lookup's 50 ms bound: beside other test workers
    # the first lookup's connection set-up once took longer and answered 0
    b = KVConnector(GEO, dst, node.address, host_pages=512, namespace=ns, lookup_timeout_s=5)
    try:
        assert a.pool.is_pinned and b.pool.is_pinned
        tokens = torch.randint(0, 32000, (4096 + 5,)).tolist()
        slots_a = torch.randperm(SLOTS, device="cuda")[: len(tokens)]
        assert a.save(tokens, slots_a).pages == 256
        a.flush_sync(timeout=60)
        assert b.lookup(tokens) == 4096
        handle = asyncio.run(b.prefetch(tokens))
        slots_b = torch.randperm(SLOTS, device="cuda")[:4096]
        b.load(handle, slots_b)
        torch.cuda.synchronize()
        for s, d in zip(src, dst):
            assert bits_equal(d[:, slots_b], s[:, slots_a[:4096]])
        b.release(handle)
    finally:
        a.close()
        b.close()


def test_layerwise_load_overlaps_compute(node):
    shape = (GEO.num_layers, SLOTS, *GEO.device_layer_shape)
    src = [torch.randn(shape, device="cuda").to(GEO.dtype) for _ in range(2)]  # finite values
    dst = caches(poisoned=True)
    ns = KeyNamespace("gpu-model-2", GEO)
    a = KVConnector(GEO, src, node.address, host_pages=512, namespace=ns)
    b = KVConnector(GEO, dst, node.address, host_pages=512, namespace=ns)
    try:
        tokens = torch.randint(0, 32000, (4096,)).tolist()
        slots = torch.randperm(SLOTS, device="cuda")[:4096]
        a.save(tokens, slots)
        a.flush_sync(timeout=60)
        handle = asyncio.run(b.prefetch(tokens))
        w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        layers = b.load_async(handle, slots)
        outs = []
        for i in range(GEO.num_layers):
            layers.wait_layer(i)  # compute on layer i while later layers are still copying
            k_i = dst[0][i, slots].reshape(-1, 1024)
            outs.append((k_i @ w).float().sum())
        torch.cuda.synchronize()
        want = [
            (src[0][i, slots].reshape(-1, 1024) @ w).float().sum() for i in range(GEO.num_layers)
        ]
        assert all(torch.equal(x, y) for x, y in zip(outs, want))
        b.release(handle)
    finally:
        a.close()
        b.close()
