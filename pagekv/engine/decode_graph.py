"""Decode with CUDA graphs: a request's decode steps replayed from one captured forward.

Eager decode launches ~20 kernels per layer from Python for one token: the engine's thread,
not the GPU, sets the pace, so anything else that wants the GIL (the connector's write-back of
the prompt just saved) slows decode. Serving engines capture decode in CUDA graphs; so does
this one. A step is one :meth:`DecodeGraphs._step` over static device buffers:

    token   [1] int64      the input token; the step writes the next one here
    pos     [1] int64      the input's position; the step adds 1 (its slot: base + pos)
    out     [L] int64      tokens made, at index ``pos - start``
    start   [1] int64      the first decode position of the request

Attention reads the request's rows of the cache as one view ``cache[base : base + L]``
(``L`` = prompt + new tokens; the table must be one contiguous run, see
:attr:`SlotTable.base`) with an additive mask hiding positions ``> pos``: the rows it hides are
the request's own, zeroed before the first step, so no NaN left there by an earlier user of
the slots can leak through the softmax's zero weights. Query heads sharing a K/V head attend as
rows of one query block (``[1, kv_heads, heads / kv_heads, head_dim]``), so the kernel needs no
GQA support and reads K/V once.

A graph is captured per (base, L) and kept (a few, least recently used first out): the
benchmark's requests of one length reuse theirs. Capture runs on a side stream in thread-local
mode, so the connector's threads may keep querying events meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagekv.kernels import store_kv

from .kv_cache import PagedKVCache, SlotTable
from .model import Llama

__all__ = ["DecodeGraphs"]

MAX_GRAPHS = 4
# Steps enqueued ahead of the one the host waits for: a serving engine reads each step's token
# (stop conditions, streamed output) at most a step behind, so its decode never queues more. A
# loop that enqueues every step at once holds every other thread's CUDA calls (the connector's
# issuer among them) until the device has taken in the whole burst.
STEPS_IN_FLIGHT = 2


@dataclass
class _Static:
    """The buffers one graph reads and writes (see the module docstring)."""

    token: torch.Tensor
    pos: torch.Tensor
    start: torch.Tensor
    out: torch.Tensor
    rows: torch.Tensor  # [L] int64: 0..L-1, the positions of the request's rows
    base: int


class _MaskedAttention:
    """The ``attend`` of one captured step: store the new row, attend over ``L`` rows."""

    def __init__(self, cache: PagedKVCache, st: _Static, out_loc: torch.Tensor) -> None:
        self.cache, self.st, self.out_loc = cache, st, out_loc
        zero = torch.zeros((), dtype=cache.k.dtype, device=cache.k.device)
        # [1, 1, 1, L]: 0 for positions <= pos, -inf after (made once per step, all layers)
        self.mask = torch.where(st.rows <= st.pos, zero, float("-inf")).view(1, 1, 1, -1)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        store_kv(k, v, k_cache, v_cache, self.out_loc, validate=False)
        lo, n = self.st.base, self.st.rows.numel()
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        qh = q.reshape(1, kv_heads, heads // kv_heads, dim)
        kh = k_cache[lo : lo + n].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D], a view
        vh = v_cache[lo : lo + n].transpose(0, 1).unsqueeze(0)
        mask = self.mask.expand(1, kv_heads, heads // kv_heads, n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return out.reshape(1, heads, dim)


class DecodeGraphs:
    """Captured decode steps of one engine's model and cache (CUDA only). Not thread-safe:
    the engine's thread owns it, like the cache."""

    def __init__(self, model: Llama, cache: PagedKVCache) -> None:
        self.model, self.cache = model, cache
        self.device = cache.k.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple[int, int], tuple[torch.cuda.CUDAGraph, _Static]] = (
            OrderedDict()
        )
        self.captures = 0

    @staticmethod
    def usable(table: SlotTable, steps: int) -> bool:
        """Whether :meth:`decode` takes this request: one contiguous run, two steps or more."""
        return table.base >= 0 and steps >= 2

    def decode(self, token: torch.Tensor, n: int, table: SlotTable, steps: int) -> list[int]:
        """``steps`` greedy tokens after ``token`` (``[1]`` on the device, at position ``n``),
        as :meth:`pagekv.engine.Engine._decode` makes them: at most ``STEPS_IN_FLIGHT`` steps
        enqueued ahead of the one the host waits for, as a serving engine reads its tokens.

        Mutates the cache rows of positions ``[n, n + steps)`` of ``table`` (zeroed, then
        written step by step). Raises ``ValueError`` when :meth:`usable` is False."""
        if not self.usable(table, steps):
            raise ValueError("graph decode needs a contiguous slot table and >= 2 steps")
        length = n + steps
        key = (table.base, length)
        entry = self.graphs.get(key)
        st = entry[1] if entry is not None else self._static(table.base, length)
        self._begin(st, token, n, table)
        if entry is None:
            entry = self._capture(st)
            self.graphs[key] = entry
            if len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
            remaining = steps - 1  # the capture's warm-up step ran for real
        else:
            self.graphs.move_to_end(key)
            remaining = steps
        graph = entry[0]
        in_flight: list[torch.cuda.Event] = []
        for _ in range(remaining):
            if len(in_flight) == STEPS_IN_FLIGHT:
                in_flight.pop(0).synchronize()
            graph.replay()
            done = torch.cuda.Event()
            done.record()
            in_flight.append(done)
        return st.out[:steps].tolist()

    def _static(self, base: int, length: int) -> _Static:
        i64 = {"dtype": torch.int64, "device": self.device}
        return _Static(
            token=torch.zeros(1, **i64), pos=torch.zeros(1, **i64),
            start=torch.zeros(1, **i64), out=torch.zeros(length, **i64),
            rows=torch.arange(length, **i64), base=base,
        )  # fmt: skip

    def _begin(self, st: _Static, token: torch.Tensor, n: int, table: SlotTable) -> None:
        """Load one request into the static buffers (device ops, no host sync)."""
        length = st.rows.numel()
        st.token.copy_(token.view(1))
        st.pos.fill_(n)
        st.start.fill_(n)
        lo = table.base + n  # the rows the mask hides at first: zeroed (see module docstring)
        self.cache.k[:, lo : table.base + length].zero_()
        self.cache.v[:, lo : table.base + length].zero_()

    def _step(self, st: _Static) -> None:
        out_loc = st.pos + st.base  # the table is one run: position p is in slot base + p
        hidden = self.model(st.token, st.pos, _MaskedAttention(self.cache, st, out_loc))
        nxt = self.model.logits(hidden).argmax(-1)
        st.out.index_copy_(0, st.pos - st.start, nxt)
        st.token.copy_(nxt)
        st.pos.add_(1)

    def _capture(self, st: _Static) -> tuple[torch.cuda.CUDAGraph, _Static]:
        """Run one real step on a side stream (lazy initialisations happen outside the
        capture), then capture the next one; both ordered after the caller's stream."""
        caller = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(caller)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self._step(st)
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self._step(st)
            finally:
                graph.capture_end()
        caller.wait_stream(side)
        self.captures += 1
        return graph, st
