"""How a connector's write-back ends. At ``close()`` it is drained within a bound and what is
left is dropped and logged (:meth:`KVConnector.close` then stops the loop, waits for the GPU
streams and unregisters the pinned pool). When a process exits without ``close()``, pending
write-backs are flushed for at most ``PAGEKV_EXIT_FLUSH_S`` seconds (default 10) and whatever
could not be written is logged with its count."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import TYPE_CHECKING, Protocol

from pagekv import env
from pagekv.errors import WriteBackFailed

if TYPE_CHECKING:
    from .loop import LoopThread
    from .writeback import WriteBack

__all__ = ["drain_writeback", "register_exit_flush"]

log = logging.getLogger("pagekv.connector")
_live: weakref.WeakSet[Closable] = weakref.WeakSet()
_registered = False


def drain_writeback(loop: LoopThread, writeback: WriteBack, timeout_s: float) -> None:
    """A closing connector's first step: wait for its write-back at most ``timeout_s``, then
    drop (and log) what is left. Never raises on store trouble."""
    try:
        loop.call(writeback.drain(), timeout_s)
    except TimeoutError:
        dropped = loop.call(_drop_all(writeback), 5.0)
        log.warning("pagekv: close: write-back not done in %.1f s; %d pages dropped "
                    "(they were not written to the store)", timeout_s, dropped)  # fmt: skip
    except WriteBackFailed as e:
        log.warning("pagekv: close: %s", e)


async def _drop_all(writeback: WriteBack) -> int:
    return writeback.drop_all()


class Closable(Protocol):
    """What the exit flush needs of a connector."""

    @property
    def closed(self) -> bool: ...

    @property
    def writeback(self) -> WriteBack: ...

    def close(self, timeout_s: float | None = None) -> None: ...


def register_exit_flush(conn: Closable) -> None:
    """Flush ``conn``'s write-back at interpreter exit if it was never closed."""
    global _registered
    _live.add(conn)
    if not _registered:
        atexit.register(_flush_at_exit)
        _registered = True


def _flush_at_exit() -> None:
    budget = env.EXIT_FLUSH_S.get()
    for conn in list(_live):
        if conn.closed:
            continue
        pending = conn.writeback.stats()["writeback_queue_pages"]
        if pending:
            log.warning("pagekv: exiting without close(): flushing %d pending write-back pages "
                        "(at most %.0f s)", pending, budget)  # fmt: skip
        conn.close(timeout_s=budget)
