"""Start real `pagekv serve` processes (free loopback ports by default) from Python: for the
demo, benchmarks and integration tests. Each node reports its bound address on stderr, and
(started from the main thread) exits when this process dies, even by SIGKILL."""

from __future__ import annotations

__all__ = ["NodeProcess", "start_nodes", "stop_process"]

import collections
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"pagekv node ready (tcp://\S+)")


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """Stop process ``pid`` (SIGSTOP) and return once every one of its threads is stopped
    (Linux ``/proc``): a signal is delivered asynchronously, and a thread already at work
    could otherwise still answer after ``kill`` returned. ``TimeoutError`` past ``timeout``."""

    def all_stopped() -> bool:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended meanwhile
        return bool(states) and all(state in "Tt" for state in states)

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all_stopped():
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid}: not every thread stopped within {timeout} s")
        time.sleep(0.005)


class NodeProcess:
    """One ``pagekv serve`` child. ``nofile`` caps its descriptors (soft and hard limit);
    ``cpus``: the CPUs its threads run on (benchmarks: the sending side's cores)."""

    def __init__(self, *args: str, port: int = 0, nofile: int | None = None,
                 cpus: frozenset[int] | None = None) -> None:  # fmt: skip
        self.args = list(args)
        self.port = port
        self.nofile = nofile
        self.cpus = cpus
        self.address = ""
        self.proc: subprocess.Popen | None = None
        self.log: collections.deque[str] = collections.deque(maxlen=200)

    def start(self, timeout: float = 20.0, warm: bool = False) -> NodeProcess:
        """Start the node and wait until it reports ready; with ``warm``, also until it has
        warmed its heap for blocks (a node as it is once it has served a while: benchmarks)."""
        cmd = [
            sys.executable,
            "-X",
            "faulthandler",  # SIGABRT (see below) prints where each of its threads is
            "-m",
            "pagekv.store.cli",
            "serve",
            "--port",
            str(self.port),
            *self.args,
        ]
        if threading.current_thread() is threading.main_thread():  # it outlives the node
            cmd += ["--parent-pid", str(os.getpid())]  # the node dies with this process
        limit, cpus = self.nofile, self.cpus

        def before_exec() -> None:  # runs in the child, before exec
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            if cpus:
                os.sched_setaffinity(0, cpus)

        preexec = before_exec if limit is not None or cpus else None
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
        self._ready = threading.Event()
        drain = threading.Thread(target=self._drain, daemon=True)
        drain.start()
        # wait on the reader's event, never on the pipe: a node that hangs before it reports
        # ready (or writes a partial line) must not block the caller past ``timeout``
        if self._ready.wait(timeout) and self.address:
            if warm:
                self.warmed()
            return self
        why = "exited" if self._ready.is_set() else f"did not report ready in {timeout:g} s"
        if self.proc.poll() is None:  # hung: its faulthandler writes every thread's stack
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        drain.join(timeout=5)  # the rest of its log, the stacks included
        raise RuntimeError(f"node {why} (status {code}); its log:\n" + "".join(self.log))

    def _drain(self) -> None:
        """Read the node's log to its end (a full pipe never blocks the node), keeping the last
        lines; set ``_ready`` at the ready line with ``address`` and ``port`` set, or at EOF."""
        for line in self.proc.stderr:
            self.log.append(line)
            match = None if self._ready.is_set() else READY.search(line)
            if match:
                self.address = match.group(1)
                self.port = int(self.address.rsplit(":", 1)[1])
                self._ready.set()
        self._ready.set()  # EOF: the node exited (``address`` stays empty if it never was ready)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> int:
        """Send ``sig`` and wait up to ``timeout`` s for the node to exit; its exit status."""
        if self.proc is None:
            raise RuntimeError("node not started")
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)

    def warmed(self, timeout: float = 60.0) -> int:
        """Wait until the node has warmed its heap for blocks (``pagekv.store.node.memory``:
        started once it serves); the resident memory that added (0: it warms nothing). Asks the
        node's STATS as a client without CURVE keys: not for a node with CURVE on."""
        import time

        from .client.blocking import StoreClient

        deadline = time.monotonic() + timeout
        with StoreClient(self.address, timeout_s=min(5.0, timeout)) as client:
            while (stats := client.stats()[0]) is None or stats["heap_warming"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {self.address} still warming after {timeout:g} s")
                time.sleep(0.01)
        return stats["heap_warmed_bytes"]

    def rss_bytes(self) -> int:
        from .node.memory import rss_bytes

        if self.proc is None:
            raise RuntimeError("node not started")
        return rss_bytes(self.proc.pid)

    def cpu_seconds(self) -> float:
        """User + system CPU time the node has used so far (all its threads)."""
        if self.proc is None:
            raise RuntimeError("node not started")
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_nodes(n: int, *args: str, warm: bool = False) -> list[NodeProcess]:
    """Start ``n`` nodes of the same ``args`` (:meth:`NodeProcess.start`)."""
    nodes = []
    try:
        for _ in range(n):
            nodes.append(NodeProcess(*args).start(warm=warm))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes
