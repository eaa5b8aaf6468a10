"""Diagnostic (GPU): does enqueueing a layer-by-layer copy-engine load from several threads lift
its host bound?

A one-layer copy-engine transfer of 32 KiB runs costs the enqueuing thread ~0.6-1 us a copy
against ~0.6 us of bus time, so a run of such layers goes at the host's pace (33-55 GB/s from one
measurement to the next on the H200). Here every layer of the pages is loaded once per round,
layer by layer (``load(layer=...)``, CPU indices, ``backend``), by ``k`` threads, thread ``i``
taking layers ``i, i + k, ...`` on a stream of its own, and each library call sent from up to
``t`` threads of the library's own (``--enqueue-threads``: ``copy_engine.ENQUEUE_THREADS``, a
thread per ``--thread-copies``: ``copy_engine.ENQUEUE_THREAD_COPIES``);
wall time from a barrier to the last stream's end, against one pinned contiguous copy of all the
bytes, rounds in turn. Also the kernel from one thread.

``--all-layers``: one all-layer call a round instead (``--threads`` 1).

    python scripts/diag_ce_layer_threads.py [--threads 1,2,4] [--enqueue-threads 1,2]
                                            [--shapes llama3-8b:16] [--mib 1024] [--all-layers]
                                            [--thread-copies 256]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from _bench_util import environment, overridden, parse_args, write_result
from bench_kernels import GEOMETRIES, Setup, parse_shapes

from pagekv.connector import KVGeometry
from pagekv.kernels import copy_engine, load

MIB = 1 << 20


def layer_loads(st: Setup, backend: str, threads: int, enqueue_threads: int = 1,
                all_layers: bool = False, thread_copies: int = 0):  # fmt: skip
    layers: list[int | None] = [None] if all_layers else list(range(st.geo.num_layers))
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def work(i: int, barrier: threading.Barrier, host_s: list[float]) -> None:
        with torch.cuda.stream(streams[i]):
            barrier.wait()
            t = time.perf_counter()
            for layer in layers[i::threads]:
                used = load(st.host, st.ids_cpu, st.kv, st.slots_cpu, layer=layer,
                            backend=backend, validate=False)  # fmt: skip
                assert used == backend, used
            host_s[i] = time.perf_counter() - t

    def call() -> tuple[float, float]:
        copies = thread_copies or copy_engine.ENQUEUE_THREAD_COPIES
        with overridden(copy_engine, ENQUEUE_THREADS=enqueue_threads,
                        ENQUEUE_THREAD_COPIES=copies):  # fmt: skip
            return timed()

    def timed() -> tuple[float, float]:
        torch.cuda.synchronize()
        barrier = threading.Barrier(threads + 1)
        host_s = [0.0] * threads
        pool = [threading.Thread(target=work, args=(i, barrier, host_s)) for i in range(threads)]
        for t in pool:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in pool:
            t.join()
        for s in streams:
            s.synchronize()
        return time.perf_counter() - start, max(host_s)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", type=parse_shapes, default=[("llama3-8b", 16), ("mla-576", 32)])
    ap.add_argument("--threads", type=lambda x: [int(n) for n in x.split(",")], default=[1, 2, 4])
    ap.add_argument("--all-layers", action="store_true")
    ap.add_argument("--enqueue-threads", type=lambda x: [int(n) for n in x.split(",")],
                    default=[1, 2])  # fmt: skip
    # copies a library thread sends at least (0: the library's setting)
    ap.add_argument("--thread-copies", type=int, default=0)
    args = parse_args(ap)
    raw = torch.empty(args.mib * MIB, dtype=torch.uint8).pin_memory()
    raw.random_()
    rows = []
    for name, page in args.shapes:
        geo = KVGeometry(page_size=page, **GEOMETRIES[name])
        st = Setup(raw, geo, args.mib * MIB)
        flat = torch.empty(st.nbytes, dtype=torch.uint8, device="cuda")

        def copy() -> tuple[float, float]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            flat.copy_(raw[: st.nbytes], non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t, 0.0

        fns = {"copy": copy, "kernel x1": layer_loads(st, "kernel", 1, 1, args.all_layers)}
        fns |= {f"copy_engine x{k} t{e}": layer_loads(st, "copy_engine", k, e, args.all_layers,
                                                     args.thread_copies)
                for k in args.threads for e in args.enqueue_threads}  # fmt: skip
        for fn in fns.values():
            fn()
        wall: dict[str, list[float]] = {n: [] for n in fns}
        host: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(args.reps):
            for n, fn in fns.items():
                w, h = fn()
                wall[n].append(w)
                host[n].append(h)
        row = {"geometry": name, "page": page, "mib": st.nbytes // MIB}
        for n in fns:
            w = statistics.median(wall[n])
            row[n] = {"gbps": round(st.nbytes / w / 1e9, 1),
                      "of_copy": round(statistics.median(c / o for c, o in
                                                         zip(wall["copy"], wall[n])), 3),
                      "host_ms": round(statistics.median(host[n]) * 1e3, 2)}  # fmt: skip
        print(row)
        rows.append(row)
    write_result("diag_ce_layer_threads", {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
