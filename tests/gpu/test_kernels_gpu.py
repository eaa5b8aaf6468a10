"""CUDA kernels against the torch reference, bit for bit, destinations poisoned first.

Run on a GPU machine (scripts/gpu_check.sh); skipped elsewhere.
"""

import logging
import os
import random
import statistics
import subprocess
import sys
import time

import pytest
import torch

from pagekv.connector import HostPagePool, KVGeometry, host_pool
from pagekv.kernels import (
    DeviceKV,
    _calibrate,
    calibrate,
    copy_engine,
    copy_slots,
    copy_slots_ref,
    copy_table,
    jit,
    load,
    load_ref,
    save,
    save_ref,
    store_kv,
    store_kv_ref,
)
from pagekv.kernels._calibrate import steady_seconds
from tests.helpers import ALL_DTYPES, as_bits, bits_equal, poison_, random_tensor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", 0)
ITEM_BYTES = [256, 264, 260, 1152, 2048, 4096]  # 264/260: 8- and 4-byte accesses


def geometry(dtype, mla, item_bytes, page_size, num_layers=3):
    elems = item_bytes // dtype.itemsize
    if mla:
        return KVGeometry.mla(num_layers, page_size, elems, dtype)
    heads = 2 if elems % 2 == 0 and elems >= 128 else 1
    return KVGeometry(num_layers, page_size, heads, elems // heads, dtype)


def device_caches(geo, num_slots, poisoned=False):
    shape = (geo.num_layers, num_slots, *geo.device_layer_shape)
    if poisoned:
        return [poison_(torch.empty(shape, dtype=geo.dtype, device=DEV)) for _ in range(geo.num_kv)]
    return [random_tensor(shape, geo.dtype, DEV) for _ in range(geo.num_kv)]


def slot_table(n_pages, page_size, num_slots, index_dtype, skip=0.1):
    s = torch.randperm(num_slots)[: n_pages * page_size]
    s[torch.rand(s.shape) < skip] = -1
    return s.view(n_pages, page_size).to(index_dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 2, 16, 64, 128])
