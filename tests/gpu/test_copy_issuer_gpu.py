"""The connector's copy-engine issuer (pagekv/connector/copy_issuer.py) on the GPU: a transfer
the table gives the copy engine is enqueued by the issuer's thread, not the caller's; its copies
come after the caller's stream's earlier work; consumers that wait on its completion see every
byte (destinations poisoned first, compared with the bytes saved); a transfer that raises fails
its completion and not the next one; close() drains."""

import logging
import threading

import pytest
import torch

from pagekv.connector import KeyNamespace, KVConnector
from pagekv.connector.copy_issuer import CopyFailed, CopyIssuer
from pagekv.connector.host_pool import HostPagePool
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch
from pagekv.kernels import (
    DeviceKV,
    calibrate,
    choose_backend,
    copy_engine,
    copy_table,
    jit,
    load_ref,
    ops,
    save,
    save_ref,
    transfer_layers,
)
from pagekv.store.launch import NodeProcess
from tests.gpu.test_kernels_gpu import device_caches, geometry, require_copy_engine
from tests.helpers import bits_equal, poison_, random_tensor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", 0)


def setup(n_pages=8, page_size=16):
    geo = geometry(torch.bfloat16, False, 2048, page_size, num_layers=4)
    num_slots = 3 * n_pages * page_size
    caches = device_caches(geo, num_slots)
    kv = DeviceKV.from_caches(geo, *caches)
    pool = HostPagePool(geo, n_pages)
    perm = torch.randperm(num_slots)
    a, b = perm[: n_pages * page_size], perm[n_pages * page_size : 2 * n_pages * page_size]
    return geo, caches, kv, pool, a.view(n_pages, page_size), b.view(n_pages, page_size)


def recorded(n=1, *, enqueued=None, progress=None):
    """A job of ``n`` empty transfers: ``n`` events recorded on the issuer's stream (handed
    over when it returns)."""
    events = [torch.cuda.Event() for _ in range(n)]
    for event in events:
        event.record()
    return "copy_engine", events


class Gate:
    """A job that holds the issuer's thread until opened."""

    def __init__(self):
        self.entered, self.opened = threading.Event(), threading.Event()

    def __call__(self, *, enqueued, progress):
        self.entered.set()
        assert self.opened.wait(30)
        return recorded()


def test_the_caller_returns_before_its_copies_are_enqueued_and_waiters_see_every_byte(
    monkeypatch,
):
    require_copy_engine()
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "copy_engine")
    geo, caches, kv, pool, a, b = setup()
    want = [t[:, a.reshape(-1)].clone() for t in caches]
    assert save(kv, a, pool.buffer, list(range(8))) == "copy_engine"  # host pages := slots A
    for t in caches:
        t[:, b.reshape(-1)] = poison_(torch.empty_like(t[:, b.reshape(-1)]))
    issuer = CopyIssuer(DEV)
    try:
        gate = Gate()
        issuer.submit(gate, 1)
        assert gate.entered.wait(30)
        out = launch(True, kv, pool.buffer, list(range(8)), b, IndexStaging(1 << 16), issuer,
                     layers=range(geo.num_layers))  # fmt: skip
        assert out.backend == "copy_engine" and len(out.events) == geo.num_layers
        assert not any(e.enqueued or e.query() for e in out.events)  # the issuer is held
        waited = threading.Event()

        def consumer():  # a stream that waits on the last layer: the host waits for the enqueue
            out.events[-1].wait(torch.cuda.current_stream(DEV))
            waited.set()

        t = threading.Thread(target=consumer)
        t.start()
        assert not waited.wait(0.2)  # bounded: it must still be waiting, the gate is closed
        gate.opened.set()
        t.join(30)
        assert waited.is_set()
        for layer in range(geo.num_layers):
            out.events[layer].wait()
        for t_, w in zip(caches, want):
            assert bits_equal(t_[:, b.reshape(-1)], w)
        assert issuer.counters["transfers"] == 1 + geo.num_layers
        assert issuer.counters["kernel_fallbacks"] == 0
    finally:
        issuer.close()


