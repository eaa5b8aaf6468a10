"""KV events of the vLLM connector, sent by vLLM's own publisher (``--kv-events-config``): a
``BlockStored`` with vLLM's block hash, its parent and tokens, medium :data:`MEDIUM`, once the
store confirmed holding that block for every rank that writes it. Never for a failed save.

Path: each writer rank's connector reports the keys its write-backs confirmed
(``KVConnector(on_stored=...)``, the connector's loop thread) -> the worker's
:class:`.worker.SaveOutcomes` keeps the events (:func:`stored_events`) of those it saved ->
``get_kv_connector_kv_cache_events`` hands them to vLLM, which carries them to the scheduler
(``KVConnectorOutput.kv_cache_events``) -> :class:`ConfirmedEvents` counts each event per rank
and ``take_events`` yields it once all ``writers`` ranks reported it (TP ranks and PP stages
each hold their part of a block; MLA: one rank per stage).

Hashes are vLLM's (``maybe_convert_block_hash``: the 64-bit ints vLLM publishes by default,
or the bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), so they match vLLM's own GPU
events. Removals are not sent from here (the connector does not learn of a node's evictions):
pagekv nodes publish them, keyed by store keys (``--events-endpoint``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from .metadata import BlockTransfer

__all__ = ["MEDIUM", "ConfirmedEvents", "PagekvKVEvents", "stored_events"]

MEDIUM = "PAGEKV"  # the medium of the connector's events: stored in pagekv
MAX_TRACKED = 1 << 16  # events awaiting other ranks (oldest go)


class PagekvKVEvents(KVConnectorKVEvents):
    """One step's events of one or more worker ranks (vLLM merges the ranks' containers)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self.events, self.workers = list(events or ()), workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> PagekvKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events = []


def stored_events(spec: BlockTransfer, block_size: int) -> list[BlockStored]:
    """The ``BlockStored`` event of each block a save names (``spec.described``: vLLM's KV
    events on), in order."""
    events = []
    for block_hash, info in zip(spec.block_hashes, spec.described):
        parent = info.parent_hash
        events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(block_hash)],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=list(info.token_ids), block_size=block_size,
            lora_id=info.lora_id, medium=MEDIUM, lora_name=info.lora_name,
        ))  # fmt: skip
    return events


class ConfirmedEvents:
    """The scheduler's tally: an event is sent once ``writers`` ranks reported it."""

    def __init__(self, writers: int) -> None:
        self.writers = writers
        self._counts: collections.OrderedDict[Any, int] = collections.OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def add(self, container: Any) -> None:
        if not isinstance(container, PagekvKVEvents):
            return
        counts = self._counts
        for ev in container.get_all_events():
            n = counts.get(ev, 0) + 1
            if n >= self.writers:
                counts.pop(ev, None)
                self._ready.append(ev)
            else:
                counts[ev] = n
        while len(counts) > MAX_TRACKED:
            counts.popitem(last=False)

    def take(self) -> Iterable[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready
