"""Host -> device load of a prefetch's leading pages while its later pages are still arriving
(``KVConnector.prefetch(..., device_slots=)``): the total is about the prefetch's time plus the
load of its last chunk, instead of prefetch time + load time.

When: :meth:`StreamingLoad.advance` is called on the connector's loop thread each time the run
of leading pages held by the prefetch grows (``_prefetch`` takes the pages in key order). Once
:func:`chunk_pages` pages wait, they are loaded in one launch; ``advance(final=True)`` loads the
rest when the prefetch ends with at least ``min_tokens`` (a prefetch that falls short of
``min_tokens`` launches nothing more). On CUDA each launch goes on the connector's load stream,
after (GPU-side) the caller's current stream as it was at the call and the pages' ready events
(device -> host copies still filling them); on CPU each chunk is copied synchronously, on the
loop thread.

Owns: a copy of the slot table taken at the call (the engine may reuse its tensor at once; a
CUDA table is cloned on the caller's stream), the index tensors of every launch (uploaded
through the connector's pinned staging ring on the load stream, or CPU tensors where ``auto``
takes the copy engine: :mod:`.transfer_indices`; kept referenced until this object is dropped,
like ``LayerLoad._keep``), and one CUDA event per launch, also appended to the
prefetch's ``loads``: :meth:`KVConnector.release` keeps the host pages until those copies are
done (contract 3). A launch the table gives the copy engine is enqueued by the connector's
issuer (its event a :class:`~.copy_issuer.Completion`), the others on the load stream, so no
single event covers them all: :meth:`wait` makes a stream wait on each, which the engine does
before reading *or writing* the slots in every case, since a prefetch that comes short
(deadline, miss, ``min_tokens``) may have launched chunks that are still landing.

Stopping: :meth:`stop` (a cancelled prefetch, a ``prefetch_sync`` past its timeout) makes
later ``advance`` calls do nothing; from then on the events are final.

Raises: :meth:`advance` raises what :func:`pagekv.kernels.load` raises (the prefetch then fails
and its pages are released after the chunks already launched). Slot validation is the
connector's (``_slot_table``), before this object exists.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pagekv.kernels import DeviceKV, load

from .copy_issuer import AllOf, CopyIssuer
from .handles import Prefetch
from .page_cache import PageCache
from .staging import IndexStaging
from .transfer_indices import launch

__all__ = ["CHUNK_BYTES", "CHUNK_PAGES", "StreamingLoad", "chunk_pages"]

# A chunk is launched once this many leading pages (or bytes) wait. What is left after the last
# page arrives is at most one chunk: 128 MiB is ~3 ms at the all-layer load's ~45 GB/s on the
# H100, about 1% of a 4 GiB prefetch (0.30 s), while a launch costs ~0.1 ms of the loop thread
# (index staging + ctypes), so 32 launches for 4 GiB take ~3 ms of CPU. Llama-3-8B pages (2 MiB)
# reach both limits at 64 pages; larger pages are cut by bytes, smaller ones by count (small
# launches run well below the bus's rate with LOAD_BLOCKS thread blocks).
CHUNK_PAGES = 64
CHUNK_BYTES = 128 << 20


def chunk_pages(page_bytes: int) -> int:
    """Leading pages that start a launch (see CHUNK_PAGES/CHUNK_BYTES), at least 1."""
    return max(1, min(CHUNK_PAGES, CHUNK_BYTES // max(page_bytes, 1)))


class StreamingLoad:
    """Loads a prefetch's leading pages into ``slots`` as they arrive (see module docstring).

    ``slots``: ``[num_keys, page_size]``, already validated (CPU) or the engine's CUDA tensor
    (out-of-range slots are then skipped by the kernels). ``stream``/``staging``: the
    connector's load stream and pinned ring (None on CPU). Created on the caller's thread.
    """

    def __init__(
        self,
        kv: DeviceKV,
        host: torch.Tensor,
        cache: PageCache,
        slots: torch.Tensor,
        stream: torch.cuda.Stream | None,
        staging: IndexStaging | None,
        issuer: CopyIssuer | None = None,
    ) -> None:
        self.kv, self.host, self.cache = kv, host, cache
        self.stream, self.staging, self.issuer = stream, staging, issuer
        self.chunk = chunk_pages(kv.geometry.page_bytes)
        self.loaded = 0  # leading pages whose copy has been launched (done, on CPU)
        self.chunks = 0  # launches
        self.events: list[torch.cuda.Event] = []
        self._keep: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.backend = "none"  # what the last launch used (kernel, copy_engine, ...)
        self._lock = threading.Lock()
        self._stopped = False
        self._start: torch.cuda.Event | None = None
        # a private copy: the engine may change or free its slot tensor once the call returns
        self._slots = slots.clone(memory_format=torch.contiguous_format)
        if stream is not None:
            caller = torch.cuda.current_stream(kv.device)
            if self._slots.is_cuda:  # cloned on the caller's stream, read on the load stream
                self._slots.record_stream(stream)
            self._start = torch.cuda.Event()
            self._start.record(caller)  # slots and earlier writes to them come first

    @property
    def done_event(self) -> AllOf | None:
        """Completes once every launched chunk is on the device (None on CPU or if none)."""
        with self._lock:
            return AllOf(self.events) if self.events else None

    def advance(self, prefetch: Prefetch, *, final: bool = False) -> None:
        """Launch the load of ``prefetch.page_ids[loaded:]`` if a chunk's worth waits (or any,
        with ``final``). Loop thread only; no host sync."""
        with self._lock:
            waiting = len(prefetch.page_ids) - self.loaded
            if self._stopped or waiting <= 0 or (not final and waiting < self.chunk):
                return
            self._launch(prefetch.page_ids[self.loaded :], prefetch.loads)
            self.loaded += waiting
            self.chunks += 1

    def _launch(self, page_ids: list[int], loads: list[Any]) -> None:
        slots = self._slots[self.loaded : self.loaded + len(page_ids)]
        if self.stream is None:
            self.backend = load(self.host, page_ids, self.kv, slots)
            return
        stream, dev = self.stream, self.kv.device
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            if self._start is not None:
                stream.wait_event(self._start)
                self._start = None
            for event in self.cache.ready_events(page_ids):
                stream.wait_event(event)
            out = launch(True, self.kv, self.host, page_ids, slots, self.staging, self.issuer)
            self.backend, done = out.backend, out.events[0]
        self._keep.append((out.indices.ids, out.indices.slots))
        self.events.append(done)
        loads.append(done)

    def stop(self) -> None:
        """No further launches (waits for one in progress)."""
        with self._lock:
            self._stopped = True

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait on every launched chunk; no host
        sync. Nothing to do on CPU, where the chunks were copied synchronously."""
        event = self.done_event
        if event is not None:
            event.wait(stream or torch.cuda.current_stream(self.kv.device))
