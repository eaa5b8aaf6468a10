"""Kernel benchmark (GPU): page-first host <-> layer-first device transfers and the fused KV store,
side by side with the contiguous pinned copy (the ceiling) in the same run.

The copy-engine backend is measured by ``scripts/bench_copy_engine.py``.

For each geometry (Llama-3-8B, its TP-8 slice with 256-byte rows, a DeepSeek-style MLA latent)
and page size 1..128, moving >= 256 MiB: our kernel (load / save, all layers, N blocks), the
direct memcpy backend, one host->device copy into a staging buffer plus a GPU scatter, and
per-page-per-layer torch copies. Then the one-layer load by batch size, a thread-block sweep,
and the fused KV store against two index_put. Medians of CUDA-event timings.

    python scripts/bench_kernels.py [--quick] [--save]   # --save: into benchmarks/results/
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Protocol

import torch
from _bench_util import environment, parse_args, write_result

from pagekv.connector import KVGeometry
from pagekv.kernels import DeviceKV, load, ops, save, store_kv

DEV = torch.device("cuda")
GEOMETRIES = {
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16"),
    "llama3-8b-tp8": dict(num_layers=32, num_kv_heads=1, head_dim=128, dtype="bf16"),
    "mla-576": dict(num_layers=61, num_kv_heads=1, head_dim=576, dtype="bf16", kind="mla"),
}


def parse_shapes(text: str) -> list[tuple[str, int]]:
    """``geometry:page,...`` (names of :data:`GEOMETRIES`) as (geometry, page size) pairs."""
    shapes = [(name, int(page)) for name, page in (x.split(":") for x in text.split(","))]
    unknown = [name for name, _ in shapes if name not in GEOMETRIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown geometries {unknown}: {sorted(GEOMETRIES)}")
    return shapes


def median_ms(fn, reps: int, warmup: int = 2, inner: int = 3) -> float:
    """Median over ``reps`` of the CUDA-event time of ``inner`` back-to-back calls, per call:
    the GPU stays busy, so Python launch overhead overlaps the previous call's copy."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def graph_us(fn, calls: int = 20, reps: int = 15) -> float:
    """GPU time per call, from replays of a CUDA graph of ``calls`` captured calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, reps, inner=1) * 1e3 / calls


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


class Setup:
    """Host pages, device caches and slot tables for one geometry and page size."""

    def __init__(
        self, raw_host: torch.Tensor, geo: KVGeometry, total_bytes: int, joint: bool = False
    ) -> None:
        self.geo = geo
        self.n_pages = max(1, total_bytes // geo.page_bytes)
        self.nbytes = self.n_pages * geo.page_bytes
        n_tokens = self.n_pages * geo.page_size
        self.host = raw_host[: self.nbytes].view(geo.dtype).view(self.n_pages, *geo.host_page_shape)
        shape = (geo.num_layers, n_tokens, *geo.device_layer_shape)
        if joint:  # K and V in one allocation, V after K: one distance between a layer's K and V
            both = torch.empty(geo.num_kv, *shape, dtype=geo.dtype, device=DEV)
            self.caches = list(both.unbind(0))
        else:
            self.caches = [
                torch.empty(shape, dtype=geo.dtype, device=DEV) for _ in range(geo.num_kv)
            ]
        for c in self.caches:
            c.view(torch.uint8).random_()
        self.kv = DeviceKV.from_caches(geo, *self.caches)
        # pages land on shuffled page-sized runs of slots (a paged engine's block table)
        order = torch.randperm(self.n_pages)
        self.slots_cpu = (order[:, None] * geo.page_size + torch.arange(geo.page_size)).contiguous()
        self.slots = self.slots_cpu.to(DEV)
        self.ids_cpu = torch.randperm(self.n_pages)
        self.ids = self.ids_cpu.to(DEV)

    def staged_load(self, staging: torch.Tensor) -> None:
        """Baseline: one contiguous H2D copy of the pages into a staging buffer, then scatter."""
        geo = self.geo
        buf = staging[: self.nbytes].view(geo.dtype).view(self.n_pages, *geo.host_page_shape)
        buf.copy_(self.host, non_blocking=True)
        rows = buf[self.ids].view(self.n_pages, geo.num_layers, geo.num_kv, geo.page_size, -1)
        flat = self.slots.view(-1)
        for layer in range(geo.num_layers):
            for c in range(geo.num_kv):
                src = rows[:, layer, c].reshape(-1, geo.row_elems)
                self.kv.layers[c][layer].index_copy_(0, flat, src)

    def per_page_load(self, max_pages: int) -> None:
        """Baseline: one torch copy per page, layer and K/V (pages are slot-contiguous)."""
        geo = self.geo
        hv = self.host.view(self.n_pages, geo.num_layers, geo.num_kv, geo.page_size, -1)
        for i in range(min(self.n_pages, max_pages)):
            start = int(self.slots_cpu[i, 0])
            page = int(self.ids_cpu[i])
            for layer in range(geo.num_layers):
                for c in range(geo.num_kv):
                    dst = self.kv.layers[c][layer][start : start + geo.page_size]
                    dst.copy_(hv[page, layer, c], non_blocking=True)


def interleaved(fns: dict, reps: int, inner: int = 3) -> dict[str, list[float]]:
    """Per-call ms of each function, ``reps`` rounds taken in turn (ceiling, ours, ceiling, ...)
    so that drift of the bus speed during the run hits every candidate alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(median_ms(fn, 1, warmup=0, inner=inner))
    return times


