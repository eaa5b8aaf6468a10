"""Which backend ``backend="auto"`` uses for a transfer: a table measured once per device.

For a grid of transfer shapes (direction, all layers or one, bytes per run of consecutive slots,
bytes in all) the kernel, the copy engine and the direct memcpy backend are timed on this GPU;
a transfer takes the backend of the nearest measured shape (:meth:`CopyTable.choose`: the
nearest run at or below its own). The copy engine wins unless it is more than
``COPY_ENGINE_SLACK`` slower than the fastest: it leaves the SMs to the model, which the kernels
do not (docs/benchmarks.md, "beside a graph-captured decode").

Cache: ``$PAGEKV_CACHE_DIR/copy_table_<key>.json``, the key naming the GPU, the driver, the
kernel library (its source hash) and the copy engine's settings, so a new driver, a changed
kernel or other copy-engine defaults measure again. A file lock makes concurrent processes
measure once. Measuring takes a few seconds, synchronises the device and uses up to 256 MiB of
device and of pinned host memory for the while; it happens on the first ``auto`` transfer that
could use the copy engine, or when :func:`calibrate` is called (do it at start-up to keep it off
the serving path). ``PAGEKV_COPY_BACKEND`` overrides the table.
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
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "COPY_ENGINE_SLACK",
    "CopyTable",
    "Entry",
    "Shape",
    "calibrate",
    "load_table",
    "save_table",
    "table_path",
]

log = logging.getLogger(__name__)
TABLE_VERSION = 3
# The copy engine is chosen unless it takes more than this fraction longer than the fastest.
COPY_ENGINE_SLACK = 0.10
# The measured grid: bytes per run (page_size x row bytes when slots are consecutive) and bytes
# per transfer, for loads and saves of all layers (32) and of one layer. Up to 128 MiB: a copy
# call's fixed host cost decides 1-16 MiB transfers, the engines' rate the large ones (a 1-4 GiB
# prefix, its 32-128 MiB layers). The copy engine's 1-D copies reach 0.96-0.99 of the bus from
# 32 KiB runs and 0.05-0.2 below ~28 KiB (H200, docs/benchmarks.md): 16 and 32 KiB bracket it.
RUN_BYTES = (512, 2048, 8192, 16384, 32768, 131072)
TOTAL_BYTES = (1 << 20, 16 << 20, 128 << 20)
BACKENDS = ("kernel", "copy_engine", "direct")
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

    def best(self, allowed: Collection[str]) -> str | None:
        times = {b: s for b, s in self.seconds if b in allowed and math.isfinite(s)}
        if not times:
            return None
        fastest = min(times, key=times.__getitem__)
        ce = times.get("copy_engine")
        if ce is not None and ce <= times[fastest] * (1 + COPY_ENGINE_SLACK):
            return "copy_engine"
        return fastest


@dataclass(frozen=True)
class CopyTable:
    key: str
    device: str
    entries: tuple[Entry, ...]

    def choose(self, shape: Shape, allowed: Collection[str]) -> str:
        """Backend of the nearest measured shape of the same direction and layer span: the
        nearest measured run at or below ``shape``'s (the copy engine's rate falls steeply
        below ~28 KiB runs, so a run between two entries takes the shorter one's choice; the
        nearest run above when none is below), then the nearest total bytes (log scale);
        ``kernel`` if none fits."""

        def distance(e: Entry) -> tuple[bool, float, float]:
            s = e.shape
            return (
                s.run_bytes > shape.run_bytes,
                abs(math.log2(max(s.run_bytes, 1)) - math.log2(max(shape.run_bytes, 1))),
                abs(math.log2(max(s.total_bytes, 1)) - math.log2(max(shape.total_bytes, 1))),
            )

        same = [
            e
            for e in self.entries
            if e.shape.load == shape.load and e.shape.all_layers == shape.all_layers
        ]
        for e in sorted(same, key=distance):
            best = e.best(allowed)
            if best is not None:
                return best
        return "kernel"

    def to_json(self) -> dict:
        return {"version": TABLE_VERSION, "key": self.key, "device": self.device,
                "entries": [{"shape": asdict(e.shape), "seconds": dict(e.seconds)}
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
            entries.append(Entry(shape, tuple((str(b), float(s)) for b, s in e["seconds"].items())))
        return cls(str(doc["key"]), str(doc["device"]), tuple(entries))


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


def cached_or_measured(
    path: Path, key: str, measure: Callable[[], CopyTable]
) -> tuple[CopyTable, bool]:
    """The table at ``path`` for ``key``, else ``measure()`` saved there (one process measures,
    concurrent ones wait and read it). Returns (table, measured_now)."""
    table = load_table(path, key)
    if table is not None:
        return table, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = load_table(path, key)
        if table is not None:
            return table, False
        table = measure()
        save_table(path, table)
        return table, True


def measured_or_empty(
    path: Path, key: str, device: str, measure: Callable[[], CopyTable]
) -> tuple[CopyTable, bool]:
    """:func:`cached_or_measured`, or, when measuring fails (out of memory, a CUDA error), an
    empty table (``auto`` then takes the kernel) kept in this process only, after one warning:
    a transfer never fails because its backend could not be measured."""
    try:
        return cached_or_measured(path, key, measure)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError included
        log.warning("pagekv: measuring the transfer backends on %s failed (%s); backend='auto' "
                    "uses the kernel in this process", device, e)  # fmt: skip
        return CopyTable(key, device, ()), False


def median_seconds(fn: Callable[[], None], sync: Callable[[], None], reps: int = 5) -> float:
    """Median wall time of ``fn`` to completion (``sync`` waits for the device), after one
    untimed call: what one transfer costs, host-side descriptor building included."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    else measured now and cached. ``force`` measures again."""
    import torch

    from . import copy_engine
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
        form = f"lanes={copy_engine.LANES},flags={copy_engine.FLAGS}"
        key = table_key(name, driver, f"{library}|{form}")
        path = table_path(cache_dir(), key)
        if force and path.exists():
            path.unlink()

        def measure() -> CopyTable:
            log.info("pagekv: measuring transfer backends on %s (once; cached in %s)", name, path)
            from ._calibrate import measure_entries

            return CopyTable(key, name, tuple(measure_entries(index)))

        table, fresh = measured_or_empty(path, key, name, measure)
        if fresh:
            log.info("pagekv: copy table for %s written to %s", name, path)
        _tables[index] = table
        return table
