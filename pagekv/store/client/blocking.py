""":class:`StoreClient`: the store client for synchronous callers, a thin wrapper that runs an
:class:`.client.AsyncStoreClient` on an event loop thread of its own (one thread per client;
see :mod:`.client` for the contract of every call).

Each method runs the async client's call there and waits for it. When a method returns or
raises, the call is over: nothing writes into its buffers any more, also when the calling thread
is interrupted (``KeyboardInterrupt``) while it waits, for the call is then cancelled and waited
for first. Several threads may call one client at once (their calls run concurrently on its
loop); ``on_arrival`` callbacks run on that loop's thread while the caller waits.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from ..config import ClientConfig
from ..wire.protocol import Status
from .client import AsyncStoreClient
from .loop import LoopThread
from .routing import ExistsResult, Router
from .transport import Route

__all__ = ["StoreClient"]

T = TypeVar("T")


class StoreClient:
    """Blocking client; takes the arguments of :class:`.client.AsyncStoreClient`."""

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        self._client = AsyncStoreClient(endpoints, **kwargs)
        self.config: ClientConfig = self._client.config
        self._loop = LoopThread("pagekv-store-client")

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.call_to_end(coro)

    @property
    def counters(self) -> dict[str, int]:
        return self._client.counters

    @property
    def router(self) -> Router:
        """The client's routing state (node health, limits): for tests and diagnostics."""
        return self._client.router

    def routes(self) -> list[Route]:
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

    def ping(self) -> list[bool]:
        return self._call(self._client.ping())

    def close(self) -> None:
        """Close the connections (on the loop, which owns them) and end the loop's thread."""
        if self._loop.closed:
            return

        async def close() -> None:
            self._client.close()

        self._loop.call(close())
        self._loop.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


for _name in ("put_many", "get_many", "exists_many", "delete_many", "stats", "ping", "routes",
              "nodes_down"):  # fmt: skip
    getattr(StoreClient, _name).__doc__ = getattr(AsyncStoreClient, _name).__doc__
