"""Layouts the transfers convert between, and the validation every path shares.

Host side (page-first), see :mod:`pagekv.connector.host_pool`:
    MHA ``host[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``
    MLA ``host[num_pages, num_layers, page_size, head_dim]``

Device side (layer-first), normalised by :class:`DeviceKV` to ``num_kv`` groups (K and V, or
the latent) of ``num_layers`` 2-D views ``[num_slots, row_elems]`` whose rows are contiguous
and whose slot stride is the same for every layer. Accepted engine forms:
    ``DeviceKV.from_caches(geo, k, v)``  k, v ``[num_layers, num_slots, heads, dim]`` or lists of
                                         ``num_layers`` tensors ``[num_slots, heads, dim]``
    ``DeviceKV.from_caches(geo, latent)`` MLA ``[num_layers, num_slots, dim]`` or a list of
                                         ``[num_slots, dim]``
    ``DeviceKV.from_vllm(geo, layers)``  vLLM-style per-layer ``[2, num_blocks, block_size,
                                         heads, dim]``; slot = block * block_size + offset

Slot indices are int32/int64 tensors ``[num_pages_moved, page_size]`` (or flat, page-major);
a negative slot means "skip this token": nothing is read or written for it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.errors import InvalidPageError, InvalidSlotError
from pagekv.geometry import KVGeometry

from .jit import PagePlan

__all__ = [
    "DeviceKV",
    "check_host",
    "check_layer",
    "check_page_ids",
    "check_slots",
    "check_unique_slots",
    "device_indices",
    "slot_runs",
]

INDEX_DTYPES = (torch.int32, torch.int64)
# The largest pitch of a 2-D copy (cudaDevAttrMaxPitch: 2^31 - 1 on every GPU this runs on; the
# library checks the device's own value too).
MAX_PITCH = (1 << 31) - 1


def _as_list(caches: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        return list(caches.unbind(0))
    if isinstance(caches, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in caches):
        return list(caches)
    raise TypeError(f"{name} must be a tensor or a list of per-layer tensors")


def _rows(t: torch.Tensor, geo: KVGeometry, name: str) -> torch.Tensor:
    """View a per-layer cache ``[num_slots, *device_layer_shape]`` as ``[num_slots, row]``."""
    if t.dtype != geo.dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, geometry says {geo.dtype}")
    if tuple(t.shape[1:]) != geo.device_layer_shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected [num_slots, "
            f"{', '.join(map(str, geo.device_layer_shape))}]"
        )
    flat = t.reshape(t.shape[0], geo.row_elems) if t.shape[0] else t.view(0, geo.row_elems)
    if flat.stride(1) != 1 or flat.data_ptr() != t.data_ptr():
        raise ValueError(f"{name}: each slot's row must be contiguous in memory")
    return flat


@dataclass(frozen=True, eq=False)
class DeviceKV:
    """The engine's layer-first cache as ``layers[kv][layer] -> [num_slots, row_elems]`` views.

    Views alias the engine's tensors: transfers that load write into them.
    """

    geometry: KVGeometry
    layers: tuple[tuple[torch.Tensor, ...], ...]

    def __post_init__(self) -> None:
        geo = self.geometry
        if len(self.layers) != geo.num_kv:
            raise ValueError(f"expected {geo.num_kv} cache groups (K/V or latent)")
        first = self.layers[0][0]
        for kv, group in enumerate(self.layers):
            if len(group) != geo.num_layers:
                raise ValueError(
                    f"cache {'KV'[kv] if geo.num_kv == 2 else 'latent'} has {len(group)} "
                    f"layers, geometry says {geo.num_layers}"
                )
            for i, t in enumerate(group):
                if t.device != first.device:
                    raise ValueError(f"layer {i} is on {t.device}, layer 0 on {first.device}")
                if t.shape[0] != first.shape[0] or t.stride(0) != first.stride(0):
                    raise ValueError(
                        f"layer {i} has {t.shape[0]} slots of stride {t.stride(0)}; every layer "
                        f"needs layer 0's {first.shape[0]} slots of stride {first.stride(0)}"
                    )

    @classmethod
    def from_caches(
        cls,
        geometry: KVGeometry,
        k: torch.Tensor | Sequence[torch.Tensor],
        v: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> DeviceKV:
        """From K and V caches (MHA) or the latent cache alone (MLA); see module docstring."""
        if geometry.is_mla != (v is None):
            want = "only the latent cache" if geometry.is_mla else "both K and V caches"
            raise ValueError(f"{geometry.kind.value} geometry needs {want}")
        names = ("latent",) if v is None else ("k_cache", "v_cache")
        groups = (k,) if v is None else (k, v)
        layers = tuple(
            tuple(_rows(t, geometry, f"{n}[{i}]") for i, t in enumerate(_as_list(g, n)))
            for n, g in zip(names, groups)
        )
        return cls(geometry, layers)

    @classmethod
    def from_vllm(cls, geometry: KVGeometry, layers: Sequence[torch.Tensor]) -> DeviceKV:
        """From vLLM-style per-layer tensors ``[2, num_blocks, block_size, heads, dim]``."""
        if geometry.is_mla:
            raise ValueError("from_vllm is for MHA caches; pass MLA latents to from_caches")
        k, v = [], []
        for i, t in enumerate(layers):
            if t.dim() != 5 or t.shape[0] != 2:
                raise ValueError(
                    f"layers[{i}] has shape {tuple(t.shape)}, expected [2, B, b, H, D]"
                )
            k.append(t[0].flatten(0, 1))
            v.append(t[1].flatten(0, 1))
        return cls.from_caches(geometry, k, v)

    # read on every transfer call: cached (the layers are fixed, and torch makes a new device
    # object on each ``Tensor.device``)
    @functools.cached_property
    def num_slots(self) -> int:
        return self.layers[0][0].shape[0]

    @functools.cached_property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    @functools.cached_property
    def slot_stride_bytes(self) -> int:
        t = self.layers[0][0]
        return t.stride(0) * t.element_size()

    @functools.cached_property
    def layer_ptrs(self) -> tuple[int, ...]:
        """Address of slot 0 of each (kv, layer), kv-major: index ``kv * num_layers + layer``."""
        return tuple(t.data_ptr() for group in self.layers for t in group)

    @functools.cached_property
    def layer_pitches(self) -> tuple[int, ...] | None:
        """Per K/V (or latent), the distance in bytes from each layer's slot 0 to the next
        layer's, where it is one distance for all layers and no layer overlaps the next (at
        least ``num_slots`` slot strides): a run of slots over the layers is then one pitched
        copy (the ``pitched`` backend). None where a group's layers lie at uneven distances or
        farther apart than a copy's pitch may be (``MAX_PITCH``)."""
        n, extent = self.geometry.num_layers, self.num_slots * self.slot_stride_bytes
        pitches = []
        for group in range(self.geometry.num_kv):
            ptrs = self.layer_ptrs[group * n : (group + 1) * n]
            pitch = ptrs[1] - ptrs[0] if n > 1 else extent
            uneven = any(b - a != pitch for a, b in itertools.pairwise(ptrs))
            if uneven or pitch < extent or (n > 1 and pitch > MAX_PITCH):
                return None
            pitches.append(pitch)
        return tuple(pitches)

    @functools.cached_property
    def alignment(self) -> int:
        """The greatest common divisor of the row size, the slot stride and every layer's
        address: an access width divides it iff it suits every row of the cache."""
        geo = self.geometry
        return math.gcd(geo.item_bytes, self.slot_stride_bytes, *self.layer_ptrs)

    @functools.cached_property
    def page_plan(self) -> tuple[PagePlan, int]:
        """What every page-transfer launch passes about this cache (device, the pointer table on
        it, slots, sizes, layers), and its address: made once, as a lone one-layer load waits
        on its launch's host time. CUDA caches only."""
        geo = self.geometry
        plan = PagePlan(
            device=self.device.index or 0, layer_ptrs=self.pointer_table(self.device).data_ptr(),
            num_slots=self.num_slots, page_bytes=geo.page_bytes,
            slot_stride=self.slot_stride_bytes, item_bytes=geo.item_bytes,
            page_size=geo.page_size, num_kv=geo.num_kv, num_layers=geo.num_layers,
        )  # fmt: skip
        return plan, ctypes.addressof(plan)  # the plan keeps the memory the address names

    @functools.cached_property
    def layer_ptr_array(self) -> ctypes.Array:
        """``layer_ptrs`` as a ctypes int64 array (made once: host-side copies read it)."""
        return (ctypes.c_int64 * len(self.layer_ptrs))(*self.layer_ptrs)

    @functools.cached_property
    def _tables(self) -> dict[torch.device, torch.Tensor]:
        return {}

    def pointer_table(self, device: torch.device) -> torch.Tensor:
        """``layer_ptrs`` as an int64 tensor on ``device`` (made once, then cached: the kernels
        read it, so it stays valid inside CUDA graphs captured after the first call)."""
        table = self._tables.get(device)
        if table is None:
            table = torch.tensor(self.layer_ptrs, dtype=torch.int64).to(device)
            self._tables[device] = table
        return table


