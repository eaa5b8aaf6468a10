""":class:`AsyncStoreClient`: the store client for asyncio (see :mod:`.client` for the contract).

``ClientConfig.streams`` DEALER sockets ("links", one per stream) per node, shared by every
concurrent call; a call's requests to a node are dealt over the node's links. A reader task per
link hands each reply to the request waiting for its id, so calls never wait on each other's
replies. Sending a request's frames is the only section under a (per link) lock, and at most the
node's ``window`` requests are in flight on a link. Each call gives up on a link on its own
deadline (``timeout_for`` the bytes it has in flight there), so k concurrent calls to a dead
node each finish within one timeout; the first to give up resets that link, which fails the
others' requests on it at once (requests on the node's other links are untouched).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from ..wire.protocol import Op, ProtocolError, Status, decode_reply
from .base import _Base, raise_unavailable, shared_context
from .routing import Batch, Call, ExistsResult, OpGen, Results, request_header

__all__ = ["AsyncStoreClient"]

log = logging.getLogger("pagekv.store")


class _AsyncLink:
    """A socket to one node, the replies awaited on it and its window of requests."""

    def __init__(self, sock: zmq.asyncio.Socket, node: int, stream: int) -> None:
        self.sock, self.created = sock, time.monotonic()
        self.node, self.stream = node, stream
        self.was_up = False  # connected when last looked at (see _Base._link_state)
        self.pending: dict[int, asyncio.Future] = {}
        self.send_lock = asyncio.Lock()
        self.inflight = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.reader: asyncio.Task | None = None
        self.closed = False
        self.retired = False  # replaced by a link to another endpoint: close once idle
        self.endpoint = ""

    async def acquire(self, window: int) -> None:
        while self.inflight >= window and not self.closed:
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
        self.inflight += 1

    def close_if_idle(self) -> None:
        if self.retired and not self.closed and not self.inflight and not self.pending:
            self.close()

    def release(self) -> None:
        self.inflight -= 1
        if self.retired:
            self.close_if_idle()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Fail every request waiting on this socket (None) and close it."""
        self.closed = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(None)
        self.pending.clear()
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self.reader is not None:
            self.reader.cancel()
        self.sock.close(linger=0)


