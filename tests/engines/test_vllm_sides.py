"""The vLLM connector's scheduler and worker halves against a real store node, without vLLM:
requests are stand-ins with vLLM's fields (request_id, num_tokens, num_prompt_tokens,
num_computed_tokens, chained block_hashes), scheduler steps are driven the way vLLM's scheduler
drives them (lookup, allocation, ``build_connector_meta``, then ``num_computed_tokens``
advanced), caches are vLLM-shaped CPU views (tests/engines/vllm_layouts.py) of random data.

Tests that fail on f1eb0b9 say so (the reason in their docstring)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import pickle
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pagekv.connector import KVIndex
from pagekv.connector.vllm import epoch as epoch_module
from pagekv.connector.vllm.blocks import block_geometry
from pagekv.connector.vllm.config import VllmConnectorConfig, directions
from pagekv.connector.vllm.epoch import EpochRecord
from pagekv.connector.vllm.metadata import BlockTransfer, PagekvMetadata
from pagekv.connector.vllm.namespace import EngineLayout
from pagekv.connector.vllm.scheduler import RecentBlocks, SchedulerSide
from pagekv.errors import ConfigError, CopyFailed
from pagekv.store import NodeConfig, Status, StoreClient, StoreNode
from tests.helpers import wait_until

from .vllm_layouts import vllm_layer_views, worker_over

BLOCK, LAYERS, HEADS, CELL, NUM_BLOCKS = 16, 2, 2, 8, 32
GEO = block_geometry(LAYERS, HEADS * BLOCK * CELL * 4, torch.float32)


def layout(tp_size: int = 1, rank_shared: bool = False, hash_ratio: int = 1) -> EngineLayout:
    return EngineLayout("test-model", "vllm-v1|test", (GEO,), BLOCK, hash_ratio, tp_size,
                        rank_shared)  # fmt: skip


class Hashes(list):
    """vLLM's ``request.block_hashes`` that counts the elements read (a whole-list copy reads
    them all): the scheduler's per-step cost must not grow with the context."""

    reads = 0

    def __iter__(self):
        Hashes.reads += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        Hashes.reads += len(range(*i.indices(len(self)))) if isinstance(i, slice) else 1
        return super().__getitem__(i)


class Req:
    """The fields of vLLM's ``Request`` the scheduler half reads: one sha256 hash per
    ``BLOCK / hashes_per_block`` tokens, chained, recomputed as tokens are appended."""

    def __init__(self, req_id: str, tokens: list[int], hashes_per_block: int = 1) -> None:
        self.request_id, self.tokens = req_id, list(tokens)
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.step = BLOCK // hashes_per_block
        self.block_hashes = Hashes()
        self._rehash()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def _rehash(self) -> None:
        prev = self.block_hashes[-1] if self.block_hashes else b"root"
        for i in range(len(self.block_hashes) * self.step, len(self.tokens) - self.step + 1,
                       self.step):  # fmt: skip
            prev = hashlib.sha256(prev + bytes(str(self.tokens[i : i + self.step]), "ascii"))
            prev = prev.digest()
            list.append(self.block_hashes, prev)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self._rehash()


def step(scheduled: dict[str, int] | None = None, preempted=()) -> SimpleNamespace:
    """The parts of vLLM's SchedulerOutput the scheduler half reads."""
    return SimpleNamespace(num_scheduled_tokens=scheduled or {},
                           preempted_req_ids=set(preempted))  # fmt: skip


