"""Torch reference transfers: the oracle for the CUDA kernels, and the CPU path.

Pure byte moves, done on integer views of the same element size, so every dtype (fp8
included) works on every device torch supports. Every argument is validated before anything
is written; see :mod:`pagekv.kernels.layout` for the layouts and the errors raised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import (
    DeviceKV,
    check_host,
    check_layer,
    check_page_ids,
    check_slots,
    check_unique_slots,
)

__all__ = ["copy_slots_ref", "load_ref", "save_ref", "store_kv_ref"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _host_rows(kv: DeviceKV, host: torch.Tensor) -> torch.Tensor:
    """``host`` as ``[num_pages, num_layers, num_kv, page_size, row_elems]`` (a view)."""
    geo = kv.geometry
    shape = (host.shape[0], geo.num_layers, geo.num_kv, geo.page_size, geo.row_elems)
    return _bytes_view(host).view(shape)


def _layers(kv: DeviceKV, layer: int | None) -> list[tuple[int, int]]:
    chosen = range(kv.geometry.num_layers) if layer is None else (layer,)
    return [(c, i) for i in chosen for c in range(kv.geometry.num_kv)]


def save_ref(
    kv: DeviceKV,
    slots: torch.Tensor | Sequence[int],
    host: torch.Tensor,
    page_ids: torch.Tensor | Sequence[int],
    *,
    layer: int | None = None,
) -> None:
    """Layer-first device -> page-first host: token ``j`` of ``page_ids[i]`` gets device slot
    ``slots[i, j]`` of every layer (or of ``layer``). Mutates ``host`` only; skipped tokens'
    host rows keep their bytes."""
    geo = kv.geometry
    check_host(geo, host)
    ids = check_page_ids(page_ids, host.shape[0], unique=True)
    s = check_slots(slots, ids.numel(), geo.page_size, kv.num_slots)
    check_layer(layer, geo.num_layers)
    save_rows(kv, s, host, ids, layer)


def save_rows(
    kv: DeviceKV, s: torch.Tensor, host: torch.Tensor, ids: torch.Tensor, layer: int | None
) -> None:
    """:func:`save_ref` on arguments its caller has already validated."""
    geo = kv.geometry
    ids = ids.to("cpu", torch.int64)
    s = s.to(kv.device, torch.int64).reshape(-1)
    valid = s >= 0
    if not bool(valid.any()):
        return
    src_idx = s.clamp(min=0)
    keep_old = None if bool(valid.all()) else (~valid).to(host.device).view(-1, geo.page_size, 1)
    hv, ids = _host_rows(kv, host), ids.to(host.device)
    for c, i in _layers(kv, layer):
        rows = _bytes_view(kv.layers[c][i]).index_select(0, src_idx)
        rows = rows.to(host.device).view(ids.numel(), geo.page_size, geo.row_elems)
        if keep_old is not None:
            rows = torch.where(keep_old, hv[ids, i, c], rows)
        hv[ids, i, c] = rows


def load_ref(
    host: torch.Tensor,
    page_ids: torch.Tensor | Sequence[int],
    kv: DeviceKV,
    slots: torch.Tensor | Sequence[int],
    *,
    layer: int | None = None,
) -> None:
    """Page-first host -> layer-first device, all layers or ``layer``: device slot
    ``slots[i, j]`` gets token ``j`` of page ``page_ids[i]``. Mutates the device cache only;
    skipped (negative) slots write nothing. A page may be loaded into two slot sets."""
    geo = kv.geometry
    check_host(geo, host)
    ids = check_page_ids(page_ids, host.shape[0], unique=False)
    s = check_slots(slots, ids.numel(), geo.page_size, kv.num_slots)
    check_layer(layer, geo.num_layers)
    check_unique_slots(s)
    load_rows(host, ids, kv, s, layer)


def load_rows(
    host: torch.Tensor, ids: torch.Tensor, kv: DeviceKV, s: torch.Tensor, layer: int | None
) -> None:
    """:func:`load_ref` on arguments its caller has already validated."""
    geo = kv.geometry
    ids = ids.to("cpu", torch.int64)
    s = s.to(kv.device, torch.int64).reshape(-1)
    valid = s >= 0
    dst_idx = s[valid]
    if dst_idx.numel() == 0:
        return
    pick = valid.to(host.device)
    hv, ids = _host_rows(kv, host), ids.to(host.device)
    for c, i in _layers(kv, layer):
        rows = hv[ids, i, c].reshape(-1, geo.row_elems)[pick].to(kv.device)
        _bytes_view(kv.layers[c][i]).index_copy_(0, dst_idx, rows)


def copy_slots_ref(
    src: DeviceKV,
    src_slots: torch.Tensor,
    dst: DeviceKV,
    dst_slots: torch.Tensor,
    *,
    layer: int | None = None,
) -> None:
    """Layer-first -> layer-first (any devices): ``dst`` slot ``dst_slots[t]`` of each layer
    gets ``src`` slot ``src_slots[t]``. A negative index on either side skips token ``t``.
    Mutates ``dst`` only."""
    if src.geometry != dst.geometry:
        raise ValueError("src and dst caches have different geometries")
    geo = src.geometry
    check_layer(layer, geo.num_layers)
    s = check_slots(src_slots, 1, src_slots.numel(), src.num_slots).view(-1)
    d = check_slots(dst_slots, 1, dst_slots.numel(), dst.num_slots).view(-1)
    if s.numel() != d.numel():
        raise ValueError(f"src_slots has {s.numel()} entries, dst_slots {d.numel()}")
    check_unique_slots(d)
    s, d = s.to(src.device, torch.int64), d.to(dst.device, torch.int64)
    valid = (s >= 0) & (d >= 0).to(src.device)
    if not bool(valid.any()):
        return
    s_idx, d_idx = s[valid], d[valid.to(dst.device)]
    for c, i in _layers(src, layer):
        rows = _bytes_view(src.layers[c][i]).index_select(0, s_idx).to(dst.device)
        _bytes_view(dst.layers[c][i]).index_copy_(0, d_idx, rows)


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    out_loc: torch.Tensor,
) -> None:
    """The engine's per-step write: ``k_cache[out_loc] = k`` and ``v_cache[out_loc] = v``
    (``index_put``). Rows are ``[tokens, ...]`` matching ``cache[0].shape``."""
    idx = out_loc.to(k_cache.device, torch.int64)
    _bytes_view(k_cache).index_put_((idx,), _bytes_view(k))
    if v is not None and v_cache is not None:
        _bytes_view(v_cache).index_put_((idx,), _bytes_view(v))
