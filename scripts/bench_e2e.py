"""End-to-end time to first token with the reference engine (pagekv.engine, random weights):

  (a) recompute   the whole prompt prefilled, nothing reused (its pages are saved);
  (b) host        the prefix in the engine's host tier (layer-wise load, suffix prefill);
  (c) store       the prefix only in a store node on this machine (TCP): fetched, then (b);
  (d) policy      an engine whose fetch-or-recompute policy (measured bandwidth and prefill
                  speed) chooses between (c) and recomputing;

and decode tokens/s right after a prefill with the prompt's save (device -> host copy and
write-back to the store) running in the background, against the same without a save.

Each prompt is a shared prefix plus a ``--question-tokens`` suffix; every repetition uses a
fresh random prefix (a cold store and host tier for it). Times are medians over ``--reps``.

    python scripts/bench_e2e.py                # GPU: Llama-3.2-1B and Llama-3-8B shapes, bf16,
                                               # 4k/16k/32k tokens (~2-4 min on an H100)
    python scripts/bench_e2e.py --quick        # CPU, tiny model, seconds
    python scripts/bench_e2e.py --out r.json   # also $RESULTS_DIR/bench_e2e.json (gpu_check.sh),
                                               # or benchmarks/results/ with --save
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import time
from pathlib import Path

import _bench_util
import torch

from pagekv.connector.policy import PolicyConfig
from pagekv.engine import PRESETS, Engine, EngineConfig, Request, Result
from pagekv.store import ClientConfig
from pagekv.store.launch import start_nodes


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, small prompts")
    ap.add_argument("--models", help="presets, comma-separated (default llama-3.2-1b,llama-3-8b)")
    ap.add_argument("--tokens", help="prompt lengths, comma-separated (default 4096,16384,32768)")
    ap.add_argument("--question-tokens", type=int, default=0, help="suffix after the prefix")
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--decode-tokens", type=int, default=0)
    ap.add_argument("--decode-pairs", type=int, default=0, help="saves off/on pairs (default 5)")
    ap.add_argument("--eager-decode", action="store_true",
                    help="launch decode steps from Python (no CUDA graphs)")  # fmt: skip
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=1, help="store nodes (this machine, TCP)")
    ap.add_argument("--shm", action="store_true", help="nodes with --shm (same-host shortcut)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", help="also write the JSON result to this file")
    args = _bench_util.parse_args(ap)  # adds --save
    quick = args.quick
    args.device = args.device if args.device != "auto" else (
        "cpu" if quick or not torch.cuda.is_available() else "cuda"
    )  # fmt: skip
    if args.device == "cpu" and not (quick or args.models):
        ap.error("no GPU here: --quick runs a tiny model on CPU (or name --models)")
    args.models = (args.models or ("tiny" if quick else "llama-3.2-1b,llama-3-8b")).split(",")
    lengths = args.tokens or ("512,1024" if quick else "4096,16384,32768")
    args.tokens = [int(t) for t in lengths.split(",")]
    args.question_tokens = args.question_tokens or (32 if quick else 128)
    args.reps = args.reps or (1 if quick else 3)
    args.decode_tokens = args.decode_tokens or (8 if quick else 128)
    args.decode_pairs = args.decode_pairs or (1 if quick else 5)
    if args.device == "cpu" and "tiny" in args.models:
        torch.set_num_threads(1)  # a tiny model's matmuls are too small to split
    return args


def engine_config(model: str, args: argparse.Namespace, host_pages: int) -> EngineConfig:
    longest = max(args.tokens) + args.decode_tokens + args.page_size
    dtype = "bf16" if args.device == "cuda" else "fp32"
    graphs = args.device == "cuda" and not args.eager_decode
    return EngineConfig(PRESETS[model], page_size=args.page_size, num_slots=longest,
                        host_pages=host_pages, dtype=dtype, device=args.device,
                        decode_graphs=graphs)  # fmt: skip


def ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def logits_diff(a: Result, b: Result) -> dict:
    """How far a reuse's first-token logits are from a recompute of the same prompt."""
    diff = (a.first_logits - b.first_logits).abs().max().item()
    return {"max_abs_diff": diff, "max_abs_logit": b.first_logits.abs().max().item(),
            "bit_identical": bool(torch.equal(a.first_logits, b.first_logits)),
            "first_token_equal": a.tokens[0] == b.tokens[0]}  # fmt: skip


