"""Decode from CUDA graphs (pagekv.engine.decode_graph) against eager decode of the same model
and prompts: same greedy tokens (fp32), graphs reused across requests without reading stale
slots, poison in the rows a graph masks never leaks, fallback for split slot tables, and a
decode beside a prompt's save and write-back."""

import pytest
import torch

from pagekv.engine import PRESETS, Engine, EngineConfig, Request
from pagekv.store.launch import NodeProcess

pytestmark = pytest.mark.cuda
MODEL = PRESETS["small"]  # 8 layers, GQA 8/2 heads x 64


def engines(store=None, dtype="fp32", slots=4096):
    """An eager engine and a graph engine sharing one model's weights."""
    eager = Engine(EngineConfig(MODEL, num_slots=slots, dtype=dtype, device="cuda",
                                decode_graphs=False))  # fmt: skip
    cfg = EngineConfig(MODEL, num_slots=slots, dtype=dtype, device="cuda", host_pages=512)
    graph = Engine(cfg, store, model=eager.model)
    assert graph.graphs is not None and eager.graphs is None
    return eager, graph


def prompt(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=gen).tolist()


def run(engine, tokens, new=24, **kw):
    return engine.generate(Request(tuple(tokens), new, **kw)).tokens


@pytest.mark.parametrize("n", [1, 15, 16, 100, 517, 1000])
def test_graph_decode_makes_the_eager_tokens(n):
    eager, graph = engines()
    p = prompt(n, n)
    assert run(graph, p) == run(eager, p)
    assert graph.graphs.captures == 1


def test_a_kept_graph_reads_each_new_request_not_the_last():
    eager, graph = engines()
    prompts = [prompt(300, seed) for seed in range(4)]
    for p in prompts:  # same length: one graph, replayed with every prompt's own slots
        assert run(graph, p) == run(eager, p)
    assert graph.graphs.captures == 1
    assert run(graph, prompt(301, 9)) == run(eager, prompt(301, 9))
    assert graph.graphs.captures == 2


def test_poison_in_the_rows_the_mask_hides_does_not_leak():
    """The rows past ``pos`` get zero attention weight; NaN there would still make NaN
    (0 * NaN) if the graph did not zero them first."""
    eager, graph = engines()
    p = prompt(200, 3)
    expected = run(eager, p)
    graph.cache.k.fill_(float("nan"))
    graph.cache.v.fill_(float("nan"))
    assert run(graph, p) == expected


def test_a_split_slot_table_decodes_eagerly():
    eager, graph = engines(slots=1024)
    hold = graph.cache.allocate(64)  # pages 0-3
    tail = graph.cache.allocate(64)  # pages 4-7
    graph.cache.free(hold)  # the next request gets pages 0-3 and then 8..: not one run
    p = prompt(100, 5)
    assert run(graph, p) == run(eager, p)
    assert graph.graphs.captures == 0
    graph.cache.free(tail)


def test_bf16_graph_decode_stays_close_to_eager():
    eager, graph = engines(dtype="bf16")
    p = prompt(700, 11)
    a, b = run(eager, p, new=32), run(graph, p, new=32)
    assert a[:8] == b[:8]  # rounding may tip a near tie later on; the start must agree


@pytest.fixture(scope="module")
def node():
    n = NodeProcess("--capacity", "1GiB").start()
    yield n
    n.stop()


def test_decode_beside_the_save_and_a_reuse_of_it(node):
    """The prompt's save (device -> host copy on the connector's stream, then the write-back)
    runs while the graph writes the decode rows; the next request reuses what was saved."""
    eager, graph = engines(store=node.address)
    p = prompt(2048, 21)
    expected = run(eager, p, new=48)
    first = graph.generate(Request(tuple(p), 48))
    assert first.tokens == expected and first.saved_pages == 2048 // 16
    graph.flush(timeout_s=60)
    again = graph.generate(Request(tuple(p), 48, save=False))
    assert again.reused_tokens == 2047 // 16 * 16
    assert again.tokens == expected
    graph.close(timeout_s=30)
