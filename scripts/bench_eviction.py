"""Host-tier eviction cost: an allocation that must evict, with the whole pool cached and unheld
(262,144 pages by default), median over rounds. CPU only (the pool is not pinned).

    python scripts/bench_eviction.py [--pages 262144] [--alloc 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagekv.connector import HostPagePool, KVGeometry, PageCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=262_144)
    ap.add_argument("--alloc", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    geo = KVGeometry(1, 1, 1, 4, "fp32")  # 32-byte pages: only the bookkeeping is timed
    cache = PageCache(HostPagePool(geo, args.pages, pin=False))
    pages = cache.allocate(args.pages)
    for i, p in enumerate(pages):
        cache.publish(i.to_bytes(16, "little"), p)
    cache.release(pages)
    times, n = [], args.pages
    for _ in range(args.rounds):
        t = time.perf_counter()
        got = cache.allocate(args.alloc)  # evicts args.alloc pages
        times.append(time.perf_counter() - t)
        for p in got:
            cache.publish(n.to_bytes(16, "little"), p)
            n += 1
        cache.release(got)
    ms = statistics.median(times) * 1e3
    print(json.dumps({"pages": args.pages, "alloc": args.alloc, "median_ms": round(ms, 4)}))


if __name__ == "__main__":
    main()
