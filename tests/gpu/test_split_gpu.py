"""The split backend (``backend="split"``: all layers shared between the kernel on 2 thread
blocks and the pitched copy on a side stream) against the torch reference, bit for bit,
destinations poisoned first: MHA and MLA, 1- and 2-byte dtypes, rows of 256 B-4 KiB, pages and
slots out of range skipped, shares 0, between and 1 and the measured table's, the caller's stream
order, every cache layout (those at uneven distances take the kernel), one layer (the kernel), a
failed pitched call (its pages to the kernel, one log line), the issuer's measured choice and the
connector's issuer. Run on a GPU machine (scripts/gpu_check.sh); skipped elsewhere."""

import logging

import pytest
import torch

from pagekv.connector import HostPagePool, KVGeometry
from pagekv.connector.copy_issuer import CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch
from pagekv.kernels import (
    DeviceKV,
    calibrate,
    choose_backend,
    copy_engine,
    copy_table,
    jit,
    load,
    load_ref,
    save,
    save_ref,
)
from tests.gpu.test_kernels_gpu import _layout, device_caches, geometry, slot_table
from tests.gpu.test_pitched_gpu import _indices
from tests.helpers import bits_equal, poison_, random_tensor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", 0)


def _caches_equal(kv, ref):
    return all(bits_equal(a, b) for ga, gb in zip(kv.layers, ref.layers) for a, b in zip(ga, gb))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("item_bytes", [256, 1152, 4096])
@pytest.mark.parametrize("share", [0.0, 0.37, 1.0, None], ids=["s0", "s037", "s1", "table"])
def test_split_loads_and_saves_are_the_references(dtype, mla, page_size, item_bytes, share):
    """Loads and saves of all layers with out-of-range pages and slots, on a side stream, after
    its earlier work (behind a sleep) and before its next (a copy of the result): both halves
    wait for what came before and what comes after waits for both."""
    geo = geometry(dtype, mla, item_bytes, page_size, num_layers=5)
    n_pages = max(5, 192 // page_size)
    num_slots = n_pages * page_size + 40
    pool = HostPagePool(geo, n_pages + 4)
    ids, slots, ref_ids, ref_slots = _indices(n_pages, page_size, num_slots)
    stream = torch.cuda.Stream(DEV)

    fresh = device_caches(geo, num_slots)
    src = device_caches(geo, num_slots, poisoned=True)
    want = poison_(pool.buffer.clone())
    save_ref(DeviceKV.from_caches(geo, *fresh), ref_slots, want, ref_ids)
    poison_(pool.buffer)
    torch.cuda.synchronize()  # inputs ready; what follows is ordered by the stream alone
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)  # earlier work on the stream: both halves wait for it
        for a, b in zip(src, fresh):
            a.copy_(b)
        got = save(DeviceKV.from_caches(geo, *src), slots, pool.buffer, ids, backend="split",
                   validate=False, dma_share=share)  # fmt: skip
        after_save = pool.buffer.to(DEV, non_blocking=True)  # the stream's next work
    stream.synchronize()
    assert got == "split" and bits_equal(after_save.cpu(), want), "save"

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
        got = load(pool.buffer, ids, dst, slots, backend="split", validate=False,
                   dma_share=share)  # fmt: skip
        after = [[t.clone() for t in g] for g in dst.layers]  # must see the loaded rows
    stream.synchronize()
    assert got == "split", got
    for g_after, g_ref in zip(after, ref.layers):
        assert all(bits_equal(a, b) for a, b in zip(g_after, g_ref)), "load"


@pytest.mark.parametrize("layout", ["separate", "interleaved", "uneven", "strided"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_split_every_cache_layout(layout, mla):
    """Layers at one distance take the split; per-layer tensors at uneven distances the kernel.
    The result is the reference's either way."""
    geo = geometry(torch.bfloat16, mla, 1152 if mla else 512, 16, num_layers=4)
    n_pages, num_slots = 9, 9 * 16 + 24
    pool = HostPagePool(geo, n_pages + 4)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    ids, slots, ref_ids, ref_slots = _indices(n_pages, 16, num_slots)
    dst = DeviceKV.from_caches(geo, *_layout(layout, geo, num_slots))
    expect = "kernel" if layout == "uneven" else "split"
    ref = DeviceKV.from_caches(geo, *device_caches(geo, num_slots, poisoned=True))
    load_ref(pool.buffer, ref_ids, ref, ref_slots)
    assert load(pool.buffer, ids, dst, slots, backend="split", validate=False,
                dma_share=0.5) == expect  # fmt: skip
    torch.cuda.synchronize()
    assert _caches_equal(dst, ref), layout
    want = poison_(pool.buffer.clone())
    save_ref(ref, ref_slots, want, ref_ids)
    poison_(pool.buffer)
    assert save(dst, slots, pool.buffer, ids, backend="split", validate=False,
                dma_share=0.5) == expect  # fmt: skip
    torch.cuda.synchronize()
    assert bits_equal(pool.buffer, want), layout


def test_split_leaves_one_layer_to_the_kernel():
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
               backend="split")  # fmt: skip
    torch.cuda.synchronize()
    assert got == "kernel" and bits_equal(pool.buffer, want)


def test_a_failed_pitched_share_goes_to_the_kernel_with_one_log_line(monkeypatch, caplog):
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
                       backend="split", dma_share=0.5)  # fmt: skip
            torch.cuda.synchronize()
            assert got == "kernel" and all(bits_equal(a, b) for a, b in zip(dst, ref))
    assert len(calls) == 1  # the second call went straight to the kernel
    lines = [r for r in caplog.records if "pitched" in r.getMessage()]
    assert len(lines) == 1 and "cudaError 1" in lines[0].getMessage()