@pytest.mark.parametrize("item_bytes", ITEM_BYTES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_page_transfers_match_reference(dtype, mla, page_size, item_bytes, index_dtype):
    if item_bytes % dtype.itemsize:
        pytest.skip("row is not a whole number of elements")
    geo = geometry(dtype, mla, item_bytes, page_size)
    n_pages = max(1, 384 // page_size)
    num_slots = n_pages * page_size + 37
    kv = DeviceKV.from_caches(geo, *device_caches(geo, num_slots))
    pool = HostPagePool(geo, n_pages + 3)
    assert pool.is_pinned
    ids = torch.randperm(n_pages + 3)[:n_pages].to(index_dtype)
    slots = slot_table(n_pages, page_size, num_slots, index_dtype)
    layer = random.randrange(geo.num_layers)
    for backend in ("kernel", "copy_engine", "direct"):
        if backend == "copy_engine":
            require_copy_engine()
        for lay in (None, layer):
            idx = (ids.to(DEV), slots.to(DEV)) if backend == "kernel" else (ids, slots)
            want = poison_(pool.buffer.clone())
            save_ref(kv, slots, want, ids, layer=lay)
            poison_(pool.buffer)
            assert save(kv, idx[1], pool.buffer, idx[0], layer=lay, backend=backend) == backend
            torch.cuda.synchronize()
            assert bits_equal(pool.buffer, want), ("save", backend, lay)

            pool.buffer.copy_(random_tensor(pool.buffer.shape, dtype))
            dst = device_caches(geo, num_slots, poisoned=True)
            ref = [d.clone() for d in dst]
            load_ref(pool.buffer, ids, DeviceKV.from_caches(geo, *ref), slots, layer=lay)
            kv_dst = DeviceKV.from_caches(geo, *dst)
            assert load(pool.buffer, idx[0], kv_dst, idx[1], layer=lay, backend=backend) == backend
            torch.cuda.synchronize()
            assert all(bits_equal(a, b) for a, b in zip(dst, ref)), ("load", backend, lay)


def require_copy_engine():
    if not copy_engine.supported(0):
        pytest.skip(f"copy engine unavailable here: {copy_engine.disabled_reason(0)}")


def test_auto_uses_the_measured_table_and_the_setting(monkeypatch):
    geo = KVGeometry(2, 128, 8, 128, "bf16")  # 128-token pages of 2 KiB rows: 256 KiB runs
    kv = DeviceKV.from_caches(geo, *device_caches(geo, 1024))
    pool = HostPagePool(geo, 8)
    contiguous = torch.arange(1024).view(8, 128)
    monkeypatch.delenv("PAGEKV_COPY_BACKEND", raising=False)  # the default: auto
    table = calibrate(0)
    assert table.entries and all(
        dict(e.seconds)["kernel"] > 0 for e in table.entries
    )  # every shape timed the kernel
    ce = copy_engine.supported(0)
    allowed = ["kernel", "direct"] + (["copy_engine"] if ce else [])
    for load_, all_layers in ((False, True), (True, False)):
        rows = geo.num_layers * 2 if all_layers else 2
        shape = copy_table.Shape(load_, all_layers, 128 * geo.item_bytes, 8 * 128 * rows * 2048)
        pitched = ["pitched"] if all_layers else []  # one tensor per K/V: layers at one pitch
        want = table.choose(shape, allowed + pitched)  # never the staged backend: see staged.py
        layer = None if all_layers else 1
        if load_:
            got = load(pool.buffer, list(range(8)), kv, contiguous, layer=layer)
        else:
            got = save(kv, contiguous, pool.buffer, list(range(8)), layer=layer)
        assert got == want
    # CUDA index tensors: the kernel (no copy can be built on the host without a sync)
    assert save(kv, contiguous.to(DEV), pool.buffer, torch.arange(8, device=DEV)) == "kernel"
    for setting in ("kernel", "direct", "copy_engine", "staged", "pitched", "split"):
        monkeypatch.setenv("PAGEKV_COPY_BACKEND", setting)
        expect = setting if setting in ("kernel", "direct", "pitched", "split") or ce else "kernel"
        assert save(kv, contiguous, pool.buffer, list(range(8))) == expect
    torch.cuda.synchronize()


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _device_seconds(fn, stream):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.mark.gpu_alone
@pytest.mark.parametrize("idle_host_s", [0.0, 0.003])
def test_the_table_times_a_run_at_its_device_rate_not_its_first_calls_host_time(idle_host_s):
    """A call issued to an idle device may hold the host long (a busy host, a first call);
    the table's rate is the run's once under way: here the device's ~1 ms a call."""
    stream = torch.cuda.Stream()
    cycles = 1 << 21

    def copy():
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)

    def call():
        if idle_host_s and stream.query():  # nothing queued: this call starts a run
            _spin(idle_host_s)
        copy()

    copy()
    stream.synchronize()
    device = statistics.median(_device_seconds(copy, stream) for _ in range(3))
    seconds, enqueue = steady_seconds(call, stream)
    assert 0.8 * device <= seconds <= 1.25 * device, (seconds, device)
    assert enqueue >= idle_host_s


def test_the_table_times_a_host_bound_run_at_its_host_time():
    stream = torch.cuda.Stream()

    def call():  # 2 ms of host time, ~0.1 ms of device time
        _spin(0.002)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1 << 17)

    seconds, enqueue = steady_seconds(call, stream)
    assert seconds >= 0.9 * 0.002 and enqueue >= 0.002, (seconds, enqueue)