class Prompts:
    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()


def run_length(engines: dict, length: int, args: argparse.Namespace, rand: Prompts) -> dict:
    """(a)-(d) at one prompt length, ``args.reps`` times with fresh prefixes."""
    writer, always, auto = engines["writer"], engines["always"], engines["auto"]
    q = args.question_tokens
    t: dict[str, list[float]] = {k: [] for k in ("recompute", "host", "store", "policy")}
    out: dict = {"prompt_tokens": length, "prefix_tokens": length - q, "policy_decisions": []}
    flush_s: list[float] = []
    fetch: list[float] = []  # store fetch bandwidth (bytes/s) of each repetition that fetched
    for rep in range(args.reps):
        prefix = rand(length - q)
        a = writer.generate(Request(prefix + rand(q), 1, reuse=False))
        start = time.perf_counter()
        writer.flush(timeout_s=300)
        flush_s.append(time.perf_counter() - start)
        prompt_b = prefix + rand(q)
        b = writer.generate(Request(prompt_b, 1, save=False))
        c = always.generate(Request(prefix + rand(q), 1, save=False))
        d = auto.generate(Request(prefix + rand(q), 1, save=False))
        for key, r in (("recompute", a), ("host", b), ("store", c), ("policy", d)):
            t[key].append(r.ttft_s)
        if c.reused_store != out["prefix_tokens"] // args.page_size * args.page_size:
            out.setdefault("warnings", []).append(f"rep {rep}: store hit {c.reused_store}")
        if c.reused_store:  # a skipped or failed lookup fetched nothing: no bandwidth sample
            fetch.append(c.reused_store * writer.geometry.bytes_per_token / c.prefetch_s)
        out["policy_decisions"].append({k: d.decision[k] for k in (
            "fetch", "reason", "predicted_fetch_s", "predicted_recompute_s")}
            | {"reused_store": d.reused_store})  # fmt: skip
        if rep == 0:  # reuse against a recompute of the very same prompt (bf16: rounding)
            full = writer.generate(Request(prompt_b, 1, reuse=False, save=False))
            out["host_vs_recompute_logits"] = logits_diff(b, full)
            out["breakdown_ms"] = {
                name: {k: round(getattr(r, k) * 1e3, 3) for k in
                       ("lookup_s", "prefetch_s", "load_s", "load_stall_s", "prefill_s")}
                for name, r in (("host", b), ("store", c))
            }  # fmt: skip
    out["ttft_ms"] = {k: ms(v) for k, v in t.items()}
    out["ttft_ms_all"] = {k: [round(x * 1e3, 3) for x in v] for k, v in t.items()}
    rec = out["ttft_ms"]["recompute"]
    out["ratio_to_recompute"] = {k: round(v / rec, 4) for k, v in out["ttft_ms"].items()}
    out["store_fetch_gbps"] = round(statistics.median(fetch) / 1e9, 3) if fetch else None
    if not fetch:
        out["store_fetch_gbps_why_null"] = "no repetition fetched from the store"
    out["writeback_gbps"] = round(length * writer.geometry.bytes_per_token
                                  / statistics.median(flush_s) / 1e9, 3)  # fmt: skip
    out["kv_bytes"] = length * writer.geometry.bytes_per_token
    return out


def run_decode(writer: Engine, length: int, args: argparse.Namespace, rand: Prompts) -> dict:
    """Decode tokens/s after a fresh prefill, with its save running in the background (device
    -> host copy and write-back to the store) and without a save; after one untimed warm-up
    (its first decode pays one-time costs, and captures the decode graph of this length),
    ``--decode-pairs`` alternated pairs. The slowdown is the median over pairs of each pair's
    own ratio: this host drifts between minutes, far less within one pair."""
    runs: dict[str, list[dict]] = {"saves_off": [], "saves_on": []}
    writer.generate(Request(rand(length), args.decode_tokens, reuse=False, save=True))
    writer.flush(timeout_s=300)
    for save in (False, True) * args.decode_pairs:
        r = writer.generate(Request(rand(length), args.decode_tokens, reuse=False, save=save))
        pending = writer.connector.stats()["writeback_queue_pages"]
        start = time.perf_counter()
        writer.flush(timeout_s=300)
        runs["saves_on" if save else "saves_off"].append(
            {"tokens_per_s": round(r.decode_tokens_per_s, 2), "saved_pages": r.saved_pages,
             "decode_ms": round(r.decode_s * 1e3, 2), "writeback_pages_pending_after": pending,
             "writeback_left_ms": round((time.perf_counter() - start) * 1e3, 2)}
        )  # fmt: skip
    tps = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    pairs = [1 - on["tokens_per_s"] / off["tokens_per_s"]
             for off, on in zip(runs["saves_off"], runs["saves_on"])]  # fmt: skip
    graphs = writer.graphs
    return {"tokens_per_s": tps, "runs": runs, "pair_slowdowns": [round(x, 4) for x in pairs],
            "slowdown": round(statistics.median(pairs), 4), "decode_graphs": graphs is not None,
            "graph_captures": graphs.captures if graphs is not None else 0}  # fmt: skip


