"""Cluster logic shared by the blocking and the asyncio client, free of I/O.

Keys are sharded by rendezvous hashing: each key ranks every node by ``xxh3_64(node || key)``;
writes go to the first ``replicas`` healthy nodes of that ranking, reads and lookups try nodes
in ranking order (down nodes skipped) up to ``replicas + 1`` of them. A node that fails or times
out is marked down with exponential back-off; a reply marks it up again.

Each operation is a generator: it yields batches of :class:`Call` (a request for one node, big
puts cut into several requests of at most ``max_message_bytes``), receives ``{request id:
(Reply, frames) | None}`` (None: the node failed or timed out), and returns its result. The
clients only move the batches.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from pagekv.errors import StoreError, StoreUnavailable

from .protocol import Code, Op, Reply, Request, Status, checksum_frames

__all__ = ["Call", "ExistsResult", "NodeHealth", "Router", "StoreError", "StoreUnavailable"]

Results = dict[int, "tuple[Reply, list[Any]] | None"]
log = logging.getLogger("pagekv.store.routing")


@dataclass
class Call:
    node: int
    request: Request
    payloads: list[Any]
    idxs: list[int]  # positions of the request's keys in the caller's key list
    # Clients call this as soon as the reply arrives (a GET's blocks are checked and copied
    # out while later replies are still on the wire); else it runs when the batch returns.
    on_reply: Callable[[Reply, list[Any]], None] | None = None
    handled: bool = False


Batch = list[Call]
OpGen = Generator[Batch, Results, Any]


@dataclass(frozen=True)
class ExistsResult:
    found: list[bool]

    @property
    def leading(self) -> int:
        """Number of leading keys found (the prefix that can be loaded)."""
        return next((i for i, f in enumerate(self.found) if not f), len(self.found))


class NodeHealth:
    def __init__(self, backoff_min: float, backoff_max: float) -> None:
        self.backoff_min, self.backoff_max = backoff_min, backoff_max
        self.down_until = 0.0
        self.backoff = 0.0
        self.failures = 0

    def is_up(self, now: float) -> bool:
        return now >= self.down_until

    def failed(self, now: float) -> None:
        self.failures += 1
        self.backoff = min(self.backoff_max, max(self.backoff_min, self.backoff * 2))
        self.down_until = now + self.backoff

    def succeeded(self) -> None:
        self.down_until, self.backoff = 0.0, 0.0


class Router:
    def __init__(
        self,
        endpoints: Sequence[str],
        replicas: int,
        backoff: tuple[float, float],
        max_message_bytes: int = 16 << 20,
        get_keys_per_request: int = 8,
    ) -> None:
        self.endpoints = list(endpoints)
        self.max_message_bytes = max_message_bytes
        self.get_keys_per_request = get_keys_per_request
        self.replicas = replicas
        self.health = [NodeHealth(*backoff) for _ in self.endpoints]
        self._salt = [ep.encode() for ep in self.endpoints]
        self._ids = itertools.count(1)
        self.counters = {"checksum_mismatch": 0, "node_failures": 0, "size_mismatch": 0}

    def next_id(self) -> int:
        return next(self._ids)

    def ranking(self, key: bytes) -> list[int]:
        """All node indices, best first, for ``key`` (rendezvous hashing)."""
        if len(self.endpoints) == 1:
            return [0]
        scores = [xxhash.xxh3_64_intdigest(salt + key) for salt in self._salt]
        return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)

    def _candidates(self, keys: Sequence[bytes], limit: int) -> list[list[int]]:
        """Per key, the first ``limit`` live nodes of its ranking (all down: try anyway)."""
        if len(self.endpoints) == 1:
            return [[0] for _ in keys]
        now = time.monotonic()
        up = [h.is_up(now) for h in self.health]
        out = []
        for key in keys:
            ranked = self.ranking(key)
            live = [n for n in ranked if up[n]]
            out.append(live[:limit] if live else ranked[:limit])
        return out

    def record(self, batch: Batch, results: Results) -> None:
        now = time.monotonic()
        for call in batch:
            result = results.get(call.request.id)
            health = self.health[call.node]
            if result is None:
                was_up = health.is_up(now)
                health.failed(now)
                if was_up:  # logged once per back-off period, not per request
                    self.counters["node_failures"] += 1
                    log.warning("pagekv store: %s did not answer (down, unreachable or refusing "
                                "this client's key); backing off %.2g s",
                                self.endpoints[call.node], health.backoff)  # fmt: skip
                continue
            if health.failures and health.backoff:
                log.info("pagekv store: %s answers again", self.endpoints[call.node])
            health.succeeded()
            if result[0].code is not Code.OK:
                ep = self.endpoints[call.node]
                raise StoreError(f"{ep}: {result[0].code.name} {result[0].error}")

    # ---- operations ------------------------------------------------------------------------
    def _calls(self, op: Op, targets: dict[int, list[int]], keys: Sequence[bytes]) -> Batch:
        return [
            Call(node, Request(op, self.next_id(), [keys[i] for i in idxs]), [], idxs)
            for node, idxs in targets.items()
        ]

    def put(self, keys: Sequence[bytes], values: Sequence[list[memoryview]]) -> OpGen:
        """``values[i]``: the frames of key i (byte views, see :func:`value_frames`)."""
        sums = [checksum_frames(v) for v in values]
        nbytes = [sum(f.nbytes for f in v) for v in values]
        targets: dict[int, list[int]] = {}
        for i, nodes in enumerate(self._candidates(keys, self.replicas)):
            for node in nodes:
                targets.setdefault(node, []).append(i)
        batch: Batch = []
        for node, idxs in targets.items():
            for part in _cut(idxs, [nbytes[i] for i in idxs], self.max_message_bytes):
                frames = [f for i in part for f in values[i]]
                req = Request(Op.PUT, self.next_id(), [keys[i] for i in part],
                              [f.nbytes for f in frames], [sums[i] for i in part],
                              [len(values[i]) for i in part])  # fmt: skip
                batch.append(Call(node, req, frames, part))
        results = yield batch
        self.record(batch, results)
        seen: list[list[int]] = [[] for _ in keys]
        for call in batch:
            result = results.get(call.request.id)
            if result is not None:
                for i, st in zip(call.idxs, result[0].status):
                    seen[i].append(st)
        return [_merge_put(sts) for sts in seen]

    def _lookup(self, op: Op, keys: Sequence[bytes], on_hit) -> OpGen:
        """Ask each key's candidates in turn until ``on_hit`` accepts an answer."""
        pending = dict(enumerate(self._candidates(keys, self.replicas + 1)))
        per_request = self.get_keys_per_request if op is Op.GET else len(keys)

        def handle(call: Call, reply: Reply, frames: list[Any]) -> None:
            call.handled = True
            found = reply.status.count(Status.OK) if op is Op.GET else 0
            counts = reply.counts if op is Op.GET else []
            if (
                len(reply.status) != len(call.idxs)
                or len(counts) != found
                or len(reply.sums) != found
                or any(type(c) is not int or c < 1 for c in counts)
                or sum(counts) != len(frames)
            ):
                self.counters["node_failures"] += 1  # malformed reply: treat as a miss
                return
            values = iter(zip(reply.sums, counts))
            start = 0
            for i, st in zip(call.idxs, reply.status):
                if st != Status.OK:
                    continue
                if op is not Op.GET:
                    if on_hit(i, None, []):
                        pending.pop(i, None)
                    continue
                cs, count = next(values)
                if on_hit(i, cs, frames[start : start + count]):
                    pending.pop(i, None)
                start += count

        while pending:
            wave: dict[int, list[int]] = {}
            for i, cands in pending.items():
                wave.setdefault(cands.pop(0), []).append(i)
            batch: Batch = []
            for node, idxs in wave.items():
                for start in range(0, len(idxs), per_request):
                    part = idxs[start : start + per_request]
                    req = Request(op, self.next_id(), [keys[i] for i in part])
                    batch.append(Call(node, req, [], part))
            for call in batch:
                call.on_reply = functools.partial(handle, call)
            results = yield batch
            self.record(batch, results)
            for call in batch:
                result = results.get(call.request.id)
                if result is not None and not call.handled:
                    handle(call, *result)
            pending = {i: c for i, c in pending.items() if c}

    def get(self, keys: Sequence[bytes], into: Sequence[list[memoryview]] | None) -> OpGen:
        """``into[i]``: the byte views that key i's frames are scattered into, or None."""
        out: list[Any] = [None] * len(keys)

        def on_hit(i: int, cs: int, frames: list[Any]) -> bool:
            data = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
            if checksum_frames(data) != cs:
                self.counters["checksum_mismatch"] += 1
                return False
            if into is None:
                views = [d.toreadonly() for d in data]
                out[i] = views[0] if len(views) == 1 else views
                return True
            targets = into[i]
            if len(targets) != len(data) or any(
                t.nbytes != d.nbytes for t, d in zip(targets, data)
            ):
                self.counters["size_mismatch"] += 1
                return False
            for target, frame in zip(targets, data):
                target[:] = frame
            out[i] = True
            return True

        yield from self._lookup(Op.GET, keys, on_hit)
        return out if into is None else [bool(x) for x in out]

    def exists(self, keys: Sequence[bytes]) -> OpGen:
        found = [False] * len(keys)

        def on_hit(i: int, _cs: int | None, _frames: list[Any]) -> bool:
            found[i] = True
            return True

        yield from self._lookup(Op.EXISTS, keys, on_hit)
        return ExistsResult(found)

    def delete(self, keys: Sequence[bytes]) -> OpGen:
        targets: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            for node in self.ranking(key)[: self.replicas + 1]:
                targets.setdefault(node, []).append(i)
        batch = self._calls(Op.DELETE, targets, keys)
        results = yield batch
        self.record(batch, results)
        out = [False] * len(keys)
        for call in batch:
            result = results.get(call.request.id)
            if result is not None:
                for i, st in zip(call.idxs, result[0].status):
                    out[i] = out[i] or st == Status.OK
        return out

    def each_node(self, op: Op) -> OpGen:
        batch = [Call(n, Request(op, self.next_id()), [], []) for n in range(len(self.endpoints))]
        results = yield batch
        self.record(batch, results)
        return [
            None if results.get(c.request.id) is None else results[c.request.id][0].stats
            for c in batch
        ]


def _cut(idxs: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """Split ``idxs`` into runs of at most ``limit`` bytes (a bigger block goes alone)."""
    parts, part, total = [], [], 0
    for i, size in zip(idxs, sizes):
        if part and total + size > limit:
            parts.append(part)
            part, total = [], 0
        part.append(i)
        total += size
    if part:
        parts.append(part)
    return parts


def _merge_put(statuses: list[int]) -> Status:
    """A key's outcome over its replicas: stored somewhere wins, then the first error."""
    if not statuses:
        return Status.UNAVAILABLE
    for good in (Status.OK, Status.EXISTS):
        if good in statuses:
            return good
    return Status(statuses[0])
