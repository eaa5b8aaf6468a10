"""Store nodes with a disk tier (``--disk``): GETs mixing memory and disk hits over ZeroMQ, the
bulk lane and LOCATE (values exact, on fresh random data, into poisoned buffers); DEFERRED values
from disk; EXISTS, DELETE and PUT across tiers; restarts of ``pagekv serve`` processes (kill -9
during a PUT stream, SIGTERM); a second node on the same directory; a full disk (a small tmpfs),
a read-only disk (a read-only bind mount), EIO (the tier's FileOps seam), flipped bytes in a
segment; metrics, /health and ``pagekv stats``.

Nodes in this process serve from a thread (``served``); the rest are ``pagekv serve`` children
(:class:`NodeProcess`). Nothing sleeps to synchronise: tests wait on the node's counters with a
bounded timeout (:func:`settled`). The ``served`` fixture fails a test whose disk tier turned
itself off unless the test expected it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import random
import re
import signal
import struct
import subprocess
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from pagekv.store import ClientConfig, NodeConfig, Status, StoreClient, StoreNode
from pagekv.store.cli.settings import format_size
from pagekv.store.launch import NodeProcess
from pagekv.store.node.disk_format import parse_directory
from pagekv.store.node.metrics import node_metrics
from tests.cli_helpers import run_cli
from tests.helpers import POISON, wait_until
from tests.test_store_disk import FailingOps, tmpfs

MIB = 1 << 20
DISK_ARGS = ("--disk-segment-size", "1MiB", "--max-block-size", "256KiB",
             "--max-message-size", "4MiB")  # fmt: skip


def values(seed: int, n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    """Fresh random keys and values (a seed per test run: no two runs see the same bytes)."""
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)], [rng.randbytes(size) for _ in range(n)]


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


def poisoned(vals: list[bytes]) -> list[bytearray]:
    return [bytearray([POISON]) * len(v) for v in vals]


def node_stats(node: StoreNode) -> dict:
    with node.lock:
        return node.stats()


def settled(node: StoreNode, timeout: float = 20.0) -> dict:
    """The node's stats once its disk writer has written everything queued."""
    wait_until(lambda: node_stats(node)["disk_queue_blocks"] == 0, timeout, "the disk queue")
    return node_stats(node)


def tiers(node: StoreNode, keys: list[bytes]) -> tuple[list[int], list[int]]:
    """Indices of ``keys`` in memory, and of those only on disk."""
    with node.lock:
        memory = [i for i, k in enumerate(keys) if k in node.store]
        disk = [i for i, k in enumerate(keys) if k not in node.store and node.disk.contains(k)]
    return memory, disk


@pytest.fixture
def served(tmp_path):
    """``start(**cfg)``: a node serving from a thread, memory 2 MiB, a 64 MiB disk tier in
    ``tmp_path/disk`` (1 MiB segments); ``disk_io`` replaces its file calls. Each is stopped
    at teardown; a tier that turned itself off fails the test unless ``node.expect_off``."""
    nodes = []

    def start(disk_io=None, **cfg):
        base = dict(port=0, capacity=2 * MIB, disk=str(tmp_path / "disk"),
                    disk_capacity=64 * MIB, disk_segment_size=MIB, max_block_size=256 << 10,
                    max_message_size=4 * MIB, shutdown_save_s=10.0)  # fmt: skip
        node = StoreNode(NodeConfig(**{**base, **cfg}), disk_io=disk_io)
        node.expect_off = False
        node.thread = thread = threading.Thread(target=node.serve_forever, daemon=True)
        thread.start()
        nodes.append((node, thread))
        return node

    yield start
    for node, thread in nodes:
        error = node.disk.error if node.disk is not None else None
        node.stop()
        thread.join(timeout=20)
        assert not thread.is_alive(), "the node did not stop"
        assert node.expect_off or error is None, error


def put_in_steps(c: StoreClient, keys: list[bytes], vals: list[bytes], step: int = 20) -> None:
    """PUTs of ``step`` values at a time (a same-host client reserves a whole call's values in
    a --shm node's segment at once: more than it holds is NO_SPACE)."""
    for i in range(0, len(keys), step):
        assert c.put_many(keys[i : i + step], vals[i : i + step]) == [Status.OK] * len(
            keys[i : i + step]
        )


