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

import torch

from . import ops, reference

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
    Returns the backend used.
    """
    if not isinstance(out_loc, torch.Tensor) or out_loc.dtype not in (torch.int32, torch.int64):
        raise TypeError("out_loc must be an int32 or int64 tensor")
    if out_loc.dim() != 1:
        raise ValueError(f"out_loc must be 1-D, got shape {tuple(out_loc.shape)}")
    _check(k, v, k_cache, v_cache, out_loc)
    if validate and out_loc.numel() and int(out_loc.max()) >= k_cache.shape[0]:
        raise IndexError(f"slot {int(out_loc.max())} is not in [0, {k_cache.shape[0]})")
    row_bytes, k_stride = _rows(k, "k")
    _, kc_stride = _rows(k_cache, "k_cache")
    v_stride, vc_stride = (
        (_rows(v, "v")[1], _rows(v_cache, "v_cache")[1]) if v is not None else (0, 0)
    )
    ptrs = [k.data_ptr(), k_cache.data_ptr()]
    if v is not None:
        ptrs += [v.data_ptr(), v_cache.data_ptr()]
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
    width = ops._vector_width(row_bytes, k_stride, kc_stride, v_stride, vc_stride, *ptrs)
    n = out_loc.shape[0]
    chunks = n * (2 if v is not None else 1) * row_bytes // width
    sms = _num_sms(k.device.index or 0)
    blocks = max(1, min(4 * sms, -(-chunks // (_THREADS * ops.UNROLL))))
    loc = out_loc if out_loc.device == k.device else out_loc.to(k.device)
    err = lib.pagekv_store_kv(
        k.device.index, k.data_ptr(), v.data_ptr() if v is not None else None,
        k_cache.data_ptr(), v_cache.data_ptr() if v_cache is not None else None,
        loc.data_ptr(), int(loc.dtype == torch.int64), n, k_cache.shape[0], k_stride,
        v_stride, kc_stride, vc_stride, row_bytes, width, blocks, _THREADS,
        torch.cuda.current_stream(k.device).cuda_stream,
    )  # fmt: skip
    if err != 0:
        raise RuntimeError(f"pagekv store_kv failed: cudaError {err}")
    return "kernel"


_SMS: dict[int, int] = {}


def _num_sms(device: int) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