@pytest.mark.gpu_alone
def test_the_table_times_a_run_slowed_by_a_busy_host_at_its_fastest():
    """A host-bound run (here 2 ms of host time a call) that other processes slow in most of
    the timed runs (here to 6 ms) is timed at its fastest run, not at the busy host's."""
    stream = torch.cuda.Stream()
    calls = []

    def call():
        calls.append(1)
        busy = 2 <= len(calls) <= 10  # the untimed call, then the first three runs of three
        _spin(0.006 if busy else 0.002)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1 << 17)

    seconds, _ = steady_seconds(call, stream, reps=5, inner=3)
    assert len(calls) == 16
    assert 0.9 * 0.002 <= seconds <= 0.004, seconds


def test_a_table_measured_after_a_refused_call_stays_in_its_process(monkeypatch, tmp_path,
                                                                     caplog):  # fmt: skip
    """A process whose batched copies were refused times no copy engine: its table serves it and
    is not cached (every later process would go without the copy engine); once nothing has been
    refused, the next measurement is cached."""
    monkeypatch.setattr(jit, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(copy_table, "_tables", {})
    measured = []
    monkeypatch.setattr(_calibrate, "measure_entries",
                        lambda device, timing: measured.append(device) or [])  # fmt: skip
    monkeypatch.setattr(copy_engine, "_failed", {0: "refused for this test"})
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_table"):
        calibrate(0)
    assert not list(tmp_path.glob("copy_table_*.json"))
    assert "batched copies (refused for this test)" in caplog.text
    monkeypatch.setattr(copy_table, "_tables", {})
    monkeypatch.setattr(copy_engine, "_failed", {})
    calibrate(0)
    assert measured == [0, 0] and len(list(tmp_path.glob("copy_table_*.json"))) == 1


@pytest.mark.gpu_alone
def test_a_table_measured_on_a_busy_host_serves_busy_start_ups_until_a_quiet_one(
    monkeypatch, tmp_path
):
    """calibrate on the device, over a grid of four shapes: beside twice as many spinning
    processes as CPUs the table is cached as provisional (its threads' wait recorded); the next
    process, still beside them, runs the trial, finds the host busy and uses it without
    measuring; once they stop, the next one's trial finds the host quiet, measures again and
    caches the device's table."""
    monkeypatch.setattr(jit, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(copy_table, "RUN_BYTES", (32768,))
    monkeypatch.setattr(copy_table, "TOTAL_BYTES", (16 << 20,))
    measured, trials = [], []
    measure_grid, trial = _calibrate.measure_grid, _calibrate.trial
    monkeypatch.setattr(_calibrate, "measure_grid",
                        lambda device: measured.append(device) or measure_grid(device))  # fmt: skip
    monkeypatch.setattr(_calibrate, "trial",
                        lambda device: trials.append(device) or trial(device))  # fmt: skip

    def start_up():  # a new process: nothing remembered in this one
        monkeypatch.setattr(copy_table, "_tables", {})
        return calibrate(0)

    cpus = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2 * cpus)]  # fmt: skip
    try:
        first = start_up()
        assert first.host_wait is not None and first.host_wait >= _calibrate.BUSY_WAIT_SHARE
        assert len(first.entries) == 4 and measured == [0] and trials == []
        (path,) = tmp_path.glob("copy_table_*.json")
        assert copy_table.load_table(path, first.key) == first
        assert start_up() == first and measured == [0] and trials == [0]
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    quiet = start_up()
    assert measured == [0, 0] and trials == [0, 0]
    assert quiet.host_wait is None and copy_table.load_table(path, first.key) == quiet
    assert start_up() == quiet and measured == [0, 0] and trials == [0, 0]


