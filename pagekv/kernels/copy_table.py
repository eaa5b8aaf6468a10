"""Which backend ``PAGEKV_COPY_BACKEND=auto`` (the default) uses for a transfer: a table
measured once per device.

For a grid of transfer shapes (direction, all layers or one, bytes per run of consecutive slots,
bytes in all) the kernel, the copy engine, the pitched copy (all layers) and the direct memcpy
backend are timed on this GPU (:func:`._calibrate.steady_seconds`): seconds per call in a run of
calls once under way, the fastest of five runs (a connector's chunks and layers follow one
another, so a call's host time overlaps the copies before it and counts only where it is the
longer; other processes busy on the host while it is measured slow such runs, not the device)
and the median host time of one
call issued to an idle device (its *enqueue* time: what the calling thread waits). On the
caller's thread (``deferred`` false) a backend is a candidate for a shape only when its enqueue
time is at most the kernel's plus ``ENQUEUE_SLACK_S``: the copy engine's host cost grows with
its copies (~0.5-1 us each, and the call blocks once the driver's queue is full: a 4 GiB load of
32 KiB runs held the host 580 of its 650 ms on the H200), and an engine's step never waits on a
transfer. Where a thread of the connector's own enqueues the copy engine's transfers
(``deferred``: :mod:`pagekv.connector.copy_issuer`) its host time bars nothing, nor the pitched
copy's. Among the candidates the faster DMA backend (``DMA_BACKENDS``: the copy engine, the
pitched copy) wins unless it is more than ``COPY_ENGINE_SLACK`` slower than the fastest
(deferred: ``DEFERRED_COPY_ENGINE_SLACK``, one layer ``DEFERRED_LAYER_SLACK``, as those
transfers run beside the engine's compute, where the kernel slows both): it leaves the SMs to
the model. Failing that, a deferred transfer takes the split backend (:mod:`.split`: the kernel
on 2 blocks beside the pitched copy; only the issuer is offered it) where it is within the same
slack of the fastest: its cost to a decode beside it is steady where the kernel's on 4 blocks is
not. Each all-layer entry also keeps the split's share (the fastest of those timed around the
balance of the 2-block kernel's and the pitched copy's seconds: :mod:`.split`), which the split
backend uses for the shapes around it.

A transfer takes a backend only when the measured shapes around it agree
(:meth:`CopyTable.choose`: the nearest runs on both sides, each at the nearest totals on both
sides); anything else, or a run shorter than any measured one, takes the kernel. The grid
includes the runs engines produce (page size x row bytes for Llama-3-8B, its TP-8 slice and
MLA-576 at 16-128 tokens), because the copy engine's rate is not monotonic in the run: 32 KiB
runs 0.96 of the bus, 36 KiB (MLA, 32 tokens) 0.74 on the H200 in one run, 0.97 in another.

Cache: ``$PAGEKV_CACHE_DIR/copy_table_<key>.json``, the key naming the GPU, the driver, the
kernel library (its source hash) and the copy engine's settings, so a new driver, a changed
kernel or other copy-engine defaults measure again. A file lock makes concurrent processes
measure once. A table measured in a process where the copy engine's or the pitched copy's calls
were refused (so it timed neither) serves that process alone. One measured while its thread
waited for the host's CPUs (other processes busy: the host-bound backends timed at the host's
rate; :func:`._calibrate.measure_grid`) is cached as *provisional* (``host_wait``, the share of
its run the thread waited): later processes use it rather than wait ~30 s each, and one that
finds the host quiet in a short trial (:func:`._calibrate.trial`, ~2 s) measures again,
caching the device's table, or, still busy, the less busy of the two; processes starting
together (an engine's tensor-parallel workers) share one measurement or one trial. Measuring
takes ~30 s, synchronises the device and uses up to 256 MiB of device and of pinned host
memory for the while; it happens on the first ``auto`` transfer with CPU indices, or when
:func:`calibrate` is called (``KVConnector.connect`` does: at start-up, off the serving path).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

__all__ = [
    "COPY_ENGINE_SLACK",
    "DEFERRED_COPY_ENGINE_SLACK",
    "DEFERRED_LAYER_SLACK",
    "DMA_BACKENDS",
    "ENQUEUE_SLACK_S",
    "CopyTable",
    "Entry",
    "Shape",
    "calibrate",
    "load_table",
    "save_table",
    "table_path",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
TABLE_VERSION = 10
# The copy engine is chosen unless it takes more than this fraction longer than the fastest.
COPY_ENGINE_SLACK = 0.10
# ... and for a transfer the connector's issuer enqueues (``deferred``: loads and saves that run
# beside the engine's compute), unless more than this: beside the reference engine's decode
# (serving-like, two steps in flight; H100, 4 GiB layer-by-layer loads of 32 KiB runs) the copy
# engine loaded 38-43 GB/s at -4.0% decode tokens/s, the kernel 34-35 GB/s at -12.0/-12.5% (a
# plain copy: -5.0%), although alone the copy engine moves such runs at 0.63-0.96 of the kernel.
DEFERRED_COPY_ENGINE_SLACK = 0.50
# ... and for a one-layer transfer the issuer enqueues, unless more than this: the one-layer
# kernel (8 blocks) costs a decode beside it 2.2-2.4x what a plain copy does, the copy engine
# 0.75-0.89x (H200, 32 layers of 128 MiB, 32 KiB runs), and at 32-36 KiB runs the copy engine's
# enqueue (0.5-1 us a copy) sets its rate, 33-55 GB/s from one measurement to the next against
# the kernel's 50-52 (1.0-1.55x its time): the wider slack keeps such layers on the copy engine.
DEFERRED_LAYER_SLACK = 0.75
# A backend whose call holds the host longer than the kernel's plus this is never chosen.
ENQUEUE_SLACK_S = 25e-6
# The measured grid: bytes per run (page_size x row bytes when slots are consecutive) and bytes
# per transfer, for loads and saves of all layers and of one layer. Runs: those of the TP-8
# slice (256-byte rows: 4-32 KiB), MLA-576 (1152-byte rows: 18-144 KiB) and Llama-3-8B (2 KiB
# rows: 32-256 KiB) at 16-128 tokens a page, so those shapes are measured, not interpolated.
# Up to 128 MiB: a copy call's fixed host cost decides 1-16 MiB transfers, the engines' rate
# the large ones.
RUN_BYTES = (4096, 8192, 16384, 18432, 32768, 36864, 65536, 73728, 131072, 147456, 262144)
TOTAL_BYTES = (1 << 20, 16 << 20, 128 << 20)
BACKENDS = ("kernel", "copy_engine", "pitched", "direct", "split")
# the backends that move bytes on the DMA engines, leaving the SMs to the model
DMA_BACKENDS = ("copy_engine", "pitched")
DIRECT_MAX_COPIES = 4096  # the direct backend is not timed where it would issue more memcpys


@dataclass(frozen=True)
class Shape:
    """What decides a transfer's backend."""

    load: bool
    all_layers: bool
    run_bytes: float
    total_bytes: int


