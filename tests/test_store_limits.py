"""Clients learn each node's limits and cut any batch to fit; big transfers get time to move."""

import asyncio
import os
import signal
import time

import pytest

from pagekv.store import AsyncStoreClient, ClientConfig, Status, StoreClient
from pagekv.store.launch import NodeProcess
from tests.helpers import sigstop, store_blocks
from tests.store_fakes import ThrottledProxy
from tests.test_store_node import Running


@pytest.fixture
def small_limits():
    # A node process, as deployed: an asyncio client sharing its process with a node thread
    # saw that node take its requests seconds late (never a node process: under investigation)
    node = NodeProcess("--capacity", "256MiB", "--max-block-size", "1MiB",
                       "--max-message-size", "2MiB", "--max-keys", "100", "--max-frames", "50",
                       "--window", "2").start()  # fmt: skip
    yield node
    node.stop()


def test_limits_are_learned_and_batches_cut_to_them(small_limits):
    keys = [os.urandom(16) for _ in range(1000)]
    values = [[os.urandom(300), os.urandom(700)] if i % 2 else os.urandom(900_000 if i % 97 == 0
              else 2000) for i in range(len(keys))]  # fmt: skip
    with StoreClient(small_limits.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        limits = client.router.limits[0]
        assert (limits.max_keys, limits.max_frames, limits.window) == (100, 50, 2)
        assert limits.max_message_size == 2 << 20
        assert client.exists_many(keys).found == [True] * len(keys)
        into = [[bytearray(len(f)) for f in v] if isinstance(v, list) else bytearray(len(v))
                for v in values]  # fmt: skip
        assert client.get_many(keys, into=into) == [True] * len(keys)
        for got, want in zip(into, values):
            assert (bytes(got) if not isinstance(want, list) else [bytes(g) for g in got]) == want
        # without into, sizes are unknown: the node defers what does not fit in one reply
        big = [k for k, v in zip(keys, values) if not isinstance(v, list) and len(v) > 2000]
        views = client.get_many(big * 3)
        assert [bytes(v) for v in views] == [values[keys.index(k)] for k in big * 3]
        assert client.delete_many(keys) == [True] * len(keys)
        stats = client.stats()[0]
        assert stats["bad_requests"] == 0 and stats["deferred"] > 0
        # a value over the node's message limit is refused without being sent
        assert client.put_many([b"too-big-key-0001"], [bytes(3 << 20)]) == [Status.TOO_LARGE]


def test_a_million_keys_in_one_batch():
    node = NodeProcess("--capacity", "2GiB").start()  # a million blocks' real cost fits
    keys = [i.to_bytes(16, "little") for i in range(1_000_000)]
    try:
        with StoreClient(node.address, timeout_s=10) as client:
            start = time.monotonic()
            assert client.exists_many(keys).found == [False] * len(keys)
            assert client.put_many(keys, [b"v"] * len(keys)) == [Status.OK] * len(keys)
            assert client.exists_many(keys).leading == len(keys)
            assert client.delete_many(keys) == [True] * len(keys)
            assert client.stats()[0]["blocks"] == 0
            took = time.monotonic() - start
        print(f"\n[limits] 1M keys exists+put+exists+delete: {took:.1f} s")
    finally:
        node.stop()


@pytest.mark.asyncio
async def test_async_client_cuts_batches_too(small_limits):
    keys = [os.urandom(16) for _ in range(3000)]
    client = AsyncStoreClient(small_limits.address, timeout_s=5)
    try:
        assert await client.put_many(keys, [k * 4 for k in keys]) == [Status.OK] * len(keys)
        got = await client.get_many(keys)
        assert [bytes(g) for g in got] == [k * 4 for k in keys]
        assert (await client.exists_many(keys)).leading == len(keys)
        assert await client.delete_many(keys) == [True] * len(keys)
    finally:
        client.close()


def test_large_healthy_transfer_over_a_slow_link_is_not_a_dead_node():
    # one port only (no stream ports, no bulk lane): every byte goes through the slow link
    node = Running(capacity="256MiB", stream_ports=False, bulk=False)
    proxy = ThrottledProxy(node.address, rate=16 << 20)  # 16 MiB/s
    values = [os.urandom(4 << 20) for _ in range(6)]  # 24 MiB: ~1.5 s each way
    keys = [os.urandom(16) for _ in values]
    try:
        cfg = ClientConfig((proxy.address,), timeout_s=0.5, timeout_per_mib_s=0.2)
        with StoreClient(proxy.address, config=cfg) as client:
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
            into = [bytearray(len(v)) for v in values]
            assert client.get_many(keys, into=into) == [True] * len(keys)
            assert [bytes(b) for b in into] == values
            assert client.counters["node_failures"] == 0
    finally:
        proxy.close()
        node.stop()


def test_backed_off_node_is_read_as_last_resort_once_it_is_back():
    """The only node holding a key was backed off (it stopped answering) and came back: reads
    find it again at once, not after its back-off runs out."""
    nodes = [NodeProcess("--capacity", "64MiB").start() for _ in range(2)]
    try:
        eps = [n.address for n in nodes]
        cfg = ClientConfig(tuple(eps), replicas=1, timeout_s=0.5, backoff_min_s=30.0,
                           backoff_max_s=30.0)  # fmt: skip
        with StoreClient(eps, config=cfg) as client:
            keys = [os.urandom(16) for _ in range(40)]
            on_first = [k for k in keys if client.router.ranking(k)[0] == 0]
            store_blocks(cfg, keys, [k * 10 for k in keys])
            sigstop(nodes[0].proc.pid)
            assert client.get_many(on_first[:1]) == [None]  # times out: node 0 backed off
            assert not client.router.health[0].is_up(time.monotonic())
            nodes[0].proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 5
            while (got := client.get_many(on_first)) != [k * 10 for k in on_first]:
                assert all(g is None or bytes(g) == k * 10 for g, k in zip(got, on_first))
                assert time.monotonic() < deadline, "a backed-off node holding keys never read"
    finally:
        for n in nodes:
            n.proc.send_signal(signal.SIGCONT)
            n.stop()


@pytest.mark.asyncio
async def test_async_stopped_node_then_resumed():
    node = NodeProcess("--capacity", "64MiB").start()
    try:
        client = AsyncStoreClient(node.address, timeout_s=0.5)
        key = os.urandom(16)
        store_blocks(ClientConfig((node.address,)), [key], [b"x" * 1000])
        assert await client.get_many([key]) == [b"x" * 1000]  # connected before the stop
        sigstop(node.proc.pid)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await client.get_many([key]) == [None]
        assert loop.time() - start < 1.0
        start = loop.time()
        assert await client.get_many([key]) == [None]  # backed off, not connected: at once
        assert loop.time() - start < 0.2
        node.proc.send_signal(signal.SIGCONT)
        deadline = loop.time() + 5
        while (await client.get_many([key])) != [b"x" * 1000]:
            assert loop.time() < deadline, "node not used again after SIGCONT"
        client.close()
    finally:
        node.proc.send_signal(signal.SIGCONT)
        node.stop()
