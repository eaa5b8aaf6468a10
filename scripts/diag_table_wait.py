"""Where the copy table's measurement waits for a CPU on a busy host (GPU).

Times every grid shape as :func:`pagekv.kernels.calibrate` does, beside ``--busy`` processes
spinning in pure Python, and prints per shape the seconds the measuring thread ran and waited
runnable for a CPU (:func:`~pagekv.kernels._calibrate.thread_seconds`) against the same summed
over every thread of the process; then the shapes where the thread waited most, the totals over
the grid, and the same for the trial's shapes (:data:`~pagekv.kernels._calibrate.TRIAL_SHAPES`,
timed three times first). The busy verdict's evidence: which threads wait, and in which shapes.

    python scripts/diag_table_wait.py [--busy 8,16]
"""

from __future__ import annotations

import argparse
import os
import time

from _bench_util import environment, parse_args, spinning, write_result

from pagekv.kernels import _calibrate, copy_table
from pagekv.kernels._calibrate import ShapeTimer, steady_seconds, thread_seconds


def process_seconds() -> tuple[float, float]:
    """Seconds run and waited for a CPU, summed over the threads of this process alive now."""
    ran = waited = 0.0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                fields = f.read().split()
        except OSError:  # a thread that ended
            continue
        ran, waited = ran + int(fields[0]) / 1e9, waited + int(fields[1]) / 1e9
    return ran, waited


def timed(shapes: list, time_shape: ShapeTimer) -> list[list]:
    """Per shape: the shape, wall seconds, the process's and the thread's (ran, waited)."""
    rows = []
    for shape in shapes:
        p0, t0, start = process_seconds(), thread_seconds(), time.perf_counter()
        time_shape(shape, steady_seconds)
        p1, t1 = process_seconds(), thread_seconds()
        rows.append([list(shape), round(time.perf_counter() - start, 3),
                     round(p1[0] - p0[0], 3), round(p1[1] - p0[1], 4),
                     round(t1[0] - t0[0], 3), round(t1[1] - t0[1], 4)])  # fmt: skip
    return rows


def share(rows: list[list], ran: int) -> float:
    total = sum(r[ran] for r in rows)
    return round(sum(r[ran + 1] for r in rows) / total, 3) if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", default="8,16", help="spinning processes, one pass each")
    args = parse_args(ap)
    out = {}
    for busy in [int(b) for b in args.busy.split(",")]:
        with (
            spinning(busy),
            _calibrate._timing_shapes(0, max(copy_table.TOTAL_BYTES)) as time_shape,
        ):
            trial = timed(list(_calibrate.TRIAL_SHAPES) * 3, time_shape)
            grid = timed(list(copy_table.grid()), time_shape)
        out[busy] = {"trial": trial, "grid": grid,
                     "share": {"trial_thread": share(trial, 4), "grid_thread": share(grid, 4),
                               "grid_process": share(grid, 2)}}  # fmt: skip
        print(f"beside {busy}: waited / ran {out[busy]['share']}")
        for r in sorted(grid, key=lambda r: -r[5])[:8]:
            print("  ", r)
    write_result("diag_table_wait", {"env": environment(), "columns": [
        "shape (load, all layers, run, total)", "wall s", "process ran s", "process waited s",
        "thread ran s", "thread waited s"], "passes": out})  # fmt: skip


if __name__ == "__main__":
    main()
