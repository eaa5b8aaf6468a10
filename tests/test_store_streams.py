"""Several streams (connections) per node: correctness on random data, concurrent calls, a node
stopped mid-transfer, no threads left behind by closed clients. Real node processes."""

import asyncio
import os
import random
import signal
import time

import numpy as np
import pytest

from pagekv.store import AsyncStoreClient, ClientConfig, Status, StoreClient
from pagekv.store.client.routing import Link
from pagekv.store.config import MAX_STREAMS, default_streams
from pagekv.store.launch import NodeProcess
from tests.helpers import POISON, as_bytes, poisoned_like, sigstop, store_blocks


@pytest.fixture
def node_proc():
    node = NodeProcess("--capacity", "256MiB", "--io-threads", "2").start()
    yield node
    node.proc.send_signal(signal.SIGCONT)
    node.stop()


def random_values(rng: random.Random, count: int) -> list:
    """Mixed sizes (a few bytes to 300 KiB, both sides of the GIL-free copy threshold); every
    fifth value has 2-3 frames."""
    values = []
    for i in range(count):
        sizes = [rng.choice([7, 4096, 70_000, 300_000]) for _ in range(2 + i % 2)]
        frames = [rng.randbytes(s) for s in sizes]
        values.append(frames if i % 5 == 0 else frames[0])
    return values


def config(node: NodeProcess, **kw) -> ClientConfig:
    kw = {"streams": 4, "timeout_s": 10.0, "max_message_bytes": 1 << 20, **kw}
    return ClientConfig((node.address,), **kw)


