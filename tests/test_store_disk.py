"""The disk tier on its own (pagekv/store/node/disk.py): round trips, reclaim, restarts (clean,
torn, killed), corruption, a full disk, I/O errors, two openers, reads racing reclaim.

Failures are injected two ways: a real small tmpfs (mounted when the test runs as root and may
mount; else those tests skip) and :class:`FailingOps`, a :class:`FileOps` whose chosen calls
fail: the tier's one seam for file system calls. No test sleeps to synchronise: they wait on
events, futures and flushes, each with a bounded timeout. The tier catches what its threads
raise and turns itself off, saying why in ``tier.error``: the ``tiers`` fixture fails every test
whose tier did so unexpectedly.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import select
import subprocess
import sys
import textwrap
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import xxhash

from pagekv.errors import ConfigError
from pagekv.store.node import disk_segment
from pagekv.store.node.disk import (
    DiskConfig,
    DiskDirLocked,
    DiskFormatError,
    DiskTier,
    FileOps,
)
from tests.helpers import wait_until

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def payload(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def offer(tier: DiskTier, i: int, size: int) -> bool:
    data = payload(i, size)
    return tier.offer(key_of(i), [data], len(data), xxhash.xxh3_64_intdigest(data))


def joined(block) -> bytes:
    return b"".join(bytes(f) for f in block.frames)


class FailingOps(FileOps):
    """File calls that fail on demand: ``fail[name] = errno`` makes every later call of that
    method raise it (``once`` too: only the next one)."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}
        self.once: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def _check(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        code = self.once.pop(name, None) or self.fail.get(name)
        if code:
            raise OSError(code, os.strerror(code))

    def pwritev(self, fd, buffers, offset):
        self._check("pwritev")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd, buffers, offset):
        self._check("preadv")
        return super().preadv(fd, buffers, offset)

    def fdatasync(self, fd):
        self._check("fdatasync")
        super().fdatasync(fd)

    def open(self, path, flags, mode=0o600):
        self._check("open")
        return super().open(path, flags, mode)


@pytest.fixture
def tiers(tmp_path):
    """``make(**config)`` opens a tier on ``tmp_path/disk``; each is closed at teardown, and a
    tier that turned itself off fails the test unless the test said so (``tier.expect_off``)."""
    made: list[DiskTier] = []

    def make(directory: Path | None = None, io: FileOps | None = None, **kw) -> DiskTier:
        kw.setdefault("capacity", 16 * MIB)
        kw.setdefault("segment_bytes", MIB)
        tier = DiskTier(DiskConfig(str(directory or tmp_path / "disk"), **kw), io=io)
        tier.expect_off = False
        made.append(tier)
        return tier

    yield make
    for tier in made:
        error = tier.error
        tier.close(5)
        assert tier.expect_off or error is None, error


@pytest.fixture
def poisoned(monkeypatch):
    """Every read buffer starts full of 0xA5: a byte the read did not write shows."""
    real = disk_segment.aligned_buffer

    def poisoned_buffer(n):
        buf = real(n)
        buf[:] = b"\xa5" * n
        return buf

    monkeypatch.setattr(disk_segment, "aligned_buffer", poisoned_buffer)


@contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def read_all(tier: DiskTier, ids, timeout=10.0):
    return dict(zip(ids, tier.read_many_wait([key_of(i) for i in ids], timeout)))


# ---- round trips --------------------------------------------------------------------------------
def test_round_trip_byte_exact_from_queue_page_cache_and_direct(tiers, poisoned):
    tier = tiers()
    sizes = {i: s for i, s in enumerate([1, 4095, 4096, 4097, 65536, 300_001, 700_000] * 3)}
    for i, size in sizes.items():
        assert offer(tier, i, size)
    queued = read_all(tier, sizes)  # some still queued: their frames come back as offered
    assert tier.flush(10)
    written = read_all(tier, sizes)  # the active segment through the page cache, sealed ones
    assert tier.close(10)  # O_DIRECT; after close every segment is sealed
    tier = tiers()
    reopened = read_all(tier, sizes)
    for results in (queued, written, reopened):
        for i, size in sizes.items():
            assert results[i] is not None and joined(results[i]) == payload(i, size), i
            assert results[i].checksum == xxhash.xxh3_64_intdigest(payload(i, size))
    assert tier.stats()["disk_blocks"] == len(sizes)


