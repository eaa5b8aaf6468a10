""":class:`StoreClient`: the store client for synchronous callers, a thin wrapper around a
:class:`~pagekv.store.backend.StoreBackend` (pagekv nodes' :class:`.client.AsyncStoreClient`,
or Mooncake Store's backend for a ``mooncake://`` address) and an event loop of its own (see
:mod:`.client` and :mod:`pagekv.store.backend` for the contract of every call).

Each method runs the async client's call to its end on that loop, on the calling thread (no
thread hand-off: on a busy 2-core machine a hop to a loop thread added ~0.8 ms to every call;
``on_arrival`` callbacks run on the calling thread). A thread that is itself running an event
loop (a notebook, an async program) cannot run another: there the call runs the client's loop on
a helper thread while the caller waits. Either way, when a method returns or raises the call is
over: nothing writes into its buffers any more, also when the calling thread is interrupted
(``KeyboardInterrupt``) while it waits, for the call is then cancelled and run to its end
first. Not thread-safe: one client per thread (its calls must not overlap).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from ..backend import StoreBackend, open_backend
from ..config import ClientConfig
from ..wire.protocol import Status
from .client import AsyncStoreClient
from .routing import ExistsResult, Router
from .transport import Route

__all__ = ["StoreClient"]

T = TypeVar("T")


class StoreClient:
    """Blocking client; takes the arguments of :class:`.client.AsyncStoreClient` (pagekv
    nodes), or a ``mooncake://`` address or ``MooncakeConfig`` alone, or a
    :class:`StoreBackend` (then owned by this client: closed with it)."""

    def __init__(self, endpoints: Any, **kwargs: Any) -> None:
        if isinstance(endpoints, StoreBackend):
            self._client: Any = endpoints
        elif not kwargs and _is_mooncake(endpoints):
            self._client = open_backend(endpoints)
        else:
            self._client = AsyncStoreClient(endpoints, **kwargs)
        self.backend: StoreBackend = self._client
        self.config: ClientConfig | Any = self._client.config
        self._loop = asyncio.new_event_loop()
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        weakref.finalize(self, _end, self._loop, None)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this StoreClient is closed")
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop runs on this thread: run the client's here
            return _run_to_end(self._loop, coro)
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, "pagekv-store-client")
        job = self._helper.submit(_run_to_end, self._loop, coro)
        try:
            return job.result()
        except BaseException:
            if not job.done():  # interrupted while waiting: the call stops, then this raises
                self._loop.call_soon_threadsafe(_cancel_all, self._loop)
                concurrent.futures.wait([job])
            raise

    @property
    def counters(self) -> dict[str, int]:
        return self._client.counters

    @property
    def router(self) -> Router:
        """The client's routing state (node health, limits), pagekv nodes only: for tests and
        diagnostics."""
        return self._client.router

    def register(self, address: int, nbytes: int) -> None:
        self._client.register(address, nbytes)

    def routes(self) -> list[Route]:
        """pagekv nodes: per node, how its GETs travel (see :meth:`AsyncStoreClient.routes`)."""
        return self._client.routes()

    def nodes_down(self) -> list[bool]:
        return self._client.nodes_down()

    def put_many(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        return self._call(self._client.put_many(keys, buffers))

    def get_many(
        self,
        keys: Sequence[bytes],
        into: Sequence[Any] | None = None,
        on_arrival: Callable[[int], None] | None = None,
    ) -> list[Any]:
        return self._call(self._client.get_many(keys, into, on_arrival))

    def exists_many(self, keys: Sequence[bytes], *, answer_s: float | None = None) -> ExistsResult:
        return self._call(self._client.exists_many(keys, answer_s=answer_s))

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self._call(self._client.delete_many(keys))

    def stats(self) -> list[dict | None]:
        return self._call(self._client.stats())

    def ping(self, *, answer_s: float | None = None) -> list[bool]:
        return self._call(self._client.ping(answer_s=answer_s))

    def close(self) -> None:
        """Close the connections and the loop (idempotent)."""
        _end(self._loop, self._client)
        if self._helper is not None:
            self._helper.shutdown(wait=False)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_mooncake(spec: Any) -> bool:
    from ..mooncake.config import SCHEME, MooncakeConfig

    return isinstance(spec, MooncakeConfig) or (isinstance(spec, str) and spec.startswith(SCHEME))


def _run_to_end(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on ``loop`` (on this thread) until it is over; if this thread is
    interrupted meanwhile, cancel it and run the loop until it has stopped, then re-raise."""
    task = loop.create_task(coro)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        task.cancel()
        while not task.done():
            try:
                loop.run_until_complete(asyncio.wait([task]))
            except BaseException:  # interrupted again: the call must still stop first
                task.cancel()
        if not task.cancelled():
            task.exception()  # retrieved: the error raised here is the one that counts
        raise


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def _end(loop: asyncio.AbstractEventLoop, client: AsyncStoreClient | None) -> None:
    """Close ``client`` (its sockets), end the loop's remaining tasks and close the loop; on a
    thread of its own when this one runs an event loop (which cannot run another)."""
    if loop.is_closed() or loop.is_running():
        return

    def end() -> None:
        async def shutdown() -> None:
            if client is not None:
                client.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        loop.run_until_complete(shutdown())
        loop.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        end()
        return
    thread = threading.Thread(target=end, name="pagekv-store-client-close")
    thread.start()
    thread.join()


for _name in ("put_many", "get_many", "exists_many", "delete_many", "stats", "ping",
              "nodes_down"):  # fmt: skip
    getattr(StoreClient, _name).__doc__ = getattr(AsyncStoreClient, _name).__doc__
