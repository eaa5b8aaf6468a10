"""What a node's KV events say, as they happen: blocks stored in or removed from one of its
tiers (``MEMORY``, ``DISK``), collected for the publisher thread (:mod:`.event_publisher`).

The node's tiers call the hooks as their contents change, in the order they change: the block
store (under the node's lock) and the disk tier (under the tier's lock). Each hook appends the
key to the pending list under this object's own lock, which is taken last and never held while
calling out, so the hooks may be called from any thread and never wait on the publisher.

Rules (what a subscriber can rely on):

* ``stored(medium, key)``: the key became readable from that tier (a PUT or COMMIT stored it,
  a disk read promoted it, the disk writer queued it; never for a request that failed);
  ``removed(medium, key)``: it no longer is (evicted, deleted, dropped, reclaimed, corrupt).
  A block moving from memory to disk is a store on the disk medium followed by a removal on
  the memory medium, so a subscriber never sees it gone meanwhile.
* At most ``max_pending`` keys wait for the publisher. Past that, the pending keys are dropped
  (counted in ``events_dropped``) and a *resync* is due: the publisher then sends
  ``AllBlocksCleared`` and the node's whole contents as stores (:meth:`begin_resync`), then the
  changes made since. A node starts with a resync due: its first batch says what it holds
  (its disk tier's blocks after a restart).
"""

from __future__ import annotations

import threading

__all__ = ["DISK", "MEMORY", "NodeEvents", "Run"]

MEMORY = "PAGEKV-MEMORY"  # the node's memory tier
DISK = "PAGEKV-DISK"  # the node's disk tier (--disk)

Run = tuple[bool, str, list[bytes]]  # (stored, medium, keys): one event's worth; None in a
# list of runs: AllBlocksCleared


class NodeEvents:
    """Pending changes of a node's contents, in order, as runs of keys of one kind and medium.
    ``wakeup``: set when the first change arrives (the publisher waits on it)."""

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._runs: list[Run | None] = []
        self._closed = False
        self._count = 0
        self.resync_due = True  # the first batch says what the node holds
        self.wakeup = threading.Event()
        self.counters = {"events_dropped": 0, "event_resyncs": 0}

    def stored(self, medium: str, key: bytes) -> None:
        self._add(True, medium, key)

    def removed(self, medium: str, key: bytes) -> None:
        self._add(False, medium, key)

    def memory_stored(self, key: bytes) -> None:
        self._add(True, MEMORY, key)

    def memory_removed(self, key: bytes) -> None:
        self._add(False, MEMORY, key)

    def disk_stored(self, key: bytes) -> None:
        self._add(True, DISK, key)

    def disk_removed(self, key: bytes) -> None:
        self._add(False, DISK, key)

    def _add(self, stored: bool, medium: str, key: bytes) -> None:
        with self._lock:
            if self.resync_due or self._closed:  # a resync's snapshot, taken later, covers it
                return
            runs = self._runs
            if runs and runs[-1] is not None and runs[-1][0] is stored and runs[-1][1] == medium:
                runs[-1][2].append(key)
            else:
                runs.append((stored, medium, [key]))
                self.wakeup.set()
            self._count += 1
            if self._count > self.max_pending:
                self.counters["events_dropped"] += self._count
                self._runs, self._count, self.resync_due = [], 0, True

    def close(self) -> None:
        """The node stops serving: what is pending gives way to ``AllBlocksCleared`` (the
        node holds nothing a subscriber can read any more); later changes are ignored."""
        with self._lock:
            self._runs, self._count, self.resync_due, self._closed = [None], 1, False, True
            self.wakeup.set()

    def take(self) -> list[Run | None]:
        """The pending runs, oldest first (the list is handed over)."""
        with self._lock:
            runs, self._runs, self._count = self._runs, [], 0
            self.wakeup.clear()
            return runs

    def begin_resync(self) -> None:
        """Start a resync: changes from now on are kept again. The caller then lists the
        node's contents and publishes them before the changes (every change made after this
        call follows the listing, so applying both in order gives the node's contents)."""
        with self._lock:
            self._runs, self._count, self.resync_due = [], 0, False
            self.counters["event_resyncs"] += 1