def _layout(name, geo, num_slots):
    """Device caches (poisoned) for ``geo`` laid out as ``name``; returns the per-kv groups."""
    shape = geo.device_layer_shape
    L, nkv = geo.num_layers, geo.num_kv
    if name == "separate":  # one tensor per K and V
        return [poison_(torch.empty(L, num_slots, *shape, dtype=geo.dtype, device=DEV))
                for _ in range(nkv)]  # fmt: skip
    if name == "interleaved":  # [layer, K/V, slot]
        t = poison_(torch.empty(L, nkv, num_slots, *shape, dtype=geo.dtype, device=DEV))
        return [t[:, c] for c in range(nkv)]
    if name == "uneven":  # per-layer tensors at uneven distances
        rows, gap = num_slots * geo.row_elems, 2048
        flat = poison_(torch.empty(L * nkv * (rows + gap) + gap, dtype=geo.dtype, device=DEV))
        offsets = [i * (rows + gap) + (i * i % 5) * 400 for i in range(L * nkv)]
        views = [flat[o : o + rows].view(num_slots, *shape) for o in offsets]
        return [views[c * L : (c + 1) * L] for c in range(nkv)]
    if name == "strided":  # K and V of a slot side by side: slot stride 2 rows, 1-token runs
        t = poison_(torch.empty(L, num_slots, 2, *shape, dtype=geo.dtype, device=DEV))
        return [t[:, :, c] for c in range(nkv)]
    raise ValueError(name)


