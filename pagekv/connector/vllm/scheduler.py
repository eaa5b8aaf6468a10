"""The scheduler half: which blocks of a request the store can supply, which blocks the workers
load into, and which blocks they save. No tensors, no host pool: a
:class:`~pagekv.connector.KVIndex` whose lookups are bounded in time and count a page only when
every rank's copy is stored (the hit is the minimum over TP ranks).

Rules (see vLLM's ``KVConnectorBase_V1``):

* the hit starts at vLLM's own block-aligned local hit and never covers the whole prompt: at
  most ``floor((num_tokens - 1) / block) * block`` tokens, so one token is left to compute;
* a request whose load failed (a page the store advertised but a worker could not fetch) gets
  no more external hits: vLLM recomputes it instead of looping on lookup, load, fail; the
  blocks it recomputes are saved;
* saves cover the prompt's full blocks (and the blocks of generated tokens with
  ``save_decode``): those this engine computes, and those it holds from its local prefix cache
  when the lookup finds the store lacks them (the store restarted empty, evicted them). A block
  is checked or saved at most once per ``resave_interval_s`` (:class:`RecentBlocks`), unless a
  worker reports its save did not reach the store (:meth:`SchedulerSide.unsaved`: the report
  comes with the step after the write-back ended, so the lookup of a request scheduled before
  it still skips the block); a block loaded from the store is known stored, unless its load
  failed;
* a block computed over a synchronous load not yet confirmed is not saved yet: vLLM runs the
  forward of a step whose load failed, and of the steps it scheduled before it learnt of the
  failure, over the failed blocks, and a block stored is never replaced. A save whose
  request's blocks up to it include a block such a load writes (its own load, or a block of
  another request's load it shares from vLLM's prefix cache) is held (:class:`_Held`) until the
  workers' report of the step that planned it is back (a step later; two with vLLM's
  asynchronous scheduling), then sent, as the request still holds the blocks. A reported
  failure drops the held saves over a failed block: planned again once vLLM recomputes them,
  never if it does not (a request that shares a failed block vLLM leaves to another: that
  request saves nothing more). The request's preemption or end drops its held saves (the
  lookup's re-save covers those blocks later).

Per step the cost is proportional to the requests that still have blocks to save (prefills,
and every running request only with ``save_decode``) and to the blocks saved, never to a
request's context length: decoding requests cost nothing here.
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagekv.connector.index import KVIndex

from .epoch import EpochRecord
from .metadata import BlockTransfer, PagekvMetadata, SavedBlock
from .namespace import EngineLayout

__all__ = ["RecentBlocks", "SchedulerSide"]

log = logging.getLogger("vllm.pagekv")  # under vLLM's logger: its handlers and format

BlockIdsOf = Callable[[str, int, int], list[int]]  # (req_id, start, stop) -> block ids


class RecentBlocks:
    """Block hashes seen stored, or saved, within the last ``interval_s``: such a block is not
    checked or saved again meanwhile. Oldest first; at most ``capacity`` entries (the oldest
    go first, which only costs a check). ``interval_s`` 0: nothing is remembered."""

    def __init__(self, interval_s: float, capacity: int = 1 << 18) -> None:
        self.interval_s, self.capacity = interval_s, capacity
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def fresh(self, block_hash: bytes, now: float) -> bool:
        seen = self._seen.get(block_hash)
        return seen is not None and now - seen < self.interval_s

    def mark(self, block_hash: bytes, now: float) -> None:
        if not self.interval_s:
            return
        seen = self._seen
        seen[block_hash] = now
        seen.move_to_end(block_hash)
        while len(seen) > self.capacity or now - next(iter(seen.values())) >= self.interval_s:
            seen.popitem(last=False)

    def forget(self, block_hash: bytes) -> None:
        self._seen.pop(block_hash, None)

    def clear(self) -> None:
        self._seen.clear()


@dataclass(eq=False)
class _Request:
    request: Any  # vLLM's Request: request_id, num_tokens, block_hashes (grows with tokens)
    limit: int  # blocks that may be saved: the prompt's full blocks (save_decode: no limit)
    local_blocks: int = 0  # vLLM's block-aligned local hit at the last lookup
    load_async: bool = False
    next_save: int | None = None  # first block not yet considered for saving (None: unscheduled)
    missing: list[int] = field(default_factory=list)  # local-hit blocks the store lacks
    resave: list[int] = field(default_factory=list)  # ... and now allocated: to save
    load_first: int = 0  # the load: its first block index and its block ids
    load_ids: tuple[int, ...] = ()
    loading: bool = False  # a load whose failure may still be reported
    no_external: bool = False
    tainted: bool = False  # computed over a failed block vLLM does not recompute: never saved


@dataclass(frozen=True)
class _Held:
    """A save planned in ``step`` over a block an unconfirmed synchronous load writes;
    ``first``: the request's first block index in it."""

    step: int
    first: int
    save: BlockTransfer


