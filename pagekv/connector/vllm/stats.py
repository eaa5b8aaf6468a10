"""pagekv's counters in vLLM's stats stream: vLLM logs them as ``KV Transfer metrics: ...``
(summed over the scheduler and the worker ranks for each logging interval)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["PagekvStats", "StatsDelta"]


@dataclass
class PagekvStats(KVConnectorStats):
    """``data``: counter name -> increase over the interval (lookups, hit_tokens, load_blocks,
    load_error_blocks, save_blocks, ...)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> PagekvStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """Turns ever-growing counters into per-call increases (None when nothing changed)."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def take(self, counters: dict[str, Any]) -> PagekvStats | None:
        delta = {k: v - self._last.get(k, 0) for k, v in counters.items()}
        self._last = dict(counters)
        delta = {k: v for k, v in delta.items() if v}
        return PagekvStats(data=delta) if delta else None