def client(node, **cfg) -> StoreClient:
    """A client whose PUTs are small next to the node's memory (a PUT keeps room for itself),
    over one stream whatever the host's cores: the node keeps room for every PUT arriving at
    once, and the default 8 streams of a 16-core host would claim all of its 2 MiB (there 1 of
    60 values stayed in memory)."""
    cfg.setdefault("max_message_bytes", 512 << 10)
    cfg.setdefault("streams", 1)
    return StoreClient(node.address, config=ClientConfig((node.address,), **cfg))


# ---- GETs across tiers --------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["zmq", "lane"])
def test_gets_mixing_memory_and_disk_hits_are_exact(served, transport):
    node = served()
    keys, vals = values(fresh_seed(), 60, 100_000)  # 6 MB into 2 MiB of memory
    with client(node, bulk=transport == "lane") as c:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        before = settled(node)
        memory, disk = tiers(node, keys)
        assert len(memory) >= 5 and len(disk) >= 30, (len(memory), len(disk))
        # memory and disk keys interleaved, and keys no tier has
        order = [i for pair in zip(disk, memory * 10) for i in pair][:24]
        missing = [os.urandom(16) for _ in range(3)]
        ask = [keys[i] for i in order] + missing
        into = poisoned([vals[i] for i in order]) + [bytearray(10) for _ in missing]
        assert c.get_many(ask, into=into) == [True] * len(order) + [False] * 3
        assert [bytes(b) for b in into[: len(order)]] == [vals[i] for i in order]
        views = c.get_many([keys[disk[-1]], missing[0], keys[memory[-1]]])
        assert bytes(views[0]) == vals[disk[-1]] and views[1] is None
        assert bytes(views[2]) == vals[memory[-1]]
        assert c.routes()[0].get == transport
    after = node_stats(node)
    assert after["disk_hits"] - before["disk_hits"] >= 12
    assert after["hits"] > before["hits"]  # memory hits among them
    assert after["disk_waiting"] == 0 and after["internal_errors"] == 0


def test_evictions_come_as_values_arrive_never_in_bursts_past_the_write_queue(served):
    """With a disk tier, memory evicts what each PUT needs, not down to a low watermark: a
    burst of a tenth of the memory would overflow a write queue smaller than it, and those
    blocks would be lost though the writer keeps up with the PUTs."""
    node = served(capacity=16 * MIB, disk_queue_size=MIB)
    keys, vals = values(fresh_seed(), 400, 100_000)  # 40 MB: 2.5x the memory
    with client(node) as c:
        for i in range(0, len(keys), 5):  # 0.5 MB at a time, the writer keeping up
            assert c.put_many(keys[i : i + 5], vals[i : i + 5]) == [Status.OK] * 5
            settled(node)
        into = poisoned(vals)
        assert c.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == vals
    assert node_stats(node)["disk_write_dropped"] == 0


def test_values_on_disk_over_the_reply_limit_are_deferred_and_fetched_again(served):
    node = served(max_message_size=MIB)
    keys, vals = values(fresh_seed(), 40, 200_000)  # 8 MB: a GET of all is 8 replies or more
    with client(node, bulk=False, max_message_bytes=8 * MIB) as c:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        settled(node)
        got = c.get_many(keys)  # no sizes known: one request, the node defers what won't fit
        assert [bytes(v) for v in got] == vals
    stats = node_stats(node)
    assert stats["deferred"] > 0 and stats["disk_hits"] >= 20


def test_without_promotion_disk_hits_stay_on_disk(served):
    node = served(disk_promote=False)
    keys, vals = values(fresh_seed(), 40, 100_000)
    with client(node) as c:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        settled(node)
        _, disk = tiers(node, keys)
        for _ in range(2):
            into = poisoned([vals[i] for i in disk])
            assert c.get_many([keys[i] for i in disk], into=into) == [True] * len(disk)
            assert [bytes(b) for b in into] == [vals[i] for i in disk]
    assert tiers(node, keys)[1] == disk
    assert node_stats(node)["disk_hits"] == 2 * len(disk)