def test_blocks_of_several_frames_come_back_as_their_frames(tiers, poisoned):
    tier = tiers()
    frames = [payload(1, 1000), b"", payload(2, 70_000), payload(3, 5)]
    data = b"".join(frames)
    assert tier.offer(b"k" * 20, frames, len(data), xxhash.xxh3_64_intdigest(data))
    assert tier.close(10)
    tier = tiers()
    (block,) = tier.read_many_wait([b"k" * 20], 10)
    assert [bytes(f) for f in block.frames] == frames
    assert all(f.readonly for f in block.frames)


def test_blocks_written_together_are_read_together(tiers, poisoned):
    tier = tiers(capacity=32 * MIB, segment_bytes=4 * MIB, read_threads=2)
    for i in range(40):  # 40 x 100 kB: a 4 MiB run holds 41 of them
        offer(tier, i, 100_000)
    assert tier.close(10)
    tier = tiers(capacity=32 * MIB, segment_bytes=4 * MIB, read_threads=2)
    wanted = [*range(5, 25), 30, 32, 99]  # two shares of 11: two runs, and 30 and 32 alone
    found = read_all(tier, wanted)
    assert found[99] is None
    for i in wanted[:-1]:
        assert joined(found[i]) == payload(i, 100_000)
    assert tier.stats()["disk_read_ops"] == 4


def test_without_o_direct_sealed_segments_are_read_through_the_page_cache(tiers, poisoned):
    class NoDirect(FileOps):
        def open(self, path, flags, mode=0o600):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "O_DIRECT refused")
            return super().open(path, flags, mode)

    tier = tiers(io=NoDirect())
    for i in range(30):
        offer(tier, i, 100_000)
    assert tier.close(10)
    tier = tiers(io=NoDirect())
    found = read_all(tier, range(30))
    assert all(joined(found[i]) == payload(i, 100_000) for i in range(30)) and tier.on


@pytest.mark.parametrize(
    "bad",
    [{"segment_bytes": 1000}, {"capacity": "1MiB"}, {"read_threads": 0}, {"capacity": "lots"},
     {"rewrite_fraction": 1.0}, {"write_queue_bytes": 0}],
)  # fmt: skip
def test_bad_configs_are_refused_naming_the_field(tmp_path, bad):
    fields = {"capacity": 16 * MIB, "segment_bytes": MIB, **bad}
    with pytest.raises(ConfigError, match="DiskConfig"):
        DiskConfig(str(tmp_path), **fields)


def test_completions_wake_the_polled_fd(tiers):
    tier = tiers()
    for i in range(3):
        offer(tier, i, 10_000)
    assert tier.flush(10)
    tier.read_many([key_of(0), key_of(9), key_of(2)], token="req-1")
    done = []
    while not done:
        readable, _, _ = select.select([tier.wakeup_fd], [], [], 10)
        assert readable, "no completion within 10 s"
        done += tier.completed()
    ((token, blocks),) = done
    assert token == "req-1" and blocks[1] is None
    assert joined(blocks[0]) == payload(0, 10_000) and joined(blocks[2]) == payload(2, 10_000)


def test_exists_answers_for_queued_and_written_blocks(tiers):
    gate = threading.Event()

    class Slow(FileOps):
        def pwritev(self, fd, buffers, offset):
            assert gate.wait(10)
            return super().pwritev(fd, buffers, offset)

    tier = tiers(io=Slow())
    offer(tier, 1, 5000)
    assert tier.contains(key_of(1)) and tier.size_of(key_of(1)) == 5000  # queued, not written
    assert not tier.contains(key_of(2)) and tier.size_of(key_of(2)) is None
    gate.set()
    assert tier.flush(10)
    assert tier.contains(key_of(1)) and tier.size_of(key_of(1)) == 5000


def test_a_block_going_from_the_queue_to_the_index_is_never_in_neither(tiers, monkeypatch):
    """``contains`` and ``size_of`` take no lock: when a written block moves from the queue
    to the index, a reader between the two steps must still find it (it found neither: a GET
    answered NOT_FOUND, EXISTS false, a PUT stored the key again)."""
    from pagekv.store.node.disk_index import DiskIndex

    tier = tiers()
    seen: list[tuple[bool, int | None]] = []
    real = DiskIndex.put

    def put(index, key, entry):  # what a lock-free reader sees as the index takes the key
        seen.append((tier.contains(key), tier.size_of(key)))
        real(index, key, entry)

    monkeypatch.setattr(DiskIndex, "put", put)
    for i in range(4):
        assert offer(tier, i, 5000)
    assert tier.flush(10)
    assert seen == [(True, 5000)] * 4


