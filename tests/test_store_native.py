"""The native checked copy (pagekv.store.wire.native): digests equal xxhash's XXH3-64 of the bytes
written, on fresh random data of many sizes, pieces and threads; bad buffers raise typed errors
before anything is copied; PAGEKV_NATIVE_COPY off / on / auto with a broken compiler; two
processes building into one fresh cache end with one library. The native receive
(``recv_verify``): bytes and digests exact over a socket in any chunk size and alignment, a
peer that closes or stalls (what arrived is in place), a shutdown from another thread, bad
input refused before a byte is read."""

import errno
import logging
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import xxhash
import zmq

from pagekv.errors import NativeCopyUnavailable
from pagekv.store.wire import copies, native
from tests.helpers import POISON

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler ($CC or cc)"
)
BLOCK = native.BLOCK_BYTES
SIZES = [0, 1, 3, 63, 4096, 65_537, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, (5 << 20) + 3]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return native.NativeCopy(native.build_library(directory=tmp_path_factory.mktemp("cache")))


@pytest.fixture
def rng():
    return np.random.default_rng(int.from_bytes(os.urandom(8)))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path / "cache"


def xxh3(*frames) -> int:
    state = xxhash.xxh3_64()
    for frame in frames:
        state.update(frame)
    return state.intdigest()


def poisoned(n: int) -> bytearray:
    return bytearray([POISON]) * n


def test_digest_and_bytes_match_xxhash_on_many_sizes(lib, rng):
    for n in SIZES:
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = poisoned(n)
        assert lib.copy_verify([([dst], [src])]) == [xxh3(src)], n
        assert dst == src.tobytes(), n


def test_copies_into_targets_at_every_alignment(lib, rng):
    """Targets that start at any offset from a cache line and end mid-line, large enough to be
    streamed through the bounce: exact bytes and digests, nothing written around them, on 1
    and 3 threads and with blocks that do not divide the values."""
    sizes = [int(n) for n in rng.choice(SIZES[5:], 8)] + [BLOCK + 4099, 64 << 10]
    offsets = [int(o) for o in rng.integers(1, 64, len(sizes))]
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    backing = [np.full(o + n + 64, POISON, np.uint8) for o, n in zip(offsets, sizes)]
    targets = [b[o : o + n] for b, o, n in zip(backing, offsets, sizes)]
    for threads, block in ((1, BLOCK), (3, 4097), (3, 100_003)):
        for t in targets:
            t[:] = POISON
        values = [([t], [s]) for t, s in zip(targets, sources)]
        assert lib.copy_verify(values, threads=threads, block_bytes=block) == [
            xxh3(s) for s in sources
        ]
        assert all(np.array_equal(t, s) for t, s in zip(targets, sources))
        for b, o, n in zip(backing, offsets, sizes):  # nothing before or after each target
            assert not np.any(b[:o] != POISON) and not np.any(b[o + n :] != POISON)


@pytest.mark.parametrize("block", [1, 7, 4096, BLOCK, 8 << 20])
def test_multi_piece_values_any_block_size(lib, rng, block):
    values, expected = [], []
    for count in (1, 2, 3, 5):
        sizes = rng.choice(SIZES[:-1], count)
        sources = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in sizes]
        values.append(([poisoned(len(s)) for s in sources], sources))
        expected.append(xxh3(*sources))
    assert lib.copy_verify(values, block_bytes=block) == expected
    for targets, sources in values:
        assert [bytes(t) for t in targets] == [s.tobytes() for s in sources]


def test_all_kinds_of_buffers(lib, rng, tmp_path):
    """Sources: bytes, a read-only mapping, a zmq frame, a float memoryview; targets: a
    bytearray, a memoryview slice, a numpy array, a torch tensor's memory."""
    data = rng.integers(0, 256, 4 * BLOCK + 5, dtype=np.uint8).tobytes()
    (tmp_path / "seg").write_bytes(data)
    with open(tmp_path / "seg", "rb") as f:
        mapped = np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), np.uint8)
    floats = memoryview(np.frombuffer(data[:4096], np.float32))
    sources = [data[:1000], mapped[7 : 7 + 2 * BLOCK], zmq.Frame(data[5:BLOCK]).buffer, floats]
    big = poisoned(BLOCK + 10)
    tensor = torch.full((len(floats) * 4,), POISON, dtype=torch.uint8)
    targets = [poisoned(1000), memoryview(big)[10:], np.full(BLOCK - 5, POISON, np.uint8),
               tensor.numpy()]  # fmt: skip
    for i, (target, source) in enumerate(zip(targets, sources)):
        if i == 1:  # the mapping: twice the block, a target to match
            target = np.full(2 * BLOCK, POISON, np.uint8)
            targets[1] = target
        assert lib.copy_verify([([target], [source])]) == [xxh3(source)], i
        assert bytes(memoryview(target).cast("B")) == bytes(source), i


