"""PNG of the store benchmark: put/get GB/s by block size and batch, with the TCP ceiling and
the peers of the same run.

    python scripts/plot_store.py [benchmarks/results/bench_store.json] [out.png]
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
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "bench_store.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    head = data["headline"]["median"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, op in zip(axes[:2], ("put", "get")):
        batches = sorted({r["batch"] for r in data["grid"]})
        for b in batches:
            pts = [(r["block_kib"], r[f"{op}_gbps"]) for r in data["grid"] if r["batch"] == b]
            ax.plot(*zip(*pts), "-o", label=f"pagekv, batch {b}", markersize=4)
        ax.axhline(head[f"tcp_{op}_gbps"], color="k", ls="--", lw=1, label="raw TCP (headline run)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (KiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op} (loopback, 2-core machine)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    names = ["pagekv", *data.get("peers", {}).keys()]
    puts = [head["put_gbps"], *(p["put_gbps"] for p in data.get("peers", {}).values())]
    gets = [head["get_gbps"], *(p["get_gbps"] for p in data.get("peers", {}).values())]
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], puts, 0.4, label="put")
    axes[2].bar([i + 0.2 for i in x], gets, 0.4, label="get")
    axes[2].set_xticks(list(x), names, rotation=20)
    axes[2].set_ylabel("GB/s")
    axes[2].set_title("64 blocks of 2 MiB, same run")
    axes[2].legend(fontsize=8)
    env = data["env"]
    fig.suptitle(f"{env['device']}, {env['date'][:10]}, commit {env['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
