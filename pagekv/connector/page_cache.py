"""The host tier: key -> page index over a :class:`HostPagePool`, LRU order, reference counts.

A page is in one of three states:

* *private*: allocated by :meth:`PageCache.allocate`, held (refcount >= 1), not indexed; being
  filled by a save or a fetch. Released to zero, it returns to the pool's free list.
* *cached*: indexed under a key. Held pages (refcount >= 1: being loaded to the GPU, being
  sent) are never evicted or reused; unheld ones sit in LRU order and are evicted, oldest
  first, when :meth:`allocate` runs out of free pages.
* *free*: in the pool's free list.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .host_pool import HostPagePool, InvalidPageError, PoolExhausted

__all__ = ["PageCache"]


class PageCache:
    """Thread-safe index of the host pool's pages by key (see module docstring)."""

    def __init__(self, pool: HostPagePool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> page; oldest first
        self._key_of: dict[int, bytes] = {}  # page -> key for cached pages
        self._refs: dict[int, int] = {}  # page -> holders, for held pages only
        self.num_evictions = 0

    # ---- queries (no side effects) ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` cached. Does not touch LRU order or references."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._lru:
                    return i
            return len(keys)

    def refcount(self, page_id: int) -> int:
        return self._refs.get(page_id, 0)

    @property
    def num_held(self) -> int:
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        with self._lock:
            return sum(1 for p in self._key_of if p not in self._refs)

    # ---- holding cached pages --------------------------------------------------------------
    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """Hold the pages of the leading cached ``keys``; returns their ids (maybe fewer than
        ``keys``: it stops at the first miss). Each held page must be :meth:`release` d once.
        Touches LRU order."""
        with self._lock:
            pages = []
            for key in keys:
                page = self._lru.get(key)
                if page is None:
                    break
                self._lru.move_to_end(key)
                self._refs[page] = self._refs.get(page, 0) + 1
                pages.append(page)
            return pages

    def release(self, page_ids: Iterable[int]) -> None:
        """Drop one hold on each page. A private page whose last hold goes returns to the pool.

        All ids are checked first; raises ``InvalidPageError`` if one is not held (as often as
        it appears), and then releases none.
        """
        pages = list(page_ids)
        with self._lock:
            need: dict[int, int] = {}
            for p in pages:
                self.pool.check_page_id(p)
                need[p] = need.get(p, 0) + 1
            for p, n in need.items():
                if self._refs.get(p, 0) < n:
                    raise InvalidPageError(
                        f"release: page {p} released {n}x but held {self._refs.get(p, 0)}x"
                    )
            to_free = []
            for p, n in need.items():
                left = self._refs[p] - n
                if left:
                    self._refs[p] = left
                    continue
                del self._refs[p]
                if p not in self._key_of:
                    to_free.append(p)
            if to_free:
                self.pool.free(to_free)

    # ---- new pages -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` private held pages, evicting unheld cached pages oldest first if needed.

        Raises ``PoolExhausted`` (allocating and evicting nothing) when free plus evictable
        pages are fewer than ``n``.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate(n): n must be a non-negative int, got {n!r}")
        with self._lock:
            short = n - self.pool.num_free
            if short > 0:
                victims = [k for k, p in self._lru.items() if p not in self._refs][:short]
                if len(victims) < short:
                    raise PoolExhausted(
                        f"host pool exhausted: {n} pages requested, {self.pool.num_free} free, "
                        f"{len(victims)} evictable, {len(self._refs)} held"
                    )
                self._evict_locked(victims)
            pages = self.pool.alloc(n)
            for p in pages:
                self._refs[p] = 1
            return pages

    def publish(self, key: bytes, page_id: int) -> bool:
        """Index a private held page under ``key``; the caller keeps its hold.

        Returns False, changing nothing, if ``key`` is already cached (the caller then
        releases its page, which goes back to the pool). Raises ``InvalidPageError`` if the
        page is not private and held.
        """
        if not isinstance(key, bytes) or not key:
            raise TypeError(f"key must be non-empty bytes, got {type(key).__name__}")
        with self._lock:
            self.pool.check_page_id(page_id)
            if page_id in self._key_of or page_id not in self._refs:
                raise InvalidPageError(f"publish: page {page_id} is not a private held page")
            if key in self._lru:
                return False
            self._lru[key] = page_id
            self._key_of[page_id] = key
            return True

    def evict(self, n: int) -> int:
        """Evict up to ``n`` unheld cached pages, oldest first; returns how many."""
        with self._lock:
            victims = [k for k, p in self._lru.items() if p not in self._refs][:n]
            self._evict_locked(victims)
            return len(victims)

    def remove(self, key: bytes) -> bool:
        """Drop ``key`` from the index (e.g. found corrupt). A held page is unindexed now and
        freed when its last hold is released. Returns whether the key was cached."""
        with self._lock:
            page = self._lru.pop(key, None)
            if page is None:
                return False
            del self._key_of[page]
            if page not in self._refs:
                self.pool.free([page])
            return True

    def _evict_locked(self, keys: list[bytes]) -> None:
        pages = [self._lru.pop(k) for k in keys]
        for p in pages:
            del self._key_of[p]
        self.pool.free(pages)
        self.num_evictions += len(pages)
