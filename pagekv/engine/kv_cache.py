"""The engine's paged KV cache: layer-first K and V tensors ``[num_layers, num_slots, kv_heads,
head_dim]`` cut into pages of ``page_size`` slots, and the allocator that hands pages to
requests. Page ``p`` holds slots ``[p * page_size, (p + 1) * page_size)``.

The allocator always gives the lowest free pages, so after the previous request has returned
its pages the next one gets one contiguous run: attention can then read the cache through a
view instead of gathering rows (:attr:`SlotTable.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekv.errors import PagekvError
from pagekv.geometry import KVGeometry
from pagekv.kernels import DeviceKV

__all__ = ["CacheFull", "PagedKVCache", "SlotTable"]


class CacheFull(PagekvError, RuntimeError):
    """The device cache has fewer free pages than a request needs; nothing was allocated."""


@dataclass
class SlotTable:
    """One request's pages and the slot of each of its positions.

    ``cpu``: int64 slots ``[num_pages * page_size]`` (what the connector takes); ``device``:
    the same on the cache's device (what ``store_kv`` and attention take). ``base``: the first
    slot when the slots are one contiguous run, else -1.
    """

    pages: list[int]
    cpu: torch.Tensor
    device: torch.Tensor
    base: int

    @property
    def capacity(self) -> int:
        return self.cpu.numel()


class PagedKVCache:
    """K and V caches of ``geometry`` on ``device``, zero-filled, and their page allocator.
    Not thread-safe: the engine's thread owns it."""

    def __init__(self, geometry: KVGeometry, num_pages: int, device: str | torch.device) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = geometry.page_size
        shape = (geometry.num_layers, num_pages * geometry.page_size, *geometry.device_layer_shape)
        self.k = torch.zeros(shape, dtype=geometry.dtype, device=device)
        self.v = torch.zeros(shape, dtype=geometry.dtype, device=device)
        self.device_kv = DeviceKV.from_caches(geometry, self.k, self.v)
        self._free = list(range(num_pages))  # kept sorted

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, num_tokens: int) -> SlotTable:
        """Pages for ``num_tokens`` positions (the lowest free ones). Raises ``CacheFull``."""
        need = -(-num_tokens // self.page_size)
        if need > len(self._free):
            raise CacheFull(
                f"{num_tokens} tokens need {need} pages of {self.page_size}; "
                f"{len(self._free)} of {self.num_pages} are free"
            )
        pages, self._free = self._free[:need], self._free[need:]
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        cpu = (torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size + offsets).view(-1)
        if pages[-1] - pages[0] == need - 1:  # one run: made on the device, no upload (a
            base = pages[0] * self.page_size  # pageable upload can wait for the whole GPU)
            device = torch.arange(base, base + cpu.numel(), device=self.k.device)
            return SlotTable(pages, cpu, device, base)
        return SlotTable(pages, cpu, cpu.to(self.k.device), -1)

    def free(self, table: SlotTable) -> None:
        """Give a request's pages back; they may be handed out by the next :meth:`allocate`.
        The caller orders its stream after any copy still reading them (see the engine)."""
        self._free = sorted(self._free + table.pages)
        table.pages = []