def check_host(geometry: KVGeometry, host: torch.Tensor) -> None:
    """``host`` must be a contiguous ``[num_pages, *geometry.host_page_shape]`` pool buffer."""
    if not isinstance(host, torch.Tensor):
        raise TypeError(f"host must be a tensor, got {type(host).__name__}")
    if host.dtype != geometry.dtype:
        raise TypeError(f"host has dtype {host.dtype}, geometry says {geometry.dtype}")
    if host.shape[1:] != geometry.host_page_shape:  # a 0-d tensor's () differs too
        raise ValueError(
            f"host has shape {tuple(host.shape)}, expected [num_pages, "
            f"{', '.join(map(str, geometry.host_page_shape))}]"
        )
    if not host.is_contiguous():
        raise ValueError("host pool buffer must be contiguous")


def _index_tensor(x: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(list(x), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise TypeError(f"{name} must be a sequence of ints: {e}") from None
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    return x


def check_page_ids(
    page_ids: torch.Tensor | Sequence[int],
    num_pages: int,
    *,
    unique: bool,
    check_values: bool = True,
) -> torch.Tensor:
    """1-D int32/int64 page ids, returned as a tensor on the device given (lists: CPU int64).

    With ``check_values`` (a GPU sync for CUDA tensors) each id must be in ``[0, num_pages)``
    and, if ``unique`` (a save writes each page once), appear once.
    """
    ids = _index_tensor(page_ids, "page_ids")
    if ids.dim() != 1:
        raise ValueError(f"page_ids must be 1-D, got shape {tuple(ids.shape)}")
    if check_values and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_pages:
            bad = lo if lo < 0 else hi
            raise InvalidPageError(f"page id {bad} is not in [0, {num_pages})")
        if unique and torch.unique(ids).numel() != ids.numel():
            raise ValueError("page_ids repeat: each page may appear once per transfer")
    return ids


def check_slots(
    slots: torch.Tensor | Sequence[int],
    num_pages: int,
    page_size: int,
    num_slots: int,
    *,
    check_values: bool = True,
    skips: bool = True,
) -> torch.Tensor:
    """Slot indices for ``num_pages`` pages, shape ``[num_pages, page_size]`` (flat accepted).

    Each slot is in ``[0, num_slots)`` or, where ``skips``, negative (skip); checked when
    ``check_values`` (a GPU sync for CUDA tensors). Returned as a 2-D view, same dtype and
    device as given. Raises ``TypeError`` / ``ValueError`` / ``IndexError``.
    """
    s = _index_tensor(slots, "slots")
    if s.dim() == 1 and s.numel() == num_pages * page_size:
        s = s.view(num_pages, page_size)
    if s.shape != (num_pages, page_size):
        raise ValueError(
            f"slots has shape {tuple(s.shape)}, expected [{num_pages}, {page_size}] "
            f"(or {num_pages * page_size} flat) for {num_pages} pages"
        )
    if check_values and s.numel():
        if int(s.max()) >= num_slots:
            raise InvalidSlotError(f"slot {int(s.max())} is not in [0, {num_slots})")
        if not skips and int(s.min()) < 0:
            raise InvalidSlotError(f"negative slot {int(s.min())}: every slot must be a token's")
    return s


def check_layer(layer: int | None, num_layers: int) -> None:
    if layer is None:
        return
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int or None, got {layer!r}")
    if not 0 <= layer < num_layers:
        raise IndexError(f"layer {layer} is not in [0, {num_layers})")


def check_unique_slots(slots: torch.Tensor) -> None:
    """Loads write device slots: two tokens may not land in one slot."""
    valid = slots[slots >= 0]
    if torch.unique(valid).numel() != valid.numel():
        raise ValueError("slots repeat: a load would write two tokens into one slot")


def device_indices(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied on the current stream without holding the host: a CPU
    tensor goes through pinned memory (torch's caching host allocator, which keeps the block
    until the copy is done), since a copy from pageable memory waits for the stream."""
    if t.device == device and t.is_contiguous():
        return t
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.contiguous().pin_memory()
    return t.to(device, non_blocking=True).contiguous()


def slot_runs(kv: DeviceKV, slots: torch.Tensor) -> tuple[int, int]:
    """(valid slots, runs) of slots ``[n, page_size]`` on the CPU (negative = skipped): a run is
    consecutive valid device slots within a page, copied as one block (one slot a run where
    the slot stride is not the row)."""
    valid = slots >= 0
    tokens = int(valid.sum())
    if kv.slot_stride_bytes != kv.geometry.item_bytes:
        return tokens, tokens
    # a token continues a run when it and the one before it (same page) are valid and adjacent
    follows = int((valid[:, 1:] & valid[:, :-1] & (slots[:, 1:] == slots[:, :-1] + 1)).sum())
    return tokens, tokens - follows
