"""PNG of the kernel benchmark: GB/s against page size per geometry, with the copy ceiling.

python scripts/plot_kernels.py [benchmarks/results/bench_kernels.json] [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SERIES = [
    ("ceiling_h2d_gbps", "contiguous pinned copy H2D (ceiling)", "k--"),
    ("kernel_load_gbps", "pagekv kernel load (4 blocks)", "C0-o"),
    ("kernel_save_gbps", "pagekv kernel save (8 blocks)", "C1-s"),
    ("staged_load_gbps", "staging copy + GPU scatter", "C2-^"),
    ("direct_load_gbps", "direct memcpy per page run", "C3-v"),
    ("per_page_load_gbps", "per-page torch copies", "C4-x"),
]


RATIOS = [
    ("kernel_load_ratio", "kernel load / H2D copy", "C0-o"),
    ("kernel_save_ratio", "kernel save / D2H copy", "C1-s"),
    ("staged_load_ratio", "staged / H2D copy", "C2-^"),
]


def main() -> None:
    root = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "bench_kernels.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    rows = data["transfers"]
    names = list(dict.fromkeys(r["geometry"] for r in rows))
    fig, grid = plt.subplots(2, len(names), figsize=(6 * len(names), 8), sharey="row")
    for ax, name in zip(grid[1], names):  # bottom row: fraction of the ceiling, linear
        sel = [r for r in rows if r["geometry"] == name]
        for key, label, style in RATIOS:
            pts = [(r["page_size"], r[key]) for r in sel if key in r]
            ax.plot(*zip(*pts), style, label=label, markersize=4)
        ax.axhline(0.9, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("page size (tokens)")
        ax.grid(True, alpha=0.3)
    grid[1][0].set_ylabel("fraction of the contiguous copy (same run)")
    grid[1][0].legend(fontsize=8, loc="lower right")
    axes = grid[0]
    for ax, name in zip(axes, names):
        sel = [r for r in rows if r["geometry"] == name]
        for key, label, style in SERIES:
            pts = [(r["page_size"], r[key]) for r in sel if key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("page size (tokens)")
        ax.set_title(f"{name}: {sel[0]['item_bytes']} B rows, {sel[0]['mib']:.0f} MiB moved")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8, loc="lower right")
    env = data["env"]
    fig.suptitle(f"{env['device']}, torch {env['torch']}, {env['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
