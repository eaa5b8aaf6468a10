"""Transfers and the fused KV store: one function per operation, each dispatching to

* ``"kernel"``: the CUDA kernels (:mod:`.jit`), host memory read/written in place, on 4-8 SMs;
* ``"copy_engine"``: batched DMA copies (:mod:`.copy_engine`), no SMs; needs CUDA >= 12.8;
* ``"pitched"``: all layers as one 2-D DMA copy per run of slots and K/V, a row per layer
  (:func:`.copy_engine.pitched_transfer`), no SMs, on the caller's stream; where each K/V's
  layers lie at one distance (:attr:`.layout.DeviceKV.layer_pitches`); one layer, or layers at
  uneven distances, take the kernel;
* ``"direct"``: one ``cudaMemcpyAsync`` per run of consecutive slots (large pages);
* ``"split"``: all layers shared between the kernel on 2 thread blocks and the pitched copy side
  by side (:mod:`.split`; the pitched copy's share from the measured table, or ``dma_share``);
  where the pitched copy suits the caches; else the kernel;
* ``"staged"``: all layers as whole-page DMA copies through a device staging buffer and a
  device-side kernel (:mod:`.staged`); needs the copy engine; one layer takes the kernel; only
  when asked for (the setting or ``backend=``);
* ``"torch"``: the reference (:mod:`.reference`), used on CPU and when kernels are unavailable.

``backend="auto"`` picks: torch on CPU; else what ``PAGEKV_COPY_BACKEND`` (:mod:`.jit`) says.
With the setting ``auto`` (the default): the kernel when the page ids or slots are CUDA tensors
(the others build their copies on the host) or a CUDA graph is being captured; else the
backend the measured shapes around this one agree on in the table measured once for this GPU
(:mod:`.copy_table`): on the caller's thread only backends whose host time per call stays
within the kernel's (the connector's issuer thread lifts that bar for the DMA backends and
the split: ``deferred``), the faster DMA backend (the copy engine for runs of at least
``COPY_ENGINE_MIN_RUN``, the pitched copy for all layers of caches it suits) unless it is more
than 10% slower than the fastest (deferred: the copy engine from
``DEFERRED_COPY_ENGINE_MIN_RUN``, unless more than 50% slower: those transfers run beside the
engine's compute; then the split where the pitched copy suits the caches and it is within 50%
of the fastest: the kernel's share on 2 blocks costs a decode beside it steadily less than the
kernel on 4), else the fastest; never the staged backend (it costs a model running beside it
more: see :mod:`.staged`). Launches go on torch's current
stream and neither allocate nor synchronise, so kernel launches can be captured in a CUDA graph
(pass device index tensors and ``validate=False`` inside a capture).

``validate=True`` checks index values (range, repeats) before anything is written, which syncs
when the indices are CUDA tensors. ``validate=False`` keeps the shape/dtype/device checks; every
backend then skips (never writes) tokens whose page id or slot is out of range. ``copy_engine``,
``pitched``, ``split`` and ``direct`` asked for with CUDA index tensors copy them to the host
first (a sync).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from . import copy_engine, copy_table, reference, split, staged
from .jit import (
    PAGE_IDS64,
    PAGE_LOAD,
    PAGE_SLOTS64,
    PAGE_UNROLL8,
    KernelsUnavailable,
    copy_backend_setting,
    layer_entries,
    load_library,
)
from .layout import (
    DeviceKV,
    check_host,
    check_layer,
    check_page_ids,
    check_slots,
    check_unique_slots,
    device_indices,
)

__all__ = [
    "DIRECT_MIN_RUN_BYTES",
    "Backend",
    "choose_backend",
    "copy_slots",
    "load",
    "save",
    "table_candidates",
    "transfer_layers",
]

Backend = Literal["auto", "kernel", "copy_engine", "pitched", "direct", "split", "staged",
                  "torch"]  # fmt: skip
_BACKENDS = ("auto", "kernel", "copy_engine", "pitched", "direct", "split", "staged", "torch")
_CUDA_BACKENDS = ("kernel", "copy_engine", "pitched", "direct", "split", "staged")
ALL_LAYER_BACKENDS = ("pitched", "split", "staged")  # one layer takes the kernel
# Thread blocks for host<->device transfers: enough to reach the bus, leaving the SMs to the
# model (H100 measurements, docs/benchmarks.md). All-layer loads use 4: with 16 KiB page blocks
# at random host addresses 8-16 blocks reading over PCIe lost ~15% (address-translation
# misses, benchmarks/results/bench_kernels_tp8_unroll.json) while 4 held >= 0.90 everywhere.
# One-layer loads (smaller, latency-bound batches, which the forward waits for layer by layer)
# are best at 8. Saves use 4, all layers or one: writing to host memory, 8 blocks make a
# graph-captured decode beside them x1.10-x3.10 slower (all layers; one layer at a time
# x2.2-x2.5) and 4 x1.02-x1.92 (one layer: x1.02-x1.05), where alone 4 move as much on all
# layers (H200, 4 GiB of TP-8 pages: 52.3-52.4 GB/s both) and 0.85-0.98 of it one layer at a
# time (benchmarks/results/bench_beside_compute_save_blocks_*, ..._by_layer_*).
HOST_BLOCKS = 8
LOAD_BLOCKS = 4
LAYER_LOAD_BLOCKS = 8
SAVE_BLOCKS = 4
LAYER_SAVE_BLOCKS = 4
THREADS = 1024
UNROLL = 4  # chunks in flight per thread (kernels/csrc: kUnroll)
# page kernels: chunks in flight per thread, 4 or 8 (benchmarks/results: the block/unroll sweep)
UNROLL_LOAD = 4
UNROLL_SAVE = 4
# The direct memcpy backend beat the kernel from runs of this many bytes on the H100 (one
# memcpy each; docs/benchmarks.md, "direct backend"); auto now decides from the measured table.
DIRECT_MIN_RUN_BYTES = 4 << 20
# ``auto`` gives the copy engine no run shorter than this on the caller's thread: from 64 KiB its
# rate held 0.94-0.98 of the copy in every H200 run; runs of 32-36 KiB moved 0.96 in some runs
# and 0.63-0.74 in others (same shapes, other processes: docs/benchmarks.md), below 28 KiB
# 0.04-0.2. Transfers the connector's issuer enqueues (``deferred``) run beside the engine's
# compute, where even at 32 KiB it is faster than the kernel and costs the model a third of
# what the kernel does (copy_table's deferred slacks): their floor is 32 KiB.
COPY_ENGINE_MIN_RUN = 64 << 10
DEFERRED_COPY_ENGINE_MIN_RUN = 32 << 10
Index = torch.Tensor | Sequence[int]


def _vector_width(*values: int) -> int:
    """The widest access (16, 8 or 4 bytes) that divides every address and size in ``values``."""
    common = math.gcd(16, *values)  # a power of two, at most 16
    if common < 4:
        raise ValueError(f"addresses/sizes {values} are not 4-byte aligned")
    return common


@functools.cache
def _can_use_host_pointer(device: int) -> bool:
    lib = load_library()
    return bool(lib and lib.pagekv_can_use_host_pointer(device))


def _device_address(t: torch.Tensor, device: torch.device) -> int:
    """Address at which a kernel on ``device`` reaches ``t`` (device or pinned host memory)."""
    if t.is_cuda:
        if t.device != device:
            raise ValueError(f"tensor on {t.device}, transfer on {device}")
        return t.data_ptr()
    if not t.is_pinned():
        raise ValueError("host memory must be pinned (HostPagePool pins when CUDA is available)")
    return _reachable_address(t, device)


def _reachable(t: torch.Tensor, device: torch.device) -> bool:
    """``t`` is on ``device`` or in pinned host memory (one ``is_pinned``: ~1.5 us)."""
    return t.device == device if t.is_cuda else t.is_pinned()


def _reachable_address(t: torch.Tensor, device: torch.device) -> int:
    """:func:`_device_address` of a tensor :func:`_reachable` from ``device`` (not checked)."""
    if t.is_cuda or _can_use_host_pointer(device.index or 0):
        return t.data_ptr()
    out = ctypes.c_void_p()
    lib = load_library()
    if lib is None or lib.pagekv_host_device_pointer(t.data_ptr(), ctypes.byref(out)) != 0:
        raise RuntimeError("cudaHostGetDevicePointer failed for a pinned host buffer")
    return int(out.value or 0)


def current_stream(device: int | None) -> int:
    """Raw ``cudaStream_t`` of torch's current stream on ``device`` (cheap: no Stream object)."""
    index = torch.cuda.current_device() if device is None else device
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter(index)
    return torch.cuda.current_stream(index).cuda_stream


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")


