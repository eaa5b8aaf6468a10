"""Child processes that never outlive their parent: a node started by ``pagekv cluster``, the
demo, a benchmark or a test exits when that parent dies, even by SIGKILL.

The child asks the kernel (Linux ``prctl(PR_SET_PDEATHSIG)``) for a signal when its parent
dies, then checks that the parent it was started by is still its parent (it may have died
before the request). Elsewhere the request is a no-op and says so.

A child's lines its parent parses (``pagekv node ready ...``, ``pagekv cluster ready: ...``) go
out with :func:`announce`: each in one write.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

__all__ = ["announce", "die_with_parent"]

log = logging.getLogger("pagekv.store.cli.lifecycle")
_PR_SET_PDEATHSIG = 1


def announce(line: str) -> None:
    """``line`` on stderr in one write, newline included: other threads write there too (log
    lines, a supervisor's forwarded node logs), and ``print`` writes a line and its newline
    apart, between which one of theirs can land (a node's log line once did, inside the ready
    line a script parses)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _prctl_set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have this process get ``sig`` when ``parent_pid`` (its parent) dies. Exits at once
    (status 1) when that parent is already gone. Returns whether the kernel took the request."""
    armed = _prctl_set_pdeathsig(sig)
    if os.getppid() != parent_pid:  # the parent died before (or is not who was named)
        log.error("pagekv: parent process %d is gone; exiting", parent_pid)
        raise SystemExit(1)
    if not armed:
        log.warning("pagekv: cannot follow parent %d on this platform", parent_pid)
    return armed
