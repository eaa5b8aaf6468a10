"""``pagekv cluster``: N local ``pagekv serve`` processes under one supervisor.

- Nodes get the same settings as ``serve`` (flags, ``PAGEKV_*``, ``--config``; CURVE included)
  on ports ``--base-port + i`` (``--base-port 0``: free ports, kept across restarts).
- The cluster is announced once every node has reported ready; each node's log lines are
  forwarded to stderr prefixed with ``[node<i>]``.
- A node that dies is reported and restarted on its port (back-off 0.5 s doubling to 10 s), up
  to ``--max-restarts`` times in a row (a node that ran a minute starts a fresh count); after
  that it is reported as given up while the others keep serving. Exit 1 only when none is left.
- With ``--disk DIR`` node i keeps its disk tier in ``DIR/node<i>`` (a directory per node).
- With ``--events-endpoint`` (and ``--events-replay-endpoint``) node i publishes on its own:
  ``tcp://host:P`` -> port ``P + i``, ``ipc://PATH`` -> ``ipc://PATH-node<i>``.
- SIGINT/SIGTERM: every node is stopped (SIGTERM, then SIGKILL after 10 s, plus
  ``--shutdown-save-s`` for nodes with a disk tier to save their memory) and the exit code
  is 0. Nodes run in their own session (a terminal's Ctrl-C reaches only the supervisor) and
  die with it (``--parent-pid``), so a SIGKILLed supervisor leaves no node behind.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from pagekv.errors import ConfigError

from .lifecycle import announce
from .serve import check_node, node_config, serve_extras
from .settings import Setting, node_settings

__all__ = ["Supervisor", "cluster_settings"]

log = logging.getLogger("pagekv.store.cluster")
READY = re.compile(r"pagekv node ready (\S+)(?: metrics (\S+))?")
_START_TIMEOUT_S, _STOP_TIMEOUT_S, _STABLE_S = 30.0, 10.0, 60.0
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.5, 10.0


def cluster_settings() -> list[Setting]:
    nodes = [s for s in node_settings(exclude=("port", "endpoint"))]
    per_node = {"capacity": 1 << 30, "disk_capacity": 0}
    nodes = [Setting(s.name, per_node[s.name], s.help + " (per node)", s.kind)
             if s.name in per_node else s for s in nodes]  # fmt: skip
    nodes = [Setting(s.name, s.default, s.help + "; node i uses DIR/node<i>", s.kind)
             if s.name == "disk" else s for s in nodes]  # fmt: skip
    nodes = [Setting(s.name, s.default, s.help + "; node i: port + i, or ipc://PATH-node<i>",
                     s.kind) if s.name.startswith("events_") and s.name.endswith("endpoint")
             else s for s in nodes]  # fmt: skip
    extras = [
        Setting("nodes", 3, "number of nodes (>= 1)", "int"),
        Setting("base_port", 7400, "node i listens on base-port + i (0: free ports)", "int"),
        Setting(
            "max_restarts",
            5,
            "restarts of a dead node in a row before it is left down (0: never restart)",
            "int",
        ),
    ]
    serve = [Setting(s.name, s.default, s.help.replace("this port", "base port + i"), s.kind)
             for s in serve_extras()]  # fmt: skip
    return [*extras, *nodes, *serve]


def node_endpoint(endpoint: str, index: int) -> str:
    """Node ``index``'s own endpoint of a cluster-wide one: ``tcp://host:P`` -> port ``P + i``
    (port 0 stays: any free port), ``ipc://PATH`` -> ``ipc://PATH-node<i>``."""
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-node{index}"
    host, _, port = endpoint.rpartition(":")
    return endpoint if port == "0" else f"{host}:{int(port) + index}"


class _Node:
    def __init__(self, index: int, port: int) -> None:
        self.index, self.port = index, port
        self.proc: subprocess.Popen | None = None
        self.address = self.metrics = ""
        self.metrics_port: int | None = None  # fixed once the node has reported it
        self.ready = False
        self.restarts = 0
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.given_up = False
        self.tail: collections.deque[str] = collections.deque(maxlen=5)

    @property
    def name(self) -> str:
        return f"node {self.index}"


