"""A node's KV events on ZeroMQ, in vLLM's KV-event wire format (vLLM 0.32,
``vllm.distributed.kv_events``), so a subscriber written for vLLM's engines reads them too.

Wire format (what :func:`encode_batch` writes, byte for byte what vLLM's msgspec encoder
writes for the same ``KVEventBatch``; tests/engines/test_vllm_events.py checks it):

* a batch is the msgpack array ``[ts, events, data_parallel_rank]`` (``ts``: float64 seconds
  since the epoch; the rank nil: a node has none);
* an event is a msgpack map, its tag first: ``{"type": "BlockStored", "block_hashes": [...],
  "parent_block_hash": nil, "token_ids": [], "block_size": 0, "lora_id": nil, "medium": M,
  "lora_name": nil}``, ``{"type": "BlockRemoved", "block_hashes": [...], "medium": M}`` or
  ``{"type": "AllBlocksCleared"}``. A node's block hashes are its store keys (msgpack bin);
  it knows no tokens (``token_ids`` empty, ``block_size`` 0) and ``M`` names the tier
  (:data:`~.events.MEMORY`, :data:`~.events.DISK`).

Sockets (as vLLM's ``ZmqEventPublisher``): a PUB socket sends each batch as three frames,
``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter from 0 for this node's life;
an optional ROUTER socket answers a replay request (a DEALER sends ``(b"", start_seq)``, 8
bytes big-endian) with every batch still buffered from ``start_seq`` on, each as
``(b"", topic, seq, payload)``, then ``(b"", b"", -1 as 8 signed bytes, b"")``. The last
``buffer`` batches are kept for replay.

One thread does all of it: it waits for changes (:class:`~.events.NodeEvents`), encodes them
(at most :data:`MAX_BATCH_KEYS` keys a batch), sends, and answers replays. The node's threads
only append to the pending list; the PUB socket drops batches a slow subscriber cannot take
(its high-water mark), so no subscriber can hold the node up. A subscriber that sees a gap in
``seq`` asks for a replay; one that sees ``seq`` go back knows the node restarted and asks for
a replay from 0 (a node's first batch is ``AllBlocksCleared`` and what it holds). An idle node
sends an empty batch every :data:`HEARTBEAT_S` seconds (kept for replay like any), so a
subscriber learns of a lost last batch, or of a restart, within that time.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import zmq

from .events import NodeEvents, Run

__all__ = ["END_SEQ", "MAX_BATCH_KEYS", "EventPublisher", "EventsBindError", "encode_batch"]

log = logging.getLogger("pagekv.store")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH_KEYS = 4096  # keys in one batch (a resync of a large node is many batches)
WAIT_S = 0.05  # the thread looks for replay requests at least this often
HEARTBEAT_S = 1.0  # an idle node's empty batches
PUB_HWM = 100_000  # batches queued per subscriber before PUB drops them (vLLM's default)

Snapshot = Callable[[], "list[tuple[str, list[bytes]]]"]  # [(medium, keys)]: what a node holds

_BLOCK_STORED_HEAD = msgpack.packb({"type": "BlockStored"})[1:]  # the map's tag pair
_BLOCK_REMOVED_HEAD = msgpack.packb({"type": "BlockRemoved"})[1:]


class EventsBindError(zmq.ZMQError):
    """An events endpoint could not be bound (``endpoint`` names it)."""

    def __init__(self, endpoint: str, error: zmq.ZMQError) -> None:
        super().__init__(error.errno, error.strerror)
        self.endpoint = endpoint


def _event(stored: bool, medium: str | None, keys: list[bytes]) -> bytes:
    """One encoded event (msgpack map, in vLLM's field order)."""
    pack = msgpack.packb
    if stored:
        return (b"\x88" + _BLOCK_STORED_HEAD + pack("block_hashes") + pack(keys)
                + pack("parent_block_hash") + b"\xc0" + pack("token_ids") + b"\x90"
                + pack("block_size") + b"\x00" + pack("lora_id") + b"\xc0"
                + pack("medium") + pack(medium) + pack("lora_name") + b"\xc0")  # fmt: skip
    return (b"\x83" + _BLOCK_REMOVED_HEAD + pack("block_hashes") + pack(keys)
            + pack("medium") + pack(medium))  # fmt: skip


_ALL_CLEARED = b"\x81" + msgpack.packb({"type": "AllBlocksCleared"})[1:]


def encode_batch(ts: float, events: list[Run | None]) -> bytes:
    """A ``KVEventBatch`` of ``events``: runs ``(stored, medium, keys)``, or None for
    ``AllBlocksCleared``."""
    parts = [b"\x93", b"\xcb" + struct.pack(">d", ts), _array_head(len(events))]
    for ev in events:
        parts.append(_ALL_CLEARED if ev is None else _event(*ev))
    parts.append(b"\xc0")  # no data-parallel rank
    return b"".join(parts)


def _array_head(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def _batches(events: list[Run | None]) -> Iterator[list[Run | None]]:
    """``events`` cut into batches of at most :data:`MAX_BATCH_KEYS` keys, in order."""
    batch: list[Run | None] = []
    room = MAX_BATCH_KEYS
    for ev in events:
        if ev is None:
            batch.append(None)
            continue
        stored, medium, keys = ev
        i = 0
        while i < len(keys):
            if room == 0:
                yield batch
                batch, room = [], MAX_BATCH_KEYS
            part = keys[i : i + room]
            batch.append((stored, medium, part))
            room -= len(part)
            i += len(part)
    if batch:
        yield batch


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``sock``; the endpoint bound (its port when ``endpoint`` asked for any)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise EventsBindError(endpoint, e) from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class EventPublisher:
    """Publishes ``events`` from a thread of its own. ``snapshot()``: the node's contents per
    medium, called (on this thread) for a resync. Binds its sockets here (raises
    :class:`EventsBindError` on a bad or busy endpoint); :meth:`close` sends what is pending
    and stops. ``counters``: batches and keys published, replays served."""

    def __init__(self, ctx: zmq.Context, events: NodeEvents, snapshot: Snapshot, *,
                 endpoint: str, replay_endpoint: str | None, topic: str,
                 buffer: int) -> None:  # fmt: skip
        self.events, self.snapshot = events, snapshot
        self.topic = topic.encode()
        self._seq = 0
        self._last_sent = 0.0  # monotonic
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer)
        self.counters = {"event_batches": 0, "event_keys": 0, "event_replays": 0}
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            self._pub.setsockopt(zmq.LINGER, 500)
            self.endpoint = _bind(self._pub, endpoint)
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # a whole replay and its end marker wait for a peer that is not reading yet
                # (past the high-water mark a ROUTER drops messages without a word)
                self._replay.setsockopt(zmq.SNDHWM, buffer + 1)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagekv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._serve_replays(0)
                self._publish_pending()
                if self._replay is not None:
                    self._serve_replays(int(WAIT_S * 1000))
                else:
                    self.events.wakeup.wait(WAIT_S)
            self._publish_pending()  # what the node said last (its AllBlocksCleared at exit)
        except Exception:  # a bug: said, and the node serves on without events
            log.exception("pagekv node: the event publisher stopped")
        finally:
            self._close_sockets()

    def _publish_pending(self) -> None:
        events: list[Run | None] = []
        if self.events.resync_due:
            self.events.begin_resync()
            events.append(None)  # AllBlocksCleared, then everything the node holds
            events.extend((True, medium, keys) for medium, keys in self.snapshot() if keys)
        events.extend(self.events.take())
        if not events and time.monotonic() - self._last_sent >= HEARTBEAT_S:
            self._send(encode_batch(time.time(), []))
        for batch in _batches(events):
            self._send(encode_batch(time.time(), batch))
            self.counters["event_keys"] += sum(len(ev[2]) for ev in batch if ev is not None)

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._buffer.append((seq, payload))
        self._last_sent = time.monotonic()
        self.counters["event_batches"] += 1

    def _serve_replays(self, timeout_ms: int) -> None:
        replay = self._replay
        if replay is None:
            return
        while replay.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            frames = replay.recv_multipart()
            if len(frames) != 3:  # not (identity, b"", start): ignored
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.counters["event_replays"] += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    replay.send_multipart((ident, b"", self.topic, seq.to_bytes(8, "big"),
                                           payload))  # fmt: skip
            replay.send_multipart((ident, b"", b"", END_SEQ, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is pending, then stop (at most ``timeout_s``). Idempotent."""
        self._stop.set()
        self.events.wakeup.set()
        self._thread.join(timeout_s)

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
