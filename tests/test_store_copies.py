"""Checked copies (pagekv.store.wire.copies) and the clients' copy pool: values checked and
copied on pool threads are right on fresh random data, misses are counted, a node verifies large
PUTs on its pool, and a call never returns while a pool thread still writes into the caller's
buffers.
Real node processes. The clients here use ZeroMQ only (``bulk=False``): it is the path these
copies serve (the bulk lane receives in place; tests/test_store_bulk.py)."""

import asyncio
import concurrent.futures
import os
import random
import threading

import numpy as np
import pytest

from pagekv import build_cache
from pagekv.store import AsyncStoreClient, ClientConfig, Status, StoreClient
from pagekv.store.client import operations, zeromq
from pagekv.store.config import NodeConfig, default_copy_threads
from pagekv.store.launch import NodeProcess
from pagekv.store.wire import copies, native
from pagekv.store.wire.copies import copy_checksum, shared_pool
from pagekv.store.wire.protocol import checksum_frames
from tests.helpers import POISON, as_bytes, poisoned_like


@pytest.fixture
def node_proc():
    node = NodeProcess("--capacity", "256MiB", "--verify-threads", "4").start()
    yield node
    node.stop()


def random_values(rng: random.Random, count: int) -> list:
    """Sizes on both sides of the chunk (256 KiB) and small-frame (64 KiB) thresholds, some
    not multiples of anything; every fourth value has two or three frames."""
    values = []
    for i in range(count):
        sizes = [rng.choice([5, 60_000, 65_536, 262_145, 1 << 20, 700_001]) for _ in range(3)]
        frames = [rng.randbytes(s) for s in sizes[: 1 + i % 3]]
        values.append(frames if i % 4 == 0 else frames[0])
    return values


def test_copy_checksum_matches_a_plain_copy_and_hash():
    rng = np.random.default_rng(int.from_bytes(os.urandom(8)))
    for sizes in ([1], [65_535], [65_536], [262_144 * 3 + 17], [5, 1 << 20, 300_001]):
        sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        targets = [memoryview(bytearray([POISON]) * n) for n in sizes]
        got = copy_checksum(targets, sources)
        assert got == checksum_frames([s.tobytes() for s in sources])
        assert [bytes(t) for t in targets] == [s.tobytes() for s in sources]


def test_copy_checksum_refuses_sizes_that_differ():
    with pytest.raises(ValueError):
        copy_checksum([memoryview(bytearray(1 << 20))], [bytes((1 << 20) - 1)])
    with pytest.raises(ValueError):
        copy_checksum([memoryview(bytearray(10))], [bytes(11)])
    with pytest.raises(ValueError):
        copy_checksum([memoryview(bytearray(10))], [])


def test_copy_threads_config():
    assert 1 <= default_copy_threads() <= 8
    assert ClientConfig(("tcp://127.0.0.1:1",)).copy_threads == default_copy_threads()
    assert NodeConfig(port=0).verify_threads == default_copy_threads()
    for bad in (0, -1, 1.5, True, "2", 65):
        with pytest.raises(ValueError, match="copy_threads"):
            ClientConfig(("tcp://127.0.0.1:1",), copy_threads=bad)
    with pytest.raises(ValueError, match="verify_threads"):
        NodeConfig(port=0, verify_threads=-1)
    assert shared_pool(1) is None and shared_pool(3) is shared_pool(3)


@pytest.mark.parametrize("streams", [1, 3])
def test_blocking_client_checks_on_its_pool(node_proc, streams):
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(40)]
    values = random_values(rng, len(keys))
    cfg = ClientConfig(
        (node_proc.address,), bulk=False, streams=streams, copy_threads=4, timeout_s=10
    )
    with StoreClient(node_proc.address, config=cfg) as client:
        assert client.router.pool is shared_pool(4)
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        missing = rng.randbytes(16)
        into = [poisoned_like(v) for v in values] + [bytearray(8)]
        arrived: list[int] = []
        got = client.get_many([*keys, missing], into=into, on_arrival=arrived.append)
        assert got == [True] * len(keys) + [False]
        assert [as_bytes(b) for b in into[:-1]] == [as_bytes(v) for v in values]
        assert sorted(arrived) == list(range(len(keys)))  # each once, never the miss
        assert client.counters["checksum_mismatch"] == 0


@pytest.mark.asyncio
async def test_async_client_checks_on_its_pool_concurrently(node_proc):
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(48)]
    values = random_values(rng, len(keys))
    cfg = ClientConfig((node_proc.address,), bulk=False, streams=2, copy_threads=4, timeout_s=10,
                       max_message_bytes=2 << 20)  # fmt: skip
    client = AsyncStoreClient(node_proc.address, config=cfg)
    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        picks = [rng.sample(range(len(keys)), 20) for _ in range(4)]
        intos = [[poisoned_like(values[i]) for i in pick] for pick in picks]
        oks = await asyncio.gather(
            *(client.get_many([keys[i] for i in p], into=b) for p, b in zip(picks, intos))
        )
        for pick, into, ok in zip(picks, intos, oks):
            assert ok == [True] * len(pick)
            assert [as_bytes(b) for b in into] == [as_bytes(values[i]) for i in pick]
    finally:
        client.close()


