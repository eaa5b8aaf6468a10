"""PNG of the streams section of ``bench_store.py``: GB/s against streams per node, for PUTs and
GETs over the bulk lane and over ZeroMQ, with the hot and cold K-stream TCP ceilings of the
same run (left), and each as a fraction of the hot ceiling with the issue's targets (right).

python scripts/plot_streams.py [benchmarks/results/bench_store_streams.json] [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    root = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "bench_store_streams.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    rows = data["streams"]["rows"]
    by_path = {path: sorted((r for r in rows if r["path"] == path), key=lambda r: r["streams"])
               for path in ("bulk", "zmq")}  # fmt: skip
    ref = by_path["zmq"] or by_path["bulk"]  # the ceilings are the same for both paths
    ks = [r["streams"] for r in ref]
    bulk_put = "put, bulk lane"
    # (label, GB/s per K, style): each path's rows, the ones it has
    series = [
        ("TCP ceiling, hot (get)", [r["tcp_get_gbps"] for r in ref], "k--"),
        ("TCP ceiling, cold (get)", [r["tcp_cold_get_gbps"] for r in ref], "k:"),
        ("get, bulk lane", [r["get_gbps"] for r in by_path["bulk"]], "C0-o"),
        ("get, ZeroMQ", [r["get_gbps"] for r in by_path["zmq"]], "C1-s"),
        ("put, ZeroMQ", [r["put_gbps"] for r in by_path["zmq"]], "C2-^"),
        (bulk_put, [r["put_gbps"] for r in by_path["bulk"]], "C3-v"),
    ]
    ratios = [
        ("get, bulk lane", [r["get_ratio"] for r in by_path["bulk"]], "C0-o"),
        ("get, ZeroMQ", [r["get_ratio"] for r in by_path["zmq"]], "C1-s"),
        ("put, ZeroMQ", [r["put_ratio"] for r in by_path["zmq"]], "C2-^"),
        (bulk_put, [r["put_ratio"] for r in by_path["bulk"]], "C3-v"),
    ]
    series = [s for s in series if s[1]]
    ratios = [s for s in ratios if s[1]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, ys, style in series:
        left.plot(ks, ys, style, label=label, markersize=5)
    left.set_xlabel("streams (connections) per node")
    left.set_ylabel("GB/s")
    left.set_xscale("log", base=2)
    left.set_xticks(ks, [str(k) for k in ks])
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    for label, ys, style in ratios:
        right.plot(ks, ys, style, label=label, markersize=5)
    right.plot([1], [0.8], "r*", markersize=10, label="target: 1 stream, put 0.8")
    right.plot([1], [0.85], "b*", markersize=10, label="target: 1 stream, get 0.85")
    right.plot([8], [0.7], "m*", markersize=10, label="target: 8 streams, get 0.7")
    right.set_xlabel("streams (connections) per node")
    right.set_ylabel("fraction of the hot K-stream TCP ceiling (same run)")
    right.set_xscale("log", base=2)
    right.set_xticks(ks, [str(k) for k in ks])
    right.set_ylim(0, max(1.1, *(y + 0.05 for _, ys, _ in ratios for y in ys)))
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8, loc="lower left")
    env = data["env"]
    fig.suptitle(f"pagekv store, one node, 2 MiB blocks: {env['device']}, {env['cpu_count']} "
                 f"cores, {env['date'][:10]}, commit {env['commit']}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
