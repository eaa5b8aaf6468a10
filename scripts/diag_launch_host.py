"""Where a transfer call's host time goes (issue 32's one-layer target: from an idle device the
host's time before the first copy counts). For the kernel backend with device indices and
``validate=False`` (what a capturable caller passes), one layer of Llama-3-8B at 4 MiB, and
for a whole layer-by-layer load (``transfer_layers``, CPU indices), prints:

* the median host time per call (the device synchronised every 50 calls, so the driver's
  queue never fills and holds the host; before each layer-by-layer load);
* the pieces a call is made of, each timed alone over the same number of calls, and again
  each right after the host waited for the device (as the first call of the plain timing):
  the checks, the library call with its arguments made beforehand (with no pages: ctypes
  alone; with the real ones: and the launch), ``load()`` with that call a Python no-op (its
  Python alone), and the ceiling's ``copy_`` of the same bytes;
* from an idle device, the device time to the end of each of 3 back-to-back calls, for the
  kernel and for one contiguous copy of the same bytes (what the benchmarks' plain ratio is
  made of);
* cProfile's top entries by own time.

    python scripts/diag_launch_host.py [--calls 2000] [--save]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from _bench_util import parse_args, write_result
from bench_kernels import GEOMETRIES, Setup

from pagekv.connector import KVGeometry
from pagekv.kernels import load, ops, transfer_layers
from pagekv.kernels.jit import load_library
from pagekv.kernels.layout import check_host, check_page_ids, check_slots, device_indices

LAYER = 5


def host_us(fn: Callable[[], object], calls: int, every: int = 50, wait: bool = False) -> float:
    """Median host microseconds of one call of ``fn``, the device synchronised every
    ``every`` calls (with ``wait``, after ~0.1 ms of GPU work: the host has waited)."""
    times = []
    for i in range(calls):
        if i % every == 0:
            if wait:
                torch.cuda._sleep(200_000)
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 2)


def profile(fn: Callable[[], object], calls: int, every: int = 50, top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        if i % every == 0:
            torch.cuda.synchronize()
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def timeline(fn: Callable[[], object], reps: int = 21, inner: int = 3) -> list[float]:
    """Median device microseconds from an event recorded on the idle device to the end of the
    first of ``inner`` back-to-back calls, then of each next call (the bench's plain timing,
    taken apart)."""
    spans: list[list[float]] = [[] for _ in range(inner)]
    for _ in range(reps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(inner + 1)]
        torch.cuda.synchronize()
        events[0].record()
        for k in range(inner):
            fn()
            events[k + 1].record()
        events[-1].synchronize()
        for k in range(inner):
            spans[k].append(events[k].elapsed_time(events[k + 1]) * 1e3)
    return [round(statistics.median(span), 1) for span in spans]


class _NoLaunch:
    """The kernel library with ``pagekv_page_plan_transfer`` a Python no-op."""

    def __init__(self, lib: object) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    @staticmethod
    def pagekv_page_plan_transfer(*args: object) -> int:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=4, help="one layer's bytes per call")
    args = parse_args(ap)
    dev = torch.device("cuda", 0)
    geo = KVGeometry(page_size=16, **GEOMETRIES["llama3-8b"])
    per_page = geo.page_bytes // geo.num_layers
    n = (args.mib << 20) // per_page
    raw = torch.empty(geo.page_bytes * n, dtype=torch.uint8).pin_memory()
    st = Setup(raw, geo, raw.numel())
    ids, slots = st.ids[:n], st.slots[:n]
    kv, host = st.kv, st.host

    def one_layer() -> object:
        return load(host, ids, kv, slots, layer=LAYER, backend="kernel", validate=False)

    def layerwise() -> object:
        return transfer_layers(
            True,
            host,
            st.ids_cpu[:n],
            kv,
            st.slots_cpu[:n],
            list(range(geo.num_layers)),
            backend="kernel",
        )

    pieces: dict[str, Callable[[], object]] = {
        "load(): one layer, kernel": one_layer,
        "check_host": lambda: check_host(geo, host),
        "check_page_ids (no values)": lambda: check_page_ids(
            ids, host.shape[0], unique=False, check_values=False
        ),
        "check_slots (no values)": lambda: check_slots(
            slots, n, geo.page_size, kv.num_slots, check_values=False
        ),
        "host.is_pinned()": host.is_pinned,
        "host.device == dev": lambda: host.device == dev,
        "kv.device": lambda: kv.device,
        "device_indices(ids)": lambda: device_indices(ids, dev),
        "current_stream": lambda: ops.current_stream(0),
        "_device_address(host)": lambda: ops._device_address(host, dev),
        "_launch_shape": lambda: ops._launch_shape(True, kv, host.data_ptr()),
        "kv.page_plan": lambda: kv.page_plan,
        "_plan_args": lambda: ops._plan_args(
            True, kv, host.data_ptr(), host.shape[0], ids, slots, ops.UNROLL_LOAD
        ),
    }
    # the library call alone: its arguments made beforehand, with no pages (ctypes converts
    # them and the entry returns before any CUDA call) and with the real ones (and the launch)
    lib = load_library()
    width, unroll, threads = ops._launch_shape(True, kv, host.data_ptr())
    call = [*ops._plan_args(True, kv, host.data_ptr(), host.shape[0], ids, slots, unroll),
            LAYER, width, ops.LAYER_LOAD_BLOCKS, threads, ops.current_stream(0)]  # fmt: skip
    no_pages = list(call)
    no_pages[6] = 0
    dev_flat = torch.empty(n * per_page, dtype=torch.uint8, device=dev)
    host_flat = raw[: n * per_page]
    pieces["library call, no pages (ctypes alone)"] = lambda: lib.pagekv_page_plan_transfer(
        *no_pages
    )
    pieces["library call and launch"] = lambda: lib.pagekv_page_plan_transfer(*call)
    pieces["copy_ of the same bytes (the ceiling's call)"] = lambda: dev_flat.copy_(
        host_flat, non_blocking=True
    )
    for _ in range(3):
        one_layer()
        layerwise()
    torch.cuda.synchronize()
    result: dict = {"calls": args.calls, "mib": args.mib, "us": {}}
    result["us_after_a_wait"] = {}
    for name, fn in pieces.items():
        result["us"][name] = host_us(fn, args.calls)
        after = result["us_after_a_wait"][name] = host_us(fn, args.calls // 5, every=1, wait=True)
        print(f"{name:44s} {result['us'][name]:8.2f} us, {after:8.2f} after a device wait",
              flush=True)  # fmt: skip
    # load()'s Python alone: the same call with a library whose entry launches nothing
    name = "load(), the library call a no-op (Python alone)"
    ops.load_library = lambda: _NoLaunch(lib)
    try:
        result["us"][name] = host_us(one_layer, args.calls)
        result["us_after_a_wait"][name] = host_us(one_layer, args.calls // 5, every=1, wait=True)
    finally:
        ops.load_library = load_library
    print(f"{name:44s} {result['us'][name]:8.2f} us, {result['us_after_a_wait'][name]:8.2f} "
          "after a device wait", flush=True)  # fmt: skip
    plain = {
        "copy": lambda: dev_flat.copy_(host_flat, non_blocking=True),
        "kernel": one_layer,
    }
    for name, fn in plain.items():
        result[f"timeline_us_{name}"] = timeline(fn)
        print(f"from idle, each of 3 calls, device us: {name} {result[f'timeline_us_{name}']}")
    key = "transfer_layers: 32 layers, CPU indices"
    result["us"][key] = host_us(layerwise, args.calls // 20, every=1)
    print(f"{key:32s} {result['us'][key]:8.2f} us", flush=True)
    result["profile_one_layer"] = profile(one_layer, args.calls)
    result["profile_layerwise"] = profile(layerwise, args.calls // 20, every=1)
    print(result["profile_one_layer"])
    print(result["profile_layerwise"])
    print(f"wrote {write_result('diag_launch_host', result)}")


if __name__ == "__main__":
    main()
