"""The backends that move all layers by 2-D DMA copies -- the pitched copy (``backend=
"pitched"``: one 2-D copy per run of slots and K/V, a row per layer) and the split (``backend=
"split"``: a share of the pages so, the rest on the kernel's 2 blocks beside it) -- against the
torch reference, bit for bit, destinations poisoned first: MHA and MLA, 1- and 2-byte dtypes,
rows of 256 B-4 KiB, pages and slots out of range skipped, the split's shares 0, between, 1 and
the measured table's, the caller's stream order, every cache layout (those at uneven distances
take the kernel), one layer (the kernel), a failed pitched call (the kernel, one log line) and
the connector's issuer. The split's own rules: ``test_split_gpu.py``. Run on a GPU machine
(scripts/gpu_check.sh); skipped elsewhere."""

import logging

import pytest
import torch

from pagekv.connector import HostPagePool
from pagekv.connector.copy_issuer import CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch
from pagekv.kernels import DeviceKV, copy_engine, jit, load, load_ref, save, save_ref
from tests.gpu.test_kernels_gpu import _layout, device_caches, geometry, slot_table
from tests.helpers import bits_equal, poison_, random_tensor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", 0)


# (backend, the split's pitched share: None the table's, on the default stream)
CASES = [("pitched", None, True), ("pitched", None, False), ("split", None, True),
         ("split", None, False), ("split", 0.0, False), ("split", 0.37, False),
         ("split", 1.0, False)]  # fmt: skip
CASE_IDS = [f"{b}-{'table' if s is None else s}-{'default' if d else 'side'}" for b, s, d in CASES]
BACKENDS = ["pitched", "split"]


