"""The staged backend: an all-layer transfer as whole host pages moved by the copy engines
through a device staging ring, and the transfer kernel moving them between the ring and the
layer-first slots at device-memory speed.

Why: the copy engine moves one run of consecutive slots per (layer, K/V) as one copy, and runs
under ~64 KiB (TP-8 slices, MLA-576 and small pages) leave it at 0.05-0.7 of the bus; the kernel
reads host memory over PCIe with its thread blocks for the whole transfer and reaches ~0.91.
A host page is contiguous (page-first layout), so moving whole pages takes one copy per page
(256 KiB-16 MiB for the standard geometries) at the copy engines' full rate, and the kernel then
only scatters (loads) or gathers (saves) device memory, ~10x faster than the bus: a few thread
blocks for a small share of the transfer's time instead of the whole of it.

Pipeline, per call, in chunks of at most :data:`CHUNK_BYTES` of pages: chunk ``c`` uses ring
buffer ``c % BUFFERS``; its pages are split over the ring's ``LANES`` copy streams, each of
which carries its share of every chunk back to back (no join between chunks, so the engines
never wait for a chunk's slowest share). A load copies on the lanes and scatters on the
caller's stream, so the copies of the next chunk overlap the scatter of this one; a save
gathers on the caller's stream and copies out on the lanes. Every ordering is on the GPU
(events), none on the host:

* a load's copies start after the caller's stream's earlier work (each lane waits on it); a
  save's copies to the host pages complete before the caller's stream's later work (it waits on
  each lane at the end): the call is ordered on the caller's stream like a kernel;
* a buffer is overwritten only after every earlier user of it has run (events recorded after
  each scatter or gather on the caller's stream and after each lane's copies), whichever call,
  direction and stream that was.

Ownership: page ids and slots are CPU tensors read during the call (the slots are uploaded on
the caller's stream); the caller keeps the host pages valid until an event recorded on its
stream after the call completes, as for a kernel launch. The ring (``BUFFERS`` buffers of
``max(CHUNK_BYTES, page bytes)`` of device memory per device, sized and allocated at its first
use: 32 MiB for pages up to 16 MiB) and its streams belong to this module; one lock per device
orders the calls that use it. A later geometry whose page does not fit takes the kernel.

Bounds: a page id out of range skips its page. A load skips tokens whose slot is out of range
(the kernel's rule). A save with any token skipped takes the kernel instead (:func:`page_transfer`
returns False): a whole-page copy would overwrite the host bytes of the skipped tokens, which
the other backends leave as they were. One-layer transfers are not staged (a layer's rows in a
host page are not contiguous across pages).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

from . import copy_engine
from .layout import DeviceKV

__all__ = ["BUFFERS", "CHUNK_BYTES", "page_transfer"]

# bytes of pages per chunk, and of each ring buffer (its size at the ring's creation): a chunk's
# copy (~0.3 ms at 55 GB/s) hides the scatter of the chunk before it
CHUNK_BYTES = 16 << 20
BUFFERS = 2
LANES = 4  # streams a chunk's page copies are split over (pages are >= 256 KiB)
SCATTER_BLOCKS = 8

# (load, device address of the page-first buffer, its pages, page ids, slots) -> cudaError:
# the transfer kernel on the current stream, all layers (ops passes it).
Kernel = Callable[[bool, int, int, torch.Tensor, torch.Tensor], int]


class _Ring:
    """One device's staging buffers, copy streams and the events that order their reuse."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.lock = threading.Lock()
        self.lanes = [torch.cuda.Stream(device) for _ in range(LANES)]
        with torch.cuda.stream(self.lanes[0]):
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device)
                            for _ in range(BUFFERS)]  # fmt: skip
        # per buffer: after the scatter or gather on the caller's stream (one), and after each
        # lane's copies (one per lane)
        self.on_caller = [torch.cuda.Event() for _ in range(BUFFERS)]
        self.on_lane = [[torch.cuda.Event() for _ in range(LANES)] for _ in range(BUFFERS)]
        self.saved = [False] * BUFFERS  # whether a save used the buffer last
        self.turn = 0
        self._aranges: dict[int, torch.Tensor] = {}

    def arange(self, n: int) -> torch.Tensor:
        """Device ids 0..n-1, one tensor per chunk length (a geometry), kept: launches on other
        streams read it."""
        t = self._aranges.get(n)
        if t is None:
            with torch.cuda.stream(self.lanes[0]):
                t = self._aranges[n] = torch.arange(n, dtype=torch.int64, device=self.device)
            self.lanes[0].synchronize()  # once per page count per process
        return t


_rings: dict[int, _Ring] = {}
_rings_lock = threading.Lock()


