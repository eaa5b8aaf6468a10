"""Copy-engine ratio study (GPU): what closes the gap to the pinned contiguous copy.

For the issue's shapes (Llama-3-8B, its TP-8 slice, MLA-576; pages of 16-128 tokens; all-layer
transfers of ``--mib`` and one-layer loads of 4-32 MiB) each candidate is timed in the same
rounds as the contiguous pinned copy (the ceiling) and reported as ceiling time / its time:

* ``kernel``: the SM kernels; ``ce``: the copy engine as ``auto`` runs it (module defaults);
* ``ce1d_lN``: one 1-D copy per (run, layer, K/V) over N streams (N = 4, 8, 16);
* ``ce2d_lN``: 2-D copies whose rows are the layers (N = 4; 1, 2 and 4 streams measured
  alike at e39b145);
* ``ce1d_l8_early`` (loads): 1-D over 8 streams with the sources read during the call
  (cudaMemcpySrcAccessOrderDuringApiCall: valid only for host pages nothing writes later);
* ``d2d_1d_l8``, ``d2d_1d_l16``, ``d2d_2d_l4``: the same scatter (gather) from a *device* copy
  of the pages: the copy engines' rate on the device side alone (> 1: faster than the bus);
* ``staged``: whole pages over the bus into a device staging ring (one 1-D copy per page), then
  the scatter device -> device on other streams, pipelined in chunks of ``--chunk-mib`` (saves:
  the gather, then whole pages back; a quarter of smaller transfers): the copy engines only,
  no SM.

Also ``host_us``: the host time of one ``ce`` call (descriptors and driver calls), which a
layer-by-layer load must keep under a layer's transfer time.

    python scripts/bench_copy_engine.py [--mib 256] [--reps 5] [--only all_layers,one_layer]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _bench_util import environment, parse_args, write_result
from bench_kernels import GEOMETRIES, Setup, ceiling_fns, gbps, interleaved, ratio

from pagekv.connector import KVGeometry
from pagekv.kernels import DeviceKV, copy_engine, load, reference, save

DEV = torch.device("cuda")
KNOBS = ("USE_2D", "LANES", "MIN_2D_ROWS", "ONE_D_MIN_RUN", "SRC_ORDER")


def with_knobs(fn: Callable[[], str], **knobs) -> Callable[[], None]:
    """``fn`` run with copy_engine's module settings changed (restored after the call)."""

    def call() -> None:
        saved = {k: getattr(copy_engine, k) for k in KNOBS}
        for k, v in knobs.items():
            setattr(copy_engine, k, v)
        try:
            got = fn()
        finally:
            for k, v in saved.items():
                setattr(copy_engine, k, v)
        assert got == "copy_engine", f"the copy engine did not run ({got})"

    return call


ONE_D = dict(USE_2D=False, ONE_D_MIN_RUN=0)
TWO_D = dict(USE_2D=True, MIN_2D_ROWS=2, ONE_D_MIN_RUN=1 << 62)