@pytest.mark.parametrize(
    "cores, by_nodes",
    [(1, [1, 1, 1, 1]), (2, [1, 1, 1, 1]), (8, [4, 2, 2, 1]), (16, [8, 4, 3, 1]),
     (128, [8, 4, 3, 1])],
)  # fmt: skip
def test_default_streams_share_one_per_two_cores_over_the_nodes(monkeypatch, cores, by_nodes):
    """One stream per 2 cores (up to 8) in all, shared out over the nodes, rounded up: a
    client of one node gets as many streams as one of several has in all."""
    from pagekv.store import config as store_config

    monkeypatch.setattr(store_config, "_usable_cores", lambda: cores)
    assert [default_streams(n) for n in (1, 2, 3, 9)] == by_nodes
    eps = [f"tcp://127.0.0.1:{p}" for p in (1, 2, 3)]
    assert [ClientConfig(tuple(eps[:n])).streams for n in (1, 2, 3)] == by_nodes[:3]
    assert store_config.NodeConfig(port=0).io_threads == min(4, max(1, cores // 4))


def test_streams_config_is_validated():
    for bad in (0, -1, 1.5, True, "2", MAX_STREAMS + 1):
        with pytest.raises(ValueError, match="streams"):
            ClientConfig(("tcp://127.0.0.1:1",), streams=bad)


def test_removed_lane_switches_are_gone(capfd):
    """Staged receives and the switch for lane PUTs were removed (a node's PUTs take its lane
    wherever its GETs can): their config fields and the node's flag are refused, not
    ignored."""
    from pagekv.store import NodeConfig
    from pagekv.store.cli import main as cli_main

    with pytest.raises(TypeError, match="staged_receives"):
        NodeConfig(port=0, staged_receives=1)
    for field in ("staged_receive", "bulk_puts"):
        with pytest.raises(TypeError, match=field):
            ClientConfig(("tcp://127.0.0.1:1",), **{field: True})
    with pytest.raises(SystemExit):
        cli_main(["serve", "--port", "0", "--staged-receives", "1"])
    assert "unrecognized arguments: --staged-receives" in capfd.readouterr().err


@pytest.mark.asyncio
async def test_async_streams_round_trip_random_data(node_proc):
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(300)]
    values = random_values(rng, len(keys))
    client = AsyncStoreClient(
        node_proc.address, config=config(node_proc, bulk=False)
    )  # its ZeroMQ links
    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [poisoned_like(v) for v in values]
        assert await client.get_many(keys, into=into) == [True] * len(keys)
        assert [as_bytes(b) for b in into] == [as_bytes(v) for v in values]
        views = await client.get_many(keys)
        assert [as_bytes(v) for v in views] == [as_bytes(v) for v in values]
        used = [link for link in client._zmq._links[0] if link is not None and link.loop]
        assert len(used) == 4, "the batch did not use every stream"
        absent = [rng.randbytes(16) for _ in range(20)]
        found = await client.exists_many(keys[:50] + absent + keys[50:60])
        assert found.found == [True] * 50 + [False] * 20 + [True] * 10
        gone = set(rng.sample(range(len(keys)), 100))
        deleted = await client.delete_many([keys[i] for i in sorted(gone)])
        assert deleted == [True] * len(gone)
        into = [poisoned_like(v) for v in values]
        got = await client.get_many(keys, into=into)
        assert got == [i not in gone for i in range(len(keys))]
        for i, (buf, value) in enumerate(zip(into, values)):
            want = poisoned_like(value) if i in gone else value
            assert as_bytes(buf) == as_bytes(want), f"key {i}"
    finally:
        client.close()


def test_blocking_streams_round_trip_random_data(node_proc):
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(200)]
    values = random_values(rng, len(keys))
    with StoreClient(node_proc.address, config=config(node_proc)) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [poisoned_like(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [as_bytes(b) for b in into] == [as_bytes(v) for v in values]
        assert all(link is not None for link in client._client._zmq._links[0])
        assert client.delete_many(keys[:10]) == [True] * 10
        assert client.get_many(keys[:12]) == [None] * 10 + [as_bytes(v) for v in values[10:12]]


@pytest.mark.asyncio
async def test_concurrent_get_many_over_streams(node_proc):
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(160)]
    values = [rng.randbytes(rng.choice([100, 80_000, 200_000])) for _ in keys]
    client = AsyncStoreClient(node_proc.address, config=config(node_proc))
    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        picks = [rng.sample(range(len(keys)), 60) for _ in range(8)]  # overlapping subsets
        intos = [[poisoned_like(values[i]) for i in pick] for pick in picks]
        oks = await asyncio.gather(
            *(client.get_many([keys[i] for i in pick], into=into)
              for pick, into in zip(picks, intos))
        )  # fmt: skip
        for pick, into, ok in zip(picks, intos, oks):
            assert ok == [True] * len(pick)
            assert [bytes(b) for b in into] == [values[i] for i in pick]
    finally:
        client.close()


@pytest.mark.asyncio
async def test_node_stopped_mid_transfer_with_streams(node_proc):
    """Three concurrent calls meet a node stopped on the first arrival (mid-transfer, or just
    after it, as the kernel's buffers allow), a fourth starts once every thread of the node is
    stopped. Each ends within its one timeout; every value reported is right; a miss's buffer
    holds, byte for byte, its poison or its own value's bytes (received before the deadline:
    the contract leaves it unspecified, never another value's); the fourth misses every key and
    writes nothing; after SIGCONT the client works again."""
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(128)]
    values = [rng.randbytes(256 << 10) for _ in keys]
    cfg = config(node_proc, timeout_s=0.5)
    store_blocks(config(node_proc), keys, values)
    client = AsyncStoreClient(node_proc.address, config=cfg)
    try:
        stopped = asyncio.Event()

        def stop_node(_i: int) -> None:
            if not stopped.is_set():
                sigstop(node_proc.proc.pid)
                stopped.set()

        parts = [range(0, 32), range(32, 64), range(64, 96), range(96, 128)]
        intos = [[bytearray([POISON]) * len(values[i]) for i in part] for part in parts]

        async def timed(part, into, on_arrival=None, after=None):
            if after is not None:
                await asyncio.wait_for(after.wait(), timeout=30)
            start = time.monotonic()
            ok = await client.get_many([keys[i] for i in part], into=into, on_arrival=on_arrival)
            return ok, time.monotonic() - start

        results = await asyncio.gather(
            timed(parts[0], intos[0], on_arrival=stop_node),
            timed(parts[1], intos[1]),
            timed(parts[2], intos[2]),
            timed(parts[3], intos[3], after=stopped),
        )
        bound = cfg.timeout_for(32 * (256 << 10)) + 1.0  # one timeout, plus a loaded machine
        for part, into, (ok, took) in zip(parts, intos, results):
            assert took < bound, f"a call took {took:.2f}s with the node stopped"
            for i, hit, buf in zip(part, ok, into):
                if hit:
                    assert bytes(buf) == values[i]
                else:
                    got, want = np.frombuffer(buf, np.uint8), np.frombuffer(values[i], np.uint8)
                    assert ((got == want) | (got == POISON)).all(), f"key {i}: foreign bytes"
        late_ok, _ = results[3]
        assert late_ok == [False] * len(parts[3]), "a stopped node answered"
        assert all(bytes(buf) == bytes([POISON]) * len(buf) for buf in intos[3])
        node_proc.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:
            into = [bytearray(len(v)) for v in values]
            if await client.get_many(keys, into=into) == [True] * len(keys):
                assert [bytes(b) for b in into] == values
                break
            assert time.monotonic() < deadline, "the client did not recover after SIGCONT"
    finally:
        node_proc.proc.send_signal(signal.SIGCONT)
        client.close()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_closed_clients_leave_no_threads_or_sockets(node_proc):
    StoreClient(node_proc.address, streams=4).close()  # the shared 4-thread context exists
    before = _threads()
    for _ in range(20):
        with StoreClient(node_proc.address, streams=4, timeout_s=5) as client:
            assert client.ping() == [True]
        client = AsyncStoreClient(node_proc.address, streams=4, timeout_s=5)
        client.close()
    assert _threads() <= before + 4 + 2  # at most the async context's I/O threads (+ reaper)
    assert client._zmq._links == {}