def test_threads_give_the_same_digests(lib, rng):
    values, expected = [], []
    for i in range(40):
        sources = [rng.integers(0, 256, int(n), dtype=np.uint8)
                   for n in rng.integers(0, 3 * BLOCK, 1 + i % 3)]  # fmt: skip
        values.append(([poisoned(len(s)) for s in sources], sources))
        expected.append(xxh3(*sources))
    for threads in (2, 3, 8, 64):
        for targets, _ in values:
            for t in targets:
                t[:] = poisoned(len(t))
        assert lib.copy_verify(values, threads=threads) == expected, threads
        assert all(bytes(t) == s.tobytes() for ts, ss in values for t, s in zip(ts, ss))
    assert lib.copy_verify([], threads=4) == []


def test_bad_input_raises_typed_errors_before_copying(lib):
    good = ([poisoned(10)], [bytes(10)])
    cases = [
        (ValueError, "source 0 has 11 bytes", ([poisoned(10)], [bytes(11)])),
        (ValueError, "1 sources for 2 targets", ([poisoned(1), poisoned(1)], [b"x"])),
        (TypeError, "read-only", ([b"0123456789"], [bytes(10)])),
        (TypeError, "read-only", ([memoryview(poisoned(10)).toreadonly()], [bytes(10)])),
        (TypeError, "not a buffer", ([poisoned(10)], [12345])),
        (ValueError, "not C-contiguous", ([poisoned(5)], [np.zeros(10, np.uint8)[::2]])),
        (ValueError, "not C-contiguous", ([np.zeros(10, np.uint8)[::2]], [bytes(5)])),
    ]
    for kind, message, bad in cases:
        with pytest.raises(kind, match=message):
            lib.copy_verify([good, bad])
        assert good[0][0] == poisoned(10), message  # nothing was copied
    for threads in (0, 65, 1.0, True):
        with pytest.raises(ValueError, match="threads"):
            lib.copy_verify([good], threads=threads)
    with pytest.raises(ValueError, match="block_bytes"):
        lib.copy_verify([good], block_bytes=0)


def _send_in_thread(sock: socket.socket, data: list[bytes]) -> threading.Thread:
    thread = threading.Thread(target=lambda: [sock.sendall(d) for d in data], daemon=True)
    thread.start()
    return thread


@pytest.fixture(params=[1, native.RECV_SLOTS], ids=["one-slot", "handed-over"])
def receive(lib, request):
    """recv_verify with a fresh bounce, poisoned (what it held must never reach a frame), of
    one chunk (this thread does everything) or of RECV_SLOTS chunks (a helper hashes and
    streams what this thread received)."""

    def call(fd, frames, counts, chunk_bytes=BLOCK):
        return lib.recv_verify(fd, frames, counts, bounce=poisoned(chunk_bytes * request.param),
                               chunk_bytes=chunk_bytes)  # fmt: skip

    return call


@pytest.mark.parametrize("chunk", [7, 4096, BLOCK, 8 << 20])
def test_recv_verify_lands_and_hashes_every_value_exactly(receive, rng, chunk):
    counts = [1, 3, 0, 2, 1, 1]
    sizes = [int(n) for n in rng.choice(SIZES, sum(counts))]
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    frames = [poisoned(n) if k % 2 else np.full(n, POISON, np.uint8) for k, n in enumerate(sizes)]
    expected, at = [], 0
    for count in counts:
        expected.append(xxh3(*data[at : at + count]))
        at += count
    a, b = socket.socketpair()
    with a, b:
        sender = _send_in_thread(a, data)
        assert receive(b.fileno(), frames, counts, chunk_bytes=chunk) == expected
        sender.join()
        assert [bytes(memoryview(f).cast("B")) for f in frames] == data
        sender = _send_in_thread(a, data)  # no counts: received, not hashed
        frames = [poisoned(n) for n in sizes]
        assert receive(b.fileno(), frames, None, chunk_bytes=chunk) is None
        sender.join()
        assert [bytes(f) for f in frames] == data