class Staged:
    """Bench-only staged transfer through a device ring of two chunks (see module doc)."""

    def __init__(self, st: Setup, chunk_bytes: int, layer: int | None, lanes: int) -> None:
        geo = self.geo = st.geo
        self.st, self.layer, self.lanes = st, layer, lanes
        # what moves over the bus per page: the whole page, or the layer's rows (contiguous)
        self.unit = geo.page_bytes if layer is None else geo.page_bytes // geo.num_layers
        self.per = max(1, min(st.n_pages, chunk_bytes // self.unit))
        elems = self.unit // geo.dtype.itemsize
        self.flat = KVGeometry.mla(1, 1, elems, geo.dtype)  # one "token" = one unit
        self.ring = [torch.empty(self.per, *geo.host_page_shape, dtype=geo.dtype, device=DEV)
                     for _ in range(2)]  # fmt: skip
        # device side of the bus copy: the ring's units; host side: the pool's units
        if layer is None:
            self.ring_units = [DeviceKV.from_caches(self.flat, r.view(1, self.per, elems))
                               for r in self.ring]  # fmt: skip
            self.host_units = st.host.view(st.n_pages, 1, 1, elems)
        else:  # a layer's K and V rows of a page are adjacent on the host: one unit per page
            per_layer = geo.page_bytes // geo.num_layers // geo.dtype.itemsize
            self.ring_units = [
                DeviceKV.from_caches(self.flat, r.view(self.per, -1)[:, layer * per_layer :
                                     (layer + 1) * per_layer].unsqueeze(0))
                for r in self.ring
            ]  # fmt: skip
            self.host_units = None  # a strided view of the pool: see _host_layer
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self.done = [[torch.cuda.Event(), torch.cuda.Event()] for _ in range(2)]
        self.used = [False, False]

    def _host_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's units of the pool as pages of a 1-unit geometry: rows of the pool
        viewed [pages * num_layers, unit] and the page ids mapped to page * L + layer."""
        geo, st = self.geo, self.st
        elems = self.unit // geo.dtype.itemsize
        return st.host.view(st.n_pages * geo.num_layers, 1, 1, elems), st.ids_cpu

    def run(self, load_dir: bool, n: int) -> str:
        geo, st = self.geo, self.st
        cur = torch.cuda.current_stream()
        bus, dev = self.streams
        bus.wait_stream(cur)
        dev.wait_stream(cur)
        if self.layer is None:
            host_units, ids_all = self.host_units, st.ids_cpu
        else:
            host_units, base = self._host_layer()
            ids_all = base * geo.num_layers + self.layer
        knobs = dict(ONE_D, LANES=self.lanes)
        for c, first in enumerate(range(0, n, self.per)):
            b, k = c % 2, min(self.per, n - first)
            ids = ids_all[first : first + k]
            slots = st.slots_cpu[first : first + k]
            units, ring = torch.arange(k).view(k, 1), torch.arange(k)
            layer, ring_units = self.layer, self.ring_units[b]
            if load_dir:  # over the bus into the ring, then scattered from it
                steps = (
                    (bus, lambda: load(host_units, ids, ring_units, units, backend="copy_engine",
                                       validate=False)),
                    (dev, lambda: load(self.ring[b], ring, st.kv, slots, layer=layer,
                                       backend="copy_engine", validate=False)),
                )  # fmt: skip
            else:  # gathered into the ring, then over the bus
                steps = (
                    (dev, lambda: save(st.kv, slots, self.ring[b], ring, layer=layer,
                                       backend="copy_engine", validate=False)),
                    (bus, lambda: save(ring_units, units, host_units, ids, backend="copy_engine",
                                       validate=False)),
                )  # fmt: skip
            for i, (stream, step) in enumerate(steps):
                with torch.cuda.stream(stream):
                    if i == 1:
                        stream.wait_event(self.done[b][0])
                    elif self.used[b]:  # the ring chunk's previous scatter (gather) is done
                        stream.wait_event(self.done[b][1])
                    with_knobs(step, **knobs)()
                    self.done[b][i].record(stream)
            self.used[b] = True
        cur.wait_stream(bus)
        cur.wait_stream(dev)
        return "copy_engine"


def chunk_bytes(st: Setup, n: int, layer: int | None, args) -> int:
    """The staged ring's chunk: ``--chunk-mib``, or a quarter of a smaller transfer (so that
    a 4 MiB one-layer load still overlaps its bus and device halves)."""
    per_page = st.geo.page_bytes if layer is None else st.geo.page_bytes // st.geo.num_layers
    return min(args.chunk_mib << 20, max(n * per_page // 4, 1))


def candidates(st: Setup, n: int, layer: int | None, args) -> dict:
    ids, slots = st.ids_cpu[:n], st.slots_cpu[:n]
    ids_d, slots_d = st.ids[:n], st.slots[:n]
    dev_pages = torch.empty_like(st.host, device=DEV)
    dev_pages.copy_(st.host)

    def ld(host=st.host, backend="copy_engine", i=ids, s=slots):
        return lambda: load(host, i, st.kv, s, layer=layer, backend=backend, validate=False)

    def sv(host=st.host, backend="copy_engine", i=ids, s=slots):
        return lambda: save(st.kv, s, host, i, layer=layer, backend=backend, validate=False)

    fns: dict = {}
    for name, mk in (("load", ld), ("save", sv)):
        fns[f"kernel_{name}"] = mk(backend="kernel", i=ids_d, s=slots_d)
        fns[f"ce_{name}"] = with_knobs(mk())
        for lanes in args.lanes_1d:
            fns[f"ce1d_l{lanes}_{name}"] = with_knobs(mk(), **ONE_D, LANES=lanes)
        for lanes in args.lanes_2d:
            fns[f"ce2d_l{lanes}_{name}"] = with_knobs(mk(), **TWO_D, LANES=lanes)
        for lanes in (8, 16):
            fns[f"d2d_1d_l{lanes}_{name}"] = with_knobs(mk(host=dev_pages), **ONE_D, LANES=lanes)
        fns[f"d2d_2d_l4_{name}"] = with_knobs(mk(host=dev_pages), **TWO_D, LANES=4)
        staged = Staged(st, chunk_bytes(st, n, layer, args), layer, lanes=8)
        fns[f"staged_{name}"] = (lambda s, d: lambda: s.run(d, n))(staged, name == "load")
    fns["ce1d_l8_early_load"] = with_knobs(ld(), **ONE_D, LANES=8, SRC_ORDER=2)
    return fns


def staged_exact(st: Setup, n: int, layer: int | None, args) -> bool:
    """The staged load writes what the torch reference writes (destination poisoned first)."""
    want = [c.clone() for c in st.caches]
    for c in st.caches:
        c.view(torch.uint8).fill_(0xA5)
    for c in want:
        c.view(torch.uint8).fill_(0xA5)
    ref_kv = DeviceKV.from_caches(st.geo, *want)
    reference.load_ref(st.host, st.ids_cpu[:n], ref_kv, st.slots_cpu[:n], layer=layer)
    Staged(st, chunk_bytes(st, n, layer, args), layer, lanes=8).run(True, n)
    torch.cuda.synchronize()
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(st.caches, want))  # fmt: skip


def host_us(fn: Callable[[], None], reps: int = 20) -> float:
    """Median host time of one call (the device drained before each)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 1)


