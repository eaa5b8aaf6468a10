"""Fused KV store: write new K and V rows at ``out_loc`` in one launch.

What an engine calls for every layer of every step, so the wrapper is kept lean:

    k, v        [num_tokens, *row_shape]   (e.g. [T, heads, dim]; rows contiguous, any row stride)
    k_cache,    [num_slots, *row_shape]    same dtype and device as k / v
    v_cache
    out_loc     [num_tokens] int32/int64   slot of each token; negative skips the token

MLA: pass ``v=None, v_cache=None``. Any dtype whose row is a multiple of 4 bytes goes to the
kernel (16/8/4-byte accesses as alignment allows); otherwise, on CPU, or with
``backend="torch"``, two ``index_put`` do the same.
"""

from __future__ import annotations

import ctypes

import torch

from pagekv.errors import InvalidSlotError

from . import ops, reference
from .jit import StoreKVPlan

__all__ = ["store_kv"]

_THREADS = 256


def _rows(t: torch.Tensor, name: str) -> tuple[int, int]:
    """(row bytes, row stride bytes) of ``t`` viewed as ``[n, row]``; rows must be contiguous."""
    if t.dim() < 1:
        raise ValueError(f"{name} must have a token dimension, got a scalar")
    row = t[0].numel() if t.shape[0] else int(torch.Size(t.shape[1:]).numel())
    inner = t.flatten(1) if t.dim() > 1 else t.unsqueeze(1)
    if t.shape[0] and t.dim() > 1 and (inner.stride(1) != 1 or inner.data_ptr() != t.data_ptr()):
        raise ValueError(f"{name}: each row must be contiguous in memory")
    return row * t.element_size(), t.stride(0) * t.element_size()


def _check(k, v, k_cache, v_cache, out_loc) -> None:
    if (v is None) != (v_cache is None):
        raise ValueError("pass both v and v_cache, or neither (MLA)")
    pairs = [("k", k, "k_cache", k_cache)]
    if v is not None:
        pairs.append(("v", v, "v_cache", v_cache))
    for name, rows, cname, cache in pairs:
        if not isinstance(rows, torch.Tensor) or not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name} and {cname} must be tensors")
        if rows.dtype != cache.dtype:
            raise TypeError(f"{name} has dtype {rows.dtype}, {cname} {cache.dtype}")
        if rows.device != cache.device:
            raise ValueError(f"{name} is on {rows.device}, {cname} on {cache.device}")
        if rows.dim() < 1 or rows.shape[1:] != cache.shape[1:]:
            raise ValueError(
                f"{name} has shape {tuple(rows.shape)}, {cname} {tuple(cache.shape)}: rows differ"
            )
        if rows.shape[0] != out_loc.shape[0]:
            raise ValueError(f"{name} has {rows.shape[0]} tokens, out_loc {out_loc.shape[0]}")
    if v is not None and (v.shape != k.shape or v_cache.shape[0] != k_cache.shape[0]):
        raise ValueError(f"v {tuple(v.shape)} / v_cache must match k {tuple(k.shape)} / k_cache")


