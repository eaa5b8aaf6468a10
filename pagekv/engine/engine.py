"""The reference engine: one request at a time, reusing prefix KV through a KVConnector.

Per request (:meth:`Engine.generate`):

1. **admission**: page keys of the prompt; ``lookup`` (host tier first, then one bounded
   EXISTS); the :class:`~pagekv.connector.policy.FetchPolicy` decides whether the part only
   the store holds is worth fetching; ``prefetch_sync`` brings the chosen pages into the host
   tier within a deadline (what arrived by then is used, the rest recomputed);
2. **load**: slots for prompt + new tokens; ``load_async`` copies the prefix layer by layer
   on the connector's load stream and the prefill waits per layer; ``release`` at once;
3. **prefill** of the remaining tokens only (new K/V written with ``store_kv``);
4. **save** of the prompt's full pages after the first token (``engine_waits=False``: the
   device -> host copy runs beside decode);
5. **decode** greedily; the slots go back to the allocator at once (the stream first waits on
   the save's copy), for the next request.

Store trouble never fails a request: a miss, a refused or late fetch means recompute.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import torch

from pagekv.connector import KeyNamespace, KVConnector, Prefetch, SaveHandle
from pagekv.connector.policy import FetchDecision, FetchPolicy, PolicyConfig
from pagekv.errors import ConfigError
from pagekv.store import ClientConfig

from .attention import PagedAttention
from .config import EngineConfig
from .decode_graph import DecodeGraphs
from .kv_cache import PagedKVCache, SlotTable
from .layer_waits import LayerWaits, cuda_event
from .model import Llama
from .request import Request, Result
from .weights import build_model

__all__ = ["Engine"]


class Engine:
    """A Llama model, its paged KV cache and (with ``store``) a KVConnector and a fetch
    policy. ``model`` may be shared between engines of the same config (the benchmark does).
    Not thread-safe: one caller at a time. Raises ``ConfigError`` for a bad request."""

    def __init__(
        self,
        config: EngineConfig,
        store: ClientConfig | str | list[str] | None = None,
        *,
        policy: PolicyConfig | None = None,
        model: Llama | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.cuda = self.device.type == "cuda"
        max_position = config.num_slots + config.prefill_chunk
        self.model = model or build_model(
            config.model, max_position=max_position, device=self.device, dtype=config.dtype,
            seed=config.seed, weights=config.weights,
        )  # fmt: skip
        self.geometry = config.geometry
        self.cache = PagedKVCache(self.geometry, config.num_pages, self.device)
        self.graphs = DecodeGraphs(self.model, self.cache) if config.decode_graphs else None
        self.positions = torch.arange(max_position, device=self.device)
        # prompt ids go up through this pinned buffer, made once (see _token_ids)
        self._ids = torch.zeros(max_position, dtype=torch.int64, pin_memory=self.cuda)
        self.connector: KVConnector | None = None
        self.policy: FetchPolicy | None = None
        if store is not None:
            ns = KeyNamespace(config.model_id, self.geometry)
            self.connector = KVConnector(
                self.geometry, self.cache.device_kv, store, host_pages=config.host_pages,
                namespace=ns, max_pending_writes=max(1024, config.host_pages),
            )  # fmt: skip
            self.policy = FetchPolicy(policy, bytes_per_token=self.geometry.bytes_per_token,
                                      attention_context=config.model.attention_context)  # fmt: skip
            self.connector.policy = self.policy  # its decisions show in the connector's stats
        self.counters = dict.fromkeys(
            ("requests", "prompt_tokens", "reused_host", "reused_store", "computed_tokens",
             "generated_tokens", "saved_pages"), 0,
        )  # fmt: skip

    # ---- one request -----------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, request: Request) -> Result:
        """Run ``request`` to completion (see module docstring) and return its result."""
        n = len(request.prompt)
        self._check(request)
        start = time.perf_counter()
        keys, handle, decision, lookup_s, prefetch_s = self._admit(request)
        table: SlotTable | None = None
        save: SaveHandle | None = None
        try:
            table = self.cache.allocate(n + request.max_new_tokens)
            t = time.perf_counter()
            ids = self._token_ids(request.prompt)
            reused, waits, load_s = self._load(handle, table)
            logits = self._prefill(ids, n, table, reused, waits)
            first_token = logits.argmax(-1)
            first = int(first_token)  # the host sync that ends time to first token
            done = time.perf_counter()
            ttft, prefill_s = done - start, done - t  # prefill_s includes the load
            stall = load_s  # on CPU the load is a synchronous copy
            if waits is not None and self.cuda:
                load_s, stall = waits.times()
            save = self._save(request, keys, table)
            t = time.perf_counter()
            tokens = [first, *self._decode(first_token, n, table, request.max_new_tokens - 1)]
            decode_s = time.perf_counter() - t
        finally:
            if handle is not None:
                self.connector.release(handle)  # idempotent; early on a failure
            if save is not None and save.event is not None:
                torch.cuda.current_stream(self.device).wait_event(save.event)
            if table is not None:
                self.cache.free(table)
        fetched = handle.fetched * self.geometry.page_size if handle is not None else 0
        result = Result(
            request.name, n, tokens, ttft, reused - fetched, fetched, lookup_s, prefetch_s,
            load_s, stall, prefill_s, decode_s, save.pages if save is not None else 0,
            None if decision is None else decision.as_dict(), logits.float().cpu().view(-1),
        )  # fmt: skip
        self._observe(result)
        return result

    def _check(self, request: Request) -> None:
        need = len(request.prompt) + request.max_new_tokens
        if need > self.cache.num_slots:
            raise ConfigError(
                f"request needs {need} KV slots; the cache has {self.cache.num_slots}"
            )
        if max(request.prompt) >= self.config.model.vocab_size:
            raise ConfigError(
                f"token id {max(request.prompt)} >= vocab {self.config.model.vocab_size}"
            )

    def _admit(
        self, request: Request
    ) -> tuple[list[bytes], Prefetch | None, FetchDecision | None, float, float]:
        """Keys, the prefetched prefix (or None), the decision, lookup and prefetch seconds."""
        conn, ps = self.connector, self.geometry.page_size
        if conn is None:
            return [], None, None, 0.0, 0.0
        keys = conn.keys(request.prompt)
        if not request.reuse:
            return keys, None, None, 0.0, 0.0
        t = time.perf_counter()
        usable = keys[: (len(request.prompt) - 1) // ps]  # at least one token is computed
        host = conn.cache.match_prefix(usable)
        found = conn.lookup(keys=usable) // ps if usable else 0
        lookup_s = time.perf_counter() - t
        decision = self.policy.decide(len(request.prompt), host * ps, max(0, found - host) * ps)
        if not decision.use_tokens:
            return keys, None, decision, lookup_s, 0.0
        t = time.perf_counter()
        timeout = min(decision.deadline_s or self.config.prefetch_timeout_s,
                      self.config.prefetch_timeout_s)  # fmt: skip
        handle = conn.prefetch_sync(keys=usable[: decision.use_tokens // ps], timeout_s=timeout)
        prefetch_s = time.perf_counter() - t
        self.policy.observe_fetch(handle.fetched * self.geometry.page_bytes, prefetch_s)
        return keys, handle, decision, lookup_s, prefetch_s

    def _load(
        self, handle: Prefetch | None, table: SlotTable
    ) -> tuple[int, LayerWaits | None, float]:
        """Start the layer-wise load of ``handle`` into ``table``; (tokens, waits, seconds
        the call took: on CPU the whole copy)."""
        if handle is None or not handle.num_tokens:
            return 0, None, 0.0
        t = time.perf_counter()
        start = cuda_event(self.cuda)
        layers = self.connector.load_async(handle, table.cpu[: handle.num_tokens])
        self.connector.release(handle)  # safe: the pages stay held until the copies are done
        return handle.num_tokens, LayerWaits(layers, self.cuda, start), time.perf_counter() - t

    def _token_ids(self, prompt: tuple[int, ...]) -> torch.Tensor:
        """The prompt on the device (then ``prefill_chunk`` zeros for batch-invariant padding),
        uploaded from a pinned buffer made once: a pageable upload or a pinned allocation can
        wait for the whole GPU (e.g. the previous request's save). The buffer is rewritten only
        after the previous request's first token, when its copy has long completed."""
        n = len(prompt)
        size = n + self.config.prefill_chunk if self.config.batch_invariant else n
        self._ids[:n] = torch.from_numpy(np.fromiter(prompt, dtype=np.int64, count=n))
        self._ids[n:size] = 0
        if not self.cuda:
            return self._ids[:size].clone()
        return self._ids[:size].to(self.device, non_blocking=True)

    def _prefill(
        self, ids: torch.Tensor, n: int, table: SlotTable, start: int, waits: LayerWaits | None
    ) -> torch.Tensor:
        """Compute positions ``[start, n)`` of ``ids`` (see EngineConfig for the two chunkings)
        and return the logits ``[1, vocab]`` of the last one. No host -> device copy: the
        slots come from ``table.device``."""
        chunk = self.config.prefill_chunk
        if self.config.batch_invariant:
            spans = [(lo, lo + chunk) for lo in range(start - start % chunk, n, chunk)]
        else:
            spans = [(lo, min(lo + chunk, n)) for lo in range(start, n, chunk)]
        for i, (lo, hi) in enumerate(spans):
            first, last = max(lo, start), min(hi, n)  # the rows whose K/V are stored
            out_loc = table.device[first:last]
            if (first, last) != (lo, hi):  # padding rows: -1, their K/V are not stored
                out_loc = torch.cat((out_loc.new_full((first - lo,), -1), out_loc,
                                     out_loc.new_full((hi - last,), -1)))  # fmt: skip
            attend = PagedAttention(self.cache, table, out_loc, key_len=hi, written=last,
                                    wait=waits if i == 0 else None)  # fmt: skip
            hidden = self.model(ids[lo:hi], self.positions[lo:hi], attend)
        return self.model.logits(hidden[n - 1 - lo : n - lo])

    def _decode(self, token: torch.Tensor, n: int, table: SlotTable, steps: int) -> list[int]:
        """``steps`` greedy tokens after ``token`` (``[1]`` on the device, at position ``n``);
        one host sync at the end. Replayed from a CUDA graph where it can be (see
        :mod:`.decode_graph`), else launched step by step."""
        if self.graphs is not None and self.graphs.usable(table, steps):
            return self.graphs.decode(token, n, table, steps)
        out = []
        for pos in range(n, n + steps):
            attend = PagedAttention(self.cache, table, table.device[pos : pos + 1],
                                    key_len=pos + 1, written=pos + 1)  # fmt: skip
            hidden = self.model(token, self.positions[pos : pos + 1], attend)
            token = self.model.logits(hidden).argmax(-1)
            out.append(token)
        return torch.cat(out).tolist() if out else []

    def _save(self, request: Request, keys: list[bytes], table: SlotTable) -> SaveHandle | None:
        full = len(request.prompt) // self.geometry.page_size
        if self.connector is None or not request.save or not full:
            return None
        slots = table.cpu[: full * self.geometry.page_size]
        return self.connector.save(keys=keys[:full], device_slots=slots, engine_waits=False)

    def _observe(self, r: Result) -> None:
        if self.policy is not None:
            self.policy.observe_prefill(r.prompt_tokens - r.reused_tokens, r.reused_tokens,
                                        r.prefill_s - r.load_stall_s)  # fmt: skip
            if r.reused_tokens:
                self.policy.observe_load(r.reused_tokens * self.geometry.bytes_per_token, r.load_s)
        c = self.counters
        c["requests"] += 1
        c["prompt_tokens"] += r.prompt_tokens
        c["reused_host"] += r.reused_host
        c["reused_store"] += r.reused_store
        c["computed_tokens"] += r.prompt_tokens - r.reused_tokens
        c["generated_tokens"] += len(r.tokens)
        c["saved_pages"] += r.saved_pages

    # ---- lifetime and stats ----------------------------------------------------------------
    def warmup(self, num_tokens: int = 1024) -> None:
        """Two prefills of ``num_tokens`` random tokens, nothing reused or saved: kernels and
        allocators warm up on the first, the second gives the policy a prefill speed. Then
        the connections to the store are opened (:meth:`KVConnector.connect`)."""
        num_tokens = max(1, min(num_tokens, self.cache.num_slots - 1))
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, self.config.model.vocab_size, (num_tokens,), generator=gen)
        policy, self.policy, counters = self.policy, None, dict(self.counters)
        try:
            self.generate(Request(prompt.tolist(), 1, reuse=False, save=False))
        finally:
            self.policy = policy
        self.generate(Request(prompt.tolist(), 1, reuse=False, save=False))
        self.counters = counters  # warm-up requests are not counted
        if self.connector is not None:  # the first lookup's 50 ms bound is not for connecting
            self.connector.connect(timeout_s=10.0)
        # What is alive now (torch, the model, the connector) lives as long as the engine:
        # out of the collector's sight, a full collection no longer walks it. One such pass
        # took 240 ms in a process with torch loaded, stalling a decode step or a write-back
        # (scripts/bench_writeback_gil.py); serving engines freeze after start-up likewise.
        gc.collect()
        gc.freeze()

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every saved page has been written to the store."""
        if self.connector is not None:
            self.connector.flush_sync(timeout_s)

    def stats(self) -> dict[str, Any]:
        """Engine counters, the policy's decision stats and the connector's stats."""
        out: dict[str, Any] = {"engine": dict(self.counters)}
        if self.connector is not None:
            out["policy"] = self.policy.stats()
            out["connector"] = self.connector.stats()
        return out

    def close(self, timeout_s: float | None = None) -> None:
        """Close the connector: drain the write-back for at most ``timeout_s`` (default the
        connector's own bound). Idempotent."""
        if self.connector is not None:
            self.connector.close(timeout_s)
