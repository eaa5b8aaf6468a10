"""Multi-process integration: real `pagekv serve` processes on free loopback ports."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pagekv.store import ClientConfig, Status, StoreClient
from pagekv.store.client import operations
from pagekv.store.launch import NodeProcess
from pagekv.store.wire.protocol import checksum_frames
from tests.helpers import store_blocks, wait_until

pytestmark = pytest.mark.slow


def blocks(n, size=64 << 10, seed=b""):
    keys = [seed + i.to_bytes(8, "little") + os.urandom(8) for i in range(n)]
    return keys, [os.urandom(size) for _ in range(n)]


def test_sharding_spreads_keys_and_reads_back(three_nodes):
    eps = [n.address for n in three_nodes]
    keys, data = blocks(90)
    with StoreClient(eps, timeout_s=5) as client:
        assert client.put_many(keys, data) == [Status.OK] * 90
        got = client.get_many(keys)
        assert [bytes(g) for g in got] == data
        per_node = [s["blocks"] for s in client.stats()]
        assert sum(per_node) == 90 and min(per_node) >= 15
        assert client.exists_many(keys).leading == 90


def test_replicated_put_hashes_each_value_once_as_its_requests_go(three_nodes, monkeypatch):
    """A PUT's checksums are computed request by request as each is sent, each value once
    however many copies it gets: every copy is stored (the nodes verify each value against its
    request's checksum) and reads back exactly from each node on its own."""
    hashed = []

    def counting(frames):
        hashed.append(bytes(frames[0][:16]))
        return checksum_frames(frames)

    monkeypatch.setattr(operations, "checksum_frames", counting)
    eps = [n.address for n in three_nodes]
    keys, data = blocks(60)
    cfg = ClientConfig(tuple(eps), replicas=2, timeout_s=10, max_message_bytes=256 << 10)
    with StoreClient(eps, config=cfg) as client:
        assert client.put_many(keys, data) == [Status.OK] * len(keys)
        assert sorted(hashed) == sorted(d[:16] for d in data)  # each value, once
        assert sum(s["blocks"] for s in client.stats()) == 2 * len(keys)
    copies = [0] * len(keys)
    for ep in eps:
        with StoreClient(ep, timeout_s=10) as one:
            for i, got in enumerate(one.get_many(keys)):
                if got is not None:
                    assert bytes(got) == data[i]
                    copies[i] += 1
    assert copies == [2] * len(keys)


def test_a_put_sends_its_first_request_before_hashing_its_last(three_nodes, monkeypatch):
    """Hashing overlaps sending: when the PUT's last value is hashed, its first request is
    already stored on the node (waited for as state, from another client). One stream: its
    requests go out in order (with several, a stream whose link connects first may send a
    later request before the first one's stream can)."""
    ep = three_nodes[0].address
    keys, data = blocks(32)
    seen_stored = []

    def checking(frames):
        if bytes(frames[0]) == data[-1]:
            with StoreClient(ep, timeout_s=5) as other:
                wait_until(lambda: other.exists_many(keys[:1]).leading == 1, timeout=5,
                           what="the first request stored")  # fmt: skip
            seen_stored.append(True)
        return checksum_frames(frames)

    monkeypatch.setattr(operations, "checksum_frames", checking)
    cfg = ClientConfig((ep,), timeout_s=10, max_message_bytes=128 << 10, bulk=False, streams=1)
    with StoreClient(ep, config=cfg) as client:
        assert client.put_many(keys, data) == [Status.OK] * len(keys)
    assert seen_stored == [True]


_WORKER = r"""
import os, sys
from pagekv.store import StoreClient, Status
eps, name = sys.argv[1].split(","), sys.argv[2].encode()
keys = [name + i.to_bytes(4, "little") for i in range(40)]
data = [os.urandom(32 << 10) + name for _ in keys]
with StoreClient(eps, replicas=2, timeout_s=10) as c:
    assert set(c.put_many(keys, data)) == {Status.OK}, "put"
    for _ in range(5):
        got = c.get_many(keys)
        assert [bytes(g) for g in got] == data, "get"
    shared = c.get_many([b"shared-block-key"])[0]
    assert shared is not None and bytes(shared) == b"S" * 1000, "shared"
print("ok")
"""


def test_several_client_processes_at_once(three_nodes):
    eps = [n.address for n in three_nodes]
    with StoreClient(eps, replicas=2) as client:
        assert client.put_many([b"shared-block-key"], [b"S" * 1000]) == [Status.OK]
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, ",".join(eps), f"w{i}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(4)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 and out.strip() == "ok" for p, (out, _) in zip(procs, outs)), outs


def test_kill_9_with_two_replicas_loses_no_reads(three_nodes):
    eps = [n.address for n in three_nodes]
    keys, data = blocks(60)
    with StoreClient(eps, replicas=2, timeout_s=1) as client:
        assert client.put_many(keys, data) == [Status.OK] * 60
        assert three_nodes[1].kill(signal.SIGKILL) == -signal.SIGKILL
        start = time.monotonic()
        got = client.get_many(keys)
        assert [bytes(g) if g is not None else None for g in got] == data
        assert client.exists_many(keys).leading == 60
        # the dead node is backed off: the next reads do not wait for its timeout again
        t0 = time.monotonic()
        assert all(g is not None for g in client.get_many(keys))
        assert time.monotonic() - t0 < 1.0 and time.monotonic() - start < 10
        assert client.counters["node_failures"] >= 1
        # writes keep 2 copies on the live nodes
        more_keys, more = blocks(10, seed=b"after")
        assert client.put_many(more_keys, more) == [Status.OK] * 10


def test_node_restart_and_client_recovery():
    node = NodeProcess("--capacity", "64MiB").start()
    restarted = None
    try:
        store_blocks(ClientConfig((node.address,)), [b"before-restart!!"], [b"x" * 100])
        with StoreClient(node.address, timeout_s=0.5) as client:
            client.router.health[0].backoff_min = 0.05
            client.router.health[0].backoff_max = 0.05
            assert bytes(client.get_many([b"before-restart!!"])[0]) == b"x" * 100
            node.kill(signal.SIGKILL)
            assert client.get_many([b"before-restart!!"]) == [None]  # down: a miss
            assert client.put_many([b"k" * 16], [b"y"]) == [Status.UNAVAILABLE]
            restarted = NodeProcess("--capacity", "64MiB", port=node.port).start()
            deadline = time.monotonic() + 10
            while client.put_many([b"after-restart!!!"], [b"z" * 10]) != [Status.OK]:
                assert time.monotonic() < deadline, "client never recovered"
                time.sleep(0.1)
            assert bytes(client.get_many([b"after-restart!!!"])[0]) == b"z" * 10
            assert client.get_many([b"before-restart!!"]) == [None]  # memory store: gone
    finally:
        node.stop()
        if restarted is not None:
            restarted.stop()


def test_eviction_under_capacity():
    node = NodeProcess("--capacity", "8MiB").start()
    try:
        keys, data = blocks(32, size=1 << 20)
        with StoreClient(node.address, timeout_s=5) as client:
            for k, d in zip(keys, data):
                assert client.put_many([k], [d]) == [Status.OK]
            stats = client.stats()[0]
            assert stats["evictions"] >= 24 and stats["used_bytes"] <= stats["capacity"] == 8 << 20
            got = client.get_many(keys)
            present = [i for i, g in enumerate(got) if g is not None]
            assert present and present == list(range(32 - len(present), 32))  # the newest stay
            assert all(bytes(got[i]) == data[i] for i in present)
    finally:
        node.stop()


def test_corrupted_block_is_a_miss_never_data():
    node = NodeProcess("--capacity", "8MiB", "--no-verify-puts").start()
    try:
        import msgpack
        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(node.address)
        block = os.urandom(4096)
        head = {"v": 2, "id": 1, "op": "PUT", "keys": [b"corrupt-block-01"], "counts": [1],
                "sizes": [4096], "sums": [12345]}  # fmt: skip
        sock.send_multipart([msgpack.packb(head, use_bin_type=True), block])
        assert sock.poll(5000)
        sock.recv_multipart()
        sock.close()
        with StoreClient(node.address, timeout_s=5) as client:
            assert client.get_many([b"corrupt-block-01"]) == [None]
            into = bytearray(4096)
            assert client.get_many([b"corrupt-block-01"], into=[into]) == [False]
            assert client.counters["checksum_mismatch"] == 2
    finally:
        node.stop()


def test_cli_cluster_and_stats():
    # free ports (--base-port 0), read from the cluster's announcement once its nodes are ready
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagekv.store.cli", "cluster", "--nodes", "2", "--base-port",
         "0", "--capacity", "32MiB"], stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        eps = _announced(proc, 2)
        with StoreClient(eps, timeout_s=10) as client:
            assert client.ping() == [True, True]
            client.put_many([b"cli-key-00000001"], [b"v" * 10])
        cmd = [sys.executable, "-m", "pagekv.store.cli", "stats", *eps, "tcp://127.0.0.1:1"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert out.returncode == 1  # one address unreachable
        lines = out.stdout.strip().splitlines()
        assert lines[0].split()[:3] == ["node", "blocks", "bytes"]
        assert "unreachable" in lines[3]
        assert sum(int(line.split()[1]) for line in lines[1:3]) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        proc.stderr.close()


def _announced(proc: subprocess.Popen, nodes: int) -> list[str]:
    """The node addresses of `pagekv cluster`'s "ready" line (its stderr), within 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"cluster exited before it was ready (code {proc.poll()})")
        found = re.search(rf"pagekv cluster ready: {nodes} nodes: (.+)$", line)
        if found:
            return found.group(1).split()
    raise AssertionError("no 'pagekv cluster ready' line in 30 s")


def test_a_node_that_never_reports_ready_is_killed_not_waited_for(tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)  # the node blocks opening its config: it never gets to report ready
    node = NodeProcess("--config", str(fifo))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not report ready in 2 s") as excinfo:
        node.start(timeout=2)
    assert time.monotonic() - start < 15
    assert node.proc.poll() == -signal.SIGABRT
    assert "Current thread" in str(excinfo.value) and "settings.py" in str(excinfo.value)


def test_a_node_that_exits_before_ready_says_so_with_its_log():
    node = NodeProcess("--capacity", "not-a-size")
    with pytest.raises(
        RuntimeError, match=r"(?s)node exited \(status [1-9]\d*\).*--capacity: not a size"
    ):
        node.start()


STACKS_CHILD = """
import os, signal, subprocess, sys, threading
from pagekv.store.cli.stacks import dump_stacks_on

dumps = []
dump_stacks_on(signal.SIGUSR1, dumps.append)
stop = threading.Event()

def nested(depth):
    return nested(depth - 1) if depth else sum(range(50))

def churn():  # threads starting and ending: what faulthandler's dump crashed on
    while not stop.is_set():
        threads = [threading.Thread(target=nested, args=(20,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

for _ in range(4):
    threading.Thread(target=churn, name="churn", daemon=True).start()
KILL = ("import os, signal, sys; pid, n = map(int, sys.argv[1:]); "
        "[os.kill(pid, signal.SIGUSR1) for _ in range(n)]")
killer = subprocess.run([sys.executable, "-c", KILL, str(os.getpid()), sys.argv[1]])
stop.set()
assert killer.returncode == 0
try:
    dump_stacks_on(signal.SIGUSR2)
except RuntimeError as e:
    print("refused:", e)
print("dumps", len(dumps))
print(dumps[-1] if dumps else "")
"""


def test_stack_dumps_under_signals_while_threads_start_and_end_never_crash_the_process():
    """Thousands of SIGUSR1 while threads start and end (faulthandler.register's dump died of
    SIGSEGV there: CPython gh-116008): the process lives, dumps, and each dump names every
    thread with its stack. A second dumper is refused (the process's one wakeup fd)."""
    out = subprocess.run([sys.executable, "-c", STACKS_CHILD, "20000"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    dumps = int(re.search(r"^dumps (\d+)$", out.stdout, re.M).group(1))
    assert dumps >= 1
    assert "refused: this process already has a wakeup fd" in out.stdout
    last = out.stdout.split("\n", 2)[2]
    assert "(MainThread, most recent call first):" in last
    assert "(churn, most recent call first):" in last and "in churn" in last


def test_sigusr1_writes_every_threads_stack_and_the_node_serves_on():
    node = NodeProcess("--capacity", "16MiB").start()
    try:
        assert "most recent call first" not in "".join(node.log)
        node.proc.send_signal(signal.SIGUSR1)
        # the whole log: it keeps its last lines only, so a count taken before is no index into
        # it; the node may not have entered serve_forever yet (its ready line comes just before)
        try:
            wait_until(lambda: "run_serve" in "".join(node.log), 30, "the stacks in the log")
        except AssertionError:
            state = "running" if node.proc.poll() is None else f"exited {node.proc.returncode}"
            log = "".join(node.log)
            raise AssertionError(f"no stacks in the node's log ({state}):\n{log}") from None
        assert "most recent call first" in "".join(node.log)
        with StoreClient(node.address, timeout_s=5) as client:
            assert client.put_many([b"after-the-dump!!"], [b"v"]) == [Status.OK]
        assert node.proc.poll() is None
    finally:
        node.stop()