def test_promoted_blocks_are_counted_by_what_they_hold(served):
    """Blocks read together share a buffer: a promoted one is copied out of it, so memory
    stays within its capacity whatever the reads were."""
    node = served(capacity=4 * MIB)
    keys, vals = values(fresh_seed(), 120, 50_000)
    with client(node) as c:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        settled(node)
        _, disk = tiers(node, keys)
        into = poisoned([vals[i] for i in disk])
        assert c.get_many([keys[i] for i in disk], into=into) == [True] * len(disk)
    with node.lock:
        held = [b for _, b in node.store.newest_first()]
        assert node.store.used <= node.store.capacity
    assert held and all(sum(len(f) for f in b.frames) == b.size for b in held)
    assert all(len(f.obj) <= b.size + 12288 for b in held for f in b.frames
               if isinstance(f, memoryview))  # fmt: skip


def test_locate_promotes_keys_only_on_disk_into_the_segment(served):
    node = served(shm=True, capacity=16 * MIB)  # the client reserves 4 MB at a time
    keys, vals = values(fresh_seed(), 300, 100_000)
    with client(node) as c:
        assert c.ping() == [True] and c.routes()[0].get == "shm", c.routes()
        put_in_steps(c, keys, vals)
        settled(node)
        memory, disk = tiers(node, keys)
        assert len(disk) >= 30 and memory
        order = disk[:10] + memory[-3:]
        into = poisoned([vals[i] for i in order])
        assert c.get_many([keys[i] for i in order], into=into) == [True] * len(order)
        assert [bytes(b) for b in into] == [vals[i] for i in order]
        assert c.counters["shm_hits"] >= len(order)
        # half the memory's worth on disk, in one call: its LOCATEs each promote what they name
        rest = [i for i in disk[10:] if keys[i] not in node.store][:80]
        assert len(rest) == 80
        into = poisoned([vals[i] for i in rest])
        assert c.get_many([keys[i] for i in rest], into=into) == [True] * len(rest)
        assert [bytes(b) for b in into] == [vals[i] for i in rest]
        # one LOCATE promotes at most a quarter of the memory: its leading keys on disk
        _, disk = tiers(node, keys)
        with node.lock:
            chosen, later = node._to_locate([keys[i] for i in disk])
        assert chosen == [keys[i] for i in disk[: len(chosen)]]
        assert later == {keys[i] for i in disk[len(chosen) :]}
        assert 4 * MIB - 100_000 < len(chosen) * 100_000 <= 4 * MIB
    stats = node_stats(node)
    assert stats["op_locate"] >= 2 and stats["disk_hits"] >= len(rest) and stats["op_get"] == 0


def test_a_locate_naming_more_on_disk_than_it_promotes_defers_the_rest(served):
    """One LOCATE naming more disk-resident values than a quarter of the memory: the ones it
    does not promote are DEFERRED, so the same-host client asks again, never a miss."""
    node = served(shm=True, capacity=16 * MIB, max_message_size=16 * MIB)
    keys, vals = values(fresh_seed(), 300, 100_000)
    with client(node, max_message_bytes=16 * MIB) as c:
        assert c.ping() == [True] and c.routes()[0].get == "shm", c.routes()
        put_in_steps(c, keys, vals)
        settled(node)
        _, disk = tiers(node, keys)
        ask = disk[:100]  # 10 MB in one call: more than the 4 MiB one LOCATE promotes
        assert len(ask) == 100
        into = poisoned([vals[i] for i in ask])
        assert c.get_many([keys[i] for i in ask], into=into) == [True] * len(ask)
        assert [bytes(b) for b in into] == [vals[i] for i in ask]
    stats = node_stats(node)
    assert stats["op_locate"] >= 3 and stats["op_get"] == 0


def test_evicted_segment_blocks_are_copied_before_their_space_is_reused(served):
    """With --shm an evicted block's bytes are copied into the write queue: the space is reused
    at once, and what reaches the disk is still the block."""
    node = served(shm=True, capacity=8 * MIB)
    keys, vals = values(fresh_seed(), 300, 60_000)
    with client(node, shm=False) as c:  # its GETs over TCP: read from disk, not promoted first
        put_in_steps(c, keys, vals, 10)  # evictions interleaved with new values in their space
        settled(node)
        _, disk = tiers(node, keys)
        assert len(disk) >= 50
        into = poisoned([vals[i] for i in disk])
        assert c.get_many([keys[i] for i in disk], into=into) == [True] * len(disk)
        assert [bytes(b) for b in into] == [vals[i] for i in disk]
    assert node_stats(node)["disk_corrupt"] == 0


