"""Store benchmark on loopback: pagekv against the raw TCP ceiling and peer stores, one run.

* headline: 64 blocks of 2 MiB, put then get into preallocated buffers, fresh keys per round,
  one stream (``StoreClient(streams=1)``); each round also times the raw 1-stream TCP socket
  ceiling (scripts/_ceilings.py), and the ratio is the median of per-round ratios;
* user: what a user's ``put_many``/``get_many`` of 32 x 2 MiB (64 MiB) moves with the default
  ``StoreClient`` and a default node, the values and destinations allocated anew every round
  (as a caller's are), against the hot 1-stream TCP ceiling of the same rounds;
* streams: the host's K-stream TCP ceilings (K process pairs) and K-thread memcpy ceilings for
  K = 1, 2, 4, 8, and ``AsyncStoreClient(streams=K)`` (the connector's client) put/get GB/s of
  the same 64 x 2 MiB against a node with K I/O threads; ratios to the K-stream and 1-stream
  ceilings, each the median of per-round ratios (a round: the ceilings, then each path once),
  the host's core count next to them; the ceilings also "cold"
  (each block from / into its own memory on both sides, as a store's blocks are, instead of
  one buffer per side that stays in the cache); where each half of the cores has 2 CPUs a
  stream, senders (TCP servers, the node) on one half and receivers (TCP clients, this
  process) on the other, the same for the ceilings as for pagekv (row ``pinned``;
  ``--no-pin``: wherever the scheduler puts them);
* peers (Redis, Mooncake Store TCP, a naive ZeroMQ store) on the same workload, in the same run,
  when ../shared/peers/setup.sh has installed them;
* put/get GB/s over block sizes 256 KiB-8 MiB and batches 1-128;
* EXISTS latency for 1,024 keys; node RSS against capacity under a put stream of 3x capacity
  (``peak_over_capacity``: the node's peak RSS over its RSS at start, in capacities).

    python scripts/bench_store.py [--quick] [--save]     # --save: into benchmarks/results/
    python scripts/bench_store.py --only user,rss         # some sections
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _bench_util import engine_heap, environment, parse_args, write_result
from _ceilings import TcpCeiling, memcpy_ceiling, pin_process, split_cores

from pagekv.store import AsyncStoreClient, ClientConfig, Status, StoreClient
from pagekv.store.launch import NodeProcess
from pagekv.store.node.memory import tune_malloc_for_blocks

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
MIB = 1 << 20


def put_get_round(client: StoreClient, blocks: list, into: list, tag: str) -> tuple[float, float]:
    keys = [f"{tag}-{i}".encode().ljust(16, b".") for i in range(len(blocks))]
    t = time.perf_counter()
    status = client.put_many(keys, blocks)
    put = time.perf_counter() - t
    if set(status) - {Status.OK}:
        raise RuntimeError(f"put failed: {set(status)}")
    t = time.perf_counter()
    ok = client.get_many(keys, into=into)
    get = time.perf_counter() - t
    if not all(ok) or into[0][:64] != blocks[0][:64]:
        raise RuntimeError("get failed")
    client.delete_many(keys)
    return put, get


def headline(args) -> dict:
    size, n = 2 * MIB, 64
    node = NodeProcess("--capacity", "2GiB").start(warm=True)
    blocks = [os.urandom(size) for _ in range(n)]
    into = [bytearray(size) for _ in range(n)]
    rows = []
    with StoreClient(node.address, timeout_s=30, streams=1) as client, \
            TcpCeiling(1, size, n) as ceiling:  # fmt: skip
        put_get_round(client, blocks, into, "warm")
        for r in range(args.rounds):
            put, get = put_get_round(client, blocks, into, f"r{r}")
            rows.append(_paired_round(size * n, put, get, ceiling))
    node.stop()
    med = _paired_medians(rows)
    print(f"headline 2 MiB x 64: {med}", flush=True)
    return dict(median=med, rounds=rows)


def user_rounds(args) -> dict:
    """A user's put_many/get_many of 32 x 2 MiB with the default client (its streams, copy
    pool and transports) and fresh buffers each round, against the 1-stream TCP ceiling."""
    size, n = 2 * MIB, 32
    node = NodeProcess("--capacity", "1GiB").start(warm=True)
    rows = []
    with StoreClient(node.address, timeout_s=30) as client, TcpCeiling(1, size, n) as ceiling:
        for r in range(args.rounds + 1):  # the first warms the links, the node and the pools
            blocks = [os.urandom(size) for _ in range(n)]
            into = [bytearray(size) for _ in range(n)]
            put, get = put_get_round(client, blocks, into, f"user{r}")
            if into[-1] != blocks[-1]:
                raise RuntimeError("user round: the last value came back wrong")
            if r == 0:
                continue
            rows.append(_paired_round(size * n, put, get, ceiling))
        config = client.config
    node.stop()
    med = _paired_medians(rows)
    med.update(streams=config.streams, copy_threads=config.copy_threads, cores=os.cpu_count())
    print(f"user 32 x 2 MiB, fresh buffers: {med}", flush=True)
    return dict(median=med, rounds=rows)


def _paired_round(nbytes: int, put_s: float, get_s: float, ceiling: TcpCeiling) -> dict:
    """One round's GB/s and the 1-stream ceiling's, timed right after it."""
    tcp_put, tcp_get = ceiling.round()
    gb = nbytes / 1e9
    return dict(put_gbps=gb / put_s, get_gbps=gb / get_s, tcp_put_gbps=tcp_put,
                tcp_get_gbps=tcp_get)  # fmt: skip


def _paired_medians(rows: list[dict]) -> dict:
    """Medians of the rounds' figures, and of their per-round ratios to the ceiling."""
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    med["put_ratio"] = round(statistics.median(r["put_gbps"] / r["tcp_put_gbps"] for r in rows), 3)
    med["get_ratio"] = round(statistics.median(r["get_gbps"] / r["tcp_get_gbps"] for r in rows), 3)
    return med


