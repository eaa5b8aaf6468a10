"""The vLLM connector's scheduler and worker halves against a real store node, without vLLM:
requests are stand-ins with vLLM's fields (request_id, num_tokens, chained block_hashes), caches
are vLLM-shaped CPU views (tests/engines/vllm_layouts.py) filled with random data."""

from __future__ import annotations

import hashlib
import pickle
import time
from types import SimpleNamespace

import pytest
import torch

from pagekv.connector import KVIndex
from pagekv.connector.vllm.blocks import block_geometry
from pagekv.connector.vllm.metadata import BlockTransfer, PagekvMetadata
from pagekv.connector.vllm.namespace import EngineLayout
from pagekv.connector.vllm.scheduler import SchedulerSide
from pagekv.store import Status, StoreClient

from .vllm_layouts import vllm_layer_views, worker_over

BLOCK, LAYERS, HEADS, CELL, NUM_BLOCKS = 16, 2, 2, 8, 32
GEO = block_geometry(LAYERS, HEADS * BLOCK * CELL * 4, torch.float32)


def layout(tp_size: int = 1, rank_shared: bool = False, hash_ratio: int = 1) -> EngineLayout:
    return EngineLayout("test-model", "vllm-v1|test", (GEO,), BLOCK, hash_ratio, tp_size,
                        rank_shared)  # fmt: skip


def request(req_id: str, tokens: list[int], hashes_per_block: int = 1) -> SimpleNamespace:
    """vLLM-like request: one sha256 hash per BLOCK / hashes_per_block tokens, chained."""
    step, prev, hashes = BLOCK // hashes_per_block, b"root", []
    for i in range(0, len(tokens) - step + 1, step):
        prev = hashlib.sha256(prev + bytes(str(tokens[i : i + step]), "ascii")).digest()
        hashes.append(prev)
    return SimpleNamespace(request_id=req_id, num_tokens=len(tokens), block_hashes=hashes)


def engine_worker(node, seed: int, poison: bool = False):
    """A worker half over vLLM-shaped LBHNC views; the raw buffer is returned for checks."""
    raw, views = vllm_layer_views("LBHNC", LAYERS, NUM_BLOCKS, HEADS, BLOCK, CELL,
                                  torch.float32, seed=seed)  # fmt: skip
    if poison:
        raw.fill_(-7.0)
    return worker_over(views, NUM_BLOCKS, GEO, node.address, load_timeout_s=1.0), raw, views


def step(new=None, cached=None, scheduled=None) -> SimpleNamespace:
    """The parts of vLLM's SchedulerOutput the scheduler half reads: req_id -> computed tokens
    of new and of running requests, req_id -> tokens scheduled in this step."""
    new, cached = new or {}, cached or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n)
                            for r, n in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                              num_computed_tokens=list(cached.values())),
        num_scheduled_tokens=scheduled or {}, preempted_req_ids=set(),
    )  # fmt: skip


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


def test_lookup_caps_a_full_prompt_hit_and_starts_at_the_local_hit(endpoint):
    lay = layout()
    sched = SchedulerSide(lay, KVIndex(lay.all_namespaces(), endpoint), save=True,
                          load_async=False)  # fmt: skip
    req = request("r", list(range(4 * BLOCK)))  # exactly 4 blocks, all stored
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes)
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)  # one token left
    assert sched.num_new_matched_tokens(req, 2 * BLOCK) == (BLOCK, False)
    longer = request("r2", list(range(4 * BLOCK + 1)))
    assert sched.num_new_matched_tokens(longer, 0) == (4 * BLOCK, False)
    other = request("r3", [7] * (4 * BLOCK + 1))
    assert sched.num_new_matched_tokens(other, 0) == (0, False)


