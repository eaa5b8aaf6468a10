"""KVIndex: what an engine's scheduler needs to know about the store, and nothing else.

No KV tensors, no host pool, no torch: a store client, the key namespaces of the ranks whose
pages a request needs, and a lookup bounded in time. The scheduler of a serving engine runs on
one thread and must never wait on the network longer than it budgets: :meth:`KVIndex.lookup`
returns within ``lookup_timeout_s`` whatever the store does, counts the failure and logs it at
most every few seconds. Back-off is per node, in the store client: a node that has not answered
a lookup within 3/4 of the bound is failed and backed off (0.25 s doubling to 8 s, reset by an
answer), its keys asked of their next node or counted as misses, while the other nodes keep
answering; a stopped or dead node costs one bound per back-off period, not one per lookup.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from pagekv.errors import ConfigError, ConnectorClosed, StoreError
from pagekv.store import ClientConfig
from pagekv.store.backend import StoreBackend, StoreConfig, open_backend, store_config

from .hashing import KeyNamespace, page_keys
from .loop import LoopThread, RateLimitedLog

__all__ = ["KVIndex", "client_config"]

log = logging.getLogger("pagekv.connector")


def client_config(store: StoreConfig | str | Sequence[str]) -> StoreConfig:
    """The store backend's config (:func:`pagekv.store.backend.store_config`): a
    :class:`ClientConfig` for pagekv nodes (a config, an endpoint or a list of them), a
    ``MooncakeConfig`` for a ``mooncake://`` address. ``ConfigError`` for anything else."""
    return store_config(store)


