"""The native checked copy: copy values, or receive them from a socket, and hash what landed,
in C, without the GIL.

``csrc/copy_verify.c`` copies each value's pieces in cache-sized blocks and hashes each block
while it is in the core's cache (pieces of 64 KiB and more through a per-thread bounce,
streamed into place): XXH3-64, seed 0, streamed, the same digest as ``xxhash.xxh3_64()`` fed
the same bytes; one ctypes call for many values, optionally on several threads. It replaces
numpy's copy plus xxhash's update per chunk, which hands the GIL over twice per chunk (see
:mod:`.copies`, which uses it when it is available). :meth:`NativeCopy.recv_verify` does the
same for a bulk-lane message's frames arriving on a socket (see :mod:`.lane`): one call, the
GIL released, each chunk hashed as it lands; :meth:`NativeCopy.recv_message` reads a whole
message, its head and, where its frames are the ones expected, its payload, in one call.

* Build: ``$CC`` (default ``cc``; may hold arguments, e.g. ``ccache gcc``) with ``CFLAGS``,
  on first use, into ``$PAGEKV_CACHE_DIR`` (default ``~/.cache/pagekv``). The library's name
  is a hash of the source, the vendored xxhash header, the flags, the compiler's identity
  (first line of ``--version``) and the platform; a file lock around the build and an atomic
  rename into place: processes building at once end with one library, never a partial one.
  XXH3 chooses its vector code when compiled: ``-mavx2`` is added where this CPU has AVX2
  (``/proc/cpuinfo``), so the flags, and with them the library's name, differ between CPUs
  that do and do not have it; a cache shared by both holds one library for each.
* ``PAGEKV_NATIVE_COPY``: ``auto`` (default: native when it builds, else the numpy path with
  one log line), ``on`` (native or :class:`NativeCopyUnavailable` saying why), ``off``.
* Needs numpy (to take the address of read-only buffers); without it :func:`load` says so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    import numpy as np
except ImportError:  # pragma: no cover - the test environment has numpy
    np = None

from pagekv import env
from pagekv.build_cache import build_once
from pagekv.errors import NativeCopyUnavailable

__all__ = ["BLOCK_BYTES", "RECV_SLOTS", "Message", "NativeCopy", "NativeCopyUnavailable", "Piece",
           "Value", "build_library", "load", "load_or_reason", "mode",
           "unavailable_reason"]  # fmt: skip

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "copy_verify.c"
HEADER = CSRC / "third_party" / "xxhash" / "xxhash.h"
BASE_CFLAGS = ("-O3", "-fPIC", "-shared", "-pthread")  # no -march=native: runs on any host
ABI = 7
BLOCK_BYTES = 256 << 10  # copied then hashed while in L2
RECV_SLOTS = 4  # chunks in a receive's bounce: received into while a helper hashes the last
MAX_THREADS = 64  # the C side's cap


class Piece(ctypes.Structure):
    """Mirror of ``pagekv_piece``: copy ``nbytes`` from ``src`` to ``dst``."""

    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("nbytes", ctypes.c_uint64)]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass  # not Linux, or no /proc: no extra instructions
    return set()


def _isa_flags() -> tuple[str, ...]:
    """``-mavx2`` where the CPU has it (XXH3 at about 35 GB/s on hot data instead of 25 with
    SSE2 only, measured on the dev machine), else nothing."""
    return ("-mavx2",) if "avx2" in _cpu_flags() else ()


CFLAGS = BASE_CFLAGS + _isa_flags()


class Value(ctypes.Structure):
    """Mirror of ``pagekv_value``: pieces ``first .. first+count``; ``digest`` is written."""

    _fields_ = [("first", ctypes.c_uint64), ("count", ctypes.c_uint64),
                ("digest", ctypes.c_uint64)]  # fmt: skip


def mode() -> str:
    """``PAGEKV_NATIVE_COPY``: auto, on or off (``ConfigError`` for anything else)."""
    return env.NATIVE_COPY.get()


def cache_dir() -> Path:
    return env.CACHE_DIR.get()


def compiler() -> tuple[str, ...]:
    return tuple(shlex.split(os.environ.get("CC") or "cc"))


def _what_to_do() -> str:
    return ("install a C compiler (cc) or point $CC at one, or set PAGEKV_NATIVE_COPY=auto "
            "(fall back) or off (never build): the numpy path gives the same results")  # fmt: skip


def _run(cmd: Sequence[str], what: str) -> subprocess.CompletedProcess:
    """Run the compiler; NativeCopyUnavailable naming it when it cannot be run or fails."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeCopyUnavailable(f"C compiler {cmd[0]!r} could not run ({what}): {e}; "
                                    f"{_what_to_do()}") from e  # fmt: skip
    if proc.returncode != 0:
        raise NativeCopyUnavailable(
            f"C compiler {cmd[0]!r} failed ({what}, exit {proc.returncode}): "
            f"`{shlex.join(cmd)}`\n{(proc.stderr or proc.stdout)[-4000:]}\n{_what_to_do()}"
        )
    return proc


