"""What both store clients share: configuration, the router, link state, argument checks (see
:mod:`.client` for the contract)."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from pagekv.errors import AuthenticationFailed

from ..config import ClientConfig, CurveClientKeys
from ..wire.copies import shared_pool
from ..wire.protocol import MAX_KEY_BYTES
from . import operations
from .lane import FALLBACK, BulkLanes
from .routing import Batch, Call, Link, OpGen, Results, Router, StoreUnavailable

__all__ = ["raise_unavailable", "shared_context"]

_CONTEXTS: dict[tuple[type, int, int], zmq.Context] = {}


def shared_context(kind: type[zmq.Context], io_threads: int) -> zmq.Context:
    """The process's context of class ``kind`` with ``io_threads`` I/O threads (one I/O thread:
    ``kind.instance()``). Clients of the same stream count share one, so a client costs
    sockets, never threads of its own, and closing it (its sockets, linger 0) leaves nothing
    behind; a forked child gets fresh contexts. Never terminated (like ``instance()``)."""
    if io_threads == 1:
        return kind.instance()
    key = (kind, io_threads, os.getpid())
    ctx = _CONTEXTS.get(key)
    if ctx is None or ctx.closed:
        ctx = _CONTEXTS[key] = kind(io_threads=io_threads)
    return ctx


def _byte_views(value: Any, writable: bool, what: str) -> list[memoryview]:
    """A value's frames as flat byte views: one bytes-like, or a sequence of them."""
    if type(value) is bytes and not writable:
        return [memoryview(value)]
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


def _check_keys(keys: Sequence[bytes], buffers: Sequence[Any] | None, what: str) -> None:
    lengths = list(map(len, keys)) if set(map(type, keys)) <= {bytes} else None
    if lengths is None or (lengths and not 0 < min(lengths) <= max(lengths) <= MAX_KEY_BYTES):
        bad = next(k for k in keys if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES)
        raise ValueError(f"keys must be non-empty bytes of <= {MAX_KEY_BYTES}, got {bad!r:.40}")
    if buffers is not None and len(buffers) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} {what}")


