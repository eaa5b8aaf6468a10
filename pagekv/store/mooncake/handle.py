"""One Mooncake Store client per process and config: set up lazily, its registered memory, its
threads, and its back-off after the master failed.

Mooncake's Python client (``mooncake.store.MooncakeDistributedStore``, release 0.3.13) is a
blocking C++ client: every call holds its thread until the master answers and the transfer
ends (the GIL is released meanwhile). Measured on loopback, TCP protocol (2 cores, 2026-11-26):

* ``setup`` takes ~50 ms; a client that contributes no memory (``global_segment_size`` 0)
  stores its objects in the segments of other processes (``mooncake_client``, or a client with
  ``segment``): at least one must be up, else puts fail (``-200``).
* a master that is killed: ``batch_is_exist`` fails at once (-900), gets and puts after ~4.3 s
  (reconnect attempts); a master that is stopped (SIGSTOP): every call hangs for
  ``MC_RPC_TIMEOUT_MS`` (default 30 s), then -901. A store process that is stopped: a get of
  its objects hangs ``MC_TCP_PROGRESS_TIMEOUT_SEC``/``MC_TCP_STATUS_TIMEOUT_SEC`` (30 s each,
  60 s seen), then -800; killed: -704 (not found) at once. With those three set from
  ``timeout_s`` (:func:`mooncake_timeouts`) the hangs are ~``timeout_s`` and ~2x it. Mooncake
  stops waiting for a transfer after 60 s while its TCP session may still run: the TCP
  timeouts are never set above 25 s, so no session outlives the call that owns its buffer.
* ``setup`` holds the GIL: against a master that accepts connections but does not answer
  (stopped) it retries 20 times ``MC_RPC_TIMEOUT_MS`` apart, and every Python thread of the
  process, event loops included, stands still meanwhile (~40 s at ``timeout_s`` 2): a limit
  of Mooncake's binding, not of these bounds. A killed master fails it at once.
* ``health_check()`` reads the result of Mooncake's own background ping (no round trip); a
  put of a key whose first put is still in flight returns 0 though nothing may be stored; a
  copying put stages the whole call in ``local_buffer`` (-600 past it).
* put of a present key returns 0 and keeps the first value (write-once; ``upsert`` would
  overwrite); a key read within the master's ``--default_kv_lease_ttl`` (10 s) cannot be
  removed without ``force`` (-706); a full store refuses puts (-200) until it evicts.
* a get into a buffer smaller than the object fails (-600); into a larger one returns the
  object's size; buffers need not be registered over TCP (they must be over RDMA).

So the backend never calls Mooncake on an event loop: calls run on two small thread pools
(lookups apart from transfers, so a stalled transfer never delays a lookup), each refusing new
work at once (a miss) when its queue is full, and after a master-level failure (-900 to -999,
or a lookup past its bound) every call is a miss at once for a back-off period (0.25 s
doubling to 8 s). Calls that write into caller buffers are waited for before they are
reported over (see :mod:`.backend`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pagekv.errors import ConfigError, StoreError

from .config import MooncakeConfig
from .values import TRAILER_BYTES

__all__ = ["MooncakeHandle", "NotRun", "Pool", "mooncake_timeouts", "shared_handle"]

log = logging.getLogger("pagekv.store.mooncake")
T = TypeVar("T")

MAX_CALL_KEYS = 4096  # keys of one Mooncake call
MASTER_ERRORS = range(-999, -899)  # RPC_FAIL (-900), RPC_TIMEOUT (-901), ...
QUEUE_PER_WORKER = 4  # a pool refuses work beyond workers * this
# Mooncake (0.3.13) waits at most 60 s for a transfer, its TCP session up to the progress plus
# the status timeout: each at most this, so a session never outlives the call that owns its buffer
TCP_STALL_MAX_S = 25


class Busy(StoreError):
    """A pool's queue is full (calls stuck on a stalled store): the call is a miss."""


class NotRun(StoreError):
    """The pool shut down (the client closed) before the call started: it never ran."""


