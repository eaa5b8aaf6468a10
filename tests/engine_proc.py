"""A toy engine process for the multi-process connector tests: a layer-first KV cache filled
from a seed, a KVConnector, and one role: save a prompt, or look it up, prefetch and load it
and compare bit for bit with the cache the seed describes. Prints one JSON line."""

import asyncio
import json
import sys

import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store.backend import store_config

GEO = KVGeometry(4, 16, 2, 64, "bf16")
SLOTS = 4096


def seeded(seed: int, num_tokens: int):
    g = torch.Generator().manual_seed(seed)
    shape = (GEO.num_layers, SLOTS, GEO.row_elems * 2)
    caches = [torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) for _ in range(2)]
    caches = [
        c.view(GEO.dtype).view(GEO.num_layers, SLOTS, *GEO.device_layer_shape) for c in caches
    ]
    tokens = torch.randint(0, 32000, (num_tokens,), generator=g).tolist()
    slots = torch.randperm(SLOTS, generator=g)[:num_tokens]
    return caches, tokens, slots


def main() -> None:
    role, endpoints, replicas, seed, num_tokens = sys.argv[1:6]
    cfg = store_config(endpoints.split(" "), replicas=int(replicas), timeout_s=2.0)
    src, tokens, src_slots = seeded(int(seed), int(num_tokens))
    ns = KeyNamespace("toy-model", GEO)
    if role == "save":
        conn = KVConnector(GEO, src, cfg, host_pages=512, namespace=ns)
        saved = conn.save(tokens, src_slots).pages
        conn.flush_sync(timeout=60)
        out = dict(saved=saved, **{k: v for k, v in conn.stats().items() if k != "store"})
    else:
        dst = [torch.full_like(c.view(torch.int16), -0x5A5B).view(GEO.dtype) for c in src]
        conn = KVConnector(GEO, dst, cfg, host_pages=512, namespace=ns)
        conn.connect(timeout_s=10)  # at start-up, as an engine does: lookups are bounded
        found = conn.lookup(tokens)
        handle = asyncio.run(conn.prefetch(tokens))
        dst_slots = torch.randperm(SLOTS)[: handle.num_tokens]
        conn.load(handle, dst_slots)
        n = handle.num_tokens
        equal = all(
            torch.equal(d[:, dst_slots].view(torch.int16), s[:, src_slots[:n]].view(torch.int16))
            for d, s in zip(dst, src)
        )
        conn.release(handle)
        out = dict(lookup=found, prefetched=n, equal=equal, fetched=handle.fetched)
    conn.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