def test_a_bad_checksum_on_the_pool_is_a_counted_miss(monkeypatch):
    """A node that does not verify PUTs stores a value whose checksum does not match; the
    client's pool finds it as it copies, reports a miss and counts it."""
    node = NodeProcess("--capacity", "64MiB", "--no-verify-puts").start()
    try:
        rng = random.Random(os.urandom(8))
        keys = [rng.randbytes(16) for _ in range(6)]
        values = [rng.randbytes(1 << 20) for _ in keys]
        cfg = ClientConfig((node.address,), bulk=False, copy_threads=4, timeout_s=10)
        with StoreClient(node.address, config=cfg) as client:
            real = operations.checksum_frames
            bad = {bytes(values[2][:64])}

            def lie_about_one(frames):  # the checksum sent with value 2 is off by one
                value = real(frames)
                return value ^ 1 if bytes(frames[0][:64]) in bad else value

            monkeypatch.setattr(operations, "checksum_frames", lie_about_one)
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
            monkeypatch.setattr(operations, "checksum_frames", real)
            into = [bytearray(len(v)) for v in values]
            assert client.get_many(keys, into=into) == [i != 2 for i in range(len(keys))]
            assert [bytes(b) for i, b in enumerate(into) if i != 2] == values[:2] + values[3:]
            assert client.counters["checksum_mismatch"] == 1
    finally:
        node.stop()


def test_node_verifies_large_puts_on_its_pool():
    """With verify threads, a large PUT whose checksums are wrong for some values stores the
    right ones and refuses exactly the wrong ones."""
    node = NodeProcess("--capacity", "64MiB", "--verify-threads", "4").start()
    try:
        rng = random.Random(os.urandom(8))
        keys = [rng.randbytes(16) for _ in range(12)]
        values = [rng.randbytes(1 << 20) for _ in keys]
        wrong = {1, 7}
        real = operations.checksum_frames
        marks = {bytes(values[i][:64]) for i in wrong}

        def lie(frames):
            value = real(frames)
            return value ^ 1 if bytes(frames[0][:64]) in marks else value

        with StoreClient(node.address, timeout_s=10) as client:
            orig, operations.checksum_frames = operations.checksum_frames, lie
            try:
                got = client.put_many(keys, values)
            finally:
                operations.checksum_frames = orig
            expected = [Status.BAD_CHECKSUM if i in wrong else Status.OK for i in range(12)]
            assert got == expected
            into = [bytearray(len(v)) for v in values]
            assert client.get_many(keys, into=into) == [i not in wrong for i in range(12)]
            assert [bytes(into[i]) for i in range(12) if i not in wrong] == [
                values[i] for i in range(12) if i not in wrong
            ]
    finally:
        node.stop()


@pytest.mark.asyncio
async def test_a_call_never_returns_while_its_pool_still_copies(node_proc, monkeypatch):
    """The call's deadline passes while a pool thread is copying a reply into the caller's
    buffer: get_many must wait for that copy before returning (the caller reuses the buffer
    at once). The copy is held until the client waits on it, so without that wait the call
    returns with the copy still pending and the test fails."""
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(4)]
    values = [rng.randbytes(1 << 20) for _ in keys]
    # the held copy outlasts any deadline (it waits for the client's wait): 2 s leaves the
    # setup's PUT room on a loaded machine (0.3 s failed there)
    cfg = ClientConfig((node_proc.address,), bulk=False, streams=1, copy_threads=2, timeout_s=2.0,
                       timeout_per_mib_s=0.0)  # fmt: skip
    client = AsyncStoreClient(node_proc.address, config=cfg)
    gate, state, lock = threading.Event(), {"started": 0, "finished": 0}, threading.Lock()
    real_copy, real_wait = operations.copy_checksum, concurrent.futures.wait

    def held_copy(targets, sources):
        with lock:
            state["started"] += 1
        gate.wait(30)  # released only when the client waits for its running copies
        try:
            return real_copy(targets, sources)
        finally:
            with lock:
                state["finished"] += 1

    def waiting(futures, *args, **kwargs):
        gate.set()
        return real_wait(futures, *args, **kwargs)

    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        monkeypatch.setattr(operations, "copy_checksum", held_copy)
        monkeypatch.setattr(zeromq.concurrent.futures, "wait", waiting)
        into = [bytearray([POISON]) * len(v) for v in values]
        got = await client.get_many(keys, into=into)
        with lock:
            assert state["started"] >= 1 and state["finished"] == state["started"]
        assert gate.is_set(), "the deadline did not pass during a copy"
        for ok, buf, value in zip(got, into, values):
            assert bytes(buf) in ((value,) if ok else (value, bytes([POISON]) * len(value)))
    finally:
        gate.set()
        client.close()


