"""``python -m pagekv.engine``: one engine process that runs a list of requests against store
nodes and prints one JSON line per request (its :meth:`Result.summary`), then one with the
engine's stats. Used by ``make demo`` and the multi-process tests.

    python -m pagekv.engine --store tcp://127.0.0.1:7400 --requests reqs.json [--dump DIR]

``reqs.json``: a list of ``{"name", "prompt": [token ids], "max_new_tokens", "reuse", "save"}``.
``--dump DIR`` writes each request's first-token logits and tokens to ``DIR/<name>.pt``.
The write-back is flushed before the process exits, so the next engine finds the pages.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pagekv.connector.policy import MODES, PolicyConfig
from pagekv.store import ClientConfig

from .config import PRESETS, EngineConfig, ModelConfig
from .engine import Engine
from .request import Request

__all__ = ["engine_config", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pagekv.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--store", required=True, help="comma-separated store node endpoints")
    ap.add_argument("--requests", required=True, help="JSON file: the list of requests")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--weights", help="a transformers-format model directory (instead of --preset)")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument(
        "--dtype", default="auto", help="fp32 / bf16 / fp16; auto: fp32 on CPU, bf16 on GPU"
    )
    ap.add_argument("--seed", type=int, default=0, help="random weights' seed")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-slots", type=int, default=16384)
    ap.add_argument("--host-pages", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=0, help="0: the engine's default")
    ap.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--policy", choices=MODES, default="auto")
    ap.add_argument("--threshold", type=float, default=1.0)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: default)")
    ap.add_argument("--dump", help="directory for <name>.pt files (logits and tokens)")
    poison = "fill the KV cache with NaN first: a slot read before written shows"
    ap.add_argument("--poison-cache", action="store_true", help=poison)
    return ap


def engine_config(args: argparse.Namespace) -> EngineConfig:
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu"
    )  # fmt: skip
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    model = ModelConfig.from_hf(args.weights) if args.weights else PRESETS[args.preset]
    invariant = {"auto": None, "on": True, "off": False}[args.batch_invariant]
    return EngineConfig(
        model, page_size=args.page_size, num_slots=args.num_slots, host_pages=args.host_pages,
        dtype=dtype, device=device, prefill_chunk=args.prefill_chunk, batch_invariant=invariant,
        seed=args.seed, weights=args.weights,
    )  # fmt: skip


def _emit(payload: dict) -> None:
    print(json.dumps(payload), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    requests = [Request(**r) for r in json.loads(Path(args.requests).read_text())]
    store = ClientConfig(tuple(args.store.split(",")), replicas=args.replicas, timeout_s=10.0)
    engine = Engine(engine_config(args), store,
                    policy=PolicyConfig(args.policy, args.threshold))  # fmt: skip
    try:
        if args.poison_cache:
            engine.cache.k.fill_(float("nan"))
            engine.cache.v.fill_(float("nan"))
        engine.warmup()
        _emit({"event": "ready", "config": engine.config.describe()})
        for request in requests:
            result = engine.generate(request)
            if args.dump:
                payload = {"logits": result.first_logits, "tokens": result.tokens}
                torch.save(payload, Path(args.dump) / f"{request.name}.pt")
            _emit({"event": "result", **result.summary()})
        engine.flush(timeout_s=120)
        _emit({"event": "stats", **engine.stats()})
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
