"""Diagnostic (GPU): the copy engine's one-layer transfers by the streams a layer's copies go
over (``copy_engine.LAYER_LANES``), in the same process and rounds as the all-layer copy-engine
transfer of the same pages (on ``LANES`` streams) and the pinned contiguous copy (the copy
engine's rate for 32-36 KiB runs changes from one process to the next, so only figures from
one process compare).

*layers*: every layer of the pages, one ``transfer_layers`` call (CPU indices) on the current
stream, against a copy of all their bytes; *one*: layer 5 alone, against a copy of its bytes.
*plain*: three calls back to back from an idle device; *held*: the same after a GPU wait
enqueued ahead, so the device's time alone counts. Ratios: copy time / our time, medians over
``--reps`` rounds.

    python scripts/diag_ce_layers.py [--mib 128,512] [--reps 5] [--shapes llama3-8b:16,...]
                                     [--lanes 1,2,4,8,16]
"""

from __future__ import annotations

import argparse

import torch
from _bench_util import environment, overridden, parse_args, write_result
from bench_copy_engine import held_interleaved
from bench_kernels import GEOMETRIES, Setup, ceiling_fns, interleaved, parse_shapes, ratio

from pagekv.connector import KVGeometry
from pagekv.kernels import copy_engine, transfer_layers

SHAPES = [("llama3-8b", 16), ("llama3-8b-tp8", 128), ("mla-576", 32), ("llama3-8b", 64)]
MIB = 1 << 20


def variant(st: Setup, layers: list[int | None], lanes: int, is_load: bool):
    def call() -> None:
        with overridden(copy_engine, LAYER_LANES=lanes):
            used, _ = transfer_layers(is_load, st.host, st.ids_cpu, st.kv, st.slots_cpu, layers,
                                      backend="copy_engine")  # fmt: skip
        assert used == "copy_engine", used

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="128,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="geometry:page,...")
    ap.add_argument("--lanes", type=lambda x: [int(n) for n in x.split(",")],
                    default=[1, 2, 4, 8, 16], help="streams of a layer's copies")  # fmt: skip
    args = parse_args(ap)
    sizes = [int(m) * MIB for m in args.mib.split(",")]
    raw = torch.empty(max(sizes), dtype=torch.uint8).pin_memory()
    raw.random_()
    rows = []
    for nbytes in sizes:
        for name, page in args.shapes:
            geo = KVGeometry(page_size=page, **GEOMETRIES[name])
            st = Setup(raw, geo, nbytes)
            every = list(range(geo.num_layers))
            row = {"geometry": name, "page": page, "mib": st.nbytes // MIB,
                   "run_kib": page * geo.item_bytes / 1024}  # fmt: skip
            for is_load, ceiling in ((True, "ceiling_h2d"), (False, "ceiling_d2h")):
                d = "load" if is_load else "save"
                fns = {ceiling: ceiling_fns(raw, st.nbytes)[ceiling],
                       f"all_{d}": variant(st, [None], 1, is_load)}  # fmt: skip
                one = {ceiling: ceiling_fns(raw, st.nbytes // geo.num_layers)[ceiling]}
                for n in args.lanes:
                    fns[f"layers{n}_{d}"] = variant(st, every, n, is_load)
                    one[f"one{n}_{d}"] = variant(st, [5], n, is_load)
                for group in (fns, one):
                    plain, held = interleaved(group, args.reps), held_interleaved(group, args.reps)
                    for key in list(group)[1:]:
                        row[key] = ratio(plain, ceiling, key)
                        row[f"held_{key}"] = ratio(held, ceiling, key)
            print(row, flush=True)
            rows.append(row)
            del st
            torch.cuda.empty_cache()
    write_result("diag_ce_layers", {"env_note": environment()["date"], "rows": rows})


if __name__ == "__main__":
    main()
