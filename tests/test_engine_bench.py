"""scripts/bench_e2e.py --quick (what the GPU run does, on CPU with a tiny model) runs and
writes the result the GPU run will: every scenario timed, reuse bit-exact on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_e2e.py"


def test_bench_e2e_quick(tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--tokens", "256,512", "--decode-tokens", "4",
           "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    (model,) = json.loads(out.read_text())["models"]
    assert [r["prompt_tokens"] for r in model["lengths"]] == [256, 512]
    for row in model["lengths"]:
        assert set(row["ttft_ms"]) == {"recompute", "host", "store", "policy"}
        assert all(v > 0 for v in row["ttft_ms"].values())
        assert "warnings" not in row  # every store scenario really hit the store
        assert row["host_vs_recompute_logits"]["bit_identical"]
        assert row["decode"]["runs"]["saves_on"][0]["saved_pages"] == row["prompt_tokens"] // 16
        assert row["store_fetch_gbps"] > 0 and row["writeback_gbps"] > 0
    assert model["policy_stats"]["decisions"] >= 3