def test_a_full_queue_drops_without_waiting(tiers):
    gate = threading.Event()

    class Stuck(FileOps):
        def pwritev(self, fd, buffers, offset):
            assert gate.wait(10)
            return super().pwritev(fd, buffers, offset)

    tier = tiers(io=Stuck(), write_queue_bytes=256 << 10)
    results = [offer(tier, i, 100_000) for i in range(6)]  # the writer is stuck on a header
    assert results[:2] == [True, True] and not all(results)
    assert tier.stats()["disk_write_dropped"] == results.count(False)
    gate.set()
    assert tier.flush(10)
    found = read_all(tier, range(6))
    assert all((found[i] is not None) == ok for i, ok in enumerate(results))


def test_delete_survives_a_restart(tiers):
    tier = tiers()
    for i in range(4):
        offer(tier, i, 20_000)
    assert tier.flush(10)
    assert tier.delete(key_of(1)) and not tier.delete(key_of(7))
    assert not tier.contains(key_of(1))
    assert tier.close(10)
    tier = tiers()
    found = read_all(tier, range(4))
    assert found[1] is None and all(found[i] is not None for i in (0, 2, 3))


# ---- capacity -----------------------------------------------------------------------------------
def test_deletes_queued_when_the_shutdown_budget_runs_out_are_still_written(tiers):
    """close() past its budget drops the blocks still queued (a miss after the restart, said
    as such), never the deletes: a dropped tombstone served the deleted key again after the
    restart, and close() called the shutdown clean."""
    gate, writing = threading.Event(), threading.Event()

    class Slow(FileOps):
        def pwritev(self, fd, buffers, offset):
            if not gate.is_set():
                writing.set()
                assert gate.wait(20)
            return super().pwritev(fd, buffers, offset)

    gate.set()
    tier = tiers(io=Slow())
    assert offer(tier, 1, 50_000) and tier.flush(10)
    gate.clear()
    assert offer(tier, 2, 50_000) and writing.wait(10)  # the writer is busy with block 2
    assert offer(tier, 3, 50_000) and tier.delete(key_of(1))
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(tier.close(0.0)))
    closer.start()
    wait_until(lambda: tier._closing, 10, "close() to begin")
    gate.set()
    closer.join(30)
    assert closed == [False] and tier.counters["write_dropped_at_close"] == 1  # block 3
    assert tier.counters["deletes_unsaved"] == 0
    found = read_all(tiers(), [1, 2, 3])
    assert found[1] is None and found[3] is None and joined(found[2]) == payload(2, 50_000)


def test_a_delete_whose_tombstone_cannot_be_written_is_counted_and_said(tiers, caplog):
    """A tombstone dropped with its batch (no descriptor free for a new segment) leaves the
    key to come back after a restart: counted, said, and close() does not call it clean."""
    first = tiers()
    assert offer(first, 1, 50_000) and first.close(10)
    ops = FailingOps()
    tier = tiers(io=ops)
    ops.once["open"] = errno.EMFILE  # the segment the tombstone needs
    with caplog.at_level(logging.WARNING, logger="pagekv.store.disk"):
        assert tier.delete(key_of(1)) and tier.flush(10)
    assert tier.counters["deletes_unsaved"] == 1
    assert "1 delete(s) not saved (no_descriptor)" in caplog.text
    assert not tier.close(10)


def test_reclaim_takes_the_oldest_segments_and_keeps_the_disk_within_capacity(tiers, tmp_path):
    tier = tiers(capacity=4 * MIB, segment_bytes=MIB, rewrite_fraction=0)
    for i in range(120):  # ~12 MiB through a 4 MiB disk
        assert offer(tier, i, 100_000)
        if i % 10 == 9:
            assert tier.flush(10)
            on_disk = sum(p.stat().st_size for p in (tmp_path / "disk").iterdir())
            assert tier.stats()["disk_used_bytes"] <= 4 * MIB and on_disk <= 4 * MIB + 4096
    found = read_all(tier, range(120))
    present = [i for i in range(120) if found[i] is not None]
    assert present == list(range(present[0], 120))  # a suffix: the oldest went first
    assert len(present) >= 20  # at least two segments' worth of the newest are kept
    stats = tier.stats()
    assert stats["disk_reclaimed_segments"] >= 6
    assert stats["disk_reclaimed_blocks"] + stats["disk_blocks"] == 120
    for i in present:
        assert joined(found[i]) == payload(i, 100_000)


