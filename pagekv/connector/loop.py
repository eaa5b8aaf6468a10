"""The connector's event loop thread (:class:`LoopThread`, the store client's: its store I/O
never runs on the engine's thread) and a rate-limited log."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pagekv.store.client.loop import LoopThread

__all__ = ["LoopThread", "RateLimitedLog"]

log = logging.getLogger("pagekv.connector")


class RateLimitedLog:
    """A warning at most every ``interval_s`` seconds; the lines skipped meanwhile are counted
    in the next one."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger, self.interval_s = logger, interval_s
        self._last = -float("inf")
        self._skipped = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._skipped += 1
                return
            skipped, self._skipped, self._last = self._skipped, 0, now
        suffix = f" ({skipped} similar messages suppressed)" if skipped else ""
        self.logger.warning(msg + suffix, *args)
