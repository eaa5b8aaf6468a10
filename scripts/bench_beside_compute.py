"""What a KV load costs the model running beside it (GPU).

Part 1, a decode-like step: Llama-3-8B-shaped bf16 matmuls at batch 8 (32 layers of QKV, O,
gate/up and down projections: 14 GB of weights read per step, as a decode reads them), captured
in one CUDA graph and replayed on a stream of its own, each replay timed with events on that
stream (never a device-wide sync). In each round and for each load -- a plain contiguous
``cudaMemcpyAsync`` of the same bytes, the kernel, the copy engine, the staged backend (whole
pages through a device buffer, a kernel device to device), the pitched copy (a 2-D DMA copy per
run of slots and K/V, a row per layer), the split (the kernel on 2 blocks beside the pitched
copy, the table's share; ``split@B:S``: on B blocks with share S pitched), ``auto`` (with
``PAGEKV_COPY_BACKEND=auto``, set here: what the measured table picks for CPU indices on the
caller's thread), ``issuer`` (what the connector enqueues: the table's choice for its issuer
thread, the load enqueued there), the direct backend -- the step is timed alone, then beside
a 4 GiB all-layer load on a side stream (``--saves``: a save; ``--by-layer``: the same bytes as
one call per layer, as the connector's layer-by-layer loads and saves run beside a forward);
only steps that start and end inside the load's window (events on the side stream) count. A
round's slowdown is the median beside over the median alone; the figure is the median over
rounds, and the ratio of a backend's extra time to the plain copy's, per round, then its median.

Part 2, the reference engine (``pagekv.engine``, Llama-3-8B shape, random weights, decode steps
replayed from CUDA graphs): decode tokens/s of one request while other requests' prefixes of
1-4 GiB are loaded layer by layer (one ``load(..., layer=l)`` per layer, prefix after prefix,
enqueued when the prefill is done, on a side stream, as many as outlast the decode: checked
each time), against the same decode alone, in alternated pairs; with the host time that
enqueuing the loads took (an engine's step thread would wait that long). ``connector``: the loads
as the connector's ``load_async`` runs them (the table's choice; the copy engine enqueued by
the connector's issuer thread, :mod:`pagekv.connector.copy_issuer`), so the enqueue time is
the submitting thread's only; ``connector_ce`` the same with the copy engine for every layer,
``connector_ce@N`` with each layer's copies over N streams (``--layer-lanes``). A part-1
backend ``.../tN`` (``issuer/t1``, ``copy_engine@16/t1``): its copy-engine calls sent from at most
N host threads (``copy_engine.ENQUEUE_THREADS``).

    python scripts/bench_beside_compute.py [--rounds 7] [--engine-sizes 1,4] [--skip-engine]
                                           [--skip-decode]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch
from _bench_util import environment, overridden, parse_args, write_result
from bench_kernels import GEOMETRIES

from pagekv.connector import KVGeometry
from pagekv.connector.copy_issuer import Completion, CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch
from pagekv.kernels import DeviceKV, calibrate, copy_engine, load, ops, save, staged

DEV = torch.device("cuda")
GIB = 1 << 30


class DecodeStep:
    """Llama-3-8B-shaped projections at batch ``batch`` in one CUDA graph (weights random)."""

    SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # out, in

    def __init__(self, layers: int = 32, batch: int = 8) -> None:
        self.stream = torch.cuda.Stream()
        gen = torch.Generator(device=DEV).manual_seed(0)
        self.weights = [
            [torch.empty(o, i, dtype=torch.bfloat16, device=DEV).normal_(0, 0.02, generator=gen)
             for o, i in self.SHAPES]
            for _ in range(layers)
        ]  # fmt: skip
        self.x = torch.randn(batch, 4096, device=DEV).to(torch.bfloat16)
        self.bytes = sum(w.numel() * 2 for ws in self.weights for w in ws)
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                self._step()
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.out = self._step()
        self.stream.synchronize()

    def _step(self) -> torch.Tensor:
        h = self.x
        for wqkv, wo, wgu, wd in self.weights:
            qkv = torch.nn.functional.linear(h, wqkv)
            h = torch.nn.functional.linear(qkv[:, :4096], wo)
            gu = torch.nn.functional.linear(h, wgu)
            h = torch.nn.functional.linear(gu[:, :14336], wd)
        return h

    def replay(self, n: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """Enqueue ``n`` replays on the decode stream, each between two timing events."""
        marks = []
        with torch.cuda.stream(self.stream):
            for _ in range(n):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(self.stream)
                self.graph.replay()
                b.record(self.stream)
                marks.append((a, b))
        return marks


class Loads:
    """4 GiB of KV (``geo``: its pages) in pinned host pages and a device cache, and
    the ways to move it host -> device (``saves``: device -> host) on a side stream."""

    def __init__(self, total: int, geo: KVGeometry, saves: bool = False,
                 by_layer: bool = False) -> None:  # fmt: skip
        self.geo, self.saves, self.by_layer = geo, saves, by_layer
        self.n_pages = total // geo.page_bytes
        self.nbytes = self.n_pages * geo.page_bytes
        self.raw_host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.raw_host.random_()
        self.host = self.raw_host.view(geo.dtype).view(self.n_pages, *geo.host_page_shape)
        n_tokens = self.n_pages * geo.page_size
        self.dev_flat = torch.empty(self.nbytes, dtype=torch.uint8, device=DEV)
        half = self.nbytes // geo.num_kv
        shape = (geo.num_layers, n_tokens, *geo.device_layer_shape)
        caches = [self.dev_flat[c * half : (c + 1) * half].view(geo.dtype).view(shape)
                  for c in range(geo.num_kv)]  # fmt: skip
        self.kv = DeviceKV.from_caches(geo, *caches)
        order = torch.randperm(self.n_pages)
        self.slots_cpu = (order[:, None] * geo.page_size + torch.arange(geo.page_size)).contiguous()
        self.ids_cpu = torch.randperm(self.n_pages)
        self.slots, self.ids = self.slots_cpu.to(DEV), self.ids_cpu.to(DEV)
        self.stream = torch.cuda.Stream()
        self.issuer: CopyIssuer | None = None
        self.staging: IndexStaging | None = None

    def run(self, how: str, layer: int | None = None, nbytes: int = 0) -> str:
        """Enqueue one load (save) of every page (or of ``layer``: ``nbytes`` of pages) on the
        side stream; the plain copy moves the same number of bytes contiguously."""
        with torch.cuda.stream(self.stream):
            if how == "plain_copy":
                n = nbytes // self.geo.num_layers if layer is not None else self.nbytes
                part = slice(0, n) if layer is None else slice(layer * n, (layer + 1) * n)
                dev, host = self.dev_flat[part], self.raw_host[part]
                (host if self.saves else dev).copy_(dev if self.saves else host, non_blocking=True)
                return how
            pages = self.n_pages if layer is None else max(1, nbytes // self.geo.page_bytes)
            if how == "issuer":  # as the connector enqueues it: the table's deferred choice
                return self.issued(pages, (layer,))
            # copy_engine@N: over N streams; staged@N: N scatter blocks; kernel@N: N blocks
            backend, _, count = how.partition("@")
            cpu = backend != "kernel"  # auto: CPU indices, as the connector passes them
            ids = (self.ids_cpu if cpu else self.ids)[:pages]
            slots = (self.slots_cpu if cpu else self.slots)[:pages]
            num_blocks, module, values, share = None, copy_engine, {}, None
            if backend == "split":  # split@B:S: the kernel on B blocks, share S pitched
                assert layer is None, "the split moves all layers"
                blocks, _, share_s = count.partition(":")
                num_blocks = int(blocks) if blocks else None
                share = float(share_s) if share_s else None
            elif backend == "kernel":  # kernel@B or kernel@BxT: B blocks (of T threads)
                blocks, _, threads = count.partition("x")
                num_blocks = int(blocks) if blocks else None
                module, values = ops, ({"THREADS": int(threads)} if threads else {})
            elif count:
                module = staged if backend == "staged" else copy_engine
                values = {"SCATTER_BLOCKS" if backend == "staged" else "LANES": int(count)}
            with overridden(module, **values):
                if self.saves:
                    return save(self.kv, slots, self.host, ids, layer=layer, backend=backend,
                                validate=False, num_blocks=num_blocks, dma_share=share)  # fmt: skip
                return load(self.host, ids, self.kv, slots, layer=layer, backend=backend,
                            validate=False, num_blocks=num_blocks, dma_share=share)  # fmt: skip

    def issued(self, pages: int, layers: Sequence[int | None]) -> str:
        """``pages`` moved through the connector's issuer, one job of ``layers`` (None: all at
        once), on the side stream; the host waits until the issuer has enqueued them."""
        if self.issuer is None:
            self.issuer, self.staging = CopyIssuer(DEV), IndexStaging()
        with torch.cuda.stream(self.stream):
            ids, slots = self.ids_cpu[:pages].tolist(), self.slots_cpu[:pages]
            out = launch(not self.saves, self.kv, self.host, ids, slots, self.staging,
                         self.issuer, layers=layers)  # fmt: skip
            out.events[-1].wait(self.stream)
        return f"issuer:{out.backend}"

    def layer_by_layer(self, how: str, nbytes: int) -> str:
        """``nbytes`` of pages moved one call per layer, as the connector's layer-by-layer loads
        and saves run in an engine's forward (``issuer``: one job of every layer, as
        ``load_async`` submits them); the backends those calls took."""
        if how == "issuer":
            pages = max(1, nbytes // self.geo.page_bytes)
            return self.issued(pages, range(self.geo.num_layers))
        used = {self.run(how, layer, nbytes) for layer in range(self.geo.num_layers)}
        return "/".join(sorted(used))

    def every_page(self, how: str) -> str:
        """Every page moved once: one all-layer call, or (``by_layer``) one call per layer.
        ``how/tN``: the copy engine's calls sent from at most N host threads."""
        how, _, threads = how.partition("/t")
        with overridden(copy_engine, **({"ENQUEUE_THREADS": int(threads)} if threads else {})):
            return self.layer_by_layer(how, self.nbytes) if self.by_layer else self.run(how)

    def timed(self, how: str) -> tuple[torch.cuda.Event, torch.cuda.Event, str]:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(self.stream)
        used = self.every_page(how)
        b.record(self.stream)
        return a, b, used