async def _timed_round(client, blocks: list, into: list, tag: str) -> tuple[float, float]:
    """(put s, get s) of ``blocks`` under fresh keys, checked, then deleted."""
    keys = [f"{tag}-{i}".encode().ljust(16, b".") for i in range(len(blocks))]
    t = time.perf_counter()
    status = await client.put_many(keys, blocks)
    put = time.perf_counter() - t
    t = time.perf_counter()
    ok = await client.get_many(keys, into=into)
    get = time.perf_counter() - t
    if set(status) - {Status.OK} or not all(ok) or into[-1][-64:] != blocks[-1][-64:]:
        raise RuntimeError(f"streams round failed: {set(status)}, {ok.count(False)} misses")
    await client.delete_many(keys)
    return put, get


def streams_rows(args) -> dict:
    """K-stream TCP and K-thread memcpy ceilings and pagekv with K streams, same bytes. Each
    round times the ceilings (hot, cold) and then each path once, and every ratio is the median
    of the rounds' own ratios: the host drifts between minutes, a round takes seconds."""
    size, n, cores = 2 * MIB, args.stream_blocks, os.cpu_count()
    blocks = [os.urandom(size) for _ in range(n)]
    into = [bytearray(size) for _ in range(n)]
    rows: list[dict] = []
    before = os.sched_getaffinity(0)
    split = split_cores() if args.pin else None
    try:
        for k in args.streams:
            memcpy = memcpy_ceiling(k, 32 * MIB, 4)
            # pinned where each side has 2 CPUs a stream (pagekv's receive: a thread and its
            # helper); with fewer, halving the cores would take from pagekv what the ceiling's
            # one thread a stream does not need
            sides = split if split and min(map(len, split)) >= 2 * k else None
            if sides:  # this process is pagekv's receiving side from here on
                pin_process(sides[1])
            per_stream = max(1, n // k)
            with TcpCeiling(k, size, per_stream, sides=sides) as hot, \
                    TcpCeiling(k, size, per_stream, cold=True, sides=sides) as cold:  # fmt: skip
                rounds, copy_threads = _paths_rounds(args, k, hot, cold, blocks, into, sides)
            pin_process(before)
            for path in args.paths:
                rows.append(_streams_row(rounds[path], rows[0] if rows else None,
                                         streams=k, path=path, cores=cores,
                                         copy_threads=copy_threads[path],
                                         memcpy_gbps=round(memcpy, 3),
                                         pinned=bool(sides)))  # fmt: skip
                print(f"streams {rows[-1]}", flush=True)
    finally:
        pin_process(before)
    used = split and any(row["pinned"] for row in rows)  # the sides, where a row ran on them
    pinned = {"send": sorted(split[0]), "receive": sorted(split[1])} if used else None
    return dict(rows=rows, pinned=pinned)


def _paths_rounds(args, k: int, hot: TcpCeiling, cold: TcpCeiling, blocks: list, into: list,
                  sides: tuple | None) -> tuple[dict[str, list[dict]], dict[str, int]]:  # fmt: skip
    """Per path, its rounds with K streams (a node with K I/O threads each, on the sending
    side's CPUs when ``sides``), each round after the ceilings' own; and each path's client's
    copy threads."""
    gb = sum(map(len, blocks)) / 1e9
    # the same ceilings for each data path
    setups = {path: ((), dict(bulk=path == "bulk", copy_threads=args.copy_threads))
              for path in args.paths}  # fmt: skip
    with stream_clients(k, setups, blocks, into, sides[0] if sides else None) as (loop, clients):
        rounds: dict[str, list[dict]] = {path: [] for path in args.paths}
        for r in range(args.rounds):
            (tcp_put, tcp_get), (cold_put, cold_get) = hot.round(), cold.round()
            for path, client in clients.items():
                put, get = loop.run_until_complete(_timed_round(client, blocks, into, f"s{r}"))
                rounds[path].append(dict(put_gbps=gb / put, get_gbps=gb / get,
                                         tcp_put_gbps=tcp_put, tcp_get_gbps=tcp_get,
                                         tcp_cold_put_gbps=cold_put,
                                         tcp_cold_get_gbps=cold_get))  # fmt: skip
        return rounds, {path: client.config.copy_threads for path, client in clients.items()}


@contextlib.contextmanager
def stream_clients(k: int, setups: dict, blocks: list, into: list,
                   cpus: frozenset[int] | None = None) -> Iterator:  # fmt: skip
    """For each ``name: (node flags, ClientConfig fields)`` of ``setups``: a node with ``k`` I/O
    threads (warmed, on ``cpus``) and an ``AsyncStoreClient`` with ``k`` streams on it, each
    through one untimed round of ``blocks``. Yields (their event loop, {name: client}); closes
    the clients, stops the nodes and closes the loop on the way out."""
    loop = asyncio.new_event_loop()
    nodes, clients = [], {}
    try:
        for name, (flags, fields) in setups.items():
            node = NodeProcess("--capacity", "1GiB", "--io-threads", str(k), *flags,
                               cpus=cpus).start(warm=True)  # fmt: skip
            nodes.append(node)
            cfg = ClientConfig((node.address,), timeout_s=30, streams=k, **fields)
            clients[name] = AsyncStoreClient(node.address, config=cfg)
            loop.run_until_complete(_timed_round(clients[name], blocks, into, "warm"))
        yield loop, clients
    finally:
        for client in clients.values():
            client.close()
        for node in nodes:
            node.stop()
        loop.close()


def _streams_row(rounds: list[dict], first: dict | None, **row) -> dict:
    """One path's row: the medians of its rounds' figures and of their per-round ratios (to
    the hot and cold K-stream ceilings, and to the 1-stream hot ceiling of ``first``'s row)."""

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(r[a] / r[b] for r in rounds), 3)

    for name in rounds[0]:
        row[name] = round(statistics.median(r[name] for r in rounds), 3)
    row.update(put_ratio=ratio("put_gbps", "tcp_put_gbps"),
               get_ratio=ratio("get_gbps", "tcp_get_gbps"),
               put_ratio_cold=ratio("put_gbps", "tcp_cold_put_gbps"),
               get_ratio_cold=ratio("get_gbps", "tcp_cold_get_gbps"))  # fmt: skip
    first = first or row
    row["put_ratio_1stream"] = round(row["put_gbps"] / first["tcp_put_gbps"], 3)
    row["get_ratio_1stream"] = round(row["get_gbps"] / first["tcp_get_gbps"], 3)
    return row


