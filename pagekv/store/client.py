"""Store clients: :class:`StoreClient` (blocking) and :class:`AsyncStoreClient` (asyncio).

Both take one endpoint or several (sharded by rendezvous hashing, ``replicas`` copies each; see
:mod:`.routing`) and offer the same batch API. A value is one bytes-like or a list/tuple of
bytes-likes (its frames, e.g. a page's K and V regions): one key, one checksum over all frames.
Puts send the caller's buffers (host pool page views) as zero-copy frames: do not change them
until the call returns. Gets verify each value's xxh3-64 checksum (a mismatch is a miss,
counted) and either scatter its frames into the caller's buffers (``into=``) or return
read-only views of the received frames.

One DEALER socket per node; a request that times out resets that socket (stale replies are
never read as answers) and backs the node off; ZeroMQ reconnects to restarted nodes.
Neither client is thread-safe: use one per thread (or per event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from pagekv.errors import AuthenticationFailed

from .config import ClientConfig, CurveClientKeys
from .protocol import MAX_KEY_BYTES, Op, ProtocolError, Status, decode_reply, encode_request
from .routing import Batch, ExistsResult, OpGen, Results, Router, StoreUnavailable

__all__ = ["AsyncStoreClient", "StoreClient"]


def _byte_views(value: Any, writable: bool, what: str) -> list[memoryview]:
    """A value's frames as flat byte views: one bytes-like, or a sequence of them."""
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


def _payload_bytes(calls: Batch) -> int:
    """Bytes the calls send (PUT payloads): what their time bound scales with."""
    return sum(memoryview(p).nbytes for call in calls for p in call.payloads)


