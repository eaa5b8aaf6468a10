"""The copy table's choices measured on a busy host (GPU).

The table (:mod:`pagekv.kernels.copy_table`) is measured once per device and cached, by
whichever process needs it first: at an engine's start-up, or in a test run, other processes
may keep the host's CPUs busy while it measures. A backend whose run is host-bound (the copy
engine's 32-36 KiB runs: ~0.5-1 us of host time a copy) is then timed at the busy host's
rate, not the device's. This measures the grid three times in one process (no cache): with the
host idle, then beside ``--busy`` processes spinning in pure Python, timed as the table does
(:func:`~pagekv.kernels._calibrate.steady_seconds`: the fastest of five runs) and by the
median of the runs (the statistic it replaced); and prints, for every shape where a busy
pass's choice differs from the idle one's, the caller's and the issuer's choices (two idle
passes differ in ~15 of 130 shapes: ``diag_table_timing.py``), how many of its timings are
under ``SLOWER`` of the idle pass's, and how :func:`~pagekv.kernels.calibrate` would have
cached each pass's table (the device's, or provisional: its threads' wait for a CPU,
:func:`~pagekv.kernels._calibrate.measure_grid`); and, beside the same spinners right after each
pass, the verdict of the trial (:func:`~pagekv.kernels._calibrate.trial`) by which a later
process decides whether to measure a provisional table again: whether it agrees with the
pass's.

    python scripts/diag_table_busy.py [--busy 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from _bench_util import environment, parse_args, spinning, write_result
from diag_table_timing import choices

from pagekv.kernels._calibrate import measure_grid, steady_seconds, trial

SLOWER = 0.8  # a busy pass's timing counted as slowed below this share of the idle one's


def median_seconds(
    fn: Callable[[], object], stream: torch.cuda.Stream, reps: int = 5
) -> tuple[float, float]:
    """:func:`steady_seconds` with the median of its runs instead of the fastest."""
    runs = [steady_seconds(fn, stream, reps=1) for _ in range(reps)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                    help="processes spinning beside the busy passes")  # fmt: skip
    args = parse_args(ap)
    passes, verdicts, trials = {}, {}, {}
    for name, timing, busy in (("idle", steady_seconds, 0), ("busy_fastest", steady_seconds,
                               args.busy), ("busy_median", median_seconds, args.busy)):  # fmt: skip
        with spinning(busy):
            t = time.perf_counter()
            entries, load = measure_grid(0, timing)
            passes[name] = choices(entries)
            seconds = time.perf_counter() - t
            t = time.perf_counter()
            tried = trial(0)
            verdicts[name] = {"wait_share": round(load.share, 3), "busy": load.busy}
            trials[name] = {"wait_share": round(tried.share, 3), "busy": tried.busy,
                            "seconds": round(time.perf_counter() - t, 2)}  # fmt: skip
            print(f"{name}: measured in {seconds:.1f} s beside {busy} spinners; the measuring "
                  f"thread's wait {load.share:.3f} of its run: cached as "
                  f"{'provisional' if load.busy else 'the device table'}; the trial after it "
                  f"({trials[name]['seconds']} s): wait {tried.share:.3f}, "
                  f"{'busy' if tried.busy else 'quiet'}")  # fmt: skip
    base = passes["idle"]
    summary, slower = {}, {}
    for other in ("busy_fastest", "busy_median"):
        diff = [k for k in base for who in ("caller", "issuer")
                if base[k][who] != passes[other][k][who]]  # fmt: skip
        summary[other] = len(set(diff))
        slow = [(k, b) for k in base for b, gbps in base[k]["gbps"].items()
                if passes[other][k]["gbps"].get(b, gbps) < SLOWER * gbps]  # fmt: skip
        slower[other] = len(slow)
        timed = sum(len(v["gbps"]) for v in base.values())
        print(f"idle vs {other}: {len(set(diff))} of {len(base)} shapes choose otherwise; "
              f"{len(slow)} of {timed} timings under {SLOWER} of the idle one's")  # fmt: skip
        for k in dict.fromkeys(diff):
            a, b = base[k], passes[other][k]
            print(
                f"  {k}: caller {a['caller']} / {b['caller']}, issuer {a['issuer']} / "
                f"{b['issuer']}; GB/s {a['gbps']} / {b['gbps']}"
            )
    write_result("diag_table_busy", {"env": environment(), "busy": args.busy,
                                     "differ": summary, "slower": slower,
                                     "host_load": verdicts, "trial": trials,
                                     "passes": passes})  # fmt: skip


if __name__ == "__main__":
    main()
