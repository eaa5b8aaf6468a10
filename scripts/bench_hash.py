"""Prefix page hashing speed: tokens/s for a long prompt (target: 128k tokens, 16-token pages,
under 10 ms on the 2-core dev machine). Medians over repeated runs; one JSON per run."""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
from _bench_util import environment, parse_args, write_result

from pagekv.connector import KeyNamespace, KVGeometry, page_keys


def time_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128 * 1024)
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--repeat", type=int, default=21)
    args = parse_args(ap)

    toks = [random.randrange(128_256) for _ in range(args.tokens)]
    inputs = {
        "list": toks,
        "numpy int64": np.array(toks, dtype=np.int64),
        "torch int64": torch.tensor(toks, dtype=torch.int64),
    }
    rows = []
    for page in map(int, args.page_sizes.split(",")):
        ns = KeyNamespace("bench-model", KVGeometry(32, page, 8, 128, "bf16"))
        for kind, data in inputs.items():
            ms = time_ms(lambda d=data, n=ns: page_keys(d, n), args.repeat)
            rows.append(
                {
                    "page_size": page,
                    "input": kind,
                    "median_ms": round(ms, 3),
                    "mtokens_per_s": round(args.tokens / ms / 1e3, 1),
                }
            )
    env = environment()
    print(f"# {env['device']}, {env['date']}, commit {env['commit']}; {args.tokens} tokens")
    print("| page size | input | median ms | M tokens/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['page_size']} | {r['input']} | {r['median_ms']:.2f} | {r['mtokens_per_s']} |")
    path = write_result("bench_hash", {"tokens": args.tokens, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
