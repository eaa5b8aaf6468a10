"""`pagekv cluster` lifecycles: announced once ready, exit 0 on SIGINT/SIGTERM (also during
start-up), a dead node restarted (or left down) while the others keep serving, and no node left
behind when the supervisor is SIGKILLed. Nodes started by pagekv.store.launch die with their
parent too. Installed `pagekv` script, loopback, free ports (--base-port 0)."""

import os
import re
import signal
import subprocess
import sys

import pytest

from pagekv.store import Status, StoreClient
from tests.cli_helpers import Proc, pid_alive, port_free, run_cli, wait_for

pytestmark = pytest.mark.slow
NODE_READY = r"pagekv cluster node (\d+) ready tcp://127\.0\.0\.1:(\d+) pid (\d+)"


def start_cluster(nodes=2, *args):
    cluster = Proc("cluster", "--nodes", nodes, "--base-port", "0", "--capacity", "8MiB", *args)
    ready = cluster.wait_line(rf"pagekv cluster ready: {nodes} nodes: (.+)$")
    found = [re.search(NODE_READY, line) for line in cluster.lines]
    nodes_seen = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in found if m}
    ports, pids = zip(*(nodes_seen[i] for i in range(nodes)))
    assert ready.group(1).split() == [f"tcp://127.0.0.1:{p}" for p in ports]
    return cluster, list(ports), list(pids)


def test_announced_once_ready_and_sigint_exits_0_stopping_every_node():
    cluster, ports, pids = start_cluster(3)
    eps = [f"tcp://127.0.0.1:{p}" for p in ports]
    try:
        out = run_cli("ping", "--count", "1", *eps)  # the announcement came after readiness
        assert out.returncode == 0 and out.stdout.count(" ok ") == 3, out.stdout
        assert sum("pagekv cluster ready" in line for line in cluster.lines) == 1
    finally:
        assert cluster.stop(signal.SIGINT) == 0
    assert not any(map(pid_alive, pids)) and all(map(port_free, ports))
    assert "Traceback" not in cluster.log


def test_sigint_during_startup_exits_0():
    for _ in range(2):
        cluster = Proc("cluster", "--nodes", "2", "--base-port", "0", "--capacity", "8MiB")
        cluster.wait_line(r"\[node0\] ")  # handlers are in place before the first node starts
        assert cluster.stop(signal.SIGINT) == 0, cluster.log
        pids = [int(m.group(1)) for m in re.finditer(r"pid (\d+)", cluster.log)]
        assert not any(map(pid_alive, pids))


def test_dead_node_is_restarted_while_the_others_serve():
    cluster, ports, pids = start_cluster(2, "--max-restarts", "2")
    eps = [f"tcp://127.0.0.1:{p}" for p in ports]
    key, block = os.urandom(16), os.urandom(4096)
    try:
        with StoreClient(eps[0], timeout_s=5) as first:
            assert first.put_many([key], [block]) == [Status.OK]
            mark = len(cluster.lines)
            os.kill(pids[1], signal.SIGKILL)
            cluster.wait_line(rf"node 1 \(tcp://127\.0\.0\.1:{ports[1]}, pid {pids[1]}\) was "
                              "killed by SIGKILL", start=mark)  # fmt: skip
            assert first.ping() == [True]  # the healthy node never stopped
            again = cluster.wait_line(NODE_READY.replace(r"(\d+)", "1", 1), start=mark)
            assert int(again.group(1)) == ports[1] and int(again.group(2)) != pids[1]
            assert bytes(first.get_many([key])[0]) == block
        assert run_cli("ping", "--count", "1", *eps).returncode == 0
        assert cluster.proc.poll() is None
    finally:
        assert cluster.stop(signal.SIGTERM) == 0


def test_node_past_max_restarts_is_left_down_and_the_cluster_goes_on():
    cluster, ports, pids = start_cluster(2, "--max-restarts", "0")
    try:
        os.kill(pids[1], signal.SIGKILL)
        cluster.wait_line(r"node 1 left down after 0 restart\(s\) .* 1 of 2 nodes serving")
        out = run_cli("ping", "--count", "1", f"tcp://127.0.0.1:{ports[0]}")
        assert out.returncode == 0 and cluster.proc.poll() is None
    finally:
        assert cluster.stop(signal.SIGINT) == 0
    assert not pid_alive(pids[0])


def test_sigkilled_cluster_leaves_no_node_behind():
    cluster, ports, pids = start_cluster(2)
    assert all(map(pid_alive, pids)) and not any(map(port_free, ports))
    cluster.proc.kill()
    cluster.proc.wait(timeout=10)
    wait_for(lambda: not any(map(pid_alive, pids)), 10, f"nodes {pids} to exit")
    wait_for(lambda: all(map(port_free, ports)), 10, f"ports {ports} to be free")


_LAUNCHER = r"""
import sys
from pagekv.store.launch import start_nodes
nodes = start_nodes(2, "--capacity", "8MiB")
print(" ".join(f"{n.proc.pid}:{n.port}" for n in nodes), flush=True)
sys.stdin.read()  # until killed
"""


def test_nodes_started_by_launch_die_with_their_parent():
    parent = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        pairs = [p.split(":") for p in parent.stdout.readline().split()]
        pids, ports = [int(a) for a, _ in pairs], [int(b) for _, b in pairs]
        assert len(pids) == 2 and all(map(pid_alive, pids))
    finally:
        parent.kill()
        parent.wait(timeout=10)
    wait_for(lambda: not any(map(pid_alive, pids)), 10, f"nodes {pids} to exit")
    wait_for(lambda: all(map(port_free, ports)), 10, f"ports {ports} to be free")


def test_announcements_are_written_one_line_per_write(monkeypatch):
    """The supervisor's lines share stderr with the threads forwarding its nodes' logs: each
    goes out in one write, newline included, so no forwarded line can land inside one (a node's
    log line once did, inside the ready line scripts parse)."""
    from pagekv.store.cli import lifecycle

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    lifecycle.announce("pagekv cluster ready: 2 nodes: tcp://127.0.0.1:1 tcp://127.0.0.1:2")
    assert writes == ["pagekv cluster ready: 2 nodes: tcp://127.0.0.1:1 tcp://127.0.0.1:2\n"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: any set is all of them")
def test_a_node_started_on_given_cpus_runs_every_thread_there():
    """``NodeProcess(cpus=)`` (benchmarks pin senders and receivers apart): the node's threads,
    its I/O threads and those it starts once it serves included, run on those CPUs only."""
    from pagekv.store.launch import NodeProcess

    cpu = max(os.sched_getaffinity(0))
    node = NodeProcess("--capacity", "8MiB", cpus=frozenset({cpu})).start(warm=True)
    try:
        with StoreClient(node.address, timeout_s=5) as client:
            key, value = os.urandom(16), os.urandom(4 << 20)
            assert client.put_many([key], [value]) == [Status.OK]
            assert bytes(client.get_many([key])[0]) == value
        seen = 0
        for tid in os.listdir(f"/proc/{node.proc.pid}/task"):
            try:
                allowed = os.sched_getaffinity(int(tid))
            except ProcessLookupError:  # a thread that ended since the listing
                continue
            assert allowed == {cpu}, tid
            seen += 1
        assert seen > 2
    finally:
        node.stop()
