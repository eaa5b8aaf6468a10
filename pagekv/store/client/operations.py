"""The batch operations (put, get, exists, delete) as I/O-free generators over a :class:`Router`.

Each yields batches of calls and returns its per-key result (see :mod:`.routing` for the
protocol between these generators and the clients). Every key is answered: a node's failure
moves the key on to its next node, and a key no node could answer is ``Status.UNAVAILABLE`` /
``None`` / ``False`` (counted in ``unanswered_keys``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from ..wire.copies import copy_checksum, parallel_map
from ..wire.protocol import Code, Op, Request, Status, checksum_frames
from .routing import Call, ExistsResult, OpGen, Router, reply_shape_problem

__all__ = ["delete", "exists", "get", "put"]

_OK, _DEFERRED = int(Status.OK), int(Status.DEFERRED)  # plain ints: statuses arrive as ints
PUT_KEY_EXTRA, PUT_FRAME_EXTRA = 24, 9  # header bytes per key (bin, count, sum) and per frame
MAX_DEFERRALS = 64  # a node that keeps deferring a key is treated as failing for it


def put(router: Router, keys: Sequence[bytes], values: Sequence[list[memoryview]]) -> OpGen:
    """``values[i]``: the frames of key i. Stores each on ``replicas`` nodes, replacing a node
    that fails by the key's next one; returns a status per key. The values' checksums are
    computed request by request, as each is sent (``Call.before_send``), each value once."""
    sizes, nframes = _describe(values)
    sums: list[int | None] = [None] * len(keys)
    cands = router.candidates(keys, router.replicas + 1, router.usable())
    statuses: list[list[int]] = [[] for _ in keys]
    want, nxt = [router.replicas] * len(keys), [0] * len(keys)
    while wave := _next_targets(router, cands, want, nxt):
        yield from router.learn({n: sum(sizes[i] for i in idxs) for n, idxs in wave.items()})
        batch: list[Call] = []
        for node, idxs in wave.items():
            limits = router.limits[node]
            if limits is None:  # did not answer: the keys go on to their next node
                for i in idxs:
                    want[i] += 1
                continue
            fits = [
                i
                for i in idxs
                if sizes[i] <= limits.max_message_size and nframes[i] <= limits.max_frames
            ]
            for i in set(idxs).difference(fits):
                statuses[i].append(Status.TOO_LARGE)
            for part in router.cut(
                keys,
                fits,
                limits,
                key_extra=PUT_KEY_EXTRA,
                frame_extra=PUT_FRAME_EXTRA,
                frames=nframes,
                nbytes=sizes,
                most_bytes=router.put_bytes[node],
            ):
                frames = [f for i in part for f in values[i]]
                req = Request(Op.PUT, router.next_id(), [keys[i] for i in part],
                              [f.nbytes for f in frames], [],
                              [nframes[i] for i in part])  # fmt: skip
                nbytes = sum(sizes[i] for i in part)
                batch.append(Call(node, req, frames, part, nbytes,
                                  before_send=_checksums(req, part, values, sums, sizes,
                                                         router.pool)))  # fmt: skip
        results = (yield batch) if batch else {}
        for call in batch:
            result = results.get(call.request.id)
            if router.reply_problem(call, result) is not None:
                for i in call.idxs:
                    want[i] += 1
                continue
            for i, st in zip(call.idxs, result[0].status):
                statuses[i].append(st)
    out = [_merge_put(sts) for sts in statuses]
    router.counters["unanswered_keys"] += out.count(Status.UNAVAILABLE)
    return out


def _describe(values: Sequence[list[memoryview]]) -> tuple[list[int], list[int]]:
    """Byte size and frame count of each value."""
    sizes = [v[0].nbytes if len(v) == 1 else sum(f.nbytes for f in v) for v in values]
    return sizes, [len(v) for v in values]


def _checksums(
    req: Request, part: list[int], values: Sequence[list[memoryview]], sums: list[int | None],
    sizes: list[int], pool: Executor | None,
) -> Callable[[], None]:  # fmt: skip
    """``req``'s ``before_send``: fill its ``sums`` from ``sums`` (shared by the operation's
    requests), computing those not known yet (a replica's or a retried key's are), on
    ``pool`` when the request is large (xxhash releases the GIL: several cores)."""

    def fill() -> None:
        todo = [i for i in part if sums[i] is None]
        nbytes = sum(sizes[i] for i in todo)
        for i, cs in zip(todo, parallel_map(checksum_frames, [values[i] for i in todo], nbytes,
                                            pool)):  # fmt: skip
            sums[i] = cs
        req.sums = [sums[i] for i in part]

    return fill


def _next_targets(
    router: Router, cands: list[list[int]], want: list[int], nxt: list[int]
) -> dict[int, list[int]]:
    """Node -> keys to write there next: each key's next candidates, as many as it still
    needs copies (``want``); ``nxt`` is how far each key's candidates have been used."""
    wave: dict[int, list[int]] = {}
    if len(router.endpoints) == 1 and not any(nxt):  # one node, first wave: every key
        if cands and cands[0] and want and want[0]:
            wave[0] = list(range(len(cands)))
            nxt[:], want[:] = [1] * len(cands), [w - 1 for w in want]
        return wave
    for i, nodes in enumerate(cands):
        while want[i] > 0 and nxt[i] < len(nodes):
            wave.setdefault(nodes[nxt[i]], []).append(i)
            nxt[i], want[i] = nxt[i] + 1, want[i] - 1
    return wave