def test_recv_verify_into_frames_at_every_alignment(receive, rng):
    """Frames that start at any offset from a cache line and end mid-line: exact bytes,
    nothing written around them, exact digests; chunks of 4 KiB + 1 so that chunk starts
    drift too."""
    sizes = [int(n) for n in rng.choice(SIZES[4:], 8)] + [BLOCK + 4099]
    offsets = [int(o) for o in rng.integers(1, 64, len(sizes))]
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    backing = [np.full(o + n + 64, POISON, np.uint8) for o, n in zip(offsets, sizes)]
    frames = [b[o : o + n] for b, o, n in zip(backing, offsets, sizes)]
    for chunk in (4097, BLOCK):
        for f in frames:
            f[:] = POISON
        a, b = socket.socketpair()
        with a, b:
            sender = _send_in_thread(a, data)
            assert receive(b.fileno(), frames, [1] * len(frames), chunk_bytes=chunk) == [
                xxh3(d) for d in data
            ]
            sender.join()
        assert [f.tobytes() for f in frames] == data
        for b, o, n in zip(backing, offsets, sizes):  # nothing before or after each frame
            assert not np.any(b[:o] != POISON) and not np.any(b[o + n :] != POISON)


@pytest.mark.parametrize("cut", [3 * BLOCK, 3 * BLOCK + 12_345, BLOCK + 7])
def test_recv_verify_peer_closing_mid_frame_is_eof_with_the_count(receive, rng, cut):
    """A receive cut short (at a chunk's end or in the middle of one, of a frame received
    through the bounce): every byte that came is in its place, nothing after it is written."""
    data = rng.integers(0, 256, cut, dtype=np.uint8).tobytes()
    frames = [poisoned(BLOCK), poisoned(3 * BLOCK)]
    a, b = socket.socketpair()
    with a, b:

        def send_then_end() -> None:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send_then_end)
        sender.start()
        with pytest.raises(EOFError, match=f"after {cut} of {4 * BLOCK} bytes"):
            receive(b.fileno(), frames, [1, 1])
        sender.join()
    landed = bytes(frames[0]) + bytes(frames[1])
    assert landed[:cut] == data and landed[cut:] == bytes(poisoned(4 * BLOCK - cut))


@pytest.mark.parametrize("size, sent", [(20, 10), (2 * BLOCK, BLOCK + 5000)])
def test_recv_verify_stalled_peer_ends_at_the_sockets_receive_timeout(receive, rng, size, sent):
    data = rng.integers(0, 256, sent, dtype=np.uint8).tobytes()
    a, b = socket.socketpair()
    with a, b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0.05))
        sender = _send_in_thread(a, [data])
        frame = poisoned(size)
        with pytest.raises(BlockingIOError, match=f"after {sent} of {size} bytes"):
            receive(b.fileno(), [frame], [1])
        sender.join()
        assert frame[:sent] == data and frame[sent:] == poisoned(size - sent)


def test_recv_verify_ends_when_another_thread_shuts_the_socket_down(receive, rng):
    """The bulk lane's abort: a shutdown from another thread wakes a receive that waits for
    the rest of a frame; it ends with EOFError, and the socket stays open (no fd reuse)."""
    first = rng.integers(1, 256, BLOCK, dtype=np.uint8).tobytes()  # no POISON-free check
    frame = np.zeros(2 * BLOCK, np.uint8)
    a, b = socket.socketpair()
    with a, b:
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                receive(b.fileno(), [frame], [1], chunk_bytes=BLOCK // 2)
            except BaseException as e:  # handed to the test's thread
                outcome.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        a.sendall(first)
        while frame[BLOCK - 1] == 0:  # the first half has landed: the call waits for more
            thread.join(0.001)
        b.shutdown(socket.SHUT_RDWR)
        thread.join(10)
        assert not thread.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], EOFError) and b.fileno() >= 0


