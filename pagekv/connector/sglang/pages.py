"""SGLang host pool pages as store values: byte views of their frames, and what names them.

A page of an SGLang host pool is one store value, one key, whatever the layout: its frames are
the memory regions ``pool.get_page_buffer_meta`` reports for it, in that order (MHA page-first
layouts: the page's K region then its V region; ``layer_first``: K and V per layer; MLA: one
region, or one per layer). The frames are sent and filled in place (memoryviews into the pool's
own buffer, bounds-checked against it: no staging copy, no raw pointer ever dereferenced).

Two pools share pages only if their pages have the same bytes in the same order: the layout,
the element type and the frame plan are part of the key namespace (``page_first`` and
``page_first_direct`` pages have the same size but a different byte order).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagekv.errors import ConfigError, InvalidPageError
from pagekv.geometry import SUPPORTED_DTYPES, KVGeometry

__all__ = ["SUPPORTED_LAYOUTS", "PageFormat", "PoolPages"]

SUPPORTED_LAYOUTS = {
    "mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "mla": ("layer_first", "page_first", "page_first_direct"),
}
_STAND_IN = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32}


@dataclass(frozen=True)
class PageFormat:
    """What one page of a pool is: its kind, layout, element type and frame plan."""

    kind: str  # "mha" | "mla"
    layout: str
    dtype: torch.dtype
    layers: int
    page_size: int
    heads: int
    head_dim: int
    frames_per_page: int
    frame_bytes: int

    @property
    def page_bytes(self) -> int:
        return self.frames_per_page * self.frame_bytes

    @property
    def label(self) -> str:
        """The byte-order name that goes into the key namespace."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"sglang-{self.kind}-{self.layout}-{dtype}-{self.frames_per_page}x{self.frame_bytes}"

    def geometry(self) -> KVGeometry:
        """The pagekv geometry of a page. An element type pagekv does not name (SGLang keeps
        fp8 caches as uint8) is described by a stand-in of the same size; the real type is
        in :attr:`label`."""
        dtype = self.dtype if self.dtype in SUPPORTED_DTYPES.values() else None
        dtype = dtype or _STAND_IN.get(torch.empty((), dtype=self.dtype).element_size())
        if dtype is None:
            raise ConfigError(f"pagekv: SGLang host pool dtype {self.dtype} is not supported")
        if self.kind == "mla":
            return KVGeometry.mla(self.layers, self.page_size, self.head_dim, dtype)
        return KVGeometry(self.layers, self.page_size, self.heads, self.head_dim, dtype)


def describe_pool(pool: Any) -> PageFormat:
    """The page format of an SGLang ``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``.
    Raises :class:`ConfigError` for a layout or pool this backend does not store."""
    kind = "mla" if hasattr(pool, "kv_lora_rank") else "mha"
    layout = getattr(pool, "layout", None)
    if layout not in SUPPORTED_LAYOUTS[kind]:
        raise ConfigError(
            f"pagekv: {kind.upper()} host layout {layout!r} is not supported; "
            f"use --hicache-mem-layout {' or '.join(SUPPORTED_LAYOUTS[kind])}"
        )
    if getattr(pool, "dcp_size", 1) != 1:
        raise ConfigError("pagekv: decode context parallel (DCP) host pools are not supported")
    page = pool.page_size
    _, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
    if not sizes or len(set(sizes)) != 1:
        raise ConfigError(f"pagekv: unexpected page regions from the host pool: {sizes}")
    heads, dim = (1, pool.kv_cache_dim) if kind == "mla" else (pool.head_num, pool.head_dim)
    return PageFormat(kind, layout, pool.dtype, pool.layer_num, page, heads, dim,
                      len(sizes), sizes[0])  # fmt: skip