# ---- EXISTS, DELETE, PUT across tiers ------------------------------------------------------------
def test_exists_delete_and_put_answer_for_both_tiers(served, tmp_path):
    node = served()
    keys, vals = values(fresh_seed(), 40, 100_000)
    with client(node) as c:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        settled(node)
        memory, disk = tiers(node, keys)
        found = c.exists_many([*keys, os.urandom(16)])
        assert found.found == [True] * len(keys) + [False] and found.leading == len(keys)
        # a PUT of a key on disk is acknowledged, not stored again
        assert c.put_many([keys[disk[0]]], [vals[disk[0]]]) == [Status.EXISTS]
        assert tiers(node, keys)[1][0] == disk[0]
        gone = [keys[disk[1]], keys[memory[-1]]]
        assert c.delete_many([*gone, os.urandom(16)]) == [True, True, False]
        assert c.exists_many(gone).found == [False, False]
        assert c.get_many(gone) == [None, None]
        assert c.put_many([keys[disk[2]]], [b"x" * 10]) == [Status.EXISTS]
    node.stop()  # a delete stays a delete after a restart
    node.thread.join(timeout=20)
    again = served()
    with client(again) as c:
        assert c.exists_many(gone).found == [False, False]
        into = poisoned([vals[disk[0]]])
        assert c.get_many([keys[disk[0]]], into=into) == [True] and into[0] == vals[disk[0]]