def best_dma(r: dict) -> dict:
    """The highest ratio of a copy-engine-only way (not the early-read one) per direction."""
    out = {}
    for d in ("load", "save"):
        ways = [(v, k) for k, v in r.items() if isinstance(v, float) and k.endswith("_" + d)
                and k.startswith(("ce", "staged")) and "early" not in k]  # fmt: skip
        if ways:
            v, k = max(ways)
            out[d] = dict(ratio=v, how=k)
    return out


def runnable(fns: dict, r: dict) -> dict:
    """The candidates that run once without error; each failure is recorded in ``r`` (and a
    refused copy engine re-enabled, so that one refused form costs no other candidate)."""
    out = {}
    for key, fn in fns.items():
        try:
            fn()
            out[key] = fn
        except (AssertionError, RuntimeError) as e:
            r[f"{key}_error"] = f"{str(e)[:200]} | {copy_engine._failed.pop(0, None)}"
    torch.cuda.synchronize()
    return out


def case(raw_host, name: str, page: int, layer: int | None, nbytes: int, args) -> dict:
    geo = KVGeometry(page_size=page, **GEOMETRIES[name])
    per_page = geo.page_bytes if layer is None else geo.page_bytes // geo.num_layers
    pages = max(1, nbytes // per_page)
    st = Setup(raw_host, geo, min(raw_host.numel(), geo.page_bytes * pages))
    n = max(1, min(st.n_pages, nbytes // per_page))
    moved = n * per_page
    r: dict = dict(geometry=name, page_size=page, layer=layer, mib=round(moved / 2**20, 2),
                   run_kib=page * geo.item_bytes / 1024,
                   plan_rows=copy_engine.row_plan(st.kv, layer or 0, 1 if layer is not None
                                                  else geo.num_layers,
                                                  page * geo.item_bytes).rows_per_copy)  # fmt: skip
    try:
        fns = {**ceiling_fns(raw_host, moved), **candidates(st, n, layer, args)}
        if layer is not None:
            fns = {k: v for k, v in fns.items() if not k.endswith("_save") or k.startswith(
                ("kernel", "ce_", "ceiling"))}  # fmt: skip
        fns = runnable(fns, r)
        t = interleaved(fns, args.reps)
        r["host_us_ce_load"] = host_us(fns["ce_load"])
        r["staged_exact"] = staged_exact(st, n, layer, args)
    except (AssertionError, RuntimeError) as e:  # recorded, and the study goes on
        r.update(error=str(e)[:300], failed=copy_engine._failed.pop(0, None))
        print(f"ce study {r}", flush=True)
        return r
    for key in t:
        if not key.startswith("ceiling"):
            r[key] = ratio(t, "ceiling_h2d" if key.endswith("load") else "ceiling_d2h", key)
    r["ceiling_h2d_gbps"] = round(gbps(moved, statistics.median(t["ceiling_h2d"])), 2)
    r["ceiling_d2h_gbps"] = round(gbps(moved, statistics.median(t["ceiling_d2h"])), 2)
    r["best_dma"] = best_dma(r)
    shown = " ".join(f"{k} {v}" for k, v in r.items() if isinstance(v, float)
                     and not k.startswith(("run", "mib", "ceiling")))  # fmt: skip
    print(f"ce study {name:14s} page {page:4d} layer {layer} {r['mib']} MiB: {shown} | best "
          f"{r['best_dma']} (ceiling {r['ceiling_h2d_gbps']} GB/s)", flush=True)  # fmt: skip
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--mib", type=int, default=256, help="all-layer transfer size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--page-sizes", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--layer-mib", type=ints, default=[4, 16])
    ap.add_argument("--lanes-1d", type=ints, default=[4, 8, 16])
    ap.add_argument("--lanes-2d", type=ints, default=[4])
    ap.add_argument("--chunk-mib", type=int, default=16, help="staged: ring chunk")
    ap.add_argument("--only", default="all_layers,one_layer")
    args = parse_args(ap)
    env = environment()
    ce = f"copy engine {copy_engine._support(0)} {copy_engine.disabled_reason(0) or 'ok'}"
    print(f"# {env['device']} torch {env['torch']} cuda {env.get('cuda')} {env['commit']}; {ce}")
    raw_host = torch.empty(max(args.mib << 20, 1 << 30), dtype=torch.uint8).pin_memory()
    raw_host.random_()
    result: dict = {"env": env, "args": vars(args),
                    "defaults": {k: getattr(copy_engine, k) for k in KNOBS}}  # fmt: skip
    only = args.only.split(",")
    plan = []
    if "all_layers" in only:
        plan += [("all_layers", g, p, None, args.mib) for g in GEOMETRIES for p in args.page_sizes]
    if "one_layer" in only:
        plan += [("one_layer", g, 16, 5, mib) for g in GEOMETRIES for mib in args.layer_mib]
    for section, g, page, layer, mib in plan:
        result.setdefault(section, []).append(case(raw_host, g, page, layer, mib << 20, args))
        path = write_result("bench_copy_engine", result)  # after each case: a cut run keeps them
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