def _kernel_lib(backend: str, cuda_ok: bool, why_not: str) -> ctypes.CDLL | None:
    """The library if this call should use it; None for the torch path; raises if the caller
    asked for a CUDA backend that cannot run."""
    if backend == "torch":
        return None
    if not cuda_ok:
        if backend in _CUDA_BACKENDS:
            raise ValueError(f"backend={backend!r} needs {why_not}")
        return None
    lib = load_library()
    if lib is None and backend in _CUDA_BACKENDS:
        raise KernelsUnavailable("CUDA kernels unavailable; see PAGEKV_KERNELS and the log")
    return lib


def _host_indices(ids: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU int64 contiguous ``ids``/``slots`` for the copy engine (which applies the kernels'
    bounds rule itself); as they are when they already are (no torch call: each gives up the
    GIL)."""
    return _host_int64(ids), _host_int64(slots)


def _host_int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64 and not t.is_cuda and t.is_contiguous():
        return t
    return t.to("cpu", torch.int64).contiguous()


def _direct_bounds(
    ids: torch.Tensor, slots: torch.Tensor, num_pages: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU int64 copies of ``ids``/``slots`` for the memcpy backend, with the kernels' bounds
    rule applied whatever ``validate`` said: a page id outside ``[0, num_pages)`` skips its page
    and a slot ``>= num_slots`` skips its token, so no index becomes a wild memcpy."""
    ids_h = ids.to("cpu", torch.int64).contiguous()
    s_h = slots.to("cpu", torch.int64).clone()
    bad_page = (ids_h < 0) | (ids_h >= num_pages)
    s_h[bad_page] = -1
    s_h[s_h >= num_slots] = -1
    return ids_h.clamp(0, max(num_pages - 1, 0)), s_h


def _auto_backend(
    load: bool,
    kv: DeviceKV,
    ids: torch.Tensor,
    s: torch.Tensor,
    layer: int | None,
    deferred: bool = False,
) -> str:
    """See the module docstring: the setting, else the kernel or the measured table."""
    setting = copy_backend_setting()
    if setting in ALL_LAYER_BACKENDS and layer is not None:
        return "kernel"  # they move all layers at once
    if setting in ("pitched", "split") and not _pitched_ok(kv):
        return "kernel"  # a row per layer, at one distance
    if setting != "auto":
        return setting
    if ids.device.type != "cpu" or s.device.type != "cpu" or not ids.numel():
        return "kernel"
    if torch.cuda.is_current_stream_capturing():
        return "kernel"
    device = kv.device.index or 0
    run = copy_engine.run_bytes(kv, s)
    allowed = table_candidates(run, layer is None, deferred, copy_engine.supported(device),
                               _pitched_ok(kv))  # fmt: skip
    return copy_table.calibrate(device).choose(_shape(load, kv, ids, layer, run), allowed,
                                               deferred)  # fmt: skip


def table_candidates(
    run: float, all_layers: bool, deferred: bool, copy_engine_ok: bool, pitched_ok: bool
) -> list[str]:
    """The backends ``auto`` lets the table choose among for a transfer of ``run``-byte runs:
    the kernel and direct copies; the copy engine where it works here and the runs reach its
    floor (``COPY_ENGINE_MIN_RUN``, deferred ``DEFERRED_COPY_ENGINE_MIN_RUN``); for all layers
    of caches at one pitch the pitched copy, and where deferred the split."""
    allowed = ["kernel", "direct"]
    floor = DEFERRED_COPY_ENGINE_MIN_RUN if deferred else COPY_ENGINE_MIN_RUN
    if copy_engine_ok and run >= floor:
        allowed.append("copy_engine")
    if all_layers and pitched_ok:
        allowed += ["pitched", "split"] if deferred else ["pitched"]
    return allowed


def _shape(
    load: bool, kv: DeviceKV, ids: torch.Tensor, layer: int | None, run: float
) -> copy_table.Shape:
    geo = kv.geometry
    rows = geo.num_layers * geo.num_kv if layer is None else geo.num_kv
    total = ids.numel() * geo.page_size * rows * geo.item_bytes
    return copy_table.Shape(load, layer is None, run, total)


def _pitched_ok(kv: DeviceKV) -> bool:
    """The pitched copy suits ``kv`` (its layers at one distance) and has not failed there."""
    return kv.layer_pitches is not None and copy_engine.pitched_supported(kv.device.index or 0)


def choose_backend(
    load: bool,
    kv: DeviceKV,
    page_ids: Index,
    slots: Index,
    *,
    layer: int | None = None,
    deferred: bool = False,
) -> str:
    """The backend ``backend="auto"`` takes for this transfer (see the module docstring):
    ``torch`` off CUDA, else from the setting, the index tensors' device and the measured
    table. Reads the indices' shapes and, when on the CPU, their values (no device sync; the
    first call on a device may measure the table: :func:`~.copy_table.calibrate`).

    A caller holding CPU indices (the connector) asks this first: for ``copy_engine`` and
    ``direct`` it passes them as they are (read during the call, no upload); for the others it
    uploads them and passes device tensors (capturable, nothing read on the host).
    ``deferred``: the caller enqueues copy-engine transfers on a thread of its own (the
    connector's issuer), so the copy engine's host time is not the caller's and does not bar
    it (:meth:`~.copy_table.CopyTable.choose`)."""
    check_layer(layer, kv.geometry.num_layers)
    ids = check_page_ids(page_ids, 0, unique=False, check_values=False)
    s = check_slots(slots, ids.numel(), kv.geometry.page_size, kv.num_slots, check_values=False)
    if kv.device.type != "cuda" or load_library() is None:
        return "torch"
    return _auto_backend(load, kv, ids, s, layer, deferred)


def _launch_shape(load: bool, kv: DeviceKV, host_addr: int) -> tuple[int, int, int]:
    """A page transfer kernel's access width, chunks in flight per thread and threads per
    block, for ``kv`` and host pages at ``host_addr``."""
    width = _vector_width(kv.alignment, host_addr)
    unroll = UNROLL_LOAD if load else UNROLL_SAVE
    threads = THREADS if unroll == 4 else THREADS // 2  # unroll 8: 512-thread blocks
    return width, unroll, threads


def _plan_args(
    load: bool,
    kv: DeviceKV,
    host_addr: int,
    host_pages: int,
    ids_d: torch.Tensor,
    s_d: torch.Tensor,
    unroll: int,
) -> tuple[int, ...]:
    """The arguments both page entries (``pagekv_page_plan_transfer``, ``..._layers``) start
    with: the cache's plan, the flags (direction, index widths, chunks in flight per thread),
    the host pages and the indices."""
    flags = ((PAGE_LOAD if load else 0) | (PAGE_IDS64 if ids_d.dtype == torch.int64 else 0)
             | (PAGE_SLOTS64 if s_d.dtype == torch.int64 else 0)
             | (PAGE_UNROLL8 if unroll == 8 else 0))  # fmt: skip
    return (kv.page_plan[1], flags, host_addr, host_pages, ids_d.data_ptr(), s_d.data_ptr(),
            ids_d.numel())  # fmt: skip


def _page_transfer(
    load: bool,
    host: torch.Tensor,
    page_ids: Index,
    kv: DeviceKV,
    slots: Index,
    layer: int | None,
    backend: str,
    num_blocks: int | None,
    validate: bool,
    dma_share: float | None = None,
) -> str:
    """:func:`load` or :func:`save`: the checks, the torch path and ``auto``'s choice; the CUDA
    backends in :func:`_cuda_page_transfer`. Returns the backend used."""
    geo = kv.geometry
    _check_backend(backend)
    check_host(geo, host)
    check_layer(layer, geo.num_layers)
    ids = check_page_ids(page_ids, host.shape[0], unique=not load, check_values=validate)
    s = check_slots(slots, ids.numel(), geo.page_size, kv.num_slots, check_values=validate)
    if load and validate:
        check_unique_slots(s)
    if num_blocks is not None and (
        isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0
    ):
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if dma_share is not None:
        split.pitched_count(0, dma_share)  # raises for a share outside [0, 1]
    host_ok = kv.device.type == "cuda" and _reachable(host, kv.device)
    lib = _kernel_lib(backend, host_ok, "CUDA caches and a pinned host")
    if lib is not None and backend == "auto":
        backend = _auto_backend(load, kv, ids, s, layer)
    if lib is None or backend == "torch":
        # Checked above when validate; else the reference checks (the torch path cannot skip
        # out-of-range indices the way the kernels do).
        if load and validate:
            reference.load_rows(host, ids, kv, s, layer)
        elif load:
            reference.load_ref(host, ids, kv, s, layer=layer)
        elif validate:
            reference.save_rows(kv, s, host, ids, layer)
        else:
            reference.save_ref(kv, s, host, ids, layer=layer)
        return "torch"
    return _cuda_page_transfer(lib, load, host, ids, kv, s, layer, backend, num_blocks,
                               dma_share)  # fmt: skip


def _default_blocks(load: bool, layer: int | None) -> int:
    if load:
        return LOAD_BLOCKS if layer is None else LAYER_LOAD_BLOCKS
    return SAVE_BLOCKS if layer is None else LAYER_SAVE_BLOCKS


def _cuda_page_transfer(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    ids: torch.Tensor,
    kv: DeviceKV,
    s: torch.Tensor,
    layer: int | None,
    backend: str,
    num_blocks: int | None,
    dma_share: float | None,
) -> str:
    """The transfer on ``backend`` (checked indices), on the current stream: a DMA backend
    that cannot take it (one layer where it moves all layers, caches it does not suit, a call
    the driver refused: said once per device) leaves it to the kernel."""
    stream = current_stream(kv.device.index)
    if backend == "split" and layer is None and _pitched_ok(kv):
        return _split_transfer(lib, load, host, ids, kv, s, num_blocks, dma_share)
    num_blocks = num_blocks or _default_blocks(load, layer)
    if backend in ("copy_engine", "staged", "pitched") and _dma_transfer(
        lib, backend, load, host, ids, kv, s, layer, num_blocks, stream
    ):
        return backend
    if backend == "direct":
        geo = kv.geometry
        l0, nl = (0, geo.num_layers) if layer is None else (layer, 1)
        ids_h, s_h = _direct_bounds(ids, s, host.shape[0], kv.num_slots)
        err = lib.pagekv_direct_page_transfer(
            kv.device.index, int(load), host.data_ptr(), kv.layer_ptr_array, ids_h.data_ptr(),
            s_h.data_ptr(), ids_h.numel(), geo.page_bytes, kv.slot_stride_bytes, geo.item_bytes,
            geo.page_size, geo.num_kv, geo.num_layers, l0, nl, stream,
        )  # fmt: skip
        if err != 0:
            what = "load" if load else "save"
            raise RuntimeError(f"pagekv direct {what} failed: cudaError {err}")
        return backend
    dev = kv.device
    _kernel_launch(lib, load, _reachable_address(host, dev), host.shape[0], kv,
                   device_indices(ids, dev), device_indices(s, dev), layer, num_blocks,
                   stream)  # fmt: skip
    return "kernel"


def _split_transfer(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    ids: torch.Tensor,
    kv: DeviceKV,
    s: torch.Tensor,
    num_blocks: int | None,
    dma_share: float | None,
) -> str:
    """All layers on the split backend (:mod:`.split`): the kernel's part on ``num_blocks``
    (default ``split.BLOCKS``), the pitched copy's share ``dma_share`` (default: the measured
    table's for this shape). Returns ``split``, or ``kernel`` where the pitched copy failed."""
    dev = kv.device
    ids_h, s_h = _host_indices(ids, s)
    if dma_share is None:
        shape = _shape(load, kv, ids_h, None, copy_engine.run_bytes(kv, s_h))
        dma_share = copy_table.calibrate(dev.index or 0).split_share(shape)
    host_addr = _reachable_address(host, dev)
    blocks = num_blocks or split.BLOCKS

    def kernel(first: int, end: int) -> None:  # on the current stream (the side one's too)
        _kernel_launch(lib, load, host_addr, host.shape[0], kv,
                       device_indices(ids_h[first:end], dev), device_indices(s_h[first:end], dev),
                       None, blocks, current_stream(dev.index))  # fmt: skip

    took = split.page_transfer(lib, load, host, kv, ids_h, s_h, dma_share, kernel)
    return "split" if took else "kernel"


def _dma_transfer(
    lib: ctypes.CDLL,
    backend: str,
    load: bool,
    host: torch.Tensor,
    ids: torch.Tensor,
    kv: DeviceKV,
    s: torch.Tensor,
    layer: int | None,
    num_blocks: int,
    stream: int,
) -> bool:
    """The transfer on the copy engine, the staged backend or the pitched copy, from host
    copies of the indices; False where the kernel must move it all (one layer for a backend
    that moves all layers at once, caches it does not suit, a call the driver refused: nothing
    of that call is relied on)."""
    index = kv.device.index or 0
    if backend == "copy_engine":
        if not copy_engine.supported(index):
            copy_engine.fail(index, copy_engine.disabled_reason(index) or "unavailable")
            return False
        ids_h, s_h = _host_indices(ids, s)
        l0, nl = (0, kv.geometry.num_layers) if layer is None else (layer, 1)
        return copy_engine.page_transfer(lib, load, host, kv, ids_h, s_h, l0, nl, stream)
    if layer is not None:
        return False  # the staged and the pitched copies move all layers at once
    if backend == "pitched":
        if not _pitched_ok(kv):
            return False
        ids_h, s_h = _host_indices(ids, s)
        return copy_engine.pitched_transfer(lib, load, host, kv, ids_h, s_h, stream)
    dev = kv.device

    def kernel(load_: bool, pages: torch.Tensor, ids_d: torch.Tensor, s_d: torch.Tensor,
               blocks: int) -> None:  # fmt: skip
        _kernel_launch(lib, load_, _device_address(pages, dev), pages.shape[0], kv, ids_d,
                       s_d, None, blocks or num_blocks, stream)  # fmt: skip

    ids_h, s_h = _host_indices(ids, s)
    return staged.page_transfer(lib, load, host, kv, ids_h, s_h, kernel)


def _kernel_launch(
    lib: ctypes.CDLL,
    load: bool,
    host_addr: int,
    host_pages: int,
    kv: DeviceKV,
    ids_d: torch.Tensor,
    s_d: torch.Tensor,
    layer: int | None,
    num_blocks: int,
    stream: int,
) -> None:
    """The page kernel for ``layer`` (None: all layers) of pages ``ids_d`` of the host pages at
    ``host_addr`` (``host_pages`` of them; pinned, or device memory, as the kernel reaches
    them) to/from slots ``s_d`` (device tensors), on ``num_blocks`` at most."""
    width, unroll, threads = _launch_shape(load, kv, host_addr)
    err = lib.pagekv_page_plan_transfer(
        *_plan_args(load, kv, host_addr, host_pages, ids_d, s_d, unroll),
        -1 if layer is None else layer, width, num_blocks, threads, stream,
    )  # fmt: skip
    if err != 0:
        raise RuntimeError(f"pagekv kernel {'load' if load else 'save'} failed: cudaError {err}")


def transfer_layers(
    load: bool,
    host: torch.Tensor,
    page_ids: Index,
    kv: DeviceKV,
    slots: Index,
    layers: Sequence[int | None],
    *,
    backend: Backend = "auto",
    enqueued: Callable[[list[torch.cuda.Event]], None] | None = None,
    progress: copy_engine.Progress | None = None,
) -> tuple[str, list[torch.cuda.Event]]:
    """:func:`load` (or :func:`save`) once per entry of ``layers`` (a layer, or None for all
    layers), in order on the current stream, with ``validate=False``; a CUDA event recorded
    after each. Returns the backend of the last entry and the events. The kernel, and the copy
    engine without ``progress``, issue the entries in two library calls, the first entry and
    then the rest (the copy engine's host time, ~0.5-1 us a copy, spent without the GIL; the
    kernel's ~5 us a layer), so the first entry's copies start before the host creates the
    others' events; where the
    driver refuses the copy engine, the entries left run on the kernel. ``enqueued`` (if
    given) is called with the events of the entries enqueued so far each time more are.
    ``progress`` (if given) brings the events (its :class:`~.copy_engine.DeviceEvent` s) and
    the fork event the entries come after (waited on here; the caller has not); on the copy
    engine the entries then go in one library call that waits on the fork, makes the events
    and counts each entry as it is enqueued, so a consumer of entry ``i``
    (:meth:`~.copy_engine.Progress.wait`) waits for the entries up to ``i`` to be enqueued,
    never for this thread to take the GIL back. CUDA only."""
    if not layers:
        return "none", []
    geo = kv.geometry
    for layer in layers:
        check_layer(layer, geo.num_layers)
    ids = check_page_ids(page_ids, host.shape[0], unique=not load, check_values=False)
    s = check_slots(slots, ids.numel(), geo.page_size, kv.num_slots, check_values=False)
    if progress is not None and len(progress.events) != len(layers):
        raise ValueError(f"{len(progress.events)} events for {len(layers)} entries")
    if backend == "auto":
        backend = _auto_backend(load, kv, ids, s, layers[0])
    events = progress.events if progress is not None else [torch.cuda.Event() for _ in layers]
    done = 0

    def published(n: int) -> None:  # entries [0, n) are enqueued
        if enqueued is not None:
            enqueued(events[:n])

    index = kv.device.index or 0
    if backend == "copy_engine" and copy_engine.supported(index):
        lib = _kernel_lib(backend, True, "")
        ids_h, s_h = _host_indices(ids, s)
        check_host(geo, host)
        stream = current_stream(index)
        if progress is not None:  # one call: the library waits on the fork, makes the events
            done = copy_engine.page_transfer_layers(lib, load, host, kv, ids_h, s_h, list(layers),
                                                    events, stream, progress)  # fmt: skip
            published(done)
        else:  # the first entry's copies run while the host creates the others' events (each
            # made by a record here, recorded again by the library after its entry)
            for first, end in [(0, 1), (1, len(layers))]:
                if first >= end:  # one entry: no second call
                    break
                for event in events[first:end]:
                    event.record()
                issued = copy_engine.page_transfer_layers(lib, load, host, kv, ids_h, s_h,
                                                          list(layers[first:end]),
                                                          events[first:end], stream)  # fmt: skip
                done += issued
                if issued < end - first:
                    break
                published(done)
        if done == len(layers):
            return "copy_engine", events
        backend = "kernel"  # said once per device by copy_engine.fail
    if progress is not None:  # waited on by the library call where it ran (again: harmless)
        torch.cuda.current_stream(kv.device).wait_event(progress.fork)
    if backend == "kernel":
        _kernel_layers(load, host, kv, ids, s, layers[done:], events[done:],
                       lambda n: published(done + n))  # fmt: skip
        return backend, events
    for k in range(done, len(layers)):
        backend = _page_transfer(load, host, ids, kv, s, layers[k], backend, None, False)
        events[k].record()
        published(k + 1)
    return backend, events


def _kernel_layers(
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    s: torch.Tensor,
    layers: Sequence[int | None],
    events: list[torch.cuda.Event],
    enqueued: Callable[[int], None],
) -> None:
    """The kernel once per entry of ``layers``, ``events[i]`` recorded after entry ``i``: the
    indices uploaded (when on the CPU) and the launch worked out once, then the entries in two
    library calls (the first, then the rest), a few us of host time per layer instead of a
    Python call's ~50; ``enqueued(n)`` after each, ``n`` the entries enqueued so far."""
    geo, dev = kv.geometry, kv.device
    check_host(geo, host)
    host_ok = dev.type == "cuda" and _reachable(host, dev)
    lib = _kernel_lib("kernel", host_ok, "CUDA caches and a pinned host")
    if lib is None:  # _kernel_lib raises first for "kernel"; kept for the type checker
        raise KernelsUnavailable("CUDA kernels unavailable; see PAGEKV_KERNELS and the log")
    ids_d, s_d = device_indices(ids, dev), device_indices(s, dev)
    host_addr = _reachable_address(host, dev)
    width, unroll, threads = _launch_shape(load, kv, host_addr)
    blocks_all, blocks_one = _default_blocks(load, None), _default_blocks(load, 0)
    args = _plan_args(load, kv, host_addr, host.shape[0], ids_d, s_d, unroll)
    stream_obj = torch.cuda.current_stream(dev)
    stream = stream_obj.cuda_stream

    def launch(first: int, end: int) -> None:
        for event in events[first:end]:  # created now: the library records it after its entry
            event.record(stream_obj)
        which, handles = layer_entries(layers[first:end], events[first:end])
        done = ctypes.c_int(0)
        err = lib.pagekv_page_plan_transfer_layers(
            *args, which, end - first, handles, width, blocks_all, blocks_one, threads, stream,
            ctypes.byref(done),
        )  # fmt: skip
        if err != 0:
            what = "load" if load else "save"
            raise RuntimeError(f"pagekv kernel {what} failed at entry {first + done.value} of "
                               f"{len(layers)}: cudaError {err}")  # fmt: skip

    # the first entry runs on the GPU while the host creates the others' events (~3 us each)
    launch(0, 1)
    enqueued(1)
    if len(layers) > 1:
        launch(1, len(layers))
        enqueued(len(layers))


def load(
    host: torch.Tensor,
    page_ids: Index,
    kv: DeviceKV,
    slots: Index,
    *,
    layer: int | None = None,
    backend: Backend = "auto",
    num_blocks: int | None = None,
    validate: bool = True,
    dma_share: float | None = None,
) -> str:
    """Page-first host pages -> layer-first device slots, all layers or only ``layer``.

    ``host``: pool buffer ``[num_pages, *geometry.host_page_shape]`` (pinned, or on the GPU);
    ``page_ids``: ``[n]``; ``slots``: ``[n, page_size]`` (negative = skip). Writes ``kv`` only,
    asynchronously on the current stream. Returns the backend used. ``num_blocks``: the
    kernel's thread blocks (default: 4 for all layers, 8 for one; the split's kernel part 2);
    ``dma_share``: the share of the pages the split backend gives the pitched copy (in [0, 1];
    default: the measured table's for this shape).
    """
    return _page_transfer(True, host, page_ids, kv, slots, layer, backend, num_blocks, validate,
                          dma_share)  # fmt: skip


def save(
    kv: DeviceKV,
    slots: Index,
    host: torch.Tensor,
    page_ids: Index,
    *,
    layer: int | None = None,
    backend: Backend = "auto",
    num_blocks: int | None = None,
    validate: bool = True,
    dma_share: float | None = None,
) -> str:
    """Layer-first device slots -> page-first host pages (each page id at most once).

    Writes ``host`` only, asynchronously on the current stream: synchronise (or record an
    event) before reading or sending the pages. Returns the backend used. ``num_blocks``: the
    kernel's thread blocks (default: 4, all layers or one; the split's kernel part 2);
    ``dma_share``: as :func:`load`'s.
    """
    return _page_transfer(False, host, page_ids, kv, slots, layer, backend, num_blocks, validate,
                          dma_share)  # fmt: skip


def copy_slots(
    src: DeviceKV,
    src_slots: torch.Tensor,
    dst: DeviceKV,
    dst_slots: torch.Tensor,
    *,
    layer: int | None = None,
    backend: Backend = "auto",
    num_blocks: int | None = None,
    validate: bool = True,
) -> str:
    """Layer-first -> layer-first: ``dst`` slot ``dst_slots[t]`` gets ``src`` slot
    ``src_slots[t]`` in every layer (or ``layer``). Device<->device or device<->pinned host;
    a negative index on either side skips the token. Writes ``dst`` only."""
    _check_backend(backend)
    if backend == "direct":
        raise ValueError("copy_slots has no direct backend; use 'kernel' or 'torch'")
    if src.geometry != dst.geometry:
        raise ValueError("src and dst caches have different geometries")
    geo = src.geometry
    check_layer(layer, geo.num_layers)
    n = src_slots.numel() if isinstance(src_slots, torch.Tensor) else len(src_slots)
    s = check_slots(src_slots, 1, n, src.num_slots, check_values=validate).view(-1)
    d = check_slots(dst_slots, 1, n, dst.num_slots, check_values=validate).view(-1)
    if validate:
        check_unique_slots(d)
    dev = src.device if src.device.type == "cuda" else dst.device
    sides_ok = all(t.device == dev or t.is_pinned() for t in (src.layers[0][0], dst.layers[0][0]))
    lib = _kernel_lib(backend, dev.type == "cuda" and sides_ok, "CUDA or pinned caches")
    if lib is None:
        reference.copy_slots_ref(src, s, dst, d, layer=layer)
        return "torch"
    src_ptrs = [_device_address(t, dev) for g in src.layers for t in g]
    dst_ptrs = [_device_address(t, dev) for g in dst.layers for t in g]
    width = _vector_width(geo.item_bytes, src.slot_stride_bytes, dst.slot_stride_bytes,
                          *src_ptrs, *dst_ptrs)  # fmt: skip
    both_on_device = src.device.type == dst.device.type == "cuda"
    if num_blocks is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        num_blocks = 2 * sms if both_on_device else HOST_BLOCKS
    l0, nl = (0, geo.num_layers) if layer is None else (layer, 1)
    chunks = n * geo.num_kv * nl * geo.item_bytes // width
    blocks = max(1, min(num_blocks, -(-chunks // (THREADS * UNROLL))))
    s_d, d_d = s.to(dev).contiguous(), d.to(dev).contiguous()
    tables = [
        kv.pointer_table(dev) if list(kv.layer_ptrs) == ptrs else torch.tensor(ptrs).to(dev)
        for kv, ptrs in ((src, src_ptrs), (dst, dst_ptrs))
    ]
    err = lib.pagekv_slot_copy(
        dev.index, tables[0].data_ptr(), tables[1].data_ptr(),
        s_d.data_ptr(), int(s_d.dtype == torch.int64), d_d.data_ptr(),
        int(d_d.dtype == torch.int64), n, src.num_slots, dst.num_slots, src.slot_stride_bytes,
        dst.slot_stride_bytes, geo.item_bytes, geo.num_kv, geo.num_layers, l0, nl, width, blocks,
        THREADS, current_stream(dev.index),
    )  # fmt: skip
    if err != 0:
        raise RuntimeError(f"pagekv copy_slots failed: cudaError {err}")
    return "kernel"