class GatedReads(FailingOps):
    """Reads that, once ``armed``, wait until ``release`` (a slow disk): ``entered`` is set
    when the first one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.entered, self.release = False, threading.Event(), threading.Event()

    def preadv(self, fd, buffers, offset):
        if self.armed:
            self.entered.set()
            assert self.release.wait(20), "the gated read was never released"
        return super().preadv(fd, buffers, offset)


@pytest.mark.parametrize("bulk", [False, True])
def test_a_delete_while_a_get_reads_the_key_from_disk_stays_a_delete(served, bulk):
    """A GET of a key on disk reads it with the node's lock released; a DELETE answered
    meanwhile must win: the read's promotion into memory must not bring the key back (it was
    then served by EXISTS and GET, and saved to disk again: back after a restart too)."""
    ops = GatedReads()
    node = served(disk_io=ops)
    keys, vals = values(fresh_seed(), 40, 100_000)
    with client(node, bulk=bulk) as c, client(node) as other:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        settled(node)
        gone = keys[tiers(node, keys)[1][0]]
        ops.armed = True
        got: list = []
        reader = threading.Thread(target=lambda: got.append(c.get_many([gone])))
        reader.start()
        try:
            assert ops.entered.wait(20), "the GET never read the disk"
            assert other.delete_many([gone]) == [True]
        finally:
            ops.armed = False
            ops.release.set()
            reader.join(20)
        assert got and len(got[0]) == 1  # the GET began first: it may answer either way
        assert other.exists_many([gone]).found == [False]
        assert other.get_many([gone]) == [None]
    node.stop()
    node.thread.join(timeout=20)
    with client(served()) as c:
        assert c.exists_many([gone]).found == [False]


def test_a_reply_s_memory_blocks_keep_their_space_while_promotion_evicts_them(served):
    """--shm: a ZeroMQ GET of a memory block M and many disk blocks is answered once the reads
    are done; promoting those blocks evicts M while the reply still sends M from the
    segment. M's space must wait for that reply: it was freed when the GET's park ended, a
    PUT took it, and the reply carried bytes that were neither M nor its checksum."""
    import zmq

    from pagekv.store.wire.protocol import Op, Request, decode_reply, encode_request

    node = served(shm=True, capacity=2 * MIB, max_message_size=8 * MIB)
    keys, vals = values(fresh_seed(), 100, 100_000)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.RCVHWM, 1)  # one reply waits in the pipe, the next stays in flight
    sock.setsockopt(zmq.LINGER, 0)
    try:
        with client(node, bulk=False, shm=False) as c:
            put_in_steps(c, keys, vals, step=5)
            settled(node)
            memory, disk = tiers(node, keys)
            m = memory[-1]
            sock.connect(node.address)
            sock.send_multipart([encode_request(Request(Op.PING, 1))])
            assert sock.poll(10_000, zmq.POLLIN), "no PING reply"  # it fills the pipe, unread
            ask = [keys[i] for i in disk[:75]] + [keys[m]]  # 7.5 MB from disk: M is evicted
            sock.send_multipart([encode_request(Request(Op.GET, 2, keys=ask))])
            wait_until(lambda: node_stats(node)["disk_waiting"] == 0
                       and keys[m] not in node.store, 20, "the GET's promotion")  # fmt: skip
            new_keys, new_vals = values(fresh_seed(), 30, 100_000)
            put_in_steps(c, new_keys, new_vals, step=5)  # they take whatever space is free
        sock.recv_multipart()  # the PING's reply
        head, *frames = sock.recv_multipart()
        rep = decode_reply(head)
        assert rep.status[-1] == Status.OK and bytes(frames[-1]) == vals[m]
    finally:
        sock.close(0)


def test_reserve_of_a_key_on_disk_is_exists(served):
    node = served(shm=True, capacity=8 * MIB)
    keys, vals = values(fresh_seed(), 120, 100_000)
    with client(node) as c:
        put_in_steps(c, keys, vals)
        settled(node)
        _, disk = tiers(node, keys)
        assert c.put_many([keys[disk[0]]], [vals[disk[0]]]) == [Status.EXISTS]
        assert c.counters["shm_puts"] >= len(keys)  # the same-host path: RESERVE, COMMIT


# ---- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["preadv", "pwritev"])
@pytest.mark.parametrize("code", [errno.EIO, errno.EROFS])
def test_an_io_error_turns_the_tier_off_and_memory_serves_on(served, caplog, call, code):
    ops = FailingOps()
    node = served(disk_io=ops)
    keys, vals = values(fresh_seed(), 40, 100_000)
    with client(node) as c:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        settled(node)
        memory, disk = tiers(node, keys)
        caplog.set_level(logging.ERROR, logger="pagekv.store.disk")
        ops.fail[call] = code
        if call == "preadv":
            assert c.get_many([keys[i] for i in disk[:3]]) == [None] * 3
        else:
            more, more_vals = values(fresh_seed(), 40, 100_000)
            assert c.put_many(more, more_vals) == [Status.OK] * len(more)  # evicts: writes
            wait_until(lambda: not node.disk.on, 20, "the tier to turn off")
        node.expect_off = True
        assert f"errno {code}" in node.disk.error
        lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(lines) == 1 and "serving from memory only" in lines[0].getMessage()
        recent = memory[-2:] if call == "preadv" else []
        mem_keys = [keys[i] for i in recent] + (more[-3:] if call == "pwritev" else [])
        mem_vals = [vals[i] for i in recent] + (more_vals[-3:] if call == "pwritev" else [])
        into = poisoned(mem_vals)
        assert c.get_many(mem_keys, into=into) == [True] * len(mem_keys)
        assert [bytes(b) for b in into] == mem_vals
        assert c.get_many([keys[disk[-1]]]) == [None]
        assert c.exists_many([keys[disk[-1]]]).found == [False]
        newer, newer_vals = values(fresh_seed(), 3, 1000)
        assert c.put_many(newer, newer_vals) == [Status.OK] * 3
    stats = node_stats(node)
    assert stats["disk_on"] == 0 and stats["internal_errors"] == 0


def test_flipped_bytes_in_a_segment_are_a_miss_never_wrong_data(served, tmp_path):
    node = served()
    keys, vals = values(fresh_seed(), 60, 100_000)
    with client(node, bulk=False) as c:
        assert c.put_many(keys, vals) == [Status.OK] * len(keys)
        settled(node)
        _, disk = tiers(node, keys)
        # a record of a sealed segment (its directory says where), one payload byte flipped
        seg_dir = sorted((tmp_path / "disk").glob("*.dir"))[0]
        _, _, dir_keys, rows = parse_directory(seg_dir.read_bytes())
        victim = dir_keys[1]
        offset = rows[1][1] + rows[1][4] + 777  # record offset + header length + 777
        with open(seg_dir.with_suffix(".seg"), "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x40]))
            f.flush()
            os.fsync(f.fileno())
        assert keys.index(victim) in disk
        ask = [keys[i] for i in disk]
        into = poisoned([vals[i] for i in disk])
        got = c.get_many(ask, into=into)
        for i, ok, buf in zip(disk, got, into):
            assert ok == (keys[i] != victim)
            if ok:
                assert bytes(buf) == vals[i]
        assert c.exists_many([victim]).found == [False]  # dropped
    assert node_stats(node)["disk_corrupt"] == 1


# ---- metrics, health, pagekv stats ---------------------------------------------------------------
def test_metrics_health_and_stats_show_the_disk_tier(served):
    node = served()
    server = node_metrics(node, None, "127.0.0.1", 0,
                          lambda: (True, {"disk_on": node.disk.on}))  # fmt: skip
    try:
        keys, vals = values(fresh_seed(), 40, 100_000)
        with client(node, bulk=False) as c:
            assert c.put_many(keys, vals) == [Status.OK] * len(keys)
            settled(node)
            memory, disk = tiers(node, keys)
            assert c.get_many([keys[disk[0]]]) != [None]
            assert c.get_many([keys[memory[-1]]]) != [None]
            stats = settled(node)
        text = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
        health = json.loads(urllib.request.urlopen(f"{server.url}/health", timeout=10).read())
    finally:
        server.close()
    for name in ("disk_hits_total", "disk_misses_total", "disk_read_bytes_total",
                 "disk_writes_total", "disk_write_bytes_total", "disk_write_dropped_total",
                 "disk_write_nospace_total", "disk_corrupt_total",
                 "disk_reclaimed_segments_total", "disk_reclaimed_blocks_total",
                 "disk_reclaimed_bytes_total", "disk_on", "disk_blocks", "disk_stored_bytes",
                 "disk_used_bytes", "disk_capacity_bytes", "disk_segments", "disk_queue_blocks",
                 "disk_queue_bytes", "disk_rebuild_seconds"):  # fmt: skip
        assert re.search(rf"^pagekv_node_{name} ", text, re.M), name
    assert re.search(r"^pagekv_node_disk_hits_total 1\.0$", text, re.M)
    assert re.search(r"^pagekv_node_disk_on 1\.0$", text, re.M)
    assert re.search(r'^pagekv_node_disk_read_seconds_bucket\{le="\+Inf"\} 1\.0$', text, re.M)
    assert re.search(r"^pagekv_node_disk_write_seconds_count [1-9]", text, re.M)
    for tier in ("memory", "disk"):
        assert re.search(rf'^pagekv_node_get_duration_seconds_count\{{tier="{tier}"\}} 1\.0$',
                         text, re.M), tier  # fmt: skip
    assert health["disk_on"] is True
    table = run_cli("stats", node.address, "--timeout", "5")
    assert table.returncode == 0, table.stderr
    head, row = table.stdout.splitlines()[:2]
    assert head.split()[-5:] == ["disk_blocks", "disk_bytes", "disk_hits", "disk_capacity",
                                 "disk_on"]  # fmt: skip
    assert row.split()[-5:] == [str(stats["disk_blocks"]), format_size(stats["disk_bytes"]), "1",
                                "64MiB", "1"]  # fmt: skip


def test_disk_settings_are_checked_before_a_node_starts(tmp_path):
    for args, text in [
        (("--disk", tmp_path / "d"), "--disk-capacity must hold at least two segments (2 x "
         "--disk-segment-size"),
        (("--disk", tmp_path / "d", "--disk-capacity", "64MiB", "--disk-segment-size", "1000"),
         "--disk-segment-size must be >= 1 MiB"),
        (("--disk", tmp_path / "d", "--disk-capacity", "1GiB", "--disk-read-threads", "0"),
         "--disk-read-threads must be > 0"),
    ]:  # fmt: skip
        done = run_cli("serve", "--port", "0", "--capacity", "2MiB", *args, timeout=60)
        assert done.returncode == 2 and text in done.stderr, done.stderr
    (tmp_path / "file").write_text("not a directory")
    done = run_cli("serve", "--port", "0", "--capacity", "2MiB", "--disk", tmp_path / "file",
                   "--disk-capacity", "1GiB", timeout=60)  # fmt: skip
    assert done.returncode == 1 and "disk tier directory" in done.stderr, done.stderr


# ---- pagekv serve processes: restarts, a second node, full and read-only disks -------------------
def serve(directory: Path, *args: str, port: int = 0) -> NodeProcess:
    return NodeProcess("--capacity", "4MiB", "--disk", str(directory), "--disk-capacity", "256MiB",
                       *DISK_ARGS, *args, port=port).start(timeout=60)  # fmt: skip


def proc_stats(c: StoreClient) -> dict:
    return c.stats()[0]


def test_sigterm_restart_loses_nothing(tmp_path):
    keys, vals = values(fresh_seed(), 200, 100_000)  # 20 MB: 4 MiB in memory, the rest on disk
    node = serve(tmp_path / "disk")
    try:
        with client(node) as c:
            assert c.put_many(keys, vals) == [Status.OK] * len(keys)
            stats = proc_stats(c)
            assert stats["blocks"] > 5 and stats["disk_write_dropped"] == 0
        assert node.kill(signal.SIGTERM, timeout=60) == 0
        assert any("memory blocks saved to the disk tier, all written" in line
                   for line in node.log)  # fmt: skip
        node = serve(tmp_path / "disk", port=node.port)
        with client(node) as c:
            stats = proc_stats(c)
            assert stats["blocks"] == 0 and stats["disk_blocks"] == len(keys)
            assert stats["disk_rebuild_scanned_bytes"] == 0  # every segment sealed: no scan
            into = poisoned(vals)
            assert c.get_many(keys, into=into) == [True] * len(keys)
            assert [bytes(b) for b in into] == vals
    finally:
        node.stop()


def test_kill_9_during_a_put_stream_then_restart(tmp_path):
    directory = tmp_path / "disk"
    node = serve(directory)
    seed = fresh_seed()
    sent: list[tuple[bytes, bytes]] = []
    stop = threading.Event()

    def stream() -> None:  # PUTs until the node dies
        with client(node, timeout_s=2.0) as c:
            for n in range(400):
                keys, vals = values(seed + n, 4, 64 << 10)
                sent.extend(zip(keys, vals))
                if stop.is_set() or c.put_many(keys, vals) != [Status.OK] * 4:
                    return

    writer = threading.Thread(target=stream)
    writer.start()
    try:
        wait_until(lambda: len(list(directory.glob("*.dir"))) >= 6, 60, "6 sealed segments")
        node.kill(signal.SIGKILL)
    finally:
        stop.set()
        writer.join(timeout=60)
    assert not writer.is_alive()
    sealed = set()  # every block of a completed (sealed) segment: on disk for sure
    for path in directory.glob("*.dir"):
        sealed.update(parse_directory(path.read_bytes())[2])
    assert len(sealed) >= 6 * 14
    truth = dict(sent)
    assert sealed <= set(truth)
    node = serve(directory, port=node.port)
    try:
        with client(node) as c:
            keys = list(truth)
            into = poisoned([truth[k] for k in keys])
            got = c.get_many(keys, into=into)
            for key, ok, buf in zip(keys, got, into):
                if ok:
                    assert bytes(buf) == truth[key]  # every block served is byte-exact
            found = {k for k, ok in zip(keys, got) if ok}
            assert sealed <= found, f"{len(sealed - found)} blocks of sealed segments lost"
            stats = proc_stats(c)
        assert stats["disk_blocks"] >= len(sealed) and stats["disk_corrupt"] == 0
    finally:
        node.stop()


def test_a_second_node_on_the_same_directory_is_refused(tmp_path):
    node = serve(tmp_path / "disk")
    try:
        second = run_cli("serve", "--port", "0", "--capacity", "2MiB", "--disk",
                         tmp_path / "disk", "--disk-capacity", "64MiB", *DISK_ARGS,
                         timeout=60)  # fmt: skip
        assert second.returncode == 1, second.stderr
        errors = [line for line in second.stderr.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "in use by another process" in errors[0]
        assert f"pid {node.proc.pid}" in errors[0]
        assert "pagekv node ready" not in second.stderr
        with client(node) as c:  # the first serves on
            assert c.put_many([b"k" * 16], [b"v" * 100]) == [Status.OK]
    finally:
        node.stop()


EXT4_IOC_SHUTDOWN, EXT4_GOING_FLAGS_NOLOGFLUSH = 0x8004587D, 2


@contextmanager
def failing_ext4(path: Path, size_mib: int = 128):
    """An ext4 file system on a loop device mounted at ``path``, and a function that makes it
    fail as a dying disk does: every later call on it (open, write, sync, read) gets EIO
    (``EXT4_IOC_SHUTDOWN``). Skips where loop devices cannot be set up."""
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    path.mkdir(parents=True)
    image = path.with_suffix(".img")
    with open(image, "wb") as f:
        f.truncate(size_mib * MIB)
    made = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot set up a loop device: {made.stderr.strip()}")
    loop = made.stdout.strip()
    try:
        for cmd in (["mkfs.ext4", "-q", "-F", loop], ["mount", loop, str(path)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                pytest.skip(f"{cmd[0]} on a loop device failed: {done.stderr.strip()}")

        def fail() -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
            finally:
                os.close(fd)

        try:
            yield fail
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", loop], capture_output=True)


def test_a_failing_disk_turns_the_tier_off_and_the_node_serves_from_memory(tmp_path):
    with failing_ext4(tmp_path / "ext4") as fail:
        node = serve(tmp_path / "ext4" / "disk")
        try:
            keys, vals = values(fresh_seed(), 80, 100_000)
            with client(node) as c:
                assert c.put_many(keys, vals) == [Status.OK] * len(keys)
                wait_until(lambda: proc_stats(c)["disk_segments"] >= 2, 20, "segments")
                fail()
                more, more_vals = values(fresh_seed(), 40, 100_000)  # evictions: writes
                assert c.put_many(more, more_vals) == [Status.OK] * len(more)
                if proc_stats(c)["disk_on"]:  # writes may land in the page cache: a read fails
                    assert c.get_many(keys[:1]) == [None]
                wait_until(lambda: proc_stats(c)["disk_on"] == 0, 20, "the tier to turn off")
                into = poisoned(more_vals[-5:])
                assert c.get_many(more[-5:], into=into) == [True] * 5
                assert [bytes(b) for b in into] == more_vals[-5:]
                assert c.get_many(keys[:1]) == [None]
                assert c.put_many([os.urandom(16)], [b"v" * 1000]) == [Status.OK]
                assert proc_stats(c)["internal_errors"] == 0
            off = [line for line in node.log if "disk tier" in line and " off: " in line]
            assert len(off) == 1 and "errno 5" in off[0], off
        finally:
            node.stop()


def test_a_full_disk_is_reclaimed_never_an_error_to_clients(tmp_path):
    with tmpfs(tmp_path / "small", "12M") as mnt:
        node = serve(mnt / "disk")  # --disk-capacity 256MiB on a 12 MiB file system
        try:
            assert any("is more than the free space" in line for line in node.log)
            keys, vals = values(fresh_seed(), 400, 100_000)  # 40 MB
            with client(node) as c:
                for i in range(0, 400, 20):
                    assert c.put_many(keys[i : i + 20], vals[i : i + 20]) == [Status.OK] * 20
                wait_until(lambda: proc_stats(c)["disk_queue_blocks"] == 0, 30, "the queue")
                into = poisoned(vals)
                got = c.get_many(keys, into=into)
                for ok, buf, v in zip(got, into, vals):
                    assert not ok or bytes(buf) == v
                stats = proc_stats(c)
            assert stats["disk_on"] == 1 and stats["disk_reclaimed_segments"] >= 1
            assert sum(got) >= 50 and got[-1]  # the newest are there
            assert stats["internal_errors"] == 0
        finally:
            node.stop()
