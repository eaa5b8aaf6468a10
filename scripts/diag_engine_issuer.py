"""Where the connector's copy issuer waits beside the reference engine's decode (issue 32, GPU).

The reference engine (Llama-3-8B shape, graph decode, no store) generates from a 512-token
prompt; when its prefill is done, two 4 GiB layer-by-layer copy-engine loads are submitted to a
:class:`~pagekv.connector.copy_issuer.CopyIssuer` (as ``load_async`` does), and a sampler thread
records the issuer thread's innermost Python frame every ~1 ms until the last load is enqueued.
Reports how often each (function, line) was seen, with the engine's own thread's frames, and
the issuer's timeline (submit, each prefix enqueued). A frame that returns to Python after a
call that released the GIL shows where the thread waited to take it back.

    python scripts/diag_engine_issuer.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import torch
from _bench_util import environment, parse_args, write_result
from bench_beside_compute import GIB, Loads

from pagekv.connector import KVGeometry
from pagekv.connector.copy_issuer import CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch


def frame_name(frame) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"


def sample(threads: dict[str, int], stop: threading.Event, seen: dict) -> None:
    """Every ~1 ms, the innermost frame of each named thread (ident), counted."""
    while not stop.is_set():
        frames = sys._current_frames()
        for name, ident in threads.items():
            frame = frames.get(ident)
            if frame is not None:
                seen[name][frame_name(frame)] += 1
        time.sleep(0.001)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    args = parse_args(ap)
    from pagekv.engine import PRESETS, Engine, EngineConfig, Request

    env = environment()
    geo = KVGeometry(32, 16, 8, 128, "bf16")
    loads = Loads(4 * GIB, geo)
    cfg = EngineConfig(PRESETS["llama-3-8b"], page_size=16, num_slots=512 + 49 + 64,
                       host_pages=16, dtype="bf16", device="cuda", decode_graphs=True)  # fmt: skip
    engine = Engine(cfg)
    engine.warmup(1024)
    issuer, staging = CopyIssuer(torch.device("cuda", 0)), IndexStaging()
    os.environ["PAGEKV_COPY_BACKEND"] = "copy_engine"
    ids, slots = loads.ids_cpu.tolist(), loads.slots_cpu
    original = engine._save
    state: dict = {}

    def submit():
        layers = range(geo.num_layers)
        return launch(True, loads.kv, loads.host, ids, slots, staging, issuer, layers=layers)

    def save_then_loads(*a, **kw):
        if state.get("armed"):
            state["armed"] = False
            state["t0"] = time.monotonic()
            with torch.cuda.stream(loads.stream):
                state["outs"] = [submit() for _ in range(2)]
            state["submitted"] = time.monotonic()
        return original(*a, **kw)

    engine._save = save_then_loads
    gen = torch.Generator().manual_seed(1)
    result: dict = {"env": env, "rounds": []}
    for r in range(args.rounds + 1):  # the first warms the issuer (its thread, its events)
        seen: dict = collections.defaultdict(collections.Counter)
        state.clear()
        state["armed"] = True
        stop = threading.Event()
        prompt = torch.randint(0, cfg.model.vocab_size, (512,), generator=gen).tolist()
        names = {"engine": threading.get_ident()}
        if issuer._thread is not None:
            names["issuer"] = issuer._thread.ident
        sampler = threading.Thread(target=sample, args=(names, stop, seen))
        sampler.start()
        res = engine.generate(Request(prompt, 49, reuse=False, save=False))
        last = state["outs"][-1].events[-1]
        last.synchronize()
        stop.set()
        sampler.join()
        t0 = state["t0"]
        row = dict(
            decode_ms=round(res.decode_s * 1e3, 1),
            submit_ms=round((state["submitted"] - t0) * 1e3, 1),
            prefix_enqueued_ms=[
                round((o.events[-1].enqueued_at - t0) * 1e3, 1) for o in state["outs"]
            ],
            frames={k: v.most_common(12) for k, v in seen.items()},
        )
        if r:
            result["rounds"].append(row)
        print(f"round {r}: decode {row['decode_ms']} ms, submitted {row['submit_ms']} ms, "
              f"prefixes enqueued at {row['prefix_enqueued_ms']} ms", flush=True)  # fmt: skip
        for name, top in row["frames"].items():
            print(f"  {name}: " + ", ".join(f"{f} x{n}" for f, n in top), flush=True)
    issuer.close()
    print(f"wrote {write_result('diag_engine_issuer', result)}")


if __name__ == "__main__":
    main()
