"""The copy table's choices under two timings of the same grid (GPU).

The table (:mod:`pagekv.kernels.copy_table`) times a backend as a run of calls once under way
(:func:`~pagekv.kernels._calibrate.steady_seconds`: device time from the first call's end). The
timing it replaced, *idle-first*, timed three calls from an idle device on the host clock, so
the first call's host time, which nothing overlaps and which a busy host lengthens, was in the
rate. This measures the grid three times in one process (steady, idle-first, steady again; no
cache) and prints, for every shape where the choices differ, the caller's and the issuer's
choice under each; the two steady passes differing show how far noise alone moves a choice.

    python scripts/diag_table_timing.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _bench_util import environment, parse_args, write_result

from pagekv.kernels import copy_table, ops
from pagekv.kernels._calibrate import measure_entries, steady_seconds


def idle_first_seconds(
    fn: Callable[[], object], stream: torch.cuda.Stream, reps: int = 5, inner: int = 3
) -> tuple[float, float]:
    """The replaced timing: seconds per call of ``inner`` calls from an idle device, host clock
    (the first call's host time included), and the first call's host time."""
    fn()
    stream.synchronize()
    times, enqueue = [], []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        enqueue.append(time.perf_counter() - start)
        for _ in range(inner - 1):
            fn()
        stream.synchronize()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), statistics.median(enqueue)


def allowed(shape: copy_table.Shape, deferred: bool) -> list[str]:
    """What ``auto`` offers the table for ``shape`` on a device with the copy engine, for caches
    the pitched copy suits."""
    return ops.table_candidates(shape.run_bytes, shape.all_layers, deferred, True, True)


def choices(entries: list[copy_table.Entry]) -> dict[str, dict]:
    out = {}
    for e in entries:
        sh = e.shape
        name = (f"{'load' if sh.load else 'save'} {'all' if sh.all_layers else 'one'} "
                f"{sh.run_bytes / 1024:g}KiB {sh.total_bytes >> 20}MiB")  # fmt: skip
        gbps = {b: round(sh.total_bytes / s / 1e9, 1) for b, s in e.seconds if s < 1e9}
        host_us = {b: round(s * 1e6, 1) for b, s in e.enqueue if s < 1e9}
        out[name] = dict(caller=e.best(allowed(sh, False)), issuer=e.best(allowed(sh, True), True),
                         gbps=gbps, host_us=host_us)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parse_args(ap)
    passes = {}
    for name, timing in (("steady", steady_seconds), ("idle_first", idle_first_seconds),
                         ("steady_again", steady_seconds)):  # fmt: skip
        t = time.perf_counter()
        passes[name] = choices(measure_entries(0, timing))
        print(f"{name}: measured in {time.perf_counter() - t:.1f} s")
    base = passes["steady"]
    for other in ("idle_first", "steady_again"):
        diff = [k for k in base for who in ("caller", "issuer")
                if base[k][who] != passes[other][k][who]]  # fmt: skip
        print(f"steady vs {other}: {len(set(diff))} of {len(base)} shapes choose otherwise")
        for k in dict.fromkeys(diff):
            a, b = base[k], passes[other][k]
            print(
                f"  {k}: caller {a['caller']} / {b['caller']}, issuer {a['issuer']} / "
                f"{b['issuer']}; GB/s {a['gbps']} / {b['gbps']}; host us {b['host_us']}"
            )
    write_result("diag_table_timing", {"env": environment(), "passes": passes})


if __name__ == "__main__":
    main()
