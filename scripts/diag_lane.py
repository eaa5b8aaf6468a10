"""Bulk lane experiments: which settings move the most bytes on this host, same run.

* ``put``: one node, K streams, PUT over ZeroMQ against PUT over the bulk lane (the client's
  ``_LANE_OPS`` widened for the run), with the K-stream TCP ceiling and the busiest threads of
  both processes (as :mod:`diag_threads`).
* ``spread``: a 4 GiB GET from N nodes over the lane (the connector's prefetch without the
  connector) for several connection counts per node and with received values hashed inline
  or on the copy pool, against the 8-stream TCP ceilings (hot and cold).

    python scripts/diag_lane.py [--only put,spread] [--nodes 3] [--per-node 2,3,4,6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np
from _ceilings import tcp_ceiling
from bench_store import _async_rounds
from diag_threads import thread_cpu

from pagekv.store import AsyncStoreClient, ClientConfig, Status, bulk_client
from pagekv.store.launch import NodeProcess
from pagekv.store.memory import tune_malloc_for_blocks
from pagekv.store.protocol import Op

MIB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a whole process, its finished threads included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def busiest(pid: int, before: dict, cpu0: float, wall: float, top: int = 3) -> str:
    """The process's cores busy over ``wall`` and its busiest named threads."""
    after = thread_cpu(pid)
    rows = []
    for name, (user, system, _faults) in after.items():
        u0, s0, _ = before.get(name, (0.0, 0.0, 0))
        rows.append((user - u0 + system - s0, name))
    rows.sort(reverse=True)
    named = ", ".join(f"{n} {c / wall:.0%}" for c, n in rows[:top])
    return f"{(process_cpu(pid) - cpu0) / wall:.2f} cores; {named}"


def put_section(args) -> None:
    size, n = 2 * MIB, 64
    blocks = [os.urandom(size) for _ in range(n)]
    into = [bytearray(size) for _ in range(n)]
    gb = size * n / 1e9
    for k in args.streams:
        hot = tcp_ceiling(k, size, max(1, n // k), 3)
        for lane_puts in (False, True):
            bulk_client._LANE_OPS = (Op.GET, Op.PUT) if lane_puts else (Op.GET,)
            node = NodeProcess("--capacity", "1GiB", "--io-threads", str(k)).start()
            cfg = ClientConfig((node.address,), timeout_s=30, streams=k)
            client = AsyncStoreClient(node.address, config=cfg)
            snap: dict = {}

            def warmed(node=node, snap=snap) -> None:
                me, pid = os.getpid(), node.proc.pid
                snap.update(c=thread_cpu(me), n=thread_cpu(pid), c0=process_cpu(me),
                            n0=process_cpu(pid), t=time.time())  # fmt: skip

            times = asyncio.run(_async_rounds(client, blocks, into, args.rounds, warmed))
            wall, cpu_c, cpu_n = time.time() - snap["t"], snap["c"], snap["n"]
            client.close()
            put = gb / statistics.median(t[0] for t in times)
            get = gb / statistics.median(t[1] for t in times)
            print(
                f"put K={k} lane_puts={lane_puts}: put {put:.2f} GB/s ({put / hot[0]:.2f} of "
                f"{hot[0]:.2f}), get {get:.2f} ({get / hot[1]:.2f} of {hot[1]:.2f})",
                flush=True,
            )
            print(f"   client: {busiest(os.getpid(), cpu_c, snap['c0'], wall)}", flush=True)
            print(f"   node:   {busiest(node.proc.pid, cpu_n, snap['n0'], wall)}", flush=True)
            node.stop()
    bulk_client._LANE_OPS = (Op.GET,)


async def _gets(client, keys, blocks, into, rounds) -> list[float]:
    times = []
    for _ in range(rounds + 1):
        for b in into[:: max(1, len(into) // 16)]:
            b[:8] = 0
        t = time.perf_counter()
        ok = await client.get_many(keys, into=into)
        times.append(time.perf_counter() - t)
        if not all(ok) or bytes(into[-1][:64]) != bytes(blocks[-1][:64]):
            raise RuntimeError("spread get failed")
    return times


def spread_section(args) -> None:
    size, n = 2 * MIB, args.blocks
    uniq = [np.frombuffer(os.urandom(size), np.uint8) for _ in range(64)]
    blocks = [uniq[i % len(uniq)] for i in range(n)]
    into = [np.ones(size, np.uint8) for _ in range(n)]  # touched: as the pinned pool is
    gb = size * n / 1e9
    hot = tcp_ceiling(8, size, 32, 3)[1]
    cold = tcp_ceiling(8, size, 32, 3, cold=True)[1]
    print(f"spread: {n} x 2 MiB from {args.nodes} nodes; tcp8 hot {hot:.2f} cold {cold:.2f} GB/s",
          flush=True)  # fmt: skip
    cap = str(int(size * n * 1.3 / args.nodes) + (256 << 20))
    nodes = [NodeProcess("--capacity", cap).start() for _ in range(args.nodes)]
    keys = [b"spread-%d" % i for i in range(n)]
    addrs = tuple(node.address for node in nodes)
    try:
        with_client = AsyncStoreClient(addrs, config=ClientConfig(addrs, timeout_s=60))
        st = asyncio.run(with_client.put_many(keys, blocks))
        with_client.close()
        if set(st) - {Status.OK}:
            raise RuntimeError(f"spread put: {set(st)}")
        original = bulk_client.BulkLanes.pool_hashing
        order = [(p, h) for p in args.per_node for h in args.hashing]
        for rep in range(args.repeat):
            for per_node, hashing in order if rep % 2 == 0 else order[::-1]:
                if hashing == "auto":
                    bulk_client.BulkLanes.pool_hashing = original
                else:
                    bulk_client.BulkLanes.pool_hashing = (lambda on: lambda self: on)(
                        hashing == "pool"
                    )
                cfg = ClientConfig(addrs, timeout_s=60, streams=per_node)
                client = AsyncStoreClient(addrs, config=cfg)
                times = asyncio.run(_gets(client, keys, blocks, into, args.rounds))
                client.close()
                best = gb / min(times[1:])
                med = gb / statistics.median(times[1:])
                print(f"  per_node={per_node} hashing={hashing}: median {med:.2f} GB/s "
                          f"({med / hot:.2f} hot, {med / cold:.2f} cold), best {best:.2f}",
                          flush=True)  # fmt: skip
        bulk_client.BulkLanes.pool_hashing = original
    finally:
        for node in nodes:
            node.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", type=lambda s: s.split(","), default=["put", "spread"])
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--per-node", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2, 3, 4, 6])  # fmt: skip
    ap.add_argument("--hashing", type=lambda s: s.split(","), default=["auto", "inline", "pool"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tune_malloc_for_blocks()
    print(f"# {os.cpu_count()} cpus", flush=True)
    if "put" in args.only:
        put_section(args)
    if "spread" in args.only:
        spread_section(args)


if __name__ == "__main__":
    main()