def test_a_block_offered_again_from_an_old_segment_is_rewritten_and_outlives_it(tiers):
    tier = tiers(capacity=6 * MIB, segment_bytes=MIB, rewrite_fraction=0.5)
    assert offer(tier, 0, 100_000)
    for i in range(1, 40):
        offer(tier, i, 100_000)
    assert tier.flush(10)
    assert not offer(tier, 39, 100_000)  # in a young segment: skipped, not written twice
    assert offer(tier, 0, 100_000)  # old: written again (memory had promoted it)
    for i in range(40, 70):
        offer(tier, i, 100_000)
    assert tier.flush(10)
    stats = tier.stats()
    assert stats["disk_rewrites"] == 1 and stats["disk_write_skipped"] == 1
    found = read_all(tier, [0, 1])
    assert found[1] is None and joined(found[0]) == payload(0, 100_000)


def test_a_smaller_capacity_at_restart_reclaims_down_to_it(tiers, tmp_path):
    tier = tiers(capacity=8 * MIB)
    for i in range(60):
        offer(tier, i, 100_000)
    assert tier.close(10)
    tier = tiers(capacity=3 * MIB)
    stats = tier.stats()
    assert stats["disk_used_bytes"] <= 3 * MIB and stats["disk_reclaimed_segments"] >= 3
    found = read_all(tier, range(60))
    present = [i for i in range(60) if found[i] is not None]
    assert present == list(range(present[0], 60)) and len(present) == stats["disk_blocks"]


def test_a_clean_restart_of_a_tier_at_capacity_reclaims_nothing(tiers, tmp_path):
    """A segment is made only with room for it and its directory (as large as the largest so
    far): room for the segment alone let the directory written when it was sealed take the
    tier over its capacity, and the next start reclaimed a whole segment of stored blocks."""
    probe = tiers(tmp_path / "probe", capacity=16 * MIB)
    per = 0
    while probe.stats()["disk_segments"] < 2:  # how many 4 KiB blocks fill a segment
        per += 1
        offer(probe, per, 4096)
        assert probe.flush(10)
    per -= 1
    assert probe.close(10)
    seg = (tmp_path / "probe" / "0000000000000001.seg").stat().st_size
    directory = (tmp_path / "probe" / "0000000000000001.dir").stat().st_size
    capacity = 2 * (seg + directory) + MIB + 1000  # three segments fit only without a directory
    tier = tiers(capacity=capacity)
    for i in range(3 * per):
        offer(tier, i, 4096)
    assert tier.flush(10)
    before = tier.stats()
    assert tier.close(10)
    files = [f for f in (tmp_path / "disk").iterdir() if f.suffix in (".seg", ".dir")]
    assert sum(f.stat().st_size for f in files) <= capacity
    after = tiers(capacity=capacity).stats()
    assert after["disk_reclaimed_segments"] == 0
    assert after["disk_blocks"] == before["disk_blocks"]


def test_a_writer_stuck_past_close_keeps_the_directory_locked_until_it_ends(tiers, tmp_path):
    """close() stops waiting for a writer stuck in a write; the directory must stay locked
    while that writer may still write to it (a node started on it could read a segment as it
    changes), and be released the moment the writer ends."""
    gate, writing = threading.Event(), threading.Event()

    class Stuck(FileOps):
        def pwritev(self, fd, buffers, offset):
            writing.set()
            assert gate.wait(30)
            return super().pwritev(fd, buffers, offset)

    tier = tiers(io=Stuck())
    assert offer(tier, 1, 50_000) and writing.wait(10)
    try:
        assert not tier.close(0.0)  # waits 5 s for the writer, then leaves it
        with pytest.raises(DiskDirLocked):
            DiskTier(DiskConfig(str(tmp_path / "disk"), capacity=16 * MIB, segment_bytes=MIB))
    finally:
        gate.set()
    tier._writer.join(10)
    assert not tier._writer.is_alive()
    again = tiers()  # released by the writer as it ended
    assert joined(read_all(again, [1])[1]) == payload(1, 50_000)


def test_blocks_larger_than_a_segment_are_refused(tiers):
    tier = tiers(segment_bytes=MIB)
    assert not offer(tier, 1, MIB)
    assert tier.stats()["disk_write_too_large"] == 1