@dataclass(frozen=True)
class Entry:
    shape: Shape
    seconds: tuple[tuple[str, float], ...]  # (backend, median seconds), inf = not measured
    enqueue: tuple[tuple[str, float], ...]  # (backend, median host seconds of the call)
    split_share: float = math.nan  # the split's pitched share for this shape (nan: none)

    def best(self, allowed: Collection[str], deferred: bool = False) -> str | None:
        """The backend for this shape among ``allowed`` (None when none was measured): those
        whose enqueue time is within ``ENQUEUE_SLACK_S`` of the kernel's (the DMA backends and
        the split whatever their enqueue time when ``deferred``: a thread other than the
        caller's enqueues them), then the faster DMA backend unless it is more than
        ``COPY_ENGINE_SLACK`` (deferred: ``DEFERRED_COPY_ENGINE_SLACK``, for one layer
        ``DEFERRED_LAYER_SLACK``) slower than the fastest, then the split unless it is more than
        that slower, else the fastest."""
        host = dict(self.enqueue)
        bound = host.get("kernel", math.inf) + ENQUEUE_SLACK_S
        free = ("kernel", *DMA_BACKENDS, "split") if deferred else ("kernel",)
        times = {b: s for b, s in self.seconds if b in allowed and math.isfinite(s)
                 and (b in free or host.get(b, math.inf) <= bound)}  # fmt: skip
        if not times:
            return None
        fastest = min(times, key=times.__getitem__)
        if not deferred:
            slack = COPY_ENGINE_SLACK
        else:
            slack = DEFERRED_COPY_ENGINE_SLACK if self.shape.all_layers else DEFERRED_LAYER_SLACK
        dma = [b for b in DMA_BACKENDS if b in times]
        for pick in ([min(dma, key=times.__getitem__)] if dma else []) + ["split"]:
            if pick in times and times[pick] <= times[fastest] * (1 + slack):
                return pick
        return fastest


