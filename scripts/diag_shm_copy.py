"""Where the same-host ``--shm`` prefetch loses against the memcpy ceiling (issue 29): GB/s of
moving ``--gib`` in 2 MiB values, every variant once per round in the same order, interleaved
rounds, in one process:

* ``ceil``: scripts/_ceilings.memcpy_ceiling(T, 32 MiB, 4) (numpy, anonymous memory);
* ``copy``: numpy copyto per value on T threads (disjoint value ranges), no hash; ``copy256k``
  the same in 256 KiB blocks (the native copy's block size);
* ``cv``: the native checked copy (copy + XXH3): ``c16`` one call per 64 MiB chunk on 16
  threads, ``c8x2`` two such calls at once on 8 threads each (the transport's PIPELINE=2),
  ``w16`` one call over everything on 16 threads;
* sources: ``anon`` (numpy), ``shm`` (a /dev/shm file mapped read-only MAP_SHARED, as
  pagekv/store/client/shm.py maps a segment), ``shmhuge`` (another such file written and
  mapped with MADV_HUGEPAGE); destinations: ``anon``, ``pin`` (torch pin_memory), ``pool``
  (torch.empty + cudaHostRegister, as connector/host_pool.py), ``pinhuge`` (anonymous mmap,
  MADV_HUGEPAGE, cudaHostRegister).

Each variant runs once untimed first into a poisoned destination and is checked (values
sampled, digests against xxh3). /proc/self/smaps tells which buffers got huge pages.

    python3 scripts/diag_shm_copy.py [--gib 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from _bench_util import SAVED_DIR, environment
from _ceilings import memcpy_ceiling

from pagekv.store.wire import native
from pagekv.store.wire.protocol import checksum

VALUE, CHUNK, BLOCK, HUGE = 2 << 20, 64 << 20, 256 << 10, 2 << 20
CUDA = torch.cuda.is_available()
copiers, drivers = ThreadPoolExecutor(16), ThreadPoolExecutor(2)


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def shm_file(n: int, fill: np.ndarray | None, huge: bool) -> tuple[np.ndarray, mmap.mmap]:
    """A /dev/shm file of ``n`` bytes (random, or a copy of ``fill``) written through a
    writable mapping, then mapped read-only MAP_SHARED (both madvised MADV_HUGEPAGE when
    ``huge``); the file is unlinked at once (the mapping keeps it)."""
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="pagekv-diag-")
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as w:
            if huge:
                w.madvise(mmap.MADV_HUGEPAGE)
            dst, rng = np.frombuffer(w, np.uint8), np.random.default_rng()
            for at in range(0, n, CHUNK):
                part = dst[at : at + CHUNK]
                part[:] = (
                    fill[at : at + CHUNK]
                    if fill is not None
                    else rng.integers(0, 256, len(part), np.uint8)
                )
            del dst, part
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE)
        return np.frombuffer(mm, np.uint8), mm
    finally:
        os.close(fd)
        os.unlink(path)


def register(a: np.ndarray) -> None:
    """Page-lock ``a`` in 1 GiB chunks (as host_pool.py)."""
    for at in range(0, a.nbytes, 1 << 30):
        size = min(1 << 30, a.nbytes - at)
        err = torch.cuda.cudart().cudaHostRegister(addr(a) + at, size, 1)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: cudaError {err}")


def huge_anon(n: int) -> tuple[np.ndarray, mmap.mmap]:
    """``n`` bytes of private anonymous memory, 2 MiB aligned, madvised MADV_HUGEPAGE, touched."""
    mm = mmap.mmap(-1, n + HUGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mm, np.uint8)
    a = whole[-addr(whole) % HUGE :][:n]
    a.fill(0)
    return a, mm


def plain(src: np.ndarray, dst: np.ndarray, threads: int, block: int = VALUE):
    """numpy copyto of every value, ``threads`` threads on disjoint value ranges."""
    nvals = src.nbytes // VALUE
    bounds = [nvals * t // threads * VALUE for t in range(threads + 1)]

    def work(lo: int, hi: int) -> None:
        for at in range(lo, hi, block):
            np.copyto(dst[at : at + block], src[at : at + block])

    def run() -> None:
        for f in [copiers.submit(work, lo, hi) for lo, hi in pairwise(bounds)]:
            f.result()

    return run


def checked(lib, src: np.ndarray, dst: np.ndarray, how: str):
    """The native checked copy of every value: ``how`` c16, c8x2 or w16 (see the docstring)."""
    vals = [([dst[at : at + VALUE]], [src[at : at + VALUE]]) for at in range(0, src.nbytes, VALUE)]
    per = CHUNK // VALUE
    chunks = [vals[i : i + per] for i in range(0, len(vals), per)]

    def run() -> list[int]:
        if how == "w16":
            return lib.copy_verify(vals, threads=16)
        if how == "c16":
            return [d for c in chunks for d in lib.copy_verify(c, threads=16)]
        return [d for ds in drivers.map(lambda c: lib.copy_verify(c, threads=8), chunks)
                for d in ds]  # fmt: skip

    return run


def smaps_huge(a: np.ndarray) -> dict[str, int]:
    """The huge-page lines (kB) of the /proc/self/smaps mapping that holds ``a``."""
    at, out, inside = addr(a), {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= at < hi
            elif inside and ("Huge" in head or "PmdMapped" in head or "PageSize" in head):
                out[head.rstrip(":")] = int(line.split()[1])
    return {k: v for k, v in out.items() if v}


def _output(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def host_facts() -> dict[str, object]:
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    info = {k: (thp / k).read_text().strip() for k in ("enabled", "shmem_enabled")
            if (thp / k).exists()}  # fmt: skip
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.split(":")[0] in ("AnonHugePages", "ShmemHugePages", "ShmemPmdMapped"):
            info[line.split(":")[0]] = line.split(":")[1].strip()
    for line in _output("lscpu").splitlines():
        key = line.split(":")[0].strip()
        if key in ("Model name", "CPU(s)", "NUMA node(s)", "L3 cache"):
            info[key] = line.split(":", 1)[1].strip()
    tun = _output("ld.so", "--list-tunables").splitlines()
    info["glibc_tunables"] = [t for t in tun if "non_temporal" in t or "rep_" in t]
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n = max(CHUNK, int(args.gib * (1 << 30)) // CHUNK * CHUNK)
    shm_free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    if shm_free < 2 * n + (1 << 30):
        raise SystemExit(f"/dev/shm has {shm_free >> 20} MiB free, needs {(2 * n >> 20) + 1024}")
    lib = native.load()
    if lib is None:
        raise SystemExit(f"native checked copy unavailable: {native.unavailable_reason()}")
    shm, _m1 = shm_file(n, None, huge=False)
    src = shm.copy()  # anonymous source, the same bytes
    anon = np.empty(n, np.uint8)
    pin = torch.empty(n, dtype=torch.uint8, pin_memory=CUDA).numpy()
    pool = torch.empty(n, dtype=torch.uint8).numpy()
    bufs = {"shm": shm, "anon_src": src, "anon": anon, "pin": pin, "pool": pool}
    if CUDA:
        register(pool)
        shmhuge, _m2 = shm_file(n, shm, huge=True)
        pinhuge, _m3 = huge_anon(n)
        register(pinhuge)
        bufs.update(shmhuge=shmhuge, pinhuge=pinhuge)
    variants = {"ceil 8t": lambda: memcpy_ceiling(8, 32 << 20, 4),
                "ceil 16t": lambda: memcpy_ceiling(16, 32 << 20, 4)}  # fmt: skip
    dsts = {}
    for s, d in (("anon_src", "anon"), ("shm", "pin"), ("shm", "anon")):
        for t in (8, 16):
            variants[f"copy {s}>{d} {t}t"] = plain(bufs[s], bufs[d], t)
            dsts[f"copy {s}>{d} {t}t"] = bufs[d]
        variants[f"copy256k {s}>{d} 16t"] = plain(bufs[s], bufs[d], 16, BLOCK)
        dsts[f"copy256k {s}>{d} 16t"] = bufs[d]
    pairs = [("anon_src", "anon"), ("shm", "pin"), ("shm", "anon"), ("shm", "pool")]
    pairs += [("shmhuge", "pinhuge")] if CUDA else []
    for s, d in pairs:
        for how in ("c16", "c8x2", "w16"):
            variants[f"cv {s}>{d} {how}"] = checked(lib, bufs[s], bufs[d], how)
            dsts[f"cv {s}>{d} {how}"] = bufs[d]
    sample = sorted({int(v) for v in np.linspace(0, n // VALUE - 1, 8)})
    refs = {v: checksum(src[v * VALUE : (v + 1) * VALUE]) for v in sample}

    def timed(name: str) -> float:
        t = time.perf_counter()
        out = variants[name]()
        return out if name.startswith("ceil") else n / 1e9 / (time.perf_counter() - t)

    for name, run in variants.items():  # untimed: faults pages in, checks the copy
        if name in dsts:
            dsts[name].fill(0x5A)
        digests = run()
        for v in sample if name in dsts else ():
            vsl = slice(v * VALUE, (v + 1) * VALUE)
            if not np.array_equal(dsts[name][vsl], src[vsl]):
                raise SystemExit(f"{name}: value {v} was not copied")
            if digests is not None and digests[v] != refs[v]:
                raise SystemExit(f"{name}: digest of value {v} is not its xxh3")
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in variants:
            rounds[name].append(timed(name))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {name: statistics.median(v) for name, v in rounds.items()}
    ceil8 = med["ceil 8t"]
    print(f"\n{'variant':34} {'median':>7} {'/ceil8':>6}  rounds (GB/s)")
    for name, vals in rounds.items():
        print(f"{name:34} {med[name]:7.2f} {med[name] / ceil8:6.2f}  "
              + " ".join(f"{v:.2f}" for v in vals))  # fmt: skip
    result = {
        "env": environment(),
        "host": host_facts(),
        "bytes": n, "value_bytes": VALUE, "chunk_bytes": CHUNK, "rounds": args.rounds,
        "pinned": "torch pin_memory (cudaHostAlloc)" if CUDA else "plain tensor (no CUDA)",
        "pool": "torch.empty + cudaHostRegister" if CUDA else "plain tensor (no CUDA)",
        "huge_variants": "run" if CUDA else "skipped: no CUDA (cudaHostRegister needed)",
        "smaps_huge": {k: smaps_huge(a) for k, a in bufs.items()},
        "median_gbps": med,
        "ratio_to_ceil8": {k: v / ceil8 for k, v in med.items()},
        "rounds_gbps": rounds,
    }  # fmt: skip
    out = Path(os.environ.get("OUT") or SAVED_DIR)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "diag_shm_copy.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"host: {json.dumps(result['host'])}\nsmaps: {json.dumps(result['smaps_huge'])}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