# ---- restarts -----------------------------------------------------------------------------------
def test_clean_shutdown_saves_memory_blocks_and_restarts_from_directories(tiers):
    tier = tiers(capacity=32 * MIB)
    for i in range(10):
        offer(tier, i, 50_000)
    memory = [(key_of(i), [payload(i, 60_000)], 60_000,
               xxhash.xxh3_64_intdigest(payload(i, 60_000))) for i in range(10, 40)]  # fmt: skip
    assert tier.save(memory, 10) == 30
    assert tier.close(10)
    tier = tiers(capacity=32 * MIB)
    assert tier.stats()["disk_rebuild_scanned_bytes"] == 0  # every segment had its directory
    found = read_all(tier, range(40))
    for i in range(40):
        assert joined(found[i]) == payload(i, 50_000 if i < 10 else 60_000)


def test_a_shutdown_save_rewrites_blocks_whose_segment_its_own_writes_reclaim(tiers):
    """A block in memory at shutdown and on disk in the oldest segment (read back from there
    earlier) must not be skipped by the save: the save's writes reclaim that segment, and
    the most wanted block was gone after the restart."""
    size = 64 << 10
    tier = tiers(capacity=4 * MIB, segment_bytes=MIB)
    for i in range(44):  # block 0 in the oldest of about three full segments
        offer(tier, i, size)
    assert tier.flush(10)
    memory = [(key_of(i), [payload(i, size)], size, xxhash.xxh3_64_intdigest(payload(i, size)))
              for i in [0, 43, *range(100, 127)]]  # fmt: skip
    queued = tier.save(memory, 10)
    assert tier.close(10)
    tier = tiers(capacity=4 * MIB, segment_bytes=MIB)
    found = read_all(tier, [0, 43, *range(100, 127)])
    assert [joined(b) if b is not None else None for b in found.values()] == [
        m[1][0] for m in memory]  # fmt: skip
    assert queued == len(memory) - 1  # block 43, in the newest segment, was not written again


def test_a_restart_with_no_room_for_a_directory_serves_every_block(tiers, tmp_path):
    """A start after a crash scans the segment that was being written and writes its
    directory; on a full file system that write fails. The segment is served without one
    (the next start scans it again), as a running tier does: the whole tier was turned off."""

    class Full(FileOps):  # new files get no data: a full file system
        def __init__(self) -> None:
            self.tmp: set[int] = set()

        def open(self, path, flags, mode=0o600):
            fd = super().open(path, flags, mode)
            if path.endswith(".tmp"):
                self.tmp.add(fd)
            return fd

        def pwritev(self, fd, buffers, offset):
            if fd in self.tmp:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().pwritev(fd, buffers, offset)

    tier = tiers()
    for i in range(40):  # sealed segments and the active one
        offer(tier, i, 60_000)
    assert tier.flush(10)
    crashed = tmp_path / "crashed"  # the files as a kill -9 leaves them: no active directory
    crashed.mkdir()
    for f in (tmp_path / "disk").iterdir():
        if f.name != "lock":
            crashed.joinpath(f.name).write_bytes(f.read_bytes())
    full = tiers(crashed, io=Full())
    assert full.on, full.error
    assert all(joined(b) == payload(i, 60_000) for i, b in read_all(full, range(40)).items())
    assert not [f.name for f in crashed.iterdir() if f.name.endswith(".tmp")]


@pytest.mark.parametrize("torn", ["short", "zeroed"])
def test_a_torn_tail_is_cut_and_every_whole_record_served(tiers, tmp_path, poisoned, torn):
    tier = tiers(capacity=32 * MIB, segment_bytes=4 * MIB)
    for i in range(30):
        offer(tier, i, 90_000)
    assert tier.close(10)
    segs = sorted((tmp_path / "disk").glob("*.seg"))
    last = segs[-1]
    (last.with_suffix(".dir")).unlink()  # as if it was the active segment when the node died
    size = last.stat().st_size
    if torn == "short":  # the last record's write had not completed
        os.truncate(last, size - 50_000)
    else:  # the file had grown, but its last pages never reached the disk (a power cut)
        with open(last, "r+b") as f:
            f.seek(size - 50_000)
            f.write(bytes(50_000))
    tier = tiers(capacity=32 * MIB, segment_bytes=4 * MIB)
    stats = tier.stats()
    assert stats["disk_rebuild_torn"] == 1 and stats["disk_blocks"] == 29
    found = read_all(tier, range(30))
    assert found[29] is None
    for i in range(29):
        assert joined(found[i]) == payload(i, 90_000)
    assert last.stat().st_size < size - 50_000  # cut at the end of the last whole record
    assert last.with_suffix(".dir").exists()  # and given its directory: the next start reads it


