"""Copy-engine ratio table (GPU): each backend and ``auto``'s choice against the pinned copy.

For the issue's shapes (Llama-3-8B, its TP-8 slice, MLA-576; pages of 16-128 tokens; all-layer
transfers of ``--mib`` and one-layer loads and saves of 4 and 16 MiB) the kernel (device
indices), the copy engine (CPU indices), for all layers the staged backend (CPU indices:
whole pages through a device buffer, :mod:`pagekv.kernels.staged`) and the pitched copy (CPU
indices: a 2-D copy per run of slots and K/V), and ``auto``
(``PAGEKV_COPY_BACKEND=auto``, set here: the connector's path,
:func:`~pagekv.connector.transfer_indices.transfer_indices` on CPU page ids and slots, then
the transfer with what it returned) are timed in the same rounds as a
contiguous pinned copy of the same bytes (the ceiling) and reported as ceiling time / their
time, with the backend ``auto`` took. ``connector``: the same with an issuer thread
(:mod:`pagekv.connector.copy_issuer`), as the connector's ``load_async``, streaming loads and
saves run: the table's choice where the copy engine's host time is not the caller's, each call
followed by the current stream waiting on its completion. ``enqueue_us_*``: the host time of one
call, the device idle at its start (what an engine's step thread would wait; for ``connector``
the call without that wait).

One-layer rows add ``held_*``: the same ratios with a GPU wait enqueued ahead of each timed run,
so that every call is enqueued before the device reaches the first and the device's time alone
counts (the plain ratio includes the first call's host time: ~50 us for the kernel against
~80 us of copy at 4 MiB); and ``layerwise_load``: a whole layer-by-layer load of those pages'
every layer as ``load_async`` runs it (one upload, the layers enqueued together), against a
contiguous copy of its bytes, plain and held.

The ``enqueue`` section: the copy engine's host time against its copies (Llama-3-8B, 16-token
pages: 32 KiB runs, 64 copies a page), for 1 and 16 streams, from 16 MiB to 1 GiB: where the
host time stops growing with the copies' count alone and follows the transfer, the driver's
queue is full and the call waits for the copy engines.

``--setting`` times ``auto`` and ``connector`` (and the layer-by-layer load) under another
``PAGEKV_COPY_BACKEND`` (e.g. ``copy_engine``) instead of the default.

    python scripts/bench_copy_engine.py [--mib 256] [--reps 5] [--only all_layers,one_layer,enqueue]
                                        [--setting auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from _bench_util import environment, overridden, parse_args, write_result
from bench_kernels import GEOMETRIES, Setup, ceiling_fns, gbps, interleaved, ratio

from pagekv.connector import KVGeometry
from pagekv.connector.copy_issuer import CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch, transfer_indices
from pagekv.kernels import calibrate, copy_engine, load, save

BACKENDS = ("kernel", "copy_engine")
HOLD_CYCLES = 40_000_000  # ~20 ms of torch.cuda._sleep on a ~2 GHz GPU


def transfer_fns(st: Setup, n: int, layer: int | None) -> dict[str, Callable[[], str]]:
    """``{backend}_{load,save}``: the kernel with device indices (capturable), the copy
    engine with CPU indices, ``auto`` as the connector runs it (CPU indices in); for one-layer
    transfers also ``kernelcpu``: the kernel handed CPU indices (uploaded through pinned
    memory)."""
    fns = {}
    for backend in BACKENDS:
        ids, slots = (st.ids, st.slots) if backend == "kernel" else (st.ids_cpu, st.slots_cpu)
        fns[f"{backend}_load"] = _call(load, st.host, ids[:n], st.kv, slots[:n], layer=layer,
                                       backend=backend)  # fmt: skip
        fns[f"{backend}_save"] = _call(save, st.kv, slots[:n], st.host, ids[:n], layer=layer,
                                       backend=backend)  # fmt: skip
    if layer is None:  # whole pages through a device staging buffer (CPU indices)
        fns["staged_load"] = _call(load, st.host, st.ids_cpu[:n], st.kv, st.slots_cpu[:n],
                                   layer=None, backend="staged")  # fmt: skip
        fns["staged_save"] = _call(save, st.kv, st.slots_cpu[:n], st.host, st.ids_cpu[:n],
                                   layer=None, backend="staged")  # fmt: skip
        # a 2-D copy per run of slots and K/V (the caches: one tensor per K/V, layers at one
        # pitch), CPU indices
        fns["pitched_load"] = _call(load, st.host, st.ids_cpu[:n], st.kv, st.slots_cpu[:n],
                                    layer=None, backend="pitched")  # fmt: skip
        fns["pitched_save"] = _call(save, st.kv, st.slots_cpu[:n], st.host, st.ids_cpu[:n],
                                    layer=None, backend="pitched")  # fmt: skip
    if layer is not None:  # what a layer-by-layer load with CPU indices pays for the upload
        fns["kernelcpu_load"] = _call(load, st.host, st.ids_cpu[:n], st.kv, st.slots_cpu[:n],
                                      layer=layer, backend="kernel")  # fmt: skip
        fns["kernelcpu_save"] = _call(save, st.kv, st.slots_cpu[:n], st.host, st.ids_cpu[:n],
                                      layer=layer, backend="kernel")  # fmt: skip
    staging = IndexStaging()
    page_ids, slots = st.ids_cpu[:n].tolist(), st.slots_cpu[:n]

    def auto(is_load: bool) -> str:
        idx = transfer_indices(is_load, st.kv, page_ids, slots, staging, layer=layer)
        if is_load:
            return load(st.host, idx.ids, st.kv, idx.slots, layer=layer, backend=idx.backend,
                        validate=False)  # fmt: skip
        return save(st.kv, idx.slots, st.host, idx.ids, layer=layer, backend=idx.backend,
                    validate=False)  # fmt: skip

    fns["auto_load"] = lambda: auto(True)
    fns["auto_save"] = lambda: auto(False)
    fns["connector_load"] = lambda: connector(True, st.kv, st.host, page_ids, slots, (layer,))
    fns["connector_save"] = lambda: connector(False, st.kv, st.host, page_ids, slots, (layer,))
    return fns


_issuer: CopyIssuer | None = None
_staging: IndexStaging | None = None


def _submit(is_load: bool, kv, host, page_ids, slots, layers):
    """The transfer (once per entry of ``layers``) as the connector's load_async, streaming
    loads and saves run it: the table's choice, the copy engine enqueued by the issuer's thread
    (``deferred``)."""
    global _issuer, _staging
    if _issuer is None:
        _issuer = CopyIssuer(torch.device("cuda", torch.cuda.current_device()))
        _staging = IndexStaging()
    return launch(is_load, kv, host, page_ids, slots, _staging, _issuer, layers=layers)


def connector(is_load: bool, kv, host, page_ids, slots, layers) -> str:
    """:func:`_submit`, then the current stream waits on it (the host waits for the enqueue)."""
    out = _submit(is_load, kv, host, page_ids, slots, layers)
    out.events[-1].wait()
    return out.backend


def submit_us(is_load: bool, st: Setup, n: int, layer: int | None, reps: int = 5) -> float:
    """Median host time of the connector's call (the issuer enqueues the copy engine's
    transfers): what the engine's thread spends, the device and the issuer idle at each start."""
    page_ids, slots = st.ids_cpu[:n].tolist(), st.slots_cpu[:n]
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = _submit(is_load, st.kv, st.host, page_ids, slots, (layer,))
        times.append(time.perf_counter() - t)
        out.events[-1].synchronize()
    return round(statistics.median(times) * 1e6, 1)


