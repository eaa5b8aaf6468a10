"""Where the connector's copy-engine path loses against the copy engine called directly (GPU).

For all-layer loads of runs >= 36 KiB the copy engine called on the caller's thread moves
0.96-0.98 of a pinned contiguous copy, the same transfer through the connector (CPU page ids,
the table's choice, the issuer thread) 0.92-0.95 (docs/benchmarks.md, "copy engine"). This
times one call from an idle device, on the host's clock, in phases:

  prep     the caller's Python before the job is queued (indices, choice, submit)
  handoff  queued -> the issuer's thread starts the job
  enqueue  the job's library call (descriptors, driver calls)
  tail     enqueued -> the transfer is done
  total    call -> done; against the pinned copy's own call -> done, and the copy engine
           called directly

and the bench's own figure (3 calls back to back, CUDA-event time) for both paths, at 256 MiB
and 1 GiB. ``--profile``: only the caller's part and the hand-off, in pieces.

``--by-layer``: a layer-by-layer load through the issuer (as ``load_async`` submits it), Llama-3-8B
16-token pages, ``--mib`` each, the caller running pure Python for each of ``--spin-ms`` after the
call (an engine's scheduler holding the GIL) before it waits for each layer in turn: when its
waits for layer 0 and the last layer returned and when the load was done, three ways in turn
(:func:`by_layer`): as shipped (the library counts each layer as it enqueues it), ``calls``
(each layer handed over as its library call returns, ~2,048 copies a call) and ``at_end``.

    python scripts/diag_issuer_overhead.py [--reps 7] [--profile | --by-layer [--spin-ms 0,20]]
                                           [--mib 256,1024]
"""

from __future__ import annotations

import argparse
import functools
import queue
import statistics
import threading
import time

import torch
from _bench_util import environment, parse_args, write_result
from bench_kernels import GEOMETRIES, Setup, ceiling_fns, interleaved, ratio

from pagekv.connector import KVGeometry
from pagekv.connector.copy_issuer import CopyIssuer
from pagekv.connector.staging import IndexStaging
from pagekv.connector.transfer_indices import launch, transfer_indices
from pagekv.kernels import calibrate, copy_engine, load, transfer_layers

CASES = [("llama3-8b", 32), ("llama3-8b", 64), ("llama3-8b", 128), ("mla-576", 64)]


def phases(st: Setup, issuer: CopyIssuer, staging: IndexStaging, reps: int) -> dict:
    page_ids, slots = st.ids_cpu.tolist(), st.slots_cpu
    marks: dict[str, float] = {}
    orig_submit = issuer.submit

    def submit(job, transfers):
        def timed_job(**handover):
            marks["job"] = time.perf_counter()
            out = job(**handover)
            marks["enqueued"] = time.perf_counter()
            return out

        marks["submit"] = time.perf_counter()
        return orig_submit(timed_job, transfers)

    issuer.submit = submit  # type: ignore[method-assign]
    rows = []
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = launch(True, st.kv, st.host, page_ids, slots, staging, issuer)
            out.events[-1].synchronize()
            t1 = time.perf_counter()
            rows.append({"prep": marks["submit"] - t0, "handoff": marks["job"] - marks["submit"],
                         "enqueue": marks["enqueued"] - marks["job"],
                         "tail": t1 - marks["enqueued"], "total": t1 - t0,
                         "backend": out.backend})  # fmt: skip
    finally:
        issuer.submit = orig_submit  # type: ignore[method-assign]
    med = {k: round(statistics.median(r[k] for r in rows) * 1e6, 1)
           for k in ("prep", "handoff", "enqueue", "tail", "total")}  # fmt: skip
    return med | {"backend": rows[-1]["backend"]}


def wall_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def case(raw, name: str, page: int, nbytes: int, issuer, staging, reps: int) -> dict:
    geo = KVGeometry(page_size=page, **GEOMETRIES[name])
    st = Setup(raw, geo, nbytes)
    page_ids, slots = st.ids_cpu.tolist(), st.slots_cpu
    ceil = ceiling_fns(raw, st.nbytes)["ceiling_h2d"]

    def ce():
        load(st.host, st.ids_cpu, st.kv, st.slots_cpu, backend="copy_engine", validate=False)

    def conn():
        launch(True, st.kv, st.host, page_ids, slots, staging, issuer).events[-1].wait()

    for fn in (ceil, ce, conn):
        fn()
    torch.cuda.synchronize()
    t = interleaved({"ceiling": ceil, "ce": ce, "connector": conn}, reps)
    return {"geometry": name, "page": page, "mib": st.nbytes >> 20,
            "run_kib": page * geo.item_bytes // 1024,
            "bench_ce": ratio(t, "ceiling", "ce"),
            "bench_connector": ratio(t, "ceiling", "connector"),
            "wall_us_ceiling": wall_us(ceil, reps), "wall_us_ce": wall_us(ce, reps),
            "connector": phases(st, issuer, staging, reps)}  # fmt: skip


