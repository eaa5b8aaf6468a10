"""Pinned staging for index uploads (page ids, slot tables), allocated once.

A page-locked host allocation is an implicit device-wide synchronisation in CUDA (as is an
upload from pageable memory), so an engine-thread call that did ``tensor.pin_memory()`` or
``tensor.to("cuda")`` from ordinary memory could wait for every stream, the save and load
streams included. :class:`IndexStaging` owns one pinned buffer made at construction; each upload
takes a region of it in a ring, copies the indices in with the CPU, starts a ``non_blocking``
copy to the device on the current stream, and gets the region back once that copy's event has
completed. If the ring is full (indices still in flight), the upload pins a fresh buffer
instead (counted in ``overflows``): correct, only slower.
"""

from __future__ import annotations

import collections
import threading

import torch

__all__ = ["IndexStaging"]


class IndexStaging:
    """Thread-safe ring of pinned int64 indices (see module docstring)."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self.buffer = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self._head = 0
        self._inflight: collections.deque[tuple[int, int, torch.cuda.Event]] = collections.deque()
        self._lock = threading.Lock()
        self.overflows = 0

    def upload(self, values: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``values`` (CPU, any int dtype) as an int64 tensor on ``device``, copied on the
        current stream without a host sync. The returned tensor belongs to the current stream's
        allocator: keep it alive (or ``record_stream``) while other streams read it."""
        flat = values.reshape(-1)
        n = flat.numel()
        with self._lock:
            start = self._take(n)
            if start is None:
                self.overflows += 1
                staged = flat.to(torch.int64).pin_memory()
            else:
                staged = self.buffer[start : start + n]
                staged.copy_(flat)
            out = staged.to(device, non_blocking=True)
            if start is not None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._inflight.append((start, start + n, event))
        return out.view(values.shape)

    def _take(self, n: int) -> int | None:
        """Start of a free region of ``n`` elements, or None (the ring is full)."""
        while self._inflight and self._inflight[0][2].query():
            self._inflight.popleft()
        if not self._inflight:
            self._head = 0
        if n == 0 or n >= self.capacity:
            return None if n else 0
        if not self._inflight:
            start = 0
        else:
            oldest = self._inflight[0][0]
            if self._head >= oldest:  # occupied: [oldest, head)
                if self._head + n <= self.capacity:
                    start = self._head
                elif n < oldest:
                    start = 0
                else:
                    return None
            elif n < oldest - self._head:  # wrapped: occupied [oldest, cap) + [0, head)
                start = self._head
            else:
                return None
        self._head = start + n
        return start
