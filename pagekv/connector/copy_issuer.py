"""The connector's copy-engine issuer: a thread of the connector's own that enqueues the
transfers given to the copy engine, so that the thread asking for them (an engine's step
thread, the connector's loop) spends microseconds on them. A copy-engine transfer costs the host
~0.5-1 us per copy (one per run of slots, layer and K/V; a 4 GiB load of 32 KiB runs ~70 ms),
and a call waits for the engines once the driver's queue is full: on the caller's thread it
would hold an engine's step for most of the transfer (docs/benchmarks.md, "copy engine").

Rules:

* :meth:`CopyIssuer.submit` records a *fork* event on the caller's current stream and queues
  the job: its copies come after everything enqueued on that stream before the call (waits on
  ready events, the engine's writes to the slots). Nothing enqueued on that stream after the
  call is ordered after the copies: consumers order themselves on the job's completions.
* The issuer's thread runs jobs in submission order on the issuer's own stream: the job waits
  on its fork event and enqueues its transfers in order (a layer-by-layer
  load is one job: :func:`pagekv.kernels.transfer_layers`, its layers in one library call;
  what the driver refuses falls back to the kernel, once logged) with one event recorded after
  each. Each transfer is handed to its completion as soon as its event is recorded: the
  library counts the layers it has enqueued in the job's
  :class:`~pagekv.kernels.copy_engine.Progress` as it goes, and a consumer of layer ``i``
  waits on that count, for the layers up to ``i`` to be enqueued; not for the whole job, nor
  for the issuer's thread to take the GIL back from a thread running Python. Transfers
  enqueued by Python (the other backends, the kernel after a refusal) are handed over as
  their events are recorded there.
* A :class:`Completion` stands for one transfer's event, with the part of ``torch.cuda.Event``
  its consumers use: ``wait(stream)`` (what ``stream.wait_event`` calls) blocks the host only
  until the transfer is *enqueued* (asleep in the library: no GIL held), then makes the stream
  wait on the GPU; ``query()`` is False until it is enqueued and done; ``synchronize()`` blocks
  until it is done.
* Ownership: a job holds its CPU page ids and slots, the host buffer and the device cache until
  its transfers are enqueued; whoever holds the host pages and slots keeps them until the
  completion completes (the rule for an event).
* A job that raises (no kernel left to fall back to: a broken CUDA context, no memory for its
  index tensors) fails the completions it had not handed an event: their ``wait``, ``query``
  and ``synchronize`` raise :class:`CopyFailed`, so nothing reads or publishes the bytes it did
  not copy. ``query`` raises only once the issuer's stream has passed what the job did enqueue
  (False until then): from then on nothing touches its pages, and their holders may let them
  go (the page cache does). The thread goes on with the next job.
* :meth:`close` runs the queued jobs, waits for their copies and stops the thread.
* The issuer is a Python thread: it takes the GIL to start a job and to finish it, and beside
  a thread running pure Python each take waits up to the switch interval (5 ms); between the
  two, a copy-engine job calls nothing that gives the GIL up, and its layers are handed over as
  the library enqueues them (docs/benchmarks.md: a 1 GiB load beside 20 ms of Python on the
  caller is done when it would be alone; a job queued behind one not yet finished waits for
  that one's end). Its CUDA calls wait
  while another thread's enqueued work fills the device's submission queue: an engine that
  enqueues many decode steps at once holds it until they drain; with a serving engine's one
  or two steps in flight (the reference engine: ``decode_graph.STEPS_IN_FLIGHT``) it keeps
  pace (docs/benchmarks.md "Copy engine").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from pagekv.errors import CopyFailed
from pagekv.kernels.copy_engine import Progress
from pagekv.kernels.jit import library_holding_gil, load_library

__all__ = ["AllOf", "CopyFailed", "CopyIssuer", "Completion"]

log = logging.getLogger(__name__)


class Completion:
    """One queued transfer's completion (see the module docstring): entry ``entry`` of a job
    whose library call counts its entries in ``progress`` (None: handed over by Python alone)."""

    __slots__ = ("_enqueued", "_entry", "_error", "_event", "_progress", "_settled",
                 "enqueued_at")  # fmt: skip

    def __init__(self, progress: Progress | None = None, entry: int = 0) -> None:
        self._enqueued = threading.Event()
        self._progress, self._entry = progress, entry
        self._event: torch.cuda.Event | None = None
        self._error: BaseException | None = None
        self._settled: torch.cuda.Event | None = None  # a failed job's: its stream passed it
        self.enqueued_at: float | None = None  # time.monotonic() Python handed it (diagnostics)

    def _set(self, event: torch.cuda.Event | None, error: BaseException | None = None,
             settled: torch.cuda.Event | None = None) -> None:  # fmt: skip
        self._event, self._error, self._settled = event, error, settled
        self.enqueued_at = time.monotonic()
        self._enqueued.set()

    def _counted(self) -> torch.cuda.Event | None:
        """The event, where the job's library call has counted this entry enqueued (read
        before ``_enqueued``: the issuer sets that first for what it counts)."""
        p = self._progress
        if p is None or not p.counted(self._entry) or self._enqueued.is_set():
            return None
        return p.events[self._entry]

    def _wait_enqueued(self) -> torch.cuda.Event:
        p = self._progress
        if p is not None and not self._enqueued.is_set() and p.wait(self._entry):
            if not self._enqueued.is_set():  # counted by the library: its event
                return p.events[self._entry]
        self._enqueued.wait()  # handed over by the issuer (it sets completions, then counts)
        if self._event is None:
            raise CopyFailed(f"a copy-engine transfer failed: {self._error!r}") from self._error
        return self._event

    @property
    def enqueued(self) -> bool:
        return self._enqueued.is_set() or self._counted() is not None

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for the transfer on the GPU; the
        host waits only until the issuer has enqueued it."""
        self._wait_enqueued().wait(stream)

    def query(self) -> bool:
        if not self._enqueued.is_set():
            counted = self._counted()
            return counted is not None and counted.query()
        if self._event is None and self._settled is not None and not _passed(self._settled):
            return False  # failed: raises once the stream has passed what the job enqueued
        return self._wait_enqueued().query()

    def synchronize(self) -> None:
        self._wait_enqueued().synchronize()