def _call(fn: Callable[..., str], *args, layer: int | None, backend: str) -> Callable[[], str]:
    return lambda: fn(*args, layer=layer, backend=backend, validate=False)


def device_ms(fn: Callable[[], str], reps: int = 3) -> tuple[float, float]:
    """Median host ms of one call and ms to its completion, the device idle at each start."""
    host, total = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        total.append(time.perf_counter() - t)
    return statistics.median(host) * 1e3, statistics.median(total) * 1e3


def layerwise(raw_host: torch.Tensor, st: Setup, n: int, nbytes: int, reps: int) -> dict:
    """A whole layer-by-layer load of ``n`` pages as ``load_async`` runs it (CPU ids and slots
    in, the table's choice, one upload for all layers, through the issuer), against a
    contiguous copy of the same bytes: plain, and held (device time alone)."""
    page_ids, slots = st.ids_cpu[:n].tolist(), st.slots_cpu[:n]
    layers = range(st.geo.num_layers)
    took = []

    def run() -> str:
        took.append(connector(True, st.kv, st.host, page_ids, slots, layers))
        return took[-1]

    fns = {"ceiling_lw": ceiling_fns(raw_host, nbytes)["ceiling_h2d"], "layerwise_load": run}
    plain, held = interleaved(fns, reps), held_interleaved(fns, reps)
    return {"layerwise_load": ratio(plain, "ceiling_lw", "layerwise_load"),
            "held_layerwise_load": ratio(held, "ceiling_lw", "layerwise_load"),
            "layerwise_backend": took[-1], "layerwise_mib": round(nbytes / 2**20, 1)}  # fmt: skip


