"""Page-first host pool: one buffer of page blocks, each holding one page's KV for all layers.

Layout of ``HostPagePool.buffer`` (dtype = geometry.dtype):

* MHA: ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` (per layer K rows,
  then V rows);
* MLA: ``[num_pages, num_layers, page_size, head_dim]``.

Page ``i`` is the contiguous byte range ``[i * page_bytes, (i + 1) * page_bytes)``: one page =
one block = one key, sent and received as one frame.

Memory is page-locked when CUDA is available so GPU kernels read and write it in place. Torch's
pinned allocator rounds each request up to a power of two (a 40 GiB pool would take 64 GiB), so
the pool allocates ordinary memory and registers it with ``cudaHostRegister`` in chunks of
whole pages instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pagekv.errors import InvalidPageError, PoolExhausted
from pagekv.geometry import KVGeometry

__all__ = ["HostPagePool", "InvalidPageError", "PoolExhausted"]

log = logging.getLogger(__name__)
_REGISTER_CHUNK_BYTES = 1 << 30
_CUDA_HOST_REGISTER_PORTABLE = 1


def _register_pinned(tensor: torch.Tensor, chunk_bytes: int) -> list[tuple[int, int]]:
    """Page-lock ``tensor``'s memory with cudaHostRegister, chunk by chunk; returns regions."""
    cudart = torch.cuda.cudart()
    base, total = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    regions: list[tuple[int, int]] = []
    for start in range(0, total, chunk_bytes):
        size = min(chunk_bytes, total - start)
        err = cudart.cudaHostRegister(base + start, size, _CUDA_HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            _unregister(regions)
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed with cudaError {err}")
        regions.append((base + start, size))
    return regions


def _unregister(regions: list[tuple[int, int]]) -> None:
    cudart = torch.cuda.cudart()
    for ptr, _ in regions:
        cudart.cudaHostUnregister(ptr)
    regions.clear()


class HostPagePool:
    """A fixed number of page blocks in (pinned) host memory with a free-page allocator.

    ``pin=None`` pins when CUDA is available. Thread-safe. The pool owns its memory; views it
    hands out stay valid until :meth:`close` and must not be used after it.
    """

    def __init__(self, geometry: KVGeometry, num_pages: int, *, pin: bool | None = None) -> None:
        if not isinstance(geometry, KVGeometry):
            raise TypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_bytes = geometry.page_bytes
        self.buffer = torch.empty((num_pages, *geometry.host_page_shape), dtype=geometry.dtype)
        self._bytes: np.ndarray = self.buffer.view(torch.uint8).view(num_pages, -1).numpy()
        self._flat = memoryview(self._bytes.reshape(-1))  # page_views slices it: no numpy call
        self._regions: list[tuple[int, int]] = []
        pin = torch.cuda.is_available() if pin is None else pin
        if pin:
            chunk = max(1, _REGISTER_CHUNK_BYTES // self.page_bytes) * self.page_bytes
            self._regions = _register_pinned(self.buffer, chunk)
        self.is_pinned = bool(self._regions)
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._in_use = np.zeros(num_pages, dtype=bool)

    @property
    def address(self) -> int:
        """Where the pool's memory starts (page ``i`` at ``address + i * page_bytes``): what a
        store backend registers for zero-copy transfers."""
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    # ---- allocation ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages. Raises ``PoolExhausted`` (taking none) if fewer are free.

        Page contents are whatever was there before: callers overwrite before reading.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"alloc(n): n must be a non-negative int, got {n!r}")
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(
                    f"host pool exhausted: {n} pages requested, {len(self._free)} of "
                    f"{self.num_pages} free"
                )
            pages = [self._free.pop() for _ in range(n)]
            self._in_use[pages] = True
            return pages

    def free(self, page_ids: Iterable[int]) -> None:
        """Return pages to the pool. All ids are checked first; on error none is freed.

        Raises ``InvalidPageError`` for an id out of range, not allocated, or repeated.
        """
        pages = list(page_ids)
        with self._lock:
            self._check_allocated(pages, "free")
            self._in_use[pages] = False
            self._free.extend(reversed(pages))

    def is_allocated(self, page_id: int) -> bool:
        self.check_page_id(page_id)
        return bool(self._in_use[page_id])

    def check_page_id(self, page_id: int) -> None:
        """Raise ``InvalidPageError`` unless ``page_id`` is an int in ``[0, num_pages)``."""
        if isinstance(page_id, bool) or not isinstance(page_id, (int, np.integer)):
            raise InvalidPageError(f"page id must be an int, got {page_id!r}")
        if not 0 <= page_id < self.num_pages:
            raise InvalidPageError(f"page id {page_id} is not in [0, {self.num_pages})")

    def _check_allocated(self, pages: list[int], what: str) -> None:
        for p in pages:
            self.check_page_id(p)
        if len(set(pages)) != len(pages):
            raise InvalidPageError(f"{what}: page ids repeat in {pages}")
        for p in pages:
            if not self._in_use[p]:
                raise InvalidPageError(f"{what}: page {p} is not allocated (double free?)")

    # ---- views -----------------------------------------------------------------------------
    def page_view(self, page_id: int) -> memoryview:
        """Writable zero-copy ``memoryview`` (format 'B', ``page_bytes`` long) of one page.

        What the network layer sends from and receives into. The pool owns the memory.
        """
        return self.page_views([page_id])[0]

    def page_views(self, page_ids: Sequence[int]) -> list[memoryview]:
        """:meth:`page_view` of each id, all checked first (``InvalidPageError``): one slice of
        the pool's flat view per page, for the many pages of a fetch or a write-back."""
        for p in page_ids:
            self.check_page_id(p)
        pb, flat = self.page_bytes, self._flat
        return [flat[p * pb : (p + 1) * pb] for p in page_ids]

    def page_tensor(self, page_id: int) -> torch.Tensor:
        """Typed zero-copy view of one page, shape ``geometry.host_page_shape``."""
        self.check_page_id(page_id)
        return self.buffer[page_id]

    def close(self) -> None:
        """Unregister pinned memory. Views taken earlier must no longer be used."""
        if self._regions:
            _unregister(self._regions)
            self.is_pinned = False

    def __del__(self) -> None:
        if getattr(self, "_regions", None):
            try:
                self.close()
            except RuntimeError as e:  # interpreter shutdown: CUDA may be gone
                log.debug("host pool unregister at exit failed: %s", e)

    def __repr__(self) -> str:
        return (
            f"HostPagePool({self.geometry.describe()}, pages={self.num_pages}, "
            f"free={self.num_free}, pinned={self.is_pinned})"
        )
