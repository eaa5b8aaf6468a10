"""The one-stream PUT against what ZeroMQ itself moves: a PUT of 64 x 2 MiB (cold client
blocks) beside the hot 1-stream TCP ceiling. Each round, interleaved: the TCP ceilings (hot and
cold), raw ZeroMQ (a DEALER sending the same frames zero-copy in 16 MiB messages, to a
ROUTER in another process that keeps every frame until the round ends: libzmq's receive into
fresh memory, no hashing anywhere), and pagekv PUTs (StoreClient streams=1) to a node that
verifies PUTs and to one that does not (--no-verify-puts). Medians, and
each against the hot ceiling, into bench_put_ceiling.json.

    python scripts/bench_put_ceiling.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import zmq
from _bench_util import engine_heap, environment, parse_args, write_result
from _ceilings import tcp_ceiling

from pagekv.store import Status, StoreClient
from pagekv.store.launch import NodeProcess
from pagekv.store.node.memory import tune_malloc_for_blocks

MIB = 1 << 20
PER_MESSAGE = 8  # 2 MiB frames per message: 16 MiB, the client's default message cap


def _router() -> None:
    """A ROUTER on one I/O thread that keeps each message's frames until told to drop them."""
    tune_malloc_for_blocks()
    sock = zmq.Context(io_threads=1).socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    kept = []
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"drop":
            kept.clear()
        elif frames[1].bytes == b"end":
            return
        else:
            kept.append(frames[2:])
        sock.send_multipart([frames[0], b"ok"])


def raw_zmq_put(sock: zmq.Socket, blocks: list) -> float:
    t = time.perf_counter()
    n = 0
    for i in range(0, len(blocks), PER_MESSAGE):
        sock.send(b"put", zmq.SNDMORE)
        part = blocks[i : i + PER_MESSAGE]
        for b in part[:-1]:
            sock.send(b, zmq.SNDMORE, copy=False)
        sock.send(part[-1], 0, copy=False)
        n += 1
    for _ in range(n):
        sock.recv()
    took = time.perf_counter() - t
    sock.send(b"drop")
    sock.recv()
    return took


def pagekv_put(client: StoreClient, blocks: list, tag: str) -> float:
    keys = [f"{tag}-{i}".encode().ljust(16, b".") for i in range(len(blocks))]
    t = time.perf_counter()
    status = client.put_many(keys, blocks)
    took = time.perf_counter() - t
    if set(status) != {Status.OK}:
        raise RuntimeError(f"put failed: {set(status)}")
    client.delete_many(keys)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    args = parse_args(ap)
    tune_malloc_for_blocks()
    env = environment()
    print(f"# {env['device']}, {env['cpu_count']} cpus, commit {env['commit']}", flush=True)
    n, gb = 64, 64 * 2 * MIB / 1e9
    blocks = [os.urandom(2 * MIB) for _ in range(n)]
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    sock = zmq.Context(io_threads=1).socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{int(server.stdout.readline())}")
    nodes = {
        "verify": NodeProcess("--capacity", "2GiB").start(warm=True),
        "no_verify": NodeProcess("--capacity", "2GiB", "--no-verify-puts").start(warm=True),
    }
    clients = {k: StoreClient(v.address, timeout_s=30, streams=1) for k, v in nodes.items()}
    rows = []
    try:
        raw_zmq_put(sock, blocks)  # warm
        for k, c in clients.items():
            pagekv_put(c, blocks, f"warm-{k}")
        engine_heap()  # set up: from here on this process is a started engine
        for r in range(args.rounds):
            row = {}
            row["tcp_hot"], _ = tcp_ceiling(1, 2 * MIB, n, 1)
            row["tcp_cold"], _ = tcp_ceiling(1, 2 * MIB, n, 1, cold=True)
            row["raw_zmq"] = gb / raw_zmq_put(sock, blocks)
            for k, c in clients.items():
                row[f"pagekv_{k}"] = gb / pagekv_put(c, blocks, f"r{r}")
            rows.append({k: round(v, 3) for k, v in row.items()})
            print(f"round {r}: {rows[-1]}", flush=True)
    finally:
        for c in clients.values():
            c.close()
        for node in nodes.values():
            node.stop()
        sock.send(b"end")
        server.wait(10)
    med = {f"{k}_gbps": round(statistics.median(row[k] for row in rows), 3) for k in rows[0]}
    for k in rows[0]:
        med[f"{k}_vs_hot"] = round(statistics.median(row[k] / row["tcp_hot"] for row in rows), 3)
    print(f"median {med}", flush=True)
    print(f"wrote {write_result('bench_put_ceiling', dict(median=med, rounds=rows))}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _router()
    else:
        main()
