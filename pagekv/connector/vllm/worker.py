"""The worker half: fetch pages into the host pool, copy them into vLLM's blocks, save the blocks
a step completed. One per worker rank, each with its own :class:`KVConnector` and namespace.

Loads
  *sync*  ``start_load_kv`` runs before the forward: every request's prefetch starts at once and
          all share one deadline (``load_timeout_s``); what arrived is copied in. On GPU the
          copy is layer by layer on pagekv's load stream and ``wait_for_layer_load`` makes the
          engine's stream wait for that layer only (``layerwise``; else the copy is enqueued on
          the engine's stream before the forward); on CPU it is done on return.
  *async* the prefetch starts when the metadata arrives (``bind``); each later step copies
          the finished ones in and reports them in ``get_finished``. Every asynchronous load
          the metadata names is reported exactly once, within ``load_timeout_s + 1`` s,
          whatever happens (a prefetch that cannot start, a loop that hangs): vLLM holds the
          request and its blocks until then.
  A page the worker cannot get (node died, evicted, corrupt, deadline) is never guessed: its
  block and every later block of that request go to ``get_block_ids_with_load_errors`` and
  vLLM recomputes them. Nothing here raises into the step.

Saves
  ``wait_for_save`` copies the blocks the scheduler planned into the host pool and queues the
  write-back; blocks already in the host pool are written back again (the scheduler plans a
  block only when the store may lack it). On CPU the copy is done on return; on GPU the
  engine's stream waits on it (pagekv's default), so vLLM may reuse the blocks at once:
  ``request_finished`` never has to delay freeing them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagekv.connector import KeyNamespace, KVConnector
from pagekv.connector.loop import LoopThread, RateLimitedLog
from pagekv.errors import CopyFailed, PagekvError

from .metadata import BlockTransfer, PagekvMetadata

__all__ = ["SaveOutcomes", "WorkerSide"]

log = logging.getLogger("vllm.pagekv")  # under vLLM's logger: its handlers and format


@dataclass
class _AsyncLoad:
    spec: BlockTransfer
    future: concurrent.futures.Future
    deadline: float


_DONE_EMPTY: concurrent.futures.Future = concurrent.futures.Future()
_DONE_EMPTY.set_result(None)  # a load with nothing fetched: all its blocks are load errors


class SaveOutcomes:
    """A rank's saves until the store took them or did not: key -> (block hash, the block's KV
    event or None) from :meth:`saved` (the worker thread, before the save); :meth:`stored` and
    :meth:`unsaved` (the connector's ``on_stored`` / ``on_unsaved``: its loop or the worker
    thread) end each. A stored save's event waits for :meth:`take_events`, an unsaved one's
    block hash for :meth:`take_unsaved` (the worker's reports after a step). ``describe``: a
    save's KV events, one per block (vLLM's KV events on: :func:`.events.stored_events`), else
    None. At most ``MAX_TRACKED`` saves are followed (the oldest go: their outcome is then not
    reported)."""

    MAX_TRACKED = 1 << 16

    def __init__(self, describe: Callable[[BlockTransfer], list[Any]] | None = None) -> None:
        self._describe = describe
        self._pending: collections.OrderedDict[bytes, tuple[bytes, Any]] = collections.OrderedDict()
        self._events: list[Any] = []
        self._unsaved: set[bytes] = set()
        self._lock = threading.Lock()

    def saved(self, keys: list[bytes], spec: BlockTransfer) -> None:
        events = self._describe(spec) if self._describe is not None and spec.described else []
        with self._lock:  # a block without an event: None
            self._pending.update(zip(keys, itertools.zip_longest(spec.block_hashes, events)))
            while len(self._pending) > self.MAX_TRACKED:
                self._pending.popitem(last=False)

    def stored(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                event = self._pending.pop(key, (None, None))[1]
                if event is not None:
                    self._events.append(event)

    def unsaved(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                pending = self._pending.pop(key, None)
                if pending is not None:
                    self._unsaved.add(pending[0])

    def lost(self, block_hashes: tuple[bytes, ...]) -> None:
        """Blocks whose save was not even made (the worker skipped it)."""
        with self._lock:
            self._unsaved.update(block_hashes)

    def take_unsaved(self) -> set[bytes]:
        with self._lock:
            out, self._unsaved = self._unsaved, set()
        return out

    def take_events(self) -> list[Any]:
        with self._lock:
            out, self._events = self._events, []
        return out


class WorkerSide:
    """Loads and saves of one worker rank. ``namespace_of(epoch)``: this rank's key namespace
    (see :meth:`EngineLayout.namespace`); ``layer_index``: vLLM layer name -> item index in a
    page. Methods are called from vLLM's worker thread; prefetches run on a loop thread."""

    def __init__(
        self,
        conn: KVConnector,
        namespace_of: Callable[[str], KeyNamespace],
        layer_index: dict[str, int],
        *,
        load_timeout_s: float,
        save: bool,
        layerwise: bool = False,
        outcomes: SaveOutcomes | None = None,
    ) -> None:
        self.conn, self.layer_index = conn, layer_index
        self.outcomes = outcomes  # the connector's on_stored / on_unsaved report to it
        self._namespace_of = namespace_of
        self._namespaces: dict[str, KeyNamespace] = {}
        self.load_timeout_s = load_timeout_s
        self.save_enabled = save and conn.namespace.is_writer  # MLA: rank 0 writes for all
        self.layerwise = layerwise and conn.kv.device.type == "cuda"
        self._aio = LoopThread("pagekv-vllm-prefetch")
        self._async: dict[str, _AsyncLoad] = {}
        self._layer_loads: list[tuple[Any, list[int]]] = []  # (LayerLoad, its block ids)
        self._errors: set[int] = set()
        self._recved: set[str] = set()
        self._warn = RateLimitedLog(log)
        self.counters = dict.fromkeys(
            ("load_blocks", "load_error_blocks", "load_seconds", "save_blocks", "saves_skipped"),
            0,
        )  # fmt: skip

    # ---- loads -----------------------------------------------------------------------------
    def keys(self, epoch: str, block_hashes: tuple[bytes, ...]) -> list[bytes]:
        ns = self._namespaces.get(epoch)
        if ns is None:
            if len(self._namespaces) >= 4:  # epochs change on resets: keep the recent few
                self._namespaces.pop(next(iter(self._namespaces)))
            ns = self._namespaces[epoch] = self._namespace_of(epoch)
        return ns.derive_keys(block_hashes)

    def _start_prefetch(
        self, spec: BlockTransfer, epoch: str, deadline: float
    ) -> concurrent.futures.Future:
        keys = self.keys(epoch, spec.block_hashes)
        return self._aio.submit(self.conn.prefetch(keys=keys, deadline=deadline))

    def bind(self, meta: PagekvMetadata) -> None:
        """Start the prefetches of this step's asynchronous loads. Each is recorded before
        its prefetch starts: one that cannot start is a failed load, reported like any."""
        for spec in meta.loads:
            if spec.load_async and spec.req_id not in self._async:
                deadline = time.monotonic() + self.load_timeout_s
                self._async[spec.req_id] = pending = _AsyncLoad(spec, _DONE_EMPTY, deadline)
                if spec.failed:  # nothing to fetch: every block is recomputed
                    continue
                try:
                    pending.future = self._start_prefetch(spec, meta.epoch, deadline)
                except Exception as e:  # a bug or a closed connector: recomputed, never stuck
                    self._warn.warning("pagekv: load of request %s not started: %r",
                                       spec.req_id, e)  # fmt: skip

    def fail_unbound(self, meta: PagekvMetadata | None) -> None:
        """Record the asynchronous loads of ``meta`` that :meth:`bind` did not (it raised) as
        failed loads: their requests are reported, never left waiting."""
        for spec in meta.loads if meta else ():
            if spec.load_async and spec.req_id not in self._async:
                self._async[spec.req_id] = _AsyncLoad(spec, _DONE_EMPTY, 0.0)

    def start_load(self, meta: PagekvMetadata | None) -> None:
        """Synchronous loads of this step (before the forward), then the asynchronous loads
        whose pages have arrived."""
        self._layer_loads = []
        loads = meta.loads if meta else []
        for spec in loads:
            if spec.failed and not spec.load_async:  # nothing to fetch: all recomputed
                self._load(spec, None)
        sync = [s for s in loads if not s.load_async and not s.failed]
        if sync:
            start = time.monotonic()
            deadline = start + self.load_timeout_s
            grace = deadline + 1.0  # once per step: a prefetch loop that does not answer
            futures = [self._start_prefetch(s, meta.epoch, deadline) for s in sync]
            for spec, future in zip(sync, futures):
                wait_s = max(0.0, grace - time.monotonic())
                self._load(spec, self._collect(future, wait_s), layerwise=self.layerwise)
            self.counters["load_seconds"] += time.monotonic() - start
        self._collect_async(time.monotonic())

    def _collect_async(self, now: float) -> None:
        """Copy in the asynchronous loads whose prefetch is done; those past their deadline
        (plus 1 s) are reported with what arrived, or as failed. Never waits."""
        for req_id, pending in list(self._async.items()):
            if pending.future.done() or now > pending.deadline + 1.0:
                del self._async[req_id]
                self._recved.add(req_id)
                self._load(pending.spec, self._collect(pending.future, 0.0))

    def _collect(self, future: concurrent.futures.Future, wait_s: float) -> Any:
        """The prefetch handle, or None if it failed or is not done within ``wait_s`` (its
        pages are then released whenever it does finish)."""
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(self._release_late)
        except Exception as e:  # a bug or a closed connector: a miss, never the step's error
            self._warn.warning("pagekv: prefetch failed: %r", e)
        return None

    def _release_late(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.conn.release(future.result())

    def _load(self, spec: BlockTransfer, handle: Any, layerwise: bool = False) -> None:
        """Copy the leading pages ``handle`` holds into ``spec``'s blocks; the rest are load
        errors. Releases the handle (safe right after the copy is enqueued)."""
        loaded = 0
        if handle is not None:
            ids = list(spec.block_ids[: handle.num_pages])
            try:
                if ids and layerwise:
                    self._layer_loads.append((self.conn.load_async(handle, ids), ids))
                elif ids:
                    self.conn.load(handle, ids)
                loaded = len(ids)
            except Exception as e:  # whatever it is, these blocks are recomputed
                self._warn.warning("pagekv: load of request %s failed: %r", spec.req_id, e)
            finally:
                self.conn.release(handle)
        failed = spec.block_ids[loaded:]
        self._errors.update(failed)
        self.counters["load_blocks"] += loaded
        self.counters["load_error_blocks"] += len(failed)

    def wait_for_layer(self, layer_name: str) -> None:
        """Make the engine's stream wait for this layer of the step's layer-wise loads (an
        unknown layer waits for all of them). A load whose copy failed (``CopyFailed``) is
        not waited for again: its blocks are reported as load errors (vLLM recomputes them),
        never an error raised into the forward."""
        index = self.layer_index.get(layer_name)
        waiting = []
        for layers, ids in self._layer_loads:
            try:
                for i in range(layers.num_layers) if index is None else (index,):
                    layers.wait_layer(i)
            except CopyFailed as e:
                self._warn.warning("pagekv: a layer-wise load failed: %r", e)
                self._errors.update(ids)
                self.counters["load_blocks"] -= len(ids)
                self.counters["load_error_blocks"] += len(ids)
            else:
                waiting.append((layers, ids))
        self._layer_loads = waiting

    @property
    def pending_async(self) -> int:
        """Asynchronous loads whose pages are still being fetched."""
        return len(self._async)

    def fail_loads(self, meta: PagekvMetadata | None) -> None:
        """Report every block of the step's synchronous loads as a load error (vLLM recomputes
        them); used when a load raised something unexpected."""
        for spec in meta.loads if meta else ():
            if not spec.load_async:
                self._errors.update(spec.block_ids)

    def take_finished(self) -> set[str]:
        """Requests whose asynchronous load ended (loaded or failed) since the last call;
        overdue ones are reported here even when :meth:`start_load` did not run."""
        overdue = [r for r, p in self._async.items() if time.monotonic() > p.deadline + 1.0]
        for req_id in overdue:
            pending = self._async.pop(req_id)
            self._recved.add(req_id)
            self._load(pending.spec, self._collect(pending.future, 0.0))
        done, self._recved = self._recved, set()
        return done

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # ---- saves -----------------------------------------------------------------------------
    def save(self, meta: PagekvMetadata | None) -> None:
        """Save the step's completed blocks (device -> host pool now, to the store later).
        Called at the end of every step: the step's layer-wise loads are done with."""
        self._layer_loads = []
        if meta is None or not self.save_enabled:
            return
        for spec in meta.saves:
            try:
                keys = self.keys(meta.epoch, spec.block_hashes)
                if self.outcomes is not None:
                    self.outcomes.saved(keys, spec)
                handle = self.conn.save(keys=keys, device_slots=list(spec.block_ids),
                                        write_through=True)  # fmt: skip
                self.counters["save_blocks"] += handle.pages
            except (PagekvError, ValueError, RuntimeError) as e:
                self.counters["saves_skipped"] += 1
                self._warn.warning("pagekv: save of request %s skipped: %r", spec.req_id, e)
                if self.outcomes is not None:
                    self.outcomes.lost(spec.block_hashes)

    def take_unsaved(self) -> set[bytes]:
        """Block hashes of saves the store did not take since the last call."""
        return self.outcomes.take_unsaved() if self.outcomes is not None else set()

    def take_events(self) -> list[Any]:
        """KV events of the saves the store confirmed since the last call."""
        return self.outcomes.take_events() if self.outcomes is not None else []

    # ---- lifetime --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {**self.counters, "connector": self.conn.stats()}

    def close(self) -> None:
        """Stop pending prefetches, flush the write-back (bounded), close the connector."""
        self._aio.close()
        self._async.clear()
        self.conn.close()