MEMO_MAX = 4096  # choices remembered per table (a serving process sees few distinct shapes)


@dataclass(frozen=True)
class CopyTable:
    key: str
    device: str
    entries: tuple[Entry, ...]
    # provisional: measured while the measuring thread waited this share of its run for a CPU
    # (at least _calibrate.BUSY_WAIT_SHARE); None: the device's table
    host_wait: float | None = None
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def choose(self, shape: Shape, allowed: Collection[str], deferred: bool = False) -> str:
        """The backend the measured shapes around ``shape`` (same direction and layer span)
        agree on: the nearest measured runs at or below and at or above ``shape``'s, each at the
        nearest measured totals at or below and at or above (log scale; one side where
        ``shape`` is outside the grid). ``kernel`` when they disagree, when a run is shorter
        than every measured one, when nothing fits. ``deferred``: see :meth:`Entry.best`.
        Remembered per (shape, allowed, deferred): a layer-by-layer load asks once per layer."""
        return self._remembered((shape, tuple(sorted(allowed)), deferred),
                                lambda: self._agreed(shape, allowed, deferred))  # fmt: skip

    def split_share(self, shape: Shape) -> float:
        """The split's pitched share for an all-layer ``shape``: the mean of the measured
        shares around it (the same neighbours as :meth:`choose`), else
        :data:`.split.FALLBACK_SHARE`. Remembered per shape, as the choices are."""
        from .split import FALLBACK_SHARE

        def mean() -> float:
            shares = [e.split_share for e in self._neighbours(shape)
                      if math.isfinite(e.split_share)]  # fmt: skip
            return statistics.fmean(shares) if shares else FALLBACK_SHARE

        return self._remembered(("split_share", shape), mean)

    def _remembered(self, key: tuple, compute: Callable[[], T]) -> T:
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= MEMO_MAX:
                self._memo.clear()
            hit = self._memo[key] = compute()
        return hit

    def _neighbours(self, shape: Shape) -> list[Entry]:
        """The entries of ``shape``'s direction and layer span at the nearest measured runs at
        or below and at or above its run, each at the nearest totals on both sides (log scale;
        one side where ``shape`` is outside the grid); none when its run is below every
        measured one."""
        same = [
            e
            for e in self.entries
            if e.shape.load == shape.load and e.shape.all_layers == shape.all_layers
        ]
        if not same or min(e.shape.run_bytes for e in same) > shape.run_bytes:
            return []
        out = []
        for run in _around([e.shape.run_bytes for e in same], shape.run_bytes):
            row = [e for e in same if e.shape.run_bytes == run]
            for total in _around([e.shape.total_bytes for e in row], shape.total_bytes):
                out += [e for e in row if e.shape.total_bytes == total]
        return out

    def _agreed(self, shape: Shape, allowed: Collection[str], deferred: bool) -> str:
        picks = {e.best(allowed, deferred) or "kernel" for e in self._neighbours(shape)}
        return picks.pop() if len(picks) == 1 else "kernel"

    def to_json(self) -> dict:
        def share(e: Entry) -> float | None:  # JSON has no nan
            return None if math.isnan(e.split_share) else e.split_share

        return {"version": TABLE_VERSION, "key": self.key, "device": self.device,
                "host_wait": self.host_wait,
                "entries": [{"shape": asdict(e.shape), "seconds": dict(e.seconds),
                             "enqueue": dict(e.enqueue), "split_share": share(e)}
                            for e in self.entries]}  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict) -> CopyTable:
        if doc.get("version") != TABLE_VERSION:
            raise ValueError(f"copy table version {doc.get('version')}, need {TABLE_VERSION}")
        entries = []
        for e in doc["entries"]:
            sh = e["shape"]
            shape = Shape(bool(sh["load"]), bool(sh["all_layers"]), float(sh["run_bytes"]),
                          int(sh["total_bytes"]))  # fmt: skip
            entries.append(Entry(shape, _pairs(e["seconds"]), _pairs(e["enqueue"]),
                                 _share(e.get("split_share"))))  # fmt: skip
        wait = doc["host_wait"]
        return cls(str(doc["key"]), str(doc["device"]), tuple(entries),
                   None if wait is None else float(wait))  # fmt: skip


