"""Disk tier benchmark (issue 30): the tier's GET throughput against the disk's own O_DIRECT
sequential-read ceiling at the same block size, measured in the same run on the same disk;
write throughput; index rebuild time after a clean stop and after a crash; optionally a replay
of Zipf-distributed prefix requests through a model of a node (memory tier + disk tier).

    python scripts/bench_disk.py                          # 2 GiB per block size, a temp dir in .
    python scripts/bench_disk.py --dir /mnt/nvme/x --gib 10 --replay   # a host's NVMe
    TESTS=tests/test_store_disk.py BENCH=disk BENCH_ARGS="--gib 10 --replay" \
        bash scripts/gpu_check.sh                         # on the GPU host, in the tree's disk

Reads: the tier reads sealed segments with O_DIRECT (no page cache). Each reference reads its
own fifth of the segment files: O_DIRECT sequential reads in chunks of the block size on as
many threads as the tier has readers, and on one; plain O_DIRECT reads of whole records in
random order (the disk's random-read speed, without the tier's work). The tier reads its
fifths as GETs of ``--get-keys`` random blocks, and of as many consecutive blocks (a prefix's
pages, evicted together). The methods take turns in ``--rounds`` rounds, so a disk whose speed
drifts (a shared virtual disk) affects them alike. No page cache helps any of them (no cache
drop is needed; ``--drop-caches`` does one anyway, as root). Where O_DIRECT is refused
(gVisor) every method reads through the page cache after dropping the file's pages (the JSON's
``disk.o_direct`` says which). The replay's model node is a BlockStore whose evictions are
offered to the tier through its eviction hook (as in a node with a disk tier), without a
network: its PUTs wait for the disk writer when its queue is half full
(``--replay-unpaced``: they do not, and a slow disk drops writes, counted in
``write_dropped``).

Everything goes in one directory, removed at the end. Results: a table, and bench_disk.json
(``$RESULTS_DIR``, ``--save`` or a temp dir; scripts/_bench_util.py).
"""

from __future__ import annotations

import argparse
import os
import random
import select
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import xxhash
from _bench_util import environment, parse_args, write_result

from pagekv.store.node.block_store import BlockStore
from pagekv.store.node.disk import DiskConfig, DiskTier
from pagekv.store.node.disk_format import PAGE, RECORD_ALIGN, align_up, record_bytes
from pagekv.store.node.disk_segment import aligned_buffer
from pagekv.store.node.memory import tune_malloc_for_blocks

GIB, MIB = 1 << 30, 1 << 20


def disk_facts(path: Path) -> dict[str, Any]:
    """Which file system and device ``path`` is on (best effort: df and lsblk)."""
    st = os.statvfs(path)
    facts: dict[str, Any] = {
        "dir": str(path),
        "fs_size_gib": round(st.f_blocks * st.f_frsize / GIB, 1),
        "fs_free_gib": round(st.f_bavail * st.f_frsize / GIB, 1),
    }
    df = subprocess.run(["df", "--output=source,fstype,target", str(path)], capture_output=True,
                        text=True)  # fmt: skip
    if df.returncode == 0 and len(df.stdout.splitlines()) > 1:
        source, fstype, target = df.stdout.splitlines()[1].split()[:3]
        facts.update(source=source, fstype=fstype, mount=target)
        lsblk = subprocess.run(["lsblk", "-ndo", "NAME,MODEL,ROTA,TRAN,SIZE", source],
                               capture_output=True, text=True)  # fmt: skip
        facts["lsblk"] = " ".join(lsblk.stdout.split()) if lsblk.returncode == 0 else None
    probe = path / "o_direct_probe"
    probe.write_bytes(bytes(PAGE))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        facts["o_direct"] = True
    except OSError:
        facts["o_direct"] = False
    probe.unlink()
    return facts


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


