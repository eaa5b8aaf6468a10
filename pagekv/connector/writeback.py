"""Background write-back of saved pages to the store, bounded: when more than ``max_pages``
wait, the oldest pending write-backs are dropped (their pages stay in the host tier) and
counted, so a slow or dead store never blocks the engine."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from pagekv.store import Status, StoreError

__all__ = ["WriteBack"]

log = logging.getLogger("pagekv.connector")


class WriteBack:
    """Lives on the connector's loop: ``submit`` is called there (``call_soon_threadsafe``)."""

    def __init__(self, conn: Any, max_pages: int) -> None:
        if max_pages <= 0:
            raise ValueError(f"max_pending_writes must be > 0, got {max_pages}")
        self.conn, self.max_pages = conn, max_pages
        self.queue: collections.deque[tuple[list[tuple[bytes, int]], Any]] = collections.deque()
        self.queued_pages = 0
        self.counts = dict.fromkeys(("written", "skipped_present", "dropped", "failed"), 0)
        self._worker: asyncio.Task | None = None
        self._busy = 0

    def submit(self, pages: list[tuple[bytes, int]], event: Any) -> None:
        """Queue ``(key, held page)`` pairs; ``event`` (CUDA, or None) marks the host copy."""
        self.queue.append((pages, event))
        self.queued_pages += len(pages)
        while self.queued_pages > self.max_pages and len(self.queue) > 1:
            old, _ = self.queue.popleft()
            self.queued_pages -= len(old)
            self.counts["dropped"] += len(old)
            self.conn.cache.release([p for _, p in old])
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.queue:
            pages, event = self.queue.popleft()
            self.queued_pages -= len(pages)
            self._busy = len(pages)
            try:
                await self._write(pages, event)
            finally:
                self._busy = 0
                self.conn.cache.release([p for _, p in pages])

    async def _write(self, pages: list[tuple[bytes, int]], event: Any) -> None:
        while event is not None and not event.query():  # device -> host copy still running
            await asyncio.sleep(0.0005)
        store, pool = self.conn.store, self.conn.pool
        keys = [k for k, _ in pages]
        try:
            present = (await store.exists_many(keys)).found
            todo = [(k, p) for (k, p), found in zip(pages, present) if not found]
            self.counts["skipped_present"] += len(pages) - len(todo)
            if not todo:
                return
            status = await store.put_many(
                [k for k, _ in todo], [pool.page_view(p) for _, p in todo]
            )
        except StoreError as e:
            self.counts["failed"] += len(pages)
            log.warning("pagekv: write-back failed: %s", e)
            return
        stored = sum(1 for s in status if s in (Status.OK, Status.EXISTS))
        self.counts["written"] += stored
        self.counts["failed"] += len(todo) - stored
        self.conn.stats_counters["bytes_out"] += stored * pool.page_bytes

    async def drain(self) -> None:
        while self.queue or (self._worker is not None and not self._worker.done()):
            await asyncio.sleep(0.001)

    def stats(self) -> dict[str, int]:
        return {
            "writeback_queue_pages": self.queued_pages + self._busy,
            **{f"writeback_{k}": v for k, v in self.counts.items()},
        }
