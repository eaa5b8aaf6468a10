"""Diagnostic (GPU host): 8-stream GETs against each connection's socket buffer size.

A GET sends stored blocks, which are in no cache, into the client's own buffers: it runs at
the cold 8-stream loopback ceiling, and the hot one is 1.4-1.6x that on the H200 host. With
the kernel's autotuning a loopback connection's buffers grow to megabytes, so up to tens of
MiB of payload sit in socket buffers between the node's copy in and the client's copy out,
and may leave the cache before they are read. This times ``bench_store``'s streams round (256
x 2 MiB put, then got into the same destinations, one node with 8 I/O threads, an
``AsyncStoreClient`` with 8 streams over the lane) for nodes and clients whose connections
take ``--socket-buffer`` S (both directions, both ends), in interleaved rounds with the hot and
cold 8-stream ceilings, each round's nodes in a rotated order. S = 0 is the default: since
98e5ed2 that is 256 KiB for same-host GET replies (``wire.lane.size_socket_buffers``); the run
in benchmarks/results/diag_socket_buffer.json (e6d21bd) predates it, its 0 the kernel's
autotuning.

    python scripts/diag_socket_buffer.py [--sizes 0,256K,1M,4M] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics

from _bench_util import engine_heap, environment, parse_args, write_result
from _ceilings import TcpCeiling
from bench_store import MIB, _timed_round, stream_clients

from pagekv.env import parse_size
from pagekv.store.node.memory import tune_malloc_for_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0,256K,1M,4M")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=256, help="2 MiB blocks per round")
    args = parse_args(ap)
    tune_malloc_for_blocks()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    k, n, size = args.streams, args.blocks, 2 * MIB
    blocks = [os.urandom(size) for _ in range(n)]
    into = [bytearray(size) for _ in range(n)]
    gb = n * size / 1e9
    engine_heap()
    rounds: dict[int, list[dict]] = {s: [] for s in sizes}
    setups = {s: (("--socket-buffer", str(s)), dict(bulk=True, socket_buffer=s)) for s in sizes}
    with TcpCeiling(k, size, n // k) as hot, TcpCeiling(k, size, n // k, cold=True) as cold:
        with stream_clients(k, setups, blocks, into) as (loop, clients):
            for r in range(args.rounds):
                (_, hot_get), (_, cold_get) = hot.round(), cold.round()
                order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
                for s in order:
                    put, get = loop.run_until_complete(
                        _timed_round(clients[s], blocks, into, f"r{r}"))  # fmt: skip
                    rounds[s].append(dict(get_gbps=gb / get, put_gbps=gb / put,
                                          hot_gbps=hot_get, cold_gbps=cold_get))  # fmt: skip
                print(f"round {r}: hot {hot_get:.1f} cold {cold_get:.1f} | " + " | ".join(
                    f"{s >> 10} KiB get {rounds[s][-1]['get_gbps']:.1f}" for s in sizes),
                    flush=True)  # fmt: skip
    base = sizes[0]
    rows = []
    for s in sizes:
        rs = rounds[s]
        med = lambda f: round(statistics.median(f(r) for r in rs), 3)  # noqa: E731
        row = dict(socket_buffer=s, get_gbps=med(lambda r: r["get_gbps"]),
                   put_gbps=med(lambda r: r["put_gbps"]),
                   get_vs_hot=med(lambda r: r["get_gbps"] / r["hot_gbps"]),
                   get_vs_cold=med(lambda r: r["get_gbps"] / r["cold_gbps"]),
                   get_vs_first=round(statistics.median(
                       a["get_gbps"] / b["get_gbps"] for a, b in zip(rs, rounds[base])), 3),
                   higher_than_first=sum(a["get_gbps"] > b["get_gbps"]
                                         for a, b in zip(rs, rounds[base])))  # fmt: skip
        print(f"socket buffer {s}: {row}", flush=True)
        rows.append(row)
    write_result("diag_socket_buffer", {"env": environment(), "args": vars(args), "rows": rows,
                                        "rounds": {str(s): rounds[s] for s in sizes}})  # fmt: skip


if __name__ == "__main__":
    main()