def test_copies_come_after_the_callers_earlier_work(monkeypatch):
    """The caller's stream fills the host pages late (a save behind a long sleep); the issuer's
    load from those pages must carry the new bytes, not what the pages held before."""
    require_copy_engine()
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "copy_engine")
    _, caches, kv, pool, a, b = setup()
    poison_(pool.buffer)  # stale bytes the load must never carry
    want = [t[:, a.reshape(-1)].clone() for t in caches]
    for t in caches:
        t[:, b.reshape(-1)] = 0
    issuer = CopyIssuer(DEV)
    try:
        side = torch.cuda.Stream(DEV)
        side.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the save
            save(kv, a, pool.buffer, list(range(8)), backend="kernel")
            out = launch(True, kv, pool.buffer, list(range(8)), b, IndexStaging(1 << 16), issuer)
        assert out.backend == "copy_engine"
        out.events[0].synchronize()
        for t_, w in zip(caches, want):
            assert bits_equal(t_[:, b.reshape(-1)], w)
    finally:
        issuer.close()


def test_a_transfer_that_raises_fails_its_completion_not_the_next():
    issuer = CopyIssuer(DEV)
    try:

        def broken(**_):
            raise RuntimeError("cudaErrorLaunchFailure (a stand-in)")

        first = issuer.submit(broken, 2)
        second = issuer.submit(lambda **_: recorded(2), 2)
        short = issuer.submit(lambda **_: recorded(1), 2)  # a job that records too few events
        for failed in first:
            with pytest.raises(CopyFailed, match="stand-in"):
                failed.wait()
            torch.cuda.synchronize()  # query() says so once the stream passed the failed job
            with pytest.raises(CopyFailed):
                failed.query()
        for ok in second:
            ok.synchronize()
            assert ok.query()
        with pytest.raises(CopyFailed, match="1 events for 2"):
            short[1].synchronize()
        assert issuer.counters["failed"] == 4 and issuer.counters["transfers"] == 2
    finally:
        issuer.close()
    with pytest.raises(RuntimeError, match="closed"):
        issuer.submit(recorded, 1)


def test_each_transfer_completes_as_soon_as_its_event_is_handed_over():
    """A consumer of transfer 0 waits only until the job has enqueued it, not for the job's end;
    a job that raises after handing over transfer 0 fails only the transfers after it."""
    issuer = CopyIssuer(DEV)
    gate, raised = threading.Event(), threading.Event()

    def two(*, enqueued, progress, fail=False):
        events = [torch.cuda.Event() for _ in range(2)]
        events[0].record()
        enqueued(events[:1])
        assert gate.wait(30)
        if fail:
            raise RuntimeError("cudaErrorLaunchFailure (a stand-in)")
        events[1].record()
        return "copy_engine", events

    try:
        done = issuer.submit(two, 2)
        done[0].synchronize()  # handed over while the job is held at the gate
        assert done[0].query() and not done[1].enqueued
        gate.set()
        done[1].synchronize()
        gate.clear()
        half = issuer.submit(lambda **kw: raised.set() or two(**kw, fail=True), 2)
        half[0].synchronize()
        assert raised.is_set() and not half[1].enqueued
        gate.set()
        with pytest.raises(CopyFailed, match="stand-in"):
            half[1].wait()
        assert half[0].query()
        assert issuer.counters["transfers"] == 3 and issuer.counters["failed"] == 1
    finally:
        gate.set()
        issuer.close()


def test_layers_are_handed_over_during_the_library_call_while_python_holds_the_gil(monkeypatch):
    """A consumer that runs Python without a pause (an engine's scheduler thread, holding the
    GIL but for the switch interval) is handed the issuer's layers as the library enqueues them:
    the second-to-last entry is enqueued while the job has not returned (the issuer's thread
    cannot take the GIL back from the spinning one before then: the last entry, all layers,
    takes milliseconds to enqueue), and each layer's bytes are there once its completion is
    waited on. Before, the layers were handed over only between library calls, each return a
    wait for the GIL."""
    require_copy_engine()
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "copy_engine")
    geo = geometry(torch.bfloat16, False, 512, 16, num_layers=6)
    n_pages = 512  # whole-page runs (8 KiB): 1,024 copies a layer
    pool = HostPagePool(geo, n_pages)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    caches = device_caches(geo, n_pages * 16)
    kv = DeviceKV.from_caches(geo, *caches)
    slots = torch.randperm(n_pages)[:, None] * 16 + torch.arange(16)
    ids = torch.randperm(n_pages)
    for t in caches:
        poison_(t)
    want = [t.clone() for t in caches]
    load_ref(pool.buffer, ids, DeviceKV.from_caches(geo, *want), slots)
    layers = [*range(geo.num_layers), None]
    returned = threading.Event()

    def job(**handover):
        out = transfer_layers(True, pool.buffer, ids, kv, slots, layers, backend="copy_engine",
                              **handover)  # fmt: skip
        returned.set()
        return out

    issuer = CopyIssuer(DEV)
    try:
        done = issuer.submit(job, len(layers))
        while True:  # pure Python: the GIL is released only when the interpreter forces it
            had_returned = returned.is_set()
            if done[-2].enqueued:
                break
        assert not had_returned
        for layer, completion in enumerate(done[:-1]):
            completion.wait()
            for t, w in zip(caches, want):
                assert bits_equal(t[layer], w[layer])
        done[-1].synchronize()
        assert all(bits_equal(t, w) for t, w in zip(caches, want))
        assert issuer.counters["transfers"] == len(layers)
        assert issuer.counters["kernel_fallbacks"] == 0
    finally:
        issuer.close()


