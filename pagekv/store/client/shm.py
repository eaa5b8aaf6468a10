"""Client side of the same-host shortcut: read values straight out of a ``--shm`` node's segment.

For ``get_many(..., into=...)``, keys whose first node advertises a segment (PING ``shm``) on
this host (same host id), in a file this process can open (same user: the file is mode 0600),
are LOCATEd and copied from a read-only mapping of the segment into their destinations, then
checked: the generations of the value's granules must still be the LOCATE's (nothing reused
its space during the copy) and the checksum of the copied bytes must match (see :mod:`.shm`
for why a torn copy cannot pass). Any key that fails, for any reason, is left to the normal TCP
GET: the shortcut never yields wrong data, only fewer hits.

Counters (in the client's ``counters``): ``shm_hits``, and the keys that fell back, by reason:
``shm_fallback_not_same_host``, ``shm_fallback_no_access`` (permission denied),
``shm_fallback_gone`` (the file is gone or is another file), ``shm_fallback_mismatch``
(generation or checksum changed: evicted and reused during the copy), ``shm_fallback_size``
(frames do not match the destination), ``shm_fallback_bad_reply`` (LOCATE failed or its reply
did not make sense), ``shm_fallback_not_offered`` (node has no segment).

Mappings are cached per segment file and dropped when a node advertises another one (a node
restarted). A segment the node has unlinked stays mapped and readable, but is only read after a
fresh LOCATE from a live node, so a dead node's keys are misses. Copies of large values run on
several threads: a chunk's values in one call of the native checked copy (:mod:`.native`) on
its own threads, or on a small thread pool (numpy copies release the GIL) without it. The
values of every LOCATE reply (one per node, or more) are copied together in key order, in
chunks, and the chunks are pipelined: ``PIPELINE`` chunks are copied at once (the next ones on
the reader's driver threads, each call on its share of the threads), so that no core idles while
one call's last values finish, and while the client's thread announces a chunk's values
(``on_arrival``) the next ones are being copied; the reply is not done until every copy it
started is (they write into the caller's buffers).
"""

from __future__ import annotations

import collections
import concurrent.futures
import mmap
import os
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

try:
    import numpy as np
except ImportError:  # the store alone (pip install pagekv, no numpy): no shortcut
    np = None

from pagekv import env

from ..config import default_shm_threads
from ..node.segment import host_id
from ..wire import native
from ..wire.protocol import Code, Op, Request, Status
from .routing import FALLBACK_LIMITS, Call, OpGen, Router
from .shm_copy import copy_batch, copy_one, in_chunks

__all__ = ["COUNTERS", "ShmReader", "disable", "get", "reader_for"]

COUNTERS = ("shm_hits", "shm_fallback_not_same_host", "shm_fallback_no_access",
            "shm_fallback_gone", "shm_fallback_mismatch", "shm_fallback_size",
            "shm_fallback_bad_reply", "shm_fallback_not_offered")  # fmt: skip
RECHECK_S = 30.0  # how long "this node failed a LOCATE" is believed
PARALLEL_BYTES = 4 << 20  # batches smaller than this are copied on the calling thread
CHUNK_BYTES = 64 << 20  # values are published (on_arrival) after each chunk of copies
# Chunks copied at once (at least 2: the next chunk is copied while this one is announced).
# Each native call ends with its threads waiting for its last values: with one call at a time,
# smaller chunks were slower (H100 host, bench_connector --shm, 4 GiB: 32 MiB chunks 15-16
# GB/s, 64 MiB 18-20) and larger ones announce later. Two at once, same call: prefetch
# 0.199-0.221 s against 0.248-0.261 s one at a time; three were no better than two.
PIPELINE = 2
BATCH = True  # a chunk's copies in one native call (bench_shm --batch compares)
_ADVERT = {"path": str, "size": int, "inode": int, "host": str, "data_offset": int,
           "granule": int, "granules": int}  # fmt: skip


@dataclass
class Mapped:
    """A read-only mapping of one segment file (kept while any node advertises it)."""

    advert: dict[str, Any]
    bytes: np.ndarray  # uint8 over the whole file
    gens: np.ndarray  # uint64 per granule of the data area


@dataclass
class _Node:
    advert: dict[str, Any] | None = None  # the last one looked at
    mapped: Mapped | None = None
    reason: str = "not_offered"  # why there is no mapping (a fallback counter's suffix)
    until: float = 0.0  # believe this state until then (monotonic)


