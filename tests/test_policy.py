"""Fetch-or-recompute decisions on measured inputs: a fast fetch is taken, a slow one refused,
the threshold moves the line, unmeasured inputs and long refusal runs lead to a probe."""

import math

import pytest

from pagekv.connector.policy import FetchPolicy, PolicyConfig
from pagekv.errors import ConfigError

BYTES_PER_TOKEN = 128 * 1024  # Llama-3-8B bf16: 32 layers x K,V x 8 heads x 128 x 2 bytes
ATTN_CONTEXT = 26_000.0


def measured(config=None, *, store_gbps, prefill_tokens_per_s=8000.0, load_gbps=25.0):
    """A policy fed the kind of measurements an engine makes: three prefills, three loads,
    three fetches (the estimates are their moving averages)."""
    p = FetchPolicy(config or PolicyConfig(), bytes_per_token=BYTES_PER_TOKEN,
                    attention_context=ATTN_CONTEXT)  # fmt: skip
    for n in (2048, 4096, 8192):
        p.observe_prefill(n, 0, p.work(n, 0) / prefill_tokens_per_s)
        nbytes = n * BYTES_PER_TOKEN
        p.observe_load(nbytes, nbytes / (load_gbps * 1e9))
        p.observe_fetch(nbytes, nbytes / (store_gbps * 1e9))
    return p


def test_fast_fetch_is_taken_and_slow_fetch_refused():
    # 16k-token prompt, 15k of it in the store only. Recompute of those 15k at 8k tok/s with
    # attention: ~2.3 s; fetching 1.9 GiB: 0.1 s at 20 GB/s, 19 s at 0.1 GB/s.
    fast = measured(store_gbps=20.0).decide(16384, 0, 15360)
    assert fast.fetch and fast.use_tokens == 15360
    assert fast.predicted_fetch_s < fast.predicted_recompute_s
    slow_policy = measured(store_gbps=0.1)
    slow = slow_policy.decide(16384, 0, 15360)
    assert not slow.fetch and slow.use_tokens == 0
    assert slow.predicted_fetch_s > slow.predicted_recompute_s
    stats = slow_policy.stats()
    assert (stats["fetch_refused"], stats["fetch_accepted"]) == (1, 0)
    assert stats["last"]["reason"].startswith("fetch predicted")
    assert stats["store_gbps"] == pytest.approx(0.1)
    assert stats["prefill_tokens_per_s"] == pytest.approx(8000.0)


def test_host_part_is_always_used_and_prices_the_rest():
    p = measured(store_gbps=0.1)
    d = p.decide(16384, 8192, 4096)  # host part kept, slow store part refused
    assert (d.fetch, d.use_tokens) == (False, 8192)
    # the store part's recompute cost is priced after the host part: later tokens attend to
    # more context, so they cost more than the same number at the start of the prompt
    late = p.decide(16384, 8192, 4096).predicted_recompute_s
    early = p.decide(16384, 0, 4096).predicted_recompute_s
    assert late > early
    assert p.decide(100, 64, 0).reason == "no store hit"


def test_threshold_moves_the_line():
    # at 1.5 GB/s the fetch is predicted ~2-3x faster than recompute for this prompt
    ratio = measured(store_gbps=1.5).decide(16384, 0, 15360)
    gain = ratio.predicted_recompute_s / ratio.predicted_fetch_s
    assert 1.2 < gain < 10
    below = PolicyConfig(threshold=gain * 0.9)
    above = PolicyConfig(threshold=gain * 1.1, reprobe_after=0)
    assert measured(below, store_gbps=1.5).decide(16384, 0, 15360).fetch
    assert not measured(above, store_gbps=1.5).decide(16384, 0, 15360).fetch


def test_unmeasured_inputs_probe_and_refusal_runs_reprobe():
    p = FetchPolicy(PolicyConfig(reprobe_after=3), bytes_per_token=BYTES_PER_TOKEN)
    first = p.decide(4096, 0, 2048)
    assert first.fetch and first.reason.startswith("probe")
    p = measured(PolicyConfig(reprobe_after=3), store_gbps=0.05)
    decisions = [p.decide(16384, 0, 15360) for _ in range(7)]
    assert [d.fetch for d in decisions] == [False, False, True, False, False, True, False]
    assert p.stats()["probes"] == 2


def test_modes_and_moving_average():
    always = measured(PolicyConfig(mode="always"), store_gbps=0.01)
    assert always.decide(16384, 0, 15360).fetch
    never = measured(PolicyConfig(mode="never"), store_gbps=100.0)
    d = never.decide(16384, 1024, 15000)
    assert (d.fetch, d.use_tokens) == (False, 1024)
    p = FetchPolicy(PolicyConfig(ema_alpha=0.5), bytes_per_token=1)
    p.observe_fetch(10**9, 1.0)  # 1 GB/s
    p.observe_fetch(3 * 10**9, 1.0)  # 3 GB/s
    p.observe_fetch(10**9, 0.0)  # no time: ignored
    assert p.stats()["store_gbps"] == pytest.approx(2.0)
    assert p.stats()["samples"]["store"] == 2
    p.observe_prefill(8, 0, 1.0)  # under min_sample_tokens: fixed costs, ignored
    assert p.stats()["prefill_tokens_per_s"] is None


def test_deadline_is_the_break_even():
    d = measured(store_gbps=20.0).decide(16384, 0, 15360)
    assert d.deadline_s == pytest.approx(d.predicted_recompute_s)


def test_bad_config_and_arguments():
    for bad in ({"mode": "sometimes"}, {"threshold": 0}, {"ema_alpha": 0}, {"store_gbps": -1}):
        with pytest.raises(ConfigError):
            PolicyConfig(**bad)
    with pytest.raises(ConfigError):
        FetchPolicy(bytes_per_token=0)
    p = FetchPolicy(bytes_per_token=1, attention_context=math.inf)
    with pytest.raises(ConfigError):
        p.decide(100, 50, 50)  # no token left to compute
    with pytest.raises(ConfigError):
        p.decide(100, -1, 10)
