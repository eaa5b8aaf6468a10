"""Where a connector prefetch spends its threads' time, against a raw get of the same pages.

Starts N local nodes, saves a prompt through one connector, then either prefetches it again and
again through a second one (``prefetch``) or reads the same keys with an AsyncStoreClient into
the same pages (``raw``). Each round prints GB/s and the CPU each group of threads used, in
cores (from /proc/*/task/*/schedstat: this process's threads grouped by Python thread name,
the nodes' by OS thread name, summed over nodes), and the busiest single thread of each side.
Run it under py-spy to see who holds the GIL:

    py-spy record --gil --threads -r 200 -f raw -o gil.txt -- \
        python scripts/diag_connector.py prefetch --nodes 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import threading
import time

import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store import AsyncStoreClient, ClientConfig
from pagekv.store.launch import start_nodes
from pagekv.store.node.memory import tune_malloc_for_blocks


def thread_times(pids: tuple[int, ...] = ()) -> dict[str, tuple[str, int]]:
    """Per OS thread of this process (or of ``pids``): (group name, CPU ns). This process's
    threads are grouped by Python thread name without its number; other processes' by their
    OS name (``python3`` for every Python thread, ``ZMQbg/IO/n`` for libzmq's)."""
    names = {str(t.native_id): t.name.split("_")[0].rstrip("0123456789-")
             for t in threading.enumerate()}  # fmt: skip
    out = {}
    for pid in pids or ("self",):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip().rstrip("0123456789")
            except OSError:  # the thread ended meanwhile
                continue
            out[f"{pid}/{tid}"] = (names.get(tid, comm) if pid == "self" else comm, ns)
    return out


def cores(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores used per group, and the busiest single thread (``max thread``)."""
    by: collections.Counter = collections.Counter()
    busiest = 0.0
    for tid, (name, ns) in after.items():
        used = (ns - before.get(tid, (name, 0))[1]) / 1e9 / seconds
        by[name] += used
        busiest = max(busiest, used)
    out = {name: round(c, 2) for name, c in by.most_common(6) if c >= 0.01}
    return {**out, "max thread": round(busiest, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=("prefetch", "raw"))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    tune_malloc_for_blocks()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geo = KVGeometry(32, 16, 8, 128, "bf16")
    n_pages = args.tokens // geo.page_size
    cap = int(n_pages * geo.page_bytes * 1.2 / args.nodes) + (256 << 20)
    nodes = start_nodes(args.nodes, "--capacity", str(cap))
    try:
        cfg = ClientConfig(tuple(n.address for n in nodes), timeout_s=60)
        shape = (geo.num_layers, args.tokens + 64, *geo.device_layer_shape)
        caches = [[torch.randn(shape, device=device).to(geo.dtype) for _ in range(2)]
                  for _ in range(2)]  # fmt: skip
        ns = KeyNamespace("diag-connector", geo)
        a, b = (KVConnector(geo, kv, cfg, host_pages=n_pages + 8, namespace=ns) for kv in caches)
        tokens = torch.randint(0, 128_000, (args.tokens,)).tolist()
        a.save(tokens, torch.randperm(args.tokens + 64, device=device)[: args.tokens])
        a.flush_sync(timeout=600)
        gb = n_pages * geo.page_bytes / 1e9
        pids = tuple(n.proc.pid for n in nodes if n.proc is not None)
        if args.what == "prefetch":
            for _ in range(args.rounds):
                b.cache.evict(n_pages + 8)
                before, on_nodes = thread_times(), thread_times(pids)
                start = time.perf_counter()
                handle = asyncio.run(b.prefetch(tokens))
                seconds = time.perf_counter() - start
                used = cores(before, thread_times(), seconds)
                nodes_used = cores(on_nodes, thread_times(pids), seconds)
                print(f"prefetch {gb / seconds:.2f} GB/s, cores {used}, nodes {nodes_used}")
                b.release(handle)
        else:
            keys, views = b.keys(tokens), b.pool.page_views(list(range(n_pages)))

            async def raw() -> None:
                client, arrived = AsyncStoreClient(cfg.endpoints, config=cfg), []
                try:
                    for _ in range(args.rounds):
                        before, on_nodes = thread_times(), thread_times(pids)
                        start = time.perf_counter()
                        await client.get_many(keys, into=views, on_arrival=arrived.append)
                        seconds = time.perf_counter() - start
                        used = cores(before, thread_times(), seconds)
                        nodes_used = cores(on_nodes, thread_times(pids), seconds)
                        print(f"raw {gb / seconds:.2f} GB/s, cores {used}, nodes {nodes_used}")
                finally:
                    client.close()

            asyncio.run(raw())
        a.close()
        b.close()
    finally:
        for node in nodes:
            node.stop()


if __name__ == "__main__":
    main()