def _damage_a_record(tiers, tmp_path, pick):
    """20 records of 60,000 bytes written to one segment and the tier closed, the segment's
    directory removed (the next start scans it), and one record's payload flipped: ``pick``
    chooses it from the records' indices in file order. Returns its index."""
    tier = tiers(capacity=32 * MIB, segment_bytes=4 * MIB)
    for i in range(20):
        offer(tier, i, 60_000)
    assert tier.close(10)
    seg = sorted((tmp_path / "disk").glob("*.seg"))[-1]
    seg.with_suffix(".dir").unlink()
    data = bytearray(seg.read_bytes())
    where = {i: data.index(payload(i, 60_000)[:64]) for i in range(20)}
    bad = pick(sorted(where, key=where.get))
    data[where[bad] + 1000] ^= 0xFF
    seg.write_bytes(bytes(data))
    return bad


def test_a_damaged_record_is_skipped_and_the_records_after_it_served(tiers, tmp_path, caplog):
    """A scan (a segment without its directory) that meets a record whose payload fails its
    checksum skips that record and goes on: it stopped there and cut every intact record
    after it off the file, and a damaged first record removed the whole file unsaid."""
    # not the file's last record: a damaged record with no intact one after it is a torn
    # tail (cut off, as a write that had not completed)
    rng = random.Random(os.urandom(8))
    bad = _damage_a_record(tiers, tmp_path, lambda order: rng.choice(order[:-1]))
    with caplog.at_level(logging.WARNING, logger="pagekv.store.disk"):
        tier = tiers(capacity=32 * MIB, segment_bytes=4 * MIB)
    assert "1 damaged record(s) skipped" in caplog.text
    assert tier.stats()["disk_rebuild_damaged"] == 1 and tier.stats()["disk_blocks"] == 19
    found = read_all(tier, range(20))
    assert found[bad] is None
    assert all(joined(found[i]) == payload(i, 60_000) for i in range(20) if i != bad)


def test_a_damaged_last_record_is_cut_as_a_torn_tail(tiers, tmp_path):
    """The file's last record failing its checksum, with no intact record after it, is what a
    write cut short by a crash leaves: the scan cuts it off (torn, not damaged) and serves the
    rest."""
    last = _damage_a_record(tiers, tmp_path, lambda order: order[-1])
    tier = tiers(capacity=32 * MIB, segment_bytes=4 * MIB)
    stats = tier.stats()
    assert stats["disk_rebuild_torn"] == 1 and stats["disk_rebuild_damaged"] == 0
    assert stats["disk_blocks"] == 19
    found = read_all(tier, range(20))
    assert found[last] is None
    assert all(joined(found[i]) == payload(i, 60_000) for i in range(20) if i != last)


WRITER = textwrap.dedent("""
    import random, sys, xxhash
    from pagekv.store.node.disk import DiskConfig, DiskTier
    tier = DiskTier(DiskConfig(sys.argv[1], capacity="1GiB", segment_bytes="1MiB"))
    print("ready", flush=True)
    for i in range(5000):
        data = random.Random(i).randbytes(20_000 + (i * 7919) % 150_000)
        while not tier.offer(i.to_bytes(16, "little"), [data], len(data),
                             xxhash.xxh3_64_intdigest(data)):
            if not tier.on:
                sys.exit(f"tier off: {tier.error}")
            tier.flush(10)  # queue full: wait for the writer (a stream, nothing dropped)
        print("offered", i + 1, flush=True)
        if i % 50 == 49 and tier.flush(10):
            print("durable", i + 1, flush=True)
""")


