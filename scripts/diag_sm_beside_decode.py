"""What SM-issued host transfers cost a decode beside them: 16-byte loads against Hopper bulk
copies (issue 32, GPU).

The kernel's one-layer loads of runs under 32 KiB cost a graph-captured decode beside them
2.2-2.4x the extra step time a plain copy of the same bytes costs (docs/benchmarks.md); its
blocks hold their bytes in flight in registers (1024 threads, 46-56 registers each: most of an
SM's register file). Hopper's bulk copies (``cp.async.bulk``) hold them in shared memory with one
issuing thread per warp. This times both variants of ``scripts/diag_sm_host_copies.cu`` (built
here as a library) on 4 GiB of runs laid out as TP-8 16-token pages (4 KiB runs, 64 a host
page, pages in random order, device runs in shuffled slots of 32 layers x K/V), all at once and
one layer at a time (32 launches of each layer's runs), loads and saves, each checked against
the source first (the destination poisoned), then: its rate alone against one contiguous
``cudaMemcpyAsync`` of the same bytes, and beside the decode of
``scripts/bench_beside_compute.py`` (Llama-3-8B projections at batch 8 in one CUDA graph) its
extra step time against the plain copy's (the same pairing as that benchmark: steps wholly
inside the transfer's window, median over steps, then over rounds).

Variants: ``lsu:GxT`` (G blocks of T threads, 4 chunks of 16 bytes in flight a thread, as
pagekv's kernel), ``tma:GxW/KxB`` (G blocks of W warps, each K stages of B bytes).

    python scripts/diag_sm_beside_decode.py [--rounds 5] [--variants lsu:8x1024,tma:16x1/4x16384]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from _bench_util import environment, parse_args, write_result
from bench_beside_compute import DecodeStep, _ms

DEV = torch.device("cuda")
RUN = 4096  # TP-8 slice of Llama-3-8B, 16-token pages: 256-byte rows x 16
LAYERS, KV = 32, 2
DEFAULT_VARIANTS = (
    "lsu:8x1024,lsu:4x1024,lsu:2x1024,tma:8x1/8x16384,tma:16x1/4x16384,tma:16x1/2x16384,"
    "tma:32x1/2x8192,tma:132x1/2x8192,tma:132x1/4x16384"
)


def build() -> ctypes.CDLL:
    src = Path(__file__).resolve().parent / "diag_sm_host_copies.cu"
    out = Path(tempfile.mkdtemp()) / "diag_sm.so"
    major, minor = torch.cuda.get_device_capability()
    subprocess.run(["nvcc", "-O3", "-std=c++17", f"-arch=sm_{major}{minor}", "-shared",
                    "-Xcompiler", "-fPIC", "-DDIAG_SM_LIB", "-o", str(out), str(src)],
                   check=True)  # fmt: skip
    lib = ctypes.CDLL(str(out))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.diag_lsu.argtypes = [p, p, p, p, i64, i32, i32, i32, p]
    lib.diag_tma.argtypes = [p, p, p, p, i64, i32, i32, i32, i32, i32, p]
    return lib


class Runs:
    """4 GiB as TP-8 16-token pages: host pages (pinned, random bytes), a layer-first device
    region, a second host region for saves, and each run's offsets on both sides, ordered by
    (layer, K/V) so that a layer's runs are one slice."""

    def __init__(self, total: int) -> None:
        per_page = LAYERS * KV
        self.pages = total // (per_page * RUN)
        self.nbytes = self.pages * per_page * RUN
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.host.random_()
        self.host2 = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(self.nbytes, dtype=torch.uint8, device=DEV)
        page_at, slot_of = torch.randperm(self.pages), torch.randperm(self.pages)
        u = torch.arange(per_page)[:, None]  # (layer, K/V) major
        self.hoff = (page_at[None, :] * per_page * RUN + u * RUN).reshape(-1).to(DEV)
        self.doff = (u * self.pages * RUN + slot_of[None, :] * RUN).reshape(-1).to(DEV)
        self.stream = torch.cuda.Stream()

    def per_layer(self) -> int:
        return KV * self.pages

    def check(self, load: bool, move) -> bool:
        """``move`` (all runs) into a poisoned destination, compared with the source."""
        rows_h, rows_d = (self.hoff // RUN).long(), (self.doff // RUN).long()
        if load:
            self.dev.fill_(0xA5)
        else:  # the device bytes random, so that a save that moved nothing cannot match
            self.dev.random_()
            self.host2.fill_(0xA5)
        with torch.cuda.stream(self.stream):
            move()
        self.stream.synchronize()
        source = self.host.to(DEV).view(-1, RUN)[rows_h]
        if load:
            got = self.dev.view(-1, RUN)[rows_d]
            return torch.equal(got, source)
        got = self.host2.to(DEV).view(-1, RUN)[rows_h]
        return torch.equal(got, self.dev.view(-1, RUN)[rows_d])


def mover(lib: ctypes.CDLL, runs: Runs, variant: str, load: bool, by_layer: bool):
    """A function enqueuing the whole 4 GiB on the current stream with ``variant``."""
    if variant == "plain_copy":

        def plain() -> None:
            n = runs.nbytes // LAYERS if by_layer else runs.nbytes
            for part in [slice(i * n, (i + 1) * n) for i in range(runs.nbytes // n)]:
                dst, src = (runs.dev, runs.host) if load else (runs.host2, runs.dev)
                dst[part].copy_(src[part], non_blocking=True)

        return plain
    kind, _, cfg = variant.partition(":")
    src, dst = (runs.host, runs.dev) if load else (runs.dev, runs.host2)
    soff, doff = (runs.hoff, runs.doff) if load else (runs.doff, runs.hoff)
    step = runs.per_layer() if by_layer else len(runs.hoff)
    if kind == "lsu":
        g, t = (int(x) for x in cfg.split("x"))
    else:
        gw, kb = cfg.split("/")
        g, w = (int(x) for x in gw.split("x"))
        k, b = (int(x) for x in kb.split("x"))

    def run() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for first in range(0, len(soff), step):
            so, do = soff[first:].data_ptr(), doff[first:].data_ptr()
            if kind == "lsu":
                err = lib.diag_lsu(src.data_ptr(), dst.data_ptr(), so, do, step, RUN, g, t, stream)
            else:
                err = lib.diag_tma(src.data_ptr(), dst.data_ptr(), so, do, step, RUN, b, k, g, w,
                                   stream)  # fmt: skip
            if err:
                raise RuntimeError(f"{variant}: cudaError {err}")

    return run


def beside(step: DecodeStep, runs: Runs, fns: dict, rounds: int, alone_steps: int) -> dict:
    """Per variant: its time alone, and per round the decode's slowdown beside it and that
    extra time against the plain copy's."""
    load_ms = {}
    for name, fn in fns.items():
        times = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(runs.stream):
                a.record()
                fn()
                b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        load_ms[name] = statistics.median(times)
    marks = step.replay(10)
    step.stream.synchronize()
    step_ms = statistics.median(_ms(a, b) for a, b in marks)
    out = {name: {"gbps_alone": round(runs.nbytes / ms / 1e6, 2), "slowdowns": [], "extra": []}
           for name, ms in load_ms.items()}  # fmt: skip
    for _ in range(rounds):
        slow = {}
        for name, fn in fns.items():
            marks = step.replay(alone_steps)
            step.stream.synchronize()
            alone = statistics.median(_ms(a, b) for a, b in marks)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(step.stream)
            marks = step.replay(int((load_ms[name] * 1.3 + 30) / step_ms) + 2)
            la, lb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(runs.stream):
                la.record()
                fn()
                lb.record()
            step.stream.synchronize()
            runs.stream.synchronize()
            ls, le = _ms(ref, la), _ms(ref, lb)
            inside = [_ms(a, b) for a, b in marks if _ms(ref, a) >= ls and _ms(ref, b) <= le]
            if inside:
                slow[name] = statistics.median(inside) / alone
                out[name]["slowdowns"].append(round(slow[name], 4))
        base = slow.get("plain_copy")
        for name, s in slow.items():
            if base is not None and base > 1:
                out[name]["extra"].append(round((s - 1) / (base - 1), 3))
    for row in out.values():
        row["slowdown_median"] = statistics.median(row["slowdowns"]) if row["slowdowns"] else None
        row["extra_median"] = statistics.median(row["extra"]) if row["extra"] else None
    plain = out["plain_copy"]["gbps_alone"]
    for row in out.values():
        row["ratio_alone"] = round(row["gbps_alone"] / plain, 3)
    return {"step_ms_alone": round(step_ms, 4), "variants": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--alone-steps", type=int, default=12)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--modes", default="layer_load,layer_save,all_load")
    args = parse_args(ap)
    lib = build()
    runs = Runs(int(args.gib * (1 << 30)))
    step = DecodeStep()
    variants = ["plain_copy", *args.variants.split(",")]
    result: dict = {"env": environment(), "run_bytes": RUN, "bytes": runs.nbytes, "modes": {}}
    for mode in args.modes.split(","):
        by_layer, load = mode.startswith("layer"), mode.endswith("load")
        fns = {v: mover(lib, runs, v, load, by_layer) for v in variants}
        # the plain copy moves the same bytes contiguously: nothing to check
        checked = {v: runs.check(load, fn) for v, fn in fns.items() if v != "plain_copy"}
        bad = [v for v, ok in checked.items() if not ok]
        fns = {v: fn for v, fn in fns.items() if v not in bad}
        res = beside(step, runs, fns, args.rounds, args.alone_steps)
        res["wrong"] = bad
        result["modes"][mode] = res
        print(f"{mode} (step {res['step_ms_alone']} ms alone; wrong: {bad or 'none'})", flush=True)
        for v, row in res["variants"].items():
            print(f"  {v:22s} {row['gbps_alone']:6.1f} GB/s ({row['ratio_alone']:.3f} of the "
                  f"copy)  step x{row['slowdown_median']}  extra vs plain {row['extra_median']} "
                  f"(rounds {row['extra']})", flush=True)  # fmt: skip
    print(f"wrote {write_result('diag_sm_beside_decode', result)}")


if __name__ == "__main__":
    main()