class _Base:
    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        replicas: int = 1,
        timeout_s: float = 5.0,
        curve: CurveClientKeys | None = None,
        config: ClientConfig | None = None,
    ) -> None:
        self.config = config or ClientConfig(
            tuple([endpoints] if isinstance(endpoints, str) else endpoints),
            replicas=replicas,
            timeout_s=timeout_s,
            curve=curve,
        )
        cfg = self.config
        self.router = Router(
            cfg.endpoints, cfg.replicas, (cfg.backoff_min_s, cfg.backoff_max_s),
            cfg.max_message_bytes,
        )  # fmt: skip

    @property
    def counters(self) -> dict[str, int]:
        return self.router.counters

    def _new_socket(self, ctx: zmq.Context, endpoint: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
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
        return self.router.put(keys, [_byte_views(b, False, "put_many") for b in buffers])

    def _plan_get(self, keys: Sequence[bytes], into: Sequence[Any] | None) -> OpGen:
        _check_keys(keys, into, "into buffers")
        targets = None if into is None else [_byte_views(b, True, "get_many") for b in into]
        return self.router.get(keys, targets)

    def _plan_exists(self, keys: Sequence[bytes]) -> OpGen:
        _check_keys(keys, None, "")
        return self.router.exists(keys)

    def _plan_delete(self, keys: Sequence[bytes]) -> OpGen:
        _check_keys(keys, None, "")
        return self.router.delete(keys)

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


class StoreClient(_Base):
    """Blocking client. Methods raise ``ValueError`` for bad arguments; node failures become
    per-key misses / ``Status.UNAVAILABLE``, never exceptions (except ``stats`` and ``ping``
    with every node down: ``StoreUnavailable``)."""

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        self.ctx = zmq.Context.instance()
        self._socks: dict[int, zmq.Socket] = {}

    def _sock(self, node: int) -> zmq.Socket:
        if node not in self._socks:
            self._socks[node] = self._new_socket(self.ctx, self.config.endpoints[node])
        return self._socks[node]

    def _reset(self, node: int) -> None:
        sock = self._socks.pop(node, None)
        if sock is not None:
            sock.close(linger=0)

    def _exchange(self, batch: Batch) -> Results:
        """Send each node its requests (pipelined on its socket) and collect the replies
        until the deadline; a request whose node cannot be written to (not connected) or
        does not answer in time gets None."""
        deadline = time.monotonic() + self.config.timeout_for(_payload_bytes(batch))
        results: Results = {}
        unsent: dict[zmq.Socket, list[tuple[int, list[Any]]]] = {}
        waiting: dict[zmq.Socket, set[int]] = {}
        node_of: dict[zmq.Socket, int] = {}
        calls = {call.request.id: call for call in batch}
        for call in batch:
            sock = self._sock(call.node)
            node_of[sock] = call.node
            frames = [encode_request(call.request), *call.payloads]
            unsent.setdefault(sock, []).append((call.request.id, frames))
            waiting.setdefault(sock, set()).add(call.request.id)
        poller = zmq.Poller()
        for sock in unsent:
            poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, event in poller.poll(left * 1000):
                if event & zmq.POLLOUT and unsent.get(sock):
                    self._send_some(sock, unsent[sock])
                    if not unsent[sock]:
                        poller.modify(sock, zmq.POLLIN)
                if event & zmq.POLLIN:
                    frames = sock.recv_multipart(copy=False)
                    try:
                        reply = decode_reply(frames[0].buffer)
                    except ProtocolError:
                        self._reset_waiting(sock, node_of, waiting, poller, results)
                        continue
                    if reply.id not in waiting[sock]:
                        continue  # a late answer to a request that timed out earlier
                    results[reply.id] = (reply, frames[1:])
                    waiting[sock].discard(reply.id)
                    if calls[reply.id].on_reply is not None:
                        calls[reply.id].on_reply(reply, frames[1:])
                    if not waiting[sock]:
                        poller.unregister(sock)
                        del waiting[sock]
        for sock in list(waiting):
            self._reset_waiting(sock, node_of, waiting, poller, results)
        return results

    @staticmethod
    def _send_some(sock: zmq.Socket, queue: list[tuple[int, list[Any]]]) -> None:
        while queue:
            try:
                sock.send_multipart(queue[0][1], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            queue.pop(0)

    def _reset_waiting(self, sock, node_of, waiting, poller, results: Results) -> None:
        """Give up on a node's outstanding requests: None for each, and a fresh socket."""
        for rid in waiting.pop(sock, ()):
            results[rid] = None
        poller.unregister(sock)
        self._reset(node_of[sock])

    def _run(self, gen: OpGen) -> Any:
        try:
            batch = next(gen)
            while True:
                batch = gen.send(self._exchange(batch))
        except StopIteration as done:
            return done.value

    def put_many(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        """Store each value under its key on ``replicas`` nodes; a status per key.

        ``buffers[i]`` is a bytes-like or a sequence of bytes-likes (the value's frames, sent
        as separate zero-copy frames and kept as such by the node). The caller must not
        change them until the call returns. Raises ``ValueError``/``TypeError`` for bad
        arguments, never for node failures (those are ``Status.UNAVAILABLE``)."""
        return self._run(self._plan_put(keys, buffers))

    def get_many(self, keys: Sequence[bytes], into: Sequence[Any] | None = None) -> list[Any]:
        """With ``into``: scatter each found value's frames into ``into[i]`` (a writable
        buffer, or a sequence of them, one per frame with matching sizes) and return a bool
        per key; a size or frame-count mismatch or a bad checksum is a miss (counted) and
        leaves ``into[i]`` untouched. Without: per found key a read-only memoryview (a
        single-frame value) or a list of them (one per frame), None per miss; the views
        hold the received frames and stay valid as long as they are referenced."""
        return self._run(self._plan_get(keys, into))

    def exists_many(self, keys: Sequence[bytes]) -> ExistsResult:
        """Which keys some node holds; ``.leading`` is the count of leading hits."""
        return self._run(self._plan_exists(keys))

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self._run(self._plan_delete(keys))

    def stats(self) -> list[dict | None]:
        """Each node's stats (None for a node that did not answer)."""
        return self._stats_or_raise(self._run(self.router.each_node(Op.STATS)))

    def ping(self) -> list[bool]:
        return [s is not None for s in self._run(self.router.each_node(Op.PING))]

    def close(self) -> None:
        for node in list(self._socks):
            self._reset(node)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStoreClient(_Base):
    """asyncio client with the same API (coroutines). Requests to different nodes run
    concurrently; requests to one node are serialised on its socket. Cancelling a call is
    safe: a reply that arrives later is discarded by its request id."""

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        self.ctx = zmq.asyncio.Context.instance()
        self._socks: dict[int, zmq.asyncio.Socket] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    def _reset(self, node: int) -> None:
        sock = self._socks.pop(node, None)
        if sock is not None:
            sock.close(linger=0)

    async def _node_calls(self, node: int, calls: Batch) -> Results:
        lock = self._locks.setdefault(node, asyncio.Lock())
        async with lock:
            if node not in self._socks:
                self._socks[node] = self._new_socket(self.ctx, self.config.endpoints[node])
            sock = self._socks[node]
            try:
                exchange = self._roundtrips(sock, calls)
                timeout = self.config.timeout_for(_payload_bytes(calls))
                return await asyncio.wait_for(exchange, timeout)
            except (asyncio.TimeoutError, ProtocolError, zmq.ZMQError):
                self._reset(node)
                return {c.request.id: None for c in calls}

    @staticmethod
    async def _roundtrips(sock: zmq.asyncio.Socket, calls: Batch) -> Results:
        for call in calls:  # pipelined: all requests out, then the replies
            await sock.send_multipart([encode_request(call.request), *call.payloads], copy=False)
        waiting = {c.request.id: c for c in calls}
        results: Results = {}
        while waiting:
            frames = await sock.recv_multipart(copy=False)
            reply = decode_reply(frames[0].buffer)
            call = waiting.pop(reply.id, None)
            if call is None:
                continue  # a late answer to a request that timed out
            results[reply.id] = (reply, frames[1:])
            if call.on_reply is not None:
                call.on_reply(reply, frames[1:])
        return results

    async def _run(self, gen: OpGen) -> Any:
        try:
            batch = next(gen)
            while True:
                per_node: dict[int, Batch] = {}
                for call in batch:
                    per_node.setdefault(call.node, []).append(call)
                parts = await asyncio.gather(*(self._node_calls(n, c) for n, c in per_node.items()))
                batch = gen.send({rid: r for part in parts for rid, r in part.items()})
        except StopIteration as done:
            return done.value

    async def put_many(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        return await self._run(self._plan_put(keys, buffers))

    async def get_many(self, keys: Sequence[bytes], into: Sequence[Any] | None = None) -> list[Any]:
        return await self._run(self._plan_get(keys, into))

    async def exists_many(self, keys: Sequence[bytes]) -> ExistsResult:
        return await self._run(self._plan_exists(keys))

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._run(self._plan_delete(keys))

    async def stats(self) -> list[dict | None]:
        stats = await self._run(self.router.each_node(Op.STATS))
        if all(st is None for st in stats):
            await asyncio.to_thread(raise_unavailable, self.config)
        return stats

    async def ping(self) -> list[bool]:
        return [s is not None for s in await self._run(self.router.each_node(Op.PING))]

    def close(self) -> None:
        for node in list(self._socks):
            self._reset(node)