def test_close_drains_what_was_queued():
    issuer = CopyIssuer(DEV)
    gate = Gate()
    done = [*issuer.submit(gate, 1), *issuer.submit(recorded, 1)]
    assert gate.entered.wait(30)
    closer = threading.Thread(target=issuer.close)
    closer.start()
    assert not done[1].enqueued
    gate.opened.set()
    closer.join(30)
    assert not closer.is_alive() and all(d.enqueued and d.query() for d in done)


@pytest.fixture(scope="module")
def node():
    n = NodeProcess("--capacity", "1GiB").start()
    yield n
    n.stop()


@pytest.mark.parametrize("engine_waits", [True, False])
def test_connector_layerwise_streaming_and_saves_through_the_issuer(node, monkeypatch,
                                                                    engine_waits):  # fmt: skip
    """The connector's load_async, streaming loads and (with engine_waits=False) saves go to its
    issuer when the copy engine is chosen; every byte lands where the engine waits for it."""
    require_copy_engine()
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "copy_engine")
    geo = geometry(torch.bfloat16, False, 2048, 16, num_layers=4)
    n_pages, n_tok = 6, 6 * 16
    caches = device_caches(geo, 4 * n_tok + 3)
    ns = KeyNamespace(f"issuer-{engine_waits}", geo)
    conn = KVConnector(geo, caches, node.address, host_pages=4 * n_pages, namespace=ns)
    try:
        perm = torch.randperm(4 * n_tok + 3)
        a, c, d = perm[:n_tok], perm[n_tok : 2 * n_tok], perm[2 * n_tok : 3 * n_tok]
        tokens = torch.randint(0, 32000, (n_tok,)).tolist()
        want = [t[:, a].clone() for t in caches]
        for t in caches:
            t[:, torch.cat([c, d])] = poison_(torch.empty_like(t[:, torch.cat([c, d])]))
        saved = conn.save(tokens, a.tolist(), engine_waits=engine_waits)
        assert saved.pages == n_pages
        if not engine_waits:
            torch.cuda.current_stream(DEV).wait_event(saved.event)  # before slots A change
        conn.flush_sync(timeout=30)
        conn.cache.evict(4 * n_pages)  # the loads below come from the store
        handle = conn.prefetch_sync(tokens, timeout_s=30)
        layers = conn.load_async(handle, c.tolist())
        conn.release(handle)
        for layer in range(geo.num_layers):
            layers.wait_layer(layer)
        streamed = conn.prefetch_sync(tokens, device_slots=d.tolist(), timeout_s=30)
        streamed.wait_loaded()
        for t, w in zip(caches, want):
            assert bits_equal(t[:, c], w) and bits_equal(t[:, d], w)
        conn.release(streamed)
        issued = conn._issuer.counters
        assert issued["transfers"] == geo.num_layers + 1 + (not engine_waits), issued
        assert issued["kernel_fallbacks"] == 0
    finally:
        conn.close()


