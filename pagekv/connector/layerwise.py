"""Layer-by-layer host -> device load on a side stream, one CUDA event per layer, so the
engine computes layer ``i`` while layer ``i + 1`` is being copied."""

from __future__ import annotations

from typing import Any

import torch

from pagekv.kernels import load

__all__ = ["LayerLoad"]


class LayerLoad:
    """Returned by :meth:`KVConnector.load_async`. On CPU the copies are done on creation and
    :meth:`wait_layer` returns at once."""

    def __init__(
        self, conn: Any, page_ids: list[int], slots: torch.Tensor | None, stream: Any
    ) -> None:
        self.num_layers = conn.geometry.num_layers
        self.events: list[torch.cuda.Event] = []
        if not page_ids:
            return
        if stream is None:
            load(conn.pool.buffer, page_ids, conn.kv, slots)
            return
        device = conn.kv.device
        ids = torch.tensor(page_ids, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        slots = slots.to(device, non_blocking=True)
        stream.wait_stream(torch.cuda.current_stream(device))  # ids/slots copies, prior writes
        with torch.cuda.stream(stream):
            for layer in range(self.num_layers):
                # validated once (layer 0); later layers reuse the checked indices without a sync
                load(conn.pool.buffer, ids, conn.kv, slots, layer=layer, validate=layer == 0)
                event = torch.cuda.Event()
                event.record(stream)
                self.events.append(event)

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until ``layer`` is on the device (no host sync)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is not in [0, {self.num_layers})")
        if self.events:
            torch.cuda.current_stream().wait_event(self.events[layer])

    def synchronize(self) -> None:
        """Block the host until every layer is loaded."""
        if self.events:
            self.events[-1].synchronize()
