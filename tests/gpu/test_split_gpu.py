"""The split backend's own rules (``backend="split"``: all layers shared between the kernel on 2
thread blocks and the pitched copy on a side stream): ``auto`` offers it to the connector's
issuer alone, with the measured share; a share outside [0, 1] is refused before anything moves;
without batched copies the issuer is not used. Its transfers against the torch reference,
layouts, one layer, a failed pitched share and the issuer's queue: ``test_pitched_gpu.py``.
Run on a GPU machine (scripts/gpu_check.sh); skipped elsewhere."""

import math
import statistics

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
    load,
    load_ref,
    split,
)
from tests.gpu.test_kernels_gpu import device_caches, geometry
from tests.helpers import bits_equal, random_tensor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", 0)


def _caches_equal(kv, ref):
    return all(bits_equal(a, b) for ga, gb in zip(kv.layers, ref.layers) for a, b in zip(ga, gb))


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
    # the mean of the shares measured at 4 KiB runs at the nearest totals on both sides (a
    # share may be 0: the kernel on 2 blocks alone was the fastest)
    runs = [e for e in table.entries if e.shape.load and e.shape.all_layers
            and e.shape.run_bytes == 4096.0]  # fmt: skip
    below = max(e.shape.total_bytes for e in runs if e.shape.total_bytes <= total)
    above = min(e.shape.total_bytes for e in runs if e.shape.total_bytes >= total)
    shares = [e.split_share for e in runs if e.shape.total_bytes in (below, above)
              and math.isfinite(e.split_share)]  # fmt: skip
    want_share = statistics.fmean(shares) if shares else split.FALLBACK_SHARE
    assert 0.0 <= table.split_share(shape) <= 1.0
    assert table.split_share(shape) == pytest.approx(want_share)
    for deferred in (False, True):  # 4 KiB runs: under the copy engine's floors
        allowed = ["kernel", "direct", "pitched"] + (["split"] if deferred else [])
        want = table.choose(shape, allowed, deferred)
        assert choose_backend(True, kv, list(range(n)), slots, deferred=deferred) == want
        assert deferred or want != "split"
    assert choose_backend(True, kv, list(range(n)), slots, layer=1, deferred=True) != "split"


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
