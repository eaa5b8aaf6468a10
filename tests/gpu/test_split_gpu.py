"""The split save (``backend="split"``: the kernel and the copy engine at once on disjoint pages)
against the torch reference, bit for bit, host pages poisoned first: every geometry kind, pages
and slots out of range skipped, the share taken from the measured table, the caller's stream
order, what it leaves to the kernel, a copy engine the driver refuses, and the connector's
issuer. Run on a GPU machine (scripts/gpu_check.sh); skipped elsewhere."""

import logging

import pytest
import torch

from pagekv.connector import HostPagePool
from pagekv.connector.copy_issuer import CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch
from pagekv.kernels import DeviceKV, copy_engine, copy_table, jit, load, load_ref, save, save_ref
from tests.gpu.test_kernels_gpu import device_caches, geometry, require_copy_engine
from tests.helpers import bits_equal, poison_, random_tensor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", 0)


@pytest.fixture
def share(monkeypatch):
    """Set the measured table's split share (one entry: every save shape is nearest to it) and
    count the pages each copy-engine part is given."""
    require_copy_engine()
    ce_pages: list[int] = []
    real = copy_engine.page_transfer

    def counted(lib, load_, host, kv, ids, *args):
        ce_pages.append(ids.numel())
        return real(lib, load_, host, kv, ids, *args)

    monkeypatch.setattr(copy_engine, "page_transfer", counted)

    def set_share(value: float) -> list[int]:
        entry = copy_table.Entry(copy_table.Shape(False, True, 4096.0, 1 << 20),
                                 (("kernel", 1.0), ("copy_engine", 2.0), ("split", 0.9)),
                                 (("kernel", 1e-5), ("copy_engine", 1e-3), ("split", 1e-3)),
                                 value)  # fmt: skip
        table = copy_table.CopyTable("test", "GPU", (entry,))
        monkeypatch.setattr(copy_table, "calibrate", lambda device=None, **kw: table)
        return ce_pages

    return set_share


