"""Prometheus metrics of a store node, served with ``/health`` on ``--metrics-port``.

:class:`NodeCollector` turns the node's :meth:`StoreNode.stats` (and its connection monitor's
counts) into metric families at scrape time, so the node's loop pays nothing for them; a stat
this module does not know is exported as an untyped ``pagekv_node_<name>``. :class:`RequestMetrics`
is the node's ``observe`` hook: a latency histogram per op (time the node spends on a request:
decode, index, queue the reply; network transfer excluded), replies by op and code, PUT blocks by
status, and GET latency by tier (``memory``: answered from memory; ``disk``: some values read
from the disk tier). A node with a disk tier adds its counters and gauges (``disk_*`` stats)
and its read and write latency histograms. :class:`MetricsServer` serves any registry on
``/metrics`` and a health callable on ``/health`` (200 or 503, JSON) from a daemon thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter as _Tally
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.utils import floatToGoString

import pagekv

from ..wire.protocol import Code, Op, Status

if TYPE_CHECKING:
    from .monitor import ConnectionMonitor
    from .server import StoreNode

__all__ = [
    "LATENCY_BUCKETS",
    "HealthCheck",
    "MetricsServer",
    "NodeCollector",
    "RequestMetrics",
    "node_metrics",
    "ping_health",
]

log = logging.getLogger("pagekv.store.node.metrics")
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                   5e-2, 0.1, 0.25, 0.5, 1.0)  # fmt: skip
HealthCheck = Callable[[], "tuple[bool, dict[str, Any]]"]

# stat -> (metric name, type, help); op_* and the error counters are handled apart
_KNOWN = {
    "blocks": ("pagekv_node_blocks", "gauge", "blocks stored"),
    "bytes": ("pagekv_node_stored_bytes", "gauge", "bytes counted against capacity"),
    "capacity": ("pagekv_node_capacity_bytes", "gauge", "configured capacity"),
    "hits": ("pagekv_node_hits", "counter", "GET keys found"),
    "misses": ("pagekv_node_misses", "counter", "GET keys not found"),
    "evictions": ("pagekv_node_evictions", "counter", "blocks evicted for space"),
    "bytes_in": ("pagekv_node_received_bytes", "counter", "request bytes received"),
    "bytes_out": ("pagekv_node_sent_bytes", "counter", "block bytes sent"),
    "auth_rejected": ("pagekv_node_auth_rejected", "counter", "CURVE client keys refused"),
    "auth_accepted": ("pagekv_node_auth_accepted", "counter", "CURVE handshakes admitted"),
}
# the disk tier's stats (pagekv.store.node.disk): stat -> (type, help); the metric is
# pagekv_node_<stat> (``disk_bytes``: pagekv_node_disk_stored_bytes, as ``bytes`` above)
# fmt: off
_DISK = {
    "disk_hits": ("counter", "GET keys read from the disk tier"),
    "disk_misses": ("counter", "disk reads that found nothing (gone, corrupt, or the tier off)"),
    "disk_read_bytes": ("counter", "block bytes read from disk"),
    "disk_read_ops": ("counter", "disk reads (one per run of adjacent records)"),
    "disk_corrupt": ("counter", "records failing their checksum or key check (dropped: a miss)"),
    "disk_writes": ("counter", "blocks written to disk"),
    "disk_write_bytes": ("counter", "block bytes written to disk"),
    "disk_write_skipped": ("counter", "evicted blocks not written: on disk already"),
    "disk_rewrites": ("counter", "evicted blocks written again (record in an old segment)"),
    "disk_write_dropped": ("counter", "evicted blocks not written: the write queue was full"),
    "disk_write_nospace": ("counter", "blocks not written: disk full, nothing to reclaim"),
    "disk_write_no_descriptor": ("counter", "blocks not written: no descriptor free for a new "
                                 "segment (peers held them all)"),
    "disk_write_too_large": ("counter", "blocks not written: larger than a segment"),
    "disk_write_dropped_at_close": ("counter", "blocks queued when the shutdown budget ran out"),
    "disk_deletes_unsaved": ("counter", "deletes whose tombstone was not written (no descriptor "
                             "or space, too many queued, the tier off): served after a restart"),
    "disk_write_dropped_off": ("counter", "queued blocks dropped as the tier turned off"),
    "disk_reclaimed_segments": ("counter", "segments reclaimed (oldest first)"),
    "disk_reclaimed_blocks": ("counter", "blocks dropped with their reclaimed segment"),
    "disk_reclaimed_bytes": ("counter", "bytes of reclaimed segments"),
    "disk_on": ("gauge", "1 while the disk tier serves, 0 once it turned itself off"),
    "disk_blocks": ("gauge", "blocks on disk"),
    "disk_bytes": ("gauge", "block bytes on disk"),
    "disk_used_bytes": ("gauge", "bytes of the tier's files (segments, directories)"),
    "disk_capacity": ("gauge", "configured disk capacity"),
    "disk_segments": ("gauge", "segment files"),
    "disk_queue_blocks": ("gauge", "evicted blocks waiting for the disk writer"),
    "disk_queue_bytes": ("gauge", "bytes of evicted blocks waiting for the disk writer"),
    "disk_waiting": ("gauge", "requests waiting for disk reads (ZeroMQ)"),
    "disk_promote_skipped": ("counter", "disk hits left on disk only: the write queue had no "
                             "room for what their promotion would evict"),
    "disk_rebuild_s": ("gauge", "seconds the index rebuild took at start"),
    "disk_rebuild_blocks": ("gauge", "blocks found on disk at start"),
    "disk_rebuild_scanned_bytes": ("gauge", "bytes scanned at start (segments without directory)"),
    "disk_rebuild_torn": ("gauge", "torn records cut off at start"),
    "disk_rebuild_damaged": ("gauge", "damaged records skipped at start (payload checksum)"),
}
_DISK_HISTOGRAMS = {
    "read": ("pagekv_node_disk_read_seconds", "a disk read, from submission to block checked"),
    "write": ("pagekv_node_disk_write_seconds", "an evicted block, from offer to record written"),
}
# fmt: on
_DISK_NAMES = {
    "disk_bytes": "disk_stored_bytes",
    "disk_capacity": "disk_capacity_bytes",
    "disk_rebuild_s": "disk_rebuild_seconds",
}
_KNOWN.update({stat: (f"pagekv_node_{_DISK_NAMES.get(stat, stat)}", kind, text)
               for stat, (kind, text) in _DISK.items()})  # fmt: skip
# KV events (--events-endpoint; pagekv.store.node.events): stat -> metric, type, help
_KNOWN.update({
    "event_batches": ("pagekv_node_event_batches", "counter", "KV event batches published"),
    "event_keys": ("pagekv_node_event_keys", "counter", "block keys in published KV events"),
    "event_replays": ("pagekv_node_event_replays", "counter", "KV event replay requests served"),
    "events_dropped": ("pagekv_node_events_dropped", "counter",
                       "KV events dropped for the publisher's bound (each followed by a resync)"),
    "event_resyncs": ("pagekv_node_event_resyncs", "counter",
                      "KV event resyncs (AllBlocksCleared, then all the node holds)"),
})  # fmt: skip
_ERRORS = {"bad_requests": "bad_request", "internal_errors": "internal", "dropped": "dropped"}
_SKIP = {"address", "pid", "uptime_s"}


class NodeCollector:
    """Reads ``node.stats()`` at each scrape. ``monitor``: a :class:`ConnectionMonitor` or None."""

    def __init__(self, node: StoreNode, monitor: ConnectionMonitor | None = None) -> None:
        self.node = node
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        stats = self.node.stats()
        info = GaugeMetricFamily("pagekv_node_info", "node version and address",
                                 labels=["version", "address"])  # fmt: skip
        info.add_metric([pagekv.__version__, str(stats.get("address", ""))], 1)
        yield info
        yield GaugeMetricFamily("pagekv_node_start_time_seconds", "Unix time the node started",
                                value=self.node.started)  # fmt: skip
        requests = CounterMetricFamily("pagekv_node_requests", "requests decoded, by op",
                                       labels=["op"])  # fmt: skip
        errors = CounterMetricFamily("pagekv_node_errors", "failed requests by kind",
                                     labels=["kind"])  # fmt: skip
        for key, value in stats.items():
            if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key.startswith("op_"):
                requests.add_metric([key[3:].upper()], value)
            elif key in _ERRORS:
                errors.add_metric([_ERRORS[key]], value)
            elif key in _KNOWN:
                name, kind, text = _KNOWN[key]
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, text, value=value)
            else:
                yield _untyped(f"pagekv_node_{key}", f"node stat {key}", value)
        yield requests
        yield errors
        disk = self.node.disk
        if disk is not None:
            for name, snap in disk.histograms().items():
                yield _histogram(*_DISK_HISTOGRAMS[name], snap)
        if self.monitor is not None:
            yield from self._connections()

    def _connections(self) -> Iterator[Metric]:
        m = self.monitor
        yield GaugeMetricFamily("pagekv_node_connections", "open client connections",
                                value=m.open_connections)  # fmt: skip
        yield CounterMetricFamily("pagekv_node_connections_accepted", "connections accepted",
                                  value=m.accepted)  # fmt: skip
        failures = CounterMetricFamily("pagekv_node_handshake_failures",
                                       "failed handshakes by kind", labels=["kind"])  # fmt: skip
        for kind, count in m.handshake_failures.items():
            failures.add_metric([kind], count)
        yield failures


def _histogram(name: str, text: str, snap: dict[str, Any]) -> Metric:
    """A histogram family from counts per bucket (and one above the last) and their sum."""
    buckets, total = [], 0
    for bound, count in zip(snap["buckets"], snap["counts"]):
        total += count
        buckets.append((floatToGoString(bound), total))
    buckets.append(("+Inf", total + snap["counts"][-1]))
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=snap["sum"])


def _untyped(name: str, text: str, value: float) -> Metric:
    metric = Metric(name, text, "unknown")
    metric.add_sample(name, {}, value)
    return metric


class RequestMetrics:
    """The node's per-request hook (``node.observe = RequestMetrics(registry)``): thread-safe,
    about 3 us per request on the node's loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram(
            "pagekv_node_request_duration_seconds",
            "time the node spends on a request (decode, index, queue the reply)",
            ["op"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.replies = Counter("pagekv_node_replies", "replies by op and code", ["op", "code"],
                               registry=registry)  # fmt: skip
        self.put_blocks = Counter("pagekv_node_put_blocks", "PUT blocks by status", ["status"],
                                  registry=registry)  # fmt: skip
        self.checksum_failures = Counter(
            "pagekv_node_checksum_failures", "PUT blocks refused: payload does not match its "
            "checksum", registry=registry,
        )  # fmt: skip
        self.get_latency = Histogram(
            "pagekv_node_get_duration_seconds",
            "time the node spends on a GET by tier: memory (answered from memory) or disk "
            "(waited for values read from the disk tier)",
            ["tier"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self._get_latency = {tier: self.get_latency.labels(tier) for tier in ("memory", "disk")}
        ops = [op.value for op in Op] + ["INVALID"]
        self._latency = {op: self.latency.labels(op) for op in ops}
        self._ok = {op: self.replies.labels(op, Code.OK.name) for op in ops}
        self._put = {int(s): self.put_blocks.labels(s.name) for s in Status}  # all from the start

    def observe_get(self, tier: str, seconds: float) -> None:
        """The node's ``observe_get`` hook: one GET answered from ``tier``."""
        self._get_latency[tier].observe(seconds)

    def __call__(self, op: Op | None, reply: Any, seconds: float) -> None:
        name = op.value if op is not None else "INVALID"
        self._latency[name].observe(seconds)
        if reply.code == Code.OK:
            self._ok[name].inc()
        else:
            self.replies.labels(name, Code(reply.code).name).inc()
        if op is Op.PUT and reply.status:
            stored = reply.status.count(Status.OK)  # the usual case, counted in C
            if stored:
                self._put[Status.OK].inc(stored)
            if stored == len(reply.status):
                return
            for status, count in _Tally(reply.status).items():
                if status != Status.OK:
                    self._put[status].inc(count)
                if status == Status.BAD_CHECKSUM:
                    self.checksum_failures.inc(count)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    # the listen backlog: connections beyond it wait for their SYN's retransmit (1 s, then
    # more), so a burst (a port scan, many scrapers) must fit; socketserver's default is 5
    request_queue_size = 128


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics http: " + format, *args)


class MetricsServer:
    """``/metrics`` (Prometheus text or OpenMetrics) and ``/health`` on ``host:port`` (0: a free
    port; :attr:`port` says which). Serves from a daemon thread until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 health: HealthCheck | None = None) -> None:  # fmt: skip
        self._metrics_app = make_wsgi_app(registry)
        self._health = health or (lambda: (True, {}))
        server_class = _ThreadingWSGIServer6 if ":" in host else _ThreadingWSGIServer
        self._server = make_server(host, port, self._app, server_class, _QuietHandler)
        self.host, self.port = host, self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="pagekv-metrics",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _app(self, environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/health":
            ok, detail = self._health()
            body = json.dumps({"status": "ok" if ok else "failing", **detail}).encode()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json")])  # fmt: skip
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"pagekv: /metrics or /health\n"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def node_metrics(node: StoreNode, monitor: ConnectionMonitor | None, host: str, port: int,
                 health: HealthCheck | None = None) -> MetricsServer:  # fmt: skip
    """Registry for ``node`` (its stats, per-request hook, this process), served on host:port.
    Installs the hook as ``node.observe``."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(node, monitor))
    ProcessCollector(registry=registry)
    node.observe = metrics = RequestMetrics(registry)
    node.observe_get = metrics.observe_get
    return MetricsServer(registry, host, port, health)


def ping_health(probe_once: Callable[[], Any], cache_s: float = 1.0,
                extra: Callable[[], dict[str, Any]] | None = None) -> HealthCheck:  # fmt: skip
    """A health check that PINGs the node through its own socket (``probe_once`` returns a
    :class:`ProbeResult`), answering from a cache for ``cache_s`` so a flood costs one PING.
    ``extra()``: more of the node's state for the JSON (e.g. ``disk_on``); it does not decide
    health (a node whose disk tier turned off serves from memory)."""
    lock = threading.Lock()
    last: list[Any] = [0.0, (False, {})]

    def check() -> tuple[bool, dict[str, Any]]:
        with lock:
            if time.monotonic() - last[0] > cache_s:
                result = probe_once()
                detail = {"endpoint": result.endpoint, "ping": str(result)}
                if extra is not None:
                    detail.update(extra())
                last[:] = [time.monotonic(), (result.outcome.value == "ok", detail)]
            return last[1]

    return check
