"""Connector benchmark: a long prompt (32k tokens, Llama-3-8B geometry by default) saved by one
engine and brought back by another, against the raw store and kernel figures of the same run.

Measures: save (device -> host pool + write-back to the store), lookup latency, prefetch from
one node and from three (store -> pinned host pages), load (host -> device, all layers), prefetch
with ``device_slots`` (the load overlapped with the fetch, until the last chunk has landed) and
in the same run a raw ``StoreClient.get_many`` of the same bytes and a contiguous host->device
copy of the same bytes.

    python scripts/bench_connector.py [--tokens 32768] [--layers 32] [--shm]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from _bench_util import FULL_COLLECTIONS, engine_heap, environment, parse_args, write_result
from _ceilings import memcpy_ceiling, tcp_ceiling

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store import AsyncStoreClient, ClientConfig, StoreClient
from pagekv.store.launch import start_nodes
from pagekv.store.node.memory import tune_malloc_for_blocks


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 1) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


async def _async_gets(cfg: ClientConfig, keys: list, views: list, reps: int) -> list[float]:
    client, times, arrived = AsyncStoreClient(cfg.endpoints, config=cfg), [], []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            ok = await client.get_many(keys, into=views, on_arrival=arrived.append)
            times.append(time.perf_counter() - t)
            if not all(ok):
                raise RuntimeError("raw async get missed pages")
    finally:
        client.close()
    return times


def run(args, num_nodes: int) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geo = KVGeometry(args.layers, args.page_size, 8, 128, "bf16")
    n_pages = args.tokens // geo.page_size
    slots = args.tokens + 64
    cap = f"{int(n_pages * geo.page_bytes * 1.2 / num_nodes) + (256 << 20)}"
    nodes = start_nodes(num_nodes, "--capacity", cap, *(["--shm"] if args.shm else []))
    try:
        warmed = sum(node.warmed() for node in nodes)  # as nodes that have served a while
        cfg = ClientConfig(tuple(n.address for n in nodes), timeout_s=60, streams=args.streams)
        shape = (geo.num_layers, slots, *geo.device_layer_shape)
        src = [torch.randn(shape, device=device).to(geo.dtype) for _ in range(2)]
        dst = [torch.zeros(shape, device=device, dtype=geo.dtype) for _ in range(2)]
        ns = KeyNamespace(f"bench-{num_nodes}", geo)
        a = KVConnector(geo, src, cfg, host_pages=n_pages + 8, namespace=ns)
        b = KVConnector(geo, dst, cfg, host_pages=n_pages + 8, namespace=ns)
        tokens = torch.randint(0, 128_000, (args.tokens,)).tolist()
        slot_ids = torch.randperm(slots, device=device)[: args.tokens]
        r: dict = dict(nodes=num_nodes, tokens=args.tokens, bytes=n_pages * geo.page_bytes,
                       streams=cfg.streams, copy_threads=cfg.copy_threads,
                       nodes_warmed_bytes=warmed)  # fmt: skip
        engine_heap()  # the set-up is done: from here on this process is a started engine
        collections_before = len(FULL_COLLECTIONS.pauses_ms)
        r["save_to_host_s"], _ = timed(lambda: a.save(tokens, slot_ids))
        r["writeback_s"], _ = timed(lambda: a.flush_sync(timeout=600))
        r["lookup_ms"] = timed(lambda: b.lookup(tokens), reps=20)[0] * 1e3
        cold, memcpy8 = [], []
        for _ in range(5):  # from the store each time: the host tier is emptied between rounds
            # (the first two warm the processes' heaps: see docs/benchmarks.md); the 8-thread
            # memcpy ceiling just before each (the host's memory bandwidth moves 2x in minutes)
            b.cache.evict(n_pages + 8)
            memcpy8.append(memcpy_ceiling(8, 32 << 20, 4))
            seconds, handle = timed(lambda: asyncio.run(b.prefetch(tokens)))
            if handle.num_tokens != n_pages * geo.page_size or handle.fetched != n_pages:
                raise RuntimeError(f"prefetched only {handle.num_tokens} tokens")
            cold.append(seconds)
            if len(cold) < 5:
                b.release(handle)
        r["prefetch_first_s"] = cold[0]
        r["prefetch_s"] = statistics.median(cold[2:])
        r["memcpy8_rounds_gbps"] = [round(g, 3) for g in memcpy8]
        r["prefetch_vs_memcpy8_paired"] = round(statistics.median(
            r["bytes"] / s / 1e9 / g for s, g in zip(cold[2:], memcpy8[2:])), 3)  # fmt: skip
        r["load_s"] = timed(lambda: b.load(handle, slot_ids), reps=5)[0]
        b.release(handle)
        # prefetch with device_slots (overlapped load): from the call until every chunk has
        # landed (timed() synchronises), cold from the store each round like prefetch_s
        overlapped = []
        for _ in range(5):
            b.cache.evict(n_pages + 8)
            seconds, h = timed(lambda: asyncio.run(b.prefetch(tokens, device_slots=slot_ids)))
            if h.loaded_tokens != n_pages * geo.page_size or h.fetched != n_pages:
                raise RuntimeError(f"overlapped prefetch loaded only {h.loaded_tokens} tokens")
            overlapped.append(seconds)
            b.release(h)
        r["prefetch_overlap_load_s"] = statistics.median(overlapped[2:])
        separate = r["prefetch_s"] + r["load_s"]
        r["overlap_vs_separate"] = round(r["prefetch_overlap_load_s"] / separate, 3)
        r["prefetch_host_hit_s"], again = timed(lambda: asyncio.run(b.prefetch(tokens)))
        b.release(again)
        # same run: the raw store and a contiguous copy of the same bytes
        keys = b.keys(tokens)
        with StoreClient(cfg.endpoints, config=cfg) as raw:  # the same settings (streams)
            views = [b.pool.page_view(p) for p in range(n_pages)]
            r["raw_store_get_s"] = timed(lambda: raw.get_many(keys, into=views), reps=3)[0]
        # the connector's kind of client (asyncio) with a per-key callback, no connector
        r["raw_async_get_s"] = statistics.median(asyncio.run(_async_gets(cfg, keys, views, 3)))
        # a separate pinned buffer: one cudaMemcpyAsync may not span the pool's registered
        # 1 GiB chunks (the kernels, which address pages, are not affected)
        flat_host = torch.empty(n_pages * geo.page_bytes, dtype=torch.uint8)
        if device == "cuda":
            flat_host = flat_host.pin_memory()
        flat_dev = torch.empty_like(flat_host, device=device)
        r["contiguous_copy_s"] = timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), 5)[0]
        for key in ("prefetch_s", "raw_store_get_s", "raw_async_get_s", "load_s",
                    "contiguous_copy_s",
                    "prefetch_overlap_load_s"):  # fmt: skip
            r[key.removesuffix("_s") + "_gbps"] = round(r["bytes"] / r[key] / 1e9, 3)
        r["prefetch_vs_raw_get"] = round(r["raw_store_get_s"] / r["prefetch_s"], 3)
        r["load_vs_copy"] = round(r["contiguous_copy_s"] / r["load_s"], 3)
        r["gc_full_ms"] = [round(ms, 1) for ms in FULL_COLLECTIONS.pauses_ms[collections_before:]]
        a.close()
        b.close()
        print(f"connector {num_nodes} node(s): {r}", flush=True)
        return r
    finally:
        for node in nodes:
            node.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--nodes", default="1,3")
    ap.add_argument("--shm", action="store_true", help="nodes with --shm (same-host shortcut)")
    ap.add_argument("--streams", type=int, default=None,
                    help="client connections per node (default: ClientConfig's)")  # fmt: skip
    args = parse_args(ap)
    tune_malloc_for_blocks()
    env = environment()
    print(f"# {env['device']}, {env['cpu_count']} cpus, commit {env['commit']}", flush=True)
    # the ceilings, measured in this run: 8-stream loopback TCP (hot: one buffer per
    # side; cold: every block from and into its own memory) and 8-thread memcpy
    mib2 = 2 << 20
    ceilings = dict(tcp8_gbps=tcp_ceiling(8, mib2, 32, 3)[1],
                    tcp8_cold_gbps=tcp_ceiling(8, mib2, 32, 3, cold=True)[1],
                    memcpy8_gbps=memcpy_ceiling(8, 32 << 20, 4))  # fmt: skip
    ceilings = {k: round(v, 3) for k, v in ceilings.items()}
    print(f"ceilings {ceilings}", flush=True)
    rows = [run(args, int(n)) for n in args.nodes.split(",")]
    for r in rows:
        for name, value in ceilings.items():
            r["prefetch_vs_" + name.removesuffix("_gbps")] = round(r["prefetch_gbps"] / value, 3)
    name = "bench_connector_shm" if args.shm else "bench_connector"
    result = dict(args=vars(args), ceilings=ceilings, rows=rows)
    print(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