@pytest.mark.parametrize("backend", ["copy_engine", "kernel"])
@pytest.mark.parametrize("layers", [[None], [0, 1, 2, 3], [2, 0]], ids=["all", "each", "some"])
@pytest.mark.parametrize("direction", ["load", "save"])
def test_transfer_layers_matches_the_reference(backend, layers, direction):
    if backend == "copy_engine":
        require_copy_engine()
    geo, caches, kv, pool, a, _ = setup()
    ids = torch.randperm(8)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    if direction == "load":
        for t in caches:
            poison_(t)
        want = [t.clone() for t in caches]
        for layer in layers:
            load_ref(pool.buffer, ids, DeviceKV.from_caches(geo, *want), a, layer=layer)
    else:
        poison_(pool.buffer)
        want = pool.buffer.clone()
        for layer in layers:
            save_ref(kv, a, want, ids, layer=layer)
    used, events = transfer_layers(direction == "load", pool.buffer, ids, kv, a, layers,
                                   backend=backend)  # fmt: skip
    assert used == backend and len(events) == len(layers)
    events[-1].synchronize()
    if direction == "load":
        assert all(bits_equal(t, w) for t, w in zip(caches, want))
    else:
        assert bits_equal(pool.buffer, want)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("direction", ["load", "save"])
@pytest.mark.parametrize(  # CUDA index tensors take the kernel (reading them would sync)
    ("backend", "where"), [("kernel", "cpu"), ("kernel", "cuda"), ("copy_engine", "cpu")]
)
@pytest.mark.parametrize("handover", [None, "callback", "progress"])
@pytest.mark.parametrize("layers", [[3, None, 0, 3, 4], [3, 0, 4, 1, 3]], ids=["mixed", "layers"])
def test_layers_in_one_call_match_the_reference(backend, where, index_dtype, mla, direction,
                                                handover, layers, monkeypatch):  # fmt: skip
    """The kernel's and the copy engine's layer-by-layer transfer: every entry (a layer, all
    layers, a layer twice) against the reference, with out-of-range pages and slots skipped; a
    reader waiting on event i sees the layers of entries 0..i written; the whole ordered after
    the stream's earlier work. With an ``enqueued`` callback (as the issuer passes), the events
    are handed over as they are recorded: the first entry, then the rest. With a progress count
    too (as the issuer passes where the library is loaded) the copy engine takes its events,
    issues every entry in one call (after waiting on the fork: the stream's earlier work) and
    counts each, its events made by the library; the kernel does not count. A helper thread is
    worth every copy here: on the copy engine an all-layer entry's copies go out from two
    threads, and entries of one layer each are spread over two (each its own stream)."""
    if backend == "copy_engine":
        require_copy_engine()
    monkeypatch.setattr(copy_engine, "ENQUEUE_THREAD_COPIES", 1)
    geo = geometry(torch.bfloat16, mla, 1152 if mla else 512, 16, num_layers=5)
    n_pages, num_slots = 12, 12 * 16 + 30
    pool = HostPagePool(geo, n_pages + 2)
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    caches = device_caches(geo, num_slots)
    kv = DeviceKV.from_caches(geo, *caches)
    ids = torch.randperm(n_pages + 2)[:n_pages]
    ids[3] = n_pages + 9  # out of range: skipped whole
    slots = torch.randperm(num_slots)[: n_pages * 16].view(n_pages, 16)
    slots[5, 2:7] = num_slots + 3  # out of range: skipped tokens
    ref_ids, ref_slots = ids.clone(), slots.clone()
    ref_ids[3] = sorted(set(range(n_pages + 2)) - set(ids.tolist()))[0]
    ref_slots[3] = -1
    ref_slots[ref_slots >= num_slots] = -1
    if direction == "load":
        for t in caches:
            poison_(t)
        want = [t.clone() for t in caches]
        load_ref(pool.buffer, ref_ids, DeviceKV.from_caches(geo, *want), ref_slots)
    else:
        poison_(pool.buffer)
        want = pool.buffer.clone()
        save_ref(kv, ref_slots, want, ref_ids)
    idx = [t.to(index_dtype) for t in (ids, slots)]
    if where == "cuda":
        idx = [t.to(DEV) for t in idx]
    stream = torch.cuda.Stream(DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)  # earlier work: the entries come after it
        seen: list[list[torch.cuda.Event]] = []
        hand = None if handover is None else seen.append
        progress = None
        if handover == "progress":  # the entries come after the fork, waited on by the call
            fork = torch.cuda.Event()
            fork.record()
            progress = copy_engine.Progress(jit.load_library(), jit.library_holding_gil(), DEV,
                                            len(layers), fork)  # fmt: skip
        used, events = transfer_layers(direction == "load", pool.buffer, idx[0], kv, idx[1],
                                       layers, backend=backend, enqueued=hand,
                                       progress=progress)  # fmt: skip
    assert used == backend and len(events) == len(layers)
    if backend == "copy_engine" and None not in layers:  # the last call's entries: 4 or 5
        assert copy_engine.last_stats[3] == copy_engine.ENQUEUE_THREADS  # spread over threads
    if handover is not None:
        one_call = backend == "copy_engine" and progress is not None
        assert [len(part) for part in seen] == ([len(layers)] if one_call else [1, len(layers)])
        assert all(part == events[: len(part)] for part in seen)
    if progress is not None:
        assert events is progress.events
        assert progress.count() == (len(layers) if backend == "copy_engine" else 0)
    snaps = []
    for event in events:  # on streams of their own, each right after its event
        side = torch.cuda.Stream(DEV)
        side.wait_event(event)
        with torch.cuda.stream(side):
            if direction == "load":
                snaps.append([t.clone() for t in caches])
            else:
                snaps.append(pool.buffer.to(DEV, non_blocking=True))
    torch.cuda.synchronize()
    covered: set[int] = set()
    for i, (layer, snap) in enumerate(zip(layers, snaps)):
        covered |= set(range(geo.num_layers)) if layer is None else {layer}
        for lay in sorted(covered):
            if direction == "load":
                assert all(bits_equal(a[lay], b[lay]) for a, b in zip(snap, want)), (i, lay)
            else:
                assert bits_equal(snap.cpu()[:, lay], want[:, lay]), (i, lay)


