"""SGLang host pool pages as store values: their frames, and what names them.

SGLang keeps a model's cache in one or more host pools, each named (``kv``; for hybrid models
also ``swa``, ``mamba``, ``indexer``, ``draft``, ...). A page of any pool is one store value,
one key. Rules:

* **Frames, zero-copy.** A page's frames are the memory regions ``pool.get_page_buffer_meta``
  reports for it, in that order (MHA page-first layouts: K then V; ``layer_first``: K and V per
  layer; MLA: one region, or one per layer; Mamba: the temporal state, then each conv state).
  They are byte views into the pool's own buffers (``get_hybrid_pool_buffer()``, else
  ``kv_buffer``), bounds-checked against them: sent and filled in place, no staging copy, no
  raw pointer ever dereferenced.
* **Flat pages, copied.** A pool whose pages have no such regions (``get_page_buffer_meta``
  refuses its layout, or reports memory outside its buffers) is stored through its flat page
  API: ``get_data_page`` to write, ``get_dummy_flat_data_page`` + ``set_from_flat_data_page``
  to read, one frame per page. A pool with neither cannot be stored (:class:`ConfigError`).
* **Names.** Two pools share pages only if their pages have the same bytes in the same order:
  the pool name, its kind, layout, element type and frame plan are part of the key namespace
  (``page_first`` and ``page_first_direct`` pages have the same size but another byte order).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagekv.errors import ConfigError, InvalidPageError
from pagekv.geometry import SUPPORTED_DTYPES, KVGeometry

__all__ = ["KV_POOL", "PageFormat", "PoolPages", "describe_pool"]

KV_POOL = "kv"  # SGLang's PoolName.KV: the anchor pool of plain MHA / MLA models
_STAND_IN = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32}
# a read's finishing step: given each page's result, copy the hits into the pool
Finish = Callable[[Sequence[bool]], None]


@dataclass(frozen=True)
class PageFormat:
    """What one page of a pool is in the store."""

    pool: str  # SGLang's pool name
    kind: str  # "mha" | "mla" (K/V or latent pools), else the host pool's class name
    layout: str
    dtype: str
    page_size: int  # tokens per page (host slots a page spans)
    frame_sizes: tuple[int, ...]  # bytes of each frame of a page, in the pool's order
    copied: bool  # True: stored through the flat page API (one frame, copied)
    geometry: KVGeometry  # K/V and latent pools: the model's; others: an opaque page

    @property
    def page_bytes(self) -> int:
        return sum(self.frame_sizes)

    @property
    def frames_per_page(self) -> int:
        return len(self.frame_sizes)

    @property
    def label(self) -> str:
        """The byte-order name that goes into the key namespace."""
        sizes = set(self.frame_sizes)
        if self.copied:
            plan = f"flat{self.page_bytes}"
        elif len(sizes) == 1:
            plan = f"{self.frames_per_page}x{self.frame_sizes[0]}"
        else:
            plan = "+".join(map(str, self.frame_sizes))
        head = "sglang" if self.pool == KV_POOL else f"sglang-{self.pool}"
        return f"{head}-{self.kind}-{self.layout}-{self.dtype}-{plan}"


def describe_pool(pool: Any, name: str = KV_POOL) -> PageFormat:
    """The page format of SGLang host pool ``pool`` registered as ``name``. Raises
    :class:`ConfigError` for a pool whose pages this backend cannot store."""
    name = str(name)
    if getattr(pool, "dcp_size", 1) != 1:
        raise ConfigError(f"pagekv: SGLang host pool {name}: decode context parallel (DCP) "
                          "pools are not supported")  # fmt: skip
    page = int(getattr(pool, "page_size", 1) or 1)
    kind, layout = _kind(pool), str(getattr(pool, "layout", "none"))
    sizes, copied = _frame_sizes(pool, name, page)
    geometry = _kv_geometry(pool, kind, page) if kind in ("mha", "mla") else None
    geometry = geometry or _opaque_geometry(sum(sizes))
    return PageFormat(name, kind, layout, _dtypes(pool, kind), page, sizes, copied, geometry)


def _dtypes(pool: Any, kind: str) -> str:
    """The element types of a page: the pool's ``dtype`` for K/V and latent pools, else those
    of its buffers in order (a Mamba pool keeps its temporal and conv states in two types)."""
    buffers = getattr(pool, "get_hybrid_pool_buffer", None)
    types = [getattr(pool, "dtype", None)]
    if kind not in ("mha", "mla") and callable(buffers):
        types = [getattr(t, "dtype", None) for t in _flatten(buffers())]
    names = [str(t).removeprefix("torch.") for t in types if t is not None]
    return "+".join(dict.fromkeys(names)) or "bytes"


def _kind(pool: Any) -> str:
    if hasattr(pool, "kv_lora_rank"):
        return "mla"
    if hasattr(pool, "head_num") and hasattr(pool, "v_buffer"):
        return "mha"
    return type(pool).__name__


def _frame_sizes(pool: Any, name: str, page: int) -> tuple[tuple[int, ...], bool]:
    """(frame sizes of one page, copied): the zero-copy frames of page 0 when the pool
    reports regions inside its buffers, else its flat page."""
    probe = torch.arange(page, dtype=torch.int64)
    try:
        ptrs, sizes = pool.get_page_buffer_meta(probe)
        regions = _Regions(pool)
        for ptr, size in zip(ptrs, sizes):
            regions.view(int(ptr), int(size))
        if sizes and len(ptrs) == len(sizes):
            return tuple(int(s) for s in sizes), False
    except Exception:  # a foreign pool's own refusal (layout, side state): its flat pages
        pass
    flat_api = ("get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page")
    try:
        if not all(callable(getattr(pool, method, None)) for method in flat_api):
            raise NotImplementedError("no flat page API")
        size = pool.get_dummy_flat_data_page().nbytes
    except Exception as e:
        raise ConfigError(
            f"pagekv: SGLang host pool {name} ({type(pool).__name__}, layout "
            f"{getattr(pool, 'layout', None)!r}) has neither page regions nor flat pages: {e}"
        ) from None
    if not size:
        raise ConfigError(f"pagekv: SGLang host pool {name} has empty pages")
    return (int(size),), True


def _kv_geometry(pool: Any, kind: str, page: int) -> KVGeometry | None:
    """The pagekv geometry of a K/V or latent page. An element type pagekv does not name
    (SGLang keeps fp8 caches as uint8) is described by a stand-in of the same size; the real
    type is in :attr:`PageFormat.label`."""
    dtype = getattr(pool, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not hasattr(pool, "layer_num"):
        return None
    stand_in = dtype if dtype in SUPPORTED_DTYPES.values() else None
    stand_in = stand_in or _STAND_IN.get(dtype.itemsize)
    if stand_in is None:
        raise ConfigError(f"pagekv: SGLang host pool dtype {dtype} is not supported")
    try:
        if kind == "mla":
            return KVGeometry.mla(pool.layer_num, page, pool.kv_cache_dim, stand_in)
        return KVGeometry(pool.layer_num, page, pool.head_num, pool.head_dim, stand_in)
    except ValueError as e:  # a shape pagekv's geometry cannot describe
        raise ConfigError(f"pagekv: SGLang host pool of {kind} pages: {e}") from None


def _opaque_geometry(page_bytes: int) -> KVGeometry:
    """A page of ``page_bytes`` opaque bytes, for pools that are not K/V or latent caches: it
    names the page (rounded up to whole 4-byte words, as a geometry's rows are); the exact size
    is in the format's frame plan, part of the key namespace too."""
    return KVGeometry.mla(1, 1, -(-page_bytes // 4) * 4, _STAND_IN[1])


class PoolPages:
    """The pages of one host pool, as the frames a store client sends or fills.

    Zero-copy frames alias the pool's memory: frames handed to ``put_many`` must not change
    until the call returns (SGLang holds backed-up pages until the backend call returns); frames
    handed to ``get_many`` are written in place. Copied pools hand out fresh flat pages, and a
    read's :data:`Finish` copies the hits into the pool. Thread-safe (read-only after
    construction; the pool's own page API is called from the calling thread)."""

    def __init__(self, pool: Any, name: str = KV_POOL) -> None:
        self.pool = pool
        self.format = describe_pool(pool, name)
        self._regions = None if self.format.copied else _Regions(pool)

    def regions(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each of the pool's buffers pages are read from and written
        into in place (none for a copied pool): what a store backend registers."""
        return [] if self._regions is None else self._regions.regions()

    def sources(self, host_indices: torch.Tensor, num_pages: int) -> list[list[memoryview]]:
        """Per page, the frames to store. Raises :class:`InvalidPageError` for slots that do
        not name ``num_pages`` pages of this pool."""
        starts = self._starts(host_indices, num_pages)
        if self.format.copied:
            return [[_bytes_of(self.pool.get_data_page(s, flat=True))] for s in starts]
        return self._frames(host_indices, num_pages)

    def targets(
        self, host_indices: torch.Tensor, num_pages: int
    ) -> tuple[list[list[memoryview]], Finish]:
        """Per page, the frames to fill, and the step that finishes the read (given each
        page's result). Raises :class:`InvalidPageError` like :meth:`sources`."""
        starts = self._starts(host_indices, num_pages)
        if not self.format.copied:
            return self._frames(host_indices, num_pages), _nothing
        pages = [self.pool.get_dummy_flat_data_page() for _ in starts]

        def finish(ok: Sequence[bool]) -> None:
            for start, page, hit in zip(starts, pages, ok):
                if hit:
                    self.pool.set_from_flat_data_page(start, page)

        return [[_bytes_of(p)] for p in pages], finish

    def flat_frames(self, flat: torch.Tensor) -> list[memoryview]:
        """A legacy flat page (``get_data_page(i, flat=True)`` or ``get_dummy_flat_data_page()``)
        cut into the same frames, in the same order, as :meth:`sources` stores: values written
        by one path are read by the other. ``flat`` must be a contiguous CPU tensor of one page;
        the views alias it."""
        fmt = self.format
        if flat.device.type != "cpu" or not flat.is_contiguous():
            raise ValueError("a flat page must be a contiguous CPU tensor")
        data = _bytes_of(flat)
        if data.nbytes != fmt.page_bytes:
            raise ValueError(f"a flat page of {data.nbytes} bytes, expected {fmt.page_bytes}")
        return [data[o : o + size] for o, size in zip(_flat_offsets(fmt), fmt.frame_sizes)]

    def _starts(self, host_indices: torch.Tensor, num_pages: int) -> list[int]:
        page = self.format.page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != num_pages * page:
            count = host_indices.numel() if isinstance(host_indices, torch.Tensor) else "no"
            raise InvalidPageError(f"{count} host slots for {num_pages} pages of {page}")
        return host_indices[::page].tolist()

    def _frames(self, host_indices: torch.Tensor, num_pages: int) -> list[list[memoryview]]:
        fmt = self.format
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        step = fmt.frames_per_page
        if len(ptrs) != num_pages * step or tuple(sizes) != fmt.frame_sizes * num_pages:
            raise InvalidPageError("the host pool reported an unexpected page region list")
        views = [self._regions.view(int(p), int(s)) for p, s in zip(ptrs, sizes)]
        return [views[i : i + step] for i in range(0, len(views), step)]


class _Regions:
    """Byte views of a pool's CPU buffers (SGLang's ``get_hybrid_pool_buffer()``, else its
    ``kv_buffer``), looked up by address."""

    def __init__(self, pool: Any) -> None:
        buffers = getattr(pool, "get_hybrid_pool_buffer", None)
        tensors = _flatten(buffers() if callable(buffers) else [getattr(pool, "kv_buffer", None)])
        found: list[tuple[int, memoryview]] = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.numel():
                continue
            if not t.is_contiguous():
                continue
            start, end = t.data_ptr(), t.data_ptr() + t.nbytes
            if any(s <= start and end <= s + v.nbytes for s, v in found):
                continue
            found.append((start, _bytes_of(t)))
        found.sort(key=lambda r: r[0])
        if not found:
            raise ConfigError("pagekv: the host pool has no CPU buffer to read pages from")
        self._starts = [start for start, _ in found]
        self._views = [view for _, view in found]

    def regions(self) -> list[tuple[int, int]]:
        return [(start, view.nbytes) for start, view in zip(self._starts, self._views)]

    def view(self, ptr: int, size: int) -> memoryview:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or ptr - self._starts[i] + size > self._views[i].nbytes:
            raise InvalidPageError(f"page region at {ptr:#x} (+{size}) is outside the host pool")
        offset = ptr - self._starts[i]
        return self._views[i][offset : offset + size]


def _flatten(items: Any) -> list[Any]:
    out: list[Any] = []
    for item in items if isinstance(items, (list, tuple)) else [items]:
        out.extend(_flatten(item) if isinstance(item, (list, tuple)) else [item])
    return out


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _nothing(ok: Sequence[bool]) -> None:
    return None


def _flat_offsets(fmt: PageFormat) -> Sequence[int]:
    """Where frame j of a page starts in the flat page. The flat page is ``(2, L, P, H, D)``
    for MHA ``layer_first`` while its frames go K0, V0, K1, V1, ...; every other pool's flat
    page is its frames back to back (K then V, layer after layer, state after state)."""
    size, n = fmt.frame_sizes[0], fmt.frames_per_page
    if fmt.kind == "mha" and fmt.layout == "layer_first" and not fmt.copied:
        layers = n // 2
        return [(kv * layers + layer) * size for layer in range(layers) for kv in (0, 1)]
    offsets, at = [], 0
    for size in fmt.frame_sizes:
        offsets.append(at)
        at += size
    return offsets
