"""Store nodes launched with the CLI and engine processes, each with its own connector/cache."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv.store.launch import NodeProcess

pytestmark = pytest.mark.slow
ENGINE = str(Path(__file__).with_name("engine_proc.py"))
PROMPT = 2048 + 7  # 128 full pages of 16 tokens and a partial one


def engine(role, endpoints, replicas=1, seed=7, tokens=PROMPT):
    args = [
        sys.executable,
        ENGINE,
        role,
        " ".join(endpoints),
        str(replicas),
        str(seed),
        str(tokens),
    ]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc):
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_engine_b_loads_what_engine_a_saved(store_addresses):
    eps = store_addresses
    saved = result(engine("save", eps))
    assert saved["saved"] == 128 and saved["writeback_written"] == 128
    loaded = result(engine("load", eps))
    assert loaded == dict(lookup=2048, prefetched=2048, equal=True, fetched=128)


def test_replicas_survive_kill_9(three_nodes):
    eps = [n.address for n in three_nodes]
    assert result(engine("save", eps, replicas=2))["writeback_written"] == 128
    three_nodes[0].kill(signal.SIGKILL)
    loaded = result(engine("load", eps, replicas=2))
    assert loaded["prefetched"] == 2048 and loaded["equal"]


def test_two_engines_prefetch_the_same_prefix_at_once(store_addresses):
    eps = store_addresses
    result(engine("save", eps, seed=11))
    procs = [engine("load", eps, seed=11) for _ in range(2)]
    for p in procs:
        loaded = result(p)
        assert loaded["prefetched"] == 2048 and loaded["equal"]


def test_store_restart_means_misses_then_recovery():
    node = NodeProcess("--capacity", "256MiB").start()
    restarted = None
    try:
        assert result(engine("save", [node.address], seed=5))["writeback_written"] == 128
        node.kill(signal.SIGKILL)
        restarted = NodeProcess("--capacity", "256MiB", port=node.port).start()
        miss = result(engine("load", [node.address], seed=5))
        assert miss == dict(lookup=0, prefetched=0, equal=True, fetched=0)
        assert result(engine("save", [node.address], seed=5))["writeback_written"] == 128
        loaded = result(engine("load", [node.address], seed=5))
        assert loaded["prefetched"] == 2048 and loaded["equal"]
    finally:
        node.stop()
        if restarted is not None:
            restarted.stop()
