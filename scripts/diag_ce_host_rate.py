"""Why the copy engine's host rate drops beside a decode (issue 32, GPU): the host time per
copy of one layer-by-layer copy-engine load (Llama-3-8B, 16-token pages: 32 KiB runs, all 32
layers in one library call, issued from a thread of its own on a side stream, as the
connector's issuer does), while the main thread does one of:

* ``idle``: waits for the issuing thread (``join``);
* ``gil``: a pure-Python loop (takes the GIL between bytecodes, no CUDA call); ``gil_pre``: the
  same, the load's events created beforehand and the library called directly (no torch call on
  the issuing thread); ``gil_fast``: ``gil`` with a 0.1 ms GIL switch interval (5 ms default);
* ``sync``: replays a decode-step graph and synchronises its stream after each replay;
* ``item``: replays it and reads one value back (``.item()``: a D2H copy and a wait), as an
  engine's sampler does;
* ``poll``: replays it and polls an event, ``time.sleep(0)`` between polls;
* ``burst``: 48 replays back to back, then ``.tolist()`` of a device tensor (the reference
  engine's graph decode: one host sync at the end); ``burst_sync``: the same with a stream
  synchronize before the ``.tolist()``.

Reports per mode the median over rounds of the issuing call's host µs per copy, and the load's
GB/s (call start to its last event's completion).

    python scripts/diag_ce_host_rate.py [--gib 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
from _bench_util import environment, parse_args, write_result
from bench_beside_compute import DecodeStep, Loads

from pagekv.connector import KVGeometry
from pagekv.kernels import copy_engine, transfer_layers
from pagekv.kernels.jit import load_library

GIB = 1 << 30
MODES = ("idle", "gil", "gil_pre", "gil_fast", "sync", "item", "poll", "burst", "burst_sync")


def issue(loads: Loads, out: dict, stream: torch.cuda.Stream, events: list | None) -> None:
    """The load on ``stream``; fills ``out`` with the call's host seconds and the total.
    ``events``: created beforehand (the library call alone, no torch call on this thread)."""
    geo = loads.geo
    layers = list(range(geo.num_layers))
    with torch.cuda.stream(stream):
        t0 = time.perf_counter()
        if events is None:
            used, events = transfer_layers(True, loads.host, loads.ids_cpu, loads.kv,
                                           loads.slots_cpu, layers,
                                           backend="copy_engine")  # fmt: skip
        else:
            used = "copy_engine"
            copy_engine.page_transfer_layers(load_library(), True, loads.host, loads.kv,
                                             loads.ids_cpu, loads.slots_cpu, layers, events,
                                             stream.cuda_stream)  # fmt: skip
        out["call_s"] = time.perf_counter() - t0
        events[-1].synchronize()
        out["total_s"] = time.perf_counter() - t0
        out["backend"] = used


def beside(mode: str, step: DecodeStep, loads: Loads) -> dict:
    out: dict = {}
    stream = torch.cuda.Stream()
    events = None
    if mode == "gil_pre":
        events = [torch.cuda.Event() for _ in range(loads.geo.num_layers)]
        for event in events:
            event.record(stream)
    thread = threading.Thread(target=issue, args=(loads, out, stream, events))
    steps = 0
    torch.cuda.synchronize()
    interval = sys.getswitchinterval()
    if mode == "gil_fast":
        sys.setswitchinterval(1e-4)
    thread.start()
    while thread.is_alive():
        if mode == "idle":
            thread.join()
        elif mode.startswith("gil"):
            sum(range(1000))
        else:
            with torch.cuda.stream(step.stream):
                if mode.startswith("burst"):  # the reference engine's graph decode
                    for _ in range(48):
                        step.graph.replay()
                    if mode == "burst_sync":
                        step.stream.synchronize()
                    step.out[0].tolist()
                    steps += 48
                    continue
                step.graph.replay()
                if mode == "sync":
                    step.stream.synchronize()
                elif mode == "item":
                    step.out[0, 0].item()
                else:
                    done = torch.cuda.Event()
                    done.record(step.stream)
                    while not done.query():
                        time.sleep(0)
            steps += 1
    thread.join()
    sys.setswitchinterval(interval)
    torch.cuda.synchronize()
    copies = loads.n_pages * loads.geo.num_layers * loads.geo.num_kv
    return dict(us_per_copy=out["call_s"] * 1e6 / copies,
                gbps=loads.nbytes / out["total_s"] / 1e9, steps=steps,
                backend=out["backend"])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = parse_args(ap)
    env = environment()
    if not copy_engine.supported(0):
        raise SystemExit(f"no copy engine here: {copy_engine.disabled_reason(0)}")
    geo = KVGeometry(32, 16, 8, 128, "bf16")
    loads = Loads(int(args.gib * GIB), geo)
    step = DecodeStep()
    beside("idle", step, loads)  # warm-up
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:  # interleaved: the host's drift hits every mode alike
            rounds[mode].append(beside(mode, step, loads))
    result: dict = {"env": env, "args": vars(args), "modes": {}}
    for mode, rs in rounds.items():
        med = {k: round(statistics.median(r[k] for r in rs), 3) for k in ("us_per_copy", "gbps")}
        result["modes"][mode] = {**med, "rounds": rs}
        print(f"{mode:5s}: {med['us_per_copy']:.3f} us/copy, {med['gbps']:.1f} GB/s "
              f"({[round(r['us_per_copy'], 3) for r in rs]})", flush=True)  # fmt: skip
    print(f"wrote {write_result('diag_ce_host_rate', result)}")


if __name__ == "__main__":
    main()