@functools.cache
def compiler_identity(cc: tuple[str, ...]) -> str:
    """First line of ``cc --version`` (part of the library's name)."""
    out = _run([*cc, "--version"], "--version").stdout.strip()
    return out.splitlines()[0] if out else "unknown"


def library_name(cc: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), HEADER.read_bytes(), " ".join(CFLAGS).encode(),
                 compiler_identity(cc).encode(), sysconfig.get_platform().encode()):  # fmt: skip
        h.update(len(part).to_bytes(8, "little") + part)
    return f"libpagekv_copy_verify_{h.hexdigest()[:16]}.so"


def build_library(*, cc: Sequence[str] | None = None, directory: Path | None = None) -> Path:
    """Compile (once per source, flags and compiler; cached and locked) and return the path.

    Raises ``NativeCopyUnavailable`` (with the compiler's name and output) when it fails.
    """
    cc = tuple(cc) if cc is not None else compiler()
    if not cc:
        raise NativeCopyUnavailable(f"$CC is empty; {_what_to_do()}")

    def build(out: Path) -> None:
        log.info("pagekv: building the native checked copy with %s", shlex.join(cc))
        _run([*cc, *CFLAGS, "-o", str(out), str(SOURCE)], "building copy_verify.c")

    return build_once((directory or cache_dir()) / library_name(cc), build)


