"""An asyncio event loop in a daemon thread: where the connector's store I/O runs, so that it
never runs on the engine's thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "RateLimitedLog"]

T = TypeVar("T")
log = logging.getLogger("pagekv.connector")


class LoopThread:
    """Owns one event loop and the thread that runs it. ``call`` runs a coroutine there from a
    synchronous caller; ``wrap`` awaits it from another loop. :meth:`close` cancels what is left
    and joins the thread (idempotent)."""

    def __init__(self, name: str = "pagekv-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it. On timeout the coroutine is cancelled and
        ``TimeoutError`` raised."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"timed out after {timeout} s") from None

    async def wrap(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (run on this loop) from any other loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self.call(_cancel_others(), timeout)
            except TimeoutError:
                log.warning("pagekv: loop tasks did not stop within %.1f s", timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class RateLimitedLog:
    """A warning at most every ``interval_s`` seconds; the lines skipped meanwhile are counted
    in the next one."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger, self.interval_s = logger, interval_s
        self._last = -float("inf")
        self._skipped = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._skipped += 1
                return
            skipped, self._skipped, self._last = self._skipped, 0, now
        suffix = f" ({skipped} similar messages suppressed)" if skipped else ""
        self.logger.warning(msg + suffix, *args)