def caller_costs(raw, staging) -> None:
    """The caller's part and the hand-off in pieces (Llama-3-8B, 64-token pages, 256 MiB): the
    bare hand-off latency of a queue to a waiting thread (no CUDA), the hand-off split
    (:func:`handoff_split`) and the prep piece by piece (:func:`prep_pieces`)."""
    geo = KVGeometry(page_size=64, **GEOMETRIES["llama3-8b"])
    st = Setup(raw, geo, 256 << 20)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    got: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: [got.put(time.perf_counter()) for _ in iter(todo.get, None)],
                     daemon=True).start()  # fmt: skip
    lat = []
    for _ in range(50):
        time.sleep(0.002)  # the thread idle, as the issuer between jobs
        t = time.perf_counter()
        todo.put(1)
        lat.append(got.get() - t)
    todo.put(None)
    print(
        f"bare hand-off us: median {statistics.median(lat) * 1e6:.1f} "
        f"p90 {sorted(lat)[44] * 1e6:.1f}",
        flush=True,
    )
    handoff_split(st, staging)
    prep_pieces(st)


def prep_pieces(st: Setup, reps: int = 300) -> None:
    """Median us of each piece of the caller's indices-and-choice step."""
    from pagekv.kernels import copy_engine, copy_table, ops
    from pagekv.kernels.jit import copy_backend_setting, load_library

    page_ids, slots = st.ids_cpu.tolist(), st.slots_cpu
    ids = torch.tensor(page_ids, dtype=torch.int64)
    geo = st.kv.geometry
    shape = copy_table.Shape(True, True, 65536.0, 256 << 20)
    table = copy_table.calibrate(0)
    pieces = {
        "torch.tensor(ids)": lambda: torch.tensor(page_ids, dtype=torch.int64),
        "check_page_ids": lambda: ops.check_page_ids(ids, 0, unique=False, check_values=False),
        "check_slots": lambda: ops.check_slots(
            slots, ids.numel(), geo.page_size, st.kv.num_slots, check_values=False
        ),
        "load_library": load_library,
        "copy_backend_setting": copy_backend_setting,
        "is_capturing": torch.cuda.is_current_stream_capturing,
        "run_bytes": lambda: copy_engine.run_bytes(st.kv, slots),
        "supported": lambda: copy_engine.supported(0),
        "calibrate": lambda: copy_table.calibrate(0),
        "choose": lambda: table.choose(shape, ["kernel", "direct", "copy_engine"], True),
        "choose_backend": lambda: ops.choose_backend(True, st.kv, ids, slots, deferred=True),
        "slots.contiguous": slots.contiguous,
        "Event+record": lambda: torch.cuda.Event().record(),
    }
    out = {}
    for name, fn in pieces.items():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = round(statistics.median(times) * 1e6, 2)
    print(f"prep pieces us: {out}", flush=True)


