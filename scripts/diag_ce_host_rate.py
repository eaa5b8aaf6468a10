"""Why the copy engine's host rate drops beside a decode (issue 32, GPU): the host time per
copy of one layer-by-layer copy-engine load (Llama-3-8B, 16-token pages: 32 KiB runs, all 32
layers in one library call, issued from a thread of its own on a side stream, as the
connector's issuer does), while the main thread does one of:

* ``idle``: waits for the issuing thread (``join``);
* ``gil``: a pure-Python loop (takes the GIL between bytecodes, no CUDA call), the load's
  ``transfer_layers`` whole on the issuing thread; ``gil_pre``: the same, but checks, indices
  and events prepared beforehand and the library call alone on the issuing thread (as the
  connector hands a job to its issuer: ``copy_engine_layers``); ``gil_fast``: ``gil`` with a
  0.1 ms GIL switch interval (5 ms by default);
* ``sync``: replays a decode-step graph and synchronises its stream after each replay;
* ``item``: replays it and reads one value back (``.item()``: a D2H copy and a wait), as an
  engine's sampler does;
* ``poll``: replays it and polls an event, ``time.sleep(0)`` between polls;
* ``burst``: 48 replays back to back, then ``.tolist()`` of a device tensor (the reference
  engine's graph decode: one host sync at the end); ``burst_sync``: the same with a stream
  synchronize before the ``.tolist()``.

Reports per mode the median over rounds of the issuing call's host µs per copy, and the load's
GB/s (call start to its last event's completion). Then the calling thread's side: the host ms
of a 32-layer kernel load enqueued through ``launch`` (as ``load_async`` does) beside a
pure-Python thread, its events created on the calling thread or taken from the issuer's pool.

    python scripts/diag_ce_host_rate.py [--gib 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
from _bench_util import environment, parse_args, write_result
from bench_beside_compute import DecodeStep, Loads

from pagekv.connector import KVGeometry
from pagekv.connector.copy_issuer import CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch
from pagekv.kernels import copy_engine, copy_engine_layers, transfer_layers

GIB = 1 << 30
MODES = ("idle", "gil", "gil_pre", "gil_fast", "sync", "item", "poll", "burst", "burst_sync")


def issue(loads: Loads, out: dict, stream: torch.cuda.Stream, prepared: tuple | None) -> None:
    """The load on ``stream``; fills ``out`` with the call's host seconds and the total.
    ``prepared``: (the library call prepared on the submitting thread, its created events), as
    the connector hands it to its issuer; else ``transfer_layers`` whole on this thread."""
    geo = loads.geo
    layers = list(range(geo.num_layers))
    with torch.cuda.stream(stream):
        t0 = time.perf_counter()
        if prepared is None:
            used, events = transfer_layers(True, loads.host, loads.ids_cpu, loads.kv,
                                           loads.slots_cpu, layers,
                                           backend="copy_engine")  # fmt: skip
        else:
            used, events = prepared[0](prepared[1])
        out["call_s"] = time.perf_counter() - t0
        events[-1].synchronize()
        out["total_s"] = time.perf_counter() - t0
        out["backend"] = used


def beside(mode: str, step: DecodeStep, loads: Loads) -> dict:
    out: dict = {}
    stream = torch.cuda.Stream()
    prepared = None
    if mode == "gil_pre":
        layers = list(range(loads.geo.num_layers))
        events = [torch.cuda.Event() for _ in layers]
        for event in events:
            event.record(stream)
        run = copy_engine_layers(True, loads.host, loads.ids_cpu, loads.kv, loads.slots_cpu,
                                 layers)  # fmt: skip
        prepared = (run, events)
    thread = threading.Thread(target=issue, args=(loads, out, stream, prepared))
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


def caller_ms(loads: Loads, pooled: bool, rounds: int) -> list[float]:
    """Host ms of a layer-by-layer kernel load enqueued through ``launch`` on this thread (as
    ``load_async`` does) while another thread runs pure Python: its events from a filled
    issuer's pool (``pooled``), or created on this thread."""
    geo = loads.geo
    issuer = CopyIssuer(torch.device("cuda", 0)) if pooled else None
    staging = IndexStaging()
    n = max(1, (128 << 20) // geo.page_bytes)
    page_ids, slots = loads.ids_cpu[:n].tolist(), loads.slots_cpu[:n]
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(stop.is_set, True)])
    times = []
    try:
        os.environ["PAGEKV_COPY_BACKEND"] = "kernel"
        busy.start()
        for _ in range(rounds):
            if issuer is not None:
                issuer.take_events(0)
                issuer.pool_full.wait(timeout=60)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = launch(True, loads.kv, loads.host, page_ids, slots, staging, issuer,
                         layers=range(geo.num_layers))  # fmt: skip
            times.append((time.perf_counter() - t0) * 1e3)
            out.events[-1].synchronize()
    finally:
        stop.set()
        busy.join()
        os.environ["PAGEKV_COPY_BACKEND"] = "auto"
        if issuer is not None:
            issuer.close()
    return times


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
    for pooled in (False, True):
        ms = caller_ms(loads, pooled, args.rounds)
        key = "caller_pooled_events" if pooled else "caller_own_events"
        result[key] = {"median_ms": round(statistics.median(ms), 3), "ms": ms}
        print(f"{key}: a 32-layer kernel load's enqueue on the calling thread beside pure "
              f"Python: {statistics.median(ms):.2f} ms ({[round(x, 2) for x in ms]})",
              flush=True)  # fmt: skip
    print(f"wrote {write_result('diag_ce_host_rate', result)}")


if __name__ == "__main__":
    main()
