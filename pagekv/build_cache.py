"""Building a compiled library once per machine: the rule shared by the CUDA kernels
(:mod:`pagekv.kernels.jit`) and the store's native checked copy
(:mod:`pagekv.store.wire.native`).

A library's file name carries everything it was built from (sources, flags, compiler), so a
name that exists is the right library. It is built into a temporary file beside it and renamed
into place (atomic: a reader sees no library or the whole one), under a file lock beside it, so
that concurrent processes build once and the others wait for that build.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["build_once"]


def build_once(lib: Path, build: Callable[[Path], None]) -> Path:
    """``lib``, made by ``build(out)`` (which writes the library to ``out`` or raises) when it
    does not exist yet; see the module docstring. Returns ``lib``."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / f"{lib.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent processes: one builds, the others wait
        if lib.exists():
            return lib
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            build(out)
            os.replace(out, lib)
    return lib
