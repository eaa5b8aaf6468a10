"""The copy-engine backend: a page transfer as batched DMA copies (``csrc/copy_engine.cu``).

The GPU's copy engines move the bytes, so no SM is taken from the model running beside the
transfer (the kernels take 4-8 thread blocks and, measured beside a graph-captured decode, cost
it far more than a DMA copy of the same bytes: docs/benchmarks.md). Descriptors are built on the
host from CPU page ids and slots: one 1-D copy per run of consecutive slots and (layer, K/V),
split over ``LANES`` streams ordered after the caller's stream and joined back to it by events
for an all-layer transfer; a one-layer transfer's go on ``LAYER_LANES`` (one: the caller's
stream), since the engines take each stream's driver call in turn at a fixed cost (the library
picks one of the two by the layers a call moves).

Two forms. Batched 1-D copies (:func:`page_transfer`): on the H200 (docs/benchmarks.md, "Copy
engine") over 16 streams 0.96-0.99 of the pinned contiguous copy for runs >= 64 KiB, 0.63-0.97
from one run to the next at 32-36 KiB (one layer on one stream: 0.93-0.99 of the copy in device
time from 4 MiB a layer for 32-36 KiB runs, 0.78-0.97 for 18 KiB), collapsing (0.04-0.2) below
~28 KiB, where each copy's fixed cost (~1.4 us of engine time) outweighs its bytes. Its host
cost grows with the copies: ~0.5-1 us each (a call of many copies is sent from
``ENQUEUE_THREADS`` threads, each its own streams), and the call waits for the engines once
the driver's queue is full, so the calling thread is held for most of a transfer of 32 KiB
runs: ``auto`` (:mod:`.copy_table`) takes it on the caller's thread only where its measured
host time stays within the kernel's, and elsewhere only where a thread of the connector's own
issues it (:mod:`pagekv.connector.copy_issuer`), never for runs under
``ops.COPY_ENGINE_MIN_RUN`` (``ops.DEFERRED_COPY_ENGINE_MIN_RUN`` where the issuer enqueues
it). Pitched copies
(:func:`pitched_transfer`, the ``pitched`` backend): where each K/V's layers lie at one distance
(:attr:`~.layout.DeviceKV.layer_pitches`), all layers of a run are one 2-D copy, whose cost is
per row (~45 ns), so small runs stay on the DMA engines (H200: 0.47 / 0.65-0.69 / 0.78-0.89 /
0.87 of the copy for runs of 4 / 8 / 16-18 / 32 KiB); ~1-2.5 us of host time per copy, on the
caller's stream.

Availability is found at run time: the library must be built with CUDA >= 12.8 and the driver
must be >= 12.8 (:func:`supported`). A call the driver refuses is logged once and the device
uses the kernel from then on (:func:`page_transfer` returns False and the caller runs the
kernel): with one descriptor form and batches already split in halves on an invalid-value
refusal, a refusal is not a property of one shape.

Ownership: page ids and slots are read during the call; the host pages and device slots are
read by the DMA engines later, in stream order, so the caller keeps them valid until an event
recorded on the caller's stream after the call has completed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import weakref
from typing import Any

import torch

from . import layout
from .jit import layer_entries
from .layout import DeviceKV

__all__ = [
    "LANES",
    "ENQUEUE_THREADS",
    "ENQUEUE_THREAD_COPIES",
    "LAYER_LANES",
    "DeviceEvent",
    "Progress",
    "disabled_reason",
    "page_transfer",
    "page_transfer_layers",
    "pitched_supported",
    "pitched_transfer",
    "run_bytes",
    "slot_runs",
    "supported",
]

log = logging.getLogger(__name__)

# cudaMemcpyFlagPreferOverlapWithCompute: a hint to keep the copy off the SMs (CUDA >= 13.1
# drivers honour it for batched copies; 13.0 ignores it: same speed either way on the H200).
FLAGS = 1
# Streams the copies of one call are split over, so several copy engines work at once (H200,
# all-layer 256 MiB: runs of 32-36 KiB 0.93-0.94 of the bus on 4 streams, 0.95-0.97 on 8, 0.97
# on 16; runs >= 64 KiB 0.98-0.99 on 4-16).
LANES = 16
# ... and those of a one-layer transfer: the engines take a stream's driver calls in turn at a
# few us each, a fixed cost per layer that 16 calls make the bound (H200, layer by layer, 32
# layers of 4 MiB, 32-128 KiB runs, device time: 0.60-0.64 of the bus on 16 streams, 0.75-0.77
# on 8, 0.84-0.88 on 4, 0.91-0.92 on 2, 0.94-1.02 on 1; scripts/diag_ce_layers.py)
LAYER_LANES = 1
# Host threads that send one call's copies (each its own streams; a one-layer call then takes a
# stream a thread), one per ENQUEUE_THREAD_COPIES copies of the call: the driver takes ~0.5-1 us
# of the sending thread per copy, about a 32 KiB copy's bus time, so one thread sets the rate of
# short runs (H200, 32 KiB runs, 4 GiB layer by layer: 34.3-42.9 GB/s from one thread, 49.0-52.2
# from two; 1 GiB: 32.3-52.8 against 42.1-50.4; scripts/diag_ce_layer_threads.py), and a helper
# costs ~20-50 us to start. Three or four threads move no more: the driver then takes ~0.5 us a
# copy whatever their number (one all-layer call of 256 MiB, 32-36 KiB runs: 0.67-0.88 of the
# copy from one thread, 0.84-0.87 from two, 0.82-0.87 from three or four). A layer-by-layer
# call (:func:`page_transfer_layers`) of one-layer entries spreads them over the threads instead
# (whole layers in turn, each thread a stream), one more for every ENQUEUE_THREAD_COPIES copies
# of the whole call: a layer of under 2 x ENQUEUE_THREAD_COPIES copies would be one thread's
# (Llama-3-8B 16-token pages through the issuer, 32 layers of 4 MiB: 0.53 of the copy from one
# thread, 0.79 spread; docs/benchmarks.md).
ENQUEUE_THREADS = 2
ENQUEUE_THREAD_COPIES = 512
# Descriptors per driver call; a call the driver refuses as invalid is split in halves.
MAX_OPS = 16384

_failed: dict[int, str] = {}
_pitched_failed: dict[int, str] = {}
# [descriptors sent, driver calls split after a refusal, streams used, threads that sent] of the
# last call
last_stats: tuple[int, int, int, int] = (0, 0, 0, 0)
_lock = threading.Lock()


def slot_runs(kv: DeviceKV, slots: torch.Tensor) -> tuple[int, int]:
    """:func:`~.layout.slot_runs` of a CPU slot table (the runs: the copy engine's copies of
    each layer and K/V), counted by the library when it is loaded (the torch count costs ~10
    small tensor ops per call, which a layer-by-layer load pays for every layer)."""
    from .jit import load_library

    lib = load_library() if kv.slot_stride_bytes == kv.geometry.item_bytes else None
    if lib is not None and slots.dtype == torch.int64 and slots.is_contiguous():
        out = (ctypes.c_int64 * 2)()
        if lib.pagekv_slot_runs(slots.data_ptr(), slots.shape[0], slots.shape[1], out) == 0:
            return out[0], out[1]
    return layout.slot_runs(kv, slots)


def run_bytes(kv: DeviceKV, slots: torch.Tensor) -> float:
    """The mean bytes of one copy: the valid slots' bytes over :func:`slot_runs`' runs."""
    tokens, runs = slot_runs(kv, slots)
    return kv.geometry.item_bytes * tokens / max(runs, 1)


@functools.cache
def _support(device: int) -> int:
    from .jit import load_library

    lib = load_library()
    return int(lib.pagekv_copy_engine_support(device)) if lib is not None else 0


def supported(device: int) -> bool:
    """True when batched copies can run on ``device`` and none has failed there."""
    return device not in _failed and _support(device) > 0


def failed_reason(device: int) -> str | None:
    """What stopped batched or pitched copies on ``device`` in this process, where a call
    failed (None where none has: either is in use, or the driver has no batched copies)."""
    with _lock:
        why = [f"{kind} ({failed[device]})" for kind, failed
               in (("batched copies", _failed), ("pitched copies", _pitched_failed))
               if device in failed]  # fmt: skip
    return " and ".join(why) or None


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
) -> bool:
    """Issue the transfer on the copy engines, ordered on ``stream`` (a raw cudaStream_t) as a
    kernel launch there would be. ``ids`` ``[n]`` and ``slots`` ``[n, page_size]`` are CPU int64
    contiguous tensors. Returns False, after one log line for the device, when the driver
    refused the call: nothing of it may be relied on and the caller runs the kernel."""
    stats = (ctypes.c_int64 * 4)()
    err = lib.pagekv_ce_page_transfer(
        *_transfer_args(load, host, kv, ids, slots), layer_begin, layer_count, FLAGS, LANES,
        LAYER_LANES, ENQUEUE_THREADS, ENQUEUE_THREAD_COPIES, MAX_OPS, stream, stats,
    )  # fmt: skip
    return _report(err, stats, load, kv, ids)


def page_transfer_layers(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    slots: torch.Tensor,
    layers: list[int | None],
    events: list[torch.cuda.Event],
    stream: int,
    progress: Progress | None = None,
) -> int:
    """:func:`page_transfer` once per entry of ``layers`` (a layer, or None for all), in order,
    ``events[i]`` recorded after entry ``i`` (and completing only once entries ``0..i`` have):
    all in one library call, which spreads entries of one layer each over ``ENQUEUE_THREADS``
    threads where the call's copies are worth a helper (the first thread's on ``stream``, each
    other's on a side stream forked from it and joined back to it). Returns how
    many entries were issued and recorded; fewer than ``len(layers)`` (after one log line for the
    device) when the driver refused a call: the caller runs the rest on the kernel. The events
    must exist (torch creates a CUDA event at its first ``record``). With ``progress`` (none of
    its entries counted yet) ``events`` are ``progress.events`` (made by the library), ``stream``
    first waits on ``progress.fork``, and each entry is counted as its event is recorded."""
    if progress is None:
        which, handles = layer_entries(layers, events)
        fork, done = None, ctypes.c_int(0)
    else:
        which, _ = layer_entries(layers, [])
        handles, fork, done = progress.handles, progress.fork.cuda_event, progress.cell
    stats = (ctypes.c_int64 * 4)()
    err = lib.pagekv_ce_page_transfer_layers(
        *_transfer_args(load, host, kv, ids, slots), which, len(layers), handles, FLAGS, LANES,
        LAYER_LANES, ENQUEUE_THREADS, ENQUEUE_THREAD_COPIES, MAX_OPS, stream, fork, stats,
        ctypes.byref(done),
    )  # fmt: skip
    _report(err, stats, load, kv, ids)
    return done.value & ~Progress.ENDED


class _Events:
    """CUDA events the library makes (no timing), by handle (null until made), destroyed with
    this object (CUDA frees one still pending once the device has passed it)."""

    def __init__(self, lib: ctypes.CDLL, lib_gil: ctypes.CDLL, device: int, count: int) -> None:
        self.lib, self.lib_gil, self.device = lib, lib_gil, device
        self.handles = (ctypes.c_void_p * count)()
        weakref.finalize(self, lib.pagekv_events_destroy, self.handles, count)


class DeviceEvent:
    """One of a :class:`Progress`'s events, with the part of ``torch.cuda.Event`` consumers use
    (``record``, ``wait``, ``query``, ``synchronize``, ``cuda_event``). Like torch's, one never
    recorded is done and waiting on it orders nothing."""

    __slots__ = ("_entry", "_set")

    def __init__(self, events: _Events, entry: int) -> None:
        self._set, self._entry = events, entry

    @property
    def cuda_event(self) -> int:
        return self._set.handles[self._entry] or 0

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        e = self._set
        if not self.cuda_event:
            slot = ctypes.byref(e.handles, self._entry * ctypes.sizeof(ctypes.c_void_p))
            _check(e.lib.pagekv_events_create(e.device, slot, 1), "create")
        _check(e.lib.pagekv_event_record(self.cuda_event, self._stream(stream)), "record")

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        if self.cuda_event:
            err = self._set.lib.pagekv_stream_wait_event(self._stream(stream), self.cuda_event)
            _check(err, "wait")

    def query(self) -> bool:
        if not self.cuda_event:
            return True
        err = self._set.lib_gil.pagekv_event_query(self.cuda_event)
        if err == _NOT_READY:
            return False
        _check(err, "query")
        return True

    def synchronize(self) -> None:
        if self.cuda_event:
            _check(self._set.lib.pagekv_event_synchronize(self.cuda_event), "synchronize")

    def _stream(self, stream: torch.cuda.Stream | None) -> int:
        return (stream or torch.cuda.current_stream(self._set.device)).cuda_stream


_NOT_READY = 600  # cudaErrorNotReady


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"CUDA event {what} failed: cudaError {err}")


class Progress:
    """How many entries of a layer-by-layer transfer are enqueued, counted where they are: the
    library stores the count as it records each entry's event, during its call, and wakes the
    threads waiting on it (:meth:`wait` sleeps in the library: no GIL held, none needed by the
    thread that counts). So a consumer of entry ``i`` is handed ``events[i]`` as soon as the
    call has enqueued it, even while the thread that made the call waits for the GIL. The
    events are :class:`DeviceEvent` s, made by the library in that call, and the call first
    orders the transfer after ``fork``: the thread that makes it calls nothing before it that
    gives up the GIL (each such call costs it up to the switch interval beside a thread running
    Python).

    Rules: the count only grows, entries in order; the library counts the entries it enqueues,
    :meth:`publish` those enqueued another way (whose owner hands their events over before it
    publishes them); :meth:`end` marks that no more will come (the job returned or failed) and
    wakes every waiter. Entry ``i``'s event may be used once it is counted. Owner: whoever
    submits the transfer (the connector's issuer, one per job); it outlives the library call,
    which writes :attr:`cell` and :attr:`handles`; the events are destroyed with it (CUDA frees
    one still pending once the device has passed it)."""

    ENDED = 1 << 30  # the count's end bit (csrc/copy_engine.cu: pagekv_progress_*)

    def __init__(self, lib: ctypes.CDLL, lib_gil: ctypes.CDLL, device: torch.device,
                 entries: int, fork: torch.cuda.Event) -> None:  # fmt: skip
        self.lib, self.lib_gil, self.fork = lib, lib_gil, fork
        self.cell = ctypes.c_int(0)
        made = _Events(lib, lib_gil, device.index or 0, entries)
        self.handles = made.handles
        self.events = [DeviceEvent(made, i) for i in range(entries)]

    def count(self) -> int:
        """Entries counted so far."""
        return self._peek() & ~self.ENDED

    def counted(self, entry: int) -> bool:
        """Entry ``entry`` is enqueued (its event recorded)."""
        return self.count() > entry

    def wait(self, entry: int) -> bool:
        """Sleep until entry ``entry`` is counted (True) or the count has ended (False)."""
        while True:
            # wakes now and then, so that signals reach the caller
            value = self.lib.pagekv_progress_wait(ctypes.byref(self.cell), entry + 1, 100_000)
            if value & ~self.ENDED > entry:
                return True
            if value & self.ENDED:
                return False

    def publish(self, entries: int) -> None:
        """Entries ``[0, entries)`` are enqueued; wakes the waiters."""
        self.lib_gil.pagekv_progress_publish(ctypes.byref(self.cell), entries)

    def end(self) -> None:
        self.publish(self.count() | self.ENDED)

    def _peek(self) -> int:
        return self.lib_gil.pagekv_progress_wait(ctypes.byref(self.cell), 1 << 30, 0)


def pitched_transfer(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    slots: torch.Tensor,
    stream: int,
) -> bool:
    """All layers of the transfer as one 2-D copy per (run of slots in a page, K/V), a row per
    layer, on ``stream`` itself (``kv.layer_pitches`` must not be None): the copy engines' cost is
    per row there, not per copy, so runs under 32 KiB move at 0.6-0.9 of the bus on them where
    batched 1-D copies move 0.05-0.4. ``ids`` and ``slots`` as :func:`page_transfer`'s. Returns
    False, after one log line for the device, when the call failed: nothing of it may be relied
    on, the caller runs the kernel, and the device takes the kernel for it from then on."""
    pitches = kv.layer_pitches
    if pitches is None:
        raise ValueError("the pitched copy needs each K/V's layers at one distance")
    stats = (ctypes.c_int64 * 4)()
    args = _transfer_args(load, host, kv, ids, slots)
    err = lib.pagekv_pitched_page_transfer(
        *args[:4], (ctypes.c_int64 * len(pitches))(*pitches), *args[4:], stream, stats,
    )  # fmt: skip
    return _report(err, stats, load, kv, ids, "pitched copy-engine", _pitched_failed)


def pitched_supported(device: int) -> bool:
    """True unless a pitched copy has failed on ``device``."""
    return device not in _pitched_failed


def _transfer_args(
    load: bool, host: torch.Tensor, kv: DeviceKV, ids: torch.Tensor, slots: torch.Tensor
) -> tuple[Any, ...]:
    """The arguments both library entries start with: device, direction, buffers, geometry."""
    geo = kv.geometry
    return (kv.device.index or 0, int(load), host.data_ptr(), kv.layer_ptr_array,
            ids.data_ptr(), slots.data_ptr(), ids.numel(), host.shape[0], kv.num_slots,
            geo.page_bytes, kv.slot_stride_bytes, geo.item_bytes, geo.page_size, geo.num_kv,
            geo.num_layers)  # fmt: skip


def _report(
    err: int,
    stats: Any,
    load: bool,
    kv: DeviceKV,
    ids: torch.Tensor,
    form: str = "copy-engine",
    failed: dict[int, str] | None = None,
) -> bool:
    """Keep a call's ``stats`` in :data:`last_stats`; True when it succeeded, else False after
    the device's first failure of this ``form`` is kept in ``failed`` (None: the batched
    copies', as :func:`fail`) and said once."""
    global last_stats
    last_stats = (stats[0], stats[1], stats[2], stats[3])
    if err == 0:
        return True
    why = (f"{form} {'load' if load else 'save'} failed with cudaError {err} "
           f"({stats[0]} copies sent of {ids.numel()} pages)")  # fmt: skip
    _say_once(_failed if failed is None else failed, kv.device.index or 0, why)
    return False


def fail(device: int, why: str) -> None:
    """Stop using the copy engine's batched copies on ``device`` and say so once."""
    _say_once(_failed, device, why)


def _say_once(failed: dict[int, str], device: int, why: str) -> None:
    with _lock:
        if device in failed:
            return
        failed[device] = why
    log.warning("pagekv: %s on cuda:%d; transfers there use the kernel from now on", why, device)
