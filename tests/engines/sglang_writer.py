"""The writing process of test_sglang.py's two-process test: its own SGLang host pool and
controller back pages up to a pagekv node; it writes what it stored (tokens, page bytes as
SGLang's ``get_data_page`` reads them) to ``--out`` for the reading process to compare.

    python -m tests.engines.sglang_writer --store tcp://127.0.0.1:PORT --layout page_first \\
        --dtype bfloat16 --pages 40 --seed 123 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import sglang_harness as h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--pages", type=int, default=40)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    pool = h.mha_pool(args.layout, pages=args.pages, dtype=getattr(torch, args.dtype))
    ctl = h.Controller(pool, h.extra_config([args.store]))
    try:
        tokens = h.random_tokens(args.pages * pool.page_size, gen)
        src = pool.alloc(len(tokens))
        h.fill_random(pool, src, gen)
        written = ctl.backup(src, tokens)
        pages = h.page_bytes(pool, src)
    finally:
        ctl.close()
    with open(args.out + ".json", "w") as f:
        json.dump({"tokens": tokens, "written": written, "page_bytes": len(pages[0])}, f)
    with open(args.out + ".bin", "wb") as f:
        f.write(b"".join(pages))
    return 0 if written == len(tokens) else 1


if __name__ == "__main__":
    sys.exit(main())