def _case(mla, item_bytes, page_size, n_pages=16):
    """Host pages, fresh device caches (and their view), unique page ids with two out of range
    and slots with some skipped or out of range; the reference's page ids and slots for the
    same save."""
    geo = geometry(torch.bfloat16, mla, item_bytes, page_size, num_layers=4)
    num_slots = n_pages * page_size + 40
    pool = HostPagePool(geo, n_pages + 4)
    caches = device_caches(geo, num_slots)
    kv = DeviceKV.from_caches(geo, *caches)
    ids = torch.randperm(n_pages + 4)[:n_pages]
    spare = sorted(set(range(n_pages + 4)) - set(ids.tolist()))
    slots = torch.randperm(num_slots)[: n_pages * page_size].view(n_pages, page_size)
    slots.view(-1)[:: max(3, page_size // 2)] = -1
    slots.view(-1)[1 :: max(5, page_size)] += num_slots  # out of range: skipped tokens
    ref_ids, ref_slots = ids.clone(), slots.clone()
    for i, bad in ((1, n_pages + 9), (n_pages - 2, -3)):  # one in each part
        ids[i] = bad
        ref_ids[i], ref_slots[i] = spare.pop(), -1
    ref_slots[ref_slots >= num_slots] = -1
    return geo, pool, caches, kv, ids, slots, ref_ids, ref_slots


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("item_bytes", [256, 1152, 2048])
@pytest.mark.parametrize("ce_share", [0.1, 0.5])
@pytest.mark.parametrize("on_default_stream", [True, False], ids=["default", "side"])
def test_split_save_matches_reference(share, mla, page_size, item_bytes, ce_share,
                                      on_default_stream):  # fmt: skip
    """Both parts come after the stream's earlier work (the caches filled behind a sleep) and
    the stream's next work (a copy of the host pages) sees every page of both."""
    ce_pages = share(ce_share)
    _, pool, caches, kv, ids, slots, ref_ids, ref_slots = _case(mla, item_bytes, page_size)
    want = poison_(pool.buffer.clone())
    save_ref(kv, ref_slots, want, ref_ids)
    fresh = [t.clone() for t in caches]
    for t in caches:
        poison_(t)  # stale rows the save must never carry
    poison_(pool.buffer)
    stream = torch.cuda.default_stream(DEV) if on_default_stream else torch.cuda.Stream(DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)  # earlier work on the stream: both parts wait for it
        for t, f in zip(caches, fresh):
            t.copy_(f)
        got = save(kv, slots, pool.buffer, ids, backend="split", validate=False)
        after = pool.buffer.to(DEV, non_blocking=True)  # the stream's next work
    stream.synchronize()
    assert got == "split" and ce_pages == [round(ids.numel() * ce_share)]
    assert bits_equal(after.cpu(), want)


def test_split_leaves_loads_one_layer_and_a_zero_share_to_the_kernel(share):
    ce_pages = share(0.5)
    geo, pool, _, kv, ids, slots, ref_ids, ref_slots = _case(False, 2048, 16)
    want = poison_(pool.buffer.clone())
    save_ref(kv, ref_slots, want, ref_ids, layer=1)
    poison_(pool.buffer)
    assert save(kv, slots, pool.buffer, ids, layer=1, backend="split", validate=False) == "kernel"
    torch.cuda.synchronize()
    assert bits_equal(pool.buffer, want)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    dst = device_caches(geo, kv.num_slots, poisoned=True)
    ref = [t.clone() for t in dst]
    load_ref(pool.buffer, ref_ids, DeviceKV.from_caches(geo, *ref), ref_slots)
    got = load(pool.buffer, ids, DeviceKV.from_caches(geo, *dst), slots, backend="split",
               validate=False)  # fmt: skip
    torch.cuda.synchronize()
    assert got == "kernel" and all(bits_equal(a, b) for a, b in zip(dst, ref))
    assert ce_pages == []
    share(0.01)  # 16 pages: none for the copy engine
    want = poison_(pool.buffer.clone())
    save_ref(kv, ref_slots, want, ref_ids)
    poison_(pool.buffer)
    assert save(kv, slots, pool.buffer, ids, backend="split", validate=False) == "kernel"
    torch.cuda.synchronize()
    assert bits_equal(pool.buffer, want) and ce_pages == []


def test_a_refused_copy_engine_part_is_saved_by_the_kernel(share, monkeypatch, caplog):
    """The driver refuses the copy engine's part: one log line, the kernel saves those pages
    after it, the result is the reference's, and the device stops using the copy engine."""
    share(0.5)
    lib = jit.load_library()
    monkeypatch.setattr(copy_engine, "_failed", {})
    monkeypatch.setattr(lib, "pagekv_ce_page_transfer", lambda *args: 1)
    _, pool, _, kv, ids, slots, ref_ids, ref_slots = _case(True, 1152, 16)
    want = poison_(pool.buffer.clone())
    save_ref(kv, ref_slots, want, ref_ids)
    poison_(pool.buffer)
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        got = save(kv, slots, pool.buffer, ids, backend="split", validate=False)
    torch.cuda.synchronize()
    assert got == "kernel" and bits_equal(pool.buffer, want)
    assert len([r for r in caplog.records if "copy-engine" in r.getMessage()]) == 1
    assert not copy_engine.supported(0)


def test_the_connector_issues_a_split_save_on_its_issuer(share, monkeypatch):
    """Through the connector's transfer launch: a save the setting gives the split backend is
    queued on the issuer (the caller's stream is not ordered after it) and its completion
    covers both parts; a load under the same setting is the kernel's, on the caller's stream."""
    ce_pages = share(0.3)
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "split")
    geo, pool, caches, kv, _, _, _, _ = _case(False, 2048, 16)
    n = 16
    page_ids = list(range(n))
    slots = torch.randperm(kv.num_slots)[: n * 16].view(n, 16)
    want = poison_(pool.buffer.clone())
    save_ref(kv, slots, want, torch.tensor(page_ids))
    poison_(pool.buffer)
    issuer = CopyIssuer(DEV)
    try:
        out = launch(False, kv, pool.buffer, page_ids, slots, IndexStaging(1 << 16), issuer)
        assert out.backend == "split"
        out.events[0].synchronize()
        assert bits_equal(pool.buffer, want) and ce_pages == [round(n * 0.3)]
        assert issuer.counters["transfers"] == 1 and issuer.counters["kernel_fallbacks"] == 0
        for t in caches:
            poison_(t)
        got = launch(True, kv, pool.buffer, page_ids, slots, IndexStaging(1 << 16), issuer)
        assert got.backend == "kernel" and issuer.counters["jobs"] == 1
        got.events[0].synchronize()
        ref = device_caches(geo, kv.num_slots, poisoned=True)
        load_ref(pool.buffer, torch.tensor(page_ids), DeviceKV.from_caches(geo, *ref), slots)
        flat = slots.reshape(-1).to(DEV)
        assert all(bits_equal(a[:, flat], b[:, flat]) for a, b in zip(caches, ref))
    finally:
        issuer.close()
