"""What the engine contract's safe defaults cost: save (device -> host pages, until the copy is
done), load (host pages -> device, all layers) and layer-wise load, in interleaved rounds, for
the connector of whatever ``pagekv`` is importable (run it once per code version to compare;
docs/benchmarks.md). Write-back is off (``writes_to_store = False``): only the GPU path is timed.

    python scripts/bench_contract.py [--tokens 8192] [--rounds 9] [--label new]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store.launch import start_nodes


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    geo = KVGeometry(args.layers, 16, 8, 128, "bf16")
    pages = args.tokens // geo.page_size
    slots = args.tokens * 2
    shape = (geo.num_layers, slots, *geo.device_layer_shape)
    kv = [torch.randn(shape, device="cuda").to(geo.dtype) for _ in range(2)]
    (node,) = start_nodes(1, "--capacity", "64MiB")
    conn = KVConnector(geo, kv, node.address, host_pages=pages + 8,
                       namespace=KeyNamespace("bench-contract", geo))  # fmt: skip
    conn.writes_to_store = False  # time the GPU path only
    src = torch.randperm(slots)[: args.tokens]  # CPU slot tables, as engines hand them over
    dst = torch.randperm(slots)[: args.tokens]
    out: dict[str, list[float]] = {"save": [], "load": [], "load_async": []}
    try:
        for _ in range(args.rounds + 1):
            conn.cache.evict(1 << 30)
            tokens = torch.randint(0, 128_000, (args.tokens,)).tolist()
            out["save"].append(timed(lambda: conn.save(tokens, src)))
            handle = asyncio.run(conn.prefetch(tokens))
            assert handle.num_tokens == pages * geo.page_size
            out["load"].append(timed(lambda: conn.load(handle, dst)))

            def layerwise() -> None:
                layers = conn.load_async(handle, dst)
                for i in range(geo.num_layers):
                    layers.wait_layer(i)

            out["load_async"].append(timed(layerwise))
            conn.release(handle)
            torch.cuda.synchronize()
        nbytes = pages * geo.page_bytes
        row = {k: round(nbytes / statistics.median(v[1:]) / 1e9, 2) for k, v in out.items()}
        print(json.dumps({"label": args.label, "bytes": nbytes, "gbps": row}), flush=True)
    finally:
        conn.close()
        node.stop()


if __name__ == "__main__":
    main()
