"""The reset epoch of a model's key namespace, kept in the store so that a reset survives
restarts and reaches every engine of the namespace.

One record per namespace (:attr:`EngineLayout.marker_key`, the same for every rank) holds the
current epoch, a random token that is part of every page key (:meth:`EngineLayout.namespace`).
Store values are write-once, so the record is changed by DELETE then PUT, and a PUT that finds
the key present (``Status.EXISTS``) adopts the value another engine wrote first.

* start-up: read the record; when absent (a fresh namespace, a store restarted empty, the
  record evicted) write a new random epoch. Pages of an epoch whose record is gone are not
  read by engines that start then: a lost record costs hits, never correctness.
* ``reset_prefix_cache(reset_connector=True)``: a new random epoch replaces the record (DELETE
  then PUT; an epoch the reset retires that another engine's check writes back in between is
  replaced again, never adopted).
* every :data:`CHECK_S` (and within a second after a lookup finds the store lacks blocks this
  engine holds, the sign of a restarted store) the scheduler reads the record again, off its
  thread: a different record is adopted (a reset made by another engine reaches this one
  within that time); a missing one is written again with this engine's epoch, so that
  engines keep sharing pages across a store restart. The read also keeps the record
  recently used in the store's LRU.
* store unreachable when the epoch is not known (start-up): the connector reads and writes
  nothing (no lookup, no save) rather than risk an epoch a reset has retired, and asks again
  (1 s doubling to :data:`CHECK_S`) until it knows. The record's node down counts as
  unreachable for the record for :data:`HOME_WAIT_S`, though another node answers "not found"
  in its place: an engine that starts then waits, running engines keep their epoch, and a
  reset made meanwhile is used at once and recorded once the node is back.

Limits: a reset whose record is lost (restart, eviction) before another running engine has
read it can be undone by that engine writing its older epoch back. A record whose node stays
down past :data:`HOME_WAIT_S` is taken for lost: a new epoch (an engine's start, a reset) is
recorded on the next node and adopted by running engines, and engines reading the old node
when it comes back follow its older record until it is reset again or evicted (pages stored
meanwhile are lost to the other epoch: hits, never wrong data).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from typing import Any

from pagekv.errors import StoreError
from pagekv.store import Status

__all__ = ["CHECK_S", "EpochRecord"]

log = logging.getLogger("vllm.pagekv")

CHECK_S = 30.0
REPLACE_TRIES = 3  # DELETE + PUT rounds of a reset whose retired epoch another check restored
HOME_WAIT_S = 60.0  # a record missing while its node is down is taken for absent after this
_PREFIX = b"pagekv-epoch:"


def new_epoch() -> str:
    return os.urandom(8).hex()


def _parse(value: Any) -> str | None:
    if value is None:
        return None
    raw = b"".join(bytes(v) for v in value) if isinstance(value, (list, tuple)) else bytes(value)
    if not raw.startswith(_PREFIX):
        return None
    text = raw[len(_PREFIX) :].decode("ascii", "replace")
    return text if len(text) == 16 and all(c in "0123456789abcdef" for c in text) else None


class EpochRecord:
    """Reads and writes one namespace's epoch record through a :class:`KVIndex`'s store client
    (on its loop). The synchronous methods are bounded by ``timeout_s`` and return None when
    the store could not answer; :meth:`poll` checks in the background."""

    def __init__(self, index: Any, key: bytes, timeout_s: float) -> None:
        self.index, self.key, self.timeout_s = index, key, timeout_s
        self._home_down_since: float | None = None  # (on the index's loop)
        self._pending: str | None = None  # a reset's epoch not yet recorded
        self._check: concurrent.futures.Future | None = None
        self._next_check = self._last_check = 0.0
        self._soon = False  # a check asked for by check_soon, not yet sent
        self._retry_s = 1.0

    # ---- store operations (coroutines on the index's loop) ---------------------------------
    async def _read(self) -> str | None:
        """The recorded epoch, "" when there is none (or it is unreadable), None when the
        store did not answer, or said "not found" while the record's node is down (for up to
        :data:`HOME_WAIT_S`: the record may be there)."""
        store = self.index.store
        present = await store.exists_many([self.key])
        if present.unanswered:
            return None
        unsure = self._home_unsure(store)  # (every answered read keeps the outage's clock)
        if not present.found[0]:
            return None if unsure else ""
        (value,) = await store.get_many([self.key])
        return _parse(value) or ""

    def _home_unsure(self, store: Any) -> bool:
        if not store.home_down(self.key):
            self._home_down_since = None
            return False
        now = time.monotonic()
        if self._home_down_since is None:
            self._home_down_since = now
            log.info("pagekv: the epoch record's store node is down: its epoch is not known "
                     "until it is back (or %.0f s have passed)", HOME_WAIT_S)  # fmt: skip
        return now - self._home_down_since < HOME_WAIT_S

    async def _write(self, epoch: str, replace: bool, current: str | None = None) -> str | None:
        """Record ``epoch`` (after deleting the current record when ``replace``), or adopt the
        record another engine wrote first. The epoch in force, or None.

        A reset retires the record it read first and the engine's ``current`` epoch: another
        engine's check that finds no record between the DELETE and the PUT writes a retired
        epoch back, and the reset deletes and writes again (``REPLACE_TRIES`` in all) rather
        than adopt it; a record holding any other epoch is a newer reset, adopted."""
        store = self.index.store
        recorded = await self._read() if replace else ""
        if recorded is None:
            return None
        retired = {recorded, current or ""}
        for _ in range(REPLACE_TRIES if replace else 1):
            if replace:
                await store.delete_many([self.key])
            (status,) = await store.put_many([self.key], [_PREFIX + epoch.encode()])
            if status == Status.OK:
                return epoch
            if status != Status.EXISTS:
                return None
            found = await self._read()
            if found is None or found not in retired:
                return found
        return None

    async def _establish(self, known: str | None = None) -> str | None:
        """The recorded epoch; when there is none, ``known`` (this engine's) or a new one is
        written (or the one another engine wrote first adopted). None: no answer."""
        current = await self._read()
        if current is None:
            return None
        return current or await self._write(known or new_epoch(), replace=False)

    def _call(self, coro: Any) -> str | None:
        try:
            return self.index.loop.call(coro, self.timeout_s)
        except (TimeoutError, StoreError) as e:
            log.debug("pagekv: epoch record: %r", e)
            return None

    # ---- for the scheduler -----------------------------------------------------------------
    def establish(self) -> str | None:
        """The namespace's epoch (written when there is none), or None (store unreachable)."""
        return self._schedule(self._call(self._establish()))

    def replace(self, current: str | None = None) -> tuple[str, bool]:
        """A new epoch for a reset of the engine's ``current`` one: ``(epoch, recorded)``. Not
        recorded (store unreachable): the new epoch is used anyway (it reads nothing stale) and
        recorded by later checks."""
        if self._check is not None:  # it read (or would write) the record the reset retires
            self._check.cancel()
            self._check = None
        epoch = new_epoch()
        recorded = self._schedule(self._call(self._write(epoch, replace=True, current=current)))
        self._pending = None if recorded else epoch
        return recorded or epoch, recorded is not None

    def poll(self, current: str | None, now: float) -> str | None:
        """The epoch to use from now on: ``current`` unless a background check found another.
        Starts a check when one is due; never waits."""
        check = self._check
        if check is not None:
            if not check.done():
                return current
            self._check = None
            failed = check.cancelled() or check.exception() is not None
            found = self._schedule(None if failed else check.result())
            if found is not None:
                self._pending = None
                if current is not None and found != current:
                    log.info("pagekv: the store's epoch record changed (a reset elsewhere): "
                             "epoch %s -> %s", current, found)  # fmt: skip
                current = found
            if self._soon:  # asked for while this one was on its way: sent, a second later
                self._send_check(current, now)
            return current
        if now >= self._next_check:
            self._send_check(current, now)
        return current

    def _send_check(self, current: str | None, now: float) -> None:
        """Start the check on the index's loop, once ``_next_check`` has come (there, not
        here: an idle engine has no poll to wait for it)."""
        delay = max(0.0, self._next_check - now)
        self._check = self.index.loop.submit(self._checked(current, self._pending, delay))
        self._soon = False
        self._next_check = now + delay + 1.0  # (until the check's answer sets the next one)

    async def _checked(self, current: str | None, pending: str | None, delay: float) -> str | None:
        if delay > 0:
            await asyncio.sleep(delay)
        return await (self._write(pending, replace=True) if pending else self._establish(current))

    def check_soon(self, current: str | None) -> None:
        """Check the record (and write ``current`` back when it is missing) a second after the
        last check at the latest: the store may have lost it (a lookup found it lacks blocks
        this engine holds). Sent from here, not left to the next poll, so that an engine that
        goes idle still records the epoch its re-saved blocks are keyed by. A check already
        on its way may have read the store before it lost the record: the one asked for is
        still sent, by the poll that takes in its answer. Never waits."""
        self._soon = True
        self._next_check = min(self._next_check, self._last_check + 1.0)
        if self._check is None:
            self._send_check(current, time.monotonic())

    def _schedule(self, found: str | None) -> str | None:
        self._last_check = time.monotonic()
        if found is None:
            self._next_check = self._last_check + self._retry_s
            self._retry_s = min(CHECK_S, self._retry_s * 2)
        else:
            self._next_check = self._last_check + CHECK_S
            self._retry_s = 1.0
        if self._soon:
            self._next_check = min(self._next_check, self._last_check + 1.0)
        return found
