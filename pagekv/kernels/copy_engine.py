"""The copy-engine backend: a page transfer as batched DMA copies (``csrc/copy_engine.cu``).

The GPU's copy engines move the bytes, so no SM is taken from the model running beside the
transfer (the kernels take 4-8 thread blocks and, measured beside a graph-captured decode, cost
it far more than a DMA copy of the same bytes: docs/benchmarks.md). Descriptors are built on the
host from CPU page ids and slots, one per run of consecutive slots and (layer, K/V), or one 2-D
copy whose rows are the layers where the cache's layers lie at one distance from each other.

Availability is found at run time: the library must be built with CUDA >= 12.8 and the driver
must be >= 12.8 (:func:`supported`). A call the driver refuses is logged once and the device
uses the kernel from then on (:func:`page_transfer` returns False and the caller runs the kernel).

Ownership: page ids and slots are read during the call; the host pages and device slots are
read by the DMA engines later, in stream order, so the caller keeps them valid until an event
recorded after the call has completed.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import threading
from dataclasses import dataclass

import torch

from .layout import DeviceKV, mean_run_bytes

__all__ = [
    "MAX_PITCH",
    "RowPlan",
    "disabled_reason",
    "page_transfer",
    "row_plan",
    "run_bytes",
    "supported",
]

log = logging.getLogger(__name__)

# cudaMemcpyFlagPreferOverlapWithCompute: a hint to keep the copy off the SMs (CUDA >= 13.1
# drivers honour it for batched copies; 13.0 ignores it: same speed either way on the H200).
FLAGS = 1
# Descriptor form (H200, driver 580.159, docs/benchmarks.md "copy engine"): a 2-D copy costs
# ~3 us of copy-engine time on top of its bytes whatever its rows, streams or not; a 1-D copy
# of >= 64 KiB ~0.5 us, hidden by splitting the copies over LANES streams; 1-D copies under
# ~28 KiB run at 4-6 GB/s, and near 32 KiB their speed swung from 0.53 to 0.92 of the bus between
# runs. Hence runs of >= ONE_D_MIN_RUN bytes are 1-D copies, shorter runs 2-D copies where the
# cache's rows lie at one distance and a copy gets >= MIN_2D_ROWS rows, else 1-D.
ONE_D_MIN_RUN = 64 << 10
MIN_2D_ROWS = 4
MAX_PITCH = 1 << 40  # any row distance: a 2.25 GiB pitch copied exactly
USE_2D = True  # False: 1-D copies only (the benchmarks compare the two forms)
# Streams the copies of one call are split over, so several copy engines work at once (1-D
# copies of 32 KiB: 0.78 of the bus on one stream, 0.92 on four).
LANES = 4
# When the driver may read a copy's sources (cudaMemcpySrcAccessOrder): 1, in stream order, so
# a load may follow the save that fills its host pages on the stream. (2, during the call, and
# 3, any time, are for the benchmark's comparison: they need sources nothing writes later.)
SRC_ORDER = 1
# Descriptors per driver call; a call the driver refuses as invalid is split in halves.
MAX_OPS = 16384

_failed: dict[int, str] = {}
# [descriptors sent, driver calls split after a refusal] of the last call (diagnostics)
last_stats: tuple[int, int] = (0, 0)
_lock = threading.Lock()


@dataclass(frozen=True)
class RowPlan:
    """How the (layer, K/V) rows of one run become descriptors (``rows_mode`` of the C side):
    0 one 1-D copy per row, 1 one 2-D copy per K/V over the layers, 2 one 2-D copy over all
    rows in host order. ``pitch``: device bytes between consecutive rows of a 2-D copy."""

    mode: int
    pitch: int
    rows_per_copy: int


def _uniform_pitch(ptrs: list[int], least: int) -> int | None:
    if len(ptrs) < 2:
        return None
    pitch = ptrs[1] - ptrs[0]
    if pitch < least or pitch > MAX_PITCH:
        return None
    return pitch if all(b - a == pitch for a, b in itertools.pairwise(ptrs)) else None


def row_plan(kv: DeviceKV, layer_begin: int, layer_count: int, run_bytes: float = 0.0) -> RowPlan:
    """The descriptor form for runs of ``run_bytes`` (see :class:`RowPlan` and the module
    constants): 1-D for long runs, else the widest 2-D form the layer addresses allow."""
    geo = kv.geometry
    if run_bytes >= ONE_D_MIN_RUN:
        return RowPlan(0, 0, 1)
    L, nkv = geo.num_layers, geo.num_kv
    ptrs = kv.layer_ptrs
    layers = range(layer_begin, layer_begin + layer_count)
    least = geo.page_size * geo.item_bytes  # a row must not overlap the next one
    if USE_2D:
        host_order = [ptrs[c * L + i] for i in layers for c in range(nkv)]
        pitch = _uniform_pitch(host_order, least)
        if pitch is not None and len(host_order) >= MIN_2D_ROWS:
            return RowPlan(2, pitch, len(host_order))
        if layer_count >= MIN_2D_ROWS:
            groups = [[ptrs[c * L + i] for i in layers] for c in range(nkv)]
            per_group = [_uniform_pitch(g, least) for g in groups]
            if per_group[0] is not None and len(set(per_group)) == 1:
                return RowPlan(1, per_group[0], layer_count)
    return RowPlan(0, 0, 1)


def run_bytes(kv: DeviceKV, slots: torch.Tensor) -> float:
    """:func:`~.layout.mean_run_bytes` of a CPU slot table ``[n, page_size]``, counted by the
    library when it is loaded (the torch count costs ~10 small tensor ops per call, which a
    layer-by-layer load pays for every layer)."""
    from .jit import load_library

    item = kv.geometry.item_bytes
    lib = load_library() if kv.slot_stride_bytes == item else None
    if lib is None or slots.dtype != torch.int64 or not slots.is_contiguous():
        return mean_run_bytes(kv, slots)
    out = (ctypes.c_int64 * 2)()
    if lib.pagekv_slot_runs(slots.data_ptr(), slots.shape[0], slots.shape[1], out) != 0:
        return mean_run_bytes(kv, slots)
    return item * out[0] / max(out[1], 1)


@functools.cache
def _support(device: int) -> int:
    from .jit import load_library

    lib = load_library()
    return int(lib.pagekv_copy_engine_support(device)) if lib is not None else 0


def supported(device: int) -> bool:
    """True when batched copies can run on ``device`` and none has failed there."""
    return device not in _failed and _support(device) > 0


def disabled_reason(device: int) -> str | None:
    """Why the copy engine is not used on ``device`` (None when it is)."""
    if device in _failed:
        return _failed[device]
    if _support(device) <= 0:
        return "batched copies need a library built with CUDA >= 12.8 and a driver >= 12.8"
    return None


def page_transfer(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    slots: torch.Tensor,
    layer_begin: int,
    layer_count: int,
    stream: int,
    mean_run: float | None = None,
) -> bool:
    """Issue the transfer on the copy engines. ``ids`` ``[n]`` and ``slots`` ``[n, page_size]``
    are CPU int64 contiguous tensors; ``mean_run``: their :func:`run_bytes` when the caller
    has it. Returns False, after one log line for the device, when the driver refused the
    call: nothing of it may be relied on and the caller runs the kernel."""
    geo = kv.geometry
    device = kv.device.index or 0
    plan = row_plan(kv, layer_begin, layer_count,
                    run_bytes(kv, slots) if mean_run is None else mean_run)  # fmt: skip
    stats = (ctypes.c_int64 * 2)()
    err = lib.pagekv_ce_page_transfer(
        device, int(load), host.data_ptr(), kv.layer_ptr_array, ids.data_ptr(), slots.data_ptr(),
        ids.numel(), host.shape[0], kv.num_slots, geo.page_bytes, kv.slot_stride_bytes,
        geo.item_bytes, geo.page_size, geo.num_kv, geo.num_layers, layer_begin, layer_count,
        plan.mode, plan.pitch, FLAGS, SRC_ORDER, LANES, MAX_OPS, stream, stats,
    )  # fmt: skip
    global last_stats
    last_stats = (stats[0], stats[1])
    if err == 0:
        return True
    what = "1-D" if plan.mode == 0 else f"2-D ({plan.rows_per_copy} rows)"
    fail(device, f"copy-engine {'load' if load else 'save'} failed with cudaError {err} "
                 f"({stats[0]} {what} copies sent of {ids.numel()} pages)")  # fmt: skip
    return False


def fail(device: int, why: str) -> None:
    """Stop using the copy engine on ``device`` and say so once."""
    with _lock:
        if device in _failed:
            return
        _failed[device] = why
    log.warning("pagekv: %s on cuda:%d; transfers there use the kernel from now on", why, device)
