"""Diagnostic (GPU): one all-layer transfer split between the kernel and a DMA backend at once.

The kernel moves 0.91-0.93 of the pinned copy whatever the run (its SMs' reads of host memory
are the bound); the copy engine, for runs under 32 KiB, 0.04-0.4 (its cost per copy). Issued
together on disjoint pages, the kernel on the caller's stream and the copy engine on a side
stream forked from it and joined back, they share the bus: this times the split against the
contiguous pinned copy of the same bytes, for the copy engine's share of the pages from 0 up.

``--dma pitched`` puts the share on the pitched copy instead (0.47-0.93 of the copy alone for
4-36 KiB runs: a row's cost, not the bus).

    python scripts/diag_hybrid.py [--mib 256,1024] [--reps 5] [--save out.json]
                                  [--dma copy_engine|pitched] [--shares 0,0.1] [--shapes g:16]
                                  [--blocks 0,2]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from _bench_util import environment
from bench_kernels import (
    GEOMETRIES,
    Setup,
    ceiling_fns,
    interleaved,
    parse_shapes,
    ratio,
    split_fn,
)

from pagekv.connector import KVGeometry

SHAPES = [("llama3-8b-tp8", 16), ("llama3-8b-tp8", 64), ("mla-576", 16), ("llama3-8b", 16)]
SHARES = {True: (0.0, 0.03, 0.06, 0.1, 0.15, 0.2), False: (0.0, 0.05, 0.1, 0.2, 0.3)}


def checked(run, dma: str):
    """``run``, failing where its DMA share did not take ``dma``."""

    def call() -> None:
        took = run()
        assert took in ("", dma), took

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", default="256,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--save", default="")
    ap.add_argument("--dma", default="copy_engine", choices=["copy_engine", "pitched"])
    ap.add_argument("--shares", default="", help="the DMA backend's shares (both directions)")
    ap.add_argument(
        "--blocks",
        type=lambda s: [int(x) or None for x in s.split(",")],
        default=[None, 8],
        help="the kernel's blocks on loads (0: its default)",
    )
    ap.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="geometry:page,...")
    args = ap.parse_args()
    shares = {d: [float(x) for x in args.shares.split(",")] for d in (True, False)} \
        if args.shares else SHARES  # fmt: skip
    sizes = [int(x) << 20 for x in args.mib.split(",")]
    raw_host = torch.empty(max(sizes), dtype=torch.uint8).pin_memory()
    raw_host.random_()
    env = environment()
    print(f"# {env['device']} commit {env['commit']}", flush=True)
    rows = []
    for name, page in args.shapes:
        geo = KVGeometry(page_size=page, **GEOMETRIES[name])
        for nbytes in sizes:
            st = Setup(raw_host, geo, nbytes)
            n = st.n_pages
            moved = n * geo.page_bytes
            for is_load in (True, False):
                d = "load" if is_load else "save"
                fns = {f"ceiling_{'h2d' if is_load else 'd2h'}": ceiling_fns(raw_host, moved)[
                    f"ceiling_{'h2d' if is_load else 'd2h'}"]}  # fmt: skip
                for share in shares[is_load]:
                    for blocks in args.blocks if is_load else (None,):
                        fns[f"{share}/{blocks}"] = checked(
                            split_fn(st, n, share, is_load, blocks, args.dma), args.dma
                        )
                t = interleaved(fns, args.reps)
                ceiling = next(iter(fns))
                out = {k: ratio(t, ceiling, k) for k in fns if k != ceiling}
                row = dict(geometry=name, page=page, run_kib=page * geo.item_bytes / 1024,
                           mib=round(moved / 2**20), op=d, ratios=out,
                           ceiling_ms=round(statistics.median(t[ceiling]), 3))  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
            del st
            torch.cuda.empty_cache()
    if args.save:
        with open(args.save, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