def test_copies_module_has_no_store_imports():
    """copies is a leaf (config imports it): it must not import the rest of the store, only
    the native checked copy, itself a leaf (it imports nothing of pagekv but the errors and
    the build-once rule, which imports nothing of pagekv)."""
    source = open(copies.__file__).read().replace("from . import native\n", "", 1)
    assert "from ." not in source and "import pagekv" not in source
    source = open(native.__file__).read().replace("from pagekv.errors import", "", 1)
    source = source.replace("from pagekv.build_cache import", "", 1)
    assert "from ." not in source and "import pagekv" not in source and "pagekv." not in source
    source = open(build_cache.__file__).read()
    assert "from ." not in source and "pagekv" not in source.split('"""')[2]


# ---- per-stream ports: each stream served by its own node I/O thread ----------------------


def test_node_advertises_a_port_per_io_thread_and_streams_use_them():
    node = NodeProcess("--capacity", "128MiB", "--io-threads", "3").start()
    try:
        rng = random.Random(os.urandom(8))
        keys = [rng.randbytes(16) for _ in range(24)]
        values = [rng.randbytes(256 << 10) for _ in keys]
        cfg = ClientConfig((node.address,), bulk=False, streams=3, copy_threads=1, timeout_s=10)
        with StoreClient(node.address, config=cfg) as client:
            assert client.put_many(keys, values) == [Status.OK] * len(keys)  # PINGs first
            ports = client.stats()[0]["stream_ports"]
            assert len(ports) == 3 and len(set(ports)) == 3
            zmq_links = client._client._zmq
            assert zmq_links._ports[0] == ports
            endpoints = sorted(link.endpoint for link in zmq_links._links[0])
            assert endpoints == sorted(f"tcp://127.0.0.1:{p}" for p in ports)
            into = [bytearray([POISON]) * len(v) for v in values]
            assert client.get_many(keys, into=into) == [True] * len(keys)
            assert [bytes(b) for b in into] == values
    finally:
        node.stop()


def test_no_stream_ports_when_turned_off():
    node = NodeProcess("--capacity", "16MiB", "--io-threads", "3", "--no-stream-ports").start()
    try:
        cfg = ClientConfig((node.address,), bulk=False, streams=3, timeout_s=10)
        with StoreClient(node.address, config=cfg) as client:
            assert client.stats()[0]["stream_ports"] == []
            assert client.put_many([b"k" * 16], [b"v" * 100]) == [Status.OK]
            assert {link.endpoint for link in client._client._zmq._links[0]} == {node.address}
    finally:
        node.stop()


@pytest.mark.asyncio
async def test_unreachable_stream_ports_fall_back_to_the_main_port():
    """A node whose advertised stream ports cannot be reached (a firewall; here ports nobody
    listens on) is still served through its main port after the connect timeout."""
    node = NodeProcess("--capacity", "16MiB", "--io-threads", "2", "--no-stream-ports").start()
    try:
        cfg = ClientConfig(
            (node.address,), bulk=False, streams=2, timeout_s=1.0, connect_timeout_s=0.5
        )
        client = AsyncStoreClient(node.address, config=cfg)
        try:
            assert await client.ping() == [True]
            dead = [free_port(), free_port()]
            client._zmq.take(0, dead)  # as if the node had advertised them
            assert {link.endpoint for link in client._zmq._links[0]} == {
                f"tcp://127.0.0.1:{p}" for p in dead
            }
            deadline = asyncio.get_running_loop().time() + 15
            while await client.put_many([b"k" * 16], [b"v" * 64]) != [Status.OK]:
                assert asyncio.get_running_loop().time() < deadline, "no fallback"
            assert client._zmq._ports[0] == []
            assert {link.endpoint for link in client._zmq._links[0]} == {node.address}
        finally:
            client.close()
    finally:
        node.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.asyncio
async def test_a_retired_link_is_closed_only_when_idle():
    """Streams moved to new ports while a call still uses the old link: that call's requests
    complete on it, and the old link is closed once released."""
    node = NodeProcess("--capacity", "64MiB", "--io-threads", "2").start()
    try:
        cfg = ClientConfig((node.address,), bulk=False, streams=2, copy_threads=1, timeout_s=10,
                           max_message_bytes=1 << 20)  # fmt: skip
        client = AsyncStoreClient(node.address, config=cfg)
        try:
            rng = random.Random(os.urandom(8))
            keys = [rng.randbytes(16) for _ in range(32)]
            values = [rng.randbytes(512 << 10) for _ in keys]
            assert await client.put_many(keys, values) == [Status.OK] * len(keys)
            old = list(client._zmq._links[0])
            into = [bytearray(len(v)) for v in values]
            call = asyncio.ensure_future(client.get_many(keys, into=into))
            while not any(link.inflight for link in old):  # the get holds the old links
                await asyncio.sleep(0)
            client._zmq.take(0, list(reversed(client._zmq._ports[0])))
            assert all(link.retired for link in old)
            assert await call == [True] * len(keys)
            assert [bytes(b) for b in into] == values
            await asyncio.sleep(0)
            assert all(link.closed for link in old)
            assert await client.get_many(keys[:2], into=into[:2]) == [True, True]
        finally:
            client.close()
    finally:
        node.stop()
