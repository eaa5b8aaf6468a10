"""One blocking store client per calling thread, and the backend's counters.

SGLang's cache controller calls the backend from three threads at once (prefetch query,
prefetch I/O, backup); each thread gets its own :class:`StoreClient` (its own connections, its
own view of node health), created on its first call. When a blocking call returns, nothing
touches the host pool's pages any more (a timed-out request's socket is closed, a late reply
cannot land in a page SGLang has since reused).
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

from pagekv.errors import ConnectorClosed
from pagekv.store import ClientConfig, StoreClient
from pagekv.store.backend import StoreConfig

__all__ = ["BackendStats", "ThreadClients"]


class ThreadClients:
    """A :class:`StoreClient` per thread. Clients of threads that have exited are closed
    when the next one is made; :meth:`close` closes all (call it with no call in flight).
    Memory given to :meth:`register` (SGLang's host pools) is registered with every client's
    backend (Mooncake: once, its clients of a process share one Mooncake client)."""

    def __init__(self, config: ClientConfig | StoreConfig) -> None:
        self.config = config
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clients: list[tuple[weakref.ref, StoreClient]] = []
        self._regions: dict[int, int] = {}
        self._closed = False

    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            self._regions[address] = nbytes
            clients = [c for _, c in self._clients]
        for client in clients:
            client.register(address, nbytes)

    def get(self) -> StoreClient:
        """This thread's client. Raises :class:`ConnectorClosed` after :meth:`close`."""
        client = getattr(self._local, "client", None)
        if client is not None and not self._closed:
            return client
        with self._lock:
            if self._closed:
                raise ConnectorClosed("the pagekv SGLang backend is closed")
            for ref, old in [c for c in self._clients if not _alive(c[0]())]:
                old.close()
                self._clients.remove((ref, old))
            if isinstance(self.config, ClientConfig):
                client = StoreClient(self.config.endpoints, config=self.config)
            else:
                client = StoreClient(self.config)
            for address, nbytes in self._regions.items():
                client.register(address, nbytes)
            self._clients.append((weakref.ref(threading.current_thread()), client))
        self._local.client = client
        return client

    def all_down(self, client: StoreClient) -> bool:
        """Whether ``client`` has found every node unreachable and is still backing off."""
        return all(client.nodes_down())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
        for _, client in clients:
            client.close()


def _alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()


class BackendStats:
    """Thread-safe counters: per operation calls, pages, hits, misses, bytes, errors and
    latency; plus the per-call samples SGLang's storage metrics want (drained by
    :meth:`drain_samples`, at most ``max_samples`` kept)."""

    OPS = ("exists", "get", "set")

    def __init__(self, max_samples: int = 4096) -> None:
        self._lock = threading.Lock()
        self._ops = {op: collections.Counter() for op in self.OPS}
        self._max_latency = dict.fromkeys(self.OPS, 0.0)
        self._samples = {
            name: collections.deque(maxlen=max_samples)
            for name in ("prefetch_pgs", "prefetch_bandwidth", "backup_pgs", "backup_bandwidth")
        }
        self.in_flight = 0
        self.max_in_flight = 0  # most calls seen running at once (the controller's threads)

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def end(self, op: str, seconds: float, **counts: int) -> None:
        """Record one finished call of ``op`` (counts: pages, hits, misses, bytes, ...)."""
        with self._lock:
            self.in_flight -= 1
            ops = self._ops[op]
            ops["calls"] += 1
            ops.update(counts)
            ops["latency_us"] += int(seconds * 1e6)
            self._max_latency[op] = max(self._max_latency[op], seconds)
            done = counts.get("hits", 0) if op == "get" else counts.get("stored", 0)
            if op != "exists" and done:
                kind = "prefetch" if op == "get" else "backup"
                self._samples[f"{kind}_pgs"].append(done)
                gbps = counts.get("bytes", 0) / max(seconds, 1e-9) / 1e9
                self._samples[f"{kind}_bandwidth"].append(gbps)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"in_flight": self.in_flight, "max_in_flight": self.max_in_flight}
            for op, counts in self._ops.items():
                entry = dict(counts)
                calls = counts.get("calls", 0)
                entry["mean_latency_ms"] = counts.get("latency_us", 0) / 1e3 / calls if calls else 0
                entry["max_latency_ms"] = self._max_latency[op] * 1e3
                out[op] = entry
            return out

    def drain_samples(self) -> dict[str, list]:
        with self._lock:
            out = {name: list(d) for name, d in self._samples.items()}
            for d in self._samples.values():
                d.clear()
            return out
