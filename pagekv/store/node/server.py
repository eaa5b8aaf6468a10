"""A store node: one ROUTER socket, blocks kept in memory as the frames they arrived in.

Every request gets a reply (an error reply naming the problem when it is malformed) unless its
sender cannot be addressed or does not read its replies; the loop never raises on input.
Single-threaded: ZeroMQ's I/O thread moves the bytes, this loop only indexes frames. Memory is
bounded against any peer (docs/protocol.md, "Node memory"): frame size, requests queued per
connection, payload per message and frames per message are limited; replies in flight per
connection are budgeted (:mod:`.outbox`); peers that make libzmq buffer more than a connection
may are disconnected (:mod:`.guard`).

With a disk tier (``--disk``, :mod:`.disk`), blocks evicted from memory are offered to it, and a
GET or LOCATE that needs values from it waits for their reads without holding up the loop: the
request is parked by a token, the tier's reader threads read, and the loop (which polls the
tier's wakeup descriptor beside its socket) answers it when they are done. The bulk lane's
threads wait for their reads themselves, without the store's lock.

With KV events (``--events-endpoint``), the store's and the disk tier's hooks record each key
stored or removed per tier (:mod:`.events`) and a thread publishes them (:mod:`.event_publisher`);
a stopping node publishes ``AllBlocksCleared`` last.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import zmq

from ..config import NodeConfig
from ..wire import native
from ..wire.copies import shared_pool
from ..wire.protocol import (
    MAX_HEADER_BYTES,
    Code,
    Op,
    ProtocolError,
    Reply,
    Request,
    Status,
    decode_request,
    encode_reply,
)
from ..wire.shm import host_id
from . import handlers
from .auth import NULL_ZAP_DOMAIN
from .block_store import Block, BlockStore
from .disk import DiskBlock, DiskConfig, DiskTier, FileOps
from .event_publisher import EventPublisher
from .events import DISK, MEMORY, NodeEvents
from .guard import ConnectionGuard, source_fd, wire_bytes
from .lane import BulkServer, LaneLimits, Receive, SendDone
from .memory import HeapWarmer
from .monitor import EVENTS as MONITOR_EVENTS
from .monitor import ConnectionMonitor
from .outbox import Outbox
from .segment import Segment

if TYPE_CHECKING:
    from .auth import ZapAuthenticator

__all__ = ["StoreNode"]

log = logging.getLogger("pagekv.store")
LANE_DISK_WAIT_S = 10.0  # a bulk lane GET waits this long for its disk reads (then: misses)
LOCATE_PROMOTE_SHARE = 0.25  # of the memory: what one LOCATE may promote from disk


class _DiskWait:
    """A request parked while its values are read from disk (ZeroMQ loop): ``work`` is a
    :class:`~.handlers.DiskGet`, or a :class:`_Locate` (its ``keys`` to promote apart).
    ``hold``: with a segment, keeps the reply's memory blocks' space from reuse until the reply
    is sent; ``peer``, ``nbytes``: the outbox's hold on the connection's budget."""

    __slots__ = ("hold", "ident", "keys", "nbytes", "peer", "sent", "start", "work")

    def __init__(self, ident: bytes, work: Any, keys: list[bytes], sent: list | None,
                 hold: SendDone | None, peer: Any, nbytes: int, start: float) -> None:  # fmt: skip
        self.ident, self.work, self.keys, self.sent, self.hold = ident, work, keys, sent, hold
        self.peer, self.nbytes, self.start = peer, nbytes, start


class _Locate(NamedTuple):
    """A LOCATE waiting for its keys' promotion from disk; ``later``: its keys on disk it
    defers."""

    req: Request
    later: frozenset[bytes]


class StoreNode:
    """Owns its socket, store, disk tier and stats. ``serve_forever`` until :meth:`stop` or a
    signal. ``disk_io`` replaces the disk tier's file system calls (tests inject faults)."""

    def __init__(self, config: NodeConfig, *, context: zmq.Context | None = None,
                 disk_io: FileOps | None = None) -> None:  # fmt: skip
        self.config = config
        # with a disk tier, each PUT evicts what it needs: evictions reach the disk writer as
        # values arrive, never as a burst (down to a low watermark) larger than its queue
        low = config.high_watermark if config.disk is not None else config.low_watermark
        self.store = BlockStore(
            config.capacity,
            max_block_bytes=config.max_block_size,
            high_watermark=config.high_watermark,
            low_watermark=low,
        )
        # first: a directory another node serves from stops this one before it binds anything
        self.disk: DiskTier | None = None
        if config.disk is not None:
            self.disk = DiskTier(DiskConfig(config.disk, config.disk_capacity,
                                            config.disk_segment_size, config.disk_queue_size,
                                            config.disk_read_threads,
                                            config.disk_direct), io=disk_io)  # fmt: skip
            self.store.on_evict = self._offer_to_disk
        self._disk_waits: dict[int, _DiskWait] = {}
        self._promote_skipped = 0
        self._tokens = 0
        # called after each GET with ("memory" or "disk", seconds): metrics hook
        self.observe_get: Callable[[str, float], None] | None = None
        try:
            self._start(config, context)
        except BaseException:
            if self.disk is not None:
                self.disk.close(0)
            raise

    def _start(self, config: NodeConfig, context: zmq.Context | None) -> None:
        self.ctx = context or zmq.Context(io_threads=config.io_threads)
        self.sock = self._make_socket()
        self._auth: ZapAuthenticator | None = None
        # called after each reply with (op or None, reply, seconds): metrics hook
        self.observe: Callable[[Op | None, Reply, float], None] | None = None
        if config.curve_secret_key:
            self._setup_curve()
        self.sock.bind(config.bind_address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stream_ports = self._bind_stream_ports()
        # The store is used by this loop and by the bulk lane's connection threads: each
        # request is answered (and a reply's blocks marked as being sent) under this lock
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._signalled = False  # set by the signal handlers: a plain store, no lock
        self.started = time.time()
        self.counters: dict[str, int] = {f"op_{op.value.lower()}": 0 for op in Op}
        self.counters.update(bytes_in=0, bytes_out=0, bad_requests=0, dropped=0, internal_errors=0,
                             dropped_replies=0, dropped_requests=0, deferred=0)  # fmt: skip
        budget = config.max_message_size + MAX_HEADER_BYTES
        self.outbox = Outbox(self.sock, budget, config.window, self.counters)
        self._sent_blocks: list[Any] | None = None  # blocks whose views the next reply sends
        self._lane_arriving = 0  # bytes of lane PUTs being received (under the lock)
        self.verify_pool = shared_pool(config.verify_threads)  # checksums of large PUTs
        # libzmq gives a socket one monitor: the guard owns it and feeds the connection
        # counts of the metrics; without a guard the counter watches the socket itself
        self.guard: ConnectionGuard | None = None
        if config.guard_interval_s > 0:
            self.connections = ConnectionMonitor(None)
            self.guard = ConnectionGuard(self.sock, config, self.counters,
                                         self.connections.on_event, MONITOR_EVENTS)  # fmt: skip
        else:
            self.connections = ConnectionMonitor(self.sock)
        self.segment: Segment | None = None
        self._warmer: HeapWarmer | None = None
        self.shm_advert: dict[str, Any] = {}  # PING and LOCATE replies' ``shm``
        self.bulk: BulkServer | None = None
        self.events: NodeEvents | None = None
        self.publisher: EventPublisher | None = None
        try:
            self._start_events()
            self.bulk = self._make_bulk()
            if self.bulk is not None:  # serving from here on (its own threads): a node's
                self.bulk.start()  # threads all exist once it is built; close() ends them
        except BaseException:
            self.close()
            raise
        if config.shm:  # last: a node that fails to start leaves no segment file behind
            try:
                self.segment = self.store.segment = Segment(config.capacity)
            except BaseException:
                self.close()
                raise
            self.shm_advert = self.segment.advert(host_id())

    def _make_socket(self) -> zmq.Socket:
        cfg = self.config
        sock = self.ctx.socket(zmq.ROUTER)
        sock.copy_threshold = 0  # zero-copy replies, so their last frame can be tracked
        options = {
            zmq.LINGER: 0,
            zmq.ROUTER_MANDATORY: 1,  # a full or vanished peer: an error, not a silent drop
            zmq.MAXMSGSIZE: cfg.max_frame_size,
            zmq.RCVHWM: cfg.recv_hwm,
            zmq.SNDHWM: 4 * cfg.window + 64,  # header-only replies; payload is budgeted
            zmq.HANDSHAKE_IVL: int(cfg.handshake_s * 1000),
            zmq.TCP_KEEPALIVE: 1,
        }
        if not cfg.curve_secret_key:
            # libzmq takes a connection whose first bytes are no ZMTP 3 greeting for a ZMTP 1.0
            # (or 2.0) peer: these have no handshake, so any bytes become messages (which carry
            # no metadata, so no ZMQ_SRCFD), and a 1.0 peer whose handshake ends as the socket
            # closes can fail an assertion (zmtp_engine.cpp, process_routing_id_msg). libzmq
            # refuses 1.0 and 2.0 peers on a socket with ZAP on: CURVE turns it on, a ZAP
            # domain does for NULL. With no ZAP handler in the context NULL handshakes go on
            # unasked; a CURVE node's handler in the same context admits them.
            options[zmq.ZAP_DOMAIN] = NULL_ZAP_DOMAIN
        if cfg.heartbeat_s:
            options[zmq.HEARTBEAT_IVL] = int(cfg.heartbeat_s * 1000)
            options[zmq.HEARTBEAT_TIMEOUT] = int(3 * cfg.heartbeat_s * 1000)
        if cfg.socket_buffer:  # 0: leave it to the kernel's TCP autotuning
            options[zmq.SNDBUF] = options[zmq.RCVBUF] = cfg.socket_buffer
        for option, value in options.items():
            sock.setsockopt(option, value)
        return sock

    def _bind_stream_ports(self) -> list[int]:
        """One more TCP port per I/O thread, each served by its thread, for clients' streams.

        libzmq gives an accepted connection to the least loaded I/O thread, but a thread's load
        is counted only once a connection is set up: a client's streams, which connect
        together, mostly landed on one or two threads. A listener keeps the ``ZMQ_AFFINITY``
        the socket had when it was bound, so port i's connections are all served by I/O thread
        i. Same socket: same CURVE, guard, limits and outbox. Advertised in PING replies
        (``ports``); clients that ignore them use the main port as before."""
        cfg = self.config
        if not cfg.stream_ports or cfg.io_threads < 2 or not self.address.startswith("tcp://"):
            return []
        host = self.address[len("tcp://") :].rsplit(":", 1)[0]
        ports = []
        try:
            for thread in range(cfg.io_threads):
                self.sock.setsockopt(zmq.AFFINITY, 1 << thread)
                self.sock.bind(f"tcp://{host}:0")
                ports.append(int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]))
        finally:
            self.sock.setsockopt(zmq.AFFINITY, 0)
        return ports

    def _start_events(self) -> None:
        """KV events, when configured: the tiers' hooks and the publisher thread."""
        cfg = self.config
        if cfg.events_endpoint is None:
            return
        self.events = events = NodeEvents(cfg.events_queue)
        self.publisher = EventPublisher(
            self.ctx, events, self._event_snapshot, endpoint=cfg.events_endpoint,
            replay_endpoint=cfg.events_replay_endpoint, topic=cfg.events_topic,
            buffer=cfg.events_buffer,
        )  # fmt: skip
        self.store.on_stored, self.store.on_removed = events.memory_stored, events.memory_removed
        if self.disk is not None:
            self.disk.on_stored, self.disk.on_removed = events.disk_stored, events.disk_removed
        log.info("pagekv node: KV events on %s%s", self.publisher.endpoint,
                 f", replays on {self.publisher.replay_endpoint}"
                 if self.publisher.replay_endpoint else "")  # fmt: skip

    def _event_snapshot(self) -> list[tuple[str, list[bytes]]]:
        """What the node holds, per tier (the publisher's resync; its thread)."""
        with self.lock:
            memory = self.store.keys()
        return [(MEMORY, memory), (DISK, self.disk.keys() if self.disk is not None else [])]

    def _make_bulk(self) -> BulkServer | None:
        """The bulk lane (:mod:`.lane`) on the node's TCP host, when it is on and safe (never
        beside CURVE: the lane is neither encrypted nor authenticated; not on ipc://) and the
        native receive it needs is there (else said once: clients use ZeroMQ)."""
        cfg = self.config
        if not cfg.bulk or cfg.curve_secret_key or not self.address.startswith("tcp://"):
            return None
        lib, why = native.load_or_reason()
        if lib is None:
            log.warning("pagekv node: no bulk lane (its receive needs the native library): %s",
                        why.splitlines()[0])  # fmt: skip
            return None
        host = self.address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        limits = LaneLimits(cfg.bulk_connections, cfg.max_keys, cfg.handshake_s,
                            cfg.max_frames, cfg.max_frame_size, cfg.max_message_size,
                            cfg.socket_buffer)  # fmt: skip
        return BulkServer(self._answer_lane_get, self._answer_lane_put, lib, limits, host,
                          cfg.bulk_port)  # fmt: skip

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
        """SIGINT/SIGTERM stop :meth:`serve_forever` within one poll interval. The handler
        takes no lock: Python runs a handler between any two bytecodes of the main thread,
        also inside the handler of an earlier signal, and one that took the stop event's
        lock there would wait on itself forever (a node SIGTERMed twice as its parent dies)."""

        def handler(*_: object) -> None:
            self._signalled = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)

    def warm_heap(self) -> None:
        """Warm this process's malloc heap for the blocks to come, up to the capacity, on a
        thread (:class:`~.memory.HeapWarmer`). For a process whose malloc was tuned for blocks
        before it started a thread (``pagekv serve``); a ``--shm`` node keeps its blocks in its
        segment, not the heap: nothing to warm."""
        if self.segment is None and self._warmer is None:
            store = self.store
            self._warmer = HeapWarmer(lambda: store.capacity - store.used).start()

    def serve_forever(self) -> None:
        # Millions of long-lived blocks: collect the young generation far less often than the
        # default every 700 allocations (each pass costs; the index makes no reference cycles).
        gc.set_threshold(50_000, 20, 20)
        log.info(
            "pagekv node serving on %s (capacity %d bytes, pid %d)",
            self.address, self.config.capacity, os.getpid(),
        )  # fmt: skip
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.guard is not None:
            poller.register(self.guard.monitor, zmq.POLLIN)
        disk_fd = self.disk.wakeup_fd if self.disk is not None else None
        if disk_fd is not None:
            poller.register(disk_fd, zmq.POLLIN)
        idle_ms = int(self.config.guard_interval_s * 1000) or 100
        swept = time.monotonic()
        try:
            while not (self._signalled or self._stop.is_set()):
                events = dict(poller.poll(1 if self.outbox.parked else idle_ms))
                if self.guard is not None and self.guard.monitor in events:
                    self.guard.on_events()
                if disk_fd is not None and disk_fd in events:
                    self._disk_done()
                if self.sock in events:
                    self._read_some(1024)  # then housekeeping, even under a flood
                if self.outbox.parked:
                    self._serve_parked()
                now = time.monotonic()
                if self.guard is not None:
                    self.guard.tick(now)
                if now - swept > 1.0:
                    self.outbox.sweep()
                    if self.segment is not None:
                        self.store.expire(now)  # reservations never committed
                    swept = now
        finally:
            self.close()
            log.info("pagekv node %s stopped", self.address)

    def close(self) -> None:
        if self._warmer is not None:
            self._warmer.stop()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self.guard is not None:
            self.guard.close()
        self.connections.stop()
        if self.bulk is not None:
            self.bulk.close()
        self.sock.close(linger=0)
        if self.disk is not None:
            self._save_to_disk()
        if self.segment is not None:
            self.segment.unlink()  # clients' mappings stay valid; the memory goes with them
        if self.publisher is not None:
            self.events.close()
            self.publisher.close()

    def _save_to_disk(self) -> None:
        """At exit, with nothing served any more: write memory's blocks to the disk tier, most
        recently used first, and close it, all within ``shutdown_save_s`` (past it, what is
        still queued is dropped; the segment being written is sealed either way)."""
        disk, budget = self.disk, self.config.shutdown_save_s
        start = time.monotonic()
        with self.lock:  # a bulk lane thread may still be finishing a reply
            blocks = [(k, b.frames, b.size, b.checksum) for k, b in self.store.newest_first()]
        saved = disk.save(blocks, budget) if budget > 0 and disk.on else 0
        clean = disk.close(max(0.0, budget - (time.monotonic() - start)))
        self._disk_waits.clear()
        log.info("pagekv node: %d of %d memory blocks saved to the disk tier, %s, in %.1f s",
                 saved, len(blocks), "all written" if clean else "not all written",
                 time.monotonic() - start)  # fmt: skip

    def _read_some(self, most: int) -> None:
        """Read up to ``most`` requests, part by part: the header first, then each payload
        frame as its declared size says (small ones copied out at once, which is faster than
        a zero-copy frame and frees libzmq's receive buffer); parts beyond ``max_frames`` are
        dropped as they are read."""
        recv, keep, curve = self.sock.recv, self.config.max_frames, self._auth is not None
        option, rcvmore = self.sock.get, zmq.RCVMORE
        for _ in range(most):
            try:
                ident = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if not ident.more:
                self.counters["dropped"] += 1  # no header: nothing to answer
                continue
            header = recv(copy=False)
            more, parsed = header.more, self._parse(header)
            sizes = parsed.sizes if isinstance(parsed, Request) else ()
            parts, extra, wire = [], 0, wire_bytes([len(header)], curve)
            while more:
                i = len(parts) + extra
                if i < len(sizes) and sizes[i] <= handlers.SHARED_BUFFER_BYTES:
                    data = recv()
                    more = option(rcvmore)
                else:
                    data = recv(copy=False)
                    more = data.more
                size = len(data)
                wire += size + 33 + (2 if size < 223 else 9) if curve else size + (
                    2 if size < 256 else 9)  # fmt: skip
                if len(parts) < keep:
                    parts.append(data)
                else:
                    extra += 1
            if self.guard is not None:
                self.guard.seen(source_fd(header), wire)
            self._answer(ident.bytes, header, parsed, parts, extra)

    def _parse(self, header: zmq.Frame) -> Request | ProtocolError:
        try:
            req = decode_request(header.buffer)
        except ProtocolError as e:
            return e
        if len(req.keys) > self.config.max_keys:
            return ProtocolError(Code.TOO_LARGE, f"{len(req.keys)} keys is over the limit")
        return req

    # ---- requests --------------------------------------------------------------------------
    def handle(self, frames: list[Any], extra_frames: int = 0) -> None:
        """Answer one request given as frames (identity, header, payloads...)."""
        if len(frames) < 2:
            self.counters["dropped"] += 1  # no header: nothing to answer
            return
        header = frames[1] if isinstance(frames[1], zmq.Frame) else zmq.Frame(frames[1])
        ident = frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0]
        self._answer(ident, header, self._parse(header), frames[2:], extra_frames)

    def _answer(
        self, ident: bytes, header: zmq.Frame, parsed: Request | ProtocolError,
        payloads: list[Any], extra_frames: int,
    ) -> None:  # fmt: skip
        """Answer one request; malformed input gets an error reply, never an exception."""
        with self.lock:
            self._answer_locked(ident, header, parsed, payloads, extra_frames)

    def _answer_locked(
        self, ident: bytes, header: zmq.Frame, parsed: Request | ProtocolError,
        payloads: list[Any], extra_frames: int,
    ) -> None:  # fmt: skip
        start, op = time.perf_counter(), None
        size = sum(map(len, payloads))
        self.counters["bytes_in"] += size + len(header)
        try:
            if size > self.config.max_message_size:
                raise ProtocolError(Code.TOO_LARGE, f"payload of {size} bytes is over the limit")
            if extra_frames:
                raise ProtocolError(Code.TOO_LARGE, f"over {self.config.max_frames} frames")
            if isinstance(parsed, ProtocolError):
                raise parsed
            op = parsed.op
            if op is Op.GET and not payloads and self.outbox.must_park(ident):
                self.outbox.park(ident, parsed)  # answered when its replies drain
                return
            answer = self._dispatch(parsed, payloads, ident, start)
            if answer is None:  # waiting on the disk: answered by _disk_done
                return
            rep, out = answer
        except Exception as e:
            rep, out = self._error_reply(handlers.best_effort_id(header), e), []
        self._send(ident, rep, out)
        self._observe(op, rep, start)

    def _observe(self, op: Op | None, rep: Reply, start: float, tier: str = "memory") -> None:
        seconds = time.perf_counter() - start
        if self.observe is not None:
            self.observe(op, rep, seconds)
        if op is Op.GET and self.observe_get is not None:
            self.observe_get(tier, seconds)

    def _get(self, req: Request, ident: bytes | None = None,
             start: float = 0.0) -> tuple[Reply, list[Any]] | None:  # fmt: skip
        """A GET's reply and payload, or None when it waits on disk reads (``ident``: the
        ZeroMQ peer it is answered to then)."""
        sent = [] if self.segment is not None else None
        got = handlers.get(self.store, self.config.max_message_size, req, sent, self.disk)
        if isinstance(got, handlers.DiskGet):
            self._wait_on_disk(ident, got, got.keys, sent, got.nbytes, start)
            return None
        rep, out, deferred = got
        self.counters["deferred"] += deferred
        self._sent_blocks = sent
        return rep, out

    def _serve_parked(self) -> None:
        for ident, req in self.outbox.ready():
            start = time.perf_counter()
            with self.lock:
                self.counters["op_get"] += 1
                try:
                    answer = self._get(req, ident, start)
                except Exception as e:
                    answer = self._error_reply(req.id, e), []
                if answer is not None:
                    self._send(ident, *answer)
                    self._observe(Op.GET, answer[0], start)

    # ---- the disk tier ---------------------------------------------------------------------
    def _offer_to_disk(self, key: bytes, block: Block) -> None:
        """The store's eviction hook: the block goes to the disk writer's queue (copied when
        its frames are views of the segment, whose space is reused as soon as this returns)."""
        self.disk.offer(key, block.frames, block.size, block.checksum,
                        copy=block.extent is not None)  # fmt: skip

    def _wait_on_disk(self, ident: bytes, work: Any, keys: list[bytes], sent: list | None,
                      nbytes: int, start: float) -> None:  # fmt: skip
        """Park a request (under the lock) while ``keys`` are read; :meth:`_disk_done` answers
        it. Its memory blocks (``sent``, with a segment) keep their space until then."""
        hold = None
        if sent:
            hold = SendDone()
            self.store.sent(sent, hold)
        token, self._tokens = self._tokens, self._tokens + 1
        peer = self.outbox.hold(ident, nbytes)
        self._disk_waits[token] = _DiskWait(ident, work, keys, sent, hold, peer, nbytes, start)
        self.disk.read_many(keys, token, own=self._own_reads)

    @property
    def _own_reads(self) -> bool:
        """Whether reads are for keeping: promoted blocks kept as read (no segment to copy
        them into) must not pin buffers shared with other blocks."""
        return self.config.disk_promote and self.segment is None

    def _to_locate(self, keys: list[bytes]) -> tuple[list[bytes], frozenset[bytes]]:
        """The keys of a LOCATE to promote from disk first: those memory lacks, in key order,
        while they take at most ``LOCATE_PROMOTE_SHARE`` of the memory (more would evict the
        first ones before the reply names them; the first is taken whatever its size); and
        the disk's other keys, which its reply defers (the client asks for them again)."""
        if self.segment is None:
            return [], frozenset()
        store, size_of = self.store, self.disk.size_of
        room, out, later = int(self.config.capacity * LOCATE_PROMOTE_SHARE), [], []
        for key in keys:
            if key in store:
                continue
            size = size_of(key)
            if size is None:
                continue
            room -= size
            if room < 0 and out:
                later.append(key)
                room = -1  # none after the first deferred one: the reply stays in key order
            else:
                out.append(key)
        return out, frozenset(later)

    def _promote(self, keys: list[bytes], blocks: list[DiskBlock | None]) -> list[bytes]:
        """Put blocks read from disk back into memory (under the lock), while the disk's write
        queue has room for what they may evict (a block evicted past it would be lost: a
        promotion is never worth a block); the keys of the others, left on disk only. A block
        the disk no longer holds as read (deleted while it was read) is not put back."""
        skipped = []
        put, room, holds = self.store.put, self.disk.queue_room(), self.disk.holds
        # room kept for what is on its way in (the last PUT's own size is no longer arriving)
        self.store.arriving = self._held_bytes()
        for key, block in zip(keys, blocks):
            if block is None or not holds(key, block.checksum):
                continue
            room -= block.size
            if room < 0:
                skipped.append(key)
                continue
            put(key, block.frames, block.size, block.checksum, block.held)
        self._promote_skipped += len(skipped)
        return skipped

    def _promote_read(self, keys: list[bytes], blocks: list[DiskBlock | None]) -> None:
        """A GET's blocks read from disk into memory, with promotion on (under the lock, once
        its reply holds the space of the memory blocks it sends: a promotion may evict them)."""
        if not self.config.disk_promote:
            return
        try:
            self._promote(keys, blocks)
        except Exception:  # a bug: the blocks stay on disk, the node serves on
            log.exception("pagekv store: promoting blocks read from disk failed")

    def _disk_done(self) -> None:
        """Answer the requests whose disk reads have completed."""
        for token, blocks in self.disk.completed():
            wait = self._disk_waits.pop(token, None)
            if wait is None:  # pragma: no cover - every token is parked before its read
                continue
            op = Op.GET if isinstance(wait.work, handlers.DiskGet) else Op.LOCATE
            with self.lock:
                self.outbox.release(wait.peer, wait.nbytes)
                try:
                    rep, out = self._finish(wait.work, wait.keys, blocks)
                except Exception as e:  # a bug: answered INTERNAL, the node serves on
                    rep, out = self._error_reply(wait.work.req.id, e), []
                self._sent_blocks = wait.sent
                self._send(wait.ident, rep, out)
                if wait.hold is not None:
                    wait.hold.done = True  # the blocks' space now waits for the reply itself
                if op is Op.GET:
                    self._promote_read(wait.keys, blocks)
                self._observe(op, rep, wait.start, "disk")

    def _finish(self, work: Any, keys: list[bytes],
                blocks: list[DiskBlock | None]) -> tuple[Reply, list[Any]]:  # fmt: skip
        """The reply to a request whose disk reads are done (under the lock). A LOCATE's
        blocks are promoted first (its reply names them in the segment); a GET's by the
        caller once the reply holds its memory blocks' space (:meth:`_promote_read`)."""
        if isinstance(work, handlers.DiskGet):
            rep, out = handlers.finish_get(work, blocks)
            self.counters["deferred"] += work.deferred
            return rep, out
        # a LOCATE: what it finds must be in the segment; what could not be promoted is
        # deferred as what it did not try
        later = work.later.union(self._promote(keys, blocks))
        return handlers.locate(self.store, work.req, self.shm_advert, later), []

    def _answer_lane_get(self, req: Request) -> tuple[Reply, list[Any], SendDone | None]:
        """The bulk lane's answer to one GET (:data:`.lane.Answer`; any connection thread):
        dispatched under :attr:`lock` as the ZeroMQ loop's requests are; values on disk are
        read with the lock released. Never raises on input."""
        start = time.perf_counter()
        planned, done = None, None
        with self.lock:
            self.counters["op_get"] += 1
            sent = [] if self.segment is not None else None
            try:
                got = handlers.get(self.store, self.config.max_message_size, req, sent,
                                   self.disk)  # fmt: skip
                if isinstance(got, handlers.DiskGet):
                    planned = got
                    rep, out = Reply(req.id), []
                else:
                    rep, out, deferred = got
                    self.counters["deferred"] += deferred
            except Exception as e:
                rep, out, sent = self._error_reply(req.id, e), [], None
            if sent:  # views of the segment: their space waits for this reply
                done = SendDone()
                self.store.sent(sent, done)
            if planned is None:
                return self._lane_reply(rep, out, done, start, "memory")
        blocks = self.disk.read_many_wait(planned.keys, LANE_DISK_WAIT_S, own=self._own_reads)
        with self.lock:
            try:
                rep, out = self._finish(planned, planned.keys, blocks)
            except Exception as e:
                rep, out = self._error_reply(req.id, e), []
            self._promote_read(planned.keys, blocks)  # the space sent from waits for ``done``
            return self._lane_reply(rep, out, done, start, "disk")

    def _answer_lane_put(self, req: Request, receive: Receive) -> Reply:
        """The bulk lane's answer to one PUT (:data:`.lane.StorePut`; any connection thread):
        room is kept for its payload while it arrives (the store's lock released), then its
        values are stored under the lock as the ZeroMQ loop's are, checked against the
        digests taken as they landed."""
        start, nbytes = time.perf_counter(), sum(req.sizes)
        with self.lock:
            self.counters["op_put"] += 1
            self._lane_arriving += nbytes
            self.store.arriving = self._held_bytes()
            self.store.make_room()
        try:
            frames, digests = receive(self.config.verify_puts)
        except BaseException:
            with self.lock:
                self._lane_arriving -= nbytes
            raise
        with self.lock:
            self.counters["bytes_in"] += nbytes
            self.store.arriving = self._held_bytes()
            self._lane_arriving -= nbytes
            try:
                rep = handlers.put(self.store, self.config, req, frames, disk=self.disk,
                                   digests=digests)  # fmt: skip
            except Exception as e:
                rep = self._error_reply(req.id, e)
            self._observe(Op.PUT, rep, start)
        return rep

    def _held_bytes(self) -> int:
        """Bytes of PUTs on their way in: received by libzmq and not read yet, and being
        received on the bulk lane (under :attr:`lock`)."""
        return (self.guard.held_bytes if self.guard is not None else 0) + self._lane_arriving

    def _lane_reply(self, rep: Reply, out: list[Any], done: SendDone | None, start: float,
                    tier: str) -> tuple[Reply, list[Any], SendDone | None]:  # fmt: skip
        self.counters["bytes_out"] += sum(len(p) for p in out)
        if done is not None and not out:
            done.done = True  # nothing to send: the space is free again
            done = None
        self._observe(Op.GET, rep, start, tier)
        return rep, out, done

    def _error_reply(self, rid: int, error: Exception) -> Reply:
        """The reply to a request that raised ``error`` (called in its ``except`` block):
        bad input (``ProtocolError``) is counted; anything else is a bug, logged and answered
        ``INTERNAL``, and the node keeps serving."""
        if isinstance(error, ProtocolError):
            self.counters["bad_requests"] += 1
            return Reply(id=rid, code=error.code, error=str(error))
        log.exception("pagekv node: internal error on a request")
        self.counters["internal_errors"] += 1
        return Reply(id=rid, code=Code.INTERNAL, error=repr(error))

    def _send(self, ident: bytes, rep: Reply, payloads: list[Any]) -> None:
        sent, self._sent_blocks = self._sent_blocks, None
        if self.outbox.send(ident, encode_reply(rep), payloads):
            self.counters["bytes_out"] += sum(len(p) for p in payloads)
            if sent and payloads:  # views of the segment: its space waits for this reply
                self.store.sent(sent, self.outbox.last_tracker)

    def _dispatch(self, req: Request, payloads: list[Any], ident: bytes = b"",
                  start: float = 0.0) -> tuple[Reply, list[Any]] | None:  # fmt: skip
        """The reply to ``req`` and its payload, or None when it waits on the disk (a GET or
        LOCATE from ZeroMQ peer ``ident``, answered once its reads are done)."""
        self.counters[f"op_{req.op.value.lower()}"] += 1
        if req.op is not Op.PUT and payloads:
            raise ProtocolError(Code.BAD_FRAMES, f"{req.op.value} takes no payload frames")
        if req.op is Op.PUT:
            pool = self.verify_pool
            # room for what is on its way in: this request (its values are stored one by one,
            # each evicting as needed) and the requests libzmq holds unread
            self.store.arriving = self._held_bytes() + sum(req.sizes)
            return handlers.put(self.store, self.config, req, payloads, pool, self.disk), []
        if req.op is Op.GET:
            return self._get(req, ident, start)
        if req.op is Op.EXISTS:
            status = self.store.statuses(req.keys)
            if self.disk is not None:
                contains, ok = self.disk.contains, int(Status.OK)
                status = [ok if s and contains(k) else s for k, s in zip(req.keys, status)]
            hits = next((i for i, s in enumerate(status) if s), len(status))
            return Reply(req.id, status=status, hits=hits), []
        if req.op is Op.DELETE:
            return Reply(req.id, status=[int(self._delete(k)) for k in req.keys]), []
        if req.op is Op.LOCATE:
            keys, later = self._to_locate(req.keys) if self.disk is not None else ([], None)
            if keys:  # promoted into the segment first: LOCATE answers from there only
                self._wait_on_disk(ident, _Locate(req, later), keys, None, 0, start)
                return None
            return handlers.locate(self.store, req, self.shm_advert), []
        if req.op is Op.RESERVE:
            return handlers.reserve(self.store, req, self.shm_advert, self.disk), []
        if req.op is Op.COMMIT:
            return handlers.commit(self.store, self.config, req, self.verify_pool), []
        if req.op is Op.STATS:
            return Reply(req.id, stats=self.stats()), []
        bulk = self.bulk.port if self.bulk is not None else 0  # PING from here on
        return Reply(req.id, limits=self.config.limits(), shm=self.shm_advert,
                     ports=self.stream_ports, bulk=bulk), []  # fmt: skip

    def _delete(self, key: bytes) -> Status:
        """Forget ``key`` in both tiers."""
        found = self.store.delete(key)
        if self.disk is not None:
            found = self.disk.delete(key) or found
        return Status.OK if found else Status.NOT_FOUND

    def stats(self) -> dict[str, Any]:
        disk = {}
        if self.disk is not None:
            disk = {**self.disk.stats(), "disk_waiting": len(self._disk_waits),
                    "disk_promote_skipped": self._promote_skipped}  # fmt: skip
        events = {}
        if self.publisher is not None:
            events = {**self.events.counters, **self.publisher.counters}
        guard, auth = self.guard, self._auth.stats() if self._auth is not None else {}
        return {**self.store.stats(), **self.counters, **auth, "address": self.address,
                "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1),
                "connections": len(guard.conns) if guard else -1,
                "reply_bytes_in_flight": self.outbox.inflight_bytes(),
                "parked": self.outbox.parked, "stream_ports": self.stream_ports,
                "bulk_port": self.bulk.port if self.bulk else 0,
                "bulk_open": self.bulk.open_connections if self.bulk else 0,
                "heap_warmed_bytes": self._warmer.warmed if self._warmer else 0,
                "heap_warming": self._warmer is not None and not self._warmer.done,
                **(self.bulk.counters if self.bulk else {}), **disk, **events}  # fmt: skip
