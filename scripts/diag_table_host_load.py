"""The copy table's one-layer entries on a quiet host and on a busy one (GPU).

The table (:mod:`pagekv.kernels.copy_table`) times each backend as calls back to back, the
device idle at the first, so a backend whose host time per call is long (the copy engine: ~0.5
us a copy, 4,096 copies for a 128 MiB layer of 32 KiB runs) is timed partly at the host's
speed. This measures the grid twice, in fresh processes and without the cache: alone, then
with ``--busy`` processes spinning on the CPU (as a test suite, or other ranks starting up, would
load the host), and prints the one-layer entries of 32 and 64 KiB runs with each backend's GB/s,
host time per call, and the issuer's choice (:meth:`Entry.best`, deferred).

    python scripts/diag_table_host_load.py [--busy 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _bench_util import environment, parse_args, spinning, write_result

RUNS = (32768.0, 65536.0)


def one_layer_entries() -> dict:
    """The grid measured now (no cache): its one-layer entries of ``RUNS``."""
    from pagekv.kernels import ops
    from pagekv.kernels._calibrate import measure_entries

    t = time.perf_counter()
    entries = measure_entries(0)
    rows = []
    for e in entries:
        if e.shape.all_layers or e.shape.run_bytes not in RUNS:
            continue
        gbps = {b: round(e.shape.total_bytes / s / 1e9, 1) for b, s in e.seconds if s < 1e9}
        host_ms = {b: round(s * 1e3, 2) for b, s in e.enqueue if s < 1e9}
        issuer = e.best(ops.table_candidates(e.shape.run_bytes, False, True, True, True), True)
        rows.append(dict(load=e.shape.load, run=e.shape.run_bytes, mib=e.shape.total_bytes >> 20,
                         gbps=gbps, host_ms=host_ms, issuer=issuer))  # fmt: skip
    return {"seconds": round(time.perf_counter() - t, 1), "one_layer": rows}


def measured_in_child() -> dict:
    out = subprocess.run([sys.executable, __file__, "--child"], check=True,
                         capture_output=True, text=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=16, help="spinning processes, second pass")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(ap)
    if args.child:
        print(json.dumps(one_layer_entries()))
        return
    quiet = measured_in_child()
    with spinning(args.busy):
        busy = measured_in_child()
    for name, res in (("quiet", quiet), (f"busy x{args.busy}", busy)):
        print(f"{name}: measured in {res['seconds']} s")
        for r in res["one_layer"]:
            print(
                f"  {'load' if r['load'] else 'save'} run {r['run'] / 1024:g} KiB {r['mib']} MiB:"
                f" GB/s {r['gbps']} host ms {r['host_ms']} -> issuer {r['issuer']}"
            )
    write_result("diag_table_host_load", {"env": environment(), "busy": args.busy,
                                          "quiet": quiet, "busy_host": busy})  # fmt: skip


if __name__ == "__main__":
    main()
