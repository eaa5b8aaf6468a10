"""Node memory against abusive peers, measured on a real `pagekv serve` process's RSS.

Each scenario checks RSS - RSS at start <= 1.1 x capacity + connection_bound per connection
(NodeConfig.connection_bound, documented in docs/protocol.md) and that the node serves on.
The figures are printed (pytest -s shows them).
"""

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from pagekv.store import ClientConfig, NodeConfig, Status, StoreClient
from pagekv.store.launch import NodeProcess
from pagekv.store.node.memory import minor_faults
from tests.helpers import wait_until
from tests.store_fakes import pack
from tests.zmtp_raw import RawPeer

pytestmark = pytest.mark.slow

MIB = 1 << 20
ARGS = ("--capacity", "64MiB", "--max-block-size", "8MiB", "--max-message-size", "8MiB")
CONFIG = NodeConfig(capacity="64MiB", max_block_size="8MiB", max_message_size="8MiB")


class Watched:
    """A node process and the most RSS it was seen to use above its RSS at start, which is
    taken once it has warmed its heap, less what that added (``kept``: memory for blocks)."""

    def __init__(self, *args: str, nofile: int | None = None) -> None:
        self.node = NodeProcess(*(args or ARGS), nofile=nofile).start()
        self.kept = self.node.warmed()
        self.base = self.node.rss_bytes() - self.kept
        self.peak = 0

    def sample(self) -> int:
        over = self.node.rss_bytes() - self.base
        self.peak = max(self.peak, over)
        return over

    def hold_for(self, seconds: float) -> None:
        """Sample RSS for a while (the node keeps working meanwhile; nothing waits on it)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(0.01)

    def bound(self, connections: int, config: NodeConfig = CONFIG) -> int:
        return int(1.1 * config.capacity) + connections * config.connection_bound

    def serves(self) -> bool:
        with StoreClient(self.node.address, timeout_s=5) as client:
            key, value = os.urandom(16), os.urandom(100_000)
            return (
                client.put_many([key], [value]) == [Status.OK]
                and bytes(client.get_many([key])[0]) == value
            )

    def stats(self) -> dict:
        with StoreClient(self.node.address, timeout_s=5) as client:
            return client.stats()[0]

    def stop(self) -> None:
        self.node.stop()


@pytest.fixture
def watched():
    w = Watched()
    yield w
    w.stop()


def report(name: str, w: Watched, **extra) -> None:
    more = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"\n[memory] {name}: peak RSS over start {w.peak / MIB:.1f} MiB "
          f"(now {w.sample() / MIB:.1f} MiB) {more}")  # fmt: skip


def flood_frames(peer: RawPeer, w: Watched, frames: int, size: int, last_more: bool) -> int:
    """Send ``frames`` frames of ``size`` bytes as one multipart message; returns how many
    went out before the node closed the connection."""
    chunk = os.urandom(size)
    for i in range(frames):
        try:
            peer.send_frame(chunk, more=last_more or i < frames - 1)
        except OSError:
            return i
        w.sample()
    return frames


@pytest.mark.parametrize("terminated", [False, True])
def test_huge_multipart_message_is_cut_off(watched, terminated):
    peer = RawPeer(watched.node.address)
    sent = flood_frames(peer, watched, 256, MIB, last_more=not terminated)
    assert peer.closed_by_peer(5.0) or terminated  # a terminated one may get TOO_LARGE instead
    watched.hold_for(0.5)
    report("multipart 256 MiB" + ("" if terminated else ", never terminated"), watched,
           sent_mib=sent)  # fmt: skip
    assert watched.peak <= watched.bound(2)
    # what libzmq held is given back: the guard trims for 1 s after closing the connection
    wait_until(lambda: watched.sample() <= 16 * MIB, 5.0, "RSS back within 16 MiB of start")
    assert watched.serves()


def test_declared_huge_frames_are_refused():
    # default limits (32 MiB a message): a frame declared bigger disconnects at its header
    w = Watched("--capacity", "64MiB")
    try:
        peers = [RawPeer(w.node.address) for _ in range(8)]
        for peer in peers:
            try:
                peer.send_raw(bytes([0x02]) + (256 * MIB).to_bytes(8, "big") + os.urandom(MIB))
            except OSError:
                pass  # reset as soon as the header arrived
        assert all(peer.closed_by_peer(5.0) for peer in peers)
        # frames within the limit, declared and never completed: one each, bounded
        partial = [RawPeer(w.node.address) for _ in range(8)]
        for peer in partial:
            peer.send_raw(bytes([0x02]) + (30 * MIB).to_bytes(8, "big") + os.urandom(20 * MIB))
        w.hold_for(0.5)
        report("8 declared 256 MiB frames + 8 partial 30 MiB frames", w)
        assert w.peak <= w.bound(17, NodeConfig(capacity="64MiB"))
        assert w.peak <= 8 * 32 * MIB
        assert w.serves()
    finally:
        w.stop()


def test_reader_that_never_reads_pins_a_bounded_amount(watched):
    """A peer asks for every block as it is written and never reads: the replies queued for it
    would keep 240 MiB of evicted blocks alive on a 64 MiB node."""
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)  # takes one reply, then its TCP window closes
    slow.setsockopt(zmq.RCVBUF, 64 << 10)
    slow.setsockopt(zmq.SNDTIMEO, 10_000)  # a send that cannot go out fails, never hangs
    slow.connect(watched.node.address)
    with StoreClient(watched.node.address, timeout_s=10) as writer:
        for round_ in range(60):
            fresh = [os.urandom(16) for _ in range(4)]
            assert set(writer.put_many(fresh, [os.urandom(MIB) for _ in fresh])) == {Status.OK}
            for i in range(8):
                slow.send(pack(id=round_ * 8 + i + 1, op="GET", keys=fresh))
            watched.sample()
        watched.hold_for(0.5)
        stats = writer.stats()[0]
    slow.close(linger=0)
    dropped = stats.get("dropped_requests", 0) + stats.get("dropped_replies", 0)
    report("480 unread GETs of blocks evicted meanwhile (240 MiB written)", watched,
           dropped=dropped)  # fmt: skip
    assert watched.peak <= watched.bound(2)
    assert dropped > 0
    assert watched.serves()


def test_unread_small_replies_are_bounded(watched):
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 64 << 10)
    # Bounded: a blocking send here once waited forever in a full suite (CI, and 1 of ~10 runs
    # here). A node that stops taking the requests of a peer that reads none of its replies is
    # pushing back, which is allowed: what matters is its memory and that it serves the others.
    slow.setsockopt(zmq.SNDTIMEO, 10_000)
    slow.connect(watched.node.address)
    keys = [os.urandom(16) for _ in range(64)]
    sent = 0
    for i in range(50_000):
        try:
            slow.send(pack(id=i + 1, op="GET", keys=keys))
        except zmq.Again:
            break
        sent += 1
        if i % 1000 == 0:
            watched.sample()
    watched.hold_for(0.5)
    slow.close(linger=0)
    report("50,000 unread GETs", watched, sent=sent)
    # no block stored: beyond the memory kept for blocks, only the connection's bound
    assert watched.peak - watched.kept <= watched.bound(1) - int(1.1 * CONFIG.capacity) + 8 * MIB
    assert watched.serves()


def test_idle_and_half_open_connections(watched):
    host, port = watched.node.address.removeprefix("tcp://").rsplit(":", 1)
    raw = [socket.create_connection((host, int(port))) for _ in range(200)]  # no handshake
    ctx = zmq.Context.instance()
    idle = []
    for _ in range(100):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(watched.node.address)
        idle.append(sock)
    half = [RawPeer(watched.node.address) for _ in range(100)]
    for peer in half:  # a frame started, then silence
        peer.send_raw(bytes([0x02]) + (8 * MIB).to_bytes(8, "big") + os.urandom(4096))
    watched.hold_for(1.0)
    n = len(raw) + len(idle) + len(half)
    report(f"{n} idle and half-open connections", watched,
           per_conn_kib=round(watched.peak / n / 1024, 1))  # fmt: skip
    assert watched.peak <= n * 256 * 1024
    assert watched.serves()
    for s in raw:
        s.close()
    for s in idle:
        s.close(linger=0)
    for p in half:
        p.close()


@pytest.mark.parametrize("size", [512, 4096])
def test_small_blocks_are_accounted_at_their_real_cost(size):
    w = Watched("--capacity", "32MiB", "--max-block-size", "1MiB", "--max-message-size", "1MiB")
    try:
        blob = os.urandom(size)
        per_call = (900 << 10) // size
        # one connection, on every host (the default streams follow the cores): the bound
        # below counts the connections' requests in flight
        cfg = ClientConfig((w.node.address,), timeout_s=10, streams=1)
        with StoreClient(w.node.address, config=cfg) as client:
            for _ in range((96 * MIB) // (per_call * size)):
                keys = [os.urandom(16) for _ in range(per_call)]
                assert set(client.put_many(keys, [blob] * per_call)) == {Status.OK}
                w.sample()
            stats = client.stats()[0]
        config = NodeConfig(capacity="32MiB", max_block_size="1MiB", max_message_size="1MiB")
        report(f"96 MiB of {size} B blocks into 32 MiB", w, evictions=stats["evictions"])
        assert stats["used_bytes"] <= stats["capacity"] and stats["evictions"] > 0
        assert w.peak <= w.bound(1, config)
        assert w.peak <= 1.1 * config.capacity + 4 * MIB  # the capacity term really holds
    finally:
        w.stop()


def test_descriptor_exhaustion_does_not_spin():
    w = Watched(*ARGS, nofile=256)
    host, port = w.node.address.removeprefix("tcp://").rsplit(":", 1)
    conns = []
    try:
        for _ in range(300):
            conns.append(socket.create_connection((host, int(port)), timeout=5))
        w.hold_for(0.5)  # the node takes and refuses connections meanwhile
        cpu0, t0 = w.node.cpu_seconds(), time.monotonic()
        w.hold_for(2.0)
        busy = (w.node.cpu_seconds() - cpu0) / (time.monotonic() - t0)
        assert busy < 0.25
    finally:
        for s in conns:
            s.close()
    try:  # at its limit the node takes no new client (a stats client neither): ask afterwards
        deadline = time.monotonic() + 10
        while not w.serves():
            assert w.node.proc.poll() is None, "the node died:\n" + "".join(w.node.log)
            assert time.monotonic() < deadline, "node does not take clients again"
        refused = w.stats()["refused_connections"]
        report("300 idle connections at RLIMIT_NOFILE=256", w, cpu=f"{busy:.0%}", refused=refused)
        assert refused > 0
    finally:
        w.stop()


OUT_OF_DESCRIPTORS = """
import os, resource, time, zmq
from pagekv.store.config import NodeConfig
from pagekv.store.node.guard import ConnectionGuard
from pagekv.store.node.memory import rss_bytes
sock = zmq.Context.instance().socket(zmq.ROUTER)
sock.bind("tcp://127.0.0.1:0")
guard = ConnectionGuard(sock, NodeConfig(capacity="1MiB", guard_interval_s=0.01), {})
resident = rss_bytes()
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, 4096))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass  # no descriptor is free now
guard.baseline_rss = -(1 << 40)  # over its memory bound: the RSS check runs in full
guard.tick(time.monotonic())
assert rss_bytes() > resident // 2, "RSS read while no descriptor is free"
print("served on")
"""


def test_guard_checks_need_no_free_descriptor():
    """A node at its descriptor limit (peers hold them all, for a moment) runs its guard's
    checks on: reading its own RSS takes no new descriptor. Such a moment once ended the node
    (EMFILE opening /proc/self/statm)."""
    done = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "served on" in done.stdout, done.stderr


def test_a_warming_node_answers_on_a_busy_machine():
    """A fresh node warms its heap on a thread of its own while it serves. On a machine whose
    cores are all busy (here: two busy processes a core) each PUT meanwhile is still answered
    within 1 s. At the lowest CPU priority the warmer was starved while it held the locks of
    the heap and of the address space (faulting chunks in), and the node's own threads queued
    behind it: PUTs went unanswered for seconds (a restarted 64 MiB node, 10 s)."""
    # at most 8: on a large host (the GPU machine's suite runs 8 workers) this test loads it
    # less and proves less; CI's 2 cores get 4
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(min(8, 2 * len(os.sched_getaffinity(0))))]  # fmt: skip
    node = None
    try:
        node = NodeProcess("--capacity", "512MiB").start()
        blob, puts = os.urandom(1 << 20), 0
        with (
            StoreClient(node.address, timeout_s=1.0) as client,
            StoreClient(node.address, timeout_s=30) as patient,
        ):
            while (stats := patient.stats()[0])["heap_warming"] or puts < 3:
                assert client.put_many([os.urandom(16)], [blob]) == [Status.OK], (
                    f"a PUT went unanswered for 1 s after {puts} while the node warmed"
                )
                puts += 1
        print(
            f"\n[memory] {puts} PUTs answered while a 512 MiB node warmed beside "
            f"{len(busy)} busy processes ({stats['heap_warmed_bytes'] >> 20} MiB warmed)"
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
        if node is not None:
            node.stop()


def fault_rounds(node: NodeProcess, io_threads: int, rounds: int) -> list[float]:
    """Page faults of ``node`` per 4 KiB page received, in each of ``rounds`` rounds of 96 MiB
    of 2 MiB blocks put (fresh random bytes) and deleted."""
    n, size = 48, 2 * MIB
    values = [os.urandom(size) for _ in range(n)]
    per_round = []
    with StoreClient(node.address, timeout_s=30, streams=io_threads) as client:
        for r in range(rounds):
            keys = [b"fault-%d-%d" % (r, i) for i in range(n)]
            before = minor_faults(node.proc.pid)
            assert client.put_many(keys, values) == [Status.OK] * n
            per_round.append((minor_faults(node.proc.pid) - before) / (n * size // 4096))
            got = client.get_many(keys[:1])[0]
            assert bytes(got) == values[0]
            assert all(client.delete_many(keys))
    return per_round


@pytest.mark.parametrize("io_threads", [1, 2])
def test_a_node_receives_blocks_into_memory_it_warmed_and_reuses_it(io_threads):
    """Blocks received by libzmq's I/O threads come from the one heap the node warmed at start:
    neither the first fill of a fresh node nor a later one lands on fresh pages the kernel
    faults in and zeroes on the receiving thread (unwarmed, each block cost 512 faults; with
    an arena per I/O thread, glibc unmapped each emptied 64 MiB heap: half of every block was
    faulted again each round)."""
    node = NodeProcess("--capacity", "256MiB", "--io-threads", str(io_threads)).start()
    try:
        assert node.warmed() >= 192 * MIB  # 90% of the capacity, in 16 MiB chunks
        per_round = fault_rounds(node, io_threads, 4)
        print(f"\n[memory] faults per 4 KiB page of each round: {per_round}")
        assert max(per_round) < 0.1, per_round
    finally:
        node.stop()


def test_the_fault_count_sees_a_node_that_warms_nothing(monkeypatch):
    """The control of the test above: untuned (``PAGEKV_TUNE_MALLOC=0``), a node warms nothing
    and its first 96 MiB of blocks fault in fresh pages."""
    monkeypatch.setenv("PAGEKV_TUNE_MALLOC", "0")
    node = NodeProcess("--capacity", "256MiB").start()
    try:
        assert node.warmed() == 0
        assert fault_rounds(node, 1, 1)[0] > 0.5
    finally:
        node.stop()


def test_a_node_warms_no_more_than_its_capacity():
    node = NodeProcess("--capacity", "40MiB", "--max-block-size", "8MiB",
                       "--max-message-size", "8MiB").start()  # fmt: skip
    try:
        assert 0 < node.warmed() <= 40 * MIB
    finally:
        node.stop()


def test_blocks_and_requests_on_their_way_stay_within_the_capacity():
    """A node fed 2 MiB blocks by a client with 4 streams (4 requests of 16 MiB in flight at
    once, as on a 16-core host) keeps room for what is on its way in: its RSS peaks within
    capacity + 10% (without that room it peaked at 1.15-1.24x of a 256 MiB capacity)."""
    capacity = 256 * MIB
    w = Watched("--capacity", str(capacity), "--io-threads", "4")
    try:
        data = [os.urandom(2 * MIB) for _ in range(16)]
        cfg = ClientConfig((w.node.address,), timeout_s=30, streams=4)
        with StoreClient(w.node.address, config=cfg) as client:
            for i in range(3 * capacity // (32 * MIB)):
                keys = [f"flow-{i}-{j}".encode() for j in range(16)]
                assert client.put_many(keys, data) == [Status.OK] * 16
                w.sample()
            stats = client.stats()[0]
        report("3x capacity of 2 MiB blocks over 4 streams", w, evictions=stats["evictions"])
        assert stats["evictions"] > 0 and w.peak <= 1.1 * capacity
    finally:
        w.stop()
