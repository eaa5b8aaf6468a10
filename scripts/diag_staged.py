"""Staged backend settings (GPU): all-layer loads and saves through the device staging ring
against the pinned contiguous copy, for the shapes whose runs no DMA backend moves at 0.95
(runs of 4-36 KiB), with the ring's settings swept in the same rounds.

Variants (over :mod:`pagekv.kernels.staged`'s module settings, each named in full): 16 MiB
chunks over 4 buffers with 64 scatter blocks and no taper, and with the chunks halving down
to 1 MiB at the transfer's end (a save's start) on 64, 8, 4 and 2 scatter blocks, and the
last on 64 blocks with each chunk's DMA call over 4 streams or with 8 DMA streams in turn. The
kernel in the same rounds. Medians over ``--reps`` rounds of (copy time / staged time).

    python scripts/diag_staged.py [--mib 256,1024] [--reps 5] [--shapes llama3-8b-tp8:16,...]
                                  [--variants blocks64_taper1,...]
"""

from __future__ import annotations

import argparse

import torch
from _bench_util import environment, overridden, parse_args, write_result
from bench_kernels import (
    GEOMETRIES,
    Setup,
    ceiling_fns,
    interleaved,
    kernel_fns,
    parse_shapes,
    ratio,
)

from pagekv.connector import KVGeometry
from pagekv.kernels import load, save, staged

SHAPES = [("llama3-8b-tp8", 16), ("llama3-8b-tp8", 32), ("llama3-8b-tp8", 64),
          ("llama3-8b-tp8", 128), ("llama3-8b", 16), ("mla-576", 16), ("mla-576", 32)]  # fmt: skip
MIB = 1 << 20
VARIANTS = {  # every setting named, so that the names hold whatever staged.py ships
    "blocks64": {"SCATTER_BLOCKS": 64, "TAPER_BYTES": 0, "CHUNK_BYTES": 16 * MIB, "BUFFERS": 4},
    **{
        f"blocks{b}_taper1": {
            "SCATTER_BLOCKS": b,
            "TAPER_BYTES": MIB,
            "CHUNK_BYTES": 16 * MIB,
            "BUFFERS": 4,
        }
        for b in (64, 8, 4, 2)
    },
    # the shipped ring with each chunk's DMA call over 4 streams, or with 8 DMA streams in turn
    "blocks64_taper1_lanes4": {"SCATTER_BLOCKS": 64, "TAPER_BYTES": MIB,
                               "CHUNK_BYTES": 16 * MIB, "BUFFERS": 4, "DMA_LANES": 4},
    "blocks64_taper1_streams8": {"SCATTER_BLOCKS": 64, "TAPER_BYTES": MIB,
                                 "CHUNK_BYTES": 16 * MIB, "BUFFERS": 4, "DMA_STREAMS": 8},
}  # fmt: skip


def variant_fn(st: Setup, settings: dict, is_load: bool):
    """A transfer under ``settings`` (set for the call) with a ring of its own (made for them
    on its first call)."""
    settings = {**settings, "_devices": {}}

    def call() -> None:
        with overridden(staged, **settings):
            if is_load:
                got = load(st.host, st.ids_cpu, st.kv, st.slots_cpu, backend="staged",
                           validate=False)  # fmt: skip
            else:
                got = save(st.kv, st.slots_cpu, st.host, st.ids_cpu, backend="staged",
                           validate=False)  # fmt: skip
        assert got == "staged", got

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="256,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="geometry:page,...")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                    help="of: " + ", ".join(VARIANTS))  # fmt: skip
    args = parse_args(ap)
    variants = {v: VARIANTS[v] for v in args.variants}
    sizes = [int(m) * MIB for m in args.mib.split(",")]
    raw = torch.empty(max(sizes) + (64 * MIB), dtype=torch.uint8).pin_memory()
    raw.random_()
    rows = []
    for nbytes in sizes:
        for name, page in args.shapes:
            geo = KVGeometry(page_size=page, **GEOMETRIES[name])
            st = Setup(raw, geo, nbytes)
            ceil, kern = ceiling_fns(raw, st.nbytes), kernel_fns(st)
            row = {"geometry": name, "page": page, "run_kib": geo.page_size * geo.item_bytes / 1024,
                   "mib": nbytes // MIB}  # fmt: skip
            for is_load, ceiling in ((True, "ceiling_h2d"), (False, "ceiling_d2h")):
                d = "load" if is_load else "save"
                fns = {ceiling: ceil[ceiling], f"kernel_{d}": kern[f"kernel_{d}"]}
                for v, settings in variants.items():
                    fns[v] = variant_fn(st, settings, is_load)
                times = interleaved(fns, args.reps)
                row[f"kernel_{d}"] = ratio(times, ceiling, f"kernel_{d}")
                for v in variants:
                    row[f"{v}_{d}"] = ratio(times, ceiling, v)
            print(row, flush=True)
            rows.append(row)
            del st
            torch.cuda.empty_cache()
    write_result("diag_staged", {"env_note": environment()["date"], "variants": variants,
                                 "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