class Blocks:
    """``n`` blocks of ``size`` bytes: key i, payload one of 16 random buffers (the disk sees
    every record whole; the checksum is of the payload)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size
        self.bases = [os.urandom(size) for _ in range(16)]
        self.sums = [xxhash.xxh3_64_intdigest(b) for b in self.bases]

    def key(self, i: int) -> bytes:
        return i.to_bytes(16, "little")

    def item(self, i: int) -> tuple[bytes, list, int, int]:
        return self.key(i), [self.bases[i % 16]], self.size, self.sums[i % 16]


def fill(tier: DiskTier, blocks: Blocks) -> float:
    """Write every block (waiting for room in the queue); GB/s from first offer to synced."""
    start = time.perf_counter()
    queued = tier.save((blocks.item(i) for i in range(blocks.n)), timeout_s=3600)
    assert tier.flush(600) and queued == blocks.n, (queued, tier.error)
    return blocks.n * blocks.size / (time.perf_counter() - start) / 1e9


def tier_reads(tier: DiskTier, blocks: Blocks, ids: list[int], keys: int, shuffle: bool,
               depth: int) -> tuple[int, float]:  # fmt: skip
    """GETs of ``keys`` blocks each (of ``ids``: random ones, or runs of consecutive ones, as
    a prefix's pages), ``depth`` GETs in flight: (bytes, seconds)."""
    order = list(ids)
    if shuffle:
        random.Random(1).shuffle(order)
    gets = [order[k : k + keys] for k in range(0, len(order), keys)]
    if not shuffle:
        random.Random(1).shuffle(gets)
    todo, inflight, nbytes = iter(gets), 0, 0
    start = time.perf_counter()
    while True:
        while inflight < depth:
            get = next(todo, None)
            if get is None:
                break
            tier.read_many([blocks.key(i) for i in get], get)
            inflight += 1
        if not inflight:
            break
        select.select([tier.wakeup_fd], [], [], 10)
        for get, found in tier.completed():
            assert all(b is not None and b.size == blocks.size for b in found), (get, tier.error)
            inflight -= 1
            nbytes += len(found) * blocks.size
    return nbytes, time.perf_counter() - start


def open_direct(path: Path) -> int:
    """``path`` opened with O_DIRECT, or without it where the file system refuses it (then
    the page cache is dropped for it first: a cold read either way, where fadvise works)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return fd


def on_threads(threads: int, work: list, run) -> tuple[int, float]:
    """``run(share)`` for ``threads`` shares of ``work`` at once: (bytes they return, seconds)."""
    counts = [0] * threads

    def one(t: int) -> None:
        counts[t] = run(work[t::threads])

    workers = [threading.Thread(target=one, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts), time.perf_counter() - start


def sequential(paths: list[Path], chunk: int, threads: int) -> tuple[int, float]:
    """O_DIRECT sequential reads of ``chunk`` bytes through ``paths``, each file cut into
    ``threads`` ranges read at once (a thread reads one range of each file): the disk's
    ceiling at this block size and depth."""
    chunk = align_up(chunk, PAGE)
    ranges = []
    for path in paths:
        size = path.stat().st_size
        step = align_up(-(-size // threads), chunk)
        ranges += [(path, start, min(size, start + step)) for start in range(0, size, step)]

    def run(share: list[tuple[Path, int, int]]) -> int:
        buf, total = aligned_buffer(chunk), 0
        for path, start, stop in share:
            fd = open_direct(path)
            try:
                for offset in range(start, stop, chunk):
                    n = os.preadv(fd, [buf], offset)
                    total += n
                    if n < chunk:  # the end of the file
                        break
            finally:
                os.close(fd)
        return total

    return on_threads(threads, ranges, run)


def raw_random(directory: Path, block: int, ids: list[int], per: int,
               threads: int) -> tuple[int, float]:  # fmt: skip
    """Plain O_DIRECT reads of the records of blocks ``ids`` (each its aligned range, as the
    tier reads it) in random order on ``threads`` threads: the disk's random-read speed for
    this workload, without the tier's work (lookup, checks, hand-over)."""
    span, size = align_up(record_bytes(16, 1, block), RECORD_ALIGN), record_bytes(16, 1, block)
    order = list(ids)
    random.Random(2).shuffle(order)
    fds = {seg: open_direct(directory / f"{seg:016x}.seg") for seg in {1 + i // per for i in ids}}

    def run(share: list[int]) -> int:
        total = 0
        for i in share:
            at = PAGE + (i % per) * span
            start, stop = at - at % PAGE, align_up(at + size, PAGE)
            total += os.preadv(fds[1 + i // per], [aligned_buffer(stop - start)], start)
        return total

    try:
        return on_threads(threads, order, run)
    finally:
        for fd in fds.values():
            os.close(fd)


def reopen(config: DiskConfig) -> tuple[DiskTier, float]:
    """The tier opened again: it, and the wall time its constructor took."""
    start = time.perf_counter()
    tier = DiskTier(config)
    return tier, time.perf_counter() - start


METHODS = ("sequential", "sequential_1", "raw_random", "tier_random", "tier_prefix")


def one_size(root: Path, block: int, total: int, args: argparse.Namespace) -> dict[str, Any]:
    """Write ``total`` bytes of ``block``-byte blocks, then read a fifth of the segments with
    each method of ``METHODS``: O_DIRECT sequential reads on ``read_threads`` threads and on
    one, plain O_DIRECT reads of records in random order, the tier's GETs of random blocks and
    of consecutive ones (a prefix's pages). Disjoint files, each as cold as the others, read
    in rounds (a slice of each method per round: a disk whose speed drifts affects them
    alike). Then restart twice (after a clean stop, and after a crash)."""
    n = max(64, total // block)
    directory = root / f"b{block}"
    config = DiskConfig(str(directory), capacity=int(n * (block + 4096) * 1.1) + 4 * args.segment,
                        segment_bytes=args.segment, read_threads=args.read_threads)  # fmt: skip
    blocks = Blocks(n, block)
    tier = DiskTier(config)
    write_gbps = fill(tier, blocks)
    tier.close(600)
    drop_caches(args.drop_caches)
    tier, clean_open_s = reopen(config)
    row = {"block_bytes": block, "blocks": n, "gib": round(n * block / GIB, 2),
           "write_gbps": write_gbps, "clean_rebuild_s": tier.rebuild_seconds,
           "clean_open_s": clean_open_s}  # fmt: skip
    totals = read_rounds(tier, blocks, directory, args)
    row["tier_read_ops"] = tier.stats()["disk_read_ops"]
    tier.close(60)
    nan = float("nan")  # a method left without files (too little data): not measured
    gbps = {m: b / s / 1e9 if s else nan for m, (b, s, _) in totals.items()}
    row.update({f"{m}_gbps": v for m, v in gbps.items()})
    row.update({f"{m}_cpu_s_per_gb": c / (b / 1e9) if b else nan
                for m, (b, _, c) in totals.items()})  # fmt: skip
    row.update(random_vs_sequential=gbps["tier_random"] / gbps["sequential"],
               prefix_vs_sequential=gbps["tier_prefix"] / gbps["sequential"],
               random_vs_raw_random=gbps["tier_random"] / gbps["raw_random"])  # fmt: skip
    max(directory.glob("*.seg")).with_suffix(".dir").unlink()  # a crash leaves it so
    tier, crash_open_s = reopen(config)
    row.update(crash_rebuild_s=tier.rebuild_seconds, crash_open_s=crash_open_s,
               crash_scanned_mib=tier.stats()["disk_rebuild_scanned_bytes"] / MIB)  # fmt: skip
    assert tier.stats()["disk_blocks"] == n
    tier.close(60)
    shutil.rmtree(directory)
    return row


def read_rounds(tier: DiskTier, blocks: Blocks, directory: Path,
                args: argparse.Namespace) -> dict[str, list[float]]:  # fmt: skip
    """(bytes, seconds, CPU seconds of this process) per method of ``METHODS``, each over its
    fifth of the segments, read in ``--rounds`` rounds."""
    paths = sorted(directory.glob("*.seg"))
    per = blocks_per_segment(blocks.size, args.segment)
    totals = {m: [0, 0.0, 0.0] for m in METHODS}
    threads, depth, keys = args.read_threads, args.depth, args.get_keys
    for r in range(args.rounds):
        for k, method in enumerate(METHODS):
            mine = [p for p in paths if int(p.stem, 16) % 5 == k][r :: args.rounds]
            segs = {int(p.stem, 16) for p in mine}
            ids = [i for i in range(blocks.n) if 1 + i // per in segs]  # the first id is 1
            if not mine:
                continue
            cpu = time.process_time()
            if method.startswith("sequential"):
                got = sequential(mine, blocks.size, 1 if method.endswith("_1") else threads)
            elif method == "raw_random":
                got = raw_random(directory, blocks.size, ids, per, threads)
            else:
                got = tier_reads(tier, blocks, ids, keys, method == "tier_random", depth)
            totals[method][0] += got[0]
            totals[method][1] += got[1]
            totals[method][2] += time.process_time() - cpu
    return totals


def blocks_per_segment(block: int, segment: int) -> int:
    """How many records of ``block``-byte blocks (16-byte keys) the writer packs in a segment."""
    span = align_up(record_bytes(16, 1, block), RECORD_ALIGN)
    return (segment - PAGE - record_bytes(16, 1, block)) // span + 1


def rebuild_only(root: Path, records: int, args: argparse.Namespace) -> dict[str, Any]:
    """Rebuild time of an index of ``records`` 4 KiB blocks (the index's cost is per record:
    as many records as 10 GiB of 64 KiB blocks, in a fraction of the bytes)."""
    directory = root / "records"
    config = DiskConfig(str(directory), capacity=records * 8192 + 4 * args.segment,
                        segment_bytes=args.segment)  # fmt: skip
    tier = DiskTier(config)
    fill(tier, Blocks(records, 4096))
    tier.close(600)
    tier, clean_open_s = reopen(config)
    row = {"records": records, "clean_rebuild_s": tier.rebuild_seconds,
           "clean_open_s": clean_open_s}  # fmt: skip
    tier.close(60)
    max(directory.glob("*.seg")).with_suffix(".dir").unlink()
    tier, crash_open_s = reopen(config)
    row.update(crash_rebuild_s=tier.rebuild_seconds, crash_open_s=crash_open_s)
    tier.close(60)
    shutil.rmtree(directory)
    return row


def replay(root: Path, args: argparse.Namespace, with_disk: bool) -> dict[str, Any]:
    """Requests for Zipf-distributed prefixes (working set ``--replay-gib``, memory a quarter
    of it, disk ``--replay-disk`` times it): each GETs its prefix's pages in order, memory then
    disk (a disk hit promoted to memory), and stores the pages from the first miss on (the
    engine recomputed them)."""
    page, pages = args.replay_page_kib << 10, 16
    prefixes = int(args.replay_gib * GIB) // (page * pages)
    memory = BlockStore(int(args.replay_gib * GIB / 4), max_block_bytes=page)
    data = os.urandom(page)
    checksum = xxhash.xxh3_64_intdigest(data)
    disk = None
    if with_disk:  # as a node with a disk tier: evictions go to the disk writer's queue
        disk_capacity = int(args.replay_gib * GIB * args.replay_disk)
        disk = DiskTier(DiskConfig(str(root / "replay"), disk_capacity, args.segment))
        memory.on_evict = lambda key, block: disk.offer(key, block.frames, block.size,
                                                        block.checksum)  # fmt: skip
    rng = random.Random(7)
    weights = [1 / (rank + 1) ** args.zipf for rank in range(prefixes)]
    asked = hits = compulsory = 0
    latencies, seen = [], set()
    for p in rng.choices(range(prefixes), weights, k=args.replay_requests):
        compulsory += 0 if p in seen else pages  # asked for the first time: no cache has it
        seen.add(p)
        if disk is not None and not args.replay_unpaced:  # a network paces the PUTs
            if disk.stats()["disk_queue_bytes"] > disk.config.write_queue_bytes // 2:
                disk.flush(60)
        keys = [p.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(pages)]
        start = time.perf_counter()
        found = _leading_hits(memory, disk, keys)
        latencies.append(time.perf_counter() - start)
        asked, hits = asked + pages, hits + found
        for key in keys[found:]:
            memory.put(key, (data,), page, checksum)
    out = {"disk": with_disk, "paced": not args.replay_unpaced,
           "requests": args.replay_requests, "hit_rate": hits / asked,
           "max_hit_rate": 1 - compulsory / asked,
           "p50_ms": statistics.median(latencies) * 1e3,
           "p99_ms": statistics.quantiles(latencies, n=100)[98] * 1e3}  # fmt: skip
    if disk is not None:
        stats = disk.stats()
        out.update({k: stats[f"disk_{k}"] for k in ("hits", "misses", "writes", "write_dropped",
                                                     "write_skipped", "rewrites", "corrupt",
                                                     "reclaimed_blocks")})  # fmt: skip
        disk.close(60)
        shutil.rmtree(root / "replay")
    return out


def _leading_hits(memory: BlockStore, disk: DiskTier | None, keys: list[bytes]) -> int:
    """How many leading keys are found: memory first, then the rest on disk in one batch."""
    n = 0
    while n < len(keys) and memory.get(keys[n]) is not None:
        n += 1
    if n == len(keys) or disk is None:
        return n
    rest = []
    for key in keys[n:]:
        if not disk.contains(key):
            break
        rest.append(key)
    for key, block in zip(rest, disk.read_many_wait(rest, 30)):
        if block is None:
            break
        memory.put(key, block.frames, block.size, block.checksum)  # promoted
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in .)")
    ap.add_argument("--gib", type=float, default=2.0, help="data per block size")
    ap.add_argument("--block-kib", default="2048,64", help="block sizes, KiB")
    ap.add_argument("--segment", type=lambda s: int(s) << 20, default=None,
                    help="segment size, MiB (default: 128, less for under 5 GiB: each read "
                    "method needs several segments)")  # fmt: skip
    ap.add_argument("--read-threads", type=int, default=8, help="the tier's reader threads")
    ap.add_argument("--get-keys", type=int, default=16, help="keys per GET")
    ap.add_argument("--depth", type=int, default=4, help="GETs in flight")
    ap.add_argument("--rounds", type=int, default=3, help="read phases interleaved in rounds")
    ap.add_argument("--rebuild-records", type=int, default=163_840,
                    help="also time the rebuild of this many records (0: skip)")  # fmt: skip
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache (root)")
    ap.add_argument("--replay", action="store_true", help="also the Zipf prefix replay")
    ap.add_argument("--replay-gib", type=float, default=1.0, help="its working set")
    ap.add_argument("--replay-page-kib", type=int, default=256)
    ap.add_argument("--replay-disk", type=float, default=2.0, help="disk / working set")
    ap.add_argument("--replay-unpaced", action="store_true",
                    help="PUT as fast as Python can (else wait for the disk writer whenever its "
                    "queue is half full, outside the GETs timed: the PUT rate a network would "
                    "give, at most what the disk absorbs)")  # fmt: skip
    ap.add_argument("--replay-requests", type=int, default=2000)
    ap.add_argument("--zipf", type=float, default=1.0)
    args = parse_args(ap)
    if args.segment is None:  # at least ~40 segments, 8 to 128 MiB
        args.segment = min(128, max(8, int(args.gib * 1024) // 40)) << 20
    tune_malloc_for_blocks()  # as a node does: block-sized buffers reused from the heap
    root = Path(tempfile.mkdtemp(prefix="pagekv-bench-disk-", dir=args.dir or "."))
    try:
        facts = disk_facts(root)
        rows = [one_size(root, int(kib) << 10, int(args.gib * GIB), args)
                for kib in args.block_kib.split(",")]  # fmt: skip
        rebuild = rebuild_only(root, args.rebuild_records, args) if args.rebuild_records else None
        replays = [replay(root, args, False), replay(root, args, True)] if args.replay else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(environment(), facts, rows, rebuild, replays, args)


def report(env, facts, rows, rebuild, replays, args) -> None:
    print(f"# {env['host']}, {env['date']}, commit {env['commit']}; {args.read_threads} readers, "
          f"GETs of {args.get_keys} keys, {args.depth} in flight")  # fmt: skip
    print(f"# disk: {facts}")
    print(
        "| block | GiB | write GB/s | O_DIRECT seq GB/s (readers / 1 thread) "
        "| O_DIRECT random GB/s | tier GET random GB/s (/ seq, / random) "
        "| tier GET prefix GB/s (/ seq) | rebuild clean s | rebuild crash s (scanned MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['block_bytes'] >> 10} KiB | {r['gib']} | {r['write_gbps']:.2f} "
              f"| {r['sequential_gbps']:.2f} / {r['sequential_1_gbps']:.2f} "
              f"| {r['raw_random_gbps']:.2f} | {r['tier_random_gbps']:.2f} "
              f"({r['random_vs_sequential']:.2f}, {r['random_vs_raw_random']:.2f}) "
              f"| {r['tier_prefix_gbps']:.2f} ({r['prefix_vs_sequential']:.2f}) "
              f"| {r['clean_rebuild_s']:.3f} "
              f"| {r['crash_rebuild_s']:.3f} ({r['crash_scanned_mib']:.0f}) |")  # fmt: skip
    if rebuild:
        print(f"index of {rebuild['records']} records: rebuilt in "
              f"{rebuild['clean_rebuild_s']:.3f} s (clean), {rebuild['crash_rebuild_s']:.3f} s "
              "(crash: newest segment scanned)")  # fmt: skip
    for r in replays:
        print(f"replay {'memory + disk' if r['disk'] else 'memory only  '}: hit rate "
              f"{r['hit_rate']:.1%} (at most {r['max_hit_rate']:.1%}), GET p50 "
              f"{r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms")  # fmt: skip
    path = write_result("bench_disk", {"disk": facts, "read_threads": args.read_threads,
                                       "get_keys": args.get_keys, "depth": args.depth,
                                       "segment_bytes": args.segment, "rows": rows,
                                       "rebuild": rebuild, "replay": replays})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
