"""Build and load the CUDA kernels: nvcc on first use, cached, behind ctypes.

Route: a plain nvcc shared library with C entry points, loaded with ctypes. It needs no torch
headers, builds with nothing but nvcc (so CI, which has nvcc and no GPU, compiles the real
sources: ``tests/test_kernels_build.py``), and launches on the stream torch hands it.

* Cache: ``$PAGEKV_CACHE_DIR`` (default ``~/.cache/pagekv``), one library per source hash, GPU
  architecture and CUDA version; a file lock makes concurrent processes build once.
* ``PAGEKV_KERNELS``: ``auto`` (default: kernels when possible, else torch with one warning),
  ``torch`` (always the reference path), ``cuda`` (kernels or an error saying why not).
* ``PAGEKV_COPY_BACKEND``: what ``backend="auto"`` transfers use: ``auto`` (the default: per
  transfer shape, from the table measured once per device, :mod:`.copy_table`), or always
  ``kernel``, ``copy_engine``, ``direct``, ``staged`` or ``torch``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from pagekv import env
from pagekv.build_cache import build_once
from pagekv.errors import KernelsUnavailable

__all__ = [
    "KernelsUnavailable",
    "backend_mode",
    "build_library",
    "copy_backend_setting",
    "find_nvcc",
    "kernels_unavailable_reason",
    "load_library",
]

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "pagekv_kernels.cu", CSRC / "copy_engine.cu")
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")
_ABI_VERSION = 10


def backend_mode() -> str:
    """``PAGEKV_KERNELS``: auto, torch or cuda (``ConfigError`` for anything else)."""
    return env.KERNELS.get()


def copy_backend_setting() -> str:
    """``PAGEKV_COPY_BACKEND``: the backend ``backend="auto"`` transfers use (see module doc;
    ``ConfigError`` for anything else)."""
    return env.COPY_BACKEND.get()


def cache_dir() -> Path:
    return env.CACHE_DIR.get()


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME / $CUDA_PATH, then PATH, then /usr/local/cuda."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.cache
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else "unknown"


def _source_digest(arch: str, cuda: str) -> str:
    h = hashlib.sha256(f"{arch}|{cuda}|{' '.join(NVCC_FLAGS)}".encode())
    for src in SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def compile_command(nvcc: str, arch: str, out: Path) -> list[str]:
    """nvcc command building all sources for ``sm_<arch>`` (e.g. "90") into ``out``."""
    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    return [nvcc, *NVCC_FLAGS, gencode, "-o", str(out), *map(str, SOURCES)]


def build_library(arch: str, *, nvcc: str | None = None, directory: Path | None = None) -> Path:
    """Compile (once; cached and locked) and return the library path for ``sm_<arch>``.

    Raises ``KernelsUnavailable`` if nvcc is missing or the compile fails (with its output).
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise KernelsUnavailable(
            "nvcc not found (set CUDA_HOME or put nvcc on PATH; install the CUDA toolkit)"
        )
    cuda = nvcc_version(nvcc)
    name = f"libpagekv_sm{arch}_cu{cuda}_{_source_digest(arch, cuda)}.so"

    def build(out: Path) -> None:
        log.info("pagekv: building CUDA kernels for sm_%s with %s", arch, nvcc)
        proc = subprocess.run(compile_command(nvcc, arch, out), capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelsUnavailable(f"nvcc failed for sm_{arch}:\n{proc.stderr[-4000:]}")

    return build_once((directory or cache_dir()) / name, build)


_SIGNATURES = {
    "pagekv_abi_version": ([], ctypes.c_int),
    "pagekv_can_use_host_pointer": ([ctypes.c_int], ctypes.c_int),
    "pagekv_host_device_pointer": (
        [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)],
        ctypes.c_int,
    ),
}
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES["pagekv_page_plan_transfer"] = (
    [_P, _I, _P, _L, _P, _P, _L] + [_I] * 4 + [_P],
    ctypes.c_int,
)
_SIGNATURES["pagekv_page_plan_transfer_layers"] = (
    [_P, _I, _P, _L, _P, _P, _L, _P, _I, _P] + [_I] * 4 + [_P, ctypes.POINTER(_I)],
    ctypes.c_int,
)
_SIGNATURES["pagekv_slot_copy"] = (
    [_I, _P, _P, _P, _I, _P, _I] + [_L] * 5 + [_I] * 8 + [_P],
    ctypes.c_int,
)
_SIGNATURES["pagekv_store_kv"] = (
    [_I, _P, _P, _P, _P, _P, _I] + [_L] * 6 + [_I] * 4 + [_P],
    ctypes.c_int,
)
_SIGNATURES["pagekv_store_kv_plan"] = ([_P, _P, _P, _P, _L, _I, _I, _P], ctypes.c_int)
_SIGNATURES["pagekv_direct_page_transfer"] = (
    [_I, _I, _P, _P, _P, _P] + [_L] * 3 + [_I] * 6 + [_P],
    ctypes.c_int,
)
_SIGNATURES["pagekv_copy_engine_support"] = ([_I], ctypes.c_int)
_SIGNATURES["pagekv_slot_runs"] = ([_P, _L, _I, ctypes.POINTER(_L)], ctypes.c_int)
_SIGNATURES["pagekv_ce_page_transfer"] = (
    [_I, _I, _P, _P, _P, _P] + [_L] * 5 + [_I] * 10 + [_L, _L, _P, ctypes.POINTER(_L)],
    ctypes.c_int,
)
_SIGNATURES["pagekv_pitched_page_transfer"] = (
    [_I, _I, _P, _P, _P, _P, _P] + [_L] * 5 + [_I] * 4 + [_P, ctypes.POINTER(_L)],
    ctypes.c_int,
)
_SIGNATURES["pagekv_progress_publish"] = ([ctypes.POINTER(_I), _I], None)
_SIGNATURES["pagekv_progress_wait"] = ([ctypes.POINTER(_I), _I, _L], ctypes.c_int)
_SIGNATURES["pagekv_ce_page_transfer_layers"] = (
    [_I, _I, _P, _P, _P, _P] + [_L] * 5 + [_I] * 4 + [_P, _I, _P, _I, _I, _I, _I, _L, _L, _P, _P]
    + [ctypes.POINTER(_L), ctypes.POINTER(_I)],
    ctypes.c_int,
)  # fmt: skip
_SIGNATURES["pagekv_events_create"] = ([_I, _P, _I], ctypes.c_int)
_SIGNATURES["pagekv_events_destroy"] = ([_P, _I], ctypes.c_int)
_SIGNATURES["pagekv_event_record"] = ([_P, _P], ctypes.c_int)
_SIGNATURES["pagekv_stream_wait_event"] = ([_P, _P], ctypes.c_int)
_SIGNATURES["pagekv_event_query"] = ([_P], ctypes.c_int)
_SIGNATURES["pagekv_event_synchronize"] = ([_P], ctypes.c_int)