def test_recv_verify_bad_input_refused_before_reading(lib):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"0123456789")
        cases = [
            (TypeError, "read-only", [b"0123456789"], [1]),
            (ValueError, "not C-contiguous", [np.zeros(20, np.uint8)[::2]], [1]),
            (ValueError, "do not add up", [poisoned(5), poisoned(5)], [1]),
            (ValueError, "do not add up", [poisoned(5), poisoned(5)], [3, -1]),
        ]
        bounce = poisoned(BLOCK)
        for kind, message, frames, counts in cases:
            with pytest.raises(kind, match=message):
                lib.recv_verify(b.fileno(), frames, counts, bounce=bounce)
        with pytest.raises(ValueError, match="chunk_bytes"):
            lib.recv_verify(b.fileno(), [poisoned(10)], [1], bounce=bounce, chunk_bytes=0)
        with pytest.raises(ValueError, match="bounce of 4095 bytes"):
            lib.recv_verify(b.fileno(), [poisoned(10)], [1], bounce=poisoned(4095),
                            chunk_bytes=4096)  # fmt: skip
        with pytest.raises(TypeError, match="bounce is read-only"):
            lib.recv_verify(b.fileno(), [poisoned(10)], [1], bounce=bytes(BLOCK))
        frame = poisoned(10)  # every byte is still there to read
        assert lib.recv_verify(b.fileno(), [frame], [1], bounce=bounce) == [xxh3(b"0123456789")]
        assert frame == b"0123456789"


def test_recv_verify_c_call_refuses_a_missing_bounce(lib):
    """The C receive has one path (large frames through the bounce): a NULL bounce is -EINVAL,
    before a byte is read."""
    import ctypes
    import errno

    a, b = socket.socketpair()
    with a, b:
        n = 64 << 10  # a frame that takes the bounce, small enough for the socket's buffer
        payload = os.urandom(n)
        a.sendall(payload)
        frame = poisoned(n)
        arr = np.frombuffer(frame, np.uint8)
        pieces = (native.Piece * 1)((arr.__array_interface__["data"][0], None, n))
        values = (native.Value * 1)((0, 1, 0))
        received = ctypes.c_uint64(7)
        rc = lib._recv(b.fileno(), pieces, 1, values, 1, BLOCK, None, 0, 0,
                       ctypes.byref(received))  # fmt: skip
        assert (rc, received.value) == (-errno.EINVAL, 0)
        assert frame == poisoned(n)
        assert lib.recv_verify(b.fileno(), [frame], [1], bounce=poisoned(BLOCK)) == [xxh3(payload)]
        assert frame == payload


def test_recv_verify_ends_at_its_deadline_however_the_bytes_come(lib):
    """``deadline_ns``: the receive ends with TimeoutError once it passes (within an eighth of
    the time it had), though the socket's own receive timeout (10 s) never ran out; a
    deadline already past reads nothing; a bad one is refused before reading."""
    import time

    a, b = socket.socketpair()
    with a, b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(10.0))
        a.sendall(os.urandom(100_000))  # of 1 MiB: the rest never comes
        frame = poisoned(1 << 20)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            lib.recv_verify(b.fileno(), [frame], [1], bounce=poisoned(BLOCK),
                            deadline_ns=time.monotonic_ns() + 300_000_000)  # fmt: skip
        assert 0.3 <= time.monotonic() - start < 1.3
        with pytest.raises(TimeoutError):
            lib.recv_verify(b.fileno(), [poisoned(10)], [1], bounce=poisoned(BLOCK),
                            deadline_ns=time.monotonic_ns() - 1)  # fmt: skip
        for bad in (-1, 1.5, None):
            with pytest.raises(ValueError, match="deadline_ns"):
                lib.recv_verify(b.fileno(), [poisoned(10)], [1], bounce=poisoned(BLOCK),
                                deadline_ns=bad)  # fmt: skip


def _timeval(seconds: float) -> bytes:
    from pagekv.store.wire.lane import timeval

    return timeval(seconds)


def _message(header: bytes, frames: list[bytes], magic: bytes = b"PKB1") -> bytes:
    """A bulk-lane message (pagekv.store.wire.lane's framing)."""
    sizes = [len(f) for f in frames]
    prefix = struct.pack("<4sIIQ", magic, len(header), len(sizes), sum(sizes))
    return prefix + struct.pack(f"<{len(sizes)}Q", *sizes) + header + b"".join(frames)


LIMITS = dict(max_header=1 << 20, max_frames=64, max_frame_bytes=8 << 20, max_payload=64 << 20)