class NativeCopy:
    """The loaded library. Thread-safe: each call has its own arguments."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # a CDLL's calls release the GIL
        lib.pagekv_copy_verify_abi.argtypes, lib.pagekv_copy_verify_abi.restype = [], ctypes.c_int
        if lib.pagekv_copy_verify_abi() != ABI:
            raise NativeCopyUnavailable(f"{path} has ABI {lib.pagekv_copy_verify_abi()}, "
                                        f"need {ABI}: remove it and retry")  # fmt: skip
        fn = lib.pagekv_copy_verify
        fn.argtypes = [ctypes.POINTER(Piece), ctypes.c_uint64, ctypes.POINTER(Value),
                       ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]  # fmt: skip
        fn.restype = ctypes.c_int
        recv = lib.pagekv_recv_verify
        recv.argtypes = [ctypes.c_int, ctypes.POINTER(Piece), ctypes.c_uint64,
                         ctypes.POINTER(Value), ctypes.c_uint64, ctypes.c_uint64,
                         ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                         ctypes.POINTER(ctypes.c_uint64)]  # fmt: skip
        recv.restype = ctypes.c_int
        message = lib.pagekv_recv_message
        u64 = ctypes.c_uint64
        message.argtypes = [ctypes.c_int, ctypes.c_void_p, u64, u64, u64, u64, u64,
                            ctypes.POINTER(Piece), u64, ctypes.POINTER(Value), u64, u64,
                            ctypes.c_void_p, u64, u64, ctypes.POINTER(u64), ctypes.POINTER(u64),
                            ctypes.POINTER(ctypes.c_int)]  # fmt: skip
        message.restype = ctypes.c_int
        self._lib, self._fn, self._recv, self._message = lib, fn, recv, message

    def copy_verify(
        self,
        values: Sequence[tuple[Sequence[Any], Sequence[Any]]],
        *,
        threads: int = 1,
        block_bytes: int = BLOCK_BYTES,
    ) -> list[int]:
        """For each ``(targets, sources)`` of ``values``: copy ``sources[k]`` into
        ``targets[k]`` and return the XXH3-64 of the bytes as written into the targets, in
        order (one digest per value), on up to ``threads`` threads (whole values each).

        Targets: writable C-contiguous buffers (bytearray, memoryview, numpy array); sources:
        any C-contiguous buffer (bytes, numpy arrays over a read-only mapping, zmq frames).
        They must not overlap. Mutates the targets, whatever the digest (a caller that finds
        a mismatch must treat them as unspecified); the buffers are held (exported) for the
        call and not kept after it. Everything is checked before anything is copied: raises
        ``TypeError`` for a non-buffer or a read-only target, ``ValueError`` for a
        non-contiguous buffer, frame counts or sizes that differ, or bad ``threads`` /
        ``block_bytes``.
        """
        if type(threads) is not int or not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be an int in 1..{MAX_THREADS}, got {threads!r}")
        if type(block_bytes) is not int or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        keep: list[Any] = []  # the numpy views: they hold each buffer's export until we return
        plan: list[tuple[int, int, int]] = []
        spans: list[tuple[int, int]] = []
        for v, (targets, sources) in enumerate(values):
            if len(targets) != len(sources):
                raise ValueError(f"value {v}: {len(sources)} sources for {len(targets)} targets")
            spans.append((len(plan), len(targets)))
            for k, (target, source) in enumerate(zip(targets, sources)):
                dst, n = _address(target, True, f"value {v} target {k}", keep)
                src, m = _address(source, False, f"value {v} source {k}", keep)
                if n != m:
                    raise ValueError(f"value {v}: source {k} has {m} bytes, its target {n}")
                plan.append((dst, src, n))
        pieces = (Piece * max(1, len(plan)))(*plan)
        out = (Value * max(1, len(spans)))(*((first, count, 0) for first, count in spans))
        rc = self._fn(pieces, len(plan), out, len(spans), block_bytes, threads)
        if rc == -2:  # a thread's bounce (block_bytes) could not be allocated
            raise MemoryError(f"pagekv_copy_verify: no memory for a {block_bytes}-byte bounce")
        if rc != 0:  # pragma: no cover - the plan above is always in range
            raise RuntimeError(f"pagekv_copy_verify returned {rc}")
        del keep
        return [out[v].digest for v in range(len(spans))]

    def recv_verify(
        self,
        fd: int,
        frames: Sequence[Any],
        counts: Sequence[int] | None,
        *,
        bounce: Any,
        chunk_bytes: int = BLOCK_BYTES,
        deadline_ns: int = 0,
    ) -> list[int] | None:
        """Receive ``frames`` (writable C-contiguous buffers, in order) from the blocking
        socket ``fd``, ``chunk_bytes`` per receive, the GIL released for the whole call. With
        ``counts`` (frames per value, adding up to ``len(frames)``), return the XXH3-64 of each
        value's bytes as they landed (as :meth:`copy_verify`'s digests), else None.

        Frames of 64 KiB and more are received a chunk at a time into ``bounce`` (a writable
        C-contiguous buffer of at least ``chunk_bytes``, the caller's: one per thread, used by
        nothing else during the call), hashed there while it is in the cache and streamed into
        place (stores that bypass the cache); smaller ones straight into place. A bounce of
        two chunks or more (``RECV_SLOTS`` chunks) is a ring: a helper thread, started for the
        call when it has two chunks or more to bounce, hashes and streams each chunk while this
        thread receives the next ones, so the receive never waits for the hash or the copy.

        Mutates the frames (those not reached when it raises keep what they held; the one it
        was in holds part of its bytes). The caller must keep ``fd`` open for the call: another
        thread may ``shutdown`` it to end the call (an ``EOFError``), never close it. Raises,
        before reading: ``TypeError`` / ``ValueError`` as :meth:`copy_verify` for the buffers,
        ``ValueError`` for counts that do not add up, a bad ``chunk_bytes`` or a bounce smaller
        than a chunk; after (what arrived is in place, nothing writes to the frames or the
        bounce any more): ``EOFError``
        when the connection ends first (its message says how many bytes came),
        ``BlockingIOError`` when the socket's ``SO_RCVTIMEO`` passes with nothing read,
        ``TimeoutError`` when ``deadline_ns`` (a ``time.monotonic_ns()`` time; 0: none) passes
        first, however the bytes trickle in (the call lowers the socket's ``SO_RCVTIMEO`` to the
        time left as it goes, and leaves it so), or the ``OSError`` of the failed receive."""
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if type(deadline_ns) is not int or deadline_ns < 0:
            raise ValueError(f"deadline_ns must be an int >= 0, got {deadline_ns!r}")
        keep: list[Any] = []  # the numpy views: they hold each buffer's export until we return
        plan, pieces, spans, out = _receive_plan(frames, counts, keep)
        at, size = _address(bounce, True, "bounce", keep)
        if size < chunk_bytes:
            raise ValueError(f"bounce of {size} bytes is smaller than a chunk ({chunk_bytes})")
        received = ctypes.c_uint64(0)
        rc = self._recv(fd, pieces, len(plan), out, len(spans), chunk_bytes, at, size,
                        deadline_ns, ctypes.byref(received))  # fmt: skip
        del keep
        total = sum(p[2] for p in plan)
        if rc == 1:
            raise EOFError(f"connection closed after {received.value} of {total} bytes")
        if rc < 0:
            raise OSError(-rc, f"{os.strerror(-rc)} after {received.value} of {total} bytes")
        return None if counts is None else [out[v].digest for v in range(len(spans))]

    def recv_message(
        self,
        fd: int,
        head: Any,
        *,
        max_header: int,
        max_frames: int,
        max_frame_bytes: int,
        max_payload: int,
        frames: Sequence[Any] = (),
        counts: Sequence[int] | None = None,
        bounce: Any = None,
        chunk_bytes: int = BLOCK_BYTES,
        deadline_ns: int = 0,
    ) -> Message:
        """Receive one bulk-lane message's head (prefix, sizes, header: see
        :mod:`.lane`) from the blocking socket ``fd`` into ``head`` (a writable buffer of at
        least 20 bytes, the caller's) and, when its frames are exactly ``frames`` (as many,
        each of the same size: where the caller expects them to go), its payload into them as
        :meth:`recv_verify` receives (``counts``, ``bounce``, ``chunk_bytes``, ``deadline_ns``
        as there): one call, the GIL released for all of it. The head's receives wait as the
        socket's ``SO_RCVTIMEO`` says; the limits are checked before what they bound is read.
        Returns what came (:class:`Message`); raises only for bad arguments (``ValueError``,
        ``TypeError``), before reading. The caller must keep ``fd`` open for the call (another
        thread may ``shutdown`` it to end the call)."""
        if frames and (bounce is None or type(chunk_bytes) is not int or chunk_bytes <= 0):
            raise ValueError("frames need a bounce and a positive chunk_bytes")
        keep: list[Any] = []
        plan, pieces, spans, out = _receive_plan(frames, counts, keep)
        at, cap = _address(head, True, "head", keep)
        if cap < 20:
            raise ValueError(f"a head buffer of {cap} bytes cannot hold a message's prefix")
        bounce_at, bounce_size = _address(bounce, True, "bounce", keep) if frames else (None, 0)
        head_bytes, received, landed = ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_int(0)
        rc = self._message(fd, at, cap, max_header, max_frames, max_frame_bytes, max_payload,
                           pieces, len(plan), out, len(spans), chunk_bytes, bounce_at,
                           bounce_size, deadline_ns, ctypes.byref(head_bytes),
                           ctypes.byref(received), ctypes.byref(landed))  # fmt: skip
        del keep
        if rc == -errno.EINVAL:  # pragma: no cover - the arguments are checked above
            raise ValueError("pagekv_recv_message refused its arguments")
        digests = [out[v].digest for v in range(len(spans))] if landed.value and spans else None
        return Message(rc, head_bytes.value, received.value, bool(landed.value), digests)


@dataclasses.dataclass(frozen=True)
class Message:
    """What :meth:`NativeCopy.recv_message` received. ``code``: 0 the head is in the buffer
    (``head_bytes`` of it), and the payload in the frames when ``landed`` (``digests`` per
    value when counts were given); 1 the connection ended before any byte of the message
    (closed, shut down or reset); 2 it ended mid-message; 3 not the lane's framing (only the
    prefix was read); 4 over a limit (the prefix, or the prefix and sizes, read); 5 the head is
    larger than the buffer (only the prefix was read, ``head_bytes`` is the head's size);
    below 0: ``-errno`` of a failed receive (``-EAGAIN``: the socket's receive timeout passed
    with nothing read in one receive). ``received``: the message's bytes that came."""

    code: int
    head_bytes: int
    received: int
    landed: bool
    digests: list[int] | None


def _receive_plan(
    frames: Sequence[Any], counts: Sequence[int] | None, keep: list[Any]
) -> tuple[list[tuple[int, None, int]], Any, list, Any]:
    """A receive's frames as ``pagekv_piece``s and ``counts`` (frames per value, or None: not
    hashed) as ``pagekv_value``s: (plan, pieces, spans, values). ``ValueError`` for counts
    that do not add up to the frames; the buffers' errors as :func:`_address`'s."""
    if counts is not None and (any(c < 0 for c in counts) or sum(counts) != len(frames)):
        raise ValueError(f"counts {list(counts)} do not add up to {len(frames)} frames")
    plan = [(dst, None, n) for dst, n in
            (_address(f, True, f"frame {k}", keep) for k, f in enumerate(frames))]  # fmt: skip
    spans, first = [], 0
    for count in counts or ():
        spans.append((first, count, 0))
        first += count
    return plan, (Piece * max(1, len(plan)))(*plan), spans, (Value * max(1, len(spans)))(*spans)


def _address(obj: Any, writable: bool, what: str, keep: list[Any]) -> tuple[int, int]:
    """(address, byte size) of a buffer; its numpy view (holding the export) goes to keep."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} is a {type(obj).__name__}, not a buffer") from None
    if writable and view.readonly:
        raise TypeError(f"{what} is read-only: targets must be writable buffers")
    if not view.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous (copy it, or pass a contiguous view)")
    arr = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    keep.append(arr)
    return arr.__array_interface__["data"][0], view.nbytes


def _settings() -> tuple[str | None, ...]:
    """The environment :func:`load` depends on (read on each call: cheap, and tests change it)."""
    return env.NATIVE_COPY.raw(), os.environ.get("CC"), env.CACHE_DIR.raw()


@functools.cache
def _load(settings: tuple[str | None, ...]) -> tuple[NativeCopy | None, str | None]:
    if mode() == "off":
        return None, "PAGEKV_NATIVE_COPY=off"
    if np is None:
        return None, "numpy is not installed (pip install numpy, or pagekv[connector])"
    try:
        return NativeCopy(build_library(cc=compiler(), directory=cache_dir())), None
    except NativeCopyUnavailable as e:
        return None, str(e)
    except OSError as e:  # the library would not load (or the cache dir is not writable)
        return None, f"native checked copy unavailable: {e}; {_what_to_do()}"


@functools.cache
def _log_once(reason: str) -> None:
    log.warning("pagekv: native checked copy unavailable, using numpy: %s", reason)


def load() -> NativeCopy | None:
    """The native checked copy, or None: ``PAGEKV_NATIVE_COPY=off``, or ``auto`` and it could
    not be built (logged once). Raises ``NativeCopyUnavailable`` when the mode is ``on`` and
    it cannot be had, ``ValueError`` for an unknown mode. Built (or found in the cache) once
    per process and setting of ``PAGEKV_NATIVE_COPY``, ``CC`` and ``PAGEKV_CACHE_DIR``."""
    lib, reason = _load(_settings())
    if lib is None and reason is not None:
        how = mode()
        if how == "on":
            raise NativeCopyUnavailable(f"PAGEKV_NATIVE_COPY=on: {reason}")
        if how == "auto":
            _log_once(reason.splitlines()[0])
    return lib


def load_or_reason() -> tuple[NativeCopy | None, str]:
    """:func:`load` for a caller that goes on without the library (the bulk lane, which needs
    it): the library and "", or None and why not (what :func:`load` would raise included)."""
    try:
        lib = load()
    except (NativeCopyUnavailable, ValueError) as e:
        return None, str(e)
    return lib, "" if lib is not None else unavailable_reason() or ""


def unavailable_reason() -> str | None:
    """None when :func:`load` gives the library, else why not (never raises for ``on``)."""
    return _load(_settings())[1]
