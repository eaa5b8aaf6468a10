"""Shared bits for pagekv benchmarks: environment facts and result files.

Results go to ``$RESULTS_DIR`` when it is set (scripts/gpu_check.sh), else to
``benchmarks/results/`` with ``--save``, else to a temp dir: running a benchmark does not dirty
the tree. JSON holds no NaN: a value that was not measured is null, and ``nulls`` says why.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

SAVED_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
_save = False


@contextlib.contextmanager
def overridden(module: Any, **values: Any) -> Iterator[None]:
    """``module``'s settings ``values`` (module attributes, which must exist) for the block, the
    previous ones restored after it."""
    missing = [name for name in values if not hasattr(module, name)]
    assert not missing, f"{module.__name__} has no setting {missing}"
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def spinning(n: int) -> Iterator[None]:
    """``n`` processes spinning in pure Python for the block (a busy host), killed and reaped
    after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def parse_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """``ap.parse_args()`` plus ``--save`` (results into benchmarks/results/)."""
    global _save
    ap.add_argument("--save", action="store_true",
                    help="write results to benchmarks/results/ (default: a temp dir; "
                    "$RESULTS_DIR overrides both)")  # fmt: skip
    args = ap.parse_args()
    _save = args.save
    return args


def results_dir() -> Path:
    if os.environ.get("RESULTS_DIR"):
        return Path(os.environ["RESULTS_DIR"])
    return SAVED_DIR if _save else Path(tempfile.gettempdir()) / "pagekv-bench"


def git_commit() -> str:
    """PAGEKV_COMMIT when set (a device copy of the tree may carry a stale .git), else git."""
    if os.environ.get("PAGEKV_COMMIT"):
        return os.environ["PAGEKV_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout
        return out.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PAGEKV_COMMIT", "unknown")


class FullCollections:
    """Counts the garbage collector's full (generation 2) collections from :meth:`install` on,
    and how long each took: a full collection holds the GIL, so every thread's Python (a lane
    connection's between two receives, the client's loop) waits for it."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._start = 0.0

    def install(self) -> None:
        if self._on_collect not in gc.callbacks:
            gc.callbacks.append(self._on_collect)

    def uninstall(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses_ms.append((time.perf_counter() - self._start) * 1e3)

    def summary(self) -> dict[str, Any]:
        pauses = self.pauses_ms
        return dict(count=len(pauses), max_ms=round(max(pauses, default=0.0), 1),
                    total_ms=round(sum(pauses), 1))  # fmt: skip


FULL_COLLECTIONS = FullCollections()


def engine_heap() -> None:
    """Make this process's heap an engine's once started: collect, then freeze what is alive
    (``gc.freeze``), as vLLM does after start-up (``freeze_gc_heap``) and pagekv's reference
    engine after its warm-up. A full collection then walks only the objects made since, not
    torch's modules and the benchmark's set-up: without it, one full collection in a timed
    round took 85-120 ms on the H200 host (2026-11-28) and a 4 GiB prefetch that met it moved
    12 GB/s instead of 17-18. Call after the set-up, before the timed rounds; every result
    records the full collections since (``gc_full``)."""
    FULL_COLLECTIONS.uninstall()  # this collection is the set-up's, not a timed round's
    gc.collect()
    gc.freeze()
    FULL_COLLECTIONS.install()


def environment() -> dict[str, Any]:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def _finite(value: Any, where: str, nulls: dict[str, str], reason: str) -> Any:
    """``value`` with every NaN/inf float replaced by None (its path and ``reason`` noted)."""
    if isinstance(value, float) and not math.isfinite(value):
        nulls[where] = reason
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{where}.{k}".lstrip("."), nulls, reason) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{where}[{i}]", nulls, reason) for i, v in enumerate(value)]
    return value


def write_result(name: str, payload: dict[str, Any], nan_reason: str = "not measured") -> Path:
    """Write ``{env, **payload}`` as ``name.json`` in :func:`results_dir`; NaN becomes null."""
    nulls: dict[str, str] = {}
    env = environment()
    env.update(gc_frozen=gc.get_freeze_count(), gc_full=FULL_COLLECTIONS.summary())
    clean = _finite({"env": env, **payload}, "", nulls, nan_reason)
    if nulls:
        clean["nulls"] = nulls
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    return path