def held_interleaved(fns: dict, reps: int, inner: int = 3) -> dict[str, list[float]]:
    """:func:`interleaved`'s rounds, each timing ``inner`` back-to-back calls after a ~20 ms
    GPU wait enqueued ahead of them: the calls are all enqueued before the device reaches the
    first, so the time is the device's alone (what a layer's transfer costs inside a
    layer-by-layer load, whose layers are enqueued together), not the host's."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / inner)
    return times


def enqueue_probe(raw_host: torch.Tensor) -> list[dict]:
    """The copy engine's host time against its copies, for 1 and 16 streams (module doc)."""
    geo = KVGeometry(page_size=16, **GEOMETRIES["llama3-8b"])
    st = Setup(raw_host, geo, raw_host.numel())
    rows = []
    for lanes in (1, 16):
        for mib in (16, 64, 256, 1024):
            n = min(st.n_pages, (mib << 20) // geo.page_bytes)
            fn = _call(load, st.host, st.ids_cpu[:n], st.kv, st.slots_cpu[:n], layer=None,
                       backend="copy_engine")  # fmt: skip
            with overridden(copy_engine, LANES=lanes):
                fn()
                host, total = device_ms(fn)
            copies = n * geo.num_layers * geo.num_kv
            r = dict(lanes=lanes, mib=round(n * geo.page_bytes / 2**20), copies=copies,
                     enqueue_ms=round(host, 2), total_ms=round(total, 2),
                     us_per_copy=round(host * 1e3 / copies, 3),
                     enqueue_share=round(host / total, 3))  # fmt: skip
            print(f"ce enqueue {r}", flush=True)
            rows.append(r)
    return rows


def case(raw_host, name: str, page: int, layer: int | None, nbytes: int, args) -> dict:
    geo = KVGeometry(page_size=page, **GEOMETRIES[name])
    per_page = geo.page_bytes if layer is None else geo.page_bytes // geo.num_layers
    pages = max(1, nbytes // per_page)
    st = Setup(raw_host, geo, min(raw_host.numel(), geo.page_bytes * pages))
    n = max(1, min(st.n_pages, nbytes // per_page))
    moved = n * per_page
    r: dict = dict(geometry=name, page_size=page, layer=layer, mib=round(moved / 2**20, 2),
                   run_kib=page * geo.item_bytes / 1024)  # fmt: skip
    try:
        fns = transfer_fns(st, n, layer)
        for d in ("load", "save"):
            r[f"auto_{d}_backend"] = fns[f"auto_{d}"]()
            r[f"connector_{d}_backend"] = fns[f"connector_{d}"]()
            if fns[f"copy_engine_{d}"]() != "copy_engine":
                raise RuntimeError(f"copy engine {d} ran on the kernel: "
                                   f"{copy_engine.disabled_reason(0)}")  # fmt: skip
        t = interleaved({**ceiling_fns(raw_host, moved), **fns}, args.reps)
        if layer is not None:  # device time alone: the host's enqueue hidden behind a wait
            held = held_interleaved({**ceiling_fns(raw_host, moved), **fns}, args.reps)
            for key in fns:
                ceiling = "ceiling_h2d" if key.endswith("load") else "ceiling_d2h"
                r[f"held_{key}"] = ratio(held, ceiling, key)
            r.update(layerwise(raw_host, st, n, moved * geo.num_layers, args.reps))
        for key, fn in fns.items():
            if key.startswith("connector_"):
                r[f"enqueue_us_{key}"] = submit_us(key.endswith("load"), st, n, layer)
            else:
                r[f"enqueue_us_{key}"] = round(device_ms(fn, reps=5)[0] * 1e3, 1)
    except (AssertionError, RuntimeError) as e:  # recorded, and the table goes on
        r.update(error=str(e)[:300])
        print(f"ce table {r}", flush=True)
        return r
    for key in fns:
        r[key] = ratio(t, "ceiling_h2d" if key.endswith("load") else "ceiling_d2h", key)
    r["ceiling_h2d_gbps"] = round(gbps(moved, statistics.median(t["ceiling_h2d"])), 2)
    r["ceiling_d2h_gbps"] = round(gbps(moved, statistics.median(t["ceiling_d2h"])), 2)
    shown = " ".join(f"{k} {r[k]}" + (f" (held {r['held_' + k]})" if layer is not None else "")
                     for k in fns)  # fmt: skip
    if layer is not None:
        shown += (f" | layer by layer, {r['layerwise_mib']} MiB on {r['layerwise_backend']}: "
                  f"{r['layerwise_load']} (held {r['held_layerwise_load']})")  # fmt: skip
    host = " ".join(f"{k} {r['enqueue_us_' + k]}" for k in fns)
    print(f"ce table {name:14s} page {page:4d} layer {layer} {r['mib']} MiB (runs "
          f"{r['run_kib']} KiB): {shown} | auto took {r['auto_load_backend']}/"
          f"{r['auto_save_backend']}, connector {r['connector_load_backend']}/"
          f"{r['connector_save_backend']} | enqueue us: {host} | ceiling "
          f"{r['ceiling_h2d_gbps']}/{r['ceiling_d2h_gbps']} GB/s", flush=True)  # fmt: skip
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--mib", type=int, default=256, help="all-layer transfer size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--page-sizes", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--layer-mib", type=ints, default=[4, 16])
    ap.add_argument("--only", default="all_layers,one_layer,enqueue")
    ap.add_argument("--setting", default="auto", help="PAGEKV_COPY_BACKEND for auto/connector")
    args = parse_args(ap)
    os.environ["PAGEKV_COPY_BACKEND"] = args.setting  # the default unless asked, whatever the env
    env = environment()
    ce = f"copy engine {copy_engine._support(0)} {copy_engine.disabled_reason(0) or 'ok'}"
    print(f"# {env['device']} torch {env['torch']} cuda {env.get('cuda')} {env['commit']}; {ce}; "
          f"{copy_engine.LANES} streams")  # fmt: skip
    calibrate(0)  # the table auto reads (cached, or measured now on the idle GPU)
    raw_host = torch.empty(max(args.mib << 20, 1 << 30), dtype=torch.uint8).pin_memory()
    raw_host.random_()
    result: dict = {"env": env, "args": vars(args), "lanes": copy_engine.LANES}
    only = args.only.split(",")
    plan = []
    if "all_layers" in only:
        plan += [("all_layers", g, p, None, args.mib) for g in GEOMETRIES for p in args.page_sizes]
    if "one_layer" in only:
        plan += [("one_layer", g, 16, 5, mib) for g in GEOMETRIES for mib in args.layer_mib]
    for section, g, page, layer, mib in plan:
        result.setdefault(section, []).append(case(raw_host, g, page, layer, mib << 20, args))
        path = write_result("bench_copy_engine", result)  # after each case: a cut run keeps them
    if "enqueue" in only and copy_engine.supported(0):
        result["enqueue"] = enqueue_probe(raw_host)
        path = write_result("bench_copy_engine", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