def test_kill_9_during_a_write_stream_loses_only_unfinished_writes(tiers, tmp_path, poisoned):
    directory = tmp_path / "disk"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    durable, offered, kill_at = 0, 0, 200 + random.randrange(1, 50)
    try:  # ~17 MiB on disk, segments sealed, records being written when the kill comes
        while offered < kill_at:
            readable, _, _ = select.select([child.stdout], [], [], 60)
            line = child.stdout.readline() if readable else ""
            assert line, "the writer stopped or hung"
            what, _, count = line.partition(" ")
            durable = int(count) if what == "durable" else durable
            offered = int(count) if what == "offered" else offered
    finally:
        child.kill()
        child.wait(10)
    tier = tiers(directory, capacity="1GiB", segment_bytes="1MiB")
    n = tier.stats()["disk_blocks"]
    assert n >= durable
    found = read_all(tier, range(n + 50))
    present = [i for i, block in found.items() if block is not None]
    assert present == list(range(n))  # in write order: nothing missing before the end
    for i in present:
        assert joined(found[i]) == payload(i, 20_000 + (i * 7919) % 150_000), i


# ---- faults -------------------------------------------------------------------------------------
def test_a_corrupted_byte_is_a_miss_and_the_block_dropped(tiers, tmp_path):
    tier = tiers()
    for i in range(5):
        offer(tier, i, 100_000)
    assert tier.close(10)
    tier = tiers()
    seg = sorted((tmp_path / "disk").glob("*.seg"))[0]
    with open(seg, "r+b") as f:  # a byte inside block 2's payload, and one in block 3's header
        for i, at in ((2, 50_000), (3, 10)):
            entry = tier._index.get(key_of(i))
            f.seek(entry.offset + (entry.header_len + at if at > 100 else at))
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
    found = read_all(tier, range(5))
    assert found[2] is None and found[3] is None
    assert not tier.contains(key_of(2)) and not tier.contains(key_of(3))
    assert [joined(found[i]) for i in (0, 1, 4)] == [payload(i, 100_000) for i in (0, 1, 4)]
    assert tier.stats()["disk_corrupt"] == 2 and tier.on


@pytest.mark.parametrize("call", ["preadv", "pwritev", "fdatasync"])
@pytest.mark.parametrize("code", [errno.EIO, errno.EROFS])
def test_an_io_error_turns_the_tier_off_with_one_log_line(tiers, caplog, call, code):
    ops = FailingOps()
    tier = tiers(io=ops)
    for i in range(3):
        offer(tier, i, 100_000)
    assert tier.flush(10)
    caplog.set_level(logging.ERROR, logger="pagekv.store.disk")
    ops.fail[call] = code
    if call == "preadv":
        assert read_all(tier, range(3))[0] is None
    else:
        for i in range(3, 30):  # enough to fill a segment: a write, then a seal's sync
            offer(tier, i, 100_000)
        assert not tier.flush(10)
    tier.expect_off = True
    assert not tier.on and os.strerror(code) in tier.error
    assert not offer(tier, 99, 1000) and not tier.contains(key_of(0))
    assert read_all(tier, range(3)) == {0: None, 1: None, 2: None}
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_the_tier_is_seen_off_only_once_its_line_is_logged(tiers):
    """Whoever sees ``on`` turn False (a node's stats, a test waiting on it) finds the error
    line already written: the line is said while the tier still reads as on."""
    ops = FailingOps()
    tier = tiers(io=ops)
    offer(tier, 0, 100_000)
    assert tier.flush(10)
    seen: list[bool] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(tier.on)

    handler = Seen(logging.ERROR)
    logger = logging.getLogger("pagekv.store.disk")
    logger.addHandler(handler)
    try:
        ops.fail["preadv"] = errno.EIO
        assert read_all(tier, [0])[0] is None
    finally:
        logger.removeHandler(handler)
    tier.expect_off = True
    assert seen == [True] and not tier.on