class _Plan:
    """Launch parameters fixed by one layout of (k, v, caches, out_loc): computed once after
    full validation, then reused by every call with the same layout (the per-step hot path)."""

    def __init__(self, lib, k, v, k_cache, v_cache, out_loc) -> None:
        self.fn = lib.pagekv_store_kv_plan
        self.device = k.get_device()
        row_bytes, k_stride = _rows(k, "k")
        v_stride, vc_stride = (
            (0, 0) if v is None else (_rows(v, "v")[1], _rows(v_cache, "v_cache")[1])
        )
        self.args = StoreKVPlan(
            device=self.device, k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr() if v_cache is not None else 0,
            num_slots=k_cache.shape[0], k_stride=k_stride, v_stride=v_stride,
            k_cache_stride=_rows(k_cache, "k_cache")[1], v_cache_stride=vc_stride,
            row_bytes=row_bytes, loc64=int(out_loc.dtype == torch.int64), threads=_THREADS,
        )  # fmt: skip
        self.args_addr = ctypes.addressof(self.args)  # self.args keeps the memory alive
        self.has_v = v is not None
        a = self.args
        self.base_width = ops._vector_width(
            row_bytes, a.k_stride, a.v_stride, a.k_cache_stride, a.v_cache_stride, a.k_cache,
            a.v_cache,
        )  # fmt: skip
        self.row_bytes = row_bytes
        self.max_blocks = 4 * torch.cuda.get_device_properties(self.device).multi_processor_count

    def launch(self, k: torch.Tensor, v: torch.Tensor | None, out_loc: torch.Tensor) -> str:
        n = out_loc.shape[0]
        if k.shape[0] != n or (v is not None and v.shape[0] != n):
            raise ValueError(f"k/v have {k.shape[0]} tokens, out_loc {n}")
        kp, vp = k.data_ptr(), v.data_ptr() if v is not None else 0
        width = self.base_width
        while (kp | vp) % width:
            width //= 2  # a row view at an odd offset: narrower accesses, still correct
        chunks = n * (2 if self.has_v else 1) * (self.row_bytes // width)
        blocks = max(1, min(self.max_blocks, -(-chunks // (_THREADS * ops.UNROLL))))
        stream = ops.current_stream(self.device)
        err = self.fn(self.args_addr, kp, vp or None, out_loc.data_ptr(), n, width, blocks, stream)
        if err != 0:
            raise RuntimeError(f"pagekv store_kv failed: cudaError {err}")
        return "kernel"


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def _plan_key(k, v, k_cache, v_cache, out_loc) -> tuple:
    key = (
        k_cache.data_ptr(), k_cache.shape, k_cache.stride(), k.shape[1:], k.stride(), k.dtype,
        k.get_device(), out_loc.dtype, out_loc.get_device(), out_loc.stride(),
    )  # fmt: skip
    if v is None or v_cache is None:
        return (*key, v is None, v_cache is None)
    return (*key, v_cache.data_ptr(), v_cache.shape, v_cache.stride(), v.shape[1:], v.stride())


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    out_loc: torch.Tensor,
    *,
    backend: ops.Backend = "auto",
    validate: bool = True,
) -> str:
    """``k_cache[out_loc] = k; v_cache[out_loc] = v`` in one launch; mutates the caches only.

    Raises ``TypeError``/``ValueError`` for mismatched dtypes, devices or shapes, and (with
    ``validate``, a sync for CUDA indices) ``IndexError`` for a slot outside the cache.
    With ``validate=False`` a layout seen before goes straight to the launch. Returns the
    backend used.
    """
    if not validate and backend != "torch" and k.is_cuda:
        plan = _PLANS.get(_plan_key(k, v, k_cache, v_cache, out_loc))
        if plan is not None:
            return plan.launch(k, v, out_loc)
    if not isinstance(out_loc, torch.Tensor) or out_loc.dtype not in (torch.int32, torch.int64):
        raise TypeError("out_loc must be an int32 or int64 tensor")
    if out_loc.dim() != 1:
        raise ValueError(f"out_loc must be 1-D, got shape {tuple(out_loc.shape)}")
    _check(k, v, k_cache, v_cache, out_loc)
    if validate and out_loc.numel() and int(out_loc.max()) >= k_cache.shape[0]:
        raise InvalidSlotError(f"slot {int(out_loc.max())} is not in [0, {k_cache.shape[0]})")
    row_bytes = _rows(k, "k")[0]
    for t, name in ((k_cache, "k_cache"), (v, "v"), (v_cache, "v_cache")):
        if t is not None:
            _rows(t, name)
    ops._check_backend(backend)
    if backend == "direct":
        raise ValueError("store_kv has no direct backend; use 'kernel' or 'torch'")
    lib = ops._kernel_lib(backend, k.is_cuda and row_bytes % 4 == 0, "CUDA rows of 4k bytes")
    if lib is None:
        loc, keep = out_loc, out_loc >= 0
        if not bool(keep.all()):  # negative slots skip their token, as in the kernel
            loc, keep = out_loc[keep], keep.to(k.device)
            k, v = k[keep], (v[keep] if v is not None else None)
        reference.store_kv_ref(k, v, k_cache, v_cache, loc)
        return "torch"
    loc = out_loc.to(k.device).contiguous()
    plan = _Plan(lib, k, v, k_cache, v_cache, loc)
    if loc is out_loc:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[_plan_key(k, v, k_cache, v_cache, out_loc)] = plan
    return plan.launch(k, v, loc)