class Engine:
    """Drives a SchedulerSide as vLLM 0.32's scheduler does; ``blocks[req_id]``: the request's
    block ids from block 0."""

    def __init__(self, sched: SchedulerSide) -> None:
        self.sched, self.blocks = sched, {}
        self.next_block = 100
        self.unreported: list[int] = []  # steps run whose workers' report is not back
        sched.block_ids_of = lambda rid, a, b: self.blocks[rid][a:b]

    def admit(self, req: Req, local_tokens: int = 0) -> int:
        """Lookup, allocation of every block the request needs, and the external tokens."""
        hit, _ = self.sched.num_new_matched_tokens(req, local_tokens)
        n = -(-(req.num_tokens + 64) // BLOCK)
        self.blocks[req.request_id] = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.sched.update_state_after_alloc(req, lambda: self.blocks[req.request_id], hit)
        req.num_computed_tokens = local_tokens + hit
        return hit

    def run(self, scheduled: dict[Req, int], preempted=(), report_first=True) -> PagekvMetadata:
        """One step; the reports of the steps run before (no failure, unless :meth:`report`
        gave one) come back first, as with vLLM's synchronous scheduling (``report_first``
        False: not yet, as with its asynchronous scheduling)."""
        while report_first and self.unreported:
            self.report()
        meta = self.sched.build_meta(step({r.request_id: n for r, n in scheduled.items()},
                                          preempted))  # fmt: skip
        self.unreported.append(meta.step)
        for req, n in scheduled.items():  # vLLM advances after building the metadata
            req.num_computed_tokens += n
        return meta

    def report(self, invalid=(), failed=()) -> None:
        """The workers' report of the oldest step run and not reported (what vLLM's
        update_connector_output passes on, after truncating what it recomputes)."""
        if self.unreported:
            self.sched.on_output(set(invalid), set(failed), self.unreported.pop(0))

    def prefill(self, req: Req) -> PagekvMetadata:
        return self.run({req: req.num_tokens - req.num_computed_tokens})


def scheduler(endpoint: str, lay: EngineLayout | None = None, **kw) -> SchedulerSide:
    lay = lay or layout()
    kw.setdefault("save", True)
    kw.setdefault("load_async", False)
    return SchedulerSide(lay, KVIndex(lay.all_namespaces(), endpoint, lookup_timeout_s=1.0),
                         **kw)  # fmt: skip


def engine_worker(node, seed: int, poison: bool = False):
    """A worker half over vLLM-shaped LBHNC views; the raw buffer is returned for checks."""
    raw, views = vllm_layer_views("LBHNC", LAYERS, NUM_BLOCKS, HEADS, BLOCK, CELL,
                                  torch.float32, seed=seed)  # fmt: skip
    if poison:
        raw.fill_(-7.0)
    return worker_over(views, NUM_BLOCKS, GEO, node.address, load_timeout_s=1.0), raw, views


def block_bytes(views, block: int) -> list[torch.Tensor]:
    return [v[block].clone() for v in views]


@pytest.fixture
def endpoint(node):
    return node.address


def store_pages(endpoint: str, namespace, hashes: list[bytes]) -> None:
    with StoreClient([endpoint]) as client:
        keys = namespace.derive_keys(hashes)
        statuses = client.put_many(keys, [b"x" * 64] * len(keys))
        assert all(s in (Status.OK, Status.EXISTS) for s in statuses)


def stored(endpoint: str, namespace, hashes: list[bytes]) -> list[bool]:
    with StoreClient([endpoint]) as client:
        return client.exists_many(namespace.derive_keys(hashes)).found


def saved_blocks(meta: PagekvMetadata) -> list[int]:
    return [b for s in meta.saves for b in s.block_ids]


# ---- configuration and roles ---------------------------------------------------------------
def test_defaults_never_slow_a_serving_engine():
    """Fails on f1eb0b9: loads were synchronous and layer-wise by default (every decode step
    of a GPU engine in PIECEWISE CUDA graphs)."""
    cfg = VllmConnectorConfig.from_extra({"store": ["tcp://127.0.0.1:1"]})
    assert cfg.load_async and not cfg.layerwise and not cfg.save_decode
    ok = VllmConnectorConfig.from_extra({"store": "tcp://h:1", "load_async": False,
                                         "layerwise": True})  # fmt: skip
    assert ok.layerwise
    with pytest.raises(ConfigError, match="load_async"):
        VllmConnectorConfig.from_extra({"store": "tcp://h:1", "layerwise": True})
    for bad in ({"resave_interval_s": -1}, {"weights_id": ""}, {"save_decode": 1}):
        with pytest.raises(ConfigError):
            VllmConnectorConfig.from_extra({"store": "tcp://h:1", **bad})


def test_roles_pick_the_directions():
    cfg = VllmConnectorConfig.from_extra({"store": "tcp://h:1"})
    assert directions("kv_producer", cfg) == (True, False)
    assert directions("kv_consumer", cfg) == (False, True)
    assert directions("kv_both", cfg) == (True, True)
    off = VllmConnectorConfig.from_extra({"store": "tcp://h:1", "save": False})
    assert directions("kv_both", off) == (False, True)
    with pytest.raises(ConfigError, match="kv_role"):
        directions(None, cfg)


def test_a_producer_never_loads_and_a_consumer_never_saves(endpoint):
    """Fails on f1eb0b9: ``kv_role`` was ignored (a consumer saved, a producer loaded)."""
    lay = layout()
    req = Req("r", list(range(5 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes[:3])
    producer = Engine(scheduler(endpoint, lay, load=False))
    assert producer.admit(req) == 0  # stored, but a producer computes
    assert saved_blocks(producer.prefill(req)) == [100, 101, 102, 103, 104]  # all computed
    consumer = Engine(scheduler(endpoint, lay, save=False))
    req2 = Req("r2", list(range(5 * BLOCK)))
    assert consumer.admit(req2) == 3 * BLOCK
    assert consumer.prefill(req2).saves == []


# ---- lookups ---------------------------------------------------------------------------------
def test_lookup_caps_a_full_prompt_hit_and_starts_at_the_local_hit(endpoint):
    lay = layout()
    sched = scheduler(endpoint, lay)
    req = Req("r", list(range(4 * BLOCK)))  # exactly 4 blocks, all stored
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes)
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)  # one token left
    assert sched.num_new_matched_tokens(req, 2 * BLOCK) == (BLOCK, False)
    longer = Req("r2", list(range(4 * BLOCK + 1)))
    assert sched.num_new_matched_tokens(longer, 0) == (4 * BLOCK, False)
    other = Req("r3", [7] * (4 * BLOCK + 1))
    assert sched.num_new_matched_tokens(other, 0) == (0, False)


def test_hit_is_the_minimum_over_tensor_parallel_ranks(endpoint):
    lay = layout(tp_size=2)
    sched = scheduler(endpoint, lay, load_async=True)
    req = Req("r", list(range(5 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes)  # rank 0: 5 blocks
    assert sched.num_new_matched_tokens(req, 0) == (0, False)  # rank 1 has none
    store_pages(endpoint, lay.namespace(1, 0), req.block_hashes[:2])
    assert sched.num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
    mla = layout(tp_size=2, rank_shared=True)
    assert len(mla.all_namespaces()) == 1 and not mla.namespace(1, 0).is_writer


def test_lookup_of_a_dead_node_is_a_bounded_miss(node):
    endpoint = node.address
    node.stop()
    lay = layout()
    sched = SchedulerSide(lay, KVIndex(lay.all_namespaces(), endpoint, lookup_timeout_s=0.1),
                          save=True, load_async=False)  # fmt: skip
    start = time.monotonic()
    assert sched.num_new_matched_tokens(Req("r", list(range(5 * BLOCK))), 0) == (0, False)
    assert time.monotonic() - start < 2.0


# ---- loads, saves and their failures ---------------------------------------------------------
def test_loads_saves_and_failures_are_planned_per_block(endpoint):
    lay = layout(hash_ratio=2)
    eng = Engine(scheduler(endpoint, lay))
    req = Req("r", list(range(6 * BLOCK + 3)), hashes_per_block=2)
    pages = lay.page_hashes(req.block_hashes)
    assert pages == req.block_hashes[1::2] and len(pages) == 6
    store_pages(endpoint, lay.namespace(0, 0), pages[:3])
    assert eng.admit(req, local_tokens=BLOCK) == 2 * BLOCK  # block 0 local, 1-2 stored
    meta = pickle.loads(pickle.dumps(eng.run({req: 2 * BLOCK + 1})))  # crosses processes
    assert meta.loads == [BlockTransfer("r", (101, 102), tuple(pages[1:3]))]
    assert meta.saves == []  # computed here over the load: held until the load is confirmed
    after = eng.run({req: BLOCK})  # the step's report is back: the held save goes out
    assert after.saves[0] == BlockTransfer("r", (103, 104), tuple(pages[3:5]))
    assert saved_blocks(after) == [103, 104, 105]
    assert eng.run({req: 1}).saves == []  # each block once
    eng.report({102})  # a worker could not load block 102
    assert eng.sched.num_new_matched_tokens(req, 0) == (0, False)  # recomputed, not retried
    assert eng.sched.counters["failed_loads"] == 1


def test_a_failed_load_never_marks_its_blocks_stored(endpoint):
    """The blocks vLLM recomputes after a failed load are saved. Fails on f1eb0b9: the
    scheduler counted every block of the load as stored and never saved them."""
    lay = layout()
    eng = Engine(scheduler(endpoint, lay))
    req = Req("r", list(range(6 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes[:4])
    assert eng.admit(req) == 4 * BLOCK
    meta = eng.run({req: 2 * BLOCK})
    assert meta.loads[0].block_ids == (100, 101, 102, 103) and saved_blocks(meta) == []
    req.num_computed_tokens = 2 * BLOCK  # blocks 2-3 did not load: vLLM truncates, then
    eng.report({102})  # hands the connector the report
    assert saved_blocks(eng.run({req: 4 * BLOCK})) == [102, 103, 104, 105]


def test_only_saves_over_an_unconfirmed_load_wait_and_a_failed_shared_block_is_never_saved(
    endpoint,
):
    """vLLM's asynchronous scheduling: B loads blocks 0-2 in step s; in step s+1, before s's
    report, A (sharing B's first 3 blocks from vLLM's prefix cache) and C (unrelated) compute
    blocks. C's save goes out at once; A's and B's wait. Block 1 of the load failed: vLLM
    recomputes B but not A (it leaves a shared failed block to the request that loads it), so
    A never saves again; B saves its blocks once recomputed. Before: every save waited, and A's
    blocks computed over the failed block were stored at its next step."""
    lay = layout()
    eng = Engine(scheduler(endpoint, lay))
    b = Req("b", list(range(5 * BLOCK + 3)))
    a = Req("a", b.tokens[: 3 * BLOCK] + list(range(1000, 1000 + 2 * BLOCK + 3)))
    c = Req("c", list(range(2000, 2000 + 2 * BLOCK + 3)))
    store_pages(endpoint, lay.namespace(0, 0), b.block_hashes[:3])
    assert eng.admit(b) == 3 * BLOCK
    assert eng.run({b: 2 * BLOCK + 3}).saves == []  # step s: loads 0-2, computes 3-4 (held)
    assert eng.admit(a, local_tokens=3 * BLOCK) == 0 and eng.admit(c) == 0
    eng.blocks["a"][:3] = eng.blocks["b"][:3]  # vLLM's prefix cache: the same blocks
    meta = eng.run({a: 2 * BLOCK + 3, c: 2 * BLOCK + 3}, report_first=False)  # step s+1
    assert [s.req_id for s in meta.saves] == ["c"]  # not over the load: at once
    b.num_computed_tokens = BLOCK  # vLLM truncates B to its first failed block (not A)
    eng.report({eng.blocks["b"][1]})  # step s: block 1 did not load
    eng.report()  # step s+1
    assert eng.sched.counters["dropped_held_blocks"] == 4
    later = [eng.run({a: 1, b: 4 * BLOCK + 3}), eng.run({a: 1, b: 1})]
    assert [s.req_id for m in later for s in m.saves] == ["b"]
    assert saved_blocks(later[0]) == eng.blocks["b"][1:5]


def forward(views, block_ids, first: int, stop: int) -> None:
    """A stand-in for the model's forward: each block's KV derives from the block before it,
    as attention makes it depend on every earlier token."""
    for layer in range(LAYERS):
        for j in range(first, stop):
            views[layer][block_ids[j]].copy_(views[layer][block_ids[j - 1]] * 0.5 + 1.0)


def test_blocks_computed_over_a_failed_load_are_never_stored(node):
    """A synchronous load fails in a step (a page evicted between the lookup and the load);
    vLLM still runs that step's forward, computing the request's next blocks over the failed
    ones, then recomputes from the first failed block. What the store serves afterwards must be
    the truth. Failed before 2026-11-27: the step's saves stored the blocks computed over the
    failed load, and a later engine loaded them."""
    lay = layout()
    truth_worker, _, truth = engine_worker(node, seed=1)
    req = Req("r", list(range(6 * BLOCK)))
    hashes = tuple(req.block_hashes)
    forward(truth, list(range(6)), 1, 6)  # blocks 0-5 as a correct engine computes them
    truth_worker.save(PagekvMetadata(saves=[BlockTransfer("w", (0, 1, 2, 3), hashes[:4])]))
    truth_worker.conn.flush_sync(timeout=10)
    eng = Engine(scheduler(node.address, lay))
    eng.next_block = 10
    assert eng.admit(req) == 4 * BLOCK
    meta = eng.run({req: 2 * BLOCK})  # loads blocks 0-3, computes 4-5
    with StoreClient([node.address]) as client:  # block 2 evicted before the load
        client.delete_many(lay.namespace(0, 0).derive_keys([hashes[2]]))
    worker, _, views = engine_worker(node, seed=2, poison=True)
    ids = eng.blocks["r"]
    worker.start_load(meta)
    errors = worker.take_errors()
    assert errors == {ids[2], ids[3]}
    forward(views, ids, 4, 6)  # the step's forward, over the failed blocks
    worker.save(meta)
    worker.conn.flush_sync(timeout=10)
    req.num_computed_tokens = 2 * BLOCK  # vLLM truncates to block 2, then reports
    eng.report(errors)
    forward(views, ids, 2, 6)
    again = eng.run({req: 4 * BLOCK})
    assert saved_blocks(again) == ids[2:6]
    worker.save(again)
    worker.conn.flush_sync(timeout=10)
    reader, _, got = engine_worker(node, seed=3, poison=True)
    reader.start_load(PagekvMetadata(loads=[BlockTransfer("q", tuple(range(20, 26)), hashes)]))
    assert reader.take_errors() == set()
    for layer in range(LAYERS):
        for j in range(6):
            assert torch.equal(got[layer][20 + j], truth[layer][j]), f"block {j}"
    for w in (truth_worker, worker, reader):
        w.close()


def test_held_saves_of_a_request_that_ends_or_is_preempted_are_dropped(endpoint):
    """A save held for a load's report names vLLM's block ids: once the request ends or is
    preempted before the report, vLLM may give those blocks to another request, so the save is
    dropped (never sent), and its blocks are no longer taken for stored."""
    lay = layout()
    eng = Engine(scheduler(endpoint, lay))
    for ending in ("finished", "preempted"):
        req = Req(ending, list(range(6 * BLOCK)))
        store_pages(endpoint, lay.namespace(0, 0), req.block_hashes[:4])
        assert eng.admit(req) == 4 * BLOCK
        assert eng.run({req: 2 * BLOCK}).saves == []  # held
        if ending == "finished":
            eng.sched.finished(req.request_id)
            assert eng.run({}).saves == []
        else:
            assert eng.run({}, preempted=[req.request_id]).saves == []
        assert eng.sched.counters["dropped_held_blocks"] == 2 * (1 + (ending == "preempted"))
        assert not any(eng.sched.recent.fresh(h, time.monotonic()) for h in req.block_hashes[4:])


def test_held_saves_are_never_sent_under_a_new_epoch(endpoint):
    """Blocks computed before a reset (new weights) must not be stored under the epoch that
    follows it: a reset drops the saves it finds held."""
    lay = layout()
    eng = Engine(scheduler(endpoint, lay))
    req = Req("r", list(range(6 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes[:4])
    assert eng.admit(req) == 4 * BLOCK
    assert eng.run({req: 2 * BLOCK}).saves == []  # held
    assert eng.sched.reset()
    assert eng.run({req: 1}).saves == []


def test_a_load_that_cannot_be_planned_is_recomputed(node):
    """vLLM counts accepted external tokens as computed: if the scheduler cannot plan their load
    (here: fewer blocks than tokens), the workers must report the blocks, never skip them."""
    lay = layout()
    sched = scheduler(node.address, lay, save=False)
    req = Req("r", list(range(4 * BLOCK)))
    store_pages(node.address, lay.namespace(0, 0), req.block_hashes)
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(req, [7, 8], 3 * BLOCK)
    meta = sched.build_meta(step())
    assert [(s.block_ids, s.failed) for s in meta.loads] == [((7, 8), True)]
    worker, _, _ = engine_worker(node, seed=3)
    worker.start_load(meta)
    assert worker.take_errors() == {7, 8}
    worker.close()


def test_decode_blocks_are_saved_only_when_configured(endpoint):
    """Fails on f1eb0b9: every block was saved, those of generated tokens included."""
    for save_decode, expected in ((False, []), (True, [102, 103])):
        eng = Engine(scheduler(endpoint, save_decode=save_decode))
        req = Req(f"r{save_decode}", list(range(2 * BLOCK + 5)))
        eng.admit(req)
        assert saved_blocks(eng.prefill(req)) == [100, 101]
        decoded = []
        for t in range(2 * BLOCK):
            req.append(t)
            decoded += saved_blocks(eng.run({req: 1}))
        assert decoded == expected  # block 2: 5 prompt tokens and 11 generated; block 3


def test_blocks_held_locally_are_saved_again_when_the_store_lacks_them(endpoint):
    """A store node restarted empty: the next request whose prefix vLLM holds locally saves
    the blocks again; another request within ``resave_interval_s`` neither checks nor saves
    them. Fails on f1eb0b9: blocks of vLLM's local hit were never saved."""
    lay = layout()
    eng = Engine(scheduler(endpoint, lay, resave_interval_s=0))  # always check
    req = Req("r", list(range(4 * BLOCK + 3)))
    eng.admit(req, local_tokens=3 * BLOCK)  # the store restarted: it holds nothing
    assert saved_blocks(eng.prefill(req)) == [100, 101, 102, 103]
    assert eng.sched.counters["resave_blocks"] == 3
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes)
    again = Req("r2", list(range(4 * BLOCK + 3)))
    eng.admit(again, local_tokens=4 * BLOCK)
    assert eng.prefill(again).saves == []  # the store has them now

    eng = Engine(scheduler(endpoint, lay, resave_interval_s=3600))
    first, second = (Req(r, list(range(1000, 1000 + 3 * BLOCK + 1))) for r in ("a", "b"))
    eng.admit(first, local_tokens=3 * BLOCK)
    assert saved_blocks(eng.prefill(first)) == [100, 101, 102]
    lookups = eng.sched.counters["lookups"]
    eng.admit(second, local_tokens=3 * BLOCK)
    assert eng.sched.counters["lookups"] == lookups  # nothing to check: saved just now
    assert eng.prefill(second).saves == []


def test_recent_blocks_remember_for_the_interval_and_within_capacity():
    recent = RecentBlocks(10.0, capacity=3)
    recent.mark(b"a", 0.0)
    assert recent.fresh(b"a", 9.9) and not recent.fresh(b"a", 10.0)
    for i, key in enumerate((b"b", b"c", b"d")):
        recent.mark(key, 1.0 + i)
    assert len(recent) == 3 and not recent.fresh(b"a", 3.5)  # the oldest went first
    recent.mark(b"e", 20.0)  # every older entry has expired
    assert len(recent) == 1
    assert not RecentBlocks(0.0).fresh(b"x", 0.0)


def test_decoding_costs_the_scheduler_nothing_per_token_of_context(endpoint):
    """Per step, the scheduler half reads no block hash of a decoding request: its cost does
    not grow with the context. Fails on f1eb0b9: every step copied every running request's
    whole ``block_hashes`` list."""
    eng = Engine(scheduler(endpoint))
    reqs = [Req(f"r{i}", list(range(i, i + 64 * BLOCK + 1))) for i in range(4)]
    for req in reqs:
        eng.admit(req)
        eng.prefill(req)
    Hashes.reads = 0
    for t in range(20):
        for req in reqs:
            list.append(req.tokens, t)  # a token whose block is not full: no new hash
        assert eng.run(dict.fromkeys(reqs, 1)).saves == []
    assert Hashes.reads == 0


# ---- reset epoch -----------------------------------------------------------------------------
def test_reset_moves_to_a_new_epoch(endpoint):
    lay = layout()
    sched = scheduler(endpoint, lay)
    req = Req("r", list(range(3 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes)
    assert sched.num_new_matched_tokens(req, 0)[0] == 2 * BLOCK
    assert sched.reset()
    assert sched.num_new_matched_tokens(req, 0)[0] == 0
    assert sched.build_meta(step()).epoch not in ("", None)


def epoch_scheduler(endpoint: str, lay: EngineLayout, timeout_s: float = 2.0) -> SchedulerSide:
    index = KVIndex(lay.all_namespaces(), endpoint, lookup_timeout_s=1.0)
    sched = SchedulerSide(None, None, save=True, load_async=False)
    sched.activate(lay, index, epochs=EpochRecord(index, lay.marker_key, timeout_s))
    return sched


def test_a_reset_survives_restarts_and_reaches_new_engines(endpoint):
    """Fails on f1eb0b9: the epoch lived in the scheduler's memory, so a restarted engine
    read the pages saved before the reset again."""
    lay = layout()
    first = epoch_scheduler(endpoint, lay)
    assert first.ready and first.epoch
    same = epoch_scheduler(endpoint, lay)
    assert same.epoch == first.epoch  # engines of one namespace share its epoch
    req = Req("r", list(range(3 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0, first.epoch), req.block_hashes)
    assert same.num_new_matched_tokens(req, 0)[0] == 2 * BLOCK
    assert first.reset()  # e.g. after new weights were loaded in place
    restarted = epoch_scheduler(endpoint, lay)
    assert restarted.epoch not in (None, same.epoch)
    assert restarted.num_new_matched_tokens(req, 0)[0] == 0


def test_a_check_between_a_resets_delete_and_put_does_not_undo_it(endpoint, monkeypatch):
    """A reset deletes the record, then writes its new epoch. Another engine's check that runs
    in between finds no record and writes its own (the retired) epoch back: the reset must
    not adopt it (before: it did, reported the reset recorded, and every engine went on
    reading the pages saved before it), and the other engine follows the new epoch at its
    next check."""
    lay = layout()
    first, second = epoch_scheduler(endpoint, lay), epoch_scheduler(endpoint, lay)
    old = first.epoch
    assert old and second.epoch == old
    store = first.epochs.index.store
    delete = store.delete_many

    checked = []

    async def delete_then_the_other_checks(keys):
        out = await delete(keys)
        if not checked:  # the first DELETE only
            other = second.epochs
            checked.append(other.index.loop.call(other._establish(second.epoch), 5))
        return out

    monkeypatch.setattr(store, "delete_many", delete_then_the_other_checks)
    assert first.reset()
    monkeypatch.setattr(store, "delete_many", delete)
    assert checked == [old]  # the other engine wrote the retired epoch back in between
    assert first.epoch not in (None, old)
    assert second.epochs._call(second.epochs._read()) == first.epoch
    assert epoch_scheduler(endpoint, lay).epoch == first.epoch  # a new engine follows the reset


def test_an_unknown_epoch_reads_and_writes_nothing_until_the_store_answers():
    """Store unreachable at start-up: the scheduler cannot know whether a reset retired the
    pages it would read, so it looks nothing up and saves nothing until it reads the record."""
    with socket.socket() as probe:  # a port nothing listens on, for now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lay = layout()
    sched = epoch_scheduler(f"tcp://127.0.0.1:{port}", lay, timeout_s=0.5)
    req = Req("r", list(range(3 * BLOCK)))
    assert not sched.ready and sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build_meta(step({"r": 10})).saves == []
    node = StoreNode(NodeConfig(port=port, capacity="64MiB"))
    threading.Thread(target=node.serve_forever, daemon=True).start()
    try:
        wait_until(lambda: sched.build_meta(step()) is not None and sched.ready, timeout=20,
                   what="the scheduler to read the epoch record")  # fmt: skip
        assert sched.epoch
    finally:
        node.stop()


def test_an_outage_of_the_records_node_neither_resets_nor_splits_the_epoch(monkeypatch):
    """Two nodes; the one holding the epoch record stops answering for a while (SIGSTOP), and
    the other answers "not found" in its place. An engine that starts then must not write a new
    epoch there (every running engine would adopt it as a reset, and leave it again once the
    node is back), and a running engine's check must keep its epoch: both wait for the node,
    for at most HOME_WAIT_S, after which the record is taken for lost. Before: the new engine
    wrote a new epoch on the other node and the running one adopted it."""
    from pagekv.store import ClientConfig
    from pagekv.store.launch import start_nodes
    from tests.helpers import sigstop

    nodes = start_nodes(2, "--capacity", "64MiB")
    lay = layout()

    def engine() -> SchedulerSide:
        index = KVIndex(
            lay.all_namespaces(),
            ClientConfig(tuple(n.address for n in nodes), timeout_s=0.5),
            lookup_timeout_s=1.0,
        )
        sched = SchedulerSide(None, None, save=True, load_async=False)
        sched.activate(lay, index, epochs=EpochRecord(index, lay.marker_key, 3.0))
        return sched

    def holds(node) -> bool:
        with StoreClient([node.address]) as client:
            return client.exists_many([lay.marker_key]).found[0]

    def check(sched: SchedulerSide) -> str | None:  # a check as poll sends it, waited for
        return sched.epochs._call(sched.epochs._establish(sched.epoch))

    try:
        running = engine()
        epoch = running.epoch
        (home,) = [n for n in nodes if holds(n)]
        sigstop(home.proc.pid)
        try:
            started = engine()
            assert started.epoch is None and not started.ready  # waits, writes nothing
            assert check(running) is None and running.epoch == epoch
            assert not holds(next(n for n in nodes if n is not home))
        finally:
            home.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: check(started) == epoch, timeout=30, what="the record's node")
        sigstop(home.proc.pid)  # down again, now for longer than HOME_WAIT_S
        try:
            waiting = engine()
            assert waiting.epoch is None
            clock = time.monotonic() + epoch_module.HOME_WAIT_S + 1
            monkeypatch.setattr(epoch_module, "time", SimpleNamespace(monotonic=lambda: clock))
            assert check(waiting) not in (None, epoch)  # taken for lost: a new epoch, elsewhere
        finally:
            home.proc.send_signal(signal.SIGCONT)
    finally:
        for n in nodes:
            n.stop()


class _TwoNodes:
    """The record's two nodes, in memory: while its home node is down, the other answers."""

    def __init__(self) -> None:
        self.home, self.other, self.home_is_down = {}, {}, False

    def _node(self) -> dict:
        return self.other if self.home_is_down else self.home

    def home_down(self, key: bytes) -> bool:
        return self.home_is_down

    async def exists_many(self, keys):
        from pagekv.store.client.routing import ExistsResult

        return ExistsResult([k in self._node() for k in keys])

    async def get_many(self, keys):
        return [self._node().get(k) for k in keys]

    async def put_many(self, keys, values):
        node, out = self._node(), []
        for k, v in zip(keys, values):
            out.append(Status.EXISTS if k in node else Status.OK)
            node.setdefault(k, v)
        return out

    async def delete_many(self, keys):
        return [self._node().pop(k, None) is not None for k in keys]


def test_each_outage_of_the_records_node_is_waited_for(monkeypatch):
    """The wait for a record whose node is down counts from that outage: a node that came back
    (its record read again) and goes down hours later is waited for again, and a reset made
    meanwhile stays pending, not written on the other node. Before: the clock of the first
    outage was never reset, so the second was taken for a lost record at once and the reset,
    recorded on the other node, was undone when the home node came back."""
    clock = [1000.0]
    monkeypatch.setattr(epoch_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    loop = SimpleNamespace(call=lambda coro, timeout_s: asyncio.run(coro))
    store = _TwoNodes()
    record = EpochRecord(SimpleNamespace(loop=loop, store=store), b"record", timeout_s=1.0)
    epoch = record.establish()
    assert epoch and store.home
    for _outage in range(2):  # each waited for, whatever came before
        store.home_is_down = True
        assert record._call(record._establish(epoch)) is None  # waited for
        clock[0] += 10
        store.home_is_down = False
        assert record._call(record._establish(epoch)) == epoch
        clock[0] += 3600
    store.home_is_down = True
    new, recorded = record.replace(epoch)
    assert not recorded and store.other == {}  # pending until the home node is back
    store.home_is_down = False
    assert record._call(record._write(new, replace=True)) == new  # as the next poll sends it


class _HeldLoop:
    """An index loop whose checks the test answers: each coroutine handed over is closed
    unrun, and the future it returns stays pending until the test sets it."""

    def __init__(self, answer: str | None = None) -> None:
        self.sent: list[concurrent.futures.Future] = []
        self.answer = answer  # what a waited-for call returns; None: the store is down

    def submit(self, coro) -> concurrent.futures.Future:
        coro.close()
        self.sent.append(concurrent.futures.Future())
        return self.sent[-1]

    def call(self, coro, timeout_s: float):
        coro.close()
        if self.answer is None:
            raise TimeoutError("the store is down")
        return self.answer


def test_a_check_asked_for_while_one_is_in_flight_is_not_lost():
    """A lookup finds the store lacks blocks (it restarted empty) while a check of the record,
    sent while the store was down, is still on its way. That check fails; the one asked for must
    still go out a second after it, not after the failures' backoff: else the engine re-saves
    its blocks under an epoch no record names, and an engine starting meanwhile writes another
    (seen once in test_vllm_roles' restarted store). Failed before 2026-11-27: the failed
    check's backoff overwrote the request."""
    loop = _HeldLoop()
    record = EpochRecord(SimpleNamespace(loop=loop, store=None), b"record", timeout_s=0.3)
    for _ in range(3):  # the store down: each failure doubles the wait, now 8 s
        assert record.establish() is None
    assert record.poll(None, time.monotonic() + 60) is None  # a check goes out
    assert len(loop.sent) == 1
    record.check_soon(None)  # the lookup's sign of a restarted store
    loop.sent[0].set_result(None)  # the check sent while the store was down fails
    assert record.poll(None, time.monotonic()) is None  # its failure taken in
    assert record.poll(None, time.monotonic() + 1.5) is None
    assert len(loop.sent) == 2  # the check asked for, a second after the failed one
    loop.sent[1].set_result(None)  # it fails too: from here the backoff holds again
    assert record.poll(None, time.monotonic()) is None
    assert record.poll(None, time.monotonic() + 1.5) is None
    assert len(loop.sent) == 2


def test_a_check_asked_for_goes_out_though_the_engine_goes_idle(monkeypatch):
    """A lookup finds the store lacks blocks, and the engine then has nothing to run: no step,
    so no poll. The check asked for must still go out (a second after the last one), from the
    lookup itself. Before: it waited for a poll, so an idle engine left its re-saved blocks
    under an epoch no record named, and an engine starting then wrote another (CI,
    test_vllm_roles' restarted store, 2026-11-27)."""
    clock = [1000.0]
    monkeypatch.setattr(epoch_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    delays = []

    async def nothing():
        return None

    def checked(current, pending, delay):  # the check as sent: when it would run
        delays.append(delay)
        return nothing()

    loop = _HeldLoop(answer="ab" * 8)
    record = EpochRecord(SimpleNamespace(loop=loop, store=None), b"record", timeout_s=0.3)
    monkeypatch.setattr(record, "_checked", checked)
    assert record.establish() == "ab" * 8
    clock[0] += 0.25
    record.check_soon("ab" * 8)  # no poll follows
    assert len(loop.sent) == 1 and delays == [pytest.approx(0.75)]  # a second after the last
    record.check_soon("ab" * 8)  # one is on its way: not sent twice
    assert len(loop.sent) == 1
    loop.sent[0].set_result("ab" * 8)
    clock[0] += 0.75
    assert record.poll("ab" * 8, clock[0]) == "ab" * 8  # its answer; the second ask is sent
    assert len(loop.sent) == 2 and delays[-1] == pytest.approx(1.0)
    loop.sent[1].set_result("cd" * 8)  # a reset elsewhere, found by the check
    clock[0] += 1.0
    assert record.poll("ab" * 8, clock[0]) == "cd" * 8
    assert len(loop.sent) == 2  # nothing more asked for: the next check in CHECK_S


def test_a_reset_cancels_the_check_on_its_way():
    """A check sent before a reset would write the retired epoch back if it finds no record:
    the reset cancels it."""
    loop = _HeldLoop(answer="ab" * 8)
    record = EpochRecord(SimpleNamespace(loop=loop, store=None), b"record", timeout_s=0.3)
    assert record.establish() == "ab" * 8
    record.check_soon("ab" * 8)
    assert len(loop.sent) == 1
    loop.answer = "cd" * 8
    record.replace("ab" * 8)
    assert loop.sent[0].cancelled()


def test_a_hung_prefetch_loop_holds_a_step_once(node):
    """A step's synchronous loads wait for their prefetches up to ``load_timeout_s`` plus one
    grace second for a prefetch loop that does not answer at all: once per step, not once per
    request (before: each load after the deadline waited a second of its own, 1 + 4 s here)."""
    worker, _, _ = engine_worker(node, seed=1)  # load_timeout_s 1.0
    gate = threading.Event()
    worker._aio.call_soon(gate.wait)  # the prefetch loop hangs until the test ends
    try:
        loads = [BlockTransfer(f"r{i}", (i,), (bytes([i]) * 32,)) for i in range(4)]
        start = time.monotonic()
        worker.start_load(PagekvMetadata(loads=loads))
        took = time.monotonic() - start
    finally:
        gate.set()
    assert worker.take_errors() == {0, 1, 2, 3}  # recomputed
    assert took < worker.load_timeout_s + 1.0 + 1.0, took
    worker.close()


def test_a_failed_layerwise_copy_is_a_load_error_never_an_exception(node):
    """Layer-wise loads (CUDA) make the forward wait on each layer's copy; a copy-engine job
    that failed raises CopyFailed there. It must reach vLLM as load errors of that load's
    blocks (recomputed), never as an exception inside the model's forward; the other loads of
    the step are still waited for."""

    class Layers:  # the waits of a LayerLoad (CUDA only): one fails, one is fine
        num_layers = LAYERS

        def __init__(self, fails: bool) -> None:
            self.fails, self.waited = fails, []

        def wait_layer(self, layer: int) -> None:
            if self.fails:
                raise CopyFailed("a copy-engine transfer failed: RuntimeError('injected')")
            self.waited.append(layer)

    worker, _, _ = engine_worker(node, seed=1)
    bad, good = Layers(fails=True), Layers(fails=False)
    worker._layer_loads = [(bad, [5, 6]), (good, [7])]
    name = next(iter(worker.layer_index))
    worker.wait_for_layer(name)
    worker.wait_for_layer(name)  # the failed load is not waited for again
    assert worker.take_errors() == {5, 6}
    assert good.waited == [worker.layer_index[name]] * 2
    worker.close()


# ---- worker ----------------------------------------------------------------------------------
@pytest.mark.parametrize("load_async", [False, True])
def test_blocks_round_trip_between_engines_byte_for_byte(node, load_async):
    writer, _, src = engine_worker(node, seed=1)
    reader, _, dst = engine_worker(node, seed=2, poison=True)
    req = Req("r", list(range(4 * BLOCK)))
    hashes = tuple(req.block_hashes)
    writer.save(PagekvMetadata(saves=[BlockTransfer("r", (3, 9, 4, 20), hashes)]))
    writer.conn.flush_sync(timeout=10)
    untouched = block_bytes(dst, 0)
    load = BlockTransfer("r", (5, 6, 7, 8), hashes, load_async=load_async)
    meta = PagekvMetadata(loads=[load])
    reader.bind(meta)
    reader.start_load(meta)
    wait_until(
        lambda: reader.start_load(None) or not reader.pending_async,
        timeout=10,
        what="the asynchronous load",
    )  # each engine step copies in what finished
    assert reader.take_finished() == ({"r"} if load_async else set())
    assert reader.take_errors() == set()
    for s, d in zip((3, 9, 4, 20), (5, 6, 7, 8)):
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][d].view(torch.int32), src[layer][s].view(torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(block_bytes(dst, 0), untouched))
    writer.close()
    reader.close()


def test_pages_that_cannot_be_fetched_become_load_errors(node):
    writer, _, _ = engine_worker(node, seed=1)
    reader, _, dst = engine_worker(node, seed=2, poison=True)
    hashes = tuple(Req("r", list(range(4 * BLOCK))).block_hashes)
    writer.save(PagekvMetadata(saves=[BlockTransfer("r", (1, 2), hashes[:2])]))
    writer.conn.flush_sync(timeout=10)
    reader.start_load(PagekvMetadata(loads=[BlockTransfer("r", (5, 6, 7, 8), hashes)]))
    assert reader.take_errors() == {7, 8}  # the first two loaded, the rest recomputed
    assert dst[0][7].eq(-7.0).all() and not dst[0][6].eq(-7.0).all()
    node.stop()
    start = time.monotonic()
    meta = PagekvMetadata(loads=[BlockTransfer("r2", (10, 11), hashes[2:4])])
    reader.start_load(meta)  # the node is gone: bounded by load_timeout_s
    assert reader.take_errors() == {10, 11}
    assert time.monotonic() - start < reader.load_timeout_s + 2.0
    writer.close()
    reader.close()


def test_an_async_load_that_cannot_start_is_reported_not_left_waiting(node):
    """A request whose prefetch cannot be set up is reported finished with every block a load
    error (vLLM recomputes it). Fails on f1eb0b9: it stayed in WAITING_FOR_REMOTE_KVS for ever,
    holding its blocks."""
    reader, _, _ = engine_worker(node, seed=2)
    hashes = tuple(Req("r", list(range(2 * BLOCK))).block_hashes)

    def broken(*args, **kwargs):
        raise RuntimeError("no prefetch today")

    reader.conn.prefetch = broken
    meta = PagekvMetadata(loads=[BlockTransfer("r", (3, 4), hashes, load_async=True)])
    reader.bind(meta)
    reader.start_load(meta)
    assert reader.take_finished() == {"r"} and reader.take_errors() == {3, 4}
    other = PagekvMetadata(loads=[BlockTransfer("q", (5,), hashes[:1], load_async=True)])
    reader.fail_unbound(other)  # the connector's path when bind itself raised
    assert reader.take_finished() == {"q"} and reader.take_errors() == {5}
    assert reader.take_finished() == set()  # each reported once
    reader.close()


def test_a_save_writes_again_what_the_host_tier_holds(node):
    """The scheduler plans a save when the store may lack the block: a page the worker's host
    tier still holds is written to the store again (a node restarted empty)."""
    writer, _, _ = engine_worker(node, seed=1)
    hashes = tuple(Req("r", list(range(2 * BLOCK))).block_hashes)
    save = PagekvMetadata(saves=[BlockTransfer("r", (1, 2), hashes)])
    writer.save(save)
    writer.conn.flush_sync(timeout=10)
    ns = writer.conn.namespace
    with StoreClient([node.address]) as client:
        assert client.delete_many(ns.derive_keys(hashes)) == [True, True]
    writer.save(save)
    writer.conn.flush_sync(timeout=10)
    assert stored(node.address, ns, list(hashes)) == [True, True]
    writer.close()