def test_a_full_disk_reclaims_and_retries_and_never_raises(tiers):
    ops = FailingOps()
    tier = tiers(io=ops, capacity=8 * MIB)
    for i in range(35):  # 10 blocks a segment: the fourth, active, holds 5
        offer(tier, i, 100_000)
    assert tier.flush(10)
    ops.once["pwritev"] = errno.ENOSPC  # the next write: reclaim the oldest, write again
    offer(tier, 35, 100_000)
    assert tier.flush(10)
    assert tier.stats()["disk_reclaimed_segments"] == 1 and tier.on
    assert joined(read_all(tier, [35])[35]) == payload(35, 100_000)
    ops.fail["pwritev"] = errno.ENOSPC  # full for good: blocks are dropped, the tier stays on
    offer(tier, 36, 100_000)
    assert tier.flush(10)
    stats = tier.stats()
    assert tier.on and stats["disk_write_nospace"] == 1 and stats["disk_reclaimed_segments"] == 2
    assert read_all(tier, [36])[36] is None and not tier.contains(key_of(36))
    ops.fail.clear()


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_a_process_out_of_descriptors_drops_writes_and_keeps_the_tier(tiers, code):
    """A node's peers may hold all its descriptors for a moment (a connection flood): a segment
    that cannot be opened then costs the blocks written meanwhile, never the tier."""
    ops = FailingOps()
    tier = tiers(io=ops)
    for i in range(10):  # a segment's worth: the next block needs a new one
        offer(tier, i, 100_000)
    assert tier.flush(10)
    ops.fail["open"] = code
    for i in range(10, 13):
        offer(tier, i, 100_000)
    assert tier.flush(10)
    assert tier.on and tier.stats()["disk_write_no_descriptor"] == 3
    ops.fail.clear()
    for i in range(13, 16):
        offer(tier, i, 100_000)
    assert tier.flush(10)
    found = read_all(tier, range(16))
    assert [i for i in range(16) if found[i] is None] == [10, 11, 12]
    for i in [*range(10), *range(13, 16)]:
        assert joined(found[i]) == payload(i, 100_000)


def test_a_real_full_file_system_is_reclaimed_into(tiers, tmp_path):
    with tmpfs(tmp_path / "small", "6M") as mnt:
        tier = tiers(mnt / "disk", capacity=64 * MIB, segment_bytes=MIB)  # more than fits
        for i in range(100):  # ~10 MiB into 6 MiB
            offer(tier, i, 100_000)
            if i % 10 == 9:
                assert tier.flush(10)
        stats = tier.stats()
        assert tier.on and stats["disk_reclaimed_segments"] >= 1
        found = read_all(tier, range(100))
        present = [i for i in range(100) if found[i] is not None]
        assert len(present) >= 20 and present == list(range(present[0], 100))
        for i in present:
            assert joined(found[i]) == payload(i, 100_000)
        tier.close(10)


def test_a_read_only_file_system_at_start_leaves_the_tier_off(tiers, tmp_path, caplog):
    with tmpfs(tmp_path / "ro", "4M") as mnt:
        (mnt / "disk").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        caplog.set_level(logging.ERROR, logger="pagekv.store.disk")
        tier = tiers(mnt / "disk")
        tier.expect_off = True
        assert not tier.on and "errno 30" in tier.error
        assert not offer(tier, 1, 1000) and read_all(tier, [1]) == {1: None}
        assert len(caplog.records) == 1
        tier.close(5)


def test_a_second_opener_of_a_directory_is_refused(tiers, tmp_path):
    tiers()
    with pytest.raises(DiskDirLocked, match=f"pid {os.getpid()}"):
        tiers()
    code = ("import sys\nfrom pagekv.store.node.disk import *\n"
            "try:\n    DiskTier(DiskConfig(sys.argv[1], capacity='4MiB', segment_bytes='1MiB'))\n"
            "except DiskDirLocked as e:\n    print('refused', e)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "disk")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.startswith("refused") and f"pid {os.getpid()}" in out.stdout


def test_a_directory_of_another_format_is_refused(tiers, tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "format").write_text("pagekv-disk 99\n")
    with pytest.raises(DiskFormatError, match="pagekv-disk 99"):
        tiers()
    tiers(tmp_path / "other")  # the failed opener released its lock: others may go on


def test_reads_racing_reclaim_never_see_wrong_bytes(tiers):
    tier = tiers(capacity=3 * MIB, segment_bytes=MIB, read_threads=4, write_queue_bytes=MIB)
    errors: list[str] = []
    reads: list[int] = []
    written = [0]
    stop = threading.Event()

    def write():
        for i in range(400):  # ~40 MiB through a 3 MiB disk: a reclaim every ~10 blocks
            while not offer(tier, i, 100_000) and tier.on:
                tier.flush(10)
            written[0] = i
        assert tier.flush(10)
        stop.set()

    def read():
        rng, seen = random.Random(), 0
        while not stop.is_set():
            ids = [max(0, written[0] - rng.randrange(40)) for _ in range(8)]
            for i, block in read_all(tier, ids).items():
                if block is not None:
                    seen += 1
                    if joined(block) != payload(i, 100_000):
                        errors.append(f"block {i} came back wrong")
        reads.append(seen)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and stop.is_set() and len(reads) == 3 and sum(reads) > 0
    assert tier.stats()["disk_reclaimed_segments"] >= 20
