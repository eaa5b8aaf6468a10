"""Same-host shortcut benchmark: get GB/s of N blocks from one ``pagekv serve --shm`` node through
its shared segment, over TCP (the same node, the shortcut turned off for that client), and the
memcpy ceilings of this host (numpy copies of the same bytes, 1 thread and the reader's thread
count), all in the same run, round after round; medians reported.

    python scripts/bench_shm.py [--blocks 64] [--block-size 2MiB] [--rounds 7] [--save]
                                [--chunks-kib 256,1024,2048]

``--chunks-kib``: the checked copy's chunk (``pagekv.store.copies.CHUNK_BYTES``) to compare,
shm and TCP rows per chunk size (the first is the headline), plus a "copy+hash" ceiling (the
reader's threads copying then hashing each block: the two-pass work with no store around it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _bench_util import parse_args, write_result
from xxhash import xxh3_64_intdigest

from pagekv.store import Status, StoreClient, copies, parse_size, shm_reader
from pagekv.store.launch import NodeProcess


def memcpy_seconds(src: list[np.ndarray], dst: list[np.ndarray], pool) -> float:
    t = time.perf_counter()
    if pool is None:
        for s, d in zip(src, dst):
            np.copyto(d, s)
    else:
        list(pool.map(lambda sd: np.copyto(sd[1], sd[0]), zip(src, dst)))
    return time.perf_counter() - t


def copy_hash_seconds(src: list[np.ndarray], dst: list[np.ndarray], pool) -> float:
    def one(sd):
        np.copyto(sd[1], sd[0])
        return xxh3_64_intdigest(sd[1])

    t = time.perf_counter()
    list(pool.map(one, zip(src, dst)))
    return time.perf_counter() - t


def get_seconds(client: StoreClient, keys: list[bytes], into: list[bytearray]) -> float:
    t = time.perf_counter()
    ok = client.get_many(keys, into=into)
    took = time.perf_counter() - t
    if not all(ok):
        raise RuntimeError(f"get missed {ok.count(False)} keys")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-size", default="2MiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunks-kib", type=lambda s: [int(x) for x in s.split(",")],
                    default=[copies.CHUNK_BYTES >> 10])  # fmt: skip
    args = parse_args(ap)
    size, n = parse_size(args.block_size), args.blocks
    total = size * n
    node = NodeProcess("--shm", "--capacity", str(2 * total + (64 << 20))).start()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    keys = [f"bench-shm-{i}".encode() for i in range(n)]
    into = [bytearray(size) for _ in range(n)]  # touched once: like pinned pages, no faults
    dst = [np.frombuffer(b, dtype=np.uint8) for b in into]
    fast, tcp = StoreClient(node.address), StoreClient(node.address)
    shm_reader.disable(tcp.router)
    threads = shm_reader.reader_for(fast.router).workers
    pool = ThreadPoolExecutor(threads)
    rows: dict[str, list[float]] = {"memcpy_1": [], f"memcpy_{threads}": [], "copy+hash": []}
    for chunk in args.chunks_kib:
        rows.update({f"shm_c{chunk}": [], f"tcp_c{chunk}": []})
    try:
        if set(fast.put_many(keys, blocks)) != {Status.OK}:
            raise RuntimeError("put failed")
        get_seconds(fast, keys, into)  # warm: mapping, limits, pool
        get_seconds(tcp, keys, into)
        for _ in range(args.rounds):
            rows["memcpy_1"].append(memcpy_seconds(blocks, dst, None))
            rows[f"memcpy_{threads}"].append(memcpy_seconds(blocks, dst, pool))
            rows["copy+hash"].append(copy_hash_seconds(blocks, dst, pool))
            for chunk in args.chunks_kib:
                copies.CHUNK_BYTES = chunk << 10
                into[0][:8] = b"\0" * 8
                rows[f"shm_c{chunk}"].append(get_seconds(fast, keys, into))
                if bytes(into[0][:64]) != blocks[0][:64].tobytes():
                    raise RuntimeError("shm get returned wrong bytes")
                rows[f"tcp_c{chunk}"].append(get_seconds(tcp, keys, into))
        hits = fast.counters["shm_hits"]
        node_stats = fast.stats()[0]
    finally:
        fast.close()
        tcp.close()
        pool.shutdown()
        node.stop()
    gbps = {name: total / statistics.median(times) / 1e9 for name, times in rows.items()}
    first = args.chunks_kib[0]
    gbps["shm"], gbps["tcp"] = gbps[f"shm_c{first}"], gbps[f"tcp_c{first}"]
    result = {"blocks": n, "block_size": size, "rounds": args.rounds, "reader_threads": threads,
              "copy_threads": tcp.config.copy_threads, "chunks_kib": args.chunks_kib,
              "cpu_count": os.cpu_count(), "get_gbps": gbps, "shm_hits": hits,
              "shm_over_memcpy_n": gbps["shm"] / gbps[f"memcpy_{threads}"],
              "shm_over_tcp": gbps["shm"] / gbps["tcp"],
              "node_locates": node_stats["op_locate"]}  # fmt: skip
    print(f"{n} x {size >> 10} KiB, {os.cpu_count()} cores, reader threads {threads}, "
          f"median of {args.rounds} rounds (GB/s):")  # fmt: skip
    for name, value in gbps.items():
        print(f"  {name:>10}  {value:6.2f}")
    print(f"  shm / memcpy_{threads} = {result['shm_over_memcpy_n']:.2f}, "
          f"shm / tcp = {result['shm_over_tcp']:.2f}")  # fmt: skip
    print(write_result("bench_shm", result))


if __name__ == "__main__":
    main()
