"""KV events of store nodes (``--events-endpoint``): a subscriber (tests/kv_events.py) rebuilds
an index of the blocks each tier holds that equals the node's contents after PUTs, evictions
(to disk and dropped), disk reclaims, promotions, DELETEs, a restart and missed batches; a PUT
that fails publishes nothing; a node with no subscriber or a subscriber that never reads serves
on. The wire format itself is checked against vLLM's own types in
tests/engines/test_vllm_events.py.

Nothing sleeps to synchronise: the tests wait for the subscriber's index to match, bounded.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import urllib.request
from pathlib import Path

import pytest

from pagekv.store import ClientConfig, NodeConfig, Status, StoreClient, StoreNode
from pagekv.store.cli.cluster import node_endpoint
from pagekv.store.node.event_publisher import MAX_BATCH_KEYS, _batches, encode_batch
from pagekv.store.node.events import DISK, MEMORY, NodeEvents
from pagekv.store.node.metrics import node_metrics
from pagekv.store.wire.protocol import checksum
from tests.cli_helpers import Node, Proc, run_cli
from tests.helpers import wait_until
from tests.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, decode_batch
from tests.test_store_node import ask, head, raw_socket

MIB = 1 << 20


def fresh(n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    return [rng.randbytes(16) for _ in range(n)], [rng.randbytes(size) for _ in range(n)]


class Served:
    """A node serving from a thread of this process."""

    def __init__(self, **cfg) -> None:
        self.node = StoreNode(NodeConfig(port=0, **cfg))
        self.thread = threading.Thread(target=self.node.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.node.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the node did not stop"

    def client(self) -> StoreClient:
        addr = self.node.address
        return StoreClient(addr, config=ClientConfig((addr,), max_message_bytes=256 << 10))

    def contents(self) -> dict[str, set]:
        """What each tier holds (settled: the disk queue written)."""
        node = self.node
        if node.disk is not None:
            wait_until(lambda: node.disk.stats()["disk_queue_blocks"] == 0, 20, "the disk queue")
        with node.lock:
            memory = set(node.store.keys())
        return {MEMORY: memory, DISK: set(node.disk.keys()) if node.disk is not None else set()}

    def subscriber(self, **kw) -> Subscriber:
        pub = self.node.publisher
        return Subscriber(pub.endpoint, pub.replay_endpoint, **kw)


def matches(sub: Subscriber, served: Served, timeout: float = 20.0) -> None:
    """Wait until ``sub``'s index equals the node's contents (bounded)."""
    want = served.contents()

    def same() -> bool:
        sub.poll(50)
        return {m: sub.stored(m) for m in (MEMORY, DISK)} == want

    try:
        wait_until(same, timeout, "the subscriber's index to equal the node's contents")
    except AssertionError:
        got = {m: sub.stored(m) for m in (MEMORY, DISK)}
        diff = {m: (len(got[m] - want[m]), len(want[m] - got[m])) for m in want}
        raise AssertionError(f"index vs node (extra, missing) per medium: {diff}") from None


@pytest.fixture
def endpoints(tmp_path):
    return dict(events_endpoint=f"ipc://{tmp_path}/events",
                events_replay_endpoint=f"ipc://{tmp_path}/replay")  # fmt: skip


@pytest.fixture
def started():
    nodes: list[Served] = []

    def start(**cfg) -> Served:
        nodes.append(Served(**cfg))
        return nodes[-1]

    yield start
    for n in nodes:
        if n.thread.is_alive():
            n.stop()


# ---- the wire format and the pending list ---------------------------------------------------
def test_batches_decode_to_the_events_in_order_and_are_cut_by_keys():
    keys = [os.urandom(16) for _ in range(MAX_BATCH_KEYS + 10)]
    runs = [None, (True, MEMORY, keys[:3]), (False, DISK, keys[3:5]), (True, DISK, keys[5:])]
    batches = list(_batches(runs))
    assert len(batches) == 2 and sum(len(r[2]) for r in batches[0] if r) == MAX_BATCH_KEYS
    decoded = [decode_batch(encode_batch(12.5 + i, b)) for i, b in enumerate(batches)]
    events = [ev for batch in decoded for ev in batch.events]
    assert [batch.ts for batch in decoded] == [12.5, 13.5]
    assert isinstance(events[0], AllBlocksCleared)
    assert events[1] == BlockStored(keys[:3], None, [], 0, None, MEMORY, None)
    assert events[2] == BlockRemoved(keys[3:5], DISK)
    stored = [h for ev in events[3:] for h in ev.block_hashes]
    assert stored == keys[5:] and all(ev.medium == DISK for ev in events[3:])


def test_pending_changes_past_the_bound_are_dropped_for_a_resync():
    ev = NodeEvents(max_pending=5)
    assert ev.resync_due  # a node's first batch says what it holds
    ev.memory_stored(b"a")
    assert ev.take() == []  # covered by the resync to come
    ev.begin_resync()
    for k in (b"a", b"b", b"c"):
        ev.memory_stored(k)
    ev.disk_stored(b"a")
    ev.memory_removed(b"a")
    assert ev.take() == [(True, MEMORY, [b"a", b"b", b"c"]), (True, DISK, [b"a"]),
                         (False, MEMORY, [b"a"])]  # fmt: skip
    for i in range(6):
        ev.memory_stored(bytes([i]))
    assert ev.resync_due and ev.take() == [] and ev.counters["events_dropped"] == 6
    ev.close()
    ev.memory_stored(b"late")
    assert ev.take() == [None]


# ---- a node's contents, rebuilt by a subscriber ------------------------------------------------
@pytest.mark.parametrize("shm", [False, True], ids=["zmq", "shm"])
def test_index_follows_puts_evictions_and_deletes(started, endpoints, shm):
    # with --shm this client writes its values into the node's segment (RESERVE, COMMIT)
    served = started(capacity=2 * MIB, max_block_size=256 << 10, max_message_size=4 * MIB,
                     shm=shm, **endpoints)  # fmt: skip
    keys, vals = fresh(80, 60_000)  # 4.8 MB through 2 MiB: most are evicted and dropped
    with served.subscriber() as sub, served.client() as c:
        for i in range(0, 80, 8):
            assert c.put_many(keys[i : i + 8], vals[i : i + 8]) == [Status.OK] * 8
        held = sorted(served.contents()[MEMORY])
        assert 10 <= len(held) < 60 and served.node.store.evictions > 0
        assert c.delete_many(held[:3]) == [True] * 3
        matches(sub, served)
        assert sub.stored(MEMORY) and not sub.stored(DISK)
        with served.node.lock:
            assert (served.node.stats()["op_commit"] > 0) == shm
        # evicted keys were announced, then removed: every key of the test was seen stored
        seen = {h for b in sub.batches for ev in b.events if type(ev).__name__ == "BlockStored"
                for h in ev.block_hashes}  # fmt: skip
        assert set(keys) <= seen


def test_index_follows_both_tiers_through_reclaims_promotions_and_a_restart(
    started, endpoints, tmp_path
):
    cfg = dict(capacity=2 * MIB, disk=str(tmp_path / "disk"), disk_capacity=4 * MIB,
               disk_segment_size=MIB, max_block_size=256 << 10, max_message_size=4 * MIB,
               shutdown_save_s=10.0, **endpoints)  # fmt: skip
    served = started(**cfg)
    keys, vals = fresh(120, 60_000)  # 7 MB: through memory (2 MiB) and disk (4 MiB, reclaimed)
    with served.subscriber() as sub:
        with served.client() as c:
            for i in range(0, 120, 8):
                assert c.put_many(keys[i : i + 8], vals[i : i + 8]) == [Status.OK] * 8
            tiers = served.contents()
            assert tiers[DISK] and tiers[MEMORY] and served.node.disk.counters["reclaimed_blocks"]
            on_disk = sorted(tiers[DISK] - tiers[MEMORY])[:4]
            got = c.get_many(on_disk)  # promoted back into memory
            assert [bytes(v) for v in got] == [vals[keys.index(k)] for k in on_disk]
            assert c.delete_many([on_disk[0], sorted(tiers[MEMORY])[0]]) == [True, True]
            matches(sub, served)
            assert set(on_disk[1:]) <= sub.stored(MEMORY) & sub.stored(DISK)
        served.stop()  # SIGTERM's path: memory saved to disk, then AllBlocksCleared
        wait_until(lambda: sub.poll(50) >= 0 and not sub.index, 20, "AllBlocksCleared")
        served = started(**cfg)  # same directory and endpoints: seq starts at 0 again
        matches(sub, served)
        assert not sub.stored(MEMORY) and len(sub.stored(DISK)) >= 10


def test_missed_batches_are_replayed(started, endpoints):
    served = started(capacity=2 * MIB, max_block_size=256 << 10, max_message_size=4 * MIB,
                     **endpoints)  # fmt: skip
    keys, vals = fresh(60, 50_000)
    with served.subscriber() as lossy, served.client() as c:
        lossy.drop = {2, 3, 5}  # lost on the way: each gap is filled from the replay socket
        for i in range(0, 60, 4):  # a batch or more per PUT: each is published before the next
            assert c.put_many(keys[i : i + 4], vals[i : i + 4]) == [Status.OK] * 4
            matches(lossy, served)
            if i == 20:  # batches 0.. exist before the second subscriber connects
                late = served.subscriber()
        assert served.node.publisher.counters["event_batches"] >= 15
        assert lossy.replays >= 1 and not lossy.drop
        with late:
            matches(late, served)  # its first batch is not 0: it replays from 0
            assert late.replays >= 1 and late.batches[0].events[0].__class__ is AllBlocksCleared


def test_a_failed_put_publishes_nothing(started, endpoints):
    served = started(capacity=16 * MIB, max_block_size=1 * MIB, max_message_size=4 * MIB,
                     **endpoints)  # fmt: skip
    with served.subscriber() as sub:
        sock = raw_socket(served.node.address)
        ok, big = os.urandom(1000), os.urandom(MIB + 1)
        bad = [os.urandom(16) for _ in range(4)]
        frames = [ok, big, ok, ok]
        sums = [checksum(ok) ^ 1, checksum(big), checksum(ok), checksum(ok)]
        keys = [bad[0], bad[1], b"", bad[2]]
        h = head(op="PUT", keys=keys, sizes=[len(f) for f in frames], sums=sums)
        reply, _ = ask(sock, [h, *frames[:3], b"x"])  # a frame short of its size: BAD_FRAMES
        assert reply["code"] != 0
        reply, _ = ask(sock, [h, *frames])
        assert reply["status"] == [Status.BAD_CHECKSUM, Status.TOO_LARGE, Status.BAD_KEY,
                                   Status.OK]  # fmt: skip
        marker = os.urandom(16)
        reply, _ = ask(sock, [head(op="PUT", keys=[marker], sizes=[3], sums=[checksum(b"abc")]),
                              b"abc"])  # fmt: skip
        sock.close()
        wait_until(lambda: sub.poll(50) >= 0 and marker in sub.stored(MEMORY), 20, "the marker")
        published = [h for b in sub.batches for ev in b.events if hasattr(ev, "block_hashes")
                     for h in ev.block_hashes]  # fmt: skip
        assert not set(bad[:2]) & set(published) and bad[2] in published
        assert served.contents()[MEMORY] == {bad[2], marker}


@pytest.mark.parametrize("queue", [1, 1 << 20])
def test_no_subscriber_or_one_that_never_reads_never_stalls_the_node(started, endpoints, queue):
    served = started(capacity=4 * MIB, max_block_size=256 << 10, max_message_size=4 * MIB,
                     events_queue=queue, events_buffer=100_000, **endpoints)  # fmt: skip
    keys, vals = fresh(3000, 2000)
    with served.client() as c:
        for i in range(0, 1500, 50):  # nobody subscribed
            assert c.put_many(keys[i : i + 50], vals[i : i + 50]) == [Status.OK] * 50
        stuck = served.subscriber(rcvhwm=1)  # connected, never reads
        for i in range(1500, 3000, 50):
            assert c.put_many(keys[i : i + 50], vals[i : i + 50]) == [Status.OK] * 50
            assert c.get_many(keys[i : i + 2]) is not None
        with stuck, served.subscriber() as sub:
            matches(sub, served)  # with queue 1, also after drops and resyncs
    server = node_metrics(served.node, None, "127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    finally:
        server.close()
    with served.node.lock:
        stats = served.node.stats()
    if queue == 1:  # keys past the queue are dropped; a resync's snapshot stands for them
        assert stats["events_dropped"] > 0 and stats["event_resyncs"] >= 2
    else:
        assert stats["event_keys"] >= 3000 and stats["events_dropped"] == 0
    for name in ("event_batches", "event_keys", "event_replays", "events_dropped",
                 "event_resyncs"):  # fmt: skip
        assert re.search(rf"^pagekv_node_{name}_total [0-9.e+]+$", text, re.M), name


def test_the_readme_subscriber_follows_a_node(started, endpoints):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## KV events", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, "README.md (KV events)", "exec"), scope)
    served = started(capacity=2 * MIB, max_block_size=256 << 10, max_message_size=4 * MIB,
                     **endpoints)  # fmt: skip
    index: dict = {}
    pub = served.node.publisher
    batches = scope["follow"](pub.endpoint, pub.replay_endpoint, index)
    keys, vals = fresh(60, 60_000)
    with served.client() as c:
        for i in range(0, 60, 6):  # the first batches go before the SUB socket is connected
            assert c.put_many(keys[i : i + 6], vals[i : i + 6]) == [Status.OK] * 6
        assert c.delete_many(sorted(served.contents()[MEMORY])[:2]) == [True, True]
    want = served.contents()
    wait_until(lambda: next(batches) >= 0 and {m: index.get(m, set()) for m in want} == want,
               20, "the README subscriber's index")  # fmt: skip


# ---- the settings: pagekv serve and pagekv cluster -------------------------------------------
def test_serve_takes_the_events_settings_and_names_a_busy_endpoint():
    any_port = "tcp://127.0.0.1:0"
    node = Node(env={"PAGEKV_EVENTS_ENDPOINT": any_port, "PAGEKV_EVENTS_REPLAY_ENDPOINT": any_port,
                     "PAGEKV_EVENTS_TOPIC": "node-a"})  # fmt: skip
    try:
        bound = node.wait_line(r"KV events on (tcp://\S+), replays on (tcp://\S+)$")
        ev, rp = bound.group(1), bound.group(2)
        key, val = os.urandom(16), os.urandom(1000)
        with Subscriber(ev, rp, topic=b"node-a") as sub, StoreClient(node.address) as c:
            assert c.put_many([key], [val]) == [Status.OK]
            wait_until(lambda: sub.poll(50) >= 0 and key in sub.stored(MEMORY), 20, "the key")
        busy = run_cli("serve", "--port", "0", "--events-endpoint", ev)
        assert busy.returncode == 1 and f"cannot bind {ev}" in busy.stderr, busy.stderr
    finally:
        assert node.stop() == 0
    bad = run_cli("serve", "--port", "0", "--events-replay-endpoint", any_port)
    assert bad.returncode == 2 and "--events-replay-endpoint needs --events-endpoint" in bad.stderr
    bad = run_cli("serve", "--port", "0", "--events-endpoint", "nowhere")
    assert bad.returncode == 2 and "--events-endpoint: not an endpoint" in bad.stderr, bad.stderr


def test_cluster_nodes_publish_on_their_own_endpoints(tmp_path):
    assert node_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert node_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert node_endpoint(f"ipc://{tmp_path}/ev", 1) == f"ipc://{tmp_path}/ev-node1"
    cluster = Proc("cluster", "--nodes", "2", "--base-port", "0", "--capacity", "8MiB",
                   "--events-endpoint", f"ipc://{tmp_path}/ev")  # fmt: skip
    try:
        ready = cluster.wait_line(r"pagekv cluster ready: 2 nodes: (.+)$")
        for i, address in enumerate(ready.group(1).split()):
            key = os.urandom(16)
            with Subscriber(f"ipc://{tmp_path}/ev-node{i}", None) as sub, \
                    StoreClient(address) as c:  # fmt: skip
                sub.drop = set()
                c.put_many([key], [b"v" * 100])
                wait_until(lambda k=key, s=sub: _seen(s, k), 20, f"node {i}'s event")
    finally:
        assert cluster.stop(signal.SIGINT) == 0


def _seen(sub: Subscriber, key: bytes) -> bool:
    """Whether a batch with ``key`` arrived (no replay socket: batches before are skipped)."""
    while sub.sub.poll(50):
        _, _, payload = sub.sub.recv_multipart()
        if any(key in getattr(ev, "block_hashes", ()) for ev in decode_batch(payload).events):
            return True
    return False


def test_a_replay_of_the_whole_buffer_arrives_whole_to_a_subscriber_not_reading_yet(
    tmp_path, monkeypatch
):
    """A replay is sent in one go; a subscriber that reads only once it was sent must still
    get every buffered batch and the end marker: past the ROUTER's default high-water mark
    (1000 messages) the rest was dropped without a word, the end marker with it."""
    import zmq

    from pagekv.store.node import event_publisher as ep

    monkeypatch.setattr(ep, "MAX_BATCH_KEYS", 1)  # a batch a key: a large node's resync, small
    keys = [os.urandom(16) for _ in range(3000)]
    sent = threading.Event()
    real = ep.EventPublisher._serve_replays

    def serve(self, timeout_ms):
        real(self, timeout_ms)
        if self.counters["event_replays"]:
            sent.set()  # every message of the replay is queued for the peer, or dropped

    monkeypatch.setattr(ep.EventPublisher, "_serve_replays", serve)
    ctx = zmq.Context()
    pub = ep.EventPublisher(ctx, NodeEvents(1 << 20), lambda: [(MEMORY, keys)],
                            endpoint=f"ipc://{tmp_path}/events", topic="", buffer=10_000,
                            replay_endpoint=f"ipc://{tmp_path}/replay")  # fmt: skip
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        wait_until(lambda: pub.counters["event_batches"] > len(keys), 20, "the resync")
        buffered = [seq for seq, _ in list(pub._buffer)]
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        assert sent.wait(20), "no replay"
        seqs = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames[2] == ep.END_SEQ:
                break
            seqs.append(int.from_bytes(frames[2], "big"))
        else:
            raise AssertionError(f"no end marker after {len(seqs)} batches")
        assert seqs[: len(buffered)] == buffered
    finally:
        dealer.close()
        pub.close()
        ctx.term()
