"""The host tier: key -> page index over a :class:`HostPagePool`, reference counts, LRU eviction,
and page ownership tied to GPU completion.

A page is in one of three states:

* *private*: allocated by :meth:`PageCache.allocate`, held (refcount >= 1), not indexed; being
  filled by a save or a fetch. Released to zero, it returns to the pool's free list.
* *cached*: indexed under a key. Held pages (refcount >= 1: being loaded to the GPU, being
  sent, waited for by a prefetch) are never evicted or reused; unheld ones are *evictable*, in
  the order their last hold went (least recently used first). Eviction is O(1) per page.
* *free*: in the pool's free list.

GPU copies outlive the Python call that launched them, so a hold can be released *after an
event* (:meth:`release` with ``after=``): the pages stay held until every event's ``query()``
is true, or raises :class:`CopyFailed` (the transfer failed, and nothing touches the pages any
more). Pending releases are reaped on every allocation and on :meth:`reap`. A page published
while a device -> host copy still writes it carries that copy's event as its *ready event*
(:meth:`ready_events`): a reader must wait on it (a GPU-side ``wait_event``) before reading. A
page whose ready event failed holds no value: it is never published, or is dropped from the
index when a reader finds out (which gets :class:`CopyFailed`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from pagekv.errors import CopyFailed, InvalidPageError, PoolExhausted

from .host_pool import HostPagePool

__all__ = ["Completion", "PageCache"]


class Completion(Protocol):
    """What a release can wait for: a ``torch.cuda.Event`` or anything with ``query()``."""

    def query(self) -> bool: ...


def _done(event: Completion) -> bool | None:
    """True once ``event`` completed, False before, None when its transfer failed
    (:class:`CopyFailed`, raised only once nothing touches its pages any more)."""
    try:
        return bool(event.query())
    except CopyFailed:
        return None


def _pending(events: Iterable[Completion | None]) -> list[Completion]:
    """The events still running: a failed one lets its pages go like a completed one."""
    return [e for e in events if e is not None and _done(e) is False]


class PageCache:
    """Thread-safe index of the host pool's pages by key (see module docstring)."""

    def __init__(self, pool: HostPagePool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._page_of: dict[bytes, int] = {}  # key -> page, cached pages
        self._key_of: dict[int, bytes] = {}  # page -> key, cached pages
        self._refs: dict[int, int] = {}  # page -> holders, held pages only
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest first
        self._deferred: list[tuple[list[Completion], list[int]]] = []  # releases after events
        self._ready: dict[int, Completion] = {}  # cached page -> copy still writing it
        self.num_evictions = 0

    # ---- queries (no side effects) ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self._page_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._page_of

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` cached. Does not touch LRU order or references."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._page_of:
                    return i
            return len(keys)

    def refcount(self, page_id: int) -> int:
        return self._refs.get(page_id, 0)

    @property
    def num_held(self) -> int:
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_deferred(self) -> int:
        """Pages whose release waits on a GPU event."""
        with self._lock:
            return sum(len(pages) for _, pages in self._deferred)

    def available(self) -> int:
        """Pages an :meth:`allocate` could take now (free + evictable, after reaping)."""
        with self._lock:
            self._reap_locked()
            return self.pool.num_free + len(self._evictable)

    def ready_events(self, page_ids: Iterable[int]) -> list[Completion]:
        """Events of copies still writing any of ``page_ids`` (distinct; done ones dropped).
        A reader makes its stream wait on each before reading the pages. Raises
        :class:`CopyFailed` when the copy that was to write one of them failed: those pages
        leave the index (their holds stay the reader's to release)."""
        with self._lock:
            out: dict[int, Completion] = {}
            state: dict[int, bool | None] = {}  # one query per distinct event (a save marks many)
            failed: list[int] = []
            for p in page_ids:
                event = self._ready.get(p)
                if event is None:
                    continue
                if id(event) not in state:
                    state[id(event)] = _done(event)
                if state[id(event)] is None:
                    failed.append(p)
                elif state[id(event)]:
                    del self._ready[p]
                else:
                    out[id(event)] = event
            for p in dict.fromkeys(failed):
                self._unindex_locked(p)
            if failed:
                raise CopyFailed(f"the copy that was to fill host pages {failed} failed")
            return list(out.values())

    # ---- holding cached pages --------------------------------------------------------------
    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """Hold the pages of the leading cached ``keys``; returns their ids (maybe fewer than
        ``keys``: it stops at the first miss). Each held page must be :meth:`release` d once."""
        with self._lock:
            pages = []
            for key in keys:
                page = self._page_of.get(key)
                if page is None:
                    break
                self._hold_locked(page)
                pages.append(page)
            return pages

    def acquire_each(self, keys: Sequence[bytes]) -> list[int | None]:
        """Hold the page of every cached key of ``keys`` (one lock for all): per key its page
        id, or None where it is not cached. Each id returned must be :meth:`release` d once."""
        with self._lock:
            pages: list[int | None] = []
            for key in keys:
                page = self._page_of.get(key)
                if page is not None:
                    self._hold_locked(page)
                pages.append(page)
            return pages

    def hold(self, page_id: int) -> None:
        """One more hold on a page that is already held (e.g. handed to a second owner)."""
        with self._lock:
            if page_id not in self._refs:
                raise InvalidPageError(f"hold: page {page_id} is not held")
            self._refs[page_id] += 1

    def _hold_locked(self, page: int) -> None:
        self._refs[page] = self._refs.get(page, 0) + 1
        self._evictable.pop(page, None)

    def release(
        self, page_ids: Iterable[int], *, after: Completion | Sequence[Completion] | None = None
    ) -> None:
        """Drop one hold on each page, now or once every event in ``after`` has completed.

        A private page whose last hold goes returns to the pool; a cached one becomes
        evictable. All ids are checked first; raises ``InvalidPageError`` if one is not held
        (as often as it appears), and then releases none.
        """
        pages = list(page_ids)
        events = after if isinstance(after, (list, tuple)) else [after]
        with self._lock:
            self._check_held(pages)
            waiting = _pending(events)
            if waiting:
                self._deferred.append((waiting, pages))
            else:
                self._release_locked(pages)
            self._reap_locked()

    def reap(self) -> int:
        """Release the deferred holds whose events have completed; returns how many pages."""
        with self._lock:
            return self._reap_locked()

    def _reap_locked(self) -> int:
        if not self._deferred:
            return 0
        done, keep = [], []
        for events, pages in self._deferred:
            events[:] = _pending(events)
            (keep if events else done).append((events, pages))
        self._deferred = keep
        for _, pages in done:
            self._release_locked(pages)
        return sum(len(p) for _, p in done)

    def _check_held(self, pages: list[int]) -> None:
        need: dict[int, int] = {}
        for p in pages:
            self.pool.check_page_id(p)
            need[p] = need.get(p, 0) + 1
        deferred: dict[int, int] = {}
        for _, held in self._deferred:
            for p in held:
                deferred[p] = deferred.get(p, 0) + 1
        for p, n in need.items():
            if self._refs.get(p, 0) - deferred.get(p, 0) < n:
                raise InvalidPageError(
                    f"release: page {p} released {n}x but held {self._refs.get(p, 0)}x "
                    f"({deferred.get(p, 0)} releases already pending)"
                )

    def _release_locked(self, pages: list[int]) -> None:
        to_free = []
        for p in pages:
            left = self._refs[p] - 1
            if left:
                self._refs[p] = left
                continue
            del self._refs[p]
            if p in self._key_of:
                self._evictable[p] = None
            else:
                to_free.append(p)
        if to_free:
            self.pool.free(to_free)

    # ---- new pages -------------------------------------------------------------------------
    def allocate(self, n: int, *, partial: bool = False) -> list[int]:
        """``n`` private held pages, evicting the least recently used unheld pages if needed.

        ``partial=False``: raises ``PoolExhausted`` (allocating and evicting nothing) when free
        plus evictable pages are fewer than ``n``. ``partial=True``: as many as can be had.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate(n): n must be a non-negative int, got {n!r}")
        with self._lock:
            self._reap_locked()
            have = self.pool.num_free + len(self._evictable)
            if n > have:
                if not partial:
                    raise PoolExhausted(
                        f"host pool exhausted: {n} pages requested, {self.pool.num_free} free, "
                        f"{len(self._evictable)} evictable, {len(self._refs)} held"
                    )
                n = have
            short = n - self.pool.num_free
            if short > 0:
                self._evict_locked(short)
            pages = self.pool.alloc(n)
            for p in pages:
                self._refs[p] = 1
            return pages

    def publish(self, key: bytes, page_id: int, *, ready: Completion | None = None) -> bool:
        """Index a private held page under ``key``; the caller keeps its hold. ``ready``: the
        event of a copy still writing the page (readers wait on it, see :meth:`ready_events`).

        Returns False, changing nothing, if ``key`` is already cached or ``ready`` failed (the
        caller then releases its page). Raises ``InvalidPageError`` if the page is not private
        and held.
        """
        if not isinstance(key, bytes) or not key:
            raise TypeError(f"key must be non-empty bytes, got {type(key).__name__}")
        with self._lock:
            self.pool.check_page_id(page_id)
            if page_id in self._key_of or page_id not in self._refs:
                raise InvalidPageError(f"publish: page {page_id} is not a private held page")
            if key in self._page_of:
                return False
            done = True if ready is None else _done(ready)
            if done is None:
                return False
            self._page_of[key] = page_id
            self._key_of[page_id] = key
            if not done:
                self._ready[page_id] = ready
            return True

    def evict(self, n: int) -> int:
        """Evict up to ``n`` unheld cached pages, least recently used first; returns how many."""
        with self._lock:
            self._reap_locked()
            return self._evict_locked(n)

    def remove(self, key: bytes) -> bool:
        """Drop ``key`` from the index (e.g. found corrupt). A held page is unindexed now and
        freed when its last hold is released. Returns whether the key was cached."""
        with self._lock:
            page = self._page_of.get(key)
            if page is None:
                return False
            self._unindex_locked(page)
            return True

    def _unindex_locked(self, page: int) -> None:
        """Take a cached page out of the index: freed now if unheld, else on its last release."""
        del self._page_of[self._key_of.pop(page)]
        self._ready.pop(page, None)
        if page in self._evictable:
            del self._evictable[page]
            self.pool.free([page])

    def _evict_locked(self, n: int) -> int:
        pages = []
        while self._evictable and len(pages) < n:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self._ready.pop(page, None)
            pages.append(page)
        if pages:
            self.pool.free(pages)
        self.num_evictions += len(pages)
        return len(pages)

    def describe(self) -> dict[str, Any]:
        return {
            "host_cached": len(self._page_of),
            "host_held": len(self._refs),
            "host_evictable": len(self._evictable),
            "host_free": self.pool.num_free,
            "host_deferred": self.num_deferred,
            "host_evictions": self.num_evictions,
        }