def get(
    router: Router,
    keys: Sequence[bytes],
    into: Sequence[list[memoryview]] | None,
    on_arrival: Callable[[int], None] | None = None,
) -> OpGen:
    """``into[i]``: the byte views key i's frames are scattered into, or None for views.
    ``on_arrival(i)`` is called as soon as key i's value is verified and in place (before the
    batch ends); it must not raise. Each GET call carries a ``prepare`` that checks (and, for
    ZeroMQ, copies) its reply's values, which a transport may run off the client's thread
    before the reply is handled (see :class:`.routing.Call`)."""
    out: list[Any] = [None] * len(keys)
    expected = None
    if into is not None:
        expected = [t[0].nbytes if len(t) == 1 else sum(v.nbytes for v in t) for t in into]
    checked: dict[int, str] = {}  # key -> outcome of its copy done by a prepare (pool thread)

    def check(i: int, cs: int, frames: list[Any], digest: int | None = None) -> str:
        """Copy and verify key i's value: "" when in place, else the failed counter's name.
        ``digest``: the checksum of the frames as they landed, when a transport wrote them
        itself (into the destinations, or new buffers) and hashed them then. Touches only
        ``into[i]``: safe on any thread."""
        data = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
        if into is None:
            if (digest if digest is not None else checksum_frames(data)) != cs:
                return "checksum_mismatch"
            views = [d.toreadonly() for d in data]
            out[i] = views[0] if len(views) == 1 else views
            return ""
        targets = into[i]
        if len(frames) == len(targets) and all(f is t for f, t in zip(frames, targets)):
            # written in place (the transport hands back the destination views themselves)
            got = digest if digest is not None else checksum_frames(targets)
            return "" if got == cs else "checksum_mismatch"
        if len(targets) != len(data) or any(t.nbytes != d.nbytes for t, d in zip(targets, data)):
            return "size_mismatch"
        return "" if copy_checksum(targets, data) == cs else "checksum_mismatch"

    def on_hit(i: int, cs: int, frames: list[Any]) -> bool:
        problem = checked.pop(i) if i in checked else check(i, cs, frames)
        if problem:
            router.counters[problem] += 1
            return False
        if into is not None:
            out[i] = True
        if on_arrival is not None:
            on_arrival(i)
        return True

    def prepare(call: Call, reply: Any, frames: list[Any]) -> None:
        """The copies and checks of one well-formed reply (any thread)."""
        if reply.code is not Code.OK or reply_shape_problem(call, reply, frames) is not None:
            return  # handled (and refused) on the client's thread
        j = start = 0
        digests = call.digests if call.digests and len(call.digests) == len(reply.sums) else None
        for i, st in zip(call.idxs, reply.status):
            if st == Status.OK:
                count = reply.counts[j]
                digest = digests[j] if digests is not None else None
                checked[i] = check(i, reply.sums[j], frames[start : start + count], digest)
                j, start = j + 1, start + count

    yield from _lookup(router, Op.GET, keys, on_hit, expected, prepare=prepare, sinks=into)
    return out if into is None else [bool(x) for x in out]


def exists(router: Router, keys: Sequence[bytes], answer_s: float | None = None) -> OpGen:
    """Which keys some node holds. ``answer_s``: a node that has not answered a request
    within it fails that request (failed, backed off, its keys asked of their next node or
    unanswered), as after a missed deadline."""
    found = [False] * len(keys)

    def on_hit(i: int, _cs: int | None, _frames: list[Any]) -> bool:
        found[i] = True
        return True

    unanswered = yield from _lookup(router, Op.EXISTS, keys, on_hit, None, answer_s=answer_s)
    return ExistsResult(found, unanswered)


