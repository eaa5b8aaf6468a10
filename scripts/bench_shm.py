"""Same-host shortcut benchmark: get GB/s of N blocks from one ``pagekv serve --shm`` node through
its shared segment, over TCP (the same node, the shortcut turned off for that client), and the
memcpy ceilings of this host (numpy copies of the same bytes, 1 thread and the reader's thread
count), all in the same run, round after round; medians reported.

    python scripts/bench_shm.py [--blocks 64] [--block-size 2MiB] [--rounds 7] [--save]
                                [--chunks-kib 256,1024,2048] [--native on|off|both]

``--chunks-kib``: the checked copy's chunk (``pagekv.store.wire.copies.CHUNK_BYTES``) to compare,
shm and TCP rows per chunk size (the first is the headline), plus a "copy+hash" ceiling (the
reader's threads copying then hashing each block: the two-pass work with no store around it).
``--native``: the checked copy in C (``pagekv.store.wire.native``, ``PAGEKV_NATIVE_COPY=on``), the
numpy path (``off``) or both, rows ``shm_<native|numpy>_c<chunk>`` (the chunk applies to the
numpy path only).
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

from pagekv.store import ClientConfig, Status, StoreClient, parse_size
from pagekv.store.launch import NodeProcess
from pagekv.store.wire import copies, native


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
    ap.add_argument("--native", choices=["on", "off", "both"], default="both")
    ap.add_argument("--more-threads", type=lambda s: [int(x) for x in s.split(",")], default=[],
                    help="also time the shortcut with these reader thread counts (native, "
                    "first chunk), each against the memcpy ceiling of as many threads")  # fmt: skip
    args = parse_args(ap)
    natives = {"on": ["native"], "off": ["numpy"], "both": ["native", "numpy"]}[args.native]
    label = {mode: mode for mode in natives}
    if "native" in natives:
        os.environ["PAGEKV_NATIVE_COPY"] = "on"
        native.load()  # built before anything is timed
    size, n = parse_size(args.block_size), args.blocks
    total = size * n
    node = NodeProcess("--shm", "--capacity", str(2 * total + (64 << 20))).start()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    keys = [f"bench-shm-{i}".encode() for i in range(n)]
    into = [bytearray(size) for _ in range(n)]  # touched once: like pinned pages, no faults
    dst = [np.frombuffer(b, dtype=np.uint8) for b in into]
    fast = StoreClient(node.address)
    tcp = StoreClient(node.address, config=ClientConfig((node.address,), shm=False))
    reader = fast._client._shm  # the same-host transport: its copy threads
    threads = reader.workers
    pool = ThreadPoolExecutor(threads)
    rows: dict[str, list[float]] = {"memcpy_1": [], f"memcpy_{threads}": [], "copy+hash": []}
    for name in label.values():
        for chunk in args.chunks_kib:
            rows.update({f"shm_{name}_c{chunk}": [], f"tcp_{name}_c{chunk}": []})
    more = [t for t in args.more_threads if t != threads]
    for t in more:
        rows.update({f"memcpy_{t}": [], f"shm_native_t{t}": []})
    try:
        if set(fast.put_many(keys, blocks)) != {Status.OK}:
            raise RuntimeError("put failed")
        get_seconds(fast, keys, into)  # warm: mapping, limits, pool
        get_seconds(tcp, keys, into)
        for _ in range(args.rounds):
            rows["memcpy_1"].append(memcpy_seconds(blocks, dst, None))
            rows[f"memcpy_{threads}"].append(memcpy_seconds(blocks, dst, pool))
            rows["copy+hash"].append(copy_hash_seconds(blocks, dst, pool))
            for mode, name in label.items():
                os.environ["PAGEKV_NATIVE_COPY"] = "on" if mode == "native" else "off"
                for chunk in args.chunks_kib:
                    copies.CHUNK_BYTES = chunk << 10
                    into[0][:8] = b"\0" * 8
                    rows[f"shm_{name}_c{chunk}"].append(get_seconds(fast, keys, into))
                    if bytes(into[0][:64]) != blocks[0][:64].tobytes():
                        raise RuntimeError("shm get returned wrong bytes")
                    rows[f"tcp_{name}_c{chunk}"].append(get_seconds(tcp, keys, into))
            os.environ["PAGEKV_NATIVE_COPY"] = "on"
            copies.CHUNK_BYTES = args.chunks_kib[0] << 10
            for t in more:
                with ThreadPoolExecutor(t) as t_pool:
                    rows[f"memcpy_{t}"].append(memcpy_seconds(blocks, dst, t_pool))
                reader.workers = t
                rows[f"shm_native_t{t}"].append(get_seconds(fast, keys, into))
            reader.workers = threads
        hits = fast.counters["shm_hits"]
        node_stats = fast.stats()[0]
    finally:
        fast.close()
        tcp.close()
        pool.shutdown()
        node.stop()
    gbps = {name: total / statistics.median(times) / 1e9 for name, times in rows.items()}
    first, head = args.chunks_kib[0], next(iter(label.values()))
    gbps["shm"], gbps["tcp"] = gbps[f"shm_{head}_c{first}"], gbps[f"tcp_{head}_c{first}"]
    ks = sorted({1, threads} | ({8} if "memcpy_8" in gbps else set()))  # 8: issue 13's bound
    over = {f"{name}_over_memcpy_{k}": gbps[name] / gbps[f"memcpy_{k}"]
            for name in gbps if name.startswith("shm_") for k in ks}  # fmt: skip
    over.update({f"shm_native_t{t}_over_memcpy_{k}": gbps[f"shm_native_t{t}"] / gbps[f"memcpy_{k}"]
                 for t in more for k in (8, t) if f"memcpy_{k}" in gbps})  # fmt: skip
    result = {"blocks": n, "block_size": size, "rounds": args.rounds, "reader_threads": threads,
              "copy_threads": tcp.config.copy_threads, "chunks_kib": args.chunks_kib,
              "cpu_count": os.cpu_count(), "get_gbps": gbps, "shm_hits": hits,
              "shm_over_memcpy_n": gbps["shm"] / gbps[f"memcpy_{threads}"],
              "shm_over_tcp": gbps["shm"] / gbps["tcp"],
              "node_locates": node_stats["op_locate"], "native": args.native,
              "over_memcpy": over}  # fmt: skip
    print(f"{n} x {size >> 10} KiB, {os.cpu_count()} cores, reader threads {threads}, "
          f"median of {args.rounds} rounds (GB/s):")  # fmt: skip
    for name, value in gbps.items():
        ratios = ""
        if name.startswith("shm_"):
            mine = {
                k.split("_over_")[1]: r for k, r in over.items() if k.startswith(name + "_over")
            }
            ratios = "".join(f"  /{k} {r:.2f}" for k, r in mine.items())
        print(f"  {name:>24}  {value:6.2f}{ratios}")
    print(f"  shm / memcpy_{threads} = {result['shm_over_memcpy_n']:.2f}, "
          f"shm / tcp = {result['shm_over_tcp']:.2f}")  # fmt: skip
    print(write_result("bench_shm", result))


if __name__ == "__main__":
    main()