def ratio(times: dict[str, list[float]], ceiling: str, ours: str) -> float:
    """Median over rounds of ceiling time / our time (>= 1 would mean faster than the copy)."""
    return round(statistics.median(c / o for c, o in zip(times[ceiling], times[ours])), 3)


def kernel_fns(st: Setup, blocks: int | None = None) -> dict:
    return {
        "kernel_load": lambda: load(
            st.host, st.ids, st.kv, st.slots, num_blocks=blocks, backend="kernel", validate=False
        ),
        "kernel_save": lambda: save(
            st.kv, st.slots, st.host, st.ids, num_blocks=blocks, backend="kernel", validate=False
        ),
    }


class Pages(Protocol):
    """Host pages, device caches and their indices, as :class:`Setup` holds them."""

    host: torch.Tensor
    kv: DeviceKV
    ids: torch.Tensor  # [n] on the device
    slots: torch.Tensor  # [n, page_size] on the device
    ids_cpu: torch.Tensor
    slots_cpu: torch.Tensor


def split_fn(st: Pages, n: int, share: float, is_load: bool, blocks: int | None, dma: str):
    """The all-layer transfer of ``st``'s first ``n`` pages split: the last ``share`` of them
    on ``dma`` (CPU indices) on a stream forked from the current one and joined back, the rest
    on the kernel (``blocks``, None: its default; device indices) on the current stream. The
    returned call gives the backend the DMA share took ("" when it has no pages). ``pitched``
    is the library's split backend (``backend="split"``); ``copy_engine`` (batched copies for
    the share, which the library does not offer) is built here."""
    if dma == "pitched":
        blocks = blocks or (ops.LOAD_BLOCKS if is_load else ops.SAVE_BLOCKS)
        shared = round(n * share) > 0

        def library() -> str:
            if is_load:
                took = load(st.host, st.ids_cpu[:n], st.kv, st.slots_cpu[:n], backend="split",
                            validate=False, num_blocks=blocks, dma_share=share)  # fmt: skip
            else:
                took = save(st.kv, st.slots_cpu[:n], st.host, st.ids_cpu[:n], backend="split",
                            validate=False, num_blocks=blocks, dma_share=share)  # fmt: skip
            return ("pitched" if took == "split" else took) if shared else ""

        return library
    k = n - round(n * share)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    fork, join = torch.cuda.Event(), torch.cuda.Event()

    def run() -> str:
        fork.record(main)
        if k:
            if is_load:
                load(st.host, st.ids[:k], st.kv, st.slots[:k], backend="kernel",
                     validate=False, num_blocks=blocks)  # fmt: skip
            else:
                save(st.kv, st.slots[:k], st.host, st.ids[:k], backend="kernel",
                     validate=False, num_blocks=blocks)  # fmt: skip
        if k == n:
            return ""
        side.wait_event(fork)
        with torch.cuda.stream(side):
            if is_load:
                took = load(st.host, st.ids_cpu[k:n], st.kv, st.slots_cpu[k:n], backend=dma,
                            validate=False)  # fmt: skip
            else:
                took = save(st.kv, st.slots_cpu[k:n], st.host, st.ids_cpu[k:n], backend=dma,
                            validate=False)  # fmt: skip
        join.record(side)
        main.wait_event(join)
        return took

    return run


