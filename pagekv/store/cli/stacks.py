"""``kill -USR1 <pid>``: a running node writes every thread's stack to its log (where is it
stuck?), and serves on.

Rules:

* The signal's handler does nothing but what Python's C-level handler does for any handled
  signal: write the signal's number to the process's wakeup fd (``signal.set_wakeup_fd``),
  from whichever thread the kernel interrupted. A daemon thread of :func:`dump_stacks_on`'s
  own reads that fd and writes the dump, so the dump needs neither the main thread (it may be
  the stuck one) nor anything run inside a signal handler.
* The dump is made holding the GIL, from ``sys._current_frames()`` (each frame referenced while
  it is read), and written in one write. ``faulthandler.register`` walks other threads' frames
  from inside the signal handler without the GIL and can crash the process when a thread ends
  during the walk (CPython gh-116008: four of four runs of threads starting and ending under
  repeated signals died of SIGSEGV on Python 3.11; a node once did at start-up, where its
  heap-warming thread ends).
* The wakeup fd is the process's one: :func:`dump_stacks_on` is for a process that sets no
  other (a node: no asyncio loop on its main thread), and refuses where one is set. Other
  handled signals' numbers pass through it too; the thread skips them.
* A thread inside a C call shows the Python frame that made the call; a thread holding the GIL
  forever leaves none to dump with.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable

__all__ = ["dump_stacks_on", "format_stacks"]


def format_stacks() -> str:
    """Every thread's Python stack, most recent call first, each under a line naming it."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        lines = traceback.format_stack(frame)
        lines.reverse()
        parts.append(f"Thread 0x{ident:016x} ({names.get(ident, '?')}, most recent call first):\n"
                     + "".join(lines))  # fmt: skip
    return "".join(parts)


def _write_stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def dump_stacks_on(sig: int, write: Callable[[str], object] = _write_stderr) -> threading.Thread:
    """On ``sig`` to this process, ``write(format_stacks())`` (default: stderr, one write) from
    a daemon thread of its own; see the module's rules. Call from the main thread. Raises
    ``RuntimeError`` where the process already has a wakeup fd."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # the C handler must never block; a full buffer drops a byte
    old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if old != -1:
        signal.set_wakeup_fd(old)
        reader.close()
        writer.close()
        raise RuntimeError("this process already has a wakeup fd (signal.set_wakeup_fd)")
    signal.signal(sig, lambda *_: None)  # handled: its number reaches the wakeup fd

    def wait_and_dump() -> None:
        with reader, writer:
            while True:
                if sig in reader.recv(256):  # every signal taken since the last read
                    try:
                        write(format_stacks())
                    except (OSError, ValueError):  # the log is gone: nothing left to tell
                        pass

    thread = threading.Thread(target=wait_and_dump, name=f"pagekv-stacks-{sig}", daemon=True)
    thread.start()
    return thread