def test_auto_offers_the_split_only_to_the_issuer(monkeypatch):
    """``auto``: the table's choice among the candidates, the split among them only where the
    transfer is deferred (the issuer enqueues it), all layers, at one pitch; and the split's
    share for a shape is the measured one around it."""
    monkeypatch.delenv("PAGEKV_COPY_BACKEND", raising=False)
    table = calibrate(0)
    # TP-8 16-token pages (4 KiB runs), the shape the split is for
    geo = KVGeometry(4, 16, 1, 128, "bf16")
    n = 64
    kv = DeviceKV.from_caches(geo, *device_caches(geo, n * 16))
    slots = torch.randperm(n)[:, None] * 16 + torch.arange(16)
    total = n * geo.page_bytes
    shape = copy_table.Shape(True, True, 4096.0, total)
    assert 0.0 < table.split_share(shape) < 1.0
    for deferred in (False, True):  # 4 KiB runs: under the copy engine's floors
        allowed = ["kernel", "direct", "pitched"] + (["split"] if deferred else [])
        want = table.choose(shape, allowed, deferred)
        assert choose_backend(True, kv, list(range(n)), slots, deferred=deferred) == want
        assert deferred or want != "split"
    assert choose_backend(True, kv, list(range(n)), slots, layer=1, deferred=True) != "split"


def test_the_connector_issues_split_transfers_on_its_issuer(monkeypatch):
    """Through the connector's transfer launch: an all-layer save and load the setting gives the
    split are queued on the issuer (the kernel's half uploads its indices there), and their
    completions cover every byte."""
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "split")
    geo = geometry(torch.bfloat16, False, 256, 16, num_layers=4)
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
        assert saved.backend == "split"
        torch.cuda.current_stream(DEV).wait_event(saved.events[0])  # before the loads read
        for t in caches:
            t[:, b.reshape(-1)] = poison_(torch.empty_like(t[:, b.reshape(-1)]))
        out = launch(True, kv, pool.buffer, list(range(n)), b, IndexStaging(1 << 16), issuer)
        assert out.backend == "split"
        out.events[0].synchronize()
        assert all(bits_equal(t[:, b.reshape(-1)], w) for t, w in zip(caches, want))
        assert issuer.counters["transfers"] == 2 and issuer.counters["kernel_fallbacks"] == 0
    finally:
        issuer.close()


def test_shares_outside_zero_to_one_are_refused():
    geo = geometry(torch.bfloat16, False, 256, 16, num_layers=2)
    kv = DeviceKV.from_caches(geo, *device_caches(geo, 64, poisoned=True))
    before = [t.clone() for g in kv.layers for t in g]
    pool = HostPagePool(geo, 4)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="share"):
            load(pool.buffer, [0, 1], kv, torch.arange(32).view(2, 16), backend="split",
                 dma_share=bad)  # fmt: skip
    torch.cuda.synchronize()
    assert all(bits_equal(a, b) for a, b in zip(before, [t for g in kv.layers for t in g]))


def test_without_batched_copies_the_issuer_is_not_used_nor_the_split_chosen(monkeypatch):
    """Where the device has stopped using batched copies the connector's launch neither queues
    on its issuer nor picks as if it would: the caller's thread's choice (never the split), run
    on the caller's stream, and the bytes are the reference's."""
    monkeypatch.delenv("PAGEKV_COPY_BACKEND", raising=False)
    monkeypatch.setattr(copy_engine, "_failed", {0: "stopped for this test"})
    geo = KVGeometry(4, 16, 1, 128, "bf16")  # 4 KiB runs: the issuer's split where it is used
    n = 64
    caches = device_caches(geo, n * 16, poisoned=True)
    kv = DeviceKV.from_caches(geo, *caches)
    pool = HostPagePool(geo, n)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    slots = torch.randperm(n)[:, None] * 16 + torch.arange(16)
    ref = DeviceKV.from_caches(geo, *[c.clone() for c in caches])
    load_ref(pool.buffer, torch.arange(n), ref, slots)
    issuer = CopyIssuer(DEV)
    try:
        out = launch(True, kv, pool.buffer, list(range(n)), slots, IndexStaging(1 << 16), issuer)
        assert out.backend != "split" and issuer.counters["jobs"] == 0
        out.events[0].synchronize()
        assert _caches_equal(kv, ref)
    finally:
        issuer.close()