class KVIndex:
    """Bounded lookups of page keys in the store, for one or several namespaces (TP ranks).

    ``store``: a store config or address (see :func:`client_config`); the backend is chosen
    from it once, here (pagekv nodes or Mooncake Store), and is the connector's
    :attr:`store` (a :class:`~pagekv.store.backend.StoreBackend`).

    ``lookup`` answers the number of leading pages stored for *every* namespace (the minimum
    over ranks, so a hit is loadable on every rank). Thread-safe; store I/O runs on ``loop``
    (its own daemon thread if not given). Raises ``ConfigError``/``TypeError`` for bad
    arguments, ``ConnectorClosed`` after :meth:`close`; never raises on store trouble.
    """

    def __init__(
        self,
        namespaces: KeyNamespace | Sequence[KeyNamespace],
        store: StoreConfig | str | Sequence[str],
        *,
        lookup_timeout_s: float = 0.05,
        loop: LoopThread | None = None,
    ) -> None:
        ns = [namespaces] if isinstance(namespaces, KeyNamespace) else list(namespaces)
        if not ns or not all(isinstance(n, KeyNamespace) for n in ns):
            raise TypeError("namespaces must be a KeyNamespace or a non-empty list of them")
        if len({n.geometry.page_size for n in ns}) != 1:
            raise ConfigError("all namespaces of a KVIndex need the same page size")
        if isinstance(lookup_timeout_s, bool) or not lookup_timeout_s > 0:
            raise ConfigError(f"lookup_timeout_s must be > 0, got {lookup_timeout_s!r}")
        cfg = client_config(store)
        self.namespaces = ns
        self.page_size = ns[0].geometry.page_size
        self.lookup_timeout_s = float(lookup_timeout_s)
        self.counters: dict[str, int] = dict.fromkeys(
            ("lookups", "lookup_timeouts", "lookups_skipped", "store_errors"), 0
        )
        self._warn = RateLimitedLog(log)
        self._why = RateLimitedLog(log, 60.0)
        self._diagnosing = threading.Event()
        self._probe_config = cfg
        self._own_loop = loop is None
        self.loop = loop or LoopThread("pagekv-index")
        try:
            self.store: StoreBackend = self.loop.call(self._make_client(cfg), timeout=10)
        except BaseException:
            if self._own_loop:
                self.loop.close()
            raise
        self._closed = False

    @staticmethod
    async def _make_client(cfg: StoreConfig) -> StoreBackend:
        return open_backend(cfg)  # on the loop: a client's sockets belong to it

    def keys(self, token_ids: Any) -> list[list[bytes]]:
        """Page keys of ``token_ids`` in each namespace."""
        return [page_keys(token_ids, n) for n in self.namespaces]

    def lookup(
        self, token_ids: Any = None, *, keys: Sequence[Sequence[bytes]] | None = None
    ) -> int:
        """Tokens of the longest page-aligned prefix stored for every namespace.

        ``keys``: per namespace, its page keys (else computed from ``token_ids``). Returns
        within about ``lookup_timeout_s``; on timeout or store error, 0 (counted, logged).
        """
        if keys is None:
            if token_ids is None:
                raise ValueError("lookup needs token_ids or keys")
            keys = self.keys(token_ids)
        if len(keys) != len(self.namespaces):
            raise ValueError(f"keys: one list per namespace ({len(self.namespaces)}) expected")
        return self.lookup_pages([list(k) for k in keys]) * self.page_size

    def lookup_pages(self, keys: list[list[bytes]], timeout_s: float | None = None) -> int:
        """Leading pages stored for every key list (bounded, never raises on store trouble)."""
        found = self.found(keys, timeout_s) or []
        return next((i for i, f in enumerate(found) if not f), len(found))

    def found(self, keys: list[list[bytes]], timeout_s: float | None = None) -> list[bool] | None:
        """Per position ``i``: whether ``keys[r][i]`` is stored for every namespace ``r`` (the
        lists are cut to the shortest). None when the store could not answer (every key
        unanswered, or the bound passed): counted and logged, never raised."""
        if self._closed:
            raise ConnectorClosed("KVIndex is closed")
        self.counters["lookups"] += 1
        n = min(map(len, keys))
        if n == 0:
            return []
        flat = [k for ks in keys for k in ks[:n]]
        timeout = self.lookup_timeout_s if timeout_s is None else timeout_s
        found = self._exists(flat, timeout)
        if found is None or len(keys) == 1:
            return found
        per_rank = [found[r * n : (r + 1) * n] for r in range(len(keys))]
        return [all(flags) for flags in zip(*per_rank)]

    def _explain(self) -> None:
        if not isinstance(self._probe_config, ClientConfig):
            return  # the backend counts and logs its own failures (Mooncake: its master)
        if not self._diagnosing.is_set():  # say why, off the engine's thread
            self._diagnosing.set()
            threading.Thread(target=self._diagnose, name="pagekv-probe", daemon=True).start()

    def _diagnose(self) -> None:
        """Probe each node once and log what is wrong: "authentication failed" (a CURVE
        misconfiguration) reads differently from "unreachable" or "no answer"."""
        from pagekv.store.client.probe import Outcome, probe

        cfg = self._probe_config
        try:
            for ep in cfg.endpoints:
                result = probe(ep, curve=cfg.curve, timeout_s=min(cfg.timeout_s, 2.0))
                if result.outcome is not Outcome.OK:
                    self._why.warning("pagekv: store node %s: %s", ep, result)
        finally:
            self._diagnosing.clear()

    def connect(self, timeout_s: float) -> bool:
        """:meth:`unreachable` as a bool: True when every node answered within ``timeout_s``."""
        return not self.unreachable(timeout_s)

    def unreachable(self, timeout_s: float) -> list[str]:
        """Open the connections to every node now (and learn its limits), so that the first
        bounded lookup does not pay for them: the endpoints that did not answer a PING within
        ``timeout_s`` (they are then backed off as any node that failed). An engine calls
        this at start-up. Never raises on store trouble."""
        if self._closed:
            raise ConnectorClosed("KVIndex is closed")
        endpoints = list(self.store.endpoints)

        async def ask() -> list[bool]:
            try:  # each node's answer bounded on its own: a dead one fails only itself
                return await self.store.ping(answer_s=0.75 * timeout_s)
            except StoreError:
                return [False] * len(endpoints)

        try:
            answered = self.loop.call(ask(), timeout_s)
        except TimeoutError:
            answered = [False] * len(endpoints)
        return [ep for ep, ok in zip(endpoints, answered) if not ok]

    def _exists(self, keys: list[bytes], timeout_s: float) -> list[bool] | None:
        """Found flags within ``timeout_s``, or None when no node answered for any key: the
        lookup's bound passed, the store failed, or every key's node missed its answer bound
        (``0.75 * timeout_s``: such a node is backed off; its keys read as not found). Each is
        counted once, here on the caller's thread (a coroutine finishing as its bound passes
        counts nothing), and logged: it must not read as a plain miss."""
        exists = self.store.exists_many(keys, answer_s=0.75 * timeout_s)
        try:
            result = self.loop.call(exists, timeout_s)
        except TimeoutError:
            self.counters["lookup_timeouts"] += 1
            self._failed("pagekv: store lookup took over %.0f ms: counted as a miss",
                         timeout_s * 1e3)  # fmt: skip
            return None
        except StoreError as e:
            self._failed("pagekv: store lookup failed: %s", e)
            return None
        if result.unanswered == len(keys):
            self.counters["lookups_skipped"] += 1
            self._failed("pagekv: store lookup: no node answered (down, stopped or backed off): "
                         "counted as a miss")  # fmt: skip
            return None
        if result.unanswered:
            self.counters["store_errors"] += 1
        return result.found

    def _failed(self, message: str, *args: object) -> None:
        self.counters["store_errors"] += 1
        self._warn.warning(message, *args)
        self._explain()

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "store": dict(self.store.counters)}

    def close(self) -> None:
        """Close the store client (and the loop thread if this index made it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.loop.closed:
            self.loop.call_soon(self.store.close)
        if self._own_loop:
            self.loop.close()