def test_transfer_layers_refused_by_the_driver_runs_on_the_kernel(monkeypatch, caplog):
    require_copy_engine()
    lib = jit.load_library()
    monkeypatch.setattr(copy_engine, "_failed", {})
    calls = []
    monkeypatch.setattr(lib, "pagekv_ce_page_transfer_layers", lambda *a: calls.append(a) or 1)
    geo, caches, kv, pool, a, _ = setup()
    pool.buffer.copy_(random_tensor(pool.buffer.shape, geo.dtype))
    for t in caches:
        poison_(t)
    want = [t.clone() for t in caches]
    load_ref(pool.buffer, torch.arange(8), DeviceKV.from_caches(geo, *want), a)
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        every = list(range(geo.num_layers))
        seen = []
        used, events = transfer_layers(True, pool.buffer, list(range(8)), kv, a, every,
                                       backend="copy_engine", enqueued=seen.append)  # fmt: skip
    events[-1].synchronize()
    assert used == "kernel" and len(calls) == 1 and not copy_engine.supported(0)
    assert [len(part) for part in seen] == [1, geo.num_layers]  # handed over by the kernel
    assert len([r for r in caplog.records if "copy-engine" in r.getMessage()]) == 1
    assert all(bits_equal(t, w) for t, w in zip(caches, want))


def test_auto_never_gives_the_copy_engine_runs_under_its_floor(monkeypatch):
    """64 KiB on the caller's thread, 32 KiB where the issuer enqueues it (deferred)."""
    require_copy_engine()
    monkeypatch.delenv("PAGEKV_COPY_BACKEND", raising=False)  # the default: auto
    table = calibrate(0)
    allowed = ["kernel", "direct", "copy_engine", "pitched"]  # all layers, at one pitch
    issuer_only = ["split"]  # the kernel on 2 blocks beside the pitched copy: deferred only
    for page_size in (8, 16, 128):  # 16 KiB, 32 KiB and 256 KiB runs
        geo, _, kv, _, _, _ = setup(n_pages=8, page_size=page_size)
        a = torch.randperm(8)[:, None] * page_size + torch.arange(page_size)  # whole-page runs
        run = page_size * geo.item_bytes
        total = 8 * page_size * geo.num_layers * geo.num_kv * geo.item_bytes
        for deferred in (False, True):
            got = choose_backend(True, kv, list(range(8)), a, deferred=deferred)
            floor = ops.DEFERRED_COPY_ENGINE_MIN_RUN if deferred else ops.COPY_ENGINE_MIN_RUN
            # under its floor the copy engine is not among the candidates
            candidates = [b for b in allowed if run >= floor or b != "copy_engine"]
            candidates += issuer_only if deferred else []
            shape = copy_table.Shape(True, True, float(run), total)
            assert got == table.choose(shape, candidates, deferred)
            assert got != "copy_engine" or run >= floor
