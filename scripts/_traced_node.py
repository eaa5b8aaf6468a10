"""A store node in a child process that records a timeline, for the diag scripts.

The script that uses it runs itself with ``--serve <pagekv serve args>`` as the child: there it
patches what it traces, appending rows to a list, and calls :func:`serve_with_timeline`, which
writes the rows to ``$PAGEKV_DIAG_TIMELINE`` when the node exits. The parent starts the child
with :class:`TracedNode` and reads the rows back with :meth:`TracedNode.timeline`.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading


def serve_with_timeline(argv: list[str], rows: list) -> int:
    """``pagekv serve argv``, ``rows`` written as JSON to ``$PAGEKV_DIAG_TIMELINE`` at exit."""
    from pagekv.store import cli

    def dump() -> None:
        with open(os.environ["PAGEKV_DIAG_TIMELINE"], "w") as f:
            json.dump(rows, f)

    atexit.register(dump)
    return cli.main(["serve", *argv])


class TracedNode:
    """``script --serve --port 0 *args`` as a child process (``env`` added to this one's), its
    address read from the node's ready line."""

    def __init__(self, script: str, *args: str, env: dict[str, str] | None = None) -> None:
        from pagekv.store.launch import READY

        self.path = tempfile.mktemp(suffix=".json")
        env = {**os.environ, **(env or {}), "PAGEKV_DIAG_TIMELINE": self.path}
        cmd = [sys.executable, os.path.abspath(script), "--serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        for line in self.proc.stderr:
            if match := READY.search(line):
                self.address = match.group(1)
                break
        else:
            raise RuntimeError(f"the traced node of {script} did not start")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def timeline(self) -> list:
        """Stop the node and return the rows it recorded."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        with open(self.path) as f:
            return json.load(f)
