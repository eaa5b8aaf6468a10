"""Layer-by-layer host -> device load on the connector's load stream, one CUDA event per layer,
so the engine computes layer ``i`` while layer ``i + 1`` is being copied.

Ownership: the page ids and slot indices the kernels read are copied to the device *on the
load stream* (from the connector's pinned staging ring, ``non_blocking``: no host sync) and
kept referenced by the :class:`LayerLoad`, so the engine's allocator can never hand their
memory to the engine's stream while later layers still read them. Where ``auto`` takes the
copy engine for a layer's shape the indices stay on the CPU and the connector's issuer thread
enqueues the layers (:mod:`.copy_issuer`): ``wait_layer`` then holds the host only until that
layer is enqueued.
The host pages stay held by the prefetch handle, whose release waits
for :attr:`LayerLoad.done_event`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagekv.kernels import DeviceKV, load

from .copy_issuer import CopyIssuer
from .staging import IndexStaging
from .transfer_indices import launch

__all__ = ["LayerLoad"]


class LayerLoad:
    """Returned by :meth:`KVConnector.load_async`. On CPU the copies are done on creation and
    :meth:`wait_layer` returns at once.

    ``slots`` ``[pages, page_size]`` must already be validated (CPU) or come from the engine
    on its device (then out-of-range slots are skipped by the kernels, never written).
    """

    def __init__(
        self,
        kv: DeviceKV,
        host: torch.Tensor,
        page_ids: list[int],
        slots: torch.Tensor | None,
        stream: torch.cuda.Stream | None,
        wait_for: Sequence[Any] = (),
        staging: IndexStaging | None = None,
        issuer: CopyIssuer | None = None,
    ) -> None:
        self.num_layers = kv.geometry.num_layers
        self.events: list[Any] = []  # per layer: a CUDA event, or the issuer's completion
        self._keep: tuple[torch.Tensor, ...] = ()
        self.backend = "none"  # what the last layer's copy used (kernel, copy_engine, ...)
        if not page_ids:
            return
        if stream is None:
            self.backend = load(host, page_ids, kv, slots)
            return
        device = kv.device
        stream.wait_stream(torch.cuda.current_stream(device))  # slots written, prior writes
        for event in wait_for:  # device -> host copies still filling these pages
            stream.wait_event(event)
        if staging is None:
            staging = IndexStaging(capacity=len(page_ids) * (1 + slots.shape[1]) + 1)
        with torch.cuda.stream(stream):
            out = launch(True, kv, host, page_ids, slots, staging, issuer,
                         layers=range(self.num_layers))  # fmt: skip
            if slots.is_cuda:
                slots.record_stream(stream)  # the engine's tensor: keep its memory until done
            self._keep = (out.indices.ids, out.indices.slots)
            self.backend, self.events = out.backend, out.events

    @property
    def done_event(self) -> Any:
        """Completes when every layer is on the device (None on CPU or for no pages): the
        layers are copied in order on one stream (the load stream's, or the issuer's)."""
        return self.events[-1] if self.events else None

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until ``layer`` is on the device (no host sync)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is not in [0, {self.num_layers})")
        if self.events:
            torch.cuda.current_stream().wait_event(self.events[layer])

    def done(self) -> bool:
        return not self.events or self.events[-1].query()

    def synchronize(self) -> None:
        """Block the host until every layer is loaded."""
        if self.events:
            self.events[-1].synchronize()