class _Base:
    """Configuration, router and link bookkeeping shared by both clients."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        replicas: int = 1,
        timeout_s: float = 5.0,
        curve: CurveClientKeys | None = None,
        config: ClientConfig | None = None,
        streams: int | None = None,
    ) -> None:
        self.config = config or ClientConfig(
            tuple([endpoints] if isinstance(endpoints, str) else endpoints),
            replicas=replicas,
            timeout_s=timeout_s,
            curve=curve,
            streams=streams,
        )
        cfg = self.config
        self.router = Router(
            cfg.endpoints, cfg.replicas, (cfg.backoff_min_s, cfg.backoff_max_s),
            cfg.max_message_bytes, link=self._link_state,
        )  # fmt: skip
        self.router.pool = shared_pool(cfg.copy_threads)  # None: copies on the client's thread
        self.router.on_ports = self._move_streams
        self._links: dict[int, list[Any]] = {}  # node -> its links, one per stream (or None)
        self._turn: dict[int, int] = {}  # node -> the stream its next batch starts on
        self.bulk = BulkLanes(cfg, self.router)  # PUT/GET over nodes' bulk lanes
        weakref.finalize(self, self.bulk.close)  # its connection threads end with the client

    @property
    def counters(self) -> dict[str, int]:
        return self.router.counters

    def _open(self, node: int, stream: int) -> Any:  # a fresh link (socket); per client kind
        raise NotImplementedError

    def _endpoint(self, node: int, stream: int) -> str:
        """Where ``stream`` of ``node`` connects: the node's port for that stream when the
        node advertised per-stream ports (see ``StoreNode._bind_stream_ports``), else the
        configured endpoint."""
        endpoint, ports = self.config.endpoints[node], self.router.stream_ports[node]
        if not ports:
            return endpoint
        return f"{endpoint.rsplit(':', 1)[0]}:{ports[stream % len(ports)]}"

    def _move_streams(self, node: int) -> None:
        """The node's stream ports changed: each open link not on its endpoint is retired
        (closed once nothing uses it) and a new one opened."""
        for stream, link in enumerate(self._links.get(node, [])):
            if link is not None and link.endpoint != self._endpoint(node, stream):
                self._retire(link)
                self._open(node, stream)

    def _retire(self, link: Any) -> None:  # close now, or once idle; per client kind
        raise NotImplementedError

    def _link(self, node: int, stream: int) -> Any:
        """The link of ``node``'s ``stream``, opened if it has none."""
        links = self._links.setdefault(node, [None] * self.config.streams)
        return links[stream] or self._open(node, stream)

    def _spread(self, node: int, calls: list) -> list[tuple[int, list]]:
        """(stream, calls) pairs: ``calls`` dealt round-robin over the node's streams, starting
        where the node's previous batch left off (so one-request batches use every stream)."""
        streams = self.config.streams
        if streams == 1:
            return [(0, calls)]
        first = self._turn.get(node, 0)
        self._turn[node] = (first + len(calls)) % streams
        parts: dict[int, list] = {}
        for j, call in enumerate(calls):
            parts.setdefault((first + j) % streams, []).append(call)
        return list(parts.items())

    def _bulk_split(self, batch: Batch) -> tuple[list[tuple[Call, Future]], Batch]:
        """Send the calls the bulk lane takes (dealt over each node's connections like
        streams) and return them with their futures, and the rest (for ZeroMQ)."""
        rest: Batch = []
        per_node: dict[int, list[Call]] = {}
        for call in batch:
            if self.bulk.takes(call):
                per_node.setdefault(call.node, []).append(call)
            else:
                rest.append(call)
        sent = []
        for node, calls in per_node.items():
            for stream, part in self._spread(node, calls):
                sent.extend((call, self.bulk.submit(node, stream, call)) for call in part)
        return sent, rest

    def _take_bulk(self, call: Call, result: Any, results: Results, fallback: Batch) -> bool:
        """Hand one finished lane call on (on the client's thread): counted; its result
        recorded and ``on_reply`` called, or the call put in ``fallback`` (lane unreachable:
        ZeroMQ takes it). True when the node failed it (the caller resets the node's links)."""
        self.bulk.count(call, result)
        if result is FALLBACK:
            fallback.append(call)
            return False
        results[call.request.id] = result
        if result is not None and call.on_reply is not None:
            call.on_reply(*result)
        return result is None

    def _link_state(self, node: int) -> Link:
        """UP only when every stream is connected: a stream replaced after a timeout must
        complete its handshake (which a stopped node cannot) before the node counts as up
        again; the streams that were not replaced still look connected to a stopped node."""
        links = [self._link(node, s) for s in range(self.config.streams)]
        # SNDHWM 0 and IMMEDIATE: a link can take a request exactly while it is connected
        up = [bool(link.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT) for link in links]
        lost = False
        for link, ok in zip(links, up):
            lost = lost or (link.was_up and not ok)
            link.was_up = ok
        if all(up):
            return Link.UP
        if lost and self.router.stream_ports[node]:
            # the node dropped a connection: it may have restarted with new stream ports,
            # which the old links would never reach. Back to its main port now (and a PING
            # learns the ports again); a node that is really down stays CONNECTING there,
            # then DOWN, as any other
            self.router.forget_ports(node, "lost a stream connection")
            return Link.CONNECTING
        newest = max(link.created for link in links)
        if time.monotonic() - newest < min(self.config.connect_timeout_s,
                                           self.config.timeout_s):  # fmt: skip
            return Link.CONNECTING
        if self.router.stream_ports[node]:  # maybe only the stream ports are unreachable
            self.router.forget_ports(node)  # fresh links to the main port: CONNECTING
            return Link.CONNECTING
        return Link.DOWN

    def _close_links(self) -> None:
        self.bulk.close()
        for links in self._links.values():
            for link in links:
                if link is not None:
                    link.close()
        self._links.clear()

    def _window(self, node: int) -> int:
        limits = self.router.limits[node]
        return limits.window if limits is not None else 1

    def _new_socket(self, ctx: zmq.Context, endpoint: str, stream: int = 0) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        # Stream s on I/O thread s: left to libzmq, connections opened together all land on
        # the first I/O thread (its load is counted only once a connection is set up), and
        # every stream's bytes then go through one thread (measured: 2-3 GB/s for 1-8 streams)
        sock.setsockopt(zmq.AFFINITY, 1 << (stream % self.config.streams))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a node not connected
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.config.socket_buffer:  # 0: leave it to the kernel's TCP autotuning
            sock.setsockopt(zmq.SNDBUF, self.config.socket_buffer)
            sock.setsockopt(zmq.RCVBUF, self.config.socket_buffer)
        if self.config.curve is not None:
            sock.curve_serverkey = self.config.curve.server_public
            sock.curve_publickey = self.config.curve.public
            sock.curve_secretkey = self.config.curve.secret
        sock.connect(endpoint)
        return sock

    def _plan_put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> OpGen:
        _check_keys(keys, buffers, "buffers")
        views = [_byte_views(b, False, "put_many") for b in buffers]
        return operations.put(self.router, keys, views)

    def _plan_get(
        self, keys: Sequence[bytes], into: Sequence[Any] | None, on_arrival: Any = None
    ) -> OpGen:
        _check_keys(keys, into, "into buffers")
        targets = None if into is None else [_byte_views(b, True, "get_many") for b in into]
        return operations.get(self.router, keys, targets, on_arrival)

    def _plan_exists(self, keys: Sequence[bytes]) -> OpGen:
        _check_keys(keys, None, "")
        return operations.exists(self.router, keys)

    def _plan_delete(self, keys: Sequence[bytes]) -> OpGen:
        _check_keys(keys, None, "")
        return operations.delete(self.router, keys)

    def _stats_or_raise(self, stats: list[dict | None]) -> list[dict | None]:
        if all(s is None for s in stats):
            raise_unavailable(self.config)
        return stats


def raise_unavailable(cfg: ClientConfig) -> None:
    """No node answered: probe each (a PING watched by a socket monitor) and raise
    ``AuthenticationFailed`` if a node refused this client's CURVE keys, else
    ``StoreUnavailable``, naming each node's outcome. Blocking (at most ~2 s per node)."""
    from .probe import Outcome, probe

    results = [probe(ep, curve=cfg.curve, timeout_s=min(cfg.timeout_s, 2.0))
               for ep in cfg.endpoints]  # fmt: skip
    why = "; ".join(f"{r.endpoint}: {r}" for r in results)
    if any(r.outcome is Outcome.AUTH_FAILED for r in results):
        raise AuthenticationFailed(f"store authentication failed ({why})")
    raise StoreUnavailable(f"no store node answered ({why})")