@pytest.mark.parametrize("layout", ["separate", "interleaved", "uneven", "strided"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("on_default_stream", [True, False], ids=["default", "side"])
@pytest.mark.parametrize("lanes", [1, copy_engine.LANES])
@pytest.mark.parametrize("threads", [1, 2], ids=["one-thread", "two-threads"])
def test_copy_engine_layouts_bounds_and_stream_order(
    layout, mla, page_size, on_default_stream, lanes, threads, monkeypatch
):
    """Every cache layout against the reference, with out-of-range page ids and slots
    skipped (validate=False), ordered after and before the stream's neighbouring work, on one
    stream or split over the default lanes (7 descriptors per driver call) for all layers and
    two streams for one layer, sent from one host thread or two (a helper for every 3 copies:
    a one-layer call then takes a stream a thread), as the library reports using."""
    require_copy_engine()
    monkeypatch.setattr(copy_engine, "LANES", lanes)
    monkeypatch.setattr(copy_engine, "LAYER_LANES", min(lanes, 2))
    monkeypatch.setattr(copy_engine, "ENQUEUE_THREADS", threads)
    monkeypatch.setattr(copy_engine, "ENQUEUE_THREAD_COPIES", 3)
    if lanes > 1:
        monkeypatch.setattr(copy_engine, "MAX_OPS", 7)
    geo = geometry(torch.bfloat16, mla, 1152 if mla else 512, page_size, num_layers=4)
    n_pages = max(2, 256 // page_size)
    num_slots = n_pages * page_size + 40
    pool = HostPagePool(geo, n_pages + 4)
    ids = torch.randperm(n_pages + 4)[:n_pages]
    spare = sorted(set(range(n_pages + 4)) - set(ids.tolist()))
    slots = slot_table(n_pages, page_size, num_slots, torch.int64)
    every = slots.view(-1)[:: max(3, page_size // 2)]
    every.copy_(torch.where(every >= 0, every + num_slots, every))  # out of range: skipped
    ids[0], ids[-1] = n_pages + 4 + 7, -3  # out-of-range pages: skipped whole
    # the same transfer in the reference's terms: bad slots -1, bad pages onto spare ids
    ref_slots = slots.clone()
    ref_slots[ref_slots >= num_slots] = -1
    ref_slots[0], ref_slots[-1] = -1, -1
    ref_ids = ids.clone()
    ref_ids[0], ref_ids[-1] = spare[0], spare[1]
    stream = torch.cuda.default_stream(DEV) if on_default_stream else torch.cuda.Stream(DEV)
    layer = random.randrange(geo.num_layers)
    for lay in (None, layer):
        fresh = device_caches(geo, num_slots)
        src = device_caches(geo, num_slots, poisoned=True)
        want = poison_(pool.buffer.clone())
        save_ref(DeviceKV.from_caches(geo, *fresh), ref_slots, want, ref_ids, layer=lay)
        poison_(pool.buffer)
        torch.cuda.synchronize()  # inputs ready; what follows is ordered by the stream alone
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # earlier work on the stream: the copies wait for it
            for a, b in zip(src, fresh):
                a.copy_(b)
            got = save(DeviceKV.from_caches(geo, *src), slots, pool.buffer, ids, layer=lay,
                       backend="copy_engine", validate=False)  # fmt: skip
        sent, _, used, senders = copy_engine.last_stats
        workers = max(1, min(threads, sent // 3))
        streams = copy_engine.LANES if lay is None else max(copy_engine.LAYER_LANES, workers)
        assert used == min(streams, sent), (copy_engine.last_stats, lay)
        assert senders == min(workers, used), (copy_engine.last_stats, lay)
        stream.synchronize()  # the stream alone: it must have waited for the copies
        assert got == "copy_engine" and bits_equal(pool.buffer, want), ("save", layout, lay)

        pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
        dst = DeviceKV.from_caches(geo, *_layout(layout, geo, num_slots))
        ref = DeviceKV.from_caches(geo, *device_caches(geo, num_slots, poisoned=True))
        load_ref(pool.buffer, ref_ids, ref, ref_slots, layer=lay)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)
            for g in dst.layers:
                for t in g:
                    poison_(t)  # runs after the sleep: the load must come after it
            got = load(pool.buffer, ids, dst, slots, layer=lay, backend="copy_engine",
                       validate=False)  # fmt: skip
            after = [[t.clone() for t in g] for g in dst.layers]  # must see the loaded rows
        stream.synchronize()
        assert got == "copy_engine", lay
        for g_after, g_ref in zip(after, ref.layers):
            assert all(bits_equal(a, b) for a, b in zip(g_after, g_ref)), ("load", layout, lay)


def test_copy_engine_refused_falls_back_to_the_kernel_with_one_log_line(monkeypatch, caplog):
    require_copy_engine()
    lib = jit.load_library()
    monkeypatch.setattr(copy_engine, "_failed", {})
    calls = []
    monkeypatch.setattr(lib, "pagekv_ce_page_transfer", lambda *a: calls.append(a) or 1)
    geo = KVGeometry(3, 16, 2, 128, "bf16")
    pool = HostPagePool(geo, 6)
    ids = torch.tensor([4, 0, 2])
    slots = torch.randperm(100)[:48].view(3, 16)
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        for _ in range(2):
            pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
            dst = device_caches(geo, 100, poisoned=True)
            ref = [d.clone() for d in dst]
            load_ref(pool.buffer, ids, DeviceKV.from_caches(geo, *ref), slots)
            got = load(pool.buffer, ids, DeviceKV.from_caches(geo, *dst), slots,
                       backend="copy_engine")  # fmt: skip
            torch.cuda.synchronize()
            assert got == "kernel" and all(bits_equal(a, b) for a, b in zip(dst, ref))
    lines = [r.getMessage() for r in caplog.records if "copy-engine" in r.getMessage()]
    assert len(calls) == 1 and len(lines) == 1, lines
    assert "cudaError 1" in lines[0] and "kernel" in lines[0]
    assert not copy_engine.supported(0)


def test_vllm_layout_and_per_layer_lists():
    geo = KVGeometry(3, 16, 2, 128, "fp16")
    layers = [random_tensor((2, 20, 16, 2, 128), geo.dtype, DEV) for _ in range(3)]
    kv = DeviceKV.from_vllm(geo, layers)
    pool = HostPagePool(geo, 4)
    slots = torch.randperm(320)[:64].view(4, 16).to(DEV)
    want = poison_(pool.buffer.clone())
    save_ref(kv, slots, want, [2, 0, 3, 1])
    poison_(pool.buffer)
    save(kv, slots, pool.buffer, torch.tensor([2, 0, 3, 1], device=DEV))
    torch.cuda.synchronize()
    assert bits_equal(pool.buffer, want)
    out = [poison_(torch.empty_like(t)) for t in layers]
    load(pool.buffer, [2, 0, 3, 1], DeviceKV.from_vllm(geo, out), slots)
    torch.cuda.synchronize()
    flat = slots.flatten().long()
    for src, dst in zip(layers, out):
        assert bits_equal(dst.flatten(1, 2)[:, flat], src.flatten(1, 2)[:, flat])


def test_pool_registered_in_chunks(monkeypatch):
    geo = KVGeometry(2, 16, 8, 128, "bf16")  # 256 KiB pages
    monkeypatch.setattr(host_pool, "_REGISTER_CHUNK_BYTES", 3 * geo.page_bytes)
    pool = HostPagePool(geo, 10)
    assert pool.is_pinned and len(pool._regions) == 4
    kv = DeviceKV.from_caches(geo, *device_caches(geo, 160))
    slots = torch.randperm(160).view(10, 16)
    save(kv, slots.to(DEV), pool.buffer, torch.arange(10, device=DEV))  # spans chunk borders
    torch.cuda.synchronize()
    want = poison_(pool.buffer.clone())
    save_ref(kv, slots, want, list(range(10)))
    assert bits_equal(pool.buffer, want)
    pool.close()
    assert not pool.is_pinned


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("where", ["d2d", "d2h", "h2d"])
def test_copy_slots_matches_reference(dtype, mla, where):
    geo = geometry(dtype, mla, 2048 if not mla else 1152, 16)
    src_dev = "cpu" if where == "h2d" else DEV
    dst_dev = "cpu" if where == "d2h" else DEV
    shape = (geo.num_layers, 500, *geo.device_layer_shape)
    src = [random_tensor(shape, dtype).to(src_dev) for _ in range(geo.num_kv)]
    if src_dev == "cpu":
        src = [t.pin_memory() for t in src]
    dst = [poison_(torch.empty(shape, dtype=dtype, device=dst_dev, pin_memory=dst_dev == "cpu"))
           for _ in range(geo.num_kv)]  # fmt: skip
    ref = [d.clone() for d in dst]
    s = torch.randperm(500)[:300]
    d = torch.randperm(500)[:300]
    s[::7] = -1
    d[::11] = -1
    layer = random.choice([None, 1])
    copy_slots_ref(
        DeviceKV.from_caches(geo, *src), s, DeviceKV.from_caches(geo, *ref), d, layer=layer
    )
    out = copy_slots(DeviceKV.from_caches(geo, *src), s.to(DEV), DeviceKV.from_caches(geo, *dst),
                     d.to(DEV), layer=layer)  # fmt: skip
    torch.cuda.synchronize()
    assert out == "kernel" and all(bits_equal(a, b) for a, b in zip(dst, ref))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("row_bytes", [4, 12, 256, 1152, 2048, 4096])
@pytest.mark.parametrize("tokens", [1, 7, 64, 3000])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_store_kv_matches_index_put(dtype, row_bytes, tokens, index_dtype):
    elems = row_bytes // dtype.itemsize
    if elems == 0 or row_bytes % dtype.itemsize:
        pytest.skip("row is not a whole number of elements")
    slots = 4096
    # k and v as strided views of one fused output, as engines produce them
    fused = random_tensor((tokens, 3, elems), dtype, DEV)
    k, v = fused[:, 1], fused[:, 2]
    kc, vc = (poison_(torch.empty(slots, elems, dtype=dtype, device=DEV)) for _ in "kv")
    want_k, want_v = kc.clone(), vc.clone()
    loc = torch.randperm(slots, device=DEV)[:tokens].to(index_dtype)
    loc[::5] = -1
    keep = loc >= 0
    store_kv_ref(k[keep], v[keep], want_k, want_v, loc[keep])
    assert store_kv(k, v, kc, vc, loc) == "kernel"
    torch.cuda.synchronize()
    assert bits_equal(kc, want_k) and bits_equal(vc, want_v)
    # the cached-plan hot path (validate=False): first call makes the plan, then reuses it
    for _ in range(2):
        fused.copy_(random_tensor(fused.shape, dtype, DEV))
        store_kv_ref(k[keep], v[keep], want_k, want_v, loc[keep])
        store_kv(k, v, kc, vc, loc, validate=False)
        torch.cuda.synchronize()
        assert bits_equal(kc, want_k) and bits_equal(vc, want_v)
    latent_cache = poison_(torch.empty(slots, elems, dtype=dtype, device=DEV))
    want = latent_cache.clone()
    store_kv_ref(k[keep], None, want, None, loc[keep])
    store_kv(k, None, latent_cache, None, loc)
    torch.cuda.synchronize()
    assert bits_equal(latent_cache, want)


def test_store_kv_plan_with_misaligned_and_new_views():
    rows = random_tensor((65, 8, 128), torch.bfloat16, DEV)
    kc, vc = (poison_(torch.empty(256, 8, 128, dtype=torch.bfloat16, device=DEV)) for _ in "kv")
    loc = torch.randperm(256, device=DEV)[:64]
    store_kv(rows[:64], rows[1:], kc, vc, loc, validate=False)  # aligned: 16-byte plan
    odd = rows.view(-1)[2:].view(-1)[: 64 * 1024].view(64, 8, 128)  # 4-byte aligned view
    with pytest.raises(ValueError):
        store_kv(odd, odd, kc, vc, loc[:10], validate=False)  # token counts differ
    store_kv(odd, odd, kc, vc, loc, validate=False)
    torch.cuda.synchronize()
    assert bits_equal(kc[loc], odd) and bits_equal(vc[loc], odd)


def test_cuda_graph_capture_and_replay():
    geo = KVGeometry(4, 16, 2, 128, "bf16")
    kv = DeviceKV.from_caches(geo, *device_caches(geo, 512, poisoned=True))
    pool = HostPagePool(geo, 8)
    ids = torch.tensor([5, 2, 7], device=DEV)
    slots = torch.randperm(400, device=DEV)[:48].view(3, 16)  # clear of loc's 400..415
    k_new = torch.empty(16, 2, 128, dtype=geo.dtype, device=DEV)
    v_new = torch.empty_like(k_new)
    loc = torch.arange(400, 416, device=DEV)
    # Warm up outside capture (builds the kernels, caches the pointer table).
    load(pool.buffer, ids, kv, slots, validate=False)
    store_kv(k_new, v_new, kv.layers[0][0].view(512, 2, 128), kv.layers[1][0].view(512, 2, 128),
             loc, validate=False)  # fmt: skip
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for layer in range(geo.num_layers):
            load(pool.buffer, ids, kv, slots, layer=layer, validate=False)
        store_kv(k_new, v_new, kv.layers[0][0].view(512, 2, 128),
                 kv.layers[1][0].view(512, 2, 128), loc, validate=False)  # fmt: skip
    for _ in range(2):  # replay with fresh data in the captured buffers
        pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
        k_new.copy_(random_tensor(k_new.shape, geo.dtype, DEV))
        v_new.copy_(random_tensor(v_new.shape, geo.dtype, DEV))
        for group in kv.layers:
            for t in group:
                poison_(t)
        ref = device_caches(geo, 512, poisoned=True)
        ref_kv = DeviceKV.from_caches(geo, *ref)
        load_ref(pool.buffer, ids, ref_kv, slots)
        store_kv_ref(k_new, v_new, ref[0][0], ref[1][0], loc)
        graph.replay()
        torch.cuda.synchronize()
        got = [torch.stack(list(g)).view(geo.num_layers, 512, 2, 128) for g in kv.layers]
        assert all(bits_equal(a, b) for a, b in zip(got, ref))
        assert (as_bits(got[0][1, 400:416]).view(torch.uint8) == 0xA5).all()  # layer 1 untouched
