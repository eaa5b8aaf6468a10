"""Start a Mooncake Store on loopback from Python, for tests and benchmarks: a master (its
built-in HTTP metadata server, no etcd) and store processes that each contribute a segment of
memory (``mooncake_client``), TCP protocol, free ports. The binaries are those of the Mooncake
package this interpreter imports.

    with MooncakeCluster(segment="512MiB") as mc:
        backend = open_backend(mc.address)
        mc.kill_store(0); mc.kill_master()   # failures, for tests
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from pagekv.env import parse_size
from pagekv.store.launch import stop_process

__all__ = ["MooncakeCluster", "binaries_dir"]

MASTER_READY = re.compile(r"HTTP metadata server started successfully")
STORE_READY = re.compile(r"Starting real client service on")


def binaries_dir() -> Path:
    """Where the installed Mooncake package keeps ``mooncake_master`` and ``mooncake_client``.
    ``FileNotFoundError`` when Mooncake is not installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("Mooncake is not installed (pip install 'pagekv[mooncake]')")
    return Path(next(iter(spec.submodule_search_locations)))


def _free_ports(n: int, taken: set[int]) -> list[int]:
    """``n`` free loopback ports, distinct from each other and from ``taken`` (which they then
    join). Each socket stays bound until all are chosen: one closed before the next bind may be
    given again (the kernel once gave a master the same port for its RPC and its HTTP server)."""
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        while len(ports) < n:
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in taken:
                ports.append(port)
                taken.add(port)
    return ports


class _Proc:
    """A child whose log (stderr and stdout) is read to its end by a thread; ``ready`` is set
    at the first line matching ``pattern``, or at EOF."""

    def __init__(self, cmd: list[str], pattern: re.Pattern, env: dict[str, str]) -> None:
        self.cmd, self.pattern = cmd, pattern
        self.log: collections.deque[str] = collections.deque(maxlen=300)
        self.ready = threading.Event()
        self.matched = False
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)  # fmt: skip
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if not self.matched and self.pattern.search(line):
                self.matched = True
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout: float, what: str) -> None:
        if self.ready.wait(timeout) and self.matched:
            return
        self.stop()
        raise RuntimeError(f"{what} did not start ({' '.join(self.cmd)}); its log:\n"
                           + "".join(self.log))  # fmt: skip

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class MooncakeCluster:
    """A master and ``stores`` store processes of ``segment`` bytes each, on loopback.
    ``lease_ms``: the master's ``--default_kv_lease_ttl``: a get whose transfer takes longer
    than this fails (LEASE_EXPIRED, a miss), so it must exceed the time one call of
    ``max_call_bytes`` takes on a loaded machine."""

    def __init__(self, *, stores: int = 1, segment: int | str = "256MiB",
                 lease_ms: int = 5000, timeout_s: float = 2.0) -> None:  # fmt: skip
        self.bin = binaries_dir()
        self.segment = parse_size(segment)
        self.lease_ms, self.timeout_s = lease_ms, timeout_s
        self._ports: set[int] = set()  # every port given to a process of this cluster
        self.rpc_port, self.http_port, self._metrics_port = _free_ports(3, self._ports)
        self.env = dict(os.environ)
        self.env["GLOG_minloglevel"] = "0"  # the ready lines are INFO lines
        self.master: _Proc | None = None
        self.stores: list[_Proc | None] = []
        try:
            self.start_master()
            for _ in range(stores):
                self.stores.append(None)
                self.start_store(len(self.stores) - 1)
        except BaseException:
            self.stop()
            raise

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def address(self) -> str:
        """The ``mooncake://`` address of this store (TCP protocol)."""
        return (f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}"
                f"&hostname=127.0.0.1&timeout_s={self.timeout_s:g}")  # fmt: skip

    def start_master(self, timeout: float = 30.0) -> None:
        cmd = [str(self.bin / "mooncake_master"), "--enable_http_metadata_server=true",
               "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={self.http_port}", "--rpc_address=127.0.0.1",
               f"--rpc_port={self.rpc_port}", f"--metrics_port={self._metrics_port}",
               f"--default_kv_lease_ttl={self.lease_ms}", "--client_ttl=2",
               "--rpc_thread_num=2"]  # fmt: skip
        self.master = _Proc(cmd, MASTER_READY, self.env)
        self.master.wait_ready(timeout, "mooncake_master")
        deadline = time.monotonic() + timeout
        while True:  # the RPC port is bound just before the HTTP server's line: make sure
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), 1.0).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mooncake_master does not accept RPC connections") from None
                time.sleep(0.05)

    def start_store(self, i: int, timeout: float = 30.0) -> None:
        """(Re)start store process ``i``: a ``mooncake_client`` holding a segment."""
        cmd = [str(self.bin / "mooncake_client"), f"--global_segment_size={self.segment}",
               f"--master_server_address=127.0.0.1:{self.rpc_port}",
               f"--metadata_server={self.metadata}", "--host=127.0.0.1",
               f"--port={_free_ports(1, self._ports)[0]}", "--protocol=tcp"]  # fmt: skip
        proc = _Proc(cmd, STORE_READY, self.env)
        self.stores[i] = proc
        try:
            proc.wait_ready(timeout, "mooncake_client")
        except RuntimeError as e:  # what the master said meanwhile tells why, most often
            raise RuntimeError(f"{e}\n{self._master_report()}") from None

    def _master_report(self) -> str:
        master = self.master
        if master is None:
            return "--- mooncake_master: not started"
        code = master.proc.poll()
        state = "running" if code is None else f"exited {code}"
        return f"--- mooncake_master ({state}):\n" + "".join(master.log)

    def kill_master(self, sig: int = signal.SIGKILL) -> None:
        if self.master is not None:
            self.master.stop(sig)

    def pause_master(self) -> None:
        """SIGSTOP, returning once no thread of the master can answer any more."""
        stop_process(self.master.proc.pid)

    def resume_master(self) -> None:
        os.kill(self.master.proc.pid, signal.SIGCONT)

    def kill_store(self, i: int = 0, sig: int = signal.SIGKILL) -> None:
        proc = self.stores[i]
        if proc is not None:
            proc.stop(sig)

    def pause_store(self, i: int = 0) -> None:
        """SIGSTOP, returning once no thread of the store process can move a byte any more."""
        stop_process(self.stores[i].proc.pid)

    def resume_store(self, i: int = 0) -> None:
        os.kill(self.stores[i].proc.pid, signal.SIGCONT)

    def logs(self) -> str:
        parts = [("master", self.master)] + [(f"store{i}", s) for i, s in enumerate(self.stores)]
        return "".join(f"--- {name}\n" + "".join(p.log) for name, p in parts if p is not None)

    def stop(self) -> None:
        for proc in [*self.stores, self.master]:
            if proc is not None:
                if proc.proc.poll() is None:
                    try:
                        os.kill(proc.proc.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                proc.stop()

    def __enter__(self) -> MooncakeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
