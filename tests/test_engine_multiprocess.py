"""Two engine processes (``python -m pagekv.engine``) and a real store node: engine B's
request whose prefix came from the store gives, bit for bit, the logits and greedy tokens of
a full recompute, and of engine A's own computation of the same prompt."""

import json
import subprocess
import sys

import pytest
import torch

from pagekv.engine import PRESETS
from pagekv.store.launch import start_nodes

pytestmark = pytest.mark.slow
VOCAB = PRESETS["tiny"].vocab_size


def run_engine(tmp_path, name, store, requests, *extra):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(requests))
    cmd = [sys.executable, "-m", "pagekv.engine", "--store", store, "--requests", str(path),
           "--preset", "tiny", "--device", "cpu", "--num-slots", "4096", "--threads", "1",
           "--dump", str(tmp_path), *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["name"]: r for r in lines if r["event"] == "result"}, lines[-1]


def dumped(tmp_path, name):
    return torch.load(tmp_path / f"{name}.pt", weights_only=True)


def test_two_engine_processes_share_a_prefix_bit_exactly(tmp_path):
    gen = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    system = rand(1500)  # 93 full pages + 12 tokens
    a_prompt, b_prompt = system + rand(41), system + rand(57)
    nodes = start_nodes(1, "--capacity", "256MiB")
    try:
        store = nodes[0].address
        a, a_stats = run_engine(tmp_path, "a", store,
                                [dict(name="a1", prompt=a_prompt, max_new_tokens=12)])  # fmt: skip
        assert a["a1"]["reused_tokens"] == 0 and a["a1"]["saved_pages"] == 1541 // 16
        assert a_stats["connector"]["writeback_written"] == 1541 // 16
        b, b_stats = run_engine(tmp_path, "b", store, [
            dict(name="b_hit", prompt=b_prompt, max_new_tokens=12),
            dict(name="b_full", prompt=b_prompt, max_new_tokens=12, reuse=False, save=False),
            dict(name="b_a", prompt=a_prompt, max_new_tokens=12),
        ], "--poison-cache")  # fmt: skip
    finally:
        for n in nodes:
            n.stop()
    assert (b["b_hit"]["reused_store"], b["b_hit"]["tier"]) == (1488, "store")
    assert b["b_a"]["tier"] == "host+store" and b["b_a"]["reused_tokens"] == 1536
    hit, full = dumped(tmp_path, "b_hit"), dumped(tmp_path, "b_full")
    assert torch.isfinite(hit["logits"]).all()
    assert torch.equal(hit["logits"], full["logits"]) and hit["tokens"] == full["tokens"]
    a1, b_a = dumped(tmp_path, "a1"), dumped(tmp_path, "b_a")
    assert torch.equal(a1["logits"], b_a["logits"]) and a1["tokens"] == b_a["tokens"]
    assert b_stats["connector"]["hit_tokens_store"] == 1488 + 48