def delete(router: Router, keys: Sequence[bytes]) -> OpGen:
    """Delete each key from every node that may hold it; True where some node had it."""
    usable = router.usable()
    targets: dict[int, list[int]] = {}
    for i, nodes in enumerate(router.candidates(keys, router.replicas + 1, usable)):
        for node in nodes:
            targets.setdefault(node, []).append(i)
    yield from router.learn(dict.fromkeys(targets, 0))
    batch = [
        Call(node, Request(Op.DELETE, router.next_id(), [keys[i] for i in part]), [], part)
        for node, idxs in targets.items()
        if router.limits[node] is not None
        for part in router.cut(keys, idxs, router.limits[node])
    ]
    results = (yield batch) if batch else {}
    out = [False] * len(keys)
    for call in batch:
        result = results.get(call.request.id)
        if router.reply_problem(call, result) is None:
            for i, st in zip(call.idxs, result[0].status):
                out[i] = out[i] or st == Status.OK
    return out


def _lookup(
    router: Router,
    op: Op,
    keys: Sequence[bytes],
    on_hit: Callable[[int, Any, list[Any]], bool],
    expected: list[int] | None,
    *,
    prepare: Callable[[Call, Any, list[Any]], None] | None = None,
    sinks: Sequence[list[memoryview]] | None = None,
    answer_s: float | None = None,
) -> OpGen:
    """Ask each key's nodes in turn until ``on_hit`` accepts a node's answer for it; returns
    the number of keys no node answered for. ``prepare(call, reply, frames)`` becomes each
    call's ``prepare`` (see ``Call``); ``sinks`` (a GET's destinations, per key) give each
    call its ``sinks``; ``answer_s`` each call's ``answer_s``."""
    usable = router.usable()
    cands = router.candidates(keys, router.replicas + 1, usable)
    pos, deferred = [0] * len(keys), [0] * len(keys)
    answered = [False] * len(keys)
    pending = {i for i, nodes in enumerate(cands) if nodes}

    def advance(i: int) -> None:
        pos[i] += 1
        if pos[i] >= len(cands[i]):
            pending.discard(i)

    def handle(call: Call, result: Any) -> None:
        call.handled = True
        if router.reply_problem(call, result) is not None:
            for i in call.idxs:
                advance(i)
            return
        reply, frames = result
        j = start = 0
        get = op is Op.GET
        for i, st in zip(call.idxs, reply.status):
            answered[i] = True
            if st == _OK:
                if get:
                    count = reply.counts[j]
                    hit = on_hit(i, reply.sums[j], frames[start : start + count])
                    j, start = j + 1, start + count
                else:
                    hit = on_hit(i, None, ())
                if hit:
                    pending.discard(i)
                    continue
            elif st == _DEFERRED and deferred[i] < MAX_DEFERRALS:
                deferred[i] += 1  # found but left out of the reply: ask the same node again
                continue
            pos[i] += 1  # this node said no (or failed): the key's next node, if any
            if pos[i] >= len(cands[i]):
                pending.discard(i)

    most = router.get_keys_per_request if op is Op.GET and expected is None else None
    while pending:
        wave: dict[int, list[int]] = {}
        for i in sorted(pending):
            node = cands[i][pos[i]]
            if node in wave:
                wave[node].append(i)
            else:
                wave[node] = [i]
        need = {n: sum(expected[i] for i in idxs) if expected else 0 for n, idxs in wave.items()}
        yield from router.learn(need, answer_s)
        batch: list[Call] = []
        for node, idxs in wave.items():
            limits = router.limits[node]
            if limits is None:
                for i in idxs:
                    advance(i)
                continue
            most_bytes = router.get_bytes[node] if op is Op.GET else None
            for part in router.cut(keys, idxs, limits, nbytes=expected, most_keys=most,
                                   most_bytes=most_bytes):  # fmt: skip
                req = Request(op, router.next_id(), [keys[i] for i in part])
                nbytes = sum(expected[i] for i in part) if expected is not None else 0
                call = Call(node, req, [], part, nbytes, answer_s=answer_s)
                call.on_reply = lambda reply, frames, call=call: handle(call, (reply, frames))
                if prepare is not None:
                    call.prepare = lambda reply, frames, call=call: prepare(call, reply, frames)
                if sinks is not None:
                    call.sinks = [sinks[i] for i in part]
                batch.append(call)
        if not batch:
            continue
        results = yield batch
        for call in batch:
            if not call.handled:
                handle(call, results.get(call.request.id))
    unanswered = answered.count(False)
    router.counters["unanswered_keys"] += unanswered
    return unanswered


_STATUS = {int(s): s for s in Status}


def _merge_put(statuses: list[int]) -> Status:
    """A key's outcome over its replicas: stored somewhere wins, then the first error."""
    if len(statuses) == 1:
        return _STATUS[statuses[0]]
    if not statuses:
        return Status.UNAVAILABLE
    for good in (Status.OK, Status.EXISTS):
        if good in statuses:
            return good
    return Status(statuses[0])
