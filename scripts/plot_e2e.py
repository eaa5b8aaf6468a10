"""Markdown table (stdout) and PNG of the end-to-end benchmark (scripts/bench_e2e.py): time to
first token per model and prompt length for recompute, host-tier, store and policy; decode
tokens/s with and without background saves.

    python scripts/plot_e2e.py [benchmarks/results/bench_e2e.json] [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCENARIOS = ("recompute", "host", "store", "policy")


def table(data: dict) -> str:
    env = data["env"]
    lines = [
        f"{env['device']}, torch {env['torch']}, commit {env['commit']}, {env['date']}",
        "",
        "| model | tokens | recompute ms | host ms (x) | store ms (x) | store GB/s | policy ms "
        "(fetched) | decode tok/s | with saves |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in data["models"]:
        for row in model["lengths"]:
            t, r, d = row["ttft_ms"], row["ratio_to_recompute"], row["decode"]
            fetched = sum(x["fetch"] for x in row["policy_decisions"])
            gbps = row["store_fetch_gbps"]
            gbps = "n/a" if gbps is None else f"{gbps:.2f}"
            lines.append(
                f"| {model['model']} | {row['prompt_tokens']} | {t['recompute']:.1f} | "
                f"{t['host']:.1f} ({r['host']:.3f}) | {t['store']:.1f} ({r['store']:.3f}) | "
                f"{gbps} | {t['policy']:.1f} "
                f"({fetched}/{len(row['policy_decisions'])}) | "
                f"{d['tokens_per_s']['saves_off']:.1f} | {d['tokens_per_s']['saves_on']:.1f} "
                f"({d['slowdown']:+.1%}) |"
            )
    return "\n".join(lines)


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = data["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = model["lengths"]
        width = 0.2
        for i, name in enumerate(SCENARIOS):
            xs = [j + (i - 1.5) * width for j in range(len(rows))]
            ax.bar(xs, [r["ttft_ms"][name] for r in rows], width, label=name)
        ax.set_xticks(range(len(rows)), [f"{r['prompt_tokens'] / 1024:g}k" for r in rows])
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens (prefix + a new question)")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(model["model"])
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"pagekv end to end, {data['env']['device']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    root = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "bench_e2e.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    print(table(data))
    plot(data, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