class _MarkedQueue:
    """A SimpleQueue that notes when each item was put and when the issuer got it."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.marks: dict[str, float] = {}

    def put(self, item) -> None:
        self.marks["put"] = time.perf_counter()
        self.q.put(item)

    def get(self):
        item = self.q.get()
        self.marks["got"] = time.perf_counter()
        return item


def handoff_split(st: Setup, staging: IndexStaging, reps: int = 15) -> None:
    """Caller: indices and choice, then submit; issuer: woken, then its fork wait and the job's
    start (a fresh issuer whose queue notes the times)."""
    issuer = CopyIssuer(torch.device("cuda", 0))
    marked = _MarkedQueue()
    issuer._queue = marked  # a diagnostic's reach-in: the issuer reads it at each get
    page_ids, slots = st.ids_cpu.tolist(), st.slots_cpu
    rows = []
    for _ in range(reps):
        torch.cuda.synchronize()
        time.sleep(0.002)
        t0 = time.perf_counter()
        idx = transfer_indices(True, st.kv, page_ids, slots, staging, deferred=True)
        t1 = time.perf_counter()
        job = functools.partial(transfer_layers, True, st.host, idx.ids, st.kv, idx.slots,
                                [None], backend=idx.backend)  # fmt: skip
        started: list[float] = []

        def timed(*, job=job, started=started, **handover):
            started.append(time.perf_counter())
            return job(**handover)

        done = issuer.submit(timed, 1)
        t2 = time.perf_counter()
        done[-1].synchronize()
        rows.append((t1 - t0, t2 - t1, marked.marks["got"] - marked.marks["put"],
                     started[0] - marked.marks["got"]))  # fmt: skip
    names = ("indices+choice", "submit", "wake", "fork wait")
    med = {n: round(statistics.median(r[i] for r in rows) * 1e6, 1) for i, n in enumerate(names)}
    print(f"hand-off split us (median of {reps}): {med}", flush=True)
    issuer.close()


def _recorded(**_) -> tuple[str, list[torch.cuda.Event]]:
    event = torch.cuda.Event()
    event.record()
    return "none", [event]


def by_layer(raw, nbytes: int, issuer: CopyIssuer, staging: IndexStaging, reps: int,
             spin_ms: float) -> dict:  # fmt: skip
    """A layer-by-layer load through the issuer, the caller then running pure Python for
    ``spin_ms`` (an engine's scheduler; 0: none) before it waits for each layer in turn (as the
    forward does): ms after the call when its wait for layer 0 and for the last layer
    returned, and when the load was done; medians. Three ways in turn: as shipped (one library
    call, each layer handed over as the library counts it), ``calls`` (each layer handed over
    as the library call that enqueued it returns, calls of ~2,048 copies: the hand-over before
    the library counted) and ``at_end`` (every layer handed over when the job returns)."""
    geo = KVGeometry(page_size=16, **GEOMETRIES["llama3-8b"])
    st = Setup(raw, geo, nbytes)
    page_ids, slots, layers = st.ids_cpu.tolist(), st.slots_cpu, range(geo.num_layers)
    orig_submit = issuer.submit
    per_call = max(1, 2048 // max(1, copy_engine.slot_runs(st.kv, slots)[1] * geo.num_kv))

    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks.setdefault(name, time.perf_counter())

    def counted(job, transfers):
        def run(**handover):
            mark("start")
            return job(**handover)

        return orig_submit(run, transfers)

    def at_end(job, transfers):
        def run(*, enqueued, progress):
            mark("start")
            torch.cuda.current_stream().wait_event(progress.fork)
            return job(enqueued=None, progress=None)

        return orig_submit(run, transfers)

    def calls(job, transfers):
        load_, host, ids, kv, s, entries = job.args

        def run(*, enqueued, progress):
            mark("start")
            torch.cuda.current_stream().wait_event(progress.fork)
            events: list[torch.cuda.Event] = []
            for first in range(0, len(entries), per_call):
                _, more = transfer_layers(load_, host, ids, kv, s, entries[first:first + per_call],
                                          **job.keywords)  # fmt: skip
                events += more
                enqueued(events)
            return "copy_engine", events

        return orig_submit(run, transfers)

    real_call = copy_engine.page_transfer_layers

    def call(*args, **kwargs):  # the library call's start
        mark("call")
        return real_call(*args, **kwargs)

    copy_engine.page_transfer_layers = call
    ways = {"counted": counted, "calls": calls, "at_end": at_end}
    times: dict[str, list[tuple[float, ...]]] = {how: [] for how in ways}
    used = {}
    for rep in range(reps + 1):  # the ways in turn, the first round a warm-up
        for how, submit in ways.items():
            issuer.submit = submit  # type: ignore[method-assign]
            torch.cuda.synchronize()
            orig_submit(_recorded, 1)[0].synchronize()  # the issuer is done with the last job
            marks.clear()
            t = time.perf_counter()
            out = launch(True, st.kv, st.host, page_ids, slots, staging, issuer, layers=layers)
            while time.perf_counter() - t < spin_ms / 1e3:
                pass
            waited = []
            for completion in out.events:
                completion.wait()
                waited.append(time.perf_counter())
            torch.cuda.current_stream().synchronize()
            end = time.perf_counter()
            if rep:
                times[how].append((marks["start"] - t, marks["call"] - t, waited[0] - t,
                                   waited[-1] - t, end - t))  # fmt: skip
            used[how] = out.backend
    issuer.submit = orig_submit  # type: ignore[method-assign]
    copy_engine.page_transfer_layers = real_call
    row: dict = {"mib": st.nbytes >> 20, "pages": st.n_pages, "spin_ms": spin_ms,
                 "layers_a_call": per_call}  # fmt: skip
    names = ("job_start_ms", "library_call_ms", "layer0_ms", "last_ms", "done_ms")
    for how, rows in times.items():
        row[how] = {k: round(statistics.median(x[i] for x in rows) * 1e3, 3)
                    for i, k in enumerate(names)}  # fmt: skip
        row[how]["backend"] = used[how]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mib", default="256,1024")
    ap.add_argument("--profile", action="store_true",
                    help="only the caller's part and the hand-off, in pieces")  # fmt: skip
    ap.add_argument("--by-layer", action="store_true",
                    help="a layer-by-layer load: when its layers are handed over")  # fmt: skip
    ap.add_argument("--spin-ms", default="0,20",
                    help="--by-layer: ms of pure Python on the caller after the call")  # fmt: skip
    args = parse_args(ap)
    calibrate(0)
    sizes = [int(x) << 20 for x in args.mib.split(",")]
    raw = torch.empty(max(sizes), dtype=torch.uint8).pin_memory()
    raw.random_()
    if args.profile:
        caller_costs(raw, IndexStaging())
        return
    issuer, staging = CopyIssuer(torch.device("cuda", 0)), IndexStaging()
    result: dict = {"env": environment(), "rows": []}
    if args.by_layer:
        for nbytes in sizes:
            for spin in map(float, args.spin_ms.split(",")):
                result["rows"].append(by_layer(raw, nbytes, issuer, staging, args.reps, spin))
                print(result["rows"][-1], flush=True)
        issuer.close()
        write_result("diag_issuer_by_layer", result)
        return
    for nbytes in sizes:
        for name, page in CASES:
            row = case(raw, name, page, nbytes, issuer, staging, args.reps)
            result["rows"].append(row)
            print(row, flush=True)
            torch.cuda.empty_cache()
    issuer.close()
    write_result("diag_issuer_overhead", result)


if __name__ == "__main__":
    main()
