"""The staged backend: an all-layer transfer as whole-page DMA copies between the host pages and
a device staging buffer, and a kernel between that buffer and the layer-first caches.

A host page is contiguous over all its layers (page-first), so each page is one DMA run of
``page_bytes`` (256 KiB for a TP-8 slice of Llama-3-8B at 16 tokens, 1-40 MiB for the others),
which the copy engines move near the bus's rate whatever the page size, where the copy engine
on the caches' own runs (one per layer and K/V: 4-32 KiB for TP-8 pages) collapses and the
kernel reading host memory over PCIe tops out at ~0.92. The kernel's part runs device to
device on ``SCATTER_BLOCKS`` thread blocks, overlapped with the next chunks' copies.

Chunks of ``CHUNK_BYTES`` take turns over ``DMA_STREAMS`` streams (each chunk one copy call on
its stream: the streams keep the copy engines busy, and no chunk boundary waits for every
stream) and ``BUFFERS`` staging buffers; the last one to two chunks' pages of a load (the first
of a save) go in chunks halving down to ``TAPER_BYTES`` (:func:`chunks`), so that the one
kernel step no DMA overlaps is small. Measured (H200, 2026-11-28, ``scripts/diag_staged.py``,
all-layer loads / saves against the pinned contiguous copy, the shapes whose runs are 4-36 KiB:
TP-8 pages of 16-128 tokens, Llama-3-8B and MLA-576 at 16, MLA-576 at 32): at 256 MiB loads
0.907-0.958 and saves 0.876-0.952 (the kernel 0.911-0.940 / 0.930-0.939), at 1 GiB loads
0.959-0.973 and saves 0.885-0.962 (the kernel 0.923-0.936 / 0.942-0.946); TP-8 saves of 16 /
32-token pages stay at 0.88-0.89 / 0.90-0.93 (256 / 512 KiB device-to-host copies). The taper
against none: at 256 MiB loads higher for 5 of 7 shapes (median +0.015), saves for 7 of 7; at 1
GiB within +-0.013. 8 scatter blocks move as much as 64 from 1 GiB, 2 blocks 0.66-0.75.

The cost: every byte crosses device memory three times (the copy into the buffer, the kernel's
read of it and its write into the caches) instead of once. Beside a graph-captured decode
(memory-bound: 3.6 TB/s of weights) a 4 GiB load at 52-53 GB/s costs each step 1.7-2.3x the
extra time a plain contiguous copy of the same bytes costs (64, 8 or 4 scatter blocks; 2 blocks
1.1x, moving 40 GB/s), where the kernel costs 0.9-2.2x and the pitched copy 0.26-0.62x (H200,
scripts/bench_beside_compute.py, TP-8 and MLA-576 pages). So ``auto`` never takes it: it is
for a transfer that nothing runs beside (``backend="staged"`` or
``PAGEKV_COPY_BACKEND=staged``).

Per chunk ``k`` (buffer ``k % BUFFERS``, DMA stream ``k % DMA_STREAMS``):

* load: the DMA stream waits until the buffer is free, copies the chunk's host pages into it
  and marks it ready; the caller's stream waits for that and scatters the buffer into the slots
  (the kernel), then marks the buffer free. The caller's later work follows every scatter.
* save: the caller's stream waits until the buffer is free and gathers the slots into it,
  marking it ready; the DMA stream waits for that, copies the buffer into the host pages and
  marks it free. The caller's stream finally waits for every buffer's last copy.

Bounds are the kernels': a load skips pages whose id is out of range (their staging rows are
never scattered) and tokens whose slot is; a save with any index out of range is not staged
(the caller runs the kernel), because a whole-page copy would write the skipped tokens' host
bytes. All layers only: one layer of a page is not contiguous on the host.

Ownership: the staging buffers (``BUFFERS x CHUNK_BYTES``, 64 MiB, of device memory per device,
allocated on the first staged transfer and kept) belong to this module; transfers from several
threads are issued one at a time (a lock), and the events order every use of a buffer on the
GPU. The caller keeps the host pages, caches and index tensors valid until an event recorded on
its stream after the call has completed, as for a kernel launch.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import copy_engine
from .layout import DeviceKV, device_indices

__all__ = [
    "BUFFERS",
    "CHUNK_BYTES",
    "DMA_STREAMS",
    "RING_BYTES",
    "SCATTER_BLOCKS",
    "TAPER_BYTES",
    "chunks",
    "page_transfer",
]

CHUNK_BYTES = 16 << 20  # pages per DMA call and per kernel launch: at least one page
# streams each chunk's DMA call is split over (the copy-engine entry's lanes): 4 moved no more,
# loads or saves (nor did 8 DMA_STREAMS; scripts/diag_staged.py)
DMA_LANES = 1
BUFFERS = 4  # staging buffers of a chunk each, used in turn (at most RING_BYTES together)
RING_BYTES = 64 << 20
DMA_STREAMS = 4  # chunks in turn on these; the copy engines work on several at once
SCATTER_BLOCKS = 64
# the chunks at the end of a load (the start of a save) halve down to this, so the one kernel
# step no DMA overlaps (the last scatter, the first gather) moves this much; 0: no taper
TAPER_BYTES = 1 << 20
_MAX_PAGE_BYTES = (1 << 31) - 1  # the copy-engine entry takes a row's bytes as a C int

# kernel(load, staging pages, ids_d, slots_d, num_blocks): the page kernel between the staging
# buffer (as host pages) and the caches, on the current stream (given by ops)
Kernel = Callable[[bool, torch.Tensor, torch.Tensor, torch.Tensor, int], None]


@dataclass
class _Device:
    """A device's staging buffers, DMA streams and the events between them."""

    device: torch.device
    buffers: list[torch.Tensor] = field(default_factory=list)
    streams: list[torch.cuda.Stream] = field(default_factory=list)
    ready: list[torch.cuda.Event] = field(default_factory=list)
    free: list[torch.cuda.Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def buffers_for(self, page_bytes: int) -> int:
        """Pages per buffer for pages of ``page_bytes``. The buffers are made on first use and
        remade (after waiting for their last uses) when a page does not fit."""
        per = max(1, CHUNK_BYTES // page_bytes)
        count = max(2, min(BUFFERS, RING_BYTES // (per * page_bytes)))
        if not self.buffers or self.buffers[0].numel() < page_bytes:
            if self.buffers:
                for stream in self.streams:
                    stream.synchronize()
                torch.cuda.current_stream(self.device).synchronize()
            size = max(CHUNK_BYTES, page_bytes)
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device)
                            for _ in range(count)]  # fmt: skip
            self.ready = [torch.cuda.Event() for _ in range(count)]
            self.free = [torch.cuda.Event() for _ in range(count)]
        if not self.streams:
            self.streams = [torch.cuda.Stream(self.device) for _ in range(DMA_STREAMS)]
        return self.buffers[0].numel() // page_bytes


_devices: dict[int, _Device] = {}
_devices_lock = threading.Lock()


def _state(device: torch.device) -> _Device:
    with _devices_lock:
        state = _devices.get(device.index or 0)
        if state is None:
            state = _devices[device.index or 0] = _Device(device)
        return state


def chunks(n: int, per: int, min_per: int, load: bool) -> list[tuple[int, int]]:
    """``(first, end)`` of each chunk of ``n`` pages, at most ``per`` each. With a taper
    (``min_per < per``) the last ``per`` to ``2 * per`` pages go in halves down to ``min_per`` --
    at the end of a load, at the start of a save (the order reversed), where no DMA hides the
    kernel's step."""
    sizes: list[int] = []
    left = n
    while left >= (2 * per if min_per < per else per + 1):
        sizes.append(per)
        left -= per
    while left > min_per:
        take = max(min_per, left - left // 2)
        sizes.append(take)
        left -= take
    if left:
        sizes.append(left)
    if not load:
        sizes.reverse()
    bounds, first = [], 0
    for size in sizes:
        bounds.append((first, first + size))
        first += size
    return bounds


def _in_range(ids: torch.Tensor, slots: torch.Tensor, num_pages: int, num_slots: int) -> bool:
    if not ids.numel():
        return True
    ok_ids = int(ids.min()) >= 0 and int(ids.max()) < num_pages
    return ok_ids and int(slots.min()) >= 0 and int(slots.max()) < num_slots


def _dma(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    page_bytes: int,
    buffer: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    stream: torch.cuda.Stream,
) -> bool:
    """Whole pages ``ids`` of ``host`` <-> rows ``rows`` of ``buffer`` on the copy engines,
    ordered on ``stream`` alone, from this thread (no side lanes or helper threads: the chunks'
    streams take turns instead): the copy-engine entry with one "layer" whose token is a
    page."""
    stats = (ctypes.c_int64 * 4)()
    n_rows = buffer.numel() // page_bytes
    err = lib.pagekv_ce_page_transfer(
        buffer.device.index or 0, int(load), host.data_ptr(),
        (ctypes.c_int64 * 1)(buffer.data_ptr()), ids.data_ptr(), rows.data_ptr(), ids.numel(),
        host.shape[0], n_rows, page_bytes, page_bytes, page_bytes, 1, 1, 1, 0, 1,
        copy_engine.FLAGS, DMA_LANES, DMA_LANES, 1, copy_engine.ENQUEUE_THREAD_COPIES,
        copy_engine.MAX_OPS, stream.cuda_stream, stats,
    )  # fmt: skip
    if err == 0:
        return True
    copy_engine.fail(
        buffer.device.index or 0,
        f"staged {'load' if load else 'save'} DMA failed with cudaError {err}",
    )
    return False


def page_transfer(
    lib: ctypes.CDLL,
    load: bool,
    host: torch.Tensor,
    kv: DeviceKV,
    ids: torch.Tensor,
    slots: torch.Tensor,
    kernel: Kernel,
) -> bool:
    """All layers of pages ``ids`` (CPU int64 ``[n]``) of ``host`` to (``load``) or from the
    caches' ``slots`` (CPU int64 ``[n, page_size]``), ordered on the current stream as a kernel
    launch there would be. False when nothing was issued (no copy engine, a page too large, a
    save with an index out of range): the caller runs the kernel. Where the driver refuses a
    DMA midway, the chunks left go through ``kernel`` straight from the host pages."""
    geo, dev = kv.geometry, kv.device
    index = dev.index or 0
    page_bytes = geo.page_bytes
    if not copy_engine.supported(index) or page_bytes > _MAX_PAGE_BYTES:
        return False
    if not load and not _in_range(ids, slots, host.shape[0], kv.num_slots):
        return False
    n = ids.numel()
    if n == 0:
        return True
    st = _state(dev)
    with st.lock:
        per = st.buffers_for(page_bytes)
        main = torch.cuda.current_stream(dev)
        order = main.record_event()
        for stream in st.streams:
            stream.wait_event(order)
        min_per = max(1, TAPER_BYTES // page_bytes) if TAPER_BYTES else per
        bounds = chunks(n, per, min_per, load)
        rows = torch.cat([torch.arange(end - first, dtype=torch.int64) for first, end in bounds])
        rows_d = device_indices(rows.masked_fill((ids < 0) | (ids >= host.shape[0]), -1), dev)
        slots_d = device_indices(slots, dev)
        shape = (per, *geo.host_page_shape)
        for k, (first, end) in enumerate(bounds):
            b = k % len(st.buffers)
            staged = st.buffers[b][: per * page_bytes].view(geo.dtype).view(shape)
            stream = st.streams[k % len(st.streams)]
            if load:
                stream.wait_event(st.free[b])
                if not _dma(lib, True, host, page_bytes, st.buffers[b], ids[first:end],
                            rows[first:end, None], stream):  # fmt: skip
                    kernel(True, host, device_indices(ids[first:], dev), slots_d[first:], 0)
                    return True
                st.ready[b].record(stream)
                main.wait_event(st.ready[b])
                kernel(True, staged, rows_d[first:end], slots_d[first:end], SCATTER_BLOCKS)
                st.free[b].record(main)
            else:
                main.wait_event(st.free[b])
                kernel(False, staged, rows_d[first:end], slots_d[first:end], SCATTER_BLOCKS)
                st.ready[b].record(main)
                stream.wait_event(st.ready[b])
                if not _dma(lib, False, host, page_bytes, st.buffers[b], ids[first:end],
                            rows[first:end, None], stream):  # fmt: skip
                    kernel(False, host, device_indices(ids[first:], dev), slots_d[first:], 0)
                    break
                st.free[b].record(stream)
        if not load:
            for event in st.free:
                main.wait_event(event)
    return True