@pytest.mark.parametrize("slots", [1, native.RECV_SLOTS], ids=["one-slot", "handed-over"])
def test_recv_message_lands_a_payload_where_expected_and_leaves_any_other(lib, rng, slots):
    """One call reads a message's head and, when its frames are exactly the ones expected (as
    many, each of the same size), its payload into them, hashed per value; a message whose
    frames differ (a size, or their number) has its head read and its payload left on the
    socket, whole, for the next receive."""
    counts = [2, 1, 1]
    sizes = [int(n) for n in rng.choice(SIZES[1:], sum(counts))]
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    header = rng.integers(0, 256, 300, dtype=np.uint8).tobytes()
    expected = [xxh3(data[0], data[1]), xxh3(data[2]), xxh3(data[3])]
    head = poisoned(native.BLOCK_BYTES)
    a, b = socket.socketpair()
    with a, b:
        sender = _send_in_thread(a, [_message(header, data)] * 3)
        frames = [poisoned(n) for n in sizes]
        got = lib.recv_message(b.fileno(), head, **LIMITS, frames=frames, counts=counts,
                               bounce=poisoned(BLOCK * slots))  # fmt: skip
        assert (got.code, got.landed, got.digests) == (0, True, expected)
        assert [bytes(f) for f in frames] == data
        assert bytes(head[20 + 8 * len(sizes) : got.head_bytes]) == header
        assert got.received == got.head_bytes + sum(sizes)
        for other in ([poisoned(n) for n in sizes[:-1]],  # one frame fewer
                      [poisoned(n + 1 if k == 2 else n) for k, n in enumerate(sizes)]):  # fmt: skip
            got = lib.recv_message(b.fileno(), head, **LIMITS, frames=other,
                                   counts=[1] * len(other), bounce=poisoned(BLOCK))  # fmt: skip
            assert (got.code, got.landed, got.digests) == (0, False, None)
            assert all(bytes(f) == bytes([POISON]) * len(f) for f in other)  # nothing written
            assert struct.unpack_from(f"<{len(sizes)}Q", head, 20) == tuple(sizes)
            frames = [poisoned(n) for n in sizes]  # the payload is still there, whole
            assert lib.recv_verify(b.fileno(), frames, counts, bounce=poisoned(BLOCK)) == expected
            assert [bytes(f) for f in frames] == data
        sender.join()


def test_recv_message_says_how_a_message_ended_or_broke_its_limits(lib):
    """Each outcome has its code, and only what a code says was read is read: the end of the
    connection before a byte (1) or within the head (2), a message not in the lane's framing
    (3), over a limit (4: checked on the prefix, and on the sizes), a head larger than the
    buffer (5: its prefix read, its size said), nothing within the socket's receive timeout
    (-EAGAIN, nothing received)."""

    def one(data: bytes, *, shut: bool = True, cap: int = 4096, **limits) -> native.Message:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data)
            if shut:
                a.shutdown(socket.SHUT_WR)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
            return lib.recv_message(b.fileno(), bytearray(cap), **{**LIMITS, **limits})

    ok = _message(b"h" * 40, [b"x" * 10, b"y" * 20])
    assert one(ok).code == 0 and one(ok).head_bytes == 20 + 16 + 40
    assert one(b"").code == 1
    assert (one(ok[:10]).code, one(ok[:10]).received) == (2, 10)
    assert one(ok[:30]).code == 2  # within the sizes
    assert one(_message(b"h", [], magic=b"HTTP")).code == 3
    assert one(ok, max_frames=1).code == 4
    assert one(ok, max_header=39).code == 4
    assert one(ok, max_payload=29).code == 4
    assert one(ok, max_frame_bytes=19).code == 4  # on the sizes
    sizes_lie = bytearray(ok)
    struct.pack_into("<Q", sizes_lie, 20, 11)  # the sizes add up to 31, the prefix says 30
    assert one(bytes(sizes_lie)).code == 4
    big = one(ok, cap=40)
    assert (big.code, big.head_bytes, big.received) == (5, 76, 20)
    idle = one(b"", shut=False)
    assert (idle.code, idle.received) == (-errno.EAGAIN, 0)
    stalled = one(ok[:25], shut=False)
    assert (stalled.code, stalled.received) == (-errno.EAGAIN, 25)


def test_read_head_reads_a_head_larger_than_its_buffer(lib, rng):
    """A head past the reader's buffer (a PUT of many frames) is read on after its prefix: the
    same head as with a buffer that holds it, its payload left to read."""
    from pagekv.store.wire.lane import read_head

    frames = [rng.integers(0, 256, 5, dtype=np.uint8).tobytes() for _ in range(50)]
    header = rng.integers(0, 256, 500, dtype=np.uint8).tobytes()
    heads = []
    for cap in (64, 4096):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(_message(header, frames))
            heads.append(read_head(b, lib, bytearray(cap), max_frames=64, max_frame_bytes=64,
                                   max_payload_bytes=1 << 20))  # fmt: skip
            assert b.recv(250, socket.MSG_WAITALL) == b"".join(frames)
    assert heads[0] == heads[1]
    assert (heads[0].header, heads[0].sizes, heads[0].landed) == (header, (5,) * 50, False)


