"""A KV-event subscriber for the tests: vLLM's wire format read with plain msgpack (checked
against vLLM's own types in tests/engines/test_vllm_events.py), and an index of stored blocks
rebuilt from a publisher's batches, asking its replay socket for what it missed.

:func:`decode_batch` gives objects with the attributes of vLLM's ``KVEventBatch`` and events
(``ts``, ``events``; ``block_hashes``, ``medium``...), their class names those of vLLM's;
:class:`Subscriber` takes any such decoder (``decode=vLLM's msgspec decoder`` works too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

END_SEQ = -1


@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: Any
    token_ids: list
    block_size: int
    lora_id: Any
    medium: str | None
    lora_name: str | None
    extra: dict = field(default_factory=dict)  # the fields with defaults that were sent


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None
    extra: dict = field(default_factory=dict)


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class KVEventBatch:
    ts: float
    events: list
    data_parallel_rank: int | None = None


_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
           "lora_name")  # fmt: skip


def decode_batch(payload: bytes) -> KVEventBatch:
    """One batch; raises ``ValueError`` on anything that is not vLLM's format."""
    top = msgpack.unpackb(payload, raw=False)
    if not isinstance(top, list) or len(top) not in (2, 3) or not isinstance(top[0], float):
        raise ValueError(f"not a KVEventBatch: {top!r:.200}")
    events = []
    for ev in top[1]:
        kind = ev.pop("type")
        if kind == "BlockStored":
            events.append(BlockStored(*(ev.pop(k) for k in _STORED), extra=ev))
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(ev.pop("block_hashes"), ev.pop("medium"), extra=ev))
        elif kind == "AllBlocksCleared" and not ev:
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown event {kind!r}: {ev!r:.200}")
    return KVEventBatch(top[0], events, *top[2:])


class Subscriber:
    """Rebuilds ``index`` (medium -> set of block hashes) from a publisher's batches.

    Batches arrive on a SUB socket as ``(topic, seq, payload)``; a gap in ``seq`` (or a first
    batch after 0) is filled from the replay socket first; a ``seq`` lower than expected means
    the publisher restarted: everything is replayed from 0. ``drop``: sequence numbers to
    ignore once when they arrive on the SUB socket (a lossy network, for the tests)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None,
                 decode: Callable[[bytes], Any] = decode_batch, topic: bytes = b"",
                 rcvhwm: int = 0) -> None:  # fmt: skip
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        if rcvhwm:
            self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
        self.replay_endpoint = replay_endpoint
        self.decode, self.topic = decode, topic
        self.index: dict[str, set] = {}
        self.next_seq = 0
        self.batches: list[Any] = []  # every batch applied, in order
        self.replays = 0
        self.drop: set[int] = set()

    def close(self) -> None:
        self.sub.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stored(self, medium: str) -> set:
        return self.index.get(medium, set())

    def poll(self, timeout_ms: int = 100) -> int:
        """Apply the batches that arrive within ``timeout_ms`` (and what they show missing);
        how many were applied."""
        applied = 0
        while self.sub.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic or self.topic == b"", topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq in self.drop:
                self.drop.discard(seq)
                continue
            if seq < self.next_seq:  # the publisher restarted
                self.index.clear()
                self.next_seq = 0
                applied += self._replay(0)
            elif seq > self.next_seq:
                applied += self._replay(self.next_seq)
            if seq == self.next_seq:
                applied += self._apply(seq, payload)
        return applied

    def _replay(self, start: int) -> int:
        """Ask the replay socket for every batch from ``start`` on; apply them."""
        assert self.replay_endpoint is not None, f"batches before {start} missed, no replay"
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint.replace("0.0.0.0", "127.0.0.1"))
        applied = 0
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                _, _topic, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return applied
                if seq == self.next_seq:
                    applied += self._apply(seq, payload)
        finally:
            dealer.close()

    def _apply(self, seq: int, payload: bytes) -> int:
        batch = self.decode(payload)
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.index.clear()
            elif kind == "BlockStored":
                self.index.setdefault(ev.medium, set()).update(ev.block_hashes)
            elif kind == "BlockRemoved":
                self.index.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
        self.batches.append(batch)
        self.next_seq = seq + 1
        return 1