class SchedulerSide:
    """Lookup and bookkeeping of the scheduler-role connector. Not thread-safe (vLLM's
    scheduler is one thread). Never raises on store trouble (lookups are bounded misses).

    Inert (no lookup, no save) until :meth:`activate` gives it the layout the workers report
    and the namespace's epoch is known (:mod:`.epoch`). ``index``: the store lookups, None when
    neither direction is on; ``block_ids_of(req_id, start, stop)``: vLLM's block ids of a
    request's blocks ``start`` to ``stop``."""

    def __init__(
        self,
        layout: EngineLayout | None,
        index: KVIndex | None,
        *,
        save: bool,
        load_async: bool,
        load: bool = True,
        save_decode: bool = False,
        resave_interval_s: float = 30.0,
        block_ids_of: BlockIdsOf | None = None,
        epoch: str | None = "",
        epochs: EpochRecord | None = None,
        describe_saves: bool = False,
    ) -> None:
        self.save_enabled, self.load_enabled = save, load
        self.describe_saves = describe_saves  # vLLM's KV events are on: saves say their tokens
        self.load_async, self.save_decode = load_async, save_decode
        self.block_ids_of = block_ids_of
        self.recent = RecentBlocks(resave_interval_s)
        self.requests: dict[str, _Request] = {}
        self._to_save: dict[str, _Request] = {}  # requests that may still have blocks to save
        self.pending_loads: list[BlockTransfer] = []
        self.counters = dict.fromkeys(
            ("lookups", "hit_tokens", "planned_load_blocks", "planned_save_blocks",
             "resave_blocks", "failed_loads", "inert_lookups", "unsaved_blocks",
             "held_save_blocks", "dropped_held_blocks"), 0,
        )  # fmt: skip
        self._steps = 0  # steps built (PagekvMetadata.step)
        self._reported = 0  # the last step whose workers' report came back
        self._unconfirmed: list[tuple[int, frozenset[int]]] = []  # (step, block ids its sync
        # loads write), until the step's report is back
        self._held: list[_Held] = []
        self.layout: EngineLayout | None = None
        self.index: KVIndex | None = None
        self.epochs: EpochRecord | None = None
        self.epoch: str | None = None
        self.namespaces: list = []
        if layout is not None:
            self.activate(layout, index, epoch=epoch, epochs=epochs)

    def activate(
        self,
        layout: EngineLayout,
        index: KVIndex | None,
        *,
        epoch: str | None = None,
        epochs: EpochRecord | None = None,
    ) -> None:
        """Start serving with ``layout``: ``epoch`` when known, else ``epochs`` finds it
        (here, bounded, then in the background while the store cannot answer)."""
        self.layout, self.index, self.epochs = layout, index, epochs
        if epoch is None and epochs is not None:
            epoch = epochs.establish()
        self._set_epoch(epoch)

    def _set_epoch(self, epoch: str | None) -> None:
        if epoch == self.epoch:
            return
        self.epoch = epoch
        self.recent.clear()
        self._held = []  # blocks computed before the change: never saved under the new epoch
        self.namespaces = [] if epoch is None else self.layout.all_namespaces(epoch)

    @property
    def ready(self) -> bool:
        return self.epoch is not None and self.index is not None

    def _state(self, request: Any) -> _Request:
        st = self.requests.get(request.request_id)
        if st is None or st.request is not request:
            if self.save_decode:
                limit = sys.maxsize
            else:
                prompt = getattr(request, "num_prompt_tokens", request.num_tokens)
                limit = prompt // self.layout.block_size
            st = self.requests[request.request_id] = _Request(request, limit)
            if self.save_enabled:
                self._to_save[request.request_id] = st
        return st

    # ---- lookup ----------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) loadable from the store, and
        whether they load asynchronously. The same EXISTS also checks the local-hit blocks not
        seen stored recently: those the store lacks are saved once vLLM allocates the request."""
        if not self.ready:
            self.counters["inert_lookups"] += 1
            return 0, False
        st = self._state(request)
        lay = self.layout
        block = lay.block_size
        st.local_blocks = num_computed_tokens // block
        st.missing = []
        hashes = request.block_hashes
        pages = lay.num_pages(hashes)
        local = min(st.local_blocks, pages)
        now = time.monotonic()
        check: list[int] = []
        if self.save_enabled:
            fresh, page_hash = self.recent.fresh, lay.page_hash
            check = [i for i in range(min(local, st.limit)) if not fresh(page_hash(hashes, i), now)]
        read = self.load_enabled and not st.no_external
        read = read and not getattr(request, "skip_reading_prefix_cache", False)
        last = min(pages, (request.num_tokens - 1) // block) if read else local
        if not check and local >= last:
            return 0, False
        wanted = check + list(range(local, last))
        wanted_hashes = [lay.page_hash(hashes, i) for i in wanted]
        found = self.index.found([ns.derive_keys(wanted_hashes) for ns in self.namespaces])
        self.counters["lookups"] += 1
        if found is None:  # the store could not answer: a miss, nothing learnt
            return 0, False
        for h, stored in zip(wanted_hashes, found):
            if stored:
                self.recent.mark(h, now)
        n = len(check)
        st.missing = [i for i, stored in zip(check, found) if not stored]
        if st.missing and self.epochs is not None:  # a restarted store lost the record too
            self.epochs.check_soon(self.epoch)
        hit = next((j for j, stored in enumerate(found[n:]) if not stored), len(found) - n)
        self.counters["hit_tokens"] += hit * block
        st.load_async = self.load_async and hit > 0
        return hit * block, st.load_async

    def update_state_after_alloc(
        self, request: Any, block_ids: Callable[[], list[int]] | list[int], num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks: plan the load of the ``num_external_tokens`` it
        accepted (into the request's blocks from the local hit on; ``block_ids``: the request's
        block ids from block 0, or a function giving them) and the save of the local-hit blocks
        the store lacks. A second call for an async load (with 0) is a no-op."""
        if not self.ready:
            return
        st = self._state(request)
        if st.missing:
            st.resave, st.missing = st.missing, []
            self._to_save[request.request_id] = st
        if num_external_tokens <= 0:
            return
        ids_all = block_ids() if callable(block_ids) else block_ids
        lay = self.layout
        block = lay.block_size
        first, n = st.local_blocks, num_external_tokens // block
        hashes = lay.page_hashes(request.block_hashes, first, first + n)
        ids = tuple(ids_all[first : first + n])
        if len(ids) != n or len(hashes) != n or num_external_tokens % block:
            # vLLM now counts these tokens as computed: the workers must report the blocks as
            # load errors (vLLM recomputes them), never leave them unwritten
            log.error("pagekv: request %s: cannot place %d external tokens in %d blocks; "
                      "recomputing", request.request_id, num_external_tokens, len(ids))  # fmt: skip
            spec = BlockTransfer(request.request_id, ids, (), st.load_async, failed=True)
        else:
            spec = BlockTransfer(request.request_id, ids, tuple(hashes), st.load_async)
        self.pending_loads.append(spec)
        st.load_first, st.load_ids, st.loading = first, ids, True
        self.counters["planned_load_blocks"] += n

    def fail_load(
        self, request: Any, block_ids: Callable[[], list[int]], num_external_tokens: int
    ) -> None:
        """A load vLLM accepted but that could not be planned: the workers report its blocks
        as load errors (and an asynchronous one as finished), so vLLM recomputes them."""
        if num_external_tokens <= 0:
            return
        st = self.requests.get(request.request_id)
        first = st.local_blocks if st is not None else 0
        n = -(-num_external_tokens // self.layout.block_size)
        ids = tuple(block_ids()[first : first + n])
        load_async = st is not None and st.load_async
        self.pending_loads.append(BlockTransfer(request.request_id, ids, (), load_async, True))
        if st is not None:
            st.no_external = True

    # ---- per step --------------------------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> PagekvMetadata:
        """This step's loads (planned since the last step) and saves (blocks this step
        completes, local-hit blocks the store lacks). Does not modify ``scheduler_output``."""
        loads, self.pending_loads = self.pending_loads, []
        if self.epochs is not None:
            try:
                self._set_epoch(self.epochs.poll(self.epoch, time.monotonic()))
            except Exception:  # the epoch stays; the next step polls again
                log.exception("pagekv: checking the epoch record failed")
        self._steps += 1
        meta = PagekvMetadata(epoch=self.epoch or "", loads=loads, step=self._steps)
        written = frozenset(b for load in loads if not load.load_async for b in load.block_ids)
        if written:
            self._unconfirmed.append((self._steps, written))
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self.requests.get(req_id)
            if st is not None:
                st.loading = False
            self._drop_held(lambda held, req_id=req_id: held.save.req_id == req_id)
        self._release_held(meta)
        if self._to_save and self.ready:
            unconfirmed = frozenset().union(*(ids for _, ids in self._unconfirmed))
            scheduled = scheduler_output.num_scheduled_tokens.get
            block, now = self.layout.block_size, time.monotonic()
            try:
                for req_id, st in list(self._to_save.items()):
                    n, first = scheduled(req_id, 0), st.next_save
                    if first is not None and not st.resave:  # fast path: no block filled
                        if (st.request.num_computed_tokens + n) // block <= first:
                            continue
                    planned = self._plan_save(req_id, st, n, now)
                    if planned is None:
                        continue
                    first, save = planned
                    if unconfirmed and self._over(req_id, first, save, unconfirmed):
                        self._held.append(_Held(self._steps, first, save))
                        self.counters["held_save_blocks"] += len(save.block_ids)
                    else:
                        meta.saves.append(save)
            except Exception:  # a save not planned is a later miss; the loads still go out
                log.exception("pagekv: planning this step's saves failed")
        return meta

    def _plan_save(
        self, req_id: str, st: _Request, num_new: int, now: float
    ) -> tuple[int, BlockTransfer] | None:
        """The blocks of one request to save now: those this step fills, and the local-hit
        blocks the lookup found missing from the store; each unless seen stored recently.
        ``(first block index, the save)``."""
        if st.tainted:
            self._to_save.pop(req_id, None)
            return None
        lay, recent = self.layout, self.recent
        hashes = st.request.block_hashes
        todo: list[int] = []
        if st.resave:
            todo, st.resave = st.resave, []
            self.counters["resave_blocks"] += len(todo)
        if num_new:
            computed = st.request.num_computed_tokens  # before this step (vLLM adds it later)
            if st.next_save is None:  # blocks before it: local hits (above) or loaded
                st.next_save = computed // lay.block_size
            full = min((computed + num_new) // lay.block_size, lay.num_pages(hashes), st.limit)
            if full > st.next_save:
                todo.extend(range(st.next_save, full))
                st.next_save = full
        if st.next_save is not None and st.next_save >= st.limit:
            self._to_save.pop(req_id, None)  # nothing more to save for it
        if not todo or self.block_ids_of is None:
            return None
        blocks, block_hashes = [], []
        for i in todo:
            h = lay.page_hash(hashes, i)
            if not recent.fresh(h, now):
                recent.mark(h, now)
                blocks.append(i)
                block_hashes.append(h)
        if not blocks:
            return None
        start = blocks[0] if len(blocks) == 1 else min(blocks)
        ids = self.block_ids_of(req_id, start, max(blocks) + 1)
        if len(ids) <= max(blocks) - start:  # blocks vLLM no longer holds: nothing to save
            for h in block_hashes:
                recent.forget(h)
            return None
        self.counters["planned_save_blocks"] += len(blocks)
        described = self._describe(st.request, blocks) if self.describe_saves else ()
        return start, BlockTransfer(req_id, tuple(ids[i - start] for i in blocks),
                                    tuple(block_hashes), described=described)  # fmt: skip

    def _over(self, req_id: str, first: int, save: BlockTransfer, blocks: Collection[int]) -> bool:
        """Whether ``save`` (from block index ``first`` of its request) or the request's blocks
        before it include any of ``blocks`` (vLLM block ids)."""
        ids = set(save.block_ids)
        if first and self.block_ids_of is not None:
            ids.update(self.block_ids_of(req_id, 0, first))
        return not ids.isdisjoint(blocks)

    def _release_held(self, meta: PagekvMetadata) -> None:
        """Send the held saves whose step's report is back (those over a failed block were
        dropped when it came)."""
        if not self._held:
            return
        keep = []
        for held in self._held:
            if held.step <= self._reported and held.save.req_id in self.requests:
                meta.saves.append(held.save)
            else:
                keep.append(held)
        self._held = keep

    def _drop_held(self, which: Callable[[_Held], bool]) -> list[_Held]:
        """Forget the held saves ``which`` picks (returned): not taken for stored, and a
        running request plans them again as it computes them again."""
        keep, dropped = [], []
        for held in self._held:
            if not which(held):
                keep.append(held)
                continue
            dropped.append(held)
            for h in held.save.block_hashes:
                self.recent.forget(h)
            self.counters["dropped_held_blocks"] += len(held.save.block_ids)
            st = self.requests.get(held.save.req_id)
            if st is not None and st.next_save is not None:
                st.next_save = min(st.next_save, held.first)
                self._to_save[held.save.req_id] = st
        self._held = keep
        return dropped

    def _describe(self, request: Any, blocks: list[int]) -> tuple[SavedBlock, ...]:
        """Parent hash, tokens and LoRA of each of ``blocks`` of ``request`` (KV events)."""
        lay, hashes, tokens = self.layout, request.block_hashes, request.all_token_ids
        size = lay.block_size
        lora = getattr(request, "lora_request", None)
        lora_id, lora_name = (lora.adapter_id, lora.name) if lora is not None else (None, None)
        return tuple(SavedBlock(lay.page_hash(hashes, i - 1) if i else None,
                                tuple(tokens[i * size : (i + 1) * size]), lora_id, lora_name)
                     for i in blocks)  # fmt: skip

    def on_output(
        self,
        invalid_block_ids: Iterable[int] | None,
        failed_req_ids: Iterable[str] | None,
        step: int = 0,
    ) -> None:
        """Workers' report after ``step`` (0: not said): a request whose load failed gets no
        more external hits, the blocks from its first failed one on are not known stored, and
        are saved once recomputed; the held saves over a failed block are dropped."""
        invalid = set(invalid_block_ids or ())
        failed = set(failed_req_ids or ())
        if invalid or failed:
            self._drop_failed_held(invalid, failed)
            self._load_failed(invalid, failed)
        self._reported = max(self._reported, step)
        self._unconfirmed = [(s, ids) for s, ids in self._unconfirmed if s > self._reported]

    def _drop_failed_held(self, invalid: set[int], failed: set[str]) -> None:
        """Drop the held saves over a failed block (called after vLLM truncated the requests
        it recomputes); the others stay held."""
        block = self.layout.block_size
        over = self._drop_held(
            lambda h: h.save.req_id in failed or self._over(h.save.req_id, h.first, h.save, invalid)
        )
        for held in over:
            st = self.requests.get(held.save.req_id)
            if st is not None and st.request.num_computed_tokens > held.first * block:
                st.tainted = True  # vLLM keeps what it computed over the failed block
                self._to_save.pop(held.save.req_id, None)

    def _load_failed(self, invalid: set[int], failed: set[str]) -> None:
        for req_id, st in self.requests.items():
            if not st.loading:
                continue
            bad = next((k for k, b in enumerate(st.load_ids) if b in invalid), None)
            if bad is None and req_id not in failed:
                continue
            first = st.load_first + (bad or 0)
            hashes = st.request.block_hashes
            for i in range(first, st.load_first + len(st.load_ids)):
                if i < self.layout.num_pages(hashes):
                    self.recent.forget(self.layout.page_hash(hashes, i))
            if not st.no_external:
                self.counters["failed_loads"] += 1
            st.no_external, st.loading = True, False
            if st.next_save is not None and self.save_enabled:
                st.next_save = min(st.next_save, first)
                self._to_save[req_id] = st

    def unsaved(self, block_hashes: Collection[bytes]) -> None:
        """Blocks a worker rank could not save (its report after a step): no longer taken for
        stored, so the next lookup of a request holding them checks them and saves them again,
        instead of waiting out ``resave_interval_s``."""
        for h in block_hashes:
            self.recent.forget(h)
        self.counters["unsaved_blocks"] += len(block_hashes)

    def reset(self) -> bool:
        """Forget every stored page: a new epoch for the namespace (:mod:`.epoch`), recorded in
        the store so that restarts and other engines follow it; the workers follow through the
        metadata. False when the store could not record it (this engine uses it anyway)."""
        if self.epochs is None:
            from .epoch import new_epoch

            self._set_epoch(new_epoch())
            return True
        epoch, recorded = self.epochs.replace(self.epoch)
        self._set_epoch(epoch)
        return recorded

    def finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self._to_save.pop(req_id, None)
        if self._held:
            self._drop_held(lambda held: held.save.req_id == req_id)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters, epoch=self.epoch, recent_blocks=len(self.recent))
        if self.epochs is not None:
            out["epoch_record_key"] = self.epochs.key.hex()
        if self.layout is not None:
            out.update(model=self.layout.model_id, layout=self.layout.layout)
        if self.index is not None:
            out["index"] = self.index.stats()
        return out
