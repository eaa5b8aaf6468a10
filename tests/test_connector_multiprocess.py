"""Store nodes launched with the CLI and engine processes, each with its own connector/cache.
Each test on three nodes runs against memory-only nodes and against nodes with 1 MiB of memory
(less than the 1.4 to 2.7 MiB a test stores on each) and a disk tier (``--disk``) of four 1 MiB
segments, smaller than the test's data (4 to 8 MiB): a load reads pages from disk."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv.store import ClientConfig, StoreClient
from pagekv.store.launch import NodeProcess, start_nodes

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


MEMORY_ONLY = ("--capacity", "256MiB")


def with_disk(directory: Path, disk: str = "4MiB") -> tuple[str, ...]:
    """A node holding part of a test's pages in memory, the rest in a disk tier smaller than
    the test's data."""
    return ("--capacity", "1MiB", "--max-block-size", "256KiB", "--disk", str(directory),
            "--disk-capacity", disk, "--disk-segment-size", "1MiB")  # fmt: skip


def start_three(kind: str, tmp_path: Path) -> list[NodeProcess]:
    """Three `pagekv serve` processes: memory only, or small memory and a disk tier each."""
    if kind == "memory":
        return start_nodes(3, *MEMORY_ONLY)
    nodes: list[NodeProcess] = []
    try:
        for n in range(3):
            nodes.append(NodeProcess(*with_disk(tmp_path / f"disk{n}")).start())
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


@pytest.fixture(params=["memory", "disk"])
def three_nodes(request, tmp_path):
    nodes = start_three(request.param, tmp_path)
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture(params=["memory", "disk", "mooncake"])
def store_addresses(request, tmp_path):
    """The addresses of each store a test runs against: three pagekv nodes (memory only, or
    with a disk tier), or a Mooncake Store (master and store processes; tests/conftest.py)."""
    if request.param == "mooncake":
        yield [request.getfixturevalue("mooncake").address]
        return
    nodes = start_three(request.param, tmp_path)
    yield [n.address for n in nodes]
    for n in nodes:
        n.stop()


def test_engine_b_loads_what_engine_a_saved(store_addresses, request):
    eps = store_addresses
    saved = result(engine("save", eps))
    assert saved["saved"] == 128 and saved["writeback_written"] == 128
    loaded = result(engine("load", eps))
    assert loaded == dict(lookup=2048, prefetched=2048, equal=True, fetched=128)
    if request.node.callspec.params["store_addresses"] == "disk":
        with StoreClient(eps[0], config=ClientConfig(tuple(eps))) as c:
            assert sum(s["disk_hits"] for s in c.stats()) > 0


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


def test_a_node_with_a_disk_tier_restarted_by_sigterm_keeps_the_prefix(tmp_path):
    """A rolling restart: the node saves its memory to disk on SIGTERM; the engine started
    after it loads the whole prefix (4 MiB: 1 MiB of memory, the rest saved) from the restarted
    node."""
    args = with_disk(tmp_path / "disk", "8MiB")
    node = NodeProcess(*args).start()
    try:
        assert result(engine("save", [node.address], seed=9))["writeback_written"] == 128
        assert node.kill(signal.SIGTERM, timeout=60) == 0
        node = NodeProcess(*args, port=node.port).start(timeout=60)
        loaded = result(engine("load", [node.address], seed=9))
        assert loaded == dict(lookup=2048, prefetched=2048, equal=True, fetched=128)
    finally:
        node.stop()