def _ring(device: torch.device, page_bytes: int) -> _Ring:
    index = device.index or 0
    with _rings_lock:
        ring = _rings.get(index)
        if ring is None:
            ring = _Ring(torch.device("cuda", index), max(CHUNK_BYTES, page_bytes))
            _rings[index] = ring
        return ring


def page_transfer(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    slots: torch.Tensor,
    kernel: Kernel,
) -> bool:
    """The all-layer transfer of host pages ``ids`` (CPU int64 ``[n]``) to (``load``) or from
    the device ``slots`` (CPU int64 ``[n, page_size]``), ordered on the current stream (module
    docstring). Returns False when it did nothing and the caller should run the kernel: a save
    with a skipped token, a page larger than a ring buffer, or a copy the driver refused (then,
    after one log line, the device uses the kernel from now on; a kernel rerun rewrites the
    same bytes)."""
    geo = kv.geometry
    valid = (ids >= 0) & (ids < host.shape[0])
    if not bool(valid.all()):
        ids, slots = ids[valid].contiguous(), slots[valid].contiguous()
    if not load and bool(((slots < 0) | (slots >= kv.num_slots)).any()):
        return False
    device = kv.device
    ring = _ring(device, geo.page_bytes)
    per = min(max(CHUNK_BYTES, geo.page_bytes), ring.nbytes) // geo.page_bytes
    if per == 0:
        return False
    n = ids.numel()
    if n == 0:
        return True
    caller = torch.cuda.current_stream(device)
    slots_d = slots.pin_memory().to(device, non_blocking=True)
    with ring.lock:
        local = ring.arange(per)
        if load:
            for lane in ring.lanes:
                lane.wait_stream(caller)
        try:
            return _chunks(lib, load, host, kv, ids, slots_d, ring, caller, local, kernel)
        finally:
            if not load:
                for lane in ring.lanes:
                    caller.wait_stream(lane)


def _chunks(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    slots_d: torch.Tensor,
    ring: _Ring,
    caller: torch.cuda.Stream,
    local: torch.Tensor,
    kernel: Kernel,
) -> bool:
    """The chunks of :func:`page_transfer`, under the ring's lock."""
    per, n = local.numel(), ids.numel()
    page = kv.geometry.page_bytes
    stats = (ctypes.c_int64 * 2)()
    for a in range(0, n, per):
        b = min(n, a + per)
        i = ring.turn
        ring.turn = (i + 1) % BUFFERS
        buf = ring.buffers[i].data_ptr()
        # each lane's share of the chunk: consecutive pages
        shares = [(a + (b - a) * k // LANES, a + (b - a) * (k + 1) // LANES) for k in range(LANES)]
        if not load:  # the gather overwrites the buffer: after every earlier user of it
            caller.wait_event(ring.on_caller[i])
            for k in range(LANES):
                caller.wait_event(ring.on_lane[i][k])
            err = kernel(False, buf, b - a, local[: b - a], slots_d[a:b])
            ring.on_caller[i].record(caller)
            if err != 0:
                break
        for k, (lo, hi) in enumerate(shares):
            if lo == hi:
                continue
            lane = ring.lanes[k]
            lane.wait_event(ring.on_caller[i])  # load: its last scatter; save: this gather
            if load and ring.saved[i]:  # the other lanes' copies out of the last save
                for other in range(LANES):
                    if other != k:
                        lane.wait_event(ring.on_lane[i][other])
            if not _copy(lib, load, host, ids[lo:hi], buf + (lo - a) * page, lane, kv, stats):
                return False
            ring.on_lane[i][k].record(lane)
            if load:
                caller.wait_event(ring.on_lane[i][k])
        ring.saved[i] = not load
        if load:
            err = kernel(True, buf, b - a, local[: b - a], slots_d[a:b])
            ring.on_caller[i].record(caller)
            if err != 0:
                break
    else:
        return True
    raise RuntimeError(f"pagekv staged {'load' if load else 'save'} failed: cudaError {err}")


def _copy(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    ids: torch.Tensor,
    staging: int,
    lane: torch.cuda.Stream,
    kv: DeviceKV,
    stats: ctypes.Array,
) -> bool:
    """Pages ``ids`` <-> the device buffer at ``staging`` on ``lane``; False (after
    :func:`copy_engine.fail`) when the driver refused the copies."""
    geo = kv.geometry
    err = lib.pagekv_ce_pages(
        kv.device.index or 0, int(load), host.data_ptr(), ids.data_ptr(), ids.numel(),
        host.shape[0], geo.page_bytes, staging, copy_engine.FLAGS, 1, copy_engine.MAX_OPS,
        lane.cuda_stream, stats,
    )  # fmt: skip
    if err == 0:
        return True
    copy_engine.fail(kv.device.index or 0, f"staged {'load' if load else 'save'} page copies "
                     f"failed with cudaError {err}")  # fmt: skip
    return False
