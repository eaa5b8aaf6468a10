"""The scheduler half: which blocks of a request the store can supply, which blocks the workers
load into, and which newly completed blocks they save. No tensors, no host pool: a
:class:`~pagekv.connector.KVIndex` whose lookups are bounded in time and count a page only when
every rank's copy is stored (the hit is the minimum over TP ranks).

Rules (see vLLM's ``KVConnectorBase_V1``):

* the hit starts at vLLM's own block-aligned local hit and never covers the whole prompt: at
  most ``floor((num_tokens - 1) / block) * block`` tokens, so one token is left to compute;
* a request whose load failed (a page the store advertised but a worker could not fetch) gets
  no more external hits: vLLM recomputes it instead of looping on lookup, load, fail;
* saves cover blocks that become full in this step and were computed by this engine (not the
  ones it loaded), each once per request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagekv.connector.index import KVIndex

from .metadata import BlockTransfer, PagekvMetadata
from .namespace import EngineLayout

__all__ = ["SchedulerSide"]

log = logging.getLogger("vllm.pagekv")  # under vLLM's logger: its handlers and format


@dataclass
class _Request:
    request: Any  # vLLM's Request: request_id, num_tokens, block_hashes (grows with tokens)
    local_blocks: int = 0  # vLLM's block-aligned local hit at the last lookup
    load_async: bool = False
    saved_blocks: int | None = None  # leading blocks stored or not to be saved
    loading: set[int] = field(default_factory=set)  # block ids a load may still report
    no_external: bool = False


class SchedulerSide:
    """Lookup and bookkeeping of the scheduler-role connector. ``index`` is None when loading
    is off; ``save`` False turns saving off. Not thread-safe (vLLM's scheduler is one thread).
    Never raises on store trouble (lookups are bounded misses)."""

    def __init__(
        self,
        layout: EngineLayout,
        index: KVIndex | None,
        *,
        save: bool,
        load_async: bool,
        block_ids_of: Any = None,
    ) -> None:
        self.layout, self.index = layout, index
        self.namespaces = layout.all_namespaces()
        self.save_enabled, self.load_async = save, load_async
        self.block_ids_of = block_ids_of  # req_id -> list of block ids (vLLM's cache manager)
        self.epoch = 0
        self.requests: dict[str, _Request] = {}
        self.pending_loads: list[BlockTransfer] = []
        self.counters = dict.fromkeys(
            ("lookups", "hit_tokens", "planned_load_blocks", "planned_save_blocks", "failed_loads"),
            0,
        )

    def _state(self, request: Any) -> _Request:
        st = self.requests.get(request.request_id)
        if st is None or st.request is not request:
            st = self.requests[request.request_id] = _Request(request)
        return st

    # ---- lookup ----------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) loadable from the store, and
        whether they load asynchronously."""
        st = self._state(request)
        block = self.layout.block_size
        st.local_blocks = num_computed_tokens // block
        if self.index is None or st.no_external or getattr(request, "skip_reading_prefix_cache", 0):
            return 0, False  # (vLLM drops external hits of prompt-logprob requests anyway)
        hashes = self.layout.page_hashes(request.block_hashes)
        last = min(len(hashes), (request.num_tokens - 1) // block)  # one token left to compute
        if st.local_blocks >= last:
            return 0, False
        wanted = hashes[st.local_blocks : last]
        keys = [ns.derive_keys(wanted) for ns in self.namespaces]
        pages = self.index.lookup_pages(keys)
        self.counters["lookups"] += 1
        self.counters["hit_tokens"] += pages * block
        st.load_async = self.load_async and pages > 0
        return pages * block, st.load_async

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Plan the load of the ``num_external_tokens`` vLLM accepted into ``block_ids`` (the
        request's blocks from block 0). A second call for an async load (with 0) is a no-op."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        block = self.layout.block_size
        first, n = st.local_blocks, num_external_tokens // block
        hashes = self.layout.page_hashes(request.block_hashes)[first : first + n]
        ids = list(block_ids[first : first + n])
        if len(ids) != n or len(hashes) != n or num_external_tokens % block:
            # vLLM now counts these tokens as computed: the workers must report the blocks as
            # load errors (vLLM recomputes them), never leave them unwritten
            log.error("pagekv: request %s: cannot place %d external tokens in %d blocks; "
                      "recomputing", request.request_id, num_external_tokens, len(ids))  # fmt: skip
            spec = BlockTransfer(request.request_id, tuple(ids), (), st.load_async, failed=True)
        else:
            spec = BlockTransfer(request.request_id, tuple(ids), tuple(hashes), st.load_async)
        self.pending_loads.append(spec)
        st.loading.update(ids)
        st.saved_blocks = max(st.saved_blocks or 0, first + n)  # already in the store
        self.counters["planned_load_blocks"] += n

    # ---- per step --------------------------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> PagekvMetadata:
        """This step's loads (planned since the last step) and saves (blocks this step
        completes). Does not modify ``scheduler_output``."""
        meta = PagekvMetadata(epoch=self.epoch, loads=self.pending_loads)
        self.pending_loads = []
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if req_id in self.requests:
                self.requests[req_id].loading.clear()
        if self.save_enabled:
            for req_id, computed in self._scheduled(scheduler_output):
                after = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                save = self._plan_save(req_id, computed, after)
                if save is not None:
                    meta.saves.append(save)
        return meta

    @staticmethod
    def _scheduled(so: Any) -> Iterable[tuple[str, int]]:
        for new in so.scheduled_new_reqs:
            yield new.req_id, new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        yield from zip(cached.req_ids, cached.num_computed_tokens)

    def _plan_save(self, req_id: str, computed: int, after: int) -> BlockTransfer | None:
        st = self.requests.get(req_id)
        if st is None or self.block_ids_of is None:
            return None
        block = self.layout.block_size
        if st.saved_blocks is None:  # first step: what vLLM had already is not ours to save
            st.saved_blocks = computed // block
        hashes = self.layout.page_hashes(st.request.block_hashes)
        full = min(after // block, len(hashes))
        if full <= st.saved_blocks:
            return None
        ids = self.block_ids_of(req_id)
        full = min(full, len(ids))
        start, st.saved_blocks = st.saved_blocks, max(st.saved_blocks, full)
        if full <= start:
            return None
        self.counters["planned_save_blocks"] += full - start
        return BlockTransfer(req_id, tuple(ids[start:full]), tuple(hashes[start:full]))

    def on_output(
        self, invalid_block_ids: Iterable[int] | None, failed_req_ids: Iterable[str] | None
    ) -> None:
        """Workers' report: a request with a failed load gets no more external hits."""
        invalid = set(invalid_block_ids or ())
        failed = set(failed_req_ids or ())
        if not invalid and not failed:
            return
        for req_id, st in self.requests.items():
            if req_id in failed or st.loading & invalid:
                if not st.no_external:
                    self.counters["failed_loads"] += 1
                st.no_external = True
                st.loading.clear()

    def reset(self) -> None:
        """Forget every stored page: later keys live in a new namespace epoch (see
        :meth:`EngineLayout.namespace`); the workers follow through the metadata."""
        self.epoch += 1
        self.namespaces = self.layout.all_namespaces(self.epoch)

    def finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        if self.index is not None:
            out["index"] = self.index.stats()
        return out