def _ms(ref: torch.cuda.Event, ev: torch.cuda.Event) -> float:
    return ref.elapsed_time(ev)


def decode_beside(args: argparse.Namespace, step: DecodeStep, loads: Loads) -> dict:
    ce = [f"copy_engine@{n}" for n in args.ce_lanes] if copy_engine.supported(0) else []
    ce += [f"staged@{n}" for n in args.staged_blocks] if copy_engine.supported(0) else []
    kernels = [f"kernel@{n}" for n in args.kernel_blocks]
    kernels += [f"split@{h}" for h in args.split]
    backends = ["plain_copy", "kernel", *kernels, *ce, "pitched", "split", "auto", "issuer",
                "direct"]  # fmt: skip
    if args.backends:  # in the order given; "name/tN" for a known name
        known = set(backends)
        backends = ["plain_copy"] + [b for b in args.backends if b.partition("/t")[0] in known
                                     and b != "plain_copy"]  # fmt: skip
    # warm-up, and each load's time alone (sizes the decode run beside it)
    load_ms = {}
    for how in backends:
        loads.every_page(how)
        loads.stream.synchronize()
        a, b, _ = loads.timed(how)
        loads.stream.synchronize()
        load_ms[how] = _ms(a, b)
    marks = step.replay(10)
    step.stream.synchronize()
    step_ms = statistics.median(_ms(a, b) for a, b in marks)
    print(f"decode step alone {step_ms:.3f} ms ({step.bytes / step_ms / 1e6:.0f} GB/s of "
          f"weights); 4 GiB load alone: "
          + ", ".join(f"{k} {v:.1f} ms ({loads.nbytes / v / 1e6:.1f} GB/s)"
                      for k, v in load_ms.items()), flush=True)  # fmt: skip
    rounds: list[dict] = []
    for r in range(args.rounds):
        row: dict = {}
        for how in backends:
            marks = step.replay(args.alone_steps)
            step.stream.synchronize()
            alone = [_ms(a, b) for a, b in marks]
            n = int((load_ms[how] * 1.3 + 30) / step_ms) + 2
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(step.stream)
            marks = step.replay(n)  # the decode first: the load's host-side enqueue overlaps it
            la, lb, used = loads.timed(how)
            step.stream.synchronize()
            loads.stream.synchronize()
            ls, le = _ms(ref, la), _ms(ref, lb)
            inside = [_ms(a, b) for a, b in marks if _ms(ref, a) >= ls and _ms(ref, b) <= le]
            row[how] = dict(
                used=used,
                alone_ms=round(statistics.median(alone), 4),
                beside_ms=round(statistics.median(inside), 4) if inside else None,
                steps_inside=len(inside),
                load_ms=round(le - ls, 2),
            )
            if inside:
                row[how]["slowdown"] = round(
                    statistics.median(inside) / statistics.median(alone), 4
                )
        base = row["plain_copy"].get("slowdown")
        for how in backends:
            s = row[how].get("slowdown")
            if s is not None and base is not None and base > 1:
                row[how]["extra_vs_plain"] = round((s - 1) / (base - 1), 3)
        rounds.append(row)
        print(f"round {r}: " + " | ".join(
            f"{k} x{v.get('slowdown')} ({v['steps_inside']} steps, load {v['load_ms']} ms, "
            f"{v['used']})" for k, v in row.items()), flush=True)  # fmt: skip
    summary = {}
    for how in backends:
        sd = [x[how]["slowdown"] for x in rounds if x[how].get("slowdown") is not None]
        ex = [x[how]["extra_vs_plain"] for x in rounds if "extra_vs_plain" in x[how]]
        summary[how] = dict(
            slowdown_median=round(statistics.median(sd), 4) if sd else None,
            slowdowns=sd,
            extra_vs_plain_median=round(statistics.median(ex), 3) if ex else None,
            load_gbps_alone=round(loads.nbytes / load_ms[how] / 1e6, 2),
        )
    print("decode beside a 4 GiB load (median over rounds): " + " | ".join(
        f"{k}: x{v['slowdown_median']} (extra time {v['extra_vs_plain_median']} of the plain "
        f"copy's)" for k, v in summary.items()), flush=True)  # fmt: skip
    return dict(step_ms_alone=round(step_ms, 4), weights_gb=round(step.bytes / 1e9, 2),
                load_bytes=loads.nbytes, load_ms_alone={k: round(v, 2) for k, v in load_ms.items()},
                rounds=rounds, summary=summary)  # fmt: skip


