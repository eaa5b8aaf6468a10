"""A store node: one ROUTER socket, blocks kept in memory as the frames they arrived in.

Every request gets a reply (an error reply naming the problem when it is malformed) unless its
sender cannot be addressed; the loop never raises on input. Single-threaded: ZeroMQ's I/O
thread moves the bytes, this loop only indexes frames.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from .block_store import BlockStore
from .config import NodeConfig
from .memory import tune_malloc_for_blocks
from .protocol import (
    Code,
    Op,
    ProtocolError,
    Reply,
    Request,
    Status,
    checksum_frames,
    decode_request,
    encode_reply,
)

if TYPE_CHECKING:
    from .auth import ZapAuthenticator

__all__ = ["StoreNode"]

log = logging.getLogger("pagekv.store")


class StoreNode:
    """Owns its socket, store and stats. ``serve_forever`` until :meth:`stop` or a signal."""

    def __init__(self, config: NodeConfig, *, context: zmq.Context | None = None) -> None:
        self.config = config
        self.ctx = context or zmq.Context(io_threads=config.io_threads)
        self.store = BlockStore(
            config.capacity,
            max_block_bytes=config.max_block_size,
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
        )
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # unknown peer: drop, never raise
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_size)
        if config.socket_buffer:  # 0: leave it to the kernel's TCP autotuning
            self.sock.setsockopt(zmq.SNDBUF, config.socket_buffer)
            self.sock.setsockopt(zmq.RCVBUF, config.socket_buffer)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self._auth: ZapAuthenticator | None = None
        # called after each reply with (op or None, reply, seconds): metrics hook
        self.observe: Callable[[Op | None, Reply, float], None] | None = None
        if config.curve_secret_key:
            self._setup_curve()
        self.sock.bind(config.bind_address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self.started = time.time()
        self.counters: dict[str, int] = {f"op_{op.value.lower()}": 0 for op in Op}
        self.counters.update(bytes_in=0, bytes_out=0, bad_requests=0, dropped=0, internal_errors=0)

    def _setup_curve(self) -> None:
        from .auth import ZapAuthenticator, load_allowed_keys, load_secret_cert

        public, secret = load_secret_cert(self.config.curve_secret_key)
        allowed = load_allowed_keys(self.config.curve_allow)  # refuses a missing/empty dir
        self._auth = ZapAuthenticator(self.ctx, allowed)  # logs rejected keys
        self.sock.curve_secretkey = secret
        self.sock.curve_publickey = public
        self.sock.curve_server = True

    @property
    def auth(self) -> ZapAuthenticator | None:
        """The CURVE authenticator (None without CURVE): its ``allowed`` keys and counts."""
        return self._auth

    # ---- loop ------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop())

    def serve_forever(self) -> None:
        if os.environ.get("PAGEKV_TUNE_MALLOC", "1") == "1":
            tune_malloc_for_blocks()
        log.info(
            "pagekv node serving on %s (capacity %d bytes, pid %d)",
            self.address, self.config.capacity, os.getpid(),
        )  # fmt: skip
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                while not self._stop.is_set():
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.handle(frames)
        finally:
            self.close()
            log.info("pagekv node %s stopped", self.address)

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.sock.close(linger=0)

    # ---- requests --------------------------------------------------------------------------
    def handle(self, frames: list[zmq.Frame]) -> None:
        """Answer one request; malformed input gets an error reply, never an exception."""
        start, op = time.perf_counter(), None
        if len(frames) < 2:
            self.counters["dropped"] += 1  # no header: nothing to answer
            return
        ident, header, payloads = frames[0], frames[1], frames[2:]
        size = sum(len(f) for f in frames[1:])
        self.counters["bytes_in"] += size
        try:
            if size > self.config.max_message_size:
                raise ProtocolError(Code.TOO_LARGE, f"message of {size} bytes is over the limit")
            req = decode_request(header.buffer)
            op = req.op
            if len(req.keys) > self.config.max_keys:
                raise ProtocolError(Code.TOO_LARGE, f"{len(req.keys)} keys is over the limit")
            rep, out = self._dispatch(req, payloads)
        except ProtocolError as e:
            self.counters["bad_requests"] += 1
            rep, out = Reply(id=_best_effort_id(header), code=e.code, error=str(e)), []
        except Exception as e:  # a bug, not bad input: log it, answer, keep serving
            log.exception("pagekv node: internal error on a request")
            self.counters["internal_errors"] += 1
            rep = Reply(id=_best_effort_id(header), code=Code.INTERNAL, error=repr(e))
            out = []
        self._send(ident, rep, out)
        if self.observe is not None:
            self.observe(op, rep, time.perf_counter() - start)

    def _send(self, ident: zmq.Frame, rep: Reply, payloads: list[Any]) -> None:
        self.counters["bytes_out"] += sum(len(p) for p in payloads)
        try:
            self.sock.send_multipart([ident, encode_reply(rep), *payloads], copy=False)
        except zmq.ZMQError as e:  # peer gone: nothing else to do for it
            self.counters["dropped"] += 1
            log.debug("reply to a vanished peer dropped: %s", e)

    def _dispatch(self, req: Request, payloads: list[zmq.Frame]) -> tuple[Reply, list[Any]]:
        self.counters[f"op_{req.op.value.lower()}"] += 1
        if req.op is not Op.PUT and payloads:
            raise ProtocolError(Code.BAD_FRAMES, f"{req.op.value} takes no payload frames")
        if req.op is Op.PUT:
            return self._put(req, payloads), []
        if req.op is Op.GET:
            return self._get(req)
        if req.op is Op.EXISTS:
            status = self.store.statuses(req.keys)
            hits = next((i for i, s in enumerate(status) if s), len(status))
            return Reply(req.id, status=status, hits=hits), []
        if req.op is Op.DELETE:
            status = [
                int(Status.OK if self.store.delete(k) else Status.NOT_FOUND) for k in req.keys
            ]
            return Reply(req.id, status=status), []
        if req.op is Op.STATS:
            return Reply(req.id, stats=self.stats()), []
        return Reply(req.id), []  # PING

    def _put(self, req: Request, payloads: list[zmq.Frame]) -> Reply:
        if len(payloads) != len(req.sizes):
            raise ProtocolError(
                Code.BAD_FRAMES, f"header declares {len(req.sizes)} frames, got {len(payloads)}"
            )
        for i, (frame, size) in enumerate(zip(payloads, req.sizes)):
            if len(frame) != size:
                msg = f"frame {i} has {len(frame)} bytes, not {size}"
                raise ProtocolError(Code.BAD_FRAMES, msg)
        status, start = [], 0
        for key, count, cs in zip(req.keys, req.counts, req.sums):
            frames, start = payloads[start : start + count], start + count
            size = sum(req.sizes[start - count : start])
            if (
                self.config.verify_puts
                and size <= self.config.max_block_size
                and checksum_frames([f.buffer for f in frames]) != cs
            ):
                status.append(int(Status.BAD_CHECKSUM))
                continue
            status.append(int(self.store.put(key, tuple(frames), size, cs)))
        return Reply(req.id, status=status)

    def _get(self, req: Request) -> tuple[Reply, list[Any]]:
        status, sums, counts, out = [], [], [], []
        for key in req.keys:
            block = self.store.get(key)
            if block is None:
                status.append(int(Status.NOT_FOUND))
                continue
            status.append(int(Status.OK))
            sums.append(block.checksum)
            counts.append(len(block.frames))
            out.extend(block.frames)
        return Reply(req.id, status=status, sums=sums, counts=counts), out

    def stats(self) -> dict[str, Any]:
        auth = self._auth.stats() if self._auth is not None else {}
        return {**self.store.stats(), **self.counters, **auth, "address": self.address,
                "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1)}  # fmt: skip


def _best_effort_id(header: zmq.Frame) -> int:
    """The request id of a header we could not fully parse, when it can be read; else 0."""
    try:
        import msgpack

        head = msgpack.unpackb(header.buffer, raw=False)
        rid = head.get("id") if isinstance(head, dict) else None
        return rid if type(rid) is int and rid >= 0 else 0
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError):
        return 0