def test_copy_checksum_same_digest_native_and_off(fresh_cache, monkeypatch, rng):
    values = [[rng.integers(0, 256, int(n), dtype=np.uint8) for n in sizes]
              for sizes in ([5], [70_000], [BLOCK + 3, 1, 9 << 20], [6 << 20])]  # fmt: skip
    results = {}
    for how in ("off", "on"):
        monkeypatch.setenv("PAGEKV_NATIVE_COPY", how)
        assert (native.load() is None) == (how == "off")
        digests = []
        for sources in values:
            targets = [memoryview(poisoned(s.size)) for s in sources]
            digests.append(copies.copy_checksum(targets, sources))
            assert [bytes(t) for t in targets] == [s.tobytes() for s in sources]
        results[how] = digests
    assert results["on"] == results["off"] == [xxh3(*s) for s in values]
    assert len(list(fresh_cache.glob("*.so"))) == 1  # built by "on" only


def test_on_with_a_broken_compiler_raises_naming_it(fresh_cache, monkeypatch):
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", "on")
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(NativeCopyUnavailable, match="/bin/false") as info:
        native.load()
    assert "PAGEKV_NATIVE_COPY" in str(info.value) and isinstance(info.value, RuntimeError)
    with pytest.raises(NativeCopyUnavailable):
        copies.copy_checksum([memoryview(poisoned(1 << 20))], [bytes(1 << 20)])
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-cc"))
    with pytest.raises(NativeCopyUnavailable, match="no-such-cc"):
        native.load()


def test_a_compile_error_is_reported_with_the_compilers_output(fresh_cache, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'fake cc 1.0' && exit 0\n"
                  "echo 'copy_verify.c:1: error: nope' >&2; exit 3\n")  # fmt: skip
    cc.chmod(0o755)
    with pytest.raises(NativeCopyUnavailable, match=r"(?s)exit 3.*error: nope.*PAGEKV_NATIVE"):
        native.build_library(cc=[str(cc)])
    assert not list(fresh_cache.glob("*.so")) and not list(fresh_cache.glob("tmp*"))


def test_auto_with_a_broken_compiler_falls_back_and_says_so_once(fresh_cache, monkeypatch,
                                                                  caplog):  # fmt: skip
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", "auto")
    monkeypatch.setenv("CC", "/bin/false")
    native._log_once.cache_clear()
    src = os.urandom(3 << 20)
    with caplog.at_level(logging.WARNING, logger="pagekv.store.wire.native"):
        assert native.load() is None and native.load() is None
        target = memoryview(poisoned(len(src)))
        assert copies.copy_checksum([target], [src]) == xxh3(src) and target == src
    warnings = [r for r in caplog.records if "native checked copy unavailable" in r.message]
    assert len(warnings) == 1 and "/bin/false" in warnings[0].message
    assert "/bin/false" in native.unavailable_reason()
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", "sometimes")
    with pytest.raises(ValueError, match="PAGEKV_NATIVE_COPY"):
        native.load()


def test_build_is_cached(fresh_cache):
    first = native.build_library()
    stamp = first.stat().st_mtime_ns
    assert native.build_library() == first and first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in fresh_cache.iterdir()) == [first.name, first.name + ".lock"]


BUILDER = textwrap.dedent("""
    import sys
    from pagekv.store.wire import native
    print("ready", flush=True)
    sys.stdin.readline()  # the parent starts both builds together
    lib = native.load()
    data = bytes(range(256)) * 4099
    out = bytearray(len(data))
    print(lib.path, lib.copy_verify([([out], [data])])[0], out == data, flush=True)
""")


def test_two_processes_building_at_once_end_with_one_library(fresh_cache, monkeypatch):
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", "on")
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    for proc in procs:
        assert proc.stdout.readline() == "ready\n"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [proc.communicate(timeout=120)[0].split() for proc in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    expected = str(xxh3(bytes(range(256)) * 4099))
    assert outs[0] == outs[1] and outs[0][1:] == [expected, "True"]
    libs = list(fresh_cache.glob("*.so"))
    assert [str(p) for p in libs] == [outs[0][0]]
    assert not list(fresh_cache.glob("tmp*"))  # no half-built leftovers