def engine_beside(args: argparse.Namespace, loads: Loads) -> dict:
    """Reference engine decode tokens/s alone and beside layer-by-layer prefix loads."""
    from pagekv.engine import PRESETS, Engine, EngineConfig, Request

    prompt_len = args.engine_prompt
    cfg = EngineConfig(PRESETS["llama-3-8b"], page_size=16,
                       num_slots=prompt_len + args.engine_tokens + 64, host_pages=16,
                       dtype="bf16", device="cuda", decode_graphs=True)  # fmt: skip
    engine = Engine(cfg)
    engine.warmup(1024)
    gen = torch.Generator().manual_seed(1)
    geo = loads.geo
    original = engine._save
    state: dict = {}

    issuer, staging = CopyIssuer(DEV), IndexStaging()

    def enqueue(how: str, size: int, repeats: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(loads.stream)
        state["t0"] = time.monotonic()
        state["job_s0"] = issuer.counters["job_seconds"]
        if how.startswith("connector"):  # as load_async runs them, on the issuer: the
            # table's choice, or (connector_ce) the copy engine whatever the table says
            n = max(1, size // geo.page_bytes)
            ids, slots = loads.ids_cpu[:n].tolist(), loads.slots_cpu[:n]
            ce = how.startswith("connector_ce")
            os.environ["PAGEKV_COPY_BACKEND"] = "copy_engine" if ce else "auto"
            outs = []
            try:
                for _ in range(repeats):
                    with torch.cuda.stream(loads.stream):
                        outs.append(launch(True, loads.kv, loads.host, ids, slots, staging,
                                           issuer, layers=range(geo.num_layers)))  # fmt: skip
            finally:
                os.environ["PAGEKV_COPY_BACKEND"] = "auto"
            out = outs[-1]
            state["last"], state["took"], state["outs"] = out.events[-1], out.backend, outs
            return start, end  # end: recorded once the decode is over (see one())
        for _ in range(repeats):
            loads.layer_by_layer(how, size)
        end.record(loads.stream)
        return start, end

    def save_then_loads(*a, **kw):
        # called when the prefill is done, right before the decode's timer starts: the prefix
        # loads are enqueued here (host time outside the decode's) and run on the side stream
        # beside the whole decode (checked: still running when it ends)
        if state.get("how") is not None:
            t0 = time.perf_counter()
            state["events"] = enqueue(state["how"], state["size"], state["repeats"])
            state["enqueue_ms"] = (time.perf_counter() - t0) * 1e3  # host time; blocks if the
            # driver's queue fills, so that the loads run before the decode instead of beside it
        return original(*a, **kw)

    engine._save = save_then_loads
    backends = ["plain_copy", "kernel"]
    backends += [f"copy_engine@{n}" for n in args.ce_lanes] if copy_engine.supported(0) else []
    backends += ["auto", "connector"]
    backends += ["connector_ce"] if copy_engine.supported(0) else []
    backends += [f"connector_ce@{n}" for n in args.layer_lanes] if copy_engine.supported(0) else []

    def one(how: str | None, size: int, repeats: int = 0) -> dict:
        state.clear()
        state.update(how=how, size=size, repeats=repeats)
        prompt = torch.randint(0, cfg.model.vocab_size, (prompt_len,), generator=gen).tolist()
        lanes = {"LAYER_LANES": int(how.partition("@")[2])} if how and "@" in how else {}
        with overridden(copy_engine, **lanes):  # connector_ce@N: a layer's copies on N streams
            r = engine.generate(Request(prompt, args.engine_tokens + 1, reuse=False, save=False))
        out = dict(
            tokens_per_s=round(r.decode_tokens_per_s, 2), decode_ms=round(r.decode_s * 1e3, 2)
        )
        if how is not None:
            start, end = state["events"]
            if how.startswith("connector"):
                out["loads_outlasted_decode"] = not state["last"].query()
                out["took"] = state["took"]
                last = state["last"]
                last.wait(loads.stream)  # the decode is over: the host may wait now
                end.record(loads.stream)
                if isinstance(last, Completion):  # when the issuer had enqueued the last
                    out["issued_ms"] = round((last.enqueued_at - state["t0"]) * 1e3, 1)  # layer
                    # of which inside its jobs (the library calls), the rest waiting to run them
                    job_s = issuer.counters["job_seconds"] - state["job_s0"]
                    out["in_jobs_ms"] = round(job_s * 1e3, 1)
                    out["prefix_issued_ms"] = [  # each prefix's first and last layer
                        [round((o.events[i].enqueued_at - state["t0"]) * 1e3, 1) for i in (0, -1)]
                        for o in state["outs"]
                    ]
            else:
                out["loads_outlasted_decode"] = not end.query()
            loads.stream.synchronize()
            out["prefixes"] = repeats
            out["load_gbps"] = round(repeats * size / start.elapsed_time(end) / 1e6, 2)
            out["enqueue_ms"] = round(state["enqueue_ms"], 1)
            out["loads_ms"] = round(start.elapsed_time(end), 1)
        return out

    def covering(how: str, size: int) -> dict:
        """One decode beside enough back-to-back prefix loads to outlast it (doubling the
        prefixes up to --max-prefixes; a run whose loads ended first says so in its row)."""
        repeats = state_repeats.get((how, size), 2)
        while True:
            res = one(how, size, repeats)
            if res["loads_outlasted_decode"] or repeats * 2 > args.max_prefixes:
                break
            repeats *= 2
        state_repeats[(how, size)] = repeats
        print(f"  {how} {size / GIB:g} GiB: {res}", flush=True)
        return res

    state_repeats: dict = {}
    one(None, 0)
    out = {"config": cfg.describe(), "decode_tokens": args.engine_tokens, "sizes": []}
    for gib in args.engine_sizes:
        size = int(gib * GIB)
        for how in backends:  # warm up, and find how many prefixes outlast a decode
            covering(how, size)
        pairs: dict[str, list] = {"alone": [], **{b: [] for b in backends}}
        for _ in range(args.engine_pairs):
            for how in [None, *backends]:
                pairs["alone" if how is None else how].append(
                    one(None, 0) if how is None else covering(how, size)
                )
        row = {"prefix_gib": gib, "runs": pairs, "tokens_per_s": {}, "slowdown": {}}
        for k, v in pairs.items():
            row["tokens_per_s"][k] = statistics.median(x["tokens_per_s"] for x in v)
        for b in backends:
            per_pair = [1 - x["tokens_per_s"] / a["tokens_per_s"]
                        for a, x in zip(pairs["alone"], pairs[b])]  # fmt: skip
            row["slowdown"][b] = round(statistics.median(per_pair), 4)
        out["sizes"].append(row)
        # a decode that outlasted its loads ran partly alone: its figure is no measurement
        row["void"] = [b for b in backends if not all(x["loads_outlasted_decode"]
                                                      for x in pairs[b])]  # fmt: skip
        print(f"engine decode beside {gib} GiB layer-by-layer loads, back to back: "
              f"alone {row['tokens_per_s']['alone']:.1f} tok/s | " + " | ".join(
                  f"{b} {row['tokens_per_s'][b]:.1f} tok/s ({row['slowdown'][b]:+.1%})"
                  + (" VOID: the loads ended before the decode" if b in row["void"] else "")
                  for b in backends), flush=True)  # fmt: skip
    engine.close()
    issuer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--alone-steps", type=int, default=12)
    ap.add_argument("--load-gib", type=float, default=4.0)
    ap.add_argument("--geometry", default="llama3-8b", choices=list(GEOMETRIES))
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (part 1)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-decode", action="store_true", help="part 2 (the engine) only")
    ap.add_argument("--engine-sizes", type=lambda s: [float(x) for x in s.split(",")],
                    default=[1.0, 4.0])  # fmt: skip
    ap.add_argument("--engine-pairs", type=int, default=5)
    ap.add_argument("--engine-tokens", type=int, default=48)
    ap.add_argument("--engine-prompt", type=int, default=512)
    ap.add_argument("--max-prefixes", type=int, default=32, help="per decode, at most")
    ap.add_argument("--backends", type=lambda s: s.split(","), default=None,
                    help="part 1: only these loads (and the plain copy)")  # fmt: skip
    ap.add_argument("--ce-lanes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[copy_engine.LANES], help="copy-engine streams to compare")  # fmt: skip
    ap.add_argument("--kernel-blocks", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="the kernel on these blocks (B or BxT: of T threads) too")  # fmt: skip
    ap.add_argument("--saves", action="store_true",
                    help="part 1: 4 GiB saves (device -> host) instead of loads")  # fmt: skip
    ap.add_argument("--by-layer", action="store_true",
                    help="part 1: the 4 GiB as one call per layer")  # fmt: skip
    ap.add_argument(
        "--split",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="B:S,...: the split with the kernel on B blocks and share S of the pages pitched",
    )
    ap.add_argument(
        "--layer-lanes",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="part 2: connector_ce with a layer's copies on N streams",
    )
    ap.add_argument("--staged-blocks", type=lambda s: [int(x) for x in s.split(",")],
                    default=[staged.SCATTER_BLOCKS], help="staged scatter blocks")  # fmt: skip
    args = parse_args(ap)
    os.environ["PAGEKV_COPY_BACKEND"] = "auto"  # the "auto" rows measure the opt-in table
    env = environment()
    print(f"# {env['device']} torch {env['torch']} cuda {env.get('cuda')} commit {env['commit']}")
    geo = KVGeometry(page_size=args.page_size, **GEOMETRIES[args.geometry])
    t = time.perf_counter()
    loads = Loads(int(args.load_gib * GIB), geo, saves=args.saves, by_layer=args.by_layer)
    table = calibrate(0)
    print(
        f"setup {time.perf_counter() - t:.1f} s; copy table: {len(table.entries)} shapes",
        flush=True,
    )
    result: dict = {"env": env, "geometry": args.geometry, "args": vars(args)}
    if not args.skip_decode:
        step = DecodeStep()
        result["decode"] = decode_beside(args, step, loads)
        write_result("bench_beside_compute", result)  # kept if the engine part is cut short
        del step
        torch.cuda.empty_cache()
    if not args.skip_engine:
        result["engine"] = engine_beside(args, loads)
    print(f"wrote {write_result('bench_beside_compute', result)}")


if __name__ == "__main__":
    main()
