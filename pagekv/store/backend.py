"""The store behind the connector: one narrow interface, one adapter per kind of store, chosen
once from the store's address.

=================================  ==============================================================
address                            backend
=================================  ==============================================================
``tcp://host:port`` (or            pagekv store nodes (:class:`.client.AsyncStoreClient`): the
``host:port``, ``ipc://path``),    default, embedded, nothing to install; a list of endpoints is
a list of them, a ClientConfig     sharded over by rendezvous hashing
``mooncake://MASTER?metadata=...`` Mooncake Store through its Python client
(or a MooncakeConfig)              (:class:`pagekv.store.mooncake.MooncakeBackend`, the
                                   optional extra ``pagekv[mooncake]``)
=================================  ==============================================================

:func:`store_config` turns what a user wrote into the backend's frozen config (``ConfigError``
for anything else); :func:`open_backend` makes the backend. The connector (``KVConnector``,
``KVIndex``, fetch, write-back), the vLLM and SGLang adapters and the blocking
:class:`.client.blocking.StoreClient` only ever see a :class:`StoreBackend`.

The contract every backend keeps (the connector's guarantees rest on it):

* **Values.** A value is one bytes-like or a sequence of them (its frames, e.g. a page's K
  and V regions); one key, one checksum over all frames, verified on every read: a value that
  does not check out (corrupt, torn, stored under another key) is a miss, never returned.
* **Buffers.** ``put_many`` reads the caller's buffers and ``get_many(into=)`` writes them
  until the call *returns*; after that nothing touches them (a backend whose transfer cannot
  be abandoned waits for it before returning, also when the call is cancelled). Buffers
  registered with :meth:`StoreBackend.register` (the host pool, once) may be used for
  zero-copy transfers; others are still correct.
* **Failures are misses.** Data calls never raise on store trouble: a key that could not be
  read is a miss (False / None), written is ``Status.UNAVAILABLE`` (or ``NO_SPACE``), asked
  is counted in ``ExistsResult.unanswered``. Bad arguments raise ``ValueError``/``TypeError``
  before anything is sent. ``exists_many(answer_s=)`` answers within ``answer_s``.
* **Write-once.** ``put_many`` of a present key leaves the stored value; its status is
  ``EXISTS`` where the store says so, else ``OK`` (both mean: a valid value is stored under the
  key, not necessarily this one). ``delete_many`` removes a key wherever it is.
* **Loops.** Methods are coroutines usable from any one event loop at a time; ``register``,
  ``routes``, ``nodes_down``, ``counters`` and ``close`` are plain calls.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Union

from pagekv.errors import ConfigError

from .client.routing import ExistsResult
from .config import ClientConfig
from .mooncake.config import SCHEME as MOONCAKE_SCHEME
from .mooncake.config import MooncakeConfig
from .wire.protocol import MAX_KEY_BYTES, Status

__all__ = [
    "StoreBackend",
    "StoreConfig",
    "byte_views",
    "check_keys",
    "open_backend",
    "store_config",
]

#: a backend's frozen config: pagekv nodes' or Mooncake Store's
StoreConfig = Union[ClientConfig, MooncakeConfig]  # noqa: UP007 - a runtime alias


class StoreBackend(abc.ABC):
    """A store of checked, write-once values under byte keys (see the module docstring)."""

    #: "pagekv" (store nodes) or "mooncake": names the store tier (KV events' medium, logs)
    kind: str = "store"

    @property
    @abc.abstractmethod
    def endpoints(self) -> tuple[str, ...]:
        """Where the store is, for logs and diagnostics: one name per part that can be down
        (a pagekv node; Mooncake's master)."""

    @property
    @abc.abstractmethod
    def counters(self) -> dict[str, int]:
        """Counts of what happened (failures, misses by cause, traffic)."""

    def register(self, address: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Declare ``nbytes`` of host memory at ``address`` (a host pool, once, before its
        first transfer) as a zero-copy source and destination. Its owner keeps it allocated
        until :meth:`close`. No-op where the store needs nothing (pagekv nodes)."""

    def nodes_down(self) -> list[bool]:
        """Per :attr:`endpoints` entry, whether it failed lately and is backed off."""
        return [False] * len(self.endpoints)

    def home_down(self, key: bytes) -> bool:
        """Whether the part of the store that holds ``key`` first is down (failed lately and
        backed off): a "not found" for ``key`` then came from elsewhere and is not sure.
        Here: any part (a backend that places keys itself says which)."""
        return any(self.nodes_down())

    @abc.abstractmethod
    async def exists_many(
        self, keys: Sequence[bytes], *, answer_s: float | None = None
    ) -> ExistsResult:
        """Which keys are stored; keys the store could not answer for within ``answer_s``
        (default: the backend's timeout) are not found and counted as unanswered."""

    @abc.abstractmethod
    async def get_many(
        self,
        keys: Sequence[bytes],
        into: Sequence[Any] | None = None,
        on_arrival: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """With ``into`` (per key a writable buffer or a sequence of them, one per frame):
        fill them and return a bool per key (after a miss ``into[i]`` holds unspecified
        bytes). Without: per found key a read-only memoryview (one frame) or a list of them,
        None per miss. ``on_arrival(i)`` runs on the caller's loop as soon as key i is
        verified and in place; if it raises, the call stops and raises that error once
        nothing writes into ``into`` any more."""

    @abc.abstractmethod
    async def put_many(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        """Store each value under its key; a status per key (``OK``/``EXISTS``: stored)."""

    @abc.abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete each key; True where it was stored."""

    @abc.abstractmethod
    async def ping(self, *, answer_s: float | None = None) -> list[bool]:
        """Per :attr:`endpoints` entry, whether it answers now (connecting if need be);
        ``answer_s``: one that has not answered within it counts as not answering."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and threads; calls in flight fail (idempotent)."""


def byte_views(value: Any, writable: bool, what: str) -> list[memoryview]:
    """A value's frames as flat byte views: one bytes-like, or a sequence of them (``TypeError``
    / ``ValueError`` naming ``what`` otherwise)."""
    if (type(value) is bytes and not writable) or type(value) is bytearray:
        return [memoryview(value)]  # flat bytes already (a bytearray's view is writable)
    if type(value) is memoryview and value.format == "B" and value.ndim == 1:
        if writable and value.readonly:
            raise ValueError(f"{what}: a read-only buffer cannot be read into")
        return [value]  # already flat bytes (a host page's view): the same view, no new one
    try:
        views = [memoryview(value)]
    except TypeError:
        if not isinstance(value, Sequence) or isinstance(value, str):
            msg = f"{what}: not a bytes-like or a sequence of them: {value!r:.60}"
            raise TypeError(msg) from None
        views = [memoryview(frame) for frame in value]
        if not views:
            raise ValueError(f"{what}: a value needs at least one frame") from None
    if writable and any(v.readonly for v in views):
        raise ValueError(f"{what}: a read-only buffer cannot be read into")
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def check_keys(keys: Sequence[bytes], buffers: Sequence[Any] | None, what: str) -> None:
    lengths = list(map(len, keys)) if set(map(type, keys)) <= {bytes} else None
    if lengths is None or (lengths and not 0 < min(lengths) <= max(lengths) <= MAX_KEY_BYTES):
        bad = next(k for k in keys if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES)
        raise ValueError(f"keys must be non-empty bytes of <= {MAX_KEY_BYTES}, got {bad!r:.40}")
    if buffers is not None and len(buffers) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} {what}")


def store_config(
    spec: Any, *, replicas: int | None = None, timeout_s: float | None = None
) -> StoreConfig:
    """The backend config of ``spec``: a :class:`ClientConfig` or ``MooncakeConfig`` as it is,
    else an address or a list of them (see the module docstring). ``replicas`` and
    ``timeout_s`` apply to addresses (a config keeps its own). Raises ``ConfigError`` naming
    the problem."""
    if isinstance(spec, (ClientConfig, MooncakeConfig)):
        return spec
    addresses = (spec,) if isinstance(spec, str) else spec
    if not isinstance(addresses, (list, tuple)) or not addresses:
        raise ConfigError(f"a store is an address or a non-empty list of them, got {spec!r}")
    if not all(isinstance(a, str) for a in addresses):
        raise ConfigError(f"store addresses must be strings, got {addresses!r}")
    mooncake = [a for a in addresses if a.startswith(MOONCAKE_SCHEME)]
    if mooncake:
        if len(addresses) != 1:
            raise ConfigError("a mooncake:// store is one address (its master), not a list "
                              f"mixed with others: {list(addresses)}")  # fmt: skip
        return MooncakeConfig.parse(mooncake[0], replicas=replicas, timeout_s=timeout_s)
    kwargs: dict[str, Any] = {}
    if replicas is not None:
        kwargs["replicas"] = replicas
    if timeout_s is not None:
        kwargs["timeout_s"] = timeout_s
    try:
        return ClientConfig(tuple(addresses), **kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def open_backend(spec: Any) -> StoreBackend:
    """The backend for ``spec`` (anything :func:`store_config` takes), chosen once here."""
    cfg = store_config(spec)
    if isinstance(cfg, ClientConfig):
        from .client.client import AsyncStoreClient

        return AsyncStoreClient(cfg.endpoints, config=cfg)
    from .mooncake.backend import MooncakeBackend

    return MooncakeBackend(cfg)
