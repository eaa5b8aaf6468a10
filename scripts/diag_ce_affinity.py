"""Diagnostic (GPU): the copy engine's host time per copy by the CPUs the enqueuing thread runs on.

A copy-engine transfer of 32 KiB runs costs the enqueuing thread 0.6-1 us a copy, which sets its
rate (33-55 GB/s on the H200 from one measurement to the next, and through the connector's
issuer thread slower than from the main thread). This enqueues the same layer-by-layer load
(every layer of ``--mib`` of pages, one ``transfer_layers`` call, CPU indices) from a fresh
thread pinned to each CPU set: the GPU's NUMA-local CPUs (``local_cpulist`` of its PCI device),
the others, every CPU, each CPU alone (a VM's CPUs may lie on several sockets of its host), and
from the main thread as it is; rounds in turn. Prints the NUMA
layout, and per set the host time per copy and GB/s (wall, to the stream's end).

    python scripts/diag_ce_affinity.py [--mib 1024] [--reps 5] [--shape llama3-8b:16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch
from _bench_util import environment, parse_args, write_result
from bench_kernels import GEOMETRIES, Setup, parse_shapes

from pagekv.connector import KVGeometry
from pagekv.kernels import transfer_layers

MIB = 1 << 20


def cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def gpu_local_cpus() -> set[int]:
    query = ["nvidia-smi", "-i", "0", "--query-gpu=pci.bus_id", "--format=csv,noheader"]
    bus = subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip().lower()
    path = Path("/sys/bus/pci/devices", bus[-12:], "local_cpulist")  # 0000:19:00.0
    print("gpu", bus, path.read_text().strip() if path.exists() else "(no local_cpulist)")
    return cpu_list(path.read_text()) if path.exists() else set()


def numa_nodes() -> dict[str, str]:
    root = Path("/sys/devices/system/node")
    return {p.name: (p / "cpulist").read_text().strip() for p in sorted(root.glob("node[0-9]*"))}


def enqueue(st: Setup, cpus: set[int] | None) -> tuple[float, float]:
    """Host seconds of the call and wall seconds to the stream's end."""
    out: list = []
    stream = torch.cuda.Stream()

    def work() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only
        with torch.cuda.stream(stream):
            torch.cuda.synchronize()
            t = time.perf_counter()
            layers = list(range(st.geo.num_layers))
            used, _ = transfer_layers(True, st.host, st.ids_cpu, st.kv, st.slots_cpu, layers,
                                      backend="copy_engine")  # fmt: skip
            host = time.perf_counter() - t
            stream.synchronize()
            out.append((host, time.perf_counter() - t, used))

    if cpus is None:
        work()
    else:
        th = threading.Thread(target=work)
        th.start()
        th.join()
    host, wall, used = out[0]
    assert used == "copy_engine", used
    return host, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", type=parse_shapes, default=[("llama3-8b", 16)])
    args = parse_args(ap)
    name, page = args.shape[0]
    geo = KVGeometry(page_size=page, **GEOMETRIES[name])
    raw = torch.empty(args.mib * MIB, dtype=torch.uint8).pin_memory()
    raw.random_()
    st = Setup(raw, geo, args.mib * MIB)
    copies = st.n_pages * geo.num_layers * geo.num_kv
    every = os.sched_getaffinity(0)
    local = gpu_local_cpus() & every
    sets = {"main thread": None, "all cpus": every}
    if local and local != every:
        sets |= {"gpu-local cpus": local, "other cpus": every - local}
    sets |= {f"cpu {c}": {c} for c in sorted(every)}  # a VM's CPUs may lie on several sockets
    print("numa:", numa_nodes(), "| gpu-local:", sorted(local), "| ours:", sorted(every))
    for cpus in sets.values():
        enqueue(st, cpus)
    rows: dict[str, list] = {k: [] for k in sets}
    for _ in range(args.reps):
        for k, cpus in sets.items():
            rows[k].append(enqueue(st, cpus))
    result = {}
    for k, r in rows.items():
        host = statistics.median(x[0] for x in r)
        wall = statistics.median(x[1] for x in r)
        result[k] = {"us_per_copy": round(host / copies * 1e6, 3),
                     "gbps": round(st.nbytes / wall / 1e9, 1)}  # fmt: skip
        print(k, result[k])
    write_result("diag_ce_affinity", {"env": environment(), "numa": numa_nodes(),
                                      "gpu_local": sorted(local), "copies": copies,
                                      "rows": result})  # fmt: skip


if __name__ == "__main__":
    main()
