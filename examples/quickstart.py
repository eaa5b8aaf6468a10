"""The README's "Using it" example, runnable: one store node on loopback, an engine that saves a
prompt's KV, and a second engine that finds it, prefetches it and loads it layer by layer.

    python examples/quickstart.py            # CPU (torch path) or the GPU when there is one
"""

from __future__ import annotations

import asyncio
import time

import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store import ClientConfig
from pagekv.store.launch import start_nodes


def engine_cache(geo: KVGeometry, num_slots: int, device: str) -> tuple[torch.Tensor, ...]:
    """A layer-first K and V cache ``[num_layers, num_slots, heads, dim]``."""
    shape = (geo.num_layers, num_slots, *geo.device_layer_shape)
    return tuple(torch.randn(shape, device=device).to(geo.dtype) for _ in range(2))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geo = KVGeometry(num_layers=4, page_size=16, num_kv_heads=8, head_dim=128, dtype="bf16")
    (node,) = start_nodes(1, "--capacity", "256MiB")
    try:
        store = ClientConfig((node.address,), replicas=1)
        ns = KeyNamespace("quickstart-model", geo, tp_rank=0, tp_size=1)
        k_a, v_a = engine_cache(geo, 4096, device)
        k_b, v_b = engine_cache(geo, 4096, device)
        a = KVConnector(geo, (k_a, v_a), store, host_pages=256, namespace=ns)
        b = KVConnector(geo, (k_b, v_b), store, host_pages=256, namespace=ns)
        token_ids = list(range(1000, 1000 + 1024 + 5))  # 64 full pages and a partial one
        slots_a = torch.randperm(4096)[: len(token_ids)]

        saved = a.save(token_ids, slots_a)  # full pages; written back in the background
        a.flush_sync(timeout=60)  # (an engine never waits for this; the example does)
        print(f"engine A saved {saved.pages} pages")

        n = b.lookup(token_ids)  # tokens of the longest stored prefix
        handle = asyncio.run(b.prefetch(token_ids, deadline=time.monotonic() + 5.0))
        slots_b = torch.randperm(4096)[: handle.num_tokens]
        layers = b.load_async(handle, slots_b)  # layer i copies while layer i-1 computes
        for i in range(geo.num_layers):
            layers.wait_layer(i)  # ... attention for layer i would run here
        b.release(handle)  # safe at once: pages are freed only after the copies
        if device == "cuda":
            torch.cuda.synchronize()
        same = torch.equal(k_b[:, slots_b].cpu(), k_a[:, slots_a[:n]].cpu()) and torch.equal(
            v_b[:, slots_b].cpu(), v_a[:, slots_a[:n]].cpu()
        )
        print(f"engine B found {n} tokens, loaded {handle.num_tokens}; identical: {same}")
        b.save(token_ids, slots_b)  # B's own pages: already stored, nothing new is written
        b.flush_sync(timeout=60)
        a.close()
        b.close()
        if not same or n != 1024:
            raise SystemExit("quickstart FAILED")
    finally:
        node.stop()


if __name__ == "__main__":
    main()
