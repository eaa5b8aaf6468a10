"""Where a store transfer spends its CPU: per-thread CPU seconds of the client process and of
the node process during a put and a get of the same blocks (from /proc/<pid>/task/*/stat), so a
saturated thread (a Python loop, a zmq I/O thread, a copy thread) shows as ~100% of the wall.

    python scripts/diag_threads.py [--streams 8] [--blocks 256] [--copy-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import defaultdict

from pagekv.store import AsyncStoreClient, ClientConfig, Status
from pagekv.store.launch import NodeProcess
from pagekv.store.node.memory import tune_malloc_for_blocks

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, tuple[float, float, int]]:
    """(user s, system s, minor faults) per thread name (threads of one name summed)."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        row = out["main" if tid == str(pid) else name]
        row[0] += int(fields[11]) / TICK
        row[1] += int(fields[12]) / TICK
        row[2] += int(fields[7])
    return {k: tuple(v) for k, v in out.items()}


def report(what: str, wall: float, nbytes: int, before: dict, after: dict) -> None:
    rows = []
    for name, (user, system, faults) in after.items():
        u0, s0, f0 = before.get(name, (0.0, 0.0, 0))
        rows.append((user - u0 + system - s0, system - s0, faults - f0, name))
    rows.sort(reverse=True)
    faults = sum(r[2] for r in rows)
    busy = ", ".join(f"{n} {c / wall:.0%} (sys {s / wall:.0%})" for c, s, _, n in rows
                     if c > 0.01 * wall)  # fmt: skip
    print(f"  {what}: {faults / (nbytes / 4096):.2f} faults/page | {busy}", flush=True)


async def main(args: argparse.Namespace) -> None:
    size = 2 << 20
    node = NodeProcess("--capacity", str(2 * args.blocks * size), "--io-threads",
                       str(args.streams)).start()  # fmt: skip
    cfg = ClientConfig((node.address,), streams=args.streams, timeout_s=30,
                       copy_threads=args.copy_threads)  # fmt: skip
    client = AsyncStoreClient(node.address, config=cfg)
    blocks = [os.urandom(size) for _ in range(args.blocks)]
    into = [bytearray(size) for _ in blocks]
    print(f"{os.cpu_count()} cores, streams {args.streams}, copy threads {cfg.copy_threads}, "
          f"{args.blocks} x 2 MiB", flush=True)  # fmt: skip
    try:
        for r in range(args.rounds):
            keys = [f"d{r}-{i}".encode().ljust(16, b".") for i in range(len(blocks))]
            for op in ("put", "get"):
                me, them = thread_cpu(os.getpid()), thread_cpu(node.proc.pid)
                t = time.perf_counter()
                if op == "put":
                    ok = set(await client.put_many(keys, blocks)) == {Status.OK}
                else:
                    ok = all(await client.get_many(keys, into=into))
                wall = time.perf_counter() - t
                if not ok:
                    raise RuntimeError(f"{op} failed")
                gbps = args.blocks * size / wall / 1e9
                print(f"round {r} {op}: {gbps:.2f} GB/s", flush=True)
                report("client", wall, args.blocks * size, me, thread_cpu(os.getpid()))
                report("node  ", wall, args.blocks * size, them, thread_cpu(node.proc.pid))
            await client.delete_many(keys)
    finally:
        client.close()
        node.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--copy-threads", type=int, default=None)
    tune_malloc_for_blocks()
    asyncio.run(main(ap.parse_args()))