def _share(value: object) -> float:
    return math.nan if value is None else float(value)  # type: ignore[arg-type]


def _pairs(d: dict) -> tuple[tuple[str, float], ...]:
    return tuple((str(b), float(s)) for b, s in d.items())


def _around(values: Iterable[float], x: float) -> list[float]:
    """The nearest of ``values`` at or below ``x`` and the nearest at or above (one where they
    coincide or ``x`` is outside them; none for no values)."""
    vals = sorted(set(values))
    below = [v for v in vals if v <= x][-1:]
    above = [v for v in vals if v >= x][:1]
    return sorted(set(below + above))


def table_key(device_name: str, driver: int, library: str) -> str:
    raw = f"{device_name}|{driver}|{library}|{TABLE_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def table_path(directory: Path, key: str) -> Path:
    return directory / f"copy_table_{key}.json"


def load_table(path: Path, key: str) -> CopyTable | None:
    """The cached table, or None when missing, unreadable or made for another key."""
    try:
        table = CopyTable.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        if path.exists():
            log.warning("pagekv: ignoring copy table %s (%s); measuring again", path, e)
        return None
    return table if table.key == key else None


def save_table(path: Path, table: CopyTable) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table.to_json(), f, indent=1)
    os.replace(tmp, path)


# measures a table: the table (its host_wait set where the host was busy), and why it must not
# be cached at all (None: cache it)
Measure = Callable[[], tuple[CopyTable, str | None]]
# a short measurement: why the host is too busy now to measure the table (None: it is not)
Trial = Callable[[], str | None]


def cached_or_measured(
    path: Path, key: str, measure: Measure, trial: Trial
) -> tuple[CopyTable, bool]:
    """The device's table at ``path`` for ``key``, else a measured one (one process measures,
    concurrent ones wait and read it). Returns (table, measured_now).

    A provisional table (``host_wait``: measured on a busy host) is used as it is where it was
    written while this process waited for the lock, or where ``trial()`` finds the host busy
    now (or raises ``RuntimeError``); else the table is measured again (:func:`_kept`). So
    where every start-up is busy, one ~30 s measurement serves them all (processes starting
    together run one trial at most), and the first quiet one replaces it. Where ``measure``
    says why its table must not be cached at all (a backend whose calls were refused in this
    process, so not timed), the table is this process's alone, after one warning."""
    seen = _written(path)
    table = load_table(path, key)
    if table is not None and table.host_wait is None:
        return table, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = load_table(path, key)
        if cached is not None and (cached.host_wait is None or _provisional_holds(
                path, cached, _written(path) != seen, trial)):  # fmt: skip
            return cached, False
        table, unfit = measure()
        if unfit is not None:
            log.warning("pagekv: the copy table measured %s is not cached; the next process "
                        "measures again", unfit)  # fmt: skip
            return table, True
        return _kept(path, cached, table), True


def _kept(path: Path, cached: CopyTable | None, table: CopyTable) -> CopyTable:
    """What a process that has just measured ``table`` caches at ``path`` (holding its lock)
    and uses: ``table`` where it is the device's, or provisional and less busy than the
    provisional ``cached`` (or none cached); else ``cached``, written anew (as after a busy
    trial: the processes waiting for the lock take it as fresh)."""
    if table.host_wait is not None and cached is not None and cached.host_wait <= table.host_wait:
        log.warning("pagekv: the copy table measured on a busy host (its thread's wait %.2f of "
                    "its run) is not cached: the cached provisional one was measured on a less "
                    "busy host (%.2f) and is used", table.host_wait, cached.host_wait)  # fmt: skip
        save_table(path, cached)
        return cached
    save_table(path, table)
    if table.host_wait is not None:
        log.warning("pagekv: the copy table was measured on a busy host (its thread's wait "
                    "%.2f of its run for a CPU) and is cached as provisional: later processes "
                    "use it and the first to find the host quiet measures again",
                    table.host_wait)  # fmt: skip
    return table


