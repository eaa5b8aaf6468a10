"""Disk tier through real store nodes (issue 30): ``pagekv serve`` processes and a StoreClient
over TCP, every figure measured in the same run on the same disk.

- ``hits``: memory hits of a node with a disk tier against one without (same data, half of
  memory; ``--rounds`` interleaved rounds of GETs): the ratio of their medians (target >= 0.95).
- ``disk``: GETs of values only on disk (the node with a disk tier, promotion off, after 3x its
  memory more was written) against the disk's own O_DIRECT sequential-read ceiling at the same
  block size on the node's segment files, in interleaved rounds (target >= 0.8).
- ``replay``: requests for Zipf-distributed prefixes (16 pages each, working set 4x the
  node's memory) sent to a node without and a node with a disk tier in turn, request by
  request: hit rate (leading pages found) and p50/p99 GET latency of each.
- ``restart``: a directory holding ``--restart-gib`` on disk (written by the tier itself,
  closed cleanly), then a node started on it: seconds from process start to its first answered
  PING, the index rebuild, the first GET served from disk.

    python scripts/bench_disk_node.py --dir /mnt/nvme/x          # a host's disk
    python scripts/bench_disk_node.py --dir . --memory-mib 256 --restart-gib 10

Results: a table, and bench_disk_node.json (``$RESULTS_DIR``, ``--save`` or a temp dir).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench_util import environment, parse_args, write_result
from bench_disk import Blocks, disk_facts, fill, sequential

from pagekv.store import ClientConfig, Status, StoreClient
from pagekv.store.launch import NodeProcess
from pagekv.store.node.disk import DiskConfig, DiskTier

GIB, MIB = 1 << 30, 1 << 20
PAGES = 16  # pages per prefix in the replay


def node(*args: str, timeout: float = 120.0) -> tuple[NodeProcess, StoreClient]:
    n = NodeProcess(*args).start(timeout=timeout)
    return n, StoreClient(n.address, config=ClientConfig((n.address,), timeout_s=60.0))


def stats(c: StoreClient) -> dict[str, Any]:
    return c.stats()[0]


def put_paced(c: StoreClient, keys: list[bytes], vals: list[bytes], batch: int = 16) -> None:
    """PUT in batches; a node with a disk tier is let write down to half its queue first (a
    network would pace the PUTs: no write is dropped for a full queue)."""
    for i in range(0, len(keys), batch):
        wait_for_writer(c)
        got = c.put_many(keys[i : i + batch], vals[i : i + batch])
        assert all(s in (Status.OK, Status.EXISTS) for s in got), got


def wait_for_writer(c: StoreClient, share: float = 0.5) -> None:
    s = stats(c)
    if "disk_queue_bytes" not in s:
        return
    while s["disk_queue_bytes"] > QUEUE * share:
        time.sleep(0.002)
        s = stats(c)


QUEUE = 64 * MIB  # --disk-queue-size of every node here


def get_rate(c: StoreClient, keys: list[bytes], into: list[bytearray], per: int) -> float:
    """GB/s of GETs of ``per`` keys at a time (every one a hit: checked)."""
    start = time.perf_counter()
    for i in range(0, len(keys), per):
        got = c.get_many(keys[i : i + per], into=into[i : i + per])
        assert all(got), f"{got.count(False)} misses"
    return sum(len(b) for b in into) / (time.perf_counter() - start) / 1e9


def bench_hits_and_disk(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    memory, page = args.memory_mib * MIB, args.page_kib << 10
    hot_n = memory // 2 // page
    rng = random.Random(1)
    bases = [rng.randbytes(page) for _ in range(16)]
    hot = [b"hot" + i.to_bytes(13, "little") for i in range(hot_n)]
    hot_vals = [bases[i % 16] for i in range(hot_n)]
    common = ("--capacity", str(memory), "--max-block-size", str(page))
    disk_args = ("--disk", str(root / "node"), "--disk-capacity", str(8 * memory),
                 "--disk-segment-size", str(args.segment_mib * MIB), "--disk-queue-size",
                 str(QUEUE), "--no-disk-promote")  # fmt: skip
    off, c_off = node(*common)
    on, c_on = node(*common, *disk_args)
    try:
        for c in (c_off, c_on):
            put_paced(c, hot, hot_vals)
        into = [bytearray(page) for _ in hot]
        per = max(1, (args.get_mib * MIB) // page)
        off_rates, on_rates = [], []
        for _ in range(args.rounds):
            off_rates.append(get_rate(c_off, hot, into, per))
            on_rates.append(get_rate(c_on, hot, into, per))
        assert [bytes(b) for b in into[:16]] == hot_vals[:16]
        hits = {"keys": hot_n, "page_bytes": page, "off_gbps": off_rates, "on_gbps": on_rates,
                "off_median_gbps": statistics.median(off_rates),
                "on_median_gbps": statistics.median(on_rates)}  # fmt: skip
        hits["ratio"] = hits["on_median_gbps"] / hits["off_median_gbps"]
        c_off.close()
        off.stop()
        # then 3x the memory more: the first 2x of it surely only on disk
        cold_n = 3 * memory // page
        cold = [b"cold" + i.to_bytes(12, "little") for i in range(cold_n)]
        cold_vals = [bases[i % 16] for i in range(cold_n)]
        put_paced(c_on, cold, cold_vals)
        while stats(c_on)["disk_queue_bytes"]:
            time.sleep(0.01)
        on_disk = cold[: 2 * memory // page]
        into = [bytearray(page) for _ in on_disk]
        before = stats(c_on)
        files = sorted(p for p in (root / "node").iterdir() if p.suffix == ".seg")
        tier, ceiling = [], []
        for _ in range(args.rounds):
            tier.append(get_rate(c_on, on_disk, into, per))
            nbytes, seconds = sequential(files, page, args.read_threads)
            ceiling.append(nbytes / seconds / 1e9)
        after = stats(c_on)
        assert all(bytes(b) == cold_vals[i] for i, b in enumerate(into[:64]))
        disk = {"keys": len(on_disk), "node_get_gbps": tier, "o_direct_seq_gbps": ceiling,
                "node_get_median_gbps": statistics.median(tier),
                "o_direct_seq_median_gbps": statistics.median(ceiling),
                "disk_hits": after["disk_hits"] - before["disk_hits"],
                "memory_hits": after["hits"] - before["hits"],
                "segment_files": len(files), "read_threads": args.read_threads}  # fmt: skip
        disk["ratio"] = disk["node_get_median_gbps"] / disk["o_direct_seq_median_gbps"]
        # the same node's memory hits, same run: what its network path allows
        disk["vs_memory_hits"] = disk["node_get_median_gbps"] / hits["on_median_gbps"]
        return {"hits": hits, "disk": disk}
    finally:
        for c, n in ((c_off, off), (c_on, on)):
            c.close()
            n.stop()
        shutil.rmtree(root / "node", ignore_errors=True)


def bench_replay(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    memory, page = args.replay_memory_mib * MIB, args.page_kib << 10
    working = 4 * memory
    prefixes = working // (page * PAGES)
    data = random.Random(2).randbytes(page)
    common = ("--capacity", str(memory), "--max-block-size", str(page))
    nodes = {"off": node(*common),
             "on": node(*common, "--disk", str(root / "replay"), "--disk-capacity",
                        str(2 * working), "--disk-segment-size", str(args.segment_mib * MIB),
                        "--disk-queue-size", str(QUEUE))}  # fmt: skip
    rng = random.Random(7)
    weights = [1 / (rank + 1) ** args.zipf for rank in range(prefixes)]
    trace = rng.choices(range(prefixes), weights, k=args.replay_requests)
    seen: set[int] = set()
    compulsory = 0
    out: dict[str, Any] = {n: {"hits": 0, "lat": []} for n in nodes}
    try:
        for p in trace:
            compulsory += 0 if p in seen else PAGES
            seen.add(p)
            keys = [p.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(PAGES)]
            for name, (_, c) in nodes.items():
                start = time.perf_counter()
                got = c.get_many(keys)
                out[name]["lat"].append(time.perf_counter() - start)
                found = next((i for i, v in enumerate(got) if v is None), PAGES)
                assert all(bytes(v) == data for v in got[:found])
                out[name]["hits"] += found
                if found < PAGES:
                    wait_for_writer(c)
                    c.put_many(keys[found:], [data] * (PAGES - found))
        asked = len(trace) * PAGES
        result = {"memory_bytes": memory, "working_set_bytes": working, "page_bytes": page,
                  "requests": len(trace), "zipf": args.zipf,
                  "max_hit_rate": 1 - compulsory / asked}  # fmt: skip
        for name, (_, c) in nodes.items():
            lat = out[name]["lat"]
            result[name] = {"hit_rate": out[name]["hits"] / asked,
                            "p50_ms": statistics.median(lat) * 1e3,
                            "p99_ms": statistics.quantiles(lat, n=100)[98] * 1e3}  # fmt: skip
            s = stats(c)
            if name == "on":
                result[name].update(
                    {
                        k: s[f"disk_{k}"]
                        for k in ("hits", "writes", "write_dropped", "reclaimed_blocks", "corrupt")
                    }
                )
        return result
    finally:
        for n, c in nodes.values():
            c.close()
            n.stop()
        shutil.rmtree(root / "replay", ignore_errors=True)


def bench_restart(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    page = args.page_kib << 10
    directory = root / "restart"
    blocks = Blocks(int(args.restart_gib * GIB) // page, page)
    capacity = int(args.restart_gib * GIB * 1.2) + 4 * args.segment_mib * MIB
    tier = DiskTier(DiskConfig(str(directory), capacity, args.segment_mib * MIB))
    write_gbps = fill(tier, blocks)
    assert tier.close(600)
    try:
        start = time.perf_counter()
        n = NodeProcess(
            "--capacity",
            str(args.memory_mib * MIB),
            "--max-block-size",
            str(page),
            "--disk",
            str(directory),
            "--disk-capacity",
            str(capacity),
            "--disk-segment-size",
            str(args.segment_mib * MIB),
        ).start(timeout=300)
        c = StoreClient(n.address, config=ClientConfig((n.address,), timeout_s=60.0))
        try:
            assert c.ping() == [True]
            serving = time.perf_counter() - start
            got = c.get_many([blocks.key(blocks.n // 2)])
            first_get = time.perf_counter() - start
            assert got[0] is not None and bytes(got[0]) == bytes(blocks.item(blocks.n // 2)[1][0])
            s = stats(c)
        finally:
            c.close()
            n.stop()
        return {"bytes_on_disk": blocks.n * page, "blocks": blocks.n, "fill_write_gbps": write_gbps,
                "start_to_serving_s": serving, "start_to_first_disk_get_s": first_get,
                "index_rebuild_s": s["disk_rebuild_s"], "disk_blocks": s["disk_blocks"],
                "rebuild_scanned_bytes": s["disk_rebuild_scanned_bytes"]}  # fmt: skip
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in .)")
    ap.add_argument("--memory-mib", type=int, default=512, help="node memory (hits, disk)")
    ap.add_argument("--page-kib", type=int, default=256, help="value size")
    ap.add_argument("--segment-mib", type=int, default=64)
    ap.add_argument("--read-threads", type=int, default=4, help="the ceiling's threads "
                    "(the node's --disk-read-threads default)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--get-mib", type=int, default=256, help="values per get_many call, MiB "
                    "(the client pipelines its requests, as a prefetch does)")  # fmt: skip
    ap.add_argument("--replay-memory-mib", type=int, default=256)
    ap.add_argument("--replay-requests", type=int, default=1500)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--restart-gib", type=float, default=10.0)
    ap.add_argument("--only", default="hits,replay,restart", help="phases (hits includes disk)")
    args = parse_args(ap)
    base = Path(args.dir) if args.dir else Path(".")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="pagekv-bench-disk-node-", dir=base))
    phases = args.only.split(",")
    out: dict[str, Any] = {"disk": disk_facts(root), "args": vars(args)}
    try:
        if "hits" in phases:
            out.update(bench_hits_and_disk(root, args))
            h, d = out["hits"], out["disk"]
            print(f"memory hits, disk tier on/off: {h['on_median_gbps']:.2f} / "
                  f"{h['off_median_gbps']:.2f} GB/s = {h['ratio']:.3f}", flush=True)  # fmt: skip
            print(f"disk GETs through the node {d['node_get_median_gbps']:.2f} GB/s, O_DIRECT "
                  f"sequential {d['o_direct_seq_median_gbps']:.2f} GB/s = {d['ratio']:.3f}",
                  flush=True)  # fmt: skip
        if "replay" in phases:
            r = out["replay"] = bench_replay(root, args)
            for name in ("off", "on"):
                x = r[name]
                print(f"replay disk {name:3}: hit rate {x['hit_rate']:.3f} (max "
                      f"{r['max_hit_rate']:.3f}), GET p50 {x['p50_ms']:.2f} ms p99 "
                      f"{x['p99_ms']:.2f} ms", flush=True)  # fmt: skip
        if "restart" in phases:
            r = out["restart"] = bench_restart(root, args)
            print(f"restart on {r['bytes_on_disk'] / GIB:.1f} GiB: serving after "
                  f"{r['start_to_serving_s']:.2f} s (index {r['index_rebuild_s']:.3f} s), first "
                  f"disk GET after {r['start_to_first_disk_get_s']:.2f} s")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["python"] = sys.version.split()[0]
    out["machine"] = environment().get("host")
    print("wrote", write_result("bench_disk_node", out))


if __name__ == "__main__":
    main()