def _indices(n_pages, page_size, num_slots):
    """Page ids (two out of range) and slots (some skipped, some out of range), and the same
    transfer in the reference's terms: the bad pages onto spare ids with every slot skipped."""
    ids = torch.randperm(n_pages + 4)[:n_pages]
    spare = sorted(set(range(n_pages + 4)) - set(ids.tolist()))
    slots = slot_table(n_pages, page_size, num_slots, torch.int64)
    every = slots.view(-1)[:: max(3, page_size // 2)]
    every.copy_(torch.where(every >= 0, every + num_slots, every))
    ids[0], ids[-1] = n_pages + 11, -3
    ref_slots = slots.clone()
    ref_slots[ref_slots >= num_slots] = -1
    ref_slots[0], ref_slots[-1] = -1, -1
    ref_ids = ids.clone()
    ref_ids[0], ref_ids[-1] = spare[0], spare[1]
    return ids, slots, ref_ids, ref_slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("item_bytes", [256, 260, 1152, 2048, 4096])
@pytest.mark.parametrize("backend,share,on_default_stream", CASES, ids=CASE_IDS)
def test_loads_and_saves_are_the_references(dtype, mla, page_size, item_bytes, backend, share,
                                            on_default_stream):  # fmt: skip
    """Loads and saves of all layers, out-of-range pages and slots skipped, after the stream's
    earlier work (behind a sleep) and before its next (a copy of the result): the split's two
    halves both wait for what came before, and what comes after waits for both."""
    if item_bytes % dtype.itemsize:
        pytest.skip("row is not a whole number of elements")
    geo = geometry(dtype, mla, item_bytes, page_size, num_layers=5)
    n_pages = max(5, 192 // page_size)
    num_slots = n_pages * page_size + 40
    pool = HostPagePool(geo, n_pages + 4)
    ids, slots, ref_ids, ref_slots = _indices(n_pages, page_size, num_slots)
    stream = torch.cuda.default_stream(DEV) if on_default_stream else torch.cuda.Stream(DEV)

    fresh = device_caches(geo, num_slots)
    src = device_caches(geo, num_slots, poisoned=True)
    want = poison_(pool.buffer.clone())
    save_ref(DeviceKV.from_caches(geo, *fresh), ref_slots, want, ref_ids)
    poison_(pool.buffer)
    torch.cuda.synchronize()  # inputs ready; what follows is ordered by the stream alone
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)  # earlier work on the stream: the copies wait for it
        for a, b in zip(src, fresh):
            a.copy_(b)
        got = save(DeviceKV.from_caches(geo, *src), slots, pool.buffer, ids, backend=backend,
                   validate=False, dma_share=share)  # fmt: skip
        after_save = pool.buffer.to(DEV, non_blocking=True)  # the stream's next work
    stream.synchronize()
    assert got == backend and bits_equal(after_save.cpu(), want), "save"

    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    dst = DeviceKV.from_caches(geo, *device_caches(geo, num_slots, poisoned=True))
    ref = DeviceKV.from_caches(geo, *device_caches(geo, num_slots, poisoned=True))
    load_ref(pool.buffer, ref_ids, ref, ref_slots)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)
        for g in dst.layers:
            for t in g:
                poison_(t)  # runs after the sleep: the load must come after it
        got = load(pool.buffer, ids, dst, slots, backend=backend, validate=False,
                   dma_share=share)  # fmt: skip
        after = [[t.clone() for t in g] for g in dst.layers]  # must see the loaded rows
    stream.synchronize()
    assert got == backend, got
    for g_after, g_ref in zip(after, ref.layers):
        assert all(bits_equal(a, b) for a, b in zip(g_after, g_ref)), "load"


@pytest.mark.parametrize("layout", ["separate", "interleaved", "uneven", "strided"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_cache_layout(layout, mla, backend):
    """Layers at one distance (one tensor per K/V, K and V interleaved per layer, K and V of a
    slot side by side: 1-token runs) take the backend; per-layer tensors at uneven distances
    take the kernel. The result is the reference's either way."""
    geo = geometry(torch.bfloat16, mla, 1152 if mla else 512, 16, num_layers=4)
    n_pages, num_slots = 9, 9 * 16 + 24
    pool = HostPagePool(geo, n_pages + 4)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    ids, slots, ref_ids, ref_slots = _indices(n_pages, 16, num_slots)
    dst = DeviceKV.from_caches(geo, *_layout(layout, geo, num_slots))
    expect = "kernel" if layout == "uneven" else backend
    assert (dst.layer_pitches is None) == (expect == "kernel")
    ref = DeviceKV.from_caches(geo, *device_caches(geo, num_slots, poisoned=True))
    load_ref(pool.buffer, ref_ids, ref, ref_slots)
    assert load(pool.buffer, ids, dst, slots, backend=backend, validate=False,
                dma_share=0.5) == expect  # fmt: skip
    torch.cuda.synchronize()
    for g_dst, g_ref in zip(dst.layers, ref.layers):
        assert all(bits_equal(a, b) for a, b in zip(g_dst, g_ref)), layout
    want = poison_(pool.buffer.clone())
    save_ref(ref, ref_slots, want, ref_ids)
    poison_(pool.buffer)
    assert save(dst, slots, pool.buffer, ids, backend=backend, validate=False,
                dma_share=0.5) == expect  # fmt: skip
    torch.cuda.synchronize()
    assert bits_equal(pool.buffer, want), layout


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_layer_is_left_to_the_kernel(backend):
    geo = geometry(torch.bfloat16, False, 512, 16, num_layers=4)
    n_pages, num_slots = 8, 8 * 16 + 8
    caches = device_caches(geo, num_slots)
    pool = HostPagePool(geo, n_pages)
    ids = torch.randperm(n_pages)
    slots = slot_table(n_pages, 16, num_slots, torch.int64)
    want = poison_(pool.buffer.clone())
    save_ref(DeviceKV.from_caches(geo, *caches), slots, want, ids, layer=2)
    poison_(pool.buffer)
    got = save(DeviceKV.from_caches(geo, *caches), slots, pool.buffer, ids, layer=2,
               backend=backend)  # fmt: skip
    torch.cuda.synchronize()
    assert got == "kernel" and bits_equal(pool.buffer, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_pitched_call_falls_back_to_the_kernel_with_one_log_line(backend, monkeypatch,
                                                                           caplog):  # fmt: skip
    """The pitched copy's pages (all of them, or the split's share) go to the kernel, logged
    once; later calls go straight to the kernel."""
    lib = jit.load_library()
    monkeypatch.setattr(copy_engine, "_pitched_failed", {})
    calls = []
    monkeypatch.setattr(lib, "pagekv_pitched_page_transfer", lambda *a: calls.append(a) or 1)
    geo = geometry(torch.bfloat16, False, 512, 16, num_layers=3)
    pool = HostPagePool(geo, 12)
    ids = torch.randperm(12)[:10]
    slots = torch.randperm(200)[:160].view(10, 16)
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        for _ in range(2):
            pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
            dst = device_caches(geo, 200, poisoned=True)
            ref = [d.clone() for d in dst]
            load_ref(pool.buffer, ids, DeviceKV.from_caches(geo, *ref), slots)
            got = load(pool.buffer, ids, DeviceKV.from_caches(geo, *dst), slots,
                       backend=backend, dma_share=0.5)  # fmt: skip
            torch.cuda.synchronize()
            assert got == "kernel" and all(bits_equal(a, b) for a, b in zip(dst, ref))
    assert len(calls) == 1  # the second call went straight to the kernel
    lines = [r for r in caplog.records if "pitched" in r.getMessage()]
    assert len(lines) == 1 and "cudaError 1" in lines[0].getMessage()
    assert not copy_engine.pitched_supported(0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_connector_issues_them_on_its_issuer(backend, monkeypatch):
    """Through the connector's transfer launch: an all-layer save and load the setting gives the
    backend are queued on the issuer (the split's kernel half uploads its indices there), and
    their completions cover every byte; a layer-by-layer load under the same setting is the
    kernel's."""
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", backend)
    geo = geometry(torch.bfloat16, False, 512, 16, num_layers=4)
    n, num_slots = 24, 3 * 24 * 16
    caches = device_caches(geo, num_slots)
    kv = DeviceKV.from_caches(geo, *caches)
    pool = HostPagePool(geo, n)
    perm = torch.randperm(num_slots)
    a, b = perm[: n * 16].view(n, 16), perm[n * 16 : 2 * n * 16].view(n, 16)
    want = [t[:, a.reshape(-1)].clone() for t in caches]
    issuer = CopyIssuer(DEV)
    try:
        saved = launch(False, kv, pool.buffer, list(range(n)), a, IndexStaging(1 << 16), issuer)
        assert saved.backend == backend
        torch.cuda.current_stream(DEV).wait_event(saved.events[0])  # before the loads read
        for t in caches:
            t[:, b.reshape(-1)] = poison_(torch.empty_like(t[:, b.reshape(-1)]))
        out = launch(True, kv, pool.buffer, list(range(n)), b, IndexStaging(1 << 16), issuer)
        assert out.backend == backend
        out.events[0].synchronize()
        assert all(bits_equal(t[:, b.reshape(-1)], w) for t, w in zip(caches, want))
        assert issuer.counters["transfers"] == 2 and issuer.counters["kernel_fallbacks"] == 0
        for t in caches:
            t[:, b.reshape(-1)] = poison_(torch.empty_like(t[:, b.reshape(-1)]))
        layers = launch(True, kv, pool.buffer, list(range(n)), b, IndexStaging(1 << 16), issuer,
                        layers=range(geo.num_layers))  # fmt: skip
        assert layers.backend == "kernel" and issuer.counters["jobs"] == 2
        layers.events[-1].synchronize()
        assert all(bits_equal(t[:, b.reshape(-1)], w) for t, w in zip(caches, want))
    finally:
        issuer.close()
