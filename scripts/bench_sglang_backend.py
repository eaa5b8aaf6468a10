"""What pagekv's SGLang backend costs over the bare store client: ``batch_get_v1`` into an SGLang
server's 2 GiB host pool against ``StoreClient.get_many`` of the same keys into the same page
regions, same run, one local node.

The cache is built as the server builds it (tests/engines/sglang_stack.py: the README's launch
line, SGLang's pool builders and ``create_tree_cache``) for a Llama-3-8B-shaped KV (32 layers,
8 KV heads of 128, bf16, 32-token pages: 4 MiB pages). Each round reads every 128-page batch
(SGLang's storage batch) once per side, sides alternating first; per side the median batch time
over the rounds. Runs in the SGLang venv (scripts/engines/setup_sglang.sh):

    PYTHONPATH=. $(bash scripts/engines/setup_sglang.sh) scripts/bench_sglang_backend.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _bench_util import git_commit  # noqa: E402

from pagekv.connector.sglang.pages import PoolPages  # noqa: E402
from pagekv.store import StoreClient  # noqa: E402
from pagekv.store.launch import start_nodes  # noqa: E402
from tests.engines import sglang_stack as st  # noqa: E402

LLAMA_8B_KV = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "intermediate_size": 128}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pages", type=int, default=512, help="pages read per round (4 MiB each)")
    args = ap.parse_args()
    (node,) = start_nodes(1, "--capacity", f"{args.pages * 4 + 512}MiB")
    try:
        with tempfile.TemporaryDirectory() as model_dir:
            st.write_model_config(model_dir, "mha")
            config = json.loads((Path(model_dir) / "config.json").read_text())
            (Path(model_dir) / "config.json").write_text(json.dumps({**config, **LLAMA_8B_KV}))
            flags = st.launch_flags(model_dir, [node.address], extra={"prefetch_threshold": 1})
            stack = st.build_cache("mha", st.server_args(model_dir, flags, page_size=32),
                                   max_total_tokens=args.pages * 16)  # fmt: skip
            try:
                result = measure(stack, node.address, args)
            finally:
                stack.close()
    finally:
        node.stop()
    print(json.dumps(result, indent=1))
    out = os.environ.get("RESULTS_DIR")
    if out:
        Path(out, "bench_sglang_backend.json").write_text(json.dumps(result, indent=1))
    return 0


def measure(stack: st.Stack, address: str, args: argparse.Namespace) -> dict:
    backend = stack.storage_backend
    pool = stack.host_pools["kv"]
    ps, n = pool.page_size, args.pages
    host = pool.alloc(n * ps)
    if host is None:
        raise SystemExit(f"the host pool holds fewer than {n} pages")
    pool.kv_buffer.view(torch.int64).random_()
    keys = [f"{i:064x}" for i in range(n)]
    batches = [(keys[i : i + 128], host[i * ps : (i + 128) * ps]) for i in range(0, n, 128)]
    for batch_keys, idx in batches:
        assert all(backend.batch_set_v1(batch_keys, idx))
    client = StoreClient(address)
    pages = PoolPages(pool)  # the same page regions the backend reads into
    plain = [(backend.store_keys(k), pages.sources(idx, len(k))) for k, idx in batches]
    sides = {
        "backend": lambda b: backend.batch_get_v1(*batches[b]),
        "client": lambda b: client.get_many(plain[b][0], into=plain[b][1]),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds + 1):  # round 0 warms up
        for b in range(len(batches)):
            for name in sorted(sides, reverse=r % 2 == 1):
                start = time.perf_counter()
                ok = sides[name](b)
                elapsed = time.perf_counter() - start
                assert all(ok)
                if r:
                    times[name].append(elapsed)
    client.close()
    batch_bytes = 128 * pages.format.page_bytes
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "bench": "sglang_backend",
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "page_bytes": batch_bytes // 128,
        "pages": n,
        "rounds": args.rounds,
        "gbps": {name: batch_bytes / m / 1e9 for name, m in medians.items()},
        "ratio_backend_to_client": medians["client"] / medians["backend"],
    }


if __name__ == "__main__":
    sys.exit(main())