class ShmReader:
    """Per client (not thread-safe, like the router it belongs to)."""

    def __init__(self, counters: dict[str, int], workers: int | None = None) -> None:
        self.counters = counters
        for name in COUNTERS:
            counters.setdefault(name, 0)
        self.host = host_id()
        self.nodes: dict[int, _Node] = {}
        self.workers = workers or default_shm_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._driver: ThreadPoolExecutor | None = None  # copy_ahead's threads

    # ---- segments --------------------------------------------------------------------------
    def learn(self, node: int, advert: dict[str, Any]) -> Mapped | None:
        """Take a node's advertised segment (PING or LOCATE ``shm``); map it unless it is the
        one already mapped. None (and the reason kept) when it cannot be used: an advert found
        unusable is looked at again only after ``RECHECK_S`` (not reopened on every call)."""
        state = self.nodes.setdefault(node, _Node())
        if state.mapped is not None and state.mapped.advert == advert:
            return state.mapped
        if state.advert == advert and time.monotonic() < state.until:
            return None
        state.advert, state.mapped, state.until = advert, None, time.monotonic() + RECHECK_S
        if not advert or any(type(advert.get(k)) is not t for k, t in _ADVERT.items()):
            state.reason = "not_offered"
        elif advert["host"] != self.host:
            state.reason = "not_same_host"
        else:
            state.mapped, state.reason = _map(advert)
        return state.mapped

    def forget(self, node: int, reason: str) -> None:
        """The node refused or failed a LOCATE: no shortcut for it for a while."""
        state = self.nodes.setdefault(node, _Node())
        state.mapped, state.reason, state.until = None, reason, time.monotonic() + RECHECK_S

    def reason(self, node: int) -> str:
        state = self.nodes.get(node)
        return state.reason if state is not None else "not_offered"

    # ---- copies ----------------------------------------------------------------------------
    def copy_ahead(
        self, jobs: list[tuple], into: Sequence[list[memoryview]]
    ) -> concurrent.futures.Future:
        """:meth:`copy_all` on one of the reader's ``PIPELINE`` driver threads, so that the
        caller can copy or publish other chunks meanwhile. The caller owns the future and must
        wait for it before it returns (the copy writes into ``into``)."""
        if self._driver is None:
            self._driver = ThreadPoolExecutor(PIPELINE, thread_name_prefix="pagekv-shm-driver")
            weakref.finalize(self, self._driver.shutdown, wait=False)
        return self._driver.submit(self.copy_all, jobs, into)

    def copy_all(self, jobs: list[tuple], into: Sequence[list[memoryview]]) -> list[str]:
        """Copy each job ``(i, mapped, offset, sizes, checksum, gen)`` into ``into[i]``;
        returns per job "" (copied and verified) or the fallback reason. Several jobs worth
        spreading go to the native checked copy in one call on ``workers // PIPELINE``
        threads when it is available (one GIL hand-off for the lot; ``PIPELINE`` such calls
        run at once), else to the pool, one job per task."""
        total = sum(sum(job[3]) for job in jobs)
        if len(jobs) < 2 or total < PARALLEL_BYTES or self.workers < 2:
            return [copy_one(job, into[job[0]]) for job in jobs]
        lib = native.load() if BATCH else None
        if lib is not None:
            return copy_batch(lib, jobs, into, max(1, self.workers // PIPELINE))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pagekv-shm")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return list(self._pool.map(lambda job: copy_one(job, into[job[0]]), jobs))


def _map(advert: dict[str, Any]) -> tuple[Mapped | None, str]:
    try:
        fd = os.open(advert["path"], os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        return None, "no_access"
    except OSError:
        return None, "gone"
    try:
        st = os.fstat(fd)
        size, granules = advert["size"], advert["granules"]
        if (st.st_ino != advert["inode"] or st.st_size != size or advert["granule"] <= 0
                or advert["data_offset"] < 8 * granules
                or advert["data_offset"] + granules * advert["granule"] > size):  # fmt: skip
            return None, "gone"  # another file by that name, or a nonsensical advert
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):
        return None, "gone"
    finally:
        os.close(fd)
    data = np.frombuffer(mm, dtype=np.uint8)
    return Mapped(dict(advert), data, np.frombuffer(mm, dtype=np.uint64, count=granules)), ""


def reader_for(router: Router) -> ShmReader | None:
    """The router's reader, made on first use; None where the shortcut is off
    (``PAGEKV_SHM_CLIENT=0``, :func:`disable`, or no numpy: the store installed without it)."""
    reader = router.__dict__.get("shm_reader", False)
    if reader is False:
        on = env.SHM_CLIENT.get() and np is not None
        reader = router.__dict__["shm_reader"] = ShmReader(router.counters) if on else None
    return reader


def disable(router: Router) -> None:
    """Turn the shortcut off for this client (its gets go over TCP only)."""
    router.__dict__["shm_reader"] = None


def get(
    router: Router,
    keys: Sequence[bytes],
    into: Sequence[list[memoryview]],
    out: list[Any],
    on_arrival: Callable[[int], None] | None = None,
) -> OpGen:
    """Copy what the shortcut can into ``into``; returns the set of keys done (``out[i]`` set
    True and ``on_arrival(i)`` called for each, chunk by chunk in key order, once every LOCATE
    reply is in). The rest is the caller's (TCP GET). Only nodes whose PING advertised a
    segment are asked: the shortcut adds no round trip for other nodes (the PING is the one the
    GET sends anyway)."""
    reader = reader_for(router)
    if reader is None or not keys:
        return set()
    by_node: dict[int, list[int]] = {}
    for i, nodes in enumerate(router.candidates(keys, 1, router.usable())):
        if nodes:
            by_node.setdefault(nodes[0], []).append(i)
    # the PING the TCP path would send first anyway (nodes not asked yet): it brings "shm"
    need = {n: sum(t.nbytes for i in idxs for t in into[i]) for n, idxs in by_node.items()}
    yield from router.learn(need)
    by_node = {n: idxs for n, idxs in by_node.items() if router.shm_adverts[n]}
    batch: list[Call] = []
    jobs: list[tuple] = []  # every LOCATE reply's copy jobs, gathered as the replies come
    for node, idxs in by_node.items():
        if reader.learn(node, router.shm_adverts[node]) is None:
            reader.counters["shm_fallback_" + reader.reason(node)] += len(idxs)
            continue
        for part in router.cut(keys, idxs, router.limits[node] or FALLBACK_LIMITS):
            call = Call(node, Request(Op.LOCATE, router.next_id(), [keys[i] for i in part]),
                        [], part)  # fmt: skip
            call.on_reply = lambda reply, frames, call=call: jobs.extend(
                _take_reply(router, reader, call, (reply, frames))
            )
            batch.append(call)
    done: set[int] = set()
    if not batch:
        return done
    results = yield batch
    for call in batch:
        if not call.handled:
            jobs.extend(_take_reply(router, reader, call, results.get(call.request.id)))
    # In key order across the nodes: the leading values come first from three nodes as from
    # one (copied reply by reply, the leading run of keys waited for the last node's copies)
    jobs.sort(key=lambda job: job[0])
    _copy(reader, jobs, into, out, on_arrival, done)
    return done


def _take_reply(router: Router, reader: ShmReader, call: Call, result: Any) -> list[tuple]:
    """One LOCATE reply (or None: no answer), once: its copy jobs."""
    call.handled = True
    return _located(router, reader, call, result)


def _copy(
    reader: ShmReader, jobs: list[tuple], into: Sequence[list[memoryview]], out: list[Any],
    on_arrival: Callable[[int], None] | None, done: set[int],
) -> None:  # fmt: skip
    """Copy, verify and publish ``jobs`` in order, in chunks of ``CHUNK_BYTES`` so that the
    first are published before the last are copied."""
    chunks = in_chunks(jobs, CHUNK_BYTES)
    ahead: collections.deque = collections.deque()  # copies of chunks[k : started], k > 0
    started = 1  # chunk 0 is copied on this thread
    try:
        for k, chunk in enumerate(chunks):
            while started < len(chunks) and started < k + PIPELINE:  # the next ones start
                ahead.append(reader.copy_ahead(chunks[started], into))
                started += 1
            whys = reader.copy_all(chunk, into) if k == 0 else ahead.popleft().result()
            _publish(reader, chunk, whys, out, on_arrival, done)
    finally:  # never return while a copy still writes into the caller's buffers
        if ahead:
            concurrent.futures.wait(ahead)


def _publish(
    reader: ShmReader, chunk: list[tuple], whys: list[str], out: list[Any],
    on_arrival: Callable[[int], None] | None, done: set[int],
) -> None:  # fmt: skip
    """Count each copied job's outcome; mark the verified ones done and announce them."""
    for job, why in zip(chunk, whys):
        if why:
            reader.counters["shm_fallback_" + why] += 1
            continue
        i = job[0]
        out[i] = True
        done.add(i)
        reader.counters["shm_hits"] += 1
        if on_arrival is not None:
            on_arrival(i)


def _located(router: Router, reader: ShmReader, call: Call, result: Any) -> list[tuple]:
    """Copy jobs for the found keys of one LOCATE reply (nothing when it is unusable)."""
    n = len(call.idxs)
    if result is None:
        router.failed(call.node)  # its keys go on to TCP, which skips a failed node
        reader.counters["shm_fallback_bad_reply"] += n
        return []
    reply = result[0]
    if reply.code is not Code.OK:
        reader.forget(call.node, "not_offered" if reply.code is Code.BAD_OP else "bad_reply")
        reader.counters["shm_fallback_bad_reply"] += n
        return []
    found = reply.status.count(Status.OK)
    if (len(reply.status) != n or len(reply.offs) != found or len(reply.gens) != found
            or len(reply.sums) != found or len(reply.counts) != found
            or sum(reply.counts) != len(reply.sizes) or result[1]):  # fmt: skip
        reader.counters["shm_fallback_bad_reply"] += n
        return []
    router.succeeded(call.node)
    mapped = reader.learn(call.node, reply.shm)  # the same one, or the node's new segment
    if mapped is None:
        reader.counters["shm_fallback_" + reader.reason(call.node)] += found
        return []
    jobs, j, start = [], 0, 0
    for i, st in zip(call.idxs, reply.status):
        if st != Status.OK:
            continue  # not on this node: TCP asks it and the key's other nodes
        count = reply.counts[j]
        sizes = reply.sizes[start : start + count]
        jobs.append((i, mapped, reply.offs[j], sizes, reply.sums[j], reply.gens[j]))
        j, start = j + 1, start + count
    return jobs
