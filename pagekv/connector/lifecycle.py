"""How a connector ends: drain the write-back within a bound, stop the loop, wait for the GPU
streams, then unregister the pinned pool. And what happens when a process exits without
``close()``: pending write-backs are flushed for at most ``PAGEKV_EXIT_FLUSH_S`` seconds
(default 10) at exit, and whatever could not be written is logged with its count."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

from pagekv import env
from pagekv.errors import WriteBackFailed

__all__ = ["close_connector", "register_exit_flush"]

log = logging.getLogger("pagekv.connector")
_live: weakref.WeakSet = weakref.WeakSet()
_registered = False


def close_connector(conn: Any, timeout_s: float) -> None:
    """Ordered shutdown of a :class:`KVConnector` (see module docstring). Never raises on store
    trouble: a write-back that cannot finish in ``timeout_s`` is dropped and logged."""
    loop, writeback = conn._loop, conn.writeback
    try:
        loop.call(writeback.drain(), timeout_s)
    except TimeoutError:
        dropped = loop.call(_drop_all(writeback), 5.0)
        log.warning("pagekv: close: write-back not done in %.1f s; %d pages dropped "
                    "(they were not written to the store)", timeout_s, dropped)  # fmt: skip
    except WriteBackFailed as e:
        log.warning("pagekv: close: %s", e)
    try:
        loop.call(conn.fetcher.cancel(), 5.0)
    except TimeoutError:
        log.warning("pagekv: close: fetches did not stop within 5 s")
    conn.index.close()
    loop.close()
    if conn._issuer is not None:
        conn._issuer.close()  # what it was given is enqueued and done
    for stream in (conn._save_stream, conn._load_stream):
        if stream is not None:
            stream.synchronize()  # no copy may touch the pool once it is unregistered
    conn.pool.close()


async def _drop_all(writeback: Any) -> int:
    return writeback.drop_all()


def register_exit_flush(conn: Any) -> None:
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
