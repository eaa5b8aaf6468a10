"""The split backend: an all-layer transfer shared between the kernel on few thread blocks and
the pitched copy on the DMA engines, side by side.

Where a cache's runs are short (4 KiB: a TP-8 slice of Llama-3-8B at 16 tokens) the DMA
engines pay per row and the pitched copy moves 0.3-0.5 of the bus, while the kernel on the 4
thread blocks that reach the bus costs a decode running beside it either ~0.9x or ~1.8x a plain
copy's extra time, round by round. On ``BLOCKS`` (2) blocks the kernel's cost is steady; with a
share of the pages moved by the pitched copy at the same time the transfer gets back part of the
rate (H200, 2026-11-28, TP-8 16-token pages, 4 GiB beside a graph-captured decode, two runs:
loads 0.77-0.81x a plain copy's extra decode time, every round <= 0.85, at 40-41 GB/s alone,
where the pitched copy costs 0.25x at 18 GB/s and the 4-block kernel 1.13-1.16x, rounds up to
2.18, at 51; saves leave the step at x1.000-x1.025 where the 8-block save kernel made it
x1.24-x3.00; docs/benchmarks.md "Beside a graph-captured decode"). ``auto`` offers it only to
transfers the connector's issuer enqueues (they run beside the engine's compute) and takes it
where no DMA backend is within the issuer's slack and it is.

Rules:

* The last :func:`pitched_count` of the ``n`` pages go to the pitched copy on this module's side
  stream for the device, forked from the current stream (it waits for everything enqueued there
  before the call) and joined back (the current stream's later work waits for it); the first
  pages go to the kernel on the current stream. The halves touch disjoint pages (a save) or
  slots (a load), so they may run in any order.
* ``share``: the fraction of the pages the pitched copy takes, from the measured table
  (:mod:`.copy_table`): the fastest of ``SHARE_TRIALS`` times the share at which both halves
  would end together by their rates alone (:func:`balanced_share`). Run together they slow each
  other unevenly, loads most (H200, 128 MiB of 4 KiB runs: the balanced 0.43 moved 33 GB/s
  where alone the pitched copy moved 26 and the kernel on 2 blocks 35; saves add up), so the
  best share lies at or below the balanced one, and may be 0: the kernel on 2 blocks alone.
* Bounds are the kernels' and the pitched copy's: out-of-range page ids and slots are skipped.
* A pitched call the driver refuses leaves its pages to the kernel on the side stream (said
  once per device by :mod:`.copy_engine`; from then on ``auto`` does not take this backend).
* Ownership: as for a kernel launch, the caller keeps the host pages, caches and index tensors
  valid until an event recorded on its stream after the call has completed. The host indices
  are read during the call; the kernel's device indices are the caller's (ops uploads them on
  the current stream).
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable

import torch

from . import copy_engine
from .layout import DeviceKV

__all__ = [
    "BLOCKS",
    "FALLBACK_SHARE",
    "SHARE_TRIALS",
    "balanced_share",
    "page_transfer",
    "pitched_count",
]

# thread blocks of the kernel's half: steady beside a decode where 4 are not (see above)
BLOCKS = 2
# the pitched share where the table has none for a shape (the measured balance for 4 KiB runs)
FALLBACK_SHARE = 0.4
# fractions of the balanced share the table times for each shape, keeping the fastest
SHARE_TRIALS = (0.0, 0.55, 0.7, 0.85, 1.0)

# kernel(first, end): the kernel for pages [first, end) of the transfer, on the current stream
Kernel = Callable[[int, int], None]

_side: dict[int, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def balanced_share(kernel_seconds: float, pitched_seconds: float) -> float:
    """The share of the pages for the pitched copy at which both halves end together, given the
    seconds each takes alone for the whole transfer; nan when either is not a positive number."""
    if not (kernel_seconds > 0 and pitched_seconds > 0):
        return math.nan
    if math.isinf(kernel_seconds) or math.isinf(pitched_seconds):
        return math.nan
    return kernel_seconds / (kernel_seconds + pitched_seconds)


def pitched_count(n: int, share: float) -> int:
    """Pages of ``n`` the pitched copy takes at ``share`` (in [0, 1])."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share!r}")
    return round(n * share)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index or 0
    with _side_lock:
        stream = _side.get(index)
        if stream is None:
            stream = _side[index] = torch.cuda.Stream(device)
        return stream


def page_transfer(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    slots: torch.Tensor,
    share: float,
    kernel: Kernel,
) -> bool:
    """All layers of pages ``ids`` (CPU int64 ``[n]``) of ``host`` to (``load``) or from the
    caches' ``slots`` (CPU int64 ``[n, page_size]``), split as the module docstring says and
    ordered on the current stream as a kernel launch there would be. Returns True when the
    pitched copy took its share (or had none), False when the kernel moved it instead.
    ``kv.layer_pitches`` must not be None."""
    n = ids.numel()
    dma = pitched_count(n, share)
    first = n - dma
    dev = kv.device
    main = torch.cuda.current_stream(dev)
    fork = main.record_event() if dma else None  # before the kernel's half: they overlap
    if first:
        kernel(0, first)
    if fork is None:
        return True
    side = _side_stream(dev)
    side.wait_event(fork)
    took = copy_engine.pitched_supported(dev.index or 0) and copy_engine.pitched_transfer(
        lib, load, host, kv, ids[first:], slots[first:], side.cuda_stream
    )
    if not took:
        with torch.cuda.stream(side):
            kernel(first, n)
    main.wait_event(side.record_event())
    return took
