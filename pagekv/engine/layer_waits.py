"""The compute stream's side of a layer-wise load of a reused prefix: wait for each layer
before it reads the cache, and (CUDA) measure how long the stream stalled on the load."""

from __future__ import annotations

from typing import Any

import torch

from pagekv.connector import LayerLoad

__all__ = ["LayerWaits", "cuda_event"]


class LayerWaits:
    """Called with a layer index before that layer's attention reads the cache (first time
    only); ``start`` is a timing event recorded before ``load_async`` (None on CPU)."""

    def __init__(self, layers: LayerLoad, cuda: bool, start: Any) -> None:
        self.layers, self.cuda, self.start = layers, cuda, start
        self.spans: list[tuple[Any, Any]] = []
        self.waited: set[int] = set()

    def __call__(self, layer: int) -> None:
        if layer in self.waited:
            return
        self.waited.add(layer)
        before = cuda_event(self.cuda)
        self.layers.wait_layer(layer)
        if self.cuda:
            self.spans.append((before, cuda_event(True)))

    def times(self) -> tuple[float, float]:
        """(until the last layer was there, total stall) in seconds; call after a sync."""
        if not self.spans:
            return 0.0, 0.0
        stall = sum(b.elapsed_time(a) for b, a in self.spans) / 1e3
        return self.start.elapsed_time(self.spans[-1][1]) / 1e3, stall


def cuda_event(cuda: bool) -> Any:
    """A timing event recorded now on the current stream (None without CUDA)."""
    if not cuda:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