class Pool:
    """A thread pool that refuses work instead of queueing without bound. Once shut down, no
    call that has not started runs: each ends cancelled or with :class:`NotRun`."""

    def __init__(self, name: str, workers: int) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._limit = workers * QUEUE_PER_WORKER
        self._lock = threading.Lock()
        self._closed = False
        self.pending = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        with self._lock:
            if self.pending >= self._limit:
                raise Busy(f"{self.pending} Mooncake calls queued")
            self.pending += 1
        try:
            future = self._executor.submit(self._start, fn, args)
        except RuntimeError as e:  # shut down (the client closed): a miss like a full queue
            self._done(None)
            raise Busy(f"the Mooncake client is closed: {e}") from None
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Any) -> None:
        with self._lock:
            self.pending -= 1

    def _start(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """``fn`` on a pool thread, unless the pool has shut down meanwhile: the executor's
        shutdown cancels the calls it takes from its queue, but a call a thread took from the
        queue as it drained it would still run (Python 3.11-3.13)."""
        with self._lock:
            if self._closed:
                raise NotRun("the Mooncake client closed before the call ran")
        return fn(*args)

    def shutdown(self) -> None:
        """Stop taking work; calls not started are never run: cancelled, or (taken by a thread
        meanwhile) ended with :class:`NotRun` (their callers' keys are misses)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)


class TrailerSlots:
    """Registered memory for the 16-byte trailers of the values in flight, handed out per
    call (a call takes its slots up front and gives them back when its thread is done)."""

    def __init__(self, count: int) -> None:
        import numpy as np

        self.memory = np.zeros(count * TRAILER_BYTES, dtype=np.uint8)
        self.address = int(self.memory.ctypes.data)
        self._free = list(range(count - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise Busy(f"{n} trailer slots wanted, {len(self._free)} free")
            return [self._free.pop() for _ in range(n)]

    def give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def view(self, slot: int) -> memoryview:
        start = slot * TRAILER_BYTES
        return memoryview(self.memory)[start : start + TRAILER_BYTES]


class MooncakeHandle:
    """The process's Mooncake client for one config (shared by every backend of that config:
    SGLang's per-thread clients, a connector and its index). Thread-safe."""

    def __init__(self, config: MooncakeConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._store: Any = None
        self._next_setup = 0.0
        self._setup_backoff = config.backoff_min_s
        self._regions: dict[int, int] = {}  # address -> bytes, to register (again on set-up)
        self.data = Pool("pagekv-mooncake", config.workers)
        self.lookups = Pool("pagekv-mooncake-exists", config.lookup_workers)
        self.trailers = TrailerSlots(MAX_CALL_KEYS * config.workers * QUEUE_PER_WORKER)
        self._down_until = 0.0
        self._backoff = 0.0
        self._backoff_lock = threading.Lock()  # never the set-up's lock: failed() runs on loops
        self.refs = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("setups", "setup_failures", "master_failures", "calls_refused_down",
             "calls_refused_busy"), 0,
        )  # fmt: skip

    # ---- set-up (worker threads) ------------------------------------------------------------
    def store(self) -> Any:
        """The set-up Mooncake client; sets it up on first use (worker thread). Raises
        :class:`StoreError` when it cannot be set up now (retried after a back-off)."""
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is not None:
                return self._store
            if time.monotonic() < self._next_setup:
                raise StoreError("Mooncake client not set up (master unreachable); retrying later")
            try:
                self._store = self._setup()
                self._setup_backoff = self.config.backoff_min_s
                self.counters["setups"] += 1
            except Exception as e:
                self.counters["setup_failures"] += 1
                log.warning("pagekv: Mooncake client set-up failed (%s): every call is a miss; "
                            "retrying in %.2f s", e, self._setup_backoff)  # fmt: skip
                self._next_setup = time.monotonic() + self._setup_backoff
                self._setup_backoff = min(self.config.backoff_max_s, 2 * self._setup_backoff)
                if isinstance(e, StoreError):
                    raise
                raise StoreError(f"Mooncake set-up failed: {e!r}") from e
            return self._store

    def _setup(self) -> Any:
        cfg = self.config
        os.environ.update(mooncake_timeouts(cfg.timeout_s, os.environ))
        module = import_mooncake()
        store = module.MooncakeDistributedStore()
        hostname = cfg.hostname or local_address(cfg.master)
        rc = store.setup(hostname, cfg.metadata, cfg.segment, cfg.local_buffer, cfg.protocol,
                         cfg.device, cfg.master)  # fmt: skip
        if rc != 0:
            _close_quietly(store)
            raise StoreError(f"Mooncake setup failed ({rc}): master {cfg.master}, "
                             f"metadata {cfg.metadata}")  # fmt: skip
        for address, nbytes in [(self.trailers.address, self.trailers.memory.nbytes),
                                *self._regions.items()]:  # fmt: skip
            rc = store.register_buffer(address, nbytes)
            if rc != 0:
                _close_quietly(store)
                raise StoreError(f"Mooncake register_buffer of {nbytes} bytes failed ({rc})")
        log.info("pagekv: Mooncake client set up: %s as %s, %s%s, %d registered region(s)",
                 cfg.master, hostname, cfg.protocol, f" {cfg.device}" if cfg.device else "",
                 len(self._regions) + 1)  # fmt: skip
        return store

    def register(self, address: int, nbytes: int) -> None:
        """Register host memory once (now if set up, else at set-up). ``ConfigError`` for a
        region Mooncake refuses."""
        if nbytes <= 0 or self._regions.get(address) == nbytes:
            return
        with self._lock:
            self._regions[address] = nbytes
            store = self._store
        if store is not None:
            rc = store.register_buffer(address, nbytes)
            if rc != 0:
                with self._lock:
                    self._regions.pop(address, None)
                raise ConfigError(f"Mooncake register_buffer of {nbytes} bytes failed ({rc})")

    def registered(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies in one registered region (then it may
        be a zero-copy source or destination; anything else goes through Mooncake's copies)."""
        regions = list(self._regions.items())
        return any(start <= address and address + nbytes <= start + size
                   for start, size in regions)  # fmt: skip

    # ---- back-off ---------------------------------------------------------------------------
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def failed(self) -> None:
        """The master failed a call (or a lookup passed its bound): back off."""
        now = time.monotonic()
        with self._backoff_lock:
            self.counters["master_failures"] += 1
            if now >= self._down_until:  # a new failure: double
                self._backoff = min(self.config.backoff_max_s,
                                    max(self.config.backoff_min_s, 2 * self._backoff))  # fmt: skip
                log.warning("pagekv: Mooncake master %s failed a call: calls are misses for "
                            "%.2f s", self.config.master, self._backoff)  # fmt: skip
            self._down_until = now + self._backoff

    def answered(self) -> None:
        if self._backoff and not self.down():
            self._backoff = 0.0

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the client (when no call is in flight: a call that still runs in Mooncake
        keeps it, it is never freed under a running call) and stop the threads."""
        self.data.shutdown()
        self.lookups.shutdown()
        with self._lock:
            store, busy = self._store, self.data.pending + self.lookups.pending
            if busy:
                log.warning("pagekv: %d Mooncake call(s) still running at close: the client "
                            "is left to them", busy)  # fmt: skip
                return
            self._store = None
        if store is not None:
            _close_quietly(store)


def mooncake_timeouts(timeout_s: float, environ: Any) -> dict[str, str]:
    """The environment Mooncake's client reads its timeouts from, for ``timeout_s``: the RPC
    timeout unless already set; the TCP progress and status timeouts ``timeout_s`` (at least
    1 s) unless set lower, never above :data:`TCP_STALL_MAX_S` (a higher preset value is
    lowered, with a warning)."""
    out = {} if "MC_RPC_TIMEOUT_MS" in environ else {
        "MC_RPC_TIMEOUT_MS": str(max(100, int(timeout_s * 1000)))}  # fmt: skip
    stall_s = min(max(1, round(timeout_s)), TCP_STALL_MAX_S)
    for name in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):
        preset = environ.get(name)
        if preset is not None and preset.isdigit() and 0 < int(preset) <= TCP_STALL_MAX_S:
            continue
        if preset is not None:
            log.warning("pagekv: %s=%s lowered to %d s: Mooncake stops waiting for a transfer "
                        "after 60 s, and a TCP session still running then could write into a "
                        "buffer its call has given back", name, preset, stall_s)  # fmt: skip
        out[name] = str(stall_s)
    return out


def import_mooncake() -> Any:
    try:
        import mooncake.store as module
    except ImportError as e:
        raise ConfigError(
            "a mooncake:// store needs Mooncake's Python client: pip install 'pagekv[mooncake]' "
            f"(mooncake-transfer-engine, or its -non-cuda build): {e}"
        ) from None
    return module


def local_address(master: str) -> str:
    """This host's address on the route to ``master`` (host:port), loopback if unknown."""
    host = master.rsplit(":", 1)[0].strip("[]") if ":" in master else master
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet: only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception as e:  # pragma: no cover - Mooncake's close logs its own trouble
        log.debug("pagekv: Mooncake close: %r", e)


_HANDLES: dict[tuple[MooncakeConfig, int], MooncakeHandle] = {}
_HANDLES_LOCK = threading.Lock()


def shared_handle(config: MooncakeConfig) -> MooncakeHandle:
    """The process's handle for ``config`` (one reference taken: give it back with
    :func:`release`)."""
    key = (config, os.getpid())
    with _HANDLES_LOCK:
        handle = _HANDLES.get(key)
        if handle is None:
            handle = _HANDLES[key] = MooncakeHandle(config)
        handle.refs += 1
        return handle


def release(handle: MooncakeHandle) -> None:
    """Give back a reference; the last one closes the handle."""
    with _HANDLES_LOCK:
        handle.refs -= 1
        if handle.refs > 0:
            return
        _HANDLES.pop((handle.config, os.getpid()), None)
    handle.close()
