"""Prometheus export of a connector's ``stats()`` (a KVConnector, a KVIndex, or anything with a
``stats() -> dict`` method), read at scrape time: the engine's step pays nothing for it.

Either into a registry the engine already serves (vLLM and SGLang expose prometheus_client's
default one)::

    from prometheus_client import REGISTRY
    register_stats(connector, REGISTRY, labels={"tp_rank": "0"})

or on a port of its own (``/metrics`` and ``/health``)::

    server = serve_stats(connector, port=9500)   # server.url; server.close()

Names: ``pagekv_connector_<key>`` (``_total`` for counters); a nested dict adds its key
(``store`` -> ``pagekv_connector_store_node_failures_total``). A key not listed below is
exported untyped rather than guessed, a non-numeric value is skipped. Collecting calls
``stats()`` from the HTTP thread: the source must allow that (KVConnector and KVIndex do).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagekv.store.node.metrics import HealthCheck, MetricsServer

__all__ = ["StatsCollector", "register_stats", "serve_stats"]

_GAUGES = frozenset(
    ("host_pages", "host_cached", "host_held", "host_evictable", "host_free", "host_deferred",
     "writeback_queue_pages")
)  # fmt: skip
_COUNTERS = frozenset(
    ("lookups", "lookup_tokens", "lookup_timeouts", "hit_tokens_host", "hit_tokens_store",
     "prefetches", "prefetch_seconds", "prefetch_pool_short", "bytes_in", "bytes_out", "saves",
     "save_pool_full", "store_errors", "pages_saved", "host_evictions", "writeback_written",
     "writeback_skipped_present", "writeback_dropped", "writeback_failed",
     "store_checksum_mismatch", "store_node_failures", "store_size_mismatch")
)  # fmt: skip


class HasStats(Protocol):
    def stats(self) -> Mapping[str, Any]: ...


class StatsCollector:
    """A prometheus_client collector over ``source.stats()``; ``labels`` are added to every
    sample (e.g. the engine and TP rank, so several connectors can share one Prometheus)."""

    def __init__(self, source: HasStats, prefix: str = "pagekv_connector",
                 labels: Mapping[str, str] | None = None) -> None:  # fmt: skip
        if not callable(getattr(source, "stats", None)):
            raise TypeError(f"{type(source).__name__} has no stats() method")
        self.source, self.prefix = source, prefix
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for key, value in _flatten(self.source.stats()):
            name = f"{self.prefix}_{key}"
            text = f"connector stat {key}"
            if key in _GAUGES:
                family: Metric = GaugeMetricFamily(name, text, labels=names)
            elif key in _COUNTERS:
                family = CounterMetricFamily(name, text, labels=names)
            else:
                family = Metric(name, text, "unknown")
                family.add_sample(name, dict(self.labels), value)
                yield family
                continue
            family.add_metric(values, value)
            yield family


def _flatten(stats: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    for key, value in stats.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}_")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + key, value


def register_stats(source: HasStats, registry: CollectorRegistry, *,
                   prefix: str = "pagekv_connector",
                   labels: Mapping[str, str] | None = None) -> StatsCollector:  # fmt: skip
    """Add ``source``'s stats to ``registry`` (unregister the returned collector to remove
    them). Raises ``ValueError`` when the registry already has these names."""
    collector = StatsCollector(source, prefix, labels)
    registry.register(collector)
    return collector


def serve_stats(source: HasStats, port: int, *, host: str = "127.0.0.1",
                prefix: str = "pagekv_connector", labels: Mapping[str, str] | None = None,
                health: HealthCheck | None = None) -> MetricsServer:  # fmt: skip
    """Serve ``source``'s stats on ``http://host:port/metrics`` (port 0: a free one, see
    ``.port``) from a daemon thread, with ``/health`` (``health()``, default always ok)."""
    registry = CollectorRegistry()
    register_stats(source, registry, prefix=prefix, labels=labels)
    return MetricsServer(registry, host, port, health)
