"""Attention over the paged KV cache for one forward of one request (a prefill chunk or a
decode step), with torch's ``scaled_dot_product_attention`` (flash kernels on the GPU).

A forward's ``T`` query rows are the positions ``[key_len - T, key_len)``: the last rows of the
key range (lower-right causal). New K/V rows are written with :func:`pagekv.kernels.store_kv`
before attention reads the cache; positions ``[written, key_len)`` read as zeros (padding of
batch-invariant chunks, see :class:`pagekv.engine.config.EngineConfig`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagekv.kernels import store_kv

from .kv_cache import PagedKVCache, SlotTable

__all__ = ["PagedAttention", "attention"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` (the last ``T`` positions) over ``k, v [S, KVH, D]``
    (``H`` a multiple of ``KVH``) -> ``[T, H, D]``. Only reads its inputs."""
    t, heads, _ = q.shape
    s, kv_heads, _ = k.shape
    qh = q.transpose(0, 1).unsqueeze(0)
    if t == 1:  # decode: every key is visible; GQA without repeating K/V
        kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
        out = _decode_attention(qh, kh, vh, heads != kv_heads)
    else:
        out = _flash_prefill(q, k, v) if t < s else None  # square: cuDNN's is faster
        if out is not None:
            return out
        if heads != kv_heads:  # the lower-right causal kernels need as many K/V heads as Q
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
        if t == s:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_lower_right(t, s, q))
    return out.squeeze(0).transpose(0, 1)


_DECODE_BACKENDS: list | None = None  # CUDA decode: flash / efficient, never cuDNN
_FLASH_PREFILL = True  # until the installed torch refuses it once


def _flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """Attention of a suffix over a longer prefix (``T < S``) by torch's flash-attention
    forward, or None where it cannot run. (A whole prompt, ``T == S``, stays with SDPA: its
    choice, cuDNN on the H100, was 13% faster for 16k tokens than this op.)

    It takes the rows as they lie (``[1, S, heads, D]``), K/V heads shared by several query
    heads as they are, and aligns the causal mask lower-right when ``T < S``: no repeated K/V
    and no mask object. On the H100 (1B shape, 128 queries over 16k keys) 0.038 ms of host
    time and 0.093 ms on the GPU per call, against 0.117 / 0.232 for SDPA with a CausalBias
    over repeated K/V (scripts/profile_e2e.py). Half precision on CUDA only."""
    global _FLASH_PREFILL
    if not (_FLASH_PREFILL and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    t, s = q.shape[0], k.shape[0]
    try:
        out = torch.ops.aten._flash_attention_forward(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, None, t, s, 0.0, True, False
        )[0]
    except (RuntimeError, AttributeError, TypeError):  # not in this build, or these shapes
        _FLASH_PREFILL = False
        return None
    return out.squeeze(0)


def _decode_attention(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, gqa: bool
) -> torch.Tensor:
    """One query row over every key. On CUDA torch may pick cuDNN, which builds an execution
    plan per new key length: 7.5 ms of host time per call, every decode step (profiled on an
    H100, scripts/profile_e2e.py). Flash or memory-efficient kernels take any length as is;
    if neither runs here, torch's default choice is used."""
    global _DECODE_BACKENDS
    if not qh.is_cuda or _DECODE_BACKENDS == []:
        return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if _DECODE_BACKENDS is None:
        _DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    try:
        with sdpa_kernel(_DECODE_BACKENDS):
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    except RuntimeError:  # no such kernel for these inputs: leave the choice to torch
        _DECODE_BACKENDS = []
        return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)


def _lower_right(t: int, s: int, like: torch.Tensor) -> torch.Tensor | object:
    """Causal mask of ``t`` queries at the end of ``s`` keys. On CUDA torch's ``CausalBias``
    (runs the flash kernel, no mask in memory; imported here because its module pulls in
    torch._dynamo, ~2 s); elsewhere a boolean ``[t, s]`` mask."""
    if like.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(t, s)
    keys = torch.arange(s, device=like.device)
    return keys[None, :] <= torch.arange(s - t, s, device=like.device)[:, None]


class PagedAttention:
    """The ``attend`` callable a :class:`pagekv.engine.model.Llama` forward uses.

    ``out_loc [T]`` (on the cache's device): slot of each query row, -1 for a padding row whose
    K/V are not stored. ``written``: positions of the request whose K/V are in the cache once
    this forward's rows are stored. ``wait(layer)``: called before a layer reads the cache
    (layer-wise load of a reused prefix). Mutates the cache rows at ``out_loc`` only.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        table: SlotTable,
        out_loc: torch.Tensor,
        *,
        key_len: int,
        written: int,
        wait: Callable[[int], None] | None = None,
    ) -> None:
        if not 0 < written <= min(key_len, table.capacity):
            raise ValueError(f"bad key range: written {written}, key_len {key_len}")
        self.cache, self.table, self.out_loc = cache, table, out_loc
        self.key_len, self.written, self.wait = key_len, written, wait
        self.validate = cache.k.device.type != "cuda"  # a check on CUDA would sync every call

    def _rows(self, layer_cache: torch.Tensor) -> torch.Tensor:
        if self.table.base >= 0:
            rows = layer_cache[self.table.base : self.table.base + self.written]
        else:
            rows = layer_cache.index_select(0, self.table.device[: self.written])
        pad = self.key_len - self.written
        if pad:
            rows = torch.cat((rows, rows.new_zeros((pad, *rows.shape[1:]))))
        return rows

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        store_kv(k, v, k_cache, v_cache, self.out_loc, validate=self.validate)
        if self.wait is not None:
            self.wait(layer)
        return attention(q, self._rows(k_cache), self._rows(v_cache))
