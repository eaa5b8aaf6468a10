"""Timing the transfer backends on this GPU for :mod:`.copy_table` (one grid, ~30 s).

Each grid shape is a real :func:`~pagekv.kernels.load` / :func:`~pagekv.kernels.save` with CPU
page ids and slots (what ``auto`` is asked to decide), on random bytes, pages in random order on
shuffled page-sized runs of slots, on a stream of its own, timed by :func:`steady_seconds`. An
all-layer shape also times the kernel on the split's blocks, whose seconds and the pitched
copy's give the split's balanced share (:func:`.split.balanced_share`); the split is timed at
``split.SHARE_TRIALS`` of it and the fastest share kept. A grid measured while its thread
waited for CPUs (other processes busy beside it) says so (:func:`measure_grid`), and its table
is cached as provisional; :func:`trial` is the short measurement that decides whether
a later process measures such a table again.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagekv.geometry import KVGeometry

from . import copy_engine, ops, split
from .copy_table import BACKENDS, DIRECT_MAX_COPIES, TOTAL_BYTES, Entry, Shape, grid
from .layout import DeviceKV

__all__ = ["BUSY_WAIT_SHARE", "HostLoad", "ShapeTimer", "ThreadSeconds", "host_load",
           "measure_entries", "measure_grid", "steady_seconds", "thread_seconds",
           "trial"]  # fmt: skip

Timing = Callable[[Callable[[], object], torch.cuda.Stream], tuple[float, float]]
# A measurement during which the measuring thread waited for a CPU this share of the time it
# ran is not taken for the device's (H200, 16 CPUs, 6caa477, scripts/diag_table_busy.py): idle,
# 0.000; beside 8 processes spinning, 0.111 (its waits in the one-layer 128 MiB shapes of
# 1152-byte rows, whose index work torch spreads over its CPU threads: the kernel timed there at
# 11-19 GB/s, not 50-52; scripts/diag_table_wait.py), beside 16, 0.568 (the copy engine's
# one-layer 32 KiB runs timed at 26-31 GB/s, not 45-46). Set low on purpose: a table so
# measured is only provisional (:mod:`.copy_table`) until a quiet start-up measures again.
BUSY_WAIT_SHARE = 0.05
# The trial (:func:`trial`): the grid's shapes whose timing a busy host slows first (one-layer
# loads and saves of 36 KiB runs of 1152-byte rows, 128 MiB: their index work is spread over
# torch's CPU threads; beside 8 spinning processes the measuring thread waited 0.38-0.45 of its
# run there, 0.11 over the whole grid, nothing in the 16 MiB shapes), timed over and over for
# at least ``TRIAL_SECONDS``.
TRIAL_SHAPES = ((True, False, 36864, 128 << 20), (False, False, 36864, 128 << 20))
TRIAL_SECONDS = 0.5


def steady_seconds(
    fn: Callable[[], object], stream: torch.cuda.Stream, reps: int = 5, inner: int = 3
) -> tuple[float, float]:
    """Seconds per call of a run of ``fn`` calls once under way (the fastest of ``reps`` runs),
    and the median host time of a call issued to an idle device (its enqueue time), after one
    untimed call.

    A run is ``inner`` calls back to back from an idle device; its seconds per call are the
    device's, from the end of the first call's work to the end of the last's, over the calls
    after the first (CUDA events on ``stream``, where every backend's work joins). So a call's
    host time counts only where it is longer than its copies (the device then waits for the
    next call): in a run of layers or chunks each call is enqueued while the ones before it
    copy, and the first call's host time, which nothing overlaps and which a busy host
    lengthens, is not the run's rate. The fastest run, not the median: a run is host-bound
    where its copies are short (the copy engine's at 32-36 KiB runs: ~0.5-1 us a copy), and
    another process's burst on the host lengthens such a run, never shortens it. (A host busy
    throughout is :func:`measure_grid`'s to report: no run is then the device's.)"""
    fn()
    stream.synchronize()
    first = torch.cuda.Event(enable_timing=True)
    last = torch.cuda.Event(enable_timing=True)
    times, enqueue = [], []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        enqueue.append(time.perf_counter() - start)
        first.record(stream)
        for _ in range(inner - 1):
            fn()
        last.record(stream)
        last.synchronize()
        times.append(first.elapsed_time(last) / 1e3 / (inner - 1))
    return min(times), statistics.median(enqueue)


def _geometry(all_layers: bool, run: int) -> KVGeometry:
    """The standard geometry with ``run``-byte page runs: MLA-576 (1152-byte rows) where the run
    is a multiple of 1152, else 256-byte rows (TP-8 slices) up to 8 KiB, else 2 KiB rows."""
    layers = 32 if all_layers else 2
    if run % 1152 == 0:
        return KVGeometry(layers, run // 1152, 1, 576, "bf16", "mla")
    heads = 1 if run <= 8192 else 8
    return KVGeometry(layers, run // (heads * 256), heads, 128, "bf16")


def _shape_seconds(
    load: bool,
    all_layers: bool,
    run: int,
    total: int,
    host_raw: torch.Tensor,
    ce_ok: bool,
    timing: Timing,
) -> Entry:
    dev = torch.cuda.current_stream().device
    geo = _geometry(all_layers, run)
    per_page = geo.page_bytes if all_layers else geo.page_bytes // geo.num_layers
    n_pages = max(1, total // per_page)
    host = host_raw[: n_pages * geo.page_bytes].view(geo.dtype).view(n_pages, *geo.host_page_shape)
    shape = (geo.num_layers, n_pages * geo.page_size, *geo.device_layer_shape)
    caches = [torch.empty(shape, dtype=geo.dtype, device=dev) for _ in range(geo.num_kv)]
    for c in caches:
        c.view(torch.uint8).random_()
    kv = DeviceKV.from_caches(geo, *caches)
    slots = torch.randperm(n_pages)[:, None] * geo.page_size + torch.arange(geo.page_size)
    ids = torch.randperm(n_pages)
    layer = None if all_layers else 1
    rows = geo.num_layers * geo.num_kv if all_layers else geo.num_kv
    stream = torch.cuda.current_stream()
    index = dev.index or 0

    def timed(backend: str, **kw: object) -> tuple[float, float]:
        if load:
            fn = functools.partial(ops.load, host, ids, kv, slots, layer=layer, backend=backend,
                                   validate=False, **kw)  # fmt: skip
        else:
            fn = functools.partial(ops.save, kv, slots, host, ids, layer=layer, backend=backend,
                                   validate=False, **kw)  # fmt: skip
        return timing(fn, stream)

    times: dict[str, tuple[float, float]] = {}
    share = math.nan
    for backend in BACKENDS:
        times[backend] = (math.inf, math.inf)
        if (
            (backend == "copy_engine" and not ce_ok)
            or (backend == "direct" and n_pages * rows > DIRECT_MAX_COPIES)
            or (backend in ("pitched", "split") and not all_layers)
        ):
            continue
        if backend == "split":
            balanced = split.balanced_share(timed("kernel", num_blocks=split.BLOCKS)[0],
                                            times["pitched"][0])  # fmt: skip
            if math.isnan(balanced):
                continue
            trials = {f * balanced: timed("split", dma_share=f * balanced)
                      for f in split.SHARE_TRIALS}  # fmt: skip
            share = min(trials, key=lambda x: trials[x][0])
            times[backend] = trials[share]
        else:
            times[backend] = timed(backend)
        if (backend == "copy_engine" and not copy_engine.supported(index)) or (
            backend in ("pitched", "split") and not copy_engine.pitched_supported(index)
        ):
            times[backend] = (math.inf, math.inf)  # the call failed: the kernel ran in its place
    shape = Shape(load, all_layers, float(run), n_pages * per_page)
    return Entry(shape, tuple((b, t[0]) for b, t in times.items()),
                 tuple((b, t[1]) for b, t in times.items()), share)  # fmt: skip


ShapeTimer = Callable[[tuple[bool, bool, int, int], Timing], Entry]


@contextlib.contextmanager
def _timing_shapes(device: int, total_bytes: int) -> Iterator[ShapeTimer]:
    """What timing a grid shape needs, set up once: pinned random host bytes for shapes of up to
    ``total_bytes``, whether the copy engine works on ``device``, and ``device`` current with a
    stream of its own; yields the function that times one shape (load, all layers, run bytes,
    total bytes) by a :data:`Timing`."""
    dev = torch.device("cuda", device)
    host_raw = torch.empty(2 * total_bytes, dtype=torch.uint8, pin_memory=True)
    host_raw.random_()
    ce_ok = copy_engine.supported(device)
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
        yield lambda shape, timing: _shape_seconds(*shape, host_raw, ce_ok, timing)


def measure_entries(device: int, timing: Timing = steady_seconds) -> list[Entry]:
    """One :class:`Entry` per grid shape, measured on ``device`` on a stream of its own by
    ``timing`` (:func:`steady_seconds`; a diagnostic may compare another)."""
    with _timing_shapes(device, max(TOTAL_BYTES)) as time_shape:
        return [time_shape(shape, timing) for shape in grid()]


# the measuring thread's seconds run on a CPU and waited runnable for one (None: not counted)
ThreadSeconds = tuple[float, float] | None


def thread_seconds() -> ThreadSeconds:
    """The calling thread's seconds run on a CPU and waited runnable for one since it started
    (Linux ``/proc/thread-self/schedstat``; None where the kernel keeps no such count)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class HostLoad:
    """How long the measuring thread ran on a CPU and waited runnable for one over a
    measurement (:func:`host_load`). Its own count, not the process's: the thread that enqueues
    the calls sets a host-bound run's rate (what the library's helper threads wait lengthens
    its join, not its wait), and torch's CPU threads spin between parallel regions, so a sum
    over the process is mostly theirs (beside 8 spinning processes, 0.66 of the process's run
    against the measuring thread's 0.11)."""

    ran: float
    waited: float

    @property
    def share(self) -> float:
        return self.waited / self.ran if self.ran > 0 else 0.0

    @property
    def busy(self) -> bool:
        """The measurement is not the device's: its thread waited ``BUSY_WAIT_SHARE`` or more
        of the time it ran (nothing counted: not busy)."""
        return self.ran > 0 and self.waited >= BUSY_WAIT_SHARE * self.ran

    def reason(self) -> str:
        return (f"on a busy host (the measuring thread waited {self.waited:.1f} s for a CPU "
                f"while running {self.ran:.1f} s)")  # fmt: skip


def host_load(before: ThreadSeconds, after: ThreadSeconds) -> HostLoad:
    """The :class:`HostLoad` between two :func:`thread_seconds` readings of one thread (none
    where either is None)."""
    if before is None or after is None:
        return HostLoad(0.0, 0.0)
    return HostLoad(after[0] - before[0], after[1] - before[1])


def measure_grid(device: int, timing: Timing = steady_seconds) -> tuple[list[Entry], HostLoad]:
    """:func:`measure_entries`, and the host's load over them (:func:`host_load`)."""
    before = thread_seconds()
    entries = measure_entries(device, timing)
    return entries, host_load(before, thread_seconds())


def trial(device: int, seconds: float = TRIAL_SECONDS) -> HostLoad:
    """The host's load while ``TRIAL_SHAPES`` are timed as the grid's are, over and over for
    at least ``seconds`` (one pass: 2.1 s on an idle H200 host, 3-4 s on a busy one, against
    the grid's ~30): whether the host is too busy now for a measurement of the grid to be the
    device's. The shapes a busy host slows first, so the trial finds a host busy at least
    wherever the grid would (H200: idle, beside 8 and beside 16 spinning processes, the two
    agreed in six of six passes; scripts/diag_table_busy.py)."""
    with _timing_shapes(device, max(t for *_, t in TRIAL_SHAPES)) as time_shape:
        before = thread_seconds()
        end = time.perf_counter() + seconds
        while True:
            for shape in TRIAL_SHAPES:
                time_shape(shape, steady_seconds)
            if time.perf_counter() >= end:
                return host_load(before, thread_seconds())
