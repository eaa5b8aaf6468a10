"""Running the installed ``pagekv`` console script (the virtualenv's bin/pagekv) in tests."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PAGEKV = Path(sys.executable).with_name("pagekv")
READY = re.compile(r"pagekv node ready (tcp://\S+)(?: metrics (\S+))?")


def run_cli(*args, env=None, timeout=30):
    """``pagekv ARGS`` to completion; ``env`` is added to (not replacing) this environment."""
    assert PAGEKV.exists(), f"{PAGEKV} missing: `pip install -e .` installs the console script"
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([str(PAGEKV), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)  # fmt: skip


def wait_for(predicate, timeout, what):
    """Poll ``predicate`` until true; fail naming ``what`` (or what ``what()`` says then) after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.02)


class Proc:
    """A long-running ``pagekv`` command whose stderr is collected line by line."""

    def __init__(self, *args, env=None):
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen([str(PAGEKV), *map(str, args)], stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, env=full_env,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern, timeout=20.0, start=0):
        """The first match of ``pattern`` in a line from index ``start`` on."""
        rx = re.compile(pattern)
        found = []

        def seen():
            found[:] = [m for line in self.lines[start:] if (m := rx.search(line))]
            return bool(found) or self.proc.poll() is not None

        wait_for(seen, timeout, f"{pattern!r} in the log")
        assert found, f"exited {self.proc.returncode} before {pattern!r}:\n{self.log}"
        return found[0]

    def send(self, sig):
        self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code


class Node(Proc):
    """``pagekv serve --port 0 ARGS`` once it has reported ready."""

    def __init__(self, *args, env=None):
        super().__init__("serve", "--port", "0", *args, env=env)
        match = self.wait_line(READY.pattern)
        self.address, self.metrics_url = match.group(1), match.group(2)


def pid_alive(pid):
    """True while ``pid`` is a process that is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def port_free(port):
    """Whether a listening socket could bind 127.0.0.1:``port`` now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