def ceiling_fns(raw_host: torch.Tensor, nbytes: int) -> dict:
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    host_flat = raw_host[:nbytes]
    return {
        "ceiling_h2d": lambda: dev_flat.copy_(host_flat, non_blocking=True),
        "ceiling_d2h": lambda: host_flat.copy_(dev_flat, non_blocking=True),
    }


def transfer_rows(raw_host, staging, args) -> list[dict]:
    rows = []
    for name, spec in GEOMETRIES.items():
        for page in args.page_sizes:
            geo = KVGeometry(page_size=page, **spec)
            st = Setup(raw_host, geo, args.bytes)
            fns = {**ceiling_fns(raw_host, st.nbytes), **kernel_fns(st)}
            fns["staged_load"] = lambda: st.staged_load(staging)
            t = interleaved(fns, args.reps)
            # the direct backend issues one memcpy per page-run, layer and K/V: skip where that
            # is more than 100k copies (seconds per transfer; it is never the right choice there)
            if st.n_pages * geo.num_layers * geo.num_kv <= 100_000:
                direct = {
                    "ceiling_h2d": fns["ceiling_h2d"],
                    "direct_load": lambda: load(
                        st.host, st.ids_cpu, st.kv, st.slots_cpu, backend="direct", validate=False
                    ),
                    "ceiling_d2h": fns["ceiling_d2h"],
                    "direct_save": lambda: save(
                        st.kv, st.slots_cpu, st.host, st.ids_cpu, backend="direct", validate=False
                    ),
                }
                td = interleaved(direct, 3, inner=1)
                t["direct_load"], t["direct_save"] = td["direct_load"], td["direct_save"]
                t["_h2d_d"], t["_d2h_d"] = td["ceiling_h2d"], td["ceiling_d2h"]
            pages = max(1, min(st.n_pages, args.per_page_bytes // geo.page_bytes))
            pp = {"ceiling_h2d": fns["ceiling_h2d"], "per_page": lambda: st.per_page_load(pages)}
            tp = interleaved(pp, 3, inner=1)
            r = dict(
                geometry=name, page_size=page, item_bytes=geo.item_bytes, mib=st.nbytes / 2**20
            )
            for key in (
                "ceiling_h2d",
                "ceiling_d2h",
                "kernel_load",
                "kernel_save",
                "staged_load",
                "direct_load",
                "direct_save",
            ):
                if key in t:
                    r[f"{key}_gbps"] = round(gbps(st.nbytes, statistics.median(t[key])), 2)
            r["per_page_load_gbps"] = round(
                gbps(pages * geo.page_bytes, statistics.median(tp["per_page"])), 2
            )
            r["kernel_load_ratio"] = ratio(t, "ceiling_h2d", "kernel_load")
            r["kernel_save_ratio"] = ratio(t, "ceiling_d2h", "kernel_save")
            r["staged_load_ratio"] = ratio(t, "ceiling_h2d", "staged_load")
            r["per_page_load_ratio"] = round(
                r["per_page_load_gbps"] / gbps(st.nbytes, statistics.median(tp["ceiling_h2d"])), 4
            )
            if "direct_load" in t:
                r["direct_load_ratio"] = ratio({**t, "c": t["_h2d_d"]}, "c", "direct_load")
                r["direct_save_ratio"] = ratio({**t, "c": t["_d2h_d"]}, "c", "direct_save")
            rows.append(r)
            print(
                f"{name:14s} page {page:4d}: load {r['kernel_load_ratio']:.3f} save "
                f"{r['kernel_save_ratio']:.3f} direct {r.get('direct_load_ratio', '-')}/"
                f"{r.get('direct_save_ratio', '-')} staged {r['staged_load_ratio']:.3f} per-page "
                f"{r['per_page_load_ratio']:.4f} (ceiling {r['ceiling_h2d_gbps']:.1f} GB/s)",
                flush=True,
            )
    return rows


def block_sweep(raw_host, args) -> list[dict]:
    out = []
    for name in ("llama3-8b", "llama3-8b-tp8", "mla-576"):
        for page in (1, 16):
            st = Setup(raw_host, KVGeometry(page_size=page, **GEOMETRIES[name]), args.bytes)
            ceil = ceiling_fns(raw_host, st.nbytes)
            for blocks in (2, 4, 8, 16, 32):
                t = interleaved({**ceil, **kernel_fns(st, blocks)}, args.reps)
                out.append(
                    dict(
                        geometry=name,
                        page_size=page,
                        blocks=blocks,
                        load_ratio=ratio(t, "ceiling_h2d", "kernel_load"),
                        save_ratio=ratio(t, "ceiling_d2h", "kernel_save"),
                    )
                )
            print(
                f"blocks sweep {name} page {page}: "
                + " ".join(
                    f"{r['blocks']}:{r['load_ratio']:.2f}/{r['save_ratio']:.2f}" for r in out[-5:]
                ),
                flush=True,
            )
    return out


def layer_rows(raw_host, args) -> list[dict]:
    """One-layer load: the ratio to the contiguous copy of the same bytes, by batch size."""
    out = []
    geo = KVGeometry(page_size=16, **GEOMETRIES["llama3-8b"])
    st = Setup(raw_host, geo, raw_host.numel())
    layer_bytes_per_page = geo.page_bytes // geo.num_layers
    for mib in (1, 4, 16, 32):
        n = max(1, min(st.n_pages, mib * 2**20 // layer_bytes_per_page))
        nbytes = n * layer_bytes_per_page
        ids, slots = st.ids[:n], st.slots[:n]
        fns = ceiling_fns(raw_host, nbytes)
        for blocks in (4, 8):
            fns[f"layer_load_{blocks}"] = lambda b=blocks: load(
                st.host, ids, st.kv, slots, layer=5, num_blocks=b, backend="kernel", validate=False
            )
        fns["layer_load"] = lambda: load(
            st.host, ids, st.kv, slots, layer=5, backend="kernel", validate=False
        )
        t = interleaved(fns, args.reps * 3)
        out.append(
            dict(
                batch_mib=round(nbytes / 2**20, 2),
                pages=n,
                ratio=ratio(t, "ceiling_h2d", "layer_load"),
                ratio_4_blocks=ratio(t, "ceiling_h2d", "layer_load_4"),
                ratio_8_blocks=ratio(t, "ceiling_h2d", "layer_load_8"),
                kernel_gbps=round(gbps(nbytes, statistics.median(t["layer_load"])), 2),
                ceiling_gbps=round(gbps(nbytes, statistics.median(t["ceiling_h2d"])), 2),
            )
        )
        print(f"one-layer load {out[-1]}", flush=True)
    return out


def store_rows(args) -> dict:
    """Fused KV store vs two index_put (Llama-3-8B rows: 8 heads x 128 bf16 = 2 KiB)."""
    slots = 1 << 18
    kc = torch.empty(slots, 8, 128, dtype=torch.bfloat16, device=DEV)
    vc = torch.empty_like(kc)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    big2 = torch.empty_like(big)
    d2d_gbps = gbps(2 * big.numel(), median_ms(lambda: big2.copy_(big), args.reps))
    rows = []
    for tokens in args.store_tokens:
        k = torch.randn(tokens, 8, 128, device=DEV).to(torch.bfloat16)
        v = torch.randn_like(k)
        loc = torch.randperm(slots, device=DEV)[:tokens]

        def index_put():
            kc[loc] = k
            vc[loc] = v

        def fused():
            store_kv(k, v, kc, vc, loc, validate=False)

        r = dict(tokens=tokens)
        for name, fn in (("index_put", index_put), ("store_kv", fused)):
            r[f"{name}_gpu_us"] = round(graph_us(fn), 2)
            calls = 200
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            r[f"{name}_call_us"] = round((time.perf_counter() - start) / calls * 1e6, 2)
        moved = 2 * 2 * tokens * 2048  # K and V rows, read + written
        r["speedup_call"] = round(r["index_put_call_us"] / r["store_kv_call_us"], 2)
        r["speedup_gpu"] = round(r["index_put_gpu_us"] / r["store_kv_gpu_us"], 2)
        r["store_kv_of_d2d"] = round(gbps(moved, r["store_kv_gpu_us"] / 1e3) / d2d_gbps, 3)
        rows.append(r)
        print(f"store_kv {r}", flush=True)
    return dict(d2d_gbps=round(d2d_gbps, 1), rows=rows, overhead_us=store_overheads(kc, vc))


def store_overheads(kc: torch.Tensor, vc: torch.Tensor) -> dict:
    """Where a small store_kv call's host time goes (16 tokens), per call in microseconds."""
    from pagekv.kernels import fused_store as sk
    from pagekv.kernels import jit

    k = torch.randn(16, 8, 128, device=DEV).to(torch.bfloat16)
    v, loc = torch.randn_like(k), torch.arange(16, device=DEV)
    store_kv(k, v, kc, vc, loc, validate=False)
    plan = sk._PLANS[sk._plan_key(k, v, kc, vc, loc)]
    lib = jit.load_library()
    cases = {
        "plan_key": lambda: sk._plan_key(k, v, kc, vc, loc),
        "current_stream": lambda: ops.current_stream(0),
        "ctypes_noop": lambda: lib.pagekv_abi_version(),
        "plan_launch": lambda: plan.launch(k, v, loc),
        "store_kv": lambda: store_kv(k, v, kc, vc, loc, validate=False),
        "one_index_put": lambda: kc.__setitem__(loc, k),
        "empty_like": lambda: torch.empty_like(k),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            fn()
        out[name] = round((time.perf_counter() - start) / 2000 * 1e6, 2)
        torch.cuda.synchronize()
    print(f"store_kv host overheads (us): {out}", flush=True)
    return out


def direct_sweep(raw_host, args) -> list[dict]:
    """Direct memcpy backend against the kernel by run length (bytes per memcpy)."""
    out = []
    for page in (128, 512, 2048, 8192):  # 2 KiB rows: runs of 256 KiB .. 16 MiB
        geo = KVGeometry(num_layers=2, page_size=page, num_kv_heads=8, head_dim=128, dtype="bf16")
        st = Setup(raw_host, geo, args.bytes)
        r = dict(run_kib=page * geo.item_bytes // 1024)
        for direction, fn in (
            (
                "load",
                lambda b, s: load(
                    st.host,
                    s.ids_cpu if b == "direct" else s.ids,
                    s.kv,
                    s.slots_cpu if b == "direct" else s.slots,
                    backend=b,
                    validate=False,
                ),
            ),
            (
                "save",
                lambda b, s: save(
                    s.kv,
                    s.slots_cpu if b == "direct" else s.slots,
                    s.host,
                    s.ids_cpu if b == "direct" else s.ids,
                    backend=b,
                    validate=False,
                ),
            ),
        ):
            for backend in ("kernel", "direct"):
                ms = median_ms(lambda: fn(backend, st), args.reps)
                r[f"{direction}_{backend}_gbps"] = round(gbps(st.nbytes, ms), 2)
        out.append(r)
        print(f"direct sweep {r}", flush=True)
    return out


def unroll_sweep(raw_host, args) -> list[dict]:
    """Loads in flight per thread (4 or 8) at 4 and 8 blocks."""
    out = []
    saved = ops.UNROLL_LOAD, ops.UNROLL_SAVE
    for name, page in (("llama3-8b", 1), ("llama3-8b", 16), ("llama3-8b-tp8", 16), ("mla-576", 16)):
        st = Setup(raw_host, KVGeometry(page_size=page, **GEOMETRIES[name]), args.bytes)
        dev_flat = torch.empty(st.nbytes, dtype=torch.uint8, device=DEV)
        h2d = median_ms(lambda: dev_flat.copy_(raw_host[: st.nbytes], non_blocking=True), args.reps)
        d2h = median_ms(lambda: raw_host[: st.nbytes].copy_(dev_flat, non_blocking=True), args.reps)
        for unroll in (4, 8):
            ops.UNROLL_LOAD = ops.UNROLL_SAVE = unroll
            for blocks in (4, 8):
                ld = median_ms(
                    lambda: load(
                        st.host,
                        st.ids,
                        st.kv,
                        st.slots,
                        num_blocks=blocks,
                        backend="kernel",
                        validate=False,
                    ),
                    args.reps,
                )
                sv = median_ms(
                    lambda: save(
                        st.kv,
                        st.slots,
                        st.host,
                        st.ids,
                        num_blocks=blocks,
                        backend="kernel",
                        validate=False,
                    ),
                    args.reps,
                )
                out.append(
                    dict(
                        geometry=name,
                        page_size=page,
                        unroll=unroll,
                        blocks=blocks,
                        load_ratio=round(h2d / ld, 3),
                        save_ratio=round(d2h / sv, 3),
                    )
                )
                print(f"unroll sweep {out[-1]}", flush=True)
    ops.UNROLL_LOAD, ops.UNROLL_SAVE = saved
    return out


def tp8_sweep(raw_host, args) -> list[dict]:
    """256-byte rows with 1-token pages (16 KiB blocks): load by block count, unroll and host
    page order (random page ids vs the pool's consecutive allocation)."""
    out = []
    saved = ops.UNROLL_LOAD
    for page in (1, 2):
        st = Setup(raw_host, KVGeometry(page_size=page, **GEOMETRIES["llama3-8b-tp8"]), args.bytes)
        ceil = ceiling_fns(raw_host, st.nbytes)
        random_ids, seq_ids = st.ids, torch.arange(st.n_pages, device=DEV)
        for order, ids in (("random", random_ids), ("sequential", seq_ids)):
            st.ids = ids
            for unroll in (4, 8):
                ops.UNROLL_LOAD = unroll
                for blocks in (4, 6, 8, 12, 16):
                    t = interleaved({**ceil, **kernel_fns(st, blocks)}, args.reps)
                    out.append(
                        dict(
                            page_size=page,
                            order=order,
                            unroll=unroll,
                            blocks=blocks,
                            load_ratio=ratio(t, "ceiling_h2d", "kernel_load"),
                        )
                    )
                print(
                    f"tp8 page {page} {order} unroll {unroll}: "
                    + " ".join(f"{r['blocks']}:{r['load_ratio']:.2f}" for r in out[-5:]),
                    flush=True,
                )
        st.ids = random_ids
    ops.UNROLL_LOAD = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument(
        "--page-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4, 8, 16, 32, 64, 128],
    )
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--per-page-bytes", type=int, default=16 << 20)
    ap.add_argument(
        "--store-tokens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 16, 64, 256, 1024, 4096, 16384, 65536, 131072],
    )
    ap.add_argument("--only", default="", help="comma list of sections to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, page sizes 1,16,128, 3 reps")
    args = parse_args(ap)
    if args.quick:
        args.bytes, args.page_sizes, args.reps = 64 << 20, [1, 16, 128], 3
    # exactly 1 GiB (the pinned allocator rounds up to powers of two): the one-layer batches
    # of 32 MiB need 512 pages of 2 MiB
    raw_host = torch.empty(max(args.bytes, 1 << 30), dtype=torch.uint8).pin_memory()
    raw_host.random_()
    staging = torch.empty(args.bytes, dtype=torch.uint8, device=DEV)
    env = environment()
    print(f"# {env['device']} torch {env['torch']} cuda {env.get('cuda')} commit {env['commit']}")
    result = dict(unroll_load=ops.UNROLL_LOAD, unroll_save=ops.UNROLL_SAVE)
    sections = {
        "store_kv": lambda: store_rows(args),
        "transfers": lambda: transfer_rows(raw_host, staging, args),
        "one_layer": lambda: layer_rows(raw_host, args),
        "blocks": lambda: block_sweep(raw_host, args),
        "unroll": lambda: unroll_sweep(raw_host, args),
        "tp8": lambda: tp8_sweep(raw_host, args),
        "direct": lambda: direct_sweep(raw_host, args),
    }
    optional = ("unroll", "tp8")
    chosen = args.only.split(",") if args.only else [k for k in sections if k not in optional]
    for name in chosen:
        result[name] = sections[name]()
    name = "bench_kernels" + ("_" + "_".join(chosen) if args.only else "")
    print(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