def run_model(model: str, args: argparse.Namespace) -> dict:
    geo_bytes = EngineConfig(PRESETS[model], page_size=args.page_size, dtype="bf16").geometry
    host_pages = (max(args.tokens) + args.question_tokens) // args.page_size + 256
    capacity = 6 * max(args.tokens) * geo_bytes.bytes_per_token * (2 if args.quick else 1)
    shm = ["--shm"] if args.shm else []
    nodes = start_nodes(args.nodes, "--capacity", str(max(capacity, 1 << 30)), *shm)
    engines: dict[str, Engine] = {}
    try:
        store = ClientConfig(tuple(n.address for n in nodes), timeout_s=30.0)
        cfg = engine_config(model, args, host_pages)
        writer = engines["writer"] = Engine(cfg, store)
        engines["always"] = Engine(cfg, store, policy=PolicyConfig("always"), model=writer.model)
        engines["auto"] = Engine(cfg, store, policy=PolicyConfig("auto"), model=writer.model)
        print(f"{cfg.describe()}; {args.nodes} store node(s)", flush=True)
        rand = Prompts(cfg.model.vocab_size, 1234)
        for e in engines.values():
            e.warmup(max(1024, min(args.tokens)))  # 1024: the policy's least sample
        warm = rand(min(args.tokens))  # measures the auto engine's store bandwidth (a probe)
        writer.generate(Request(warm, 1, reuse=False))
        writer.flush(timeout_s=300)
        for name in ("always", "auto"):
            engines[name].generate(Request(warm, 1, save=False))
        result = {"model": model, "config": cfg.describe(), "lengths": []}
        for length in args.tokens:
            row = run_length(engines, length, args, rand)
            row["decode"] = run_decode(writer, length, args, rand)
            result["lengths"].append(row)
            print_row(row)
        result["policy_stats"] = engines["auto"].stats()["policy"]
        return result
    finally:
        for e in engines.values():
            e.close(timeout_s=30)
        for n in nodes:
            n.stop()
        engines.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def print_row(row: dict) -> None:
    t, r, d = row["ttft_ms"], row["ratio_to_recompute"], row["decode"]
    chose = sum(x["fetch"] for x in row["policy_decisions"])
    print(f"  {row['prompt_tokens']:>6} tokens: recompute {t['recompute']:.1f} ms | host "
          f"{t['host']:.1f} ms ({r['host']:.3f}x) | store {t['store']:.1f} ms ({r['store']:.3f}x,"
          f" {row['store_fetch_gbps']} GB/s) | policy {t['policy']:.1f} ms (fetched "
          f"{chose}/{len(row['policy_decisions'])}) | decode {d['tokens_per_s']['saves_off']:.1f} "
          f"tok/s, with saves {d['tokens_per_s']['saves_on']:.1f} ({d['slowdown']:+.1%} slower)",
          flush=True)  # fmt: skip


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    models = [run_model(m, args) for m in args.models]
    payload = {"args": {k: v for k, v in vars(args).items()},
               "wall_s": round(time.perf_counter() - started, 1), "models": models}  # fmt: skip
    path = _bench_util.write_result("bench_e2e", payload)  # $RESULTS_DIR, --save or a temp dir
    if args.out and Path(args.out).resolve() != Path(path).resolve():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, args.out)
    print(f"wrote {args.out or path} ({payload['wall_s']} s)")


if __name__ == "__main__":
    main()
