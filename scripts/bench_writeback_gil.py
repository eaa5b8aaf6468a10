"""How much a connector's background write-back slows the engine's own Python thread (CPU).

An engine's decode loop is host-bound: one Python step launches each kernel. The connector's
write-back runs on its loop thread in the same process, so every bit of Python it runs while
moving a save to the store is GIL time the engine does not get. This measures it without a GPU:
the engine's thread is a pure-Python spin loop (its progress per second is what the GIL lets it
have), timed alone and while a ``save`` of ``--mib`` MiB is written back to a local store node.

    python scripts/bench_writeback_gil.py [--mib 512] [--page-kib 512] [--rounds 3]

Prints the spin rate alone and during the write-back (slowdown = the engine's loss), the
write-back's wall time and the loop thread's CPU seconds per GiB written.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store import ClientConfig
from pagekv.store.launch import start_nodes


def spin_until(stop: threading.Event) -> tuple[int, float]:
    n, t = 0, time.perf_counter()
    while not stop.is_set():
        for _ in range(100):
            n += 1
    return n, time.perf_counter() - t


def spin_for(seconds: float) -> float:
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(100):
            n += 1
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--page-kib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # bf16 K and V, 8 heads x 64: 2 KiB per token per layer, pages of 16 tokens
    layers = max(1, args.page_kib * 1024 // (16 * 2 * 8 * 64 * 2))
    geo = KVGeometry(layers, 16, 8, 64, "bf16")
    pages = args.mib * (1 << 20) // geo.page_bytes
    tokens = pages * geo.page_size
    kv = [torch.zeros(layers, tokens, 8, 64, dtype=torch.bfloat16) for _ in range(2)]
    nodes = start_nodes(1, "--capacity", f"{4 * args.mib * args.rounds + 256}MiB")
    cfg = ClientConfig((nodes[0].address,), timeout_s=30.0)
    conn = KVConnector(geo, kv, cfg, host_pages=pages * 2, namespace=KeyNamespace("gil", geo),
                       max_pending_writes=pages * 2)  # fmt: skip
    alone, during, wall, cpu = [], [], [], []
    try:
        for r in range(args.rounds):
            alone.append(spin_for(1.0))
            ids = torch.randint(0, 32000, (tokens,), generator=torch.Generator().manual_seed(r))
            loop_cpu0 = conn._loop.thread_cpu_s() if hasattr(conn._loop, "thread_cpu_s") else 0
            stop = threading.Event()
            t = time.perf_counter()
            conn.save(ids.tolist(), torch.arange(tokens))
            waiter = threading.Thread(target=lambda: (conn.flush_sync(300), stop.set()))
            waiter.start()
            n, secs = spin_until(stop)
            waiter.join()
            wall.append(time.perf_counter() - t)
            during.append(n / secs)
            if hasattr(conn._loop, "thread_cpu_s"):
                cpu.append((conn._loop.thread_cpu_s() - loop_cpu0) / (args.mib / 1024))
            conn.cache.evict(1 << 30)
        base, busy = statistics.median(alone), statistics.median(during)
        print(
            f"spin alone {base / 1e6:.1f} M/s, during write-back {busy / 1e6:.1f} M/s: "
            f"engine thread slowed {1 - busy / base:.1%}; write-back of {args.mib} MiB in "
            f"{statistics.median(wall) * 1e3:.0f} ms"
            + (f", loop thread {statistics.median(cpu):.2f} CPU s/GiB" if cpu else "")
        )
    finally:
        conn.close(30)
        for node in nodes:
            node.stop()


if __name__ == "__main__":
    main()
