"""The connector's host <-> device copies on the copy engine: CPU slot tables reach the copy
engine as they are (no upload), for every geometry the kernel tests cover, bit for bit against
the bytes saved, destinations poisoned first; a copy-engine call that fails falls back to the
kernel with one log line, and the connector's copies stay exact."""

import asyncio
import logging

import pytest
import torch

from pagekv.connector import KeyNamespace, KVConnector
from pagekv.kernels import copy_engine, jit
from pagekv.store.launch import NodeProcess
from tests.gpu.test_kernels_gpu import ITEM_BYTES, device_caches, geometry, require_copy_engine
from tests.helpers import bits_equal, poison_

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def node():
    n = NodeProcess("--capacity", "1GiB").start()
    yield n
    n.stop()


def round_trip(node, geo, setting, monkeypatch, cuda_slots=False):
    """Save ``n`` pages from slots A, then load them back into slots B (``load``), C
    (``load_async``) and D (a streaming prefetch), each poisoned first; returns the connector's
    transfer counts. Every copy must reproduce slots A's bytes."""
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", setting)
    n_pages = max(2, 96 // geo.page_size)
    n_tok = n_pages * geo.page_size
    num_slots = 4 * n_tok + 5
    caches = device_caches(geo, num_slots)
    ns = KeyNamespace(f"ce-{setting}-{geo.page_size}-{geo.item_bytes}-{geo.is_mla}", geo)
    conn = KVConnector(geo, caches, node.address, host_pages=4 * n_pages, namespace=ns)
    try:
        perm = torch.randperm(num_slots)
        a, b, c, d = (perm[i * n_tok : (i + 1) * n_tok] for i in range(4))
        as_arg = (lambda s: s.cuda()) if cuda_slots else (lambda s: s.tolist())
        tokens = torch.randint(0, 32000, (n_tok,)).tolist()
        want = [t[:, a].clone() for t in caches]
        rest = torch.cat([b, c, d])
        for t in caches:
            t[:, rest] = poison_(torch.empty_like(t[:, rest]))
        assert conn.save(tokens, as_arg(a)).pages == n_pages

        handle = conn.prefetch_sync(tokens, timeout_s=30)
        assert handle.num_pages == n_pages
        conn.load(handle, as_arg(b))
        layers = conn.load_async(handle, as_arg(c))
        for layer in range(geo.num_layers):
            layers.wait_layer(layer)
        conn.release(handle)
        streamed = asyncio.run(conn.prefetch(tokens, device_slots=as_arg(d)))
        streamed.wait_loaded()
        torch.cuda.synchronize()
        for t, w in zip(caches, want):
            for name, s in (("load", b), ("load_async", c), ("streaming", d)):
                assert bits_equal(t[:, s], w), (name, setting)
        conn.release(streamed)
        counts = dict(conn.transfer_backends)
        counts["streaming"] = streamed.streaming.backend if streamed.streaming else "none"
        return counts
    finally:
        conn.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 2, 16, 64, 128])
@pytest.mark.parametrize("item_bytes", ITEM_BYTES)
def test_connector_copies_on_the_copy_engine_match(node, monkeypatch, mla, page_size, item_bytes):
    require_copy_engine()
    geo = geometry(torch.bfloat16, mla, item_bytes, page_size)
    counts = round_trip(node, geo, "copy_engine", monkeypatch)
    assert counts == {"copy_engine": 3, "streaming": "copy_engine"}, counts


@pytest.mark.parametrize("setting", ["auto", "kernel"])
@pytest.mark.parametrize("cuda_slots", [False, True], ids=["cpu_slots", "cuda_slots"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_connector_copies_with_auto_and_kernel_match(node, monkeypatch, setting, cuda_slots,
                                                     page_size):  # fmt: skip
    geo = geometry(torch.bfloat16, False, 2048, page_size)
    counts = round_trip(node, geo, setting, monkeypatch, cuda_slots=cuda_slots)
    if setting == "kernel" or cuda_slots:
        assert counts == {"kernel": 3, "streaming": "kernel"}, counts


def test_connector_copy_engine_refused_falls_back_to_the_kernel_with_one_log_line(
    node, monkeypatch, caplog
):
    require_copy_engine()
    lib = jit.load_library()
    monkeypatch.setattr(copy_engine, "_failed", {})
    calls = []
    for name in ("pagekv_ce_page_transfer", "pagekv_ce_page_transfer_layers"):
        monkeypatch.setattr(lib, name, lambda *a: calls.append(a) or 1)
    geo = geometry(torch.bfloat16, False, 2048, 16)
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        counts = round_trip(node, geo, "copy_engine", monkeypatch)
    lines = [r.getMessage() for r in caplog.records if "copy-engine" in r.getMessage()]
    assert len(calls) == 1 and len(lines) == 1, lines
    assert counts == {"kernel": 3, "streaming": "kernel"}, counts
    assert not copy_engine.supported(0)
