"""An asyncio event loop in a daemon thread: where a :class:`.blocking.StoreClient` runs its
:class:`.client.AsyncStoreClient`, and the connector its store I/O (never on an engine's
thread)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")
log = logging.getLogger("pagekv.store")


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

    def call_to_end(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it; if this thread is interrupted meanwhile
        (``KeyboardInterrupt``, any exception raised into the wait), the coroutine is cancelled
        and waited for before the interruption goes on: when this returns or raises, the
        coroutine is over (it may own buffers of the caller's)."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        ended = threading.Event()
        task: list[asyncio.Task] = []

        def finish(t: asyncio.Task) -> None:
            if t.cancelled():
                result.cancel()
            elif t.exception() is not None:
                result.set_exception(t.exception())
            else:
                result.set_result(t.result())
            ended.set()

        def start() -> None:
            task.append(self.loop.create_task(coro))
            task[0].add_done_callback(finish)

        self.loop.call_soon_threadsafe(start)
        try:
            return result.result()
        except BaseException:
            # after start() (the loop runs these callbacks in order): the task exists
            self.loop.call_soon_threadsafe(lambda: task[0].cancel())
            while not ended.wait(1.0):  # an interrupted wait goes on waiting
                pass
            raise

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