@pytest.mark.asyncio
async def test_reset_of_one_link_fails_only_its_requests():
    """A link reset mid-batch (what a timeout on it does) fails the requests on that link
    only: the half of the batch dealt to the other link all arrive, right. The node's window
    of 1 keeps requests waiting on each link when the first value arrives (with a wider one,
    a 16-core host had every reply in before the first arrival was handled, and nothing
    failed)."""
    node = NodeProcess("--capacity", "256MiB", "--io-threads", "2", "--window", "1").start()
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(64)]
    values = [rng.randbytes(256 << 10) for _ in keys]
    client = AsyncStoreClient(node.address, config=config(node, streams=2, bulk=False))
    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        resets = []

        def reset_second_link(_i: int) -> None:
            if not resets:
                resets.append(client._zmq._links[0][1])
                client._zmq._reset(resets[0])

        into = [bytearray([POISON]) * len(v) for v in values]
        ok = await client.get_many(keys, into=into, on_arrival=reset_second_link)
        assert resets and resets[0].closed and client._zmq._links[0][1] is not resets[0]
        assert len(keys) // 2 <= ok.count(True) < len(keys)
        for hit, buf, value in zip(ok, into, values):
            assert bytes(buf) == (value if hit else bytes([POISON]) * len(buf))
        # the failed requests back the node off; it takes requests again once the replacing
        # link has done its handshake (ZeroMQ's I/O thread: on a loaded host, after this point)
        deadline = time.monotonic() + 10
        while client._zmq.link_state(0) is not Link.UP:
            assert time.monotonic() < deadline, "the replacing link did not connect in 10 s"
            await asyncio.sleep(0.005)
        assert await client.get_many(keys, into=into) == [True] * len(keys)  # link replaced
        assert [bytes(b) for b in into] == values
    finally:
        client.close()
        node.stop()


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_a_put_s_requests_go_out_dealt_over_the_streams_in_turn(node_proc, monkeypatch, kind):
    """A PUT hashes each request as it is sent: the requests must leave about in batch order,
    one per stream in turn, so that every stream starts at once (a stream whose socket is not
    writable yet may let the next one pass). When one stream's requests were all hashed and
    sent before the next stream's first (4 streams on the H100 host: the fourth began after
    42 ms of a 70 ms put), the streams ran one after the other."""
    from pagekv.store.client import operations
    from pagekv.store.wire.protocol import checksum_frames

    values = [os.urandom(64 << 10) for _ in range(32)]
    keys = [b"turn-%d" % i for i in range(len(values))]
    order = []

    def noting(frames):
        order.append(values.index(bytes(frames[0])) // 4)  # request of 4 values (256 KiB)
        return checksum_frames(frames)

    cfg = config(node_proc, streams=2, bulk=False, copy_threads=1, max_message_bytes=256 << 10)
    warm = [b"warm-%d" % i for i in range(8)]  # both streams connected (a put on each) first
    ok = [Status.OK] * len(keys)
    if kind == "blocking":
        with StoreClient(node_proc.address, config=cfg) as client:
            assert client.put_many(warm, values[:8]) == ok[:8]
            monkeypatch.setattr(operations, "checksum_frames", noting)
            assert client.put_many(keys, values) == ok
    else:

        async def both(client: AsyncStoreClient) -> list:
            assert await client.put_many(warm, values[:8]) == ok[:8]
            monkeypatch.setattr(operations, "checksum_frames", noting)
            return await client.put_many(keys, values)

        client = AsyncStoreClient(node_proc.address, config=cfg)
        try:
            assert asyncio.run(both(client)) == ok
        finally:
            client.close()
    requests = list(dict.fromkeys(order))
    assert sorted(requests) == list(range(8)), order
    assert all(abs(at - r) < 2 for at, r in enumerate(requests)), requests