class AsyncStoreClient(_Base):
    """asyncio client with the same API as :class:`StoreClient` (coroutines). Cancelling a
    call is safe: a reply that arrives later is discarded by its request id."""

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        self.ctx = shared_context(zmq.asyncio.Context, self.config.streams)

    def _open(self, node: int, stream: int) -> _AsyncLink:
        endpoint = self._endpoint(node, stream)
        link = _AsyncLink(self._new_socket(self.ctx, endpoint, stream), node, stream)
        link.endpoint = endpoint
        self._links.setdefault(node, [None] * self.config.streams)[stream] = link
        return link

    def _retire(self, link: _AsyncLink) -> None:
        """A call that already holds ``link`` may still send on it: it is closed when its
        last request is released, or on the next turn of the loop if nothing takes it."""
        link.retired = True
        try:
            asyncio.get_running_loop().call_soon(link.close_if_idle)
        except RuntimeError:  # no running loop: nothing can be using it
            link.close_if_idle()

    def _reset(self, link: _AsyncLink) -> None:
        """Replace ``link`` (its requests fail at once); the node's other links go on."""
        node, stream = link.node, link.stream
        if self._links.get(node, [None] * (stream + 1))[stream] is link:
            link.close()
            self._open(node, stream)  # reconnecting starts now

    async def _read(self, link: _AsyncLink) -> None:
        """Hand each reply to the request waiting for it; a reply that cannot be read
        resets the socket (its requests fail and move on)."""
        while not link.closed:
            try:
                frames = await link.sock.recv_multipart(copy=False)
                reply = decode_reply(frames[0].buffer)
            except ProtocolError:
                self.router.counters["bad_replies"] += 1
                self._reset(link)
                return
            except zmq.ZMQError:
                return  # socket closed under us
            fut = link.pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result((reply, frames[1:]))

    async def _request(self, node: int, link: _AsyncLink, call: Call, clock: dict) -> Any:
        """Send one request when the window allows and wait for its reply (None: failed)."""
        await link.acquire(self._window(node))
        rid = call.request.id
        try:
            if link.closed:
                return None
            if link.reader is None:
                link.reader = asyncio.ensure_future(self._read(link))
            fut = link.pending[rid] = asyncio.get_running_loop().create_future()
            clock["sending"] += 1
            clock["wake"]()  # the deadline is now the connection's
            try:
                async with link.send_lock:
                    frames = [request_header(call), *call.payloads]
                    await link.sock.send_multipart(frames, copy=False)
            except zmq.ZMQError:  # e.g. Again after a writable event that did not last (the
                # peer went), or the socket reset meanwhile: it may hold part of a message,
                # so it is replaced, and this request failed (never raised to the caller)
                self.router.counters["send_errors"] += 1
                self._reset(link)
                return None
            finally:
                clock["sending"] -= 1
            if not clock["bytes"]:
                clock["progress"] = time.monotonic()
            clock["bytes"] += call.nbytes + 1
            clock["wake"]()  # a send completed: the deadline moves (bytes in flight)
            result = await fut
            clock["bytes"] -= call.nbytes + 1
            clock["progress"] = time.monotonic()
            if result is not None and call.prepare is not None and self.router.pool is not None:
                job = self.router.pool.submit(call.prepare, *result)
                clock["jobs"].append(job)  # waited for by _stream_calls, even if cancelled
                try:
                    await asyncio.wrap_future(job)
                except Exception:  # a bug in a prepare: on_reply does its work instead
                    log.exception("pagekv store: a reply's copies failed")
            if result is not None and call.on_reply is not None:
                call.on_reply(*result)
            return result
        finally:
            link.pending.pop(rid, None)
            link.release()

    async def _node_calls(self, node: int, calls: Batch) -> Results:
        """A node's calls of a batch: PUTs and GETs over its bulk lane when it offers one, the
        rest (and the calls whose lane cannot be reached) over ZeroMQ."""
        bulk, calls = self._bulk_split(calls)
        jobs = [self._bulk_calls(node, bulk)] if bulk else []
        if calls:
            jobs.append(self._zmq_calls(node, calls))
        parts = await asyncio.gather(*jobs)
        return {rid: result for part in parts for rid, result in part.items()}

    async def _bulk_calls(
        self, node: int, bulk: list[tuple[Call, concurrent.futures.Future]]
    ) -> Results:
        """Await the bulk calls, handing each result on (on this loop) as it arrives: one
        callback per call, no task per call (what a prefetch of thousands of pages spent its
        loop's time on). Failed or cancelled, it stops the node's transfers (they write into
        the caller's buffers), waits for them, and hands nothing more on."""
        loop = asyncio.get_running_loop()
        results: Results = {}
        fallback: Batch = []
        ended = loop.create_future()
        left, reset = len(bulk), False

        def take(call: Call, fut: concurrent.futures.Future) -> None:
            nonlocal left, reset
            if ended.done():
                return  # the batch ended (an error, or the caller was cancelled)
            try:
                result = None if fut.cancelled() else fut.result()
                failed = self._take_bulk(call, result, results, fallback)
            except Exception as e:  # e.g. the caller's on_arrival raised: get_many raises it
                ended.set_exception(e)
                return
            if failed and not reset:  # as after a ZeroMQ timeout: the node must connect
                reset = True  # again (a handshake a stopped node cannot complete) before it
                for link in self._links.get(node, []):  # is used, even as a last resort
                    if link is not None:
                        self._reset(link)
            left -= 1
            if not left:
                ended.set_result(None)

        def done(fut: concurrent.futures.Future, call: Call) -> None:  # a lane's thread
            try:
                loop.call_soon_threadsafe(take, call, fut)
            except RuntimeError:  # the loop closed: the batch ended, nothing to hand on
                return

        if not bulk:
            return results
        for call, fut in bulk:
            fut.add_done_callback(functools.partial(done, call=call))
        try:
            await ended
        finally:
            running = [fut for _, fut in bulk if not fut.done()]
            if running:
                self.bulk.abort({node})
                concurrent.futures.wait(running)
        if fallback:
            results.update(await self._zmq_calls(node, fallback))
        return results

    async def _zmq_calls(self, node: int, calls: Batch) -> Results:
        parts = self._spread(node, calls)
        if len(parts) == 1:
            return await self._stream_calls(node, *parts[0])
        done = await asyncio.gather(*(self._stream_calls(node, s, c) for s, c in parts))
        return {rid: result for part in done for rid, result in part.items()}

    async def _stream_calls(self, node: int, stream: int, calls: Batch) -> Results:
        """Run ``calls`` on one link of ``node`` until all are answered or their deadline
        passes (see the module doc; the unanswered ones are None). Waits on one event that
        completions, sends and the deadline timer set: O(1) work per wake-up (a wait over
        every task each time cost O(tasks) and took the engine's GIL)."""
        link = self._link(node, stream)
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        waker = asyncio.Event()
        left_calls = len(calls)

        def finished(_task: asyncio.Future) -> None:
            nonlocal left_calls
            left_calls -= 1
            waker.set()

        clock = {"progress": start, "bytes": 0, "sending": 0, "wake": waker.set, "jobs": []}
        tasks: dict[asyncio.Future, Call] = {}
        cfg = self.config
        total = sum(c.nbytes for c in calls)
        cap = start + cfg.timeout_for(total) + cfg.timeout_s
        stretch = cfg.timeout_per_mib_s * total / (1 << 20)
        try:
            for call in calls:
                task = asyncio.ensure_future(self._request(node, link, call, clock))
                task.add_done_callback(finished)
                tasks[task] = call
                if call.before_send is not None and len(tasks) < len(calls):
                    # A PUT's values are hashed as it is sent, on this loop: let the node's
                    # other streams send their first requests before this one's next. Made all
                    # at once, one stream's requests were hashed and sent before the next
                    # stream's first (H100, 4 streams, 512 MiB: the fourth began at 42 ms).
                    await asyncio.sleep(0)
            while left_calls:
                if clock["bytes"]:
                    deadline = clock["progress"] + cfg.timeout_for(clock["bytes"])
                elif clock["sending"]:  # waiting for the connection (stretched by the bytes)
                    connect = min(cfg.connect_timeout_s, cfg.timeout_s)
                    deadline = clock["progress"] + connect + stretch
                else:  # waiting for window slots held by other calls (each on its deadline)
                    deadline = cap
                left = deadline - time.monotonic()
                if left <= 0:
                    if clock["bytes"]:  # a request went out: fail the socket's requests
                        self._reset(link)
                    break  # (none did: the socket is kept, its age tells the node is down)
                waker.clear()
                timer = loop.call_later(left, waker.set)
                try:
                    await waker.wait()
                finally:
                    timer.cancel()
        finally:
            for task in tasks:
                task.cancel()
            # A prepare running on the copy pool writes into the caller's buffers: the call is
            # over only when none is left (a queued one is cancelled with its task; a running
            # one finishes within a copy of one reply, milliseconds)
            running = [job for job in clock["jobs"] if not job.cancel() and not job.done()]
            if running:
                concurrent.futures.wait(running)
        results: Results = dict.fromkeys((c.request.id for c in calls), None)
        for t, c in tasks.items():
            if t.done() and not t.cancelled():
                results[c.request.id] = t.result()
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

    async def get_many(
        self,
        keys: Sequence[bytes],
        into: Sequence[Any] | None = None,
        on_arrival: Callable[[int], None] | None = None,
    ) -> list[Any]:
        return await self._run(self._plan_get(keys, into, on_arrival))

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
        """Close every link (pending requests fail); the shared context stays (see
        :func:`.client_base.shared_context`)."""
        self._close_links()