def layer_entries(
    layers: Sequence[int | None], events: Sequence[torch.cuda.Event]
) -> tuple[ctypes.Array, ctypes.Array]:
    """The arrays the layer-by-layer entries (``pagekv_*_transfer_layers``) take: each entry's
    layer (-1: all layers) and the handle of the event recorded after it (the events must
    exist: torch creates one at its first ``record``)."""
    which = (ctypes.c_int * len(layers))(*(-1 if layer is None else layer for layer in layers))
    handles = (ctypes.c_void_p * len(events))(*(event.cuda_event for event in events))
    return which, handles


class PagePlan(ctypes.Structure):
    """Mirror of ``PagePlan`` in csrc/pagekv_kernels.cu (all int64: no padding to match)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "device", "layer_ptrs", "num_slots", "page_bytes", "slot_stride", "item_bytes",
            "page_size", "num_kv", "num_layers",
        )
    ]  # fmt: skip


# ``flags`` of the page entries (csrc/pagekv_kernels.cu ``PageFlags``)
PAGE_LOAD, PAGE_IDS64, PAGE_SLOTS64, PAGE_UNROLL8 = 1, 2, 4, 8


class StoreKVPlan(ctypes.Structure):
    """Mirror of ``StoreKVPlan`` in csrc/pagekv_kernels.cu (all int64: no padding to match)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "device", "k_cache", "v_cache", "num_slots", "k_stride", "v_stride",
            "k_cache_stride", "v_cache_stride", "row_bytes", "loc64", "threads",
        )
    ]  # fmt: skip


def _open(path: Path, kind: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL:
    lib = kind(str(path))
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    if lib.pagekv_abi_version() != _ABI_VERSION:
        raise KernelsUnavailable(f"{path} has ABI {lib.pagekv_abi_version()}, need {_ABI_VERSION}")
    return lib


@functools.cache
def library_holding_gil() -> ctypes.CDLL | None:
    """The kernel library (:func:`load_library`'s) with calls that keep the GIL: only for calls
    that never block (a progress count read or wake, an event query). A call that gives the GIL
    up must take it back, which beside a thread running Python costs up to the interpreter's
    switch interval (5 ms); these cost less than handing it over."""
    lib = load_library()
    return None if lib is None else _open(Path(lib._name), ctypes.PyDLL)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if backend_mode() == "torch":
        return None, "PAGEKV_KERNELS=torch forces the torch reference path"
    if not torch.cuda.is_available():
        return None, "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    try:
        return _open(build_library(f"{major}{minor}")), None
    except (KernelsUnavailable, OSError, subprocess.SubprocessError) as e:
        return None, str(e)


def kernels_unavailable_reason() -> str | None:
    """None when the kernels are usable, else a one-line reason."""
    return _load()[1]


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("pagekv: CUDA kernels unavailable, using the torch path: %s", reason)


def load_library() -> ctypes.CDLL | None:
    """The kernel library, or None (warned once) when unavailable and PAGEKV_KERNELS allows
    the torch path. Raises ``KernelsUnavailable`` when PAGEKV_KERNELS=cuda and they are not."""
    lib, reason = _load()
    if lib is None and reason is not None:
        if backend_mode() == "cuda":
            raise KernelsUnavailable(reason)
        _warn_once(reason.splitlines()[0])
    return lib
