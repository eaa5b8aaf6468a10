"""The staged backend (pagekv.kernels.staged) against the torch reference, bit for bit,
destinations poisoned first: chunks small enough that both staging buffers take turns several
times, pages and slots out of range, the caller's stream order, and the cases it leaves to the
kernel. Run on a GPU machine (scripts/gpu_check.sh); skipped elsewhere."""

import logging

import pytest
import torch

from pagekv.connector import HostPagePool
from pagekv.kernels import DeviceKV, copy_engine, jit, load, load_ref, save, save_ref, staged
from tests.gpu.test_kernels_gpu import (
    _layout,
    device_caches,
    geometry,
    require_copy_engine,
    slot_table,
)
from tests.helpers import bits_equal, poison_, random_tensor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", 0)


@pytest.fixture
def small_chunks(monkeypatch):
    """Fresh staging state: chunks of 3 pages tapering to 1, 2 buffers taking turns over 3 DMA
    streams (so buffers are reused while streams differ, and chunks differ in size)."""
    require_copy_engine()
    monkeypatch.setattr(staged, "_devices", {})
    monkeypatch.setattr(staged, "BUFFERS", 2)
    monkeypatch.setattr(staged, "DMA_STREAMS", 3)

    def chunk_for(geo):
        monkeypatch.setattr(staged, "CHUNK_BYTES", 3 * geo.page_bytes)
        monkeypatch.setattr(staged, "TAPER_BYTES", geo.page_bytes)  # the last 3-5 pages: 2, 1..

    return chunk_for