def _written(path: Path) -> tuple[int, int] | None:
    """Which write of ``path`` is there now (:func:`save_table` replaces the file: a new inode
    each time); None for none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _provisional_holds(path: Path, cached: CopyTable, fresh: bool, trial: Trial) -> bool:
    """Whether a process uses the provisional table ``cached`` as it is: one written while it
    waited for the lock (``fresh``: measured, or found still busy by a trial, in a process
    starting beside it: the host is as busy as a moment ago), or one the trial finds the host
    still too busy to measure again (the table then written anew, so that the processes waiting
    meanwhile run no trial of their own: one trial per start-up of a tensor-parallel engine)."""
    if fresh:
        log.info("pagekv: using the provisional copy table %s, written while this process "
                 "waited for it (measured, or found busy by a trial, beside it)",
                 path)  # fmt: skip
        return True
    try:
        busy = trial()
    except RuntimeError as e:  # no memory for it, a CUDA error: measuring would fail too
        busy = f"the trial failed ({e})"
    if busy is None:
        return False
    log.info("pagekv: using the provisional copy table %s (measured while its thread waited "
             "%.2f of its run for a CPU): the host is still busy, %s", path, cached.host_wait,
             busy)  # fmt: skip
    save_table(path, cached)  # written anew: the processes waiting for the lock take it as fresh
    return True


def measured_or_empty(
    path: Path, key: str, device: str, measure: Measure, trial: Trial
) -> tuple[CopyTable, bool]:
    """:func:`cached_or_measured`, or, when measuring fails (out of memory, a CUDA error), an
    empty table (``auto`` then takes the kernel) kept in this process only, after one warning:
    a transfer never fails because its backend could not be measured."""
    try:
        return cached_or_measured(path, key, measure, trial)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError included
        log.warning("pagekv: measuring the transfer backends on %s failed (%s); backend='auto' "
                    "uses the kernel in this process", device, e)  # fmt: skip
        return CopyTable(key, device, ()), False


def grid() -> Iterable[tuple[bool, bool, int, int]]:
    for all_layers in (True, False):
        for run in RUN_BYTES:
            for total in TOTAL_BYTES:
                for load in (True, False):
                    yield load, all_layers, run, total


_tables: dict[int, CopyTable] = {}
_tables_lock = threading.Lock()


def calibrate(device: int | None = None, *, force: bool = False) -> CopyTable:
    """The table for ``device`` (default: the current one): from this process, else the cache,
    else measured now and cached (provisional where the host was busy; not at all where a DMA
    backend's calls were refused here: :func:`cached_or_measured`). ``force`` measures again."""
    import torch

    from . import _calibrate, copy_engine, ops, split
    from .jit import cache_dir, load_library

    index = torch.cuda.current_device() if device is None else device
    with _tables_lock:
        if not force and index in _tables:
            return _tables[index]
        lib = load_library()
        if lib is None:
            raise RuntimeError("the copy table needs the CUDA kernels (see PAGEKV_KERNELS)")
        name = torch.cuda.get_device_name(index)
        driver = copy_engine._support(index)
        library = Path(getattr(lib, "_name", "lib")).name
        blocks = (ops.LOAD_BLOCKS, ops.LAYER_LOAD_BLOCKS, ops.SAVE_BLOCKS, ops.LAYER_SAVE_BLOCKS,
                  split.BLOCKS)  # fmt: skip
        form = (f"lanes={copy_engine.LANES},layer_lanes={copy_engine.LAYER_LANES},"
                f"threads={copy_engine.ENQUEUE_THREADS}/{copy_engine.ENQUEUE_THREAD_COPIES},"
                f"flags={copy_engine.FLAGS},blocks={blocks}")  # fmt: skip
        key = table_key(name, driver, f"{library}|{form}")
        path = table_path(cache_dir(), key)
        if force and path.exists():
            path.unlink()

        def measure() -> tuple[CopyTable, str | None]:
            log.info("pagekv: measuring transfer backends on %s (once; cached in %s)", name, path)
            entries, load = _calibrate.measure_grid(index)
            failed = copy_engine.failed_reason(index)
            table = CopyTable(key, name, tuple(entries), load.share if load.busy else None)
            return table, f"without {failed}" if failed else None

        def trial() -> str | None:
            load = _calibrate.trial(index)
            return load.reason() if load.busy else None

        table, fresh = measured_or_empty(path, key, name, measure, trial)
        if fresh:
            log.info("pagekv: copy table for %s written to %s", name, path)
        _tables[index] = table
        return table