def peer_rows(args) -> dict:
    env_sh = Path(os.environ.get("PAGEKV_PEERS_DIR", "/tmp/pagekv-peers")) / "env.sh"
    if not env_sh.exists():
        print("peers: not installed (bash ../shared/peers/setup.sh)", flush=True)
        return {}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = (
            f"source {env_sh} && $MC_PY {PEERS / 'store_peers.py'} --block-mib 2 --blocks 64 "
            f"--rounds {args.rounds} --peers tcp,zmq,redis,mooncake --json {out.name}"
        )
        proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=900)
        print(proc.stdout, flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:])
            return {}
        return json.loads(Path(out.name).read_text())["peers"]


def grid(args) -> list[dict]:
    node = NodeProcess("--capacity", "2GiB").start(warm=True)
    rows = []
    with StoreClient(node.address, timeout_s=60) as client:
        for size in args.block_sizes:
            for batch in args.batches:
                if size * batch > args.max_batch_bytes:
                    continue
                blocks = [os.urandom(size) for _ in range(batch)]
                into = [bytearray(size) for _ in range(batch)]
                rounds = max(3, min(20, (64 * MIB) // (size * batch)))
                times = [put_get_round(client, blocks, into, f"g{size}-{batch}-{r}")
                         for r in range(rounds)]  # fmt: skip
                gb = size * batch / 1e9
                put = gb / statistics.median(t[0] for t in times)
                get = gb / statistics.median(t[1] for t in times)
                rows.append(dict(block_kib=size // 1024, batch=batch, put_gbps=round(put, 3),
                                 get_gbps=round(get, 3)))  # fmt: skip
                print(f"grid {rows[-1]}", flush=True)
    node.stop()
    return rows


def exists_latency(args) -> dict:
    node = NodeProcess("--capacity", "1GiB").start(warm=True)
    with StoreClient(node.address, timeout_s=10) as client:
        keys = [i.to_bytes(16, "little") for i in range(1024)]
        client.put_many(keys[:512], [b"x" * 64] * 512)
        lat = []
        for _ in range(args.exists_iters):
            t = time.perf_counter()
            res = client.exists_many(keys)
            lat.append((time.perf_counter() - t) * 1e3)
            if res.leading != 512:
                raise RuntimeError("exists wrong")
    node.stop()
    lat.sort()
    out = dict(
        keys=1024, p50_ms=round(lat[len(lat) // 2], 3), p99_ms=round(lat[int(len(lat) * 0.99)], 3)
    )
    print(f"exists {out}", flush=True)
    return out


def rss_under_stream(args) -> dict:
    capacity = args.rss_capacity
    node = NodeProcess("--capacity", str(capacity)).start()
    warmed = node.warmed()  # memory kept for blocks counts against the capacity
    baseline = node.rss_bytes() - warmed
    block, batch = 2 * MIB, 16
    data = [os.urandom(block) for _ in range(batch)]
    samples, sent, i = [], 0, 0
    with StoreClient(node.address, timeout_s=30) as client:
        while sent < 3 * capacity:
            keys = [f"rss-{i}-{j}".encode() for j in range(batch)]
            client.put_many(keys, data)
            sent += block * batch
            i += 1
            samples.append(node.rss_bytes())
        stats = client.stats()[0]
    node.stop()
    peak = max(samples)
    out = dict(capacity=capacity, streamed=sent, baseline_rss=baseline, warmed=warmed,
               peak_rss=peak, final_rss=samples[-1], evictions=stats["evictions"],
               stored_bytes=stats["bytes"],
               peak_over_capacity=round((peak - baseline) / capacity, 3))  # fmt: skip
    print(f"rss {out}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-sizes", type=lambda s: [int(x) * 1024 for x in s.split(",")],
                    default=[256 << 10, 1 << 20, 2 << 20, 8 << 20])  # fmt: skip
    ap.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128]
    )
    ap.add_argument("--max-batch-bytes", type=int, default=512 * MIB)
    ap.add_argument("--exists-iters", type=int, default=300)
    ap.add_argument("--rss-capacity", type=int, default=256 * MIB)
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument(
        "--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    ap.add_argument("--stream-blocks", type=int, default=256, help="2 MiB blocks per round")
    ap.add_argument(
        "--paths",
        type=lambda s: s.split(","),
        default=["bulk", "zmq"],
        help="client data paths the streams section compares (bulk lane, ZeroMQ)",
    )
    ap.add_argument("--copy-threads", type=int, default=None, help="client copy pool (streams)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="streams: senders (TCP servers, the node) and receivers (TCP "
                    "clients, this process) on cores of their own, 2 a stream a side")  # fmt: skip
    ap.add_argument("--only", type=lambda s: s.split(","),
                    default=["headline", "user", "streams", "peers", "exists", "rss", "grid"],
                    help="sections to run, comma-separated")  # fmt: skip
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--default-malloc", action="store_true", help="client: glibc defaults")
    args = parse_args(ap)
    if args.quick:
        args.rounds, args.batches, args.block_sizes = 3, [1, 32], [256 * 1024, 2 * MIB]
        args.exists_iters, args.rss_capacity = 50, 64 * MIB
    if not args.default_malloc:
        tune_malloc_for_blocks()
    env = environment()
    print(f"# {env['device']}, {env['cpu_count']} cpus, commit {env['commit']}", flush=True)
    peers = (lambda a: {}) if args.skip_peers else peer_rows
    sections = {"headline": headline, "user": user_rounds, "streams": streams_rows,
                "peers": peers, "exists": exists_latency, "rss": rss_under_stream,
                "grid": grid}  # fmt: skip
    engine_heap()  # from here on this process is a started engine (torch and modules frozen)
    result = {name: fn(args) for name, fn in sections.items() if name in args.only}
    reason = "no raw-TCP peer measured (peers not installed or --skip-peers)"
    print(f"wrote {write_result('bench_store', result, nan_reason=reason)}")


if __name__ == "__main__":
    main()
