"""Mooncake Store as the connector's store: a prompt's pages (4 GiB by default, Llama-3-8B
geometry) saved through a KVConnector and prefetched back cold (host tier emptied each round)
through Mooncake Store (TCP) and through pagekv nodes (TCP), and in the same run Mooncake's own
``batch_get_into`` of the same objects into the same registered host memory, plus a loopback
TCP ceiling. Each backend's store runs only during its phase (memory: source KV + host pool +
the store's copy, ~3.3x the bytes).

    python scripts/bench_mooncake.py [--bytes 4GiB] [--layers 32] [--rounds 5]

Needs Mooncake (scripts/engines/setup_mooncake.sh, or pip install 'pagekv[mooncake]'). Writes
mooncake.json (see scripts/_bench_util.py for where). Medians over rounds 2..N (the first
warms the store processes' memory); GB/s are 1e9 bytes per second of page bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import time

import torch
from _bench_util import parse_args, write_result
from _ceilings import tcp_ceiling

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.env import parse_size
from pagekv.store import ClientConfig
from pagekv.store.backend import store_config
from pagekv.store.launch import start_nodes
from pagekv.store.mooncake import values
from pagekv.store.mooncake.handle import release, shared_handle
from pagekv.store.mooncake.launch import MooncakeCluster


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_cache(shape: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random bytes as a cache of ``dtype`` (no float temporaries: 4 GiB fits a small box)."""
    last = shape[-1] * dtype.itemsize
    raw = torch.randint(0, 256, (*shape[:-1], last), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def prefetch_rounds(conn: KVConnector, tokens: list[int], n_pages: int, rounds: int) -> list:
    """Cold prefetches (host tier emptied first): seconds per round."""
    times = []
    for _ in range(rounds):
        conn.cache.evict(n_pages + 8)
        sync()
        t = time.perf_counter()
        handle = asyncio.run(conn.prefetch(tokens))
        times.append(time.perf_counter() - t)
        if handle.fetched != n_pages:
            raise RuntimeError(f"prefetch fetched {handle.fetched} of {n_pages} pages")
        conn.release(handle)
    return times


def phase(name: str, store, geo: KVGeometry, src, tokens, slot_ids, args) -> dict:
    """Save the prompt through a connector on ``store``, then prefetch it back cold."""
    n_pages = len(tokens) // geo.page_size
    conn = KVConnector(geo, src, store, host_pages=n_pages + 8,
                       namespace=KeyNamespace(f"bench-{name}", geo))  # fmt: skip
    r: dict = {}
    try:
        t = time.perf_counter()
        conn.save(tokens, slot_ids)
        conn.flush_sync(timeout=900)
        r["save_and_writeback_s"] = time.perf_counter() - t
        times = prefetch_rounds(conn, tokens, n_pages, args.rounds)
        r["prefetch_rounds_s"] = [round(x, 4) for x in times]
        r["prefetch_s"] = statistics.median(times[1:])
        r["store_counters"] = conn.store.counters
        if name == "mooncake":
            r.update(raw_batch_get_into(conn, tokens, geo, args.rounds))
    finally:
        conn.close()
    return r


def raw_batch_get_into(conn: KVConnector, tokens, geo: KVGeometry, rounds: int) -> dict:
    """Mooncake's own ``batch_get_into`` of the connector's objects (page + trailer) into the
    connector's registered host pool, no checks: one call of every key, and calls of
    ``max_call_bytes`` run ``workers`` at a time (the backend's cut, without its checks)."""
    cfg = conn.store.config
    names = [values.object_key(cfg.prefix, k) for k in conn.keys(tokens)]
    size = geo.page_bytes + values.TRAILER_BYTES
    conn.cache.evict(len(names) + 8)  # the pool is free now: every handle released
    if len(names) * size > conn.pool.nbytes:
        raise RuntimeError("the pool cannot hold the objects back to back")
    ptrs = [conn.pool.address + i * size for i in range(len(names))]
    per_call = max(1, cfg.max_call_bytes // size)
    chunks = [slice(i, i + per_call) for i in range(0, len(names), per_call)]
    handle = shared_handle(cfg)
    out: dict = {}
    try:
        store = handle.store()

        def get(part: slice) -> int:
            """Keys of ``part`` that did not arrive (a 4 GiB call on a slow box outlives
            Mooncake's transfer timeouts: TRANSFER_FAIL), counted, not fatal."""
            codes = store.batch_get_into(names[part], ptrs[part], [size] * len(names[part]))
            return sum(c != size for c in codes)

        with concurrent.futures.ThreadPoolExecutor(cfg.workers) as pool:
            for name, run in (("one_call", lambda: get(slice(None))),
                              ("calls", lambda: sum(pool.map(get, chunks)))):  # fmt: skip
                times, failed = [], []
                for _ in range(rounds):
                    t = time.perf_counter()
                    failed.append(run())
                    times.append(time.perf_counter() - t)
                out[f"raw_batch_get_into_{name}_rounds_s"] = [round(x, 4) for x in times]
                out[f"raw_batch_get_into_{name}_failed_keys"] = failed
                out[f"raw_batch_get_into_{name}_s"] = statistics.median(times[1:])
    finally:
        release(handle)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bytes", default="4GiB", help="page bytes of the prompt")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--mooncake-params",
        default="",
        help="appended to the mooncake:// address, e.g. '&max_call_bytes=256MiB'",
    )
    args = parse_args(ap)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geo = KVGeometry(args.layers, args.page_size, 8, 128, "bf16")
    n_pages = parse_size(args.bytes) // geo.page_bytes
    num_tokens = n_pages * geo.page_size
    nbytes = n_pages * geo.page_bytes
    shape = (geo.num_layers, num_tokens + 64, *geo.device_layer_shape)
    src = [random_cache(shape, geo.dtype, device) for _ in range(2)]
    tokens = torch.randint(0, 128_000, (num_tokens,)).tolist()
    slot_ids = torch.randperm(num_tokens + 64, device=device)[:num_tokens]
    capacity = int(nbytes * 1.15) + (256 << 20)
    out: dict = {"mooncake_params": args.mooncake_params, "bytes": nbytes, "pages": n_pages,
                 "page_bytes": geo.page_bytes, "device": device}  # fmt: skip
    # one loopback TCP stream, page-sized blocks, each in its own memory (as a store's)
    out["tcp_get_ceiling_gbps"] = round(tcp_ceiling(1, geo.page_bytes, 256, 3, cold=True)[1], 3)

    # a lease long enough for one call of every key (Mooncake's own batch) on a slow box
    with MooncakeCluster(stores=1, segment=capacity, timeout_s=30.0, lease_ms=120_000) as mc:
        mooncake = store_config(mc.address + args.mooncake_params)
        out["mooncake"] = phase("mooncake", mooncake, geo, src, tokens, slot_ids, args)
    (node,) = start_nodes(1, "--capacity", str(capacity))
    try:
        cfg = ClientConfig((node.address,), timeout_s=60)
        out["pagekv"] = phase("pagekv", cfg, geo, src, tokens, slot_ids, args)
    finally:
        node.stop()

    for name, key in (("mooncake", "prefetch_s"), ("pagekv", "prefetch_s"),
                      ("mooncake", "raw_batch_get_into_one_call_s"),
                      ("mooncake", "raw_batch_get_into_calls_s")):  # fmt: skip
        failed = out[name].get(key.removesuffix("_s") + "_failed_keys", [0])
        gbps = nbytes / out[name][key] / 1e9 if not any(failed) else float("nan")
        out[f"{name}_{key.removesuffix('_s')}_gbps"] = round(gbps, 3)
    for variant in ("calls", "one_call"):  # > 1: the backend's prefetch is faster
        raw = out[f"mooncake_raw_batch_get_into_{variant}_gbps"]
        out[f"mooncake_prefetch_vs_raw_{variant}"] = round(out["mooncake_prefetch_gbps"] / raw, 3)
    out["mooncake_vs_pagekv_prefetch"] = round(
        out["pagekv"]["prefetch_s"] / out["mooncake"]["prefetch_s"], 3
    )
    path = write_result("mooncake", out, nan_reason="keys failed (see *_failed_keys)")
    summary = {k: v for k, v in out.items() if not isinstance(v, dict)}
    print(summary, "->", path, flush=True)


if __name__ == "__main__":
    main()
