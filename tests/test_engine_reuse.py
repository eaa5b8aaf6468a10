"""The reference engine reusing prefix KV through a store node (in-process engines): a request
whose prefix came from the store or the host tier gives the logits and tokens of a full
recompute, bit for bit on CPU fp32; a refused or impossible fetch recomputes."""

import time

import pytest
import torch

from pagekv.connector.policy import PolicyConfig
from pagekv.engine import PRESETS, Engine, EngineConfig, Request
from pagekv.store import ClientConfig

MODEL = PRESETS["tiny"]
PAGE = 16


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matmuls are too small to split: one thread is faster, and spares a
    shared machine's other cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(**kw):
    base = dict(page_size=PAGE, num_slots=2048, host_pages=512)
    return EngineConfig(MODEL, **{**base, **kw})


def tokens(gen, n):
    return torch.randint(0, MODEL.vocab_size, (n,), generator=gen).tolist()


def poisoned(engine):
    """NaN in every slot: a slot read before it is written (loaded or computed) shows."""
    engine.cache.k.fill_(float("nan"))
    engine.cache.v.fill_(float("nan"))
    return engine


def same_output(a, b):
    return torch.equal(a.first_logits, b.first_logits) and a.tokens == b.tokens


@pytest.fixture
def store(node):
    return ClientConfig((node.address,), timeout_s=5.0)


# prefix lengths: inside a chunk, on a chunk boundary (64), page-aligned, long; suffixes short
# and long; the last case's prompt is page-aligned (its last page is never reused)
CASES = [(40, 9), (64, 30), (400, 3), (1000, 100), (752, 48)]


def test_prefix_from_store_is_bit_exact(store):
    gen = torch.Generator().manual_seed(1)
    a = Engine(config(), store)
    b = poisoned(Engine(config(), store))
    try:
        for prefix_len, suffix_len in CASES:
            prefix = tokens(gen, prefix_len)
            prompt_a = prefix + tokens(gen, suffix_len)
            first = a.generate(Request(prompt_a, 8))
            a.flush()
            prompt = prefix + tokens(gen, suffix_len + 1)
            hit = b.generate(Request(prompt, 8))
            full = b.generate(Request(prompt, 8, reuse=False))
            assert hit.reused_store == prefix_len // PAGE * PAGE and hit.reused_host == 0
            assert full.reused_tokens == 0
            assert same_output(hit, full), (prefix_len, suffix_len)
            assert torch.isfinite(hit.first_logits).all()
            # the same prompt as A's: B's host tier now has the prefix, the store the rest
            again = b.generate(Request(prompt_a, 8))
            assert again.reused_host == hit.reused_store
            assert same_output(again, first)
        assert b.stats()["engine"]["reused_store"] > 0
    finally:
        a.close()
        b.close()


def test_host_tier_reuse_is_bit_exact_and_slots_are_reused_at_once(store):
    gen = torch.Generator().manual_seed(2)
    # a cache with room for one request at a time: each request gets the slots the previous
    # one gave back, right after its save
    engine = poisoned(Engine(config(num_slots=1280), store))
    try:
        prefix = tokens(gen, 1100)
        for _ in range(3):
            prompt = prefix + tokens(gen, 37)
            hit = engine.generate(Request(prompt, 16))
            full = engine.generate(Request(prompt, 16, reuse=False, save=False))
            assert same_output(hit, full)
        assert hit.reused_host == 1088 and hit.tier == "host"
        assert engine.cache.free_pages == engine.cache.num_pages
    finally:
        engine.close()


def test_fragmented_slot_table_reads_through_a_gather():
    engine = poisoned(Engine(config(num_slots=2048)))
    prompt = tokens(torch.Generator().manual_seed(6), 900)
    contiguous = engine.generate(Request(prompt, 8))
    hole = engine.cache.allocate(PAGE)  # page 0 taken: the next table starts at page 1
    other = engine.cache.allocate(1000)
    engine.cache.free(hole)  # the request gets page 0, then pages after `other`
    fragmented = engine.generate(Request(prompt, 8))
    engine.cache.free(other)
    assert same_output(contiguous, fragmented)


def test_fast_path_matches_within_rounding(store):
    """Without batch-invariant chunks the suffix is one forward: same result up to fp32
    rounding (the batch-invariant default is what makes it bit-exact)."""
    gen = torch.Generator().manual_seed(3)
    engine = Engine(config(batch_invariant=False), store)
    try:
        prefix = tokens(gen, 900)
        engine.generate(Request(prefix + tokens(gen, 20), 4))
        prompt = prefix + tokens(gen, 21)
        hit = engine.generate(Request(prompt, 8))
        full = engine.generate(Request(prompt, 8, reuse=False))
        assert hit.reused_host == 896
        torch.testing.assert_close(hit.first_logits, full.first_logits, rtol=1e-5, atol=1e-5)
        assert hit.tokens == full.tokens
    finally:
        engine.close()


def test_refused_fetch_recomputes(store):
    gen = torch.Generator().manual_seed(4)
    a = Engine(config(), store)
    # a threshold no fetch can meet: once bandwidth and prefill speed are measured (by the
    # first store hit, a probe), every store hit is refused
    b = poisoned(Engine(config(), store, policy=PolicyConfig(threshold=1e9, reprobe_after=0)))
    try:
        prompts = [tokens(gen, 700) for _ in range(2)]
        for p in prompts:
            a.generate(Request(p, 2))
        a.flush()
        b.warmup()  # measures the prefill speed
        probe = b.generate(Request(prompts[0][:-1], 4))
        assert probe.reused_store == 688 and probe.decision["reason"].startswith("probe")
        refused = b.generate(Request(prompts[1][:-1], 4))
        assert refused.reused_tokens == 0 and not refused.decision["fetch"]
        assert refused.decision["predicted_fetch_s"] > 0
        full = b.generate(Request(prompts[1][:-1], 4, reuse=False))
        assert same_output(refused, full)
        policy = b.stats()["policy"]
        assert (policy["fetch_accepted"], policy["fetch_refused"]) == (1, 1)
        assert b.connector.stats()["policy"] == b.policy.stats()  # the decision in the connector
    finally:
        a.close()
        b.close()


def test_dead_store_means_recompute_not_failure(node):
    gen = torch.Generator().manual_seed(5)
    address = node.address
    node.stop()  # nothing listens there any more
    store = ClientConfig((address,), timeout_s=0.3)
    engine = Engine(config(), store)
    plain = Engine(config())
    try:
        prompt = tokens(gen, 500)
        start = time.monotonic()
        result = engine.generate(Request(prompt, 4))
        assert time.monotonic() - start < 5  # the lookup is bounded
        assert result.reused_tokens == 0
        assert same_output(result, plain.generate(Request(prompt, 4)))
    finally:
        engine.close(timeout_s=2)
