"""pagekv demo: two engines share a long prompt's KV through local store nodes.

Starts store nodes on loopback (`pagekv serve`), then engine A computes (here: random) KV for
a long prompt and saves it; engine B, with its own cache, looks the prompt up, prefetches its
pages from the store and loads them into different slots, then checks every byte. On a GPU
the caches live on it and the CUDA kernels move the pages; elsewhere the torch path runs.

    make demo            # or: python scripts/demo.py [--tokens 8192] [--nodes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store import ClientConfig
from pagekv.store.launch import start_nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geo = KVGeometry(num_layers=8, page_size=16, num_kv_heads=8, head_dim=128, dtype="bf16")
    num_slots = args.tokens + 1024
    print(f"geometry: {geo.describe()}; {args.tokens} tokens on {device}")
    nodes = start_nodes(args.nodes, "--capacity", "1GiB")
    try:
        cfg = ClientConfig(tuple(n.address for n in nodes), replicas=args.replicas, timeout_s=10)
        print(f"store nodes: {', '.join(cfg.endpoints)}")
        shape = (geo.num_layers, num_slots, *geo.device_layer_shape)
        src = [torch.randn(shape, device=device).to(geo.dtype) for _ in range(2)]
        dst = [torch.full(shape, float("nan"), device=device).to(geo.dtype) for _ in range(2)]
        ns = KeyNamespace("demo-model", geo)
        pages = args.tokens // geo.page_size + 8
        a = KVConnector(geo, src, cfg, host_pages=pages, namespace=ns)
        b = KVConnector(geo, dst, cfg, host_pages=pages, namespace=ns)
        tokens = torch.randint(0, 128_000, (args.tokens,)).tolist()
        slots_a = torch.randperm(num_slots)[: args.tokens]
        t = time.perf_counter()
        saved = a.save(tokens, slots_a).pages
        a.flush_sync(timeout=120)
        print(
            f"engine A: saved {saved} pages and wrote them back in {time.perf_counter() - t:.2f} s"
        )
        t = time.perf_counter()
        hit = b.lookup(tokens)
        ms = (time.perf_counter() - t) * 1e3
        print(f"engine B: lookup {hit} of {args.tokens} tokens in {ms:.1f} ms")
        t = time.perf_counter()
        handle = asyncio.run(b.prefetch(tokens))
        fetch_s = time.perf_counter() - t
        mib = handle.fetched * geo.page_bytes / 2**20
        print(f"engine B: prefetched {handle.num_tokens} tokens ({mib:.0f} MiB) in {fetch_s:.2f} s")
        slots_b = torch.randperm(num_slots)[: handle.num_tokens]
        t = time.perf_counter()
        b.load(handle, slots_b)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"engine B: loaded into its cache in {(time.perf_counter() - t) * 1e3:.1f} ms")
        n = handle.num_tokens
        same = all(
            torch.equal(d[:, slots_b].view(torch.int16), s[:, slots_a[:n]].view(torch.int16))
            for d, s in zip(dst, src)
        )
        b.release(handle)
        print(f"bit-identical: {same}")
        print(f"engine B stats: { {k: v for k, v in b.stats().items() if k != 'store'} }")
        a.close()
        b.close()
        if not same or n != args.tokens // geo.page_size * geo.page_size:
            raise SystemExit("demo FAILED")
        print("demo OK")
    finally:
        for node in nodes:
            node.stop()


if __name__ == "__main__":
    main()