def test_hit_is_the_minimum_over_tensor_parallel_ranks(endpoint):
    lay = layout(tp_size=2)
    sched = SchedulerSide(lay, KVIndex(lay.all_namespaces(), endpoint), save=True,
                          load_async=True)  # fmt: skip
    req = request("r", list(range(5 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes)  # rank 0: 5 blocks
    assert sched.num_new_matched_tokens(req, 0) == (0, False)  # rank 1 has none
    store_pages(endpoint, lay.namespace(1, 0), req.block_hashes[:2])
    assert sched.num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
    mla = layout(tp_size=2, rank_shared=True)
    assert len(mla.all_namespaces()) == 1 and not mla.namespace(1, 0).is_writer


def test_loads_saves_and_failures_are_planned_per_block(endpoint):
    lay = layout(hash_ratio=2)
    blocks = {"r": list(range(100, 120))}
    sched = SchedulerSide(lay, KVIndex(lay.all_namespaces(), endpoint), save=True,
                          load_async=False, block_ids_of=blocks.__getitem__)  # fmt: skip
    req = request("r", list(range(6 * BLOCK + 3)), hashes_per_block=2)
    pages = lay.page_hashes(req.block_hashes)
    assert pages == req.block_hashes[1::2] and len(pages) == 6
    store_pages(endpoint, lay.namespace(0, 0), pages[:3])
    assert sched.num_new_matched_tokens(req, BLOCK) == (2 * BLOCK, False)
    sched.update_state_after_alloc(req, blocks["r"], 2 * BLOCK)
    so = step(new={"r": 3 * BLOCK}, scheduled={"r": 2 * BLOCK + 1})
    meta = pickle.loads(pickle.dumps(sched.build_meta(so)))  # crosses a process boundary
    assert meta.loads == [BlockTransfer("r", (101, 102), tuple(pages[1:3]))]
    assert meta.saves == [BlockTransfer("r", (103, 104), tuple(pages[3:5]))]  # computed here
    so = step(cached={"r": 5 * BLOCK + 1}, scheduled={"r": BLOCK})
    assert sched.build_meta(so).saves == [BlockTransfer("r", (105,), (pages[5],))]
    assert sched.build_meta(so).saves == []  # each block once
    sched.on_output({102}, set())  # a worker could not load block 102
    assert sched.num_new_matched_tokens(req, 0) == (0, False)  # recomputed, not retried
    assert sched.counters["failed_loads"] == 1


def test_reset_moves_to_a_new_epoch(endpoint):
    lay = layout()
    sched = SchedulerSide(lay, KVIndex(lay.all_namespaces(), endpoint), save=True,
                          load_async=False)  # fmt: skip
    req = request("r", list(range(3 * BLOCK)))
    store_pages(endpoint, lay.namespace(0, 0), req.block_hashes)
    assert sched.num_new_matched_tokens(req, 0)[0] == 2 * BLOCK
    sched.reset()
    assert sched.num_new_matched_tokens(req, 0)[0] == 0
    assert sched.build_meta(step()).epoch == 1


def test_lookup_of_a_dead_node_is_a_bounded_miss(node):
    endpoint = node.address
    node.stop()
    lay = layout()
    sched = SchedulerSide(lay, KVIndex(lay.all_namespaces(), endpoint, lookup_timeout_s=0.1),
                          save=True, load_async=False)  # fmt: skip
    start = time.monotonic()
    assert sched.num_new_matched_tokens(request("r", list(range(5 * BLOCK))), 0) == (0, False)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("load_async", [False, True])
def test_blocks_round_trip_between_engines_byte_for_byte(node, load_async):
    writer, _, src = engine_worker(node, seed=1)
    reader, _, dst = engine_worker(node, seed=2, poison=True)
    req = request("r", list(range(4 * BLOCK)))
    hashes = tuple(req.block_hashes)
    writer.save(PagekvMetadata(saves=[BlockTransfer("r", (3, 9, 4, 20), hashes)]))
    writer.conn.flush_sync(timeout=10)
    untouched = block_bytes(dst, 0)
    load = BlockTransfer("r", (5, 6, 7, 8), hashes, load_async=load_async)
    meta = PagekvMetadata(loads=[load])
    reader.bind(meta)
    reader.start_load(meta)
    deadline = time.monotonic() + 10
    while reader.pending_async and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine runs other steps meanwhile
        reader.start_load(None)  # each step copies in the prefetches that finished
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
    hashes = tuple(request("r", list(range(4 * BLOCK))).block_hashes)
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


def test_a_load_that_cannot_be_planned_is_recomputed(node):
    """vLLM counts accepted external tokens as computed: if the scheduler cannot plan their load
    (here: fewer blocks than tokens), the workers must report the blocks, never skip them."""
    lay = layout()
    sched = SchedulerSide(lay, KVIndex(lay.all_namespaces(), node.address), save=False,
                          load_async=False)  # fmt: skip
    req = request("r", list(range(4 * BLOCK)))
    store_pages(node.address, lay.namespace(0, 0), req.block_hashes)
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(req, [7, 8], 3 * BLOCK)
    meta = sched.build_meta(step())
    assert [(s.block_ids, s.failed) for s in meta.loads] == [((7, 8), True)]
    worker, _, _ = engine_worker(node, seed=3)
    worker.start_load(meta)
    assert worker.take_errors() == {7, 8}
    worker.close()