def _passed(event: torch.cuda.Event) -> bool:
    """Whether the GPU has passed ``event``; a context too broken to say runs nothing more."""
    try:
        return event.query()
    except RuntimeError:  # a CUDA error (torch raises RuntimeError subclasses for them)
        return True


def _settle() -> torch.cuda.Event | None:
    """An event after whatever a failed job enqueued on the current stream (None when the
    context cannot record one: it runs nothing more)."""
    try:
        event = torch.cuda.Event()
        event.record()
        return event
    except RuntimeError:
        return None


class Job(Protocol):
    """Enqueues its transfers in order on the current stream (the issuer's), a CUDA event
    recorded after each; calls ``enqueued`` with the events recorded so far each time there are
    more; returns the backend it used and all the events. Given a ``progress`` (None where the
    library is not loaded, and then the issuer has waited on the fork), it orders its transfers
    after ``progress.fork`` itself and may record ``progress.events`` and have the library count
    them (:func:`pagekv.kernels.transfer_layers` does both in one library call, so the issuer's
    thread gives up the GIL before its copies start only where it waits for a job)."""

    def __call__(
        self, *, enqueued: Callable[[list[torch.cuda.Event]], None], progress: Progress | None
    ) -> tuple[str, list[torch.cuda.Event]]: ...


class CopyIssuer:
    """The issuer thread of one connector on ``device`` (started on the first job)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stream: torch.cuda.Stream | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.counters = {"jobs": 0, "transfers": 0, "failed": 0, "kernel_fallbacks": 0,
                         "job_seconds": 0.0}  # fmt: skip

    def submit(self, job: Job, transfers: int) -> list[Completion]:
        """Queue ``job`` (``transfers`` transfers, one event each) after the current stream's
        enqueued work; one completion per transfer. Raises ``RuntimeError`` once closed."""
        fork = torch.cuda.Event()
        fork.record(torch.cuda.current_stream(self.device))
        lib, lib_gil = load_library(), library_holding_gil()
        progress = None
        if lib is not None and lib_gil is not None:
            progress = Progress(lib, lib_gil, self.device, transfers, fork)
        done = [Completion(progress, i) for i in range(transfers)]
        with self._lock:
            if self._closed:
                raise RuntimeError("the copy issuer is closed")
            if self._thread is None:
                self._stream = torch.cuda.Stream(self.device)
                self._thread = threading.Thread(target=self._run, name="pagekv-copy-issuer",
                                                daemon=True)  # fmt: skip
                self._thread.start()
            self.counters["jobs"] += 1
            self._queue.put((fork, job, done, progress))
        return done

    def close(self) -> None:
        """Run what is queued, wait for its copies, stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()
            self._stream.synchronize()

    def _run(self) -> None:
        stream = self._stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            while (item := self._queue.get()) is not None:
                fork, job, done, progress = item
                if progress is None:  # else the job orders itself after progress.fork
                    stream.wait_event(fork)
                try:
                    self._one(job, done, progress)
                finally:
                    if progress is not None:  # every completion is set: waiters may look
                        progress.end()

    def _one(self, job: Job, done: list[Completion], progress: Progress | None) -> None:
        start = time.perf_counter()
        handed = 0

        def enqueued(events: list[torch.cuda.Event]) -> None:
            nonlocal handed
            if len(events) > len(done):
                raise RuntimeError(f"a job recorded {len(events)} events for {len(done)} transfers")
            for completion, event in zip(done[handed:], events[handed:]):
                completion._set(event)
            handed = max(handed, len(events))
            if progress is not None:  # after the completions: a waiter it wakes finds them set
                progress.publish(handed)

        try:
            backend, events = job(enqueued=enqueued, progress=progress)
            self.counters["job_seconds"] += time.perf_counter() - start
            if len(events) != len(done):
                raise RuntimeError(f"a job recorded {len(events)} events for {len(done)} transfers")
            enqueued(events)
        except Exception as e:  # the completions not handed an event carry it to every consumer
            if progress is not None:  # what the library counted was enqueued
                enqueued(progress.events[: min(progress.count(), len(done))])
            self.counters["failed"] += len(done) - handed
            self.counters["transfers"] += handed
            log.error("pagekv: a copy-engine transfer failed: %r", e)
            settled = _settle()
            for completion in done[handed:]:
                completion._set(None, e, settled)
            return
        self.counters["transfers"] += len(done)
        self.counters["kernel_fallbacks"] += len(done) * (backend == "kernel")


class AllOf:
    """Completes when every one of ``events`` (CUDA events or completions) has; the same
    three methods, applied to each."""

    def __init__(self, events: Sequence[Any]) -> None:
        self.events = list(events)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        for event in self.events:
            event.wait(stream)

    def query(self) -> bool:
        return all(event.query() for event in self.events)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()