class Supervisor:
    """Starts, watches and stops the nodes; :meth:`run` returns the process exit code."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        if values["nodes"] < 1:
            raise ConfigError(f"--nodes must be >= 1, got {values['nodes']}")
        base = values["base_port"]
        if base != 0 and not 0 < base <= 65536 - values["nodes"]:
            raise ConfigError(f"--base-port {base} + {values['nodes']} nodes leaves 1..65535")
        mport = values["metrics_port"]
        if mport is not None and mport != 0 and not 0 < mport <= 65536 - values["nodes"]:
            raise ConfigError(f"--metrics-port {mport} + {values['nodes']} nodes leaves 1..65535")
        if values["max_restarts"] < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {values['max_restarts']}")
        config = node_config({**values, "port": base})
        check_node(config, force=values["force"], copies=values["nodes"])  # the nodes warn
        self.nodes = [_Node(i, base + i if base else 0) for i in range(values["nodes"])]
        self.events: queue.Queue[tuple[_Node, subprocess.Popen, str]] = queue.Queue()
        self.stopping = False

    # ---- child processes -------------------------------------------------------------------
    def _command(self, node: _Node) -> list[str]:
        cmd = [sys.executable, "-m", "pagekv", "serve", "--port", str(node.port),
               "--parent-pid", str(os.getpid())]  # fmt: skip
        skip = {"nodes", "base_port", "max_restarts", "metrics_port"}
        for key, value in self.values.items():
            if key in skip or value is None:
                continue
            flag = "--" + key.replace("_", "-")
            if key == "disk":
                value = os.path.join(value, f"node{node.index}")
            if key in ("events_endpoint", "events_replay_endpoint"):
                value = node_endpoint(value, node.index)
            if isinstance(value, bool):
                cmd.append(flag if value else "--no-" + flag[2:])
            else:
                cmd += [flag, str(value)]
        mport = self.values["metrics_port"]
        if mport is not None:
            port = (
                node.metrics_port if node.metrics_port is not None else mport and mport + node.index
            )
            cmd += ["--metrics-port", str(port)]
        return cmd

    def _environment(self) -> dict[str, str]:
        """Ours, minus the settings (the command line carries every one)."""
        names = {s.env_var for s in cluster_settings()} | {"PAGEKV_CONFIG", "PAGEKV_PORT",
                                                            "PAGEKV_ENDPOINT"}  # fmt: skip
        return {k: v for k, v in os.environ.items() if k not in names}

    def _start(self, node: _Node) -> None:
        node.proc = subprocess.Popen(
            self._command(node), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=self._environment(), start_new_session=True,
        )  # fmt: skip
        node.ready, node.started_at, node.restart_at = False, time.monotonic(), None
        threading.Thread(target=self._forward, args=(node, node.proc), daemon=True).start()

    def _forward(self, node: _Node, proc: subprocess.Popen) -> None:
        """Copy a node's log to our stderr; report its ready line. Keeps reading even when our
        stderr is gone, so a node never blocks on a full pipe."""
        forwarding = True
        for line in proc.stderr:
            node.tail.append(line.rstrip())
            if forwarding:
                try:
                    sys.stderr.write(f"[node{node.index}] {line}")
                except (OSError, ValueError):  # our stderr is closed or broken: stop copying
                    forwarding = False
            match = READY.search(line)
            if match:
                self.events.put((node, proc, line))
        proc.stderr.close()

    def _on_ready(self, node: _Node, proc: subprocess.Popen, line: str) -> None:
        if proc is not node.proc:
            return  # a line from a process that has since been replaced
        match = READY.search(line)
        node.address, node.metrics = match.group(1), match.group(2) or ""
        node.port = int(node.address.rsplit(":", 1)[1])
        if node.metrics:
            node.metrics_port = int(node.metrics.rsplit(":", 1)[1])
        node.ready = True
        extra = f" metrics {node.metrics}" if node.metrics else ""
        announce(f"pagekv cluster {node.name} ready {node.address} pid {proc.pid}{extra}")

    def _exit_text(self, code: int) -> str:
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def _on_death(self, node: _Node, code: int) -> None:
        last = f"; last log line: {node.tail[-1]}" if node.tail else ""
        log.error("pagekv cluster: %s (%s, pid %d) %s%s", node.name, node.address or "starting",
                  node.proc.pid, self._exit_text(code), last)  # fmt: skip
        if time.monotonic() - node.started_at > _STABLE_S:
            node.restarts = 0
        if node.restarts >= self.values["max_restarts"]:
            node.given_up = True
            left = sum(not n.given_up for n in self.nodes)
            log.error("pagekv cluster: %s left down after %d restart(s) (--max-restarts %d); "
                      "%d of %d nodes serving", node.name, node.restarts,
                      self.values["max_restarts"], left, len(self.nodes))  # fmt: skip
            return
        delay = min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * 2**node.restarts)
        node.restarts += 1
        node.restart_at = time.monotonic() + delay
        log.warning("pagekv cluster: restarting %s on port %d in %.1f s (restart %d of %d)",
                    node.name, node.port, delay, node.restarts,
                    self.values["max_restarts"])  # fmt: skip

    # ---- supervision -----------------------------------------------------------------------
    def _stop_handler(self, *_: object) -> None:
        self.stopping = True

    def _drain_events(self, timeout: float) -> None:
        try:
            self._on_ready(*self.events.get(timeout=timeout))
            while True:
                self._on_ready(*self.events.get_nowait())
        except queue.Empty:
            pass

    def _startup(self) -> bool:
        """Start every node and wait until all are ready; False if one fails or we are told
        to stop."""
        for node in self.nodes:
            self._start(node)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(n.ready for n in self.nodes):
            if self.stopping:
                return False
            self._drain_events(0.1)
            for node in self.nodes:
                code = node.proc.poll()
                if code is not None and not node.ready:
                    last = node.tail[-1] if node.tail else "no output"
                    log.error("pagekv cluster: %s failed to start (%s): %s", node.name,
                              self._exit_text(code), last)  # fmt: skip
                    return False
            if time.monotonic() > deadline:
                log.error("pagekv cluster: nodes not ready after %.0f s", _START_TIMEOUT_S)
                return False
        return True

    def _watch(self) -> int:
        while not self.stopping:
            self._drain_events(0.2)
            now = time.monotonic()
            for node in self.nodes:
                if node.given_up:
                    continue
                if node.restart_at is not None:
                    if now >= node.restart_at:
                        self._start(node)
                    continue
                code = node.proc.poll()
                if code is not None:
                    self._on_death(node, code)
            if all(n.given_up for n in self.nodes):
                log.error("pagekv cluster: every node is down; exiting")
                return 1
        return 0

    def _shutdown(self) -> None:
        live = [n.proc for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        save = self.values["shutdown_save_s"] if self.values["disk"] is not None else 0.0
        deadline = time.monotonic() + _STOP_TIMEOUT_S + save
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pagekv cluster: pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop_handler)
        try:
            if not self._startup():
                return 0 if self.stopping else 1
            addresses = " ".join(n.address for n in self.nodes)
            announce(f"pagekv cluster ready: {len(self.nodes)} nodes: {addresses}")
            return self._watch()
        finally:
            self._shutdown()
            if self.stopping:
                log.info("pagekv cluster: stopped")