class PoolPages:
    """Byte views of one host pool's pages (frames), for the store client to send or fill.

    Views alias the pool's memory: a view handed to ``put_many`` must not change until the
    call returns (SGLang holds backed-up pages until the backend call returns); one handed
    to ``get_many`` is written in place. Thread-safe (read-only after construction)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.format = describe_pool(pool)
        self._starts: list[int] = []
        self._regions: list[tuple[int, memoryview]] = []
        for start, view in sorted(_buffer_regions(pool), key=lambda r: r[0]):
            self._starts.append(start)
            self._regions.append((start, view))
        if not self._regions:
            raise ConfigError("pagekv: the host pool has no CPU buffer to read pages from")

    def frames(self, host_indices: torch.Tensor, num_pages: int) -> list[list[memoryview]]:
        """Per page, its frames as writable byte views into the pool. ``host_indices`` holds
        ``num_pages * page_size`` token slots (SGLang's convention: page i starts at
        ``host_indices[i * page_size]``). Raises :class:`InvalidPageError` for slots that
        do not name pages of this pool."""
        fmt = self.format
        if host_indices.numel() != num_pages * fmt.page_size:
            raise InvalidPageError(
                f"{host_indices.numel()} host slots for {num_pages} pages of {fmt.page_size}"
            )
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != num_pages * fmt.frames_per_page or any(s != fmt.frame_bytes for s in sizes):
            raise InvalidPageError("the host pool reported an unexpected page region list")
        views = [self._view(ptr, fmt.frame_bytes) for ptr in ptrs]
        step = fmt.frames_per_page
        return [views[i : i + step] for i in range(0, len(views), step)]

    def _view(self, ptr: int, size: int) -> memoryview:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            raise InvalidPageError(f"page region at {ptr:#x} is outside the host pool")
        start, region = self._regions[i]
        offset = ptr - start
        if offset + size > region.nbytes:
            raise InvalidPageError(f"page region at {ptr:#x} (+{size}) is outside the host pool")
        return region[offset : offset + size]

    def flat_frames(self, flat: torch.Tensor) -> list[memoryview]:
        """A legacy flat page (``get_data_page(i, flat=True)`` or ``get_dummy_flat_data_page()``)
        cut into the same frames, in the same order, as the zero-copy path stores: values
        written by one path are read by the other. ``flat`` must be a contiguous CPU tensor
        of one page; the views alias it."""
        fmt = self.format
        if flat.device.type != "cpu" or not flat.is_contiguous():
            raise ValueError("a flat page must be a contiguous CPU tensor")
        data = memoryview(flat.reshape(-1).view(torch.uint8).numpy())
        if data.nbytes != fmt.page_bytes:
            raise ValueError(f"a flat page of {data.nbytes} bytes, expected {fmt.page_bytes}")
        return [data[o : o + fmt.frame_bytes] for o in _flat_offsets(fmt)]


def _flat_offsets(fmt: PageFormat) -> Sequence[int]:
    """Where frame j of a page starts in the flat page. The flat page is ``(2, L, P, H, D)``
    for MHA ``layer_first`` while its frames go K0, V0, K1, V1, ...; every other layout's
    flat page is its frames back to back (K then V, or layer after layer)."""
    size, n = fmt.frame_bytes, fmt.frames_per_page
    if fmt.kind == "mha" and fmt.layout == "layer_first":
        layers = n // 2
        return [(kv * layers + layer) * size for layer in range(layers) for kv in (0, 1)]
    return [j * size for j in range(n)]


def _buffer_regions(pool: Any) -> list[tuple[int, memoryview]]:
    """(address, byte view) of each CPU tensor the pool keeps its pages in."""
    out: list[tuple[int, memoryview]] = []
    for name in ("kv_buffer", "k_buffer", "v_buffer"):  # MHA k/v_buffer lie inside kv_buffer
        tensor = getattr(pool, name, None)
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        if not tensor.is_contiguous() or not tensor.numel():
            continue
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        if any(s <= start and end <= s + v.nbytes for s, v in out):
            continue
        out.append((start, memoryview(tensor.reshape(-1).view(torch.uint8).numpy())))
    return out