def _bad_indices(ids, slots, n_host, num_slots, page_size):
    """Make some slots and two page ids out of range; the reference's equivalent (skipped
    slots -1, the bad pages' slots -1)."""
    every = slots.view(-1)[:: max(3, page_size // 2)]
    every.copy_(torch.where(every >= 0, every + num_slots, every))
    ids[0], ids[-1] = n_host + 7, -3
    ref_slots = slots.clone()
    ref_slots[ref_slots >= num_slots] = -1
    ref_slots[0], ref_slots[-1] = -1, -1
    ref_ids = ids.clone()
    ref_ids[0], ref_ids[-1] = 0, 0
    return ref_ids, ref_slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("item_bytes", [256, 260, 1152, 2048])
@pytest.mark.parametrize("on_default_stream", [True, False], ids=["default", "side"])
def test_staged_load_and_save_match_reference(
    small_chunks, dtype, mla, page_size, item_bytes, on_default_stream
):
    """All-layer loads (out-of-range pages and slots skipped) and saves (every index in range)
    through 3-page chunks, ordered after and before the stream's neighbouring work."""
    geo = geometry(dtype, mla, item_bytes, page_size, num_layers=4)
    small_chunks(geo)
    n_pages = max(7, 160 // page_size)
    num_slots = n_pages * page_size + 40
    pool = HostPagePool(geo, n_pages + 4)
    stream = torch.cuda.default_stream(DEV) if on_default_stream else torch.cuda.Stream(DEV)
    ids = torch.randperm(n_pages + 4)[:n_pages]
    slots = slot_table(n_pages, page_size, num_slots, torch.int64, skip=0.0)

    fresh = device_caches(geo, num_slots)
    src = device_caches(geo, num_slots, poisoned=True)
    want = poison_(pool.buffer.clone())
    save_ref(DeviceKV.from_caches(geo, *fresh), slots, want, ids)
    poison_(pool.buffer)
    torch.cuda.synchronize()  # inputs ready; what follows is ordered by the stream alone
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)  # earlier work on the stream: the copies wait for it
        for a, b in zip(src, fresh):
            a.copy_(b)
        got = save(DeviceKV.from_caches(geo, *src), slots, pool.buffer, ids, backend="staged",
                   validate=False)  # fmt: skip
        after_save = pool.buffer.to(DEV, non_blocking=True)  # the stream's next work sees them
    stream.synchronize()
    assert got == "staged" and bits_equal(after_save.cpu(), want), "save"

    ref_ids, ref_slots = _bad_indices(ids, slots, n_pages + 4, num_slots, page_size)
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
        got = load(pool.buffer, ids, dst, slots, backend="staged", validate=False)
        after = [[t.clone() for t in g] for g in dst.layers]  # must see the loaded rows
    stream.synchronize()
    assert got == "staged"
    for g_after, g_ref in zip(after, ref.layers):
        assert all(bits_equal(a, b) for a, b in zip(g_after, g_ref)), "load"


@pytest.mark.parametrize("layout", ["separate", "interleaved", "uneven", "strided"])
def test_staged_every_cache_layout(small_chunks, layout):
    geo = geometry(torch.bfloat16, False, 512, 16, num_layers=4)
    small_chunks(geo)
    n_pages, num_slots = 11, 11 * 16 + 40
    pool = HostPagePool(geo, n_pages + 2)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    ids = torch.randperm(n_pages + 2)[:n_pages]
    slots = slot_table(n_pages, 16, num_slots, torch.int64, skip=0.1)
    dst = DeviceKV.from_caches(geo, *_layout(layout, geo, num_slots))
    ref = DeviceKV.from_caches(geo, *device_caches(geo, num_slots, poisoned=True))
    load_ref(pool.buffer, ids, ref, slots)
    assert load(pool.buffer, ids, dst, slots, backend="staged", validate=False) == "staged"
    torch.cuda.synchronize()
    for g_dst, g_ref in zip(dst.layers, ref.layers):
        assert all(bits_equal(a, b) for a, b in zip(g_dst, g_ref)), layout
    poison_(pool.buffer)
    want = poison_(pool.buffer.clone())
    full = slot_table(n_pages, 16, num_slots, torch.int64, skip=0.0)
    save_ref(ref, full, want, ids)
    assert save(dst, full, pool.buffer, ids, backend="staged", validate=False) == "staged"
    torch.cuda.synchronize()
    assert bits_equal(pool.buffer, want), layout


def test_staged_leaves_one_layer_and_partial_saves_to_the_kernel(small_chunks):
    """One layer is not contiguous on the host, and a whole-page copy would write the host
    bytes of tokens a save skips: both take the kernel, with the reference's result."""
    geo = geometry(torch.bfloat16, False, 512, 16, num_layers=4)
    small_chunks(geo)
    n_pages, num_slots = 8, 8 * 16 + 8
    kv = DeviceKV.from_caches(geo, *device_caches(geo, num_slots))
    pool = HostPagePool(geo, n_pages)
    ids = torch.randperm(n_pages)
    slots = slot_table(n_pages, 16, num_slots, torch.int64, skip=0.0)
    slots[3, 5:] = -1  # a partial page
    for layer in (None, 2):
        want = poison_(pool.buffer.clone())
        save_ref(kv, slots, want, ids, layer=layer)
        poison_(pool.buffer)
        assert save(kv, slots, pool.buffer, ids, layer=layer, backend="staged") == "kernel"
        torch.cuda.synchronize()
        assert bits_equal(pool.buffer, want), layer
    dst = device_caches(geo, num_slots, poisoned=True)
    ref = [d.clone() for d in dst]
    load_ref(pool.buffer, ids, DeviceKV.from_caches(geo, *ref), slots, layer=1)
    got = load(pool.buffer, ids, DeviceKV.from_caches(geo, *dst), slots, layer=1,
               backend="staged")  # fmt: skip
    torch.cuda.synchronize()
    assert got == "kernel" and all(bits_equal(a, b) for a, b in zip(dst, ref))


def test_staged_dma_refused_midway_finishes_on_the_kernel(small_chunks, monkeypatch, caplog):
    """The driver refuses the second chunk's DMA: one log line, the chunks left go through the
    kernel from the host pages, and the result is the reference's."""
    geo = geometry(torch.bfloat16, False, 512, 16, num_layers=3)
    small_chunks(geo)
    lib = jit.load_library()
    real = lib.pagekv_ce_page_transfer
    calls = []

    def second_refused(*args):
        calls.append(1)
        return 1 if len(calls) == 2 else real(*args)

    monkeypatch.setattr(copy_engine, "_failed", {})
    monkeypatch.setattr(lib, "pagekv_ce_page_transfer", second_refused)
    n_pages, num_slots = 10, 10 * 16
    pool = HostPagePool(geo, n_pages)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    ids = torch.randperm(n_pages)
    slots = torch.randperm(num_slots).view(n_pages, 16)
    dst = device_caches(geo, num_slots, poisoned=True)
    ref = [d.clone() for d in dst]
    load_ref(pool.buffer, ids, DeviceKV.from_caches(geo, *ref), slots)
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        got = load(pool.buffer, ids, DeviceKV.from_caches(geo, *dst), slots, backend="staged")
    torch.cuda.synchronize()
    assert got == "staged" and all(bits_equal(a, b) for a, b in zip(dst, ref))
    assert len(calls) == 2  # the first chunk staged, the second refused, the rest the kernel
    assert sum("staged load DMA failed" in r.message for r in caplog.records) == 1
    assert not copy_engine.supported(0)  # the device uses the kernel from now on
