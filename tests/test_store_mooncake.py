"""Mooncake Store as a pagekv store backend (pagekv.store.mooncake): addresses and configs
everywhere; against a real master and store processes (tests/mooncake_fixture.py) where
Mooncake is installed (``make test-mooncake``): round trips into the registered host pool and
into other buffers, checksums turning corrupt objects into misses, and a master or store
process killed in the middle of a batch."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagekv.errors import ConfigError
from pagekv.store.backend import open_backend, store_config
from pagekv.store.cli.settings import tomllib
from pagekv.store.client.blocking import StoreClient
from pagekv.store.config import ClientConfig
from pagekv.store.mooncake import MooncakeConfig, values
from pagekv.store.wire.protocol import Status
from tests.helpers import wait_until

from .mooncake_fixture import mooncake_cluster

PAGE = 64 << 10
POISON = 0x5A


# ---- addresses and configs: no Mooncake needed -------------------------------------------------
def test_an_address_chooses_the_backend_once():
    assert isinstance(store_config("tcp://h:7400"), ClientConfig)
    assert isinstance(store_config(["tcp://a:1", "tcp://b:2"]), ClientConfig)
    cfg = store_config("mooncake://m:50051?metadata=http://m:8080/metadata&protocol=rdma"
                       "&device=mlx5_0,mlx5_1&replicas=2", timeout_s=3.0)  # fmt: skip
    assert cfg == MooncakeConfig("m:50051", "http://m:8080/metadata", protocol="rdma",
                                 device="mlx5_0,mlx5_1", replicas=2, timeout_s=3.0)  # fmt: skip
    assert store_config(cfg) is cfg


@pytest.mark.parametrize("address, says", [
    ("mooncake://m:1", "metadata"),
    ("mooncake://?metadata=P2PHANDSHAKE", "no master"),
    ("mooncake://m:1?metadata=x&protocol=udp", "protocol"),
    ("mooncake://m:1?metadata=x&protocol=rdma", "device"),
    ("mooncake://m:1?metadata=x&replicas=0", "replicas"),
    ("mooncake://m:1?metadata=x&timeout_s=-1", "timeout_s"),
    ("mooncake://m:1?metadata=x&segmnet=1GiB", "unknown"),
    ("mooncake://m:1?metadata=x&metadata=y", "more than once"),
    ("mooncake://m:1?metadata=x&prefix=a/b", "prefix"),
])  # fmt: skip
def test_a_bad_mooncake_address_is_a_config_error(address, says):
    with pytest.raises(ConfigError, match=says):
        store_config(address)


def test_a_mooncake_address_in_a_list_of_nodes_is_a_config_error():
    with pytest.raises(ConfigError, match="one address"):
        store_config(["tcp://a:1", "mooncake://m:1?metadata=x"])


def test_without_the_package_a_mooncake_address_is_a_typed_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # import mooncake.store fails
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ConfigError, match=r"pagekv\[mooncake\]"):
        open_backend("mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE")


def test_importing_pagekv_never_imports_mooncake():
    code = ("import sys, pagekv, pagekv.connector, pagekv.store.backend, pagekv.store.mooncake;"
            "from pagekv.store.backend import store_config;"
            "store_config('mooncake://m:1?metadata=x');"
            "assert not [m for m in sys.modules if m.startswith('mooncake')]")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_extra_names_the_package():
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert any(r.startswith("mooncake-transfer-engine")
               for r in meta["optional-dependencies"]["mooncake"])  # fmt: skip


def test_the_trailer_binds_bytes_length_and_key():
    frames = [os.urandom(100), os.urandom(7)]
    tail = values.trailer(frames, "p/aa")
    assert values.check(frames, "p/aa", tail)
    assert not values.check(frames, "p/ab", tail)
    flipped = frames[0][:-1] + bytes([frames[0][-1] ^ 1])  # one bit: never the same bytes
    assert not values.check([flipped, frames[1]], "p/aa", tail)
    assert not values.check([frames[0]], "p/aa", tail)
    assert not values.check(frames, "p/aa", tail[:-1])


def test_a_call_not_started_when_its_pool_shuts_down_never_runs(monkeypatch):
    """The executor's shutdown cancels the calls it drains from its queue, but a call its
    thread took from the queue meanwhile would still run: after close, against a paused
    store, a get queued behind a stalled one hit (test_close_with_calls_in_flight..., about 1
    run in 7). Here that race's outcome, an executor whose shutdown drains nothing: the queued
    call ends with NotRun and never runs; the one running finishes."""
    import concurrent.futures
    import threading

    from pagekv.store.mooncake.handle import NotRun
    from pagekv.store.mooncake.handle import Pool as CallPool

    drain = concurrent.futures.ThreadPoolExecutor.shutdown
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "shutdown",
                        lambda self, wait=True, *, cancel_futures=False: None)  # fmt: skip
    pool = CallPool("pagekv-test-calls", 1)
    gate, started, ran = threading.Event(), threading.Event(), []
    running = pool.submit(lambda: started.set() or gate.wait(10))  # the only thread busy
    queued = pool.submit(ran.append, 1)
    assert started.wait(10)
    pool.shutdown()
    gate.set()
    assert running.result(timeout=10) is True
    with pytest.raises(NotRun):
        queued.result(timeout=10)
    assert ran == [] and pool.pending == 0
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "shutdown", drain)
    pool.shutdown()  # the real one: its thread ends


class _Kernel:
    """Loopback ports as a kernel may give them to bind(0): the lowest not bound now, so a port
    closed is the next one given."""

    def __init__(self) -> None:
        self.bound: set[int] = set()
        kernel = self

        class Socket:
            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                kernel.bound.discard(self.port)

            def bind(self, address) -> None:
                self.port = min(set(range(5000, 5100)) - kernel.bound)
                kernel.bound.add(self.port)

            def getsockname(self):
                return ("127.0.0.1", self.port)

        self.Socket = Socket


def test_a_clusters_processes_never_get_one_port_twice(monkeypatch):
    """The master's RPC, HTTP and metrics ports and each store's are distinct even where the
    kernel gives a port again once its socket is closed (a master once got one port for RPC and
    HTTP and could not start)."""
    from pagekv.store.mooncake import launch

    kernel = _Kernel()
    monkeypatch.setattr(launch.socket, "socket", kernel.Socket)
    taken: set[int] = set()
    master = launch._free_ports(3, taken)
    stores = [launch._free_ports(1, taken)[0] for _ in range(4)]
    assert len(set(master + stores)) == 7 and taken == set(master + stores)
    assert not kernel.bound  # every socket closed: the processes bind them next


# ---- against a Mooncake Store ------------------------------------------------------------------
@pytest.fixture
def cluster():
    c = mooncake_cluster(stores=1, segment="256MiB", timeout_s=2.0)
    yield c
    c.stop()


class Pool:
    """A host pool of pages registered with the backend, as the connector's."""

    def __init__(self, backend, pages: int) -> None:
        self.mem = np.full(pages * PAGE, POISON, dtype=np.uint8)
        backend.register(self.mem.ctypes.data, self.mem.nbytes)

    def page(self, i: int) -> memoryview:
        return memoryview(self.mem)[i * PAGE : (i + 1) * PAGE]


def random_pages(n: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(16) for _ in range(n)], [os.urandom(PAGE) for _ in range(n)]


def test_round_trip_through_the_registered_pool_and_other_buffers(cluster):
    with StoreClient(cluster.address) as client:
        pool = Pool(client, 64)
        keys, data = random_pages(32)
        for i, d in enumerate(data[:16]):
            pool.page(i)[:] = d
        # 16 values from the pool (zero-copy), 16 from bytes, as two frames each
        sources = [pool.page(i) for i in range(16)] + list(data[16:])
        sources = [[memoryview(s)[: PAGE // 4], memoryview(s)[PAGE // 4 :]] for s in sources]
        assert client.put_many(keys, sources) == [Status.OK] * 32
        assert client.exists_many([*keys, os.urandom(16)]).found == [True] * 32 + [False]
        pool.mem[16 * PAGE :] = POISON
        into = [[pool.page(32 + i)[:100], pool.page(32 + i)[100:]] for i in range(16)]
        into += [bytearray([POISON]) * PAGE for _ in range(16)]
        arrived = []
        assert client.get_many(keys, into, on_arrival=arrived.append) == [True] * 32
        assert sorted(arrived) == list(range(32))
        got = [bytes(pool.page(32 + i)) for i in range(16)] + [bytes(b) for b in into[16:]]
        assert got == data
        assert [bytes(v) for v in client.get_many(keys[:3])] == data[:3]
        assert client.put_many(keys[:1], [os.urandom(PAGE)])[0] in (Status.OK, Status.EXISTS)
        assert client.get_many(keys[:1])[0] == data[0]  # write-once: the first value stays
        assert client.delete_many(keys[:2]) == [True, True]
        assert client.get_many(keys[:2]) == [None, None]


def test_a_corrupt_object_is_a_miss(cluster):
    """Objects written straight into Mooncake under pagekv's object keys: a flipped byte, the
    object of another key, a truncated object, a value without a trailer. Each is a miss,
    never bytes; the destination may hold anything after a miss but a hit is exact."""
    from pagekv.store.mooncake.handle import release, shared_handle

    cfg = store_config(cluster.address)
    with StoreClient(cfg) as client:
        keys, data = random_pages(5)
        names = [values.object_key(cfg.prefix, k) for k in keys]
        objects = [d + values.trailer([d], n) for d, n in zip(data, names)]
        flipped = bytearray(objects[0])
        flipped[PAGE // 2] ^= 0x01
        tampered = [bytes(flipped), objects[2], objects[2][:-1], data[3], objects[4]]
        handle = shared_handle(cfg)
        try:
            raw = handle.store()
            for name, obj in zip(names, tampered):
                assert raw.put(name, obj) == 0
        finally:
            release(handle)
        pool = Pool(client, 10)
        assert client.get_many(keys, [pool.page(i) for i in range(5)]) == [False] * 4 + [True]
        assert bytes(pool.page(4)) == data[4]
        copies = [bytearray([POISON]) * PAGE for _ in range(5)]
        assert client.get_many(keys, copies) == [False] * 4 + [True]
        assert client.get_many(keys) == [None] * 4 + [data[4]]
        assert client.backend.counters["misses_checksum"] >= 3


@pytest.mark.parametrize("victim", ["master", "store"])
def test_a_process_killed_mid_batch_means_misses_never_wrong_bytes(victim):
    """A get of 32 calls run one at a time; when the first call's pages are in, the master (or
    the store process holding the pages) is killed. The get returns; every page it reports
    is exact, and not all are reported; later calls are misses too; nothing raises."""
    cluster = mooncake_cluster(stores=1, segment="256MiB", timeout_s=2.0)
    try:
        address = cluster.address + f"&workers=1&max_call_bytes={2 * PAGE}"
        with StoreClient(address) as client:
            pool = Pool(client, 128)
            keys, data = random_pages(64)
            for i, d in enumerate(data):
                pool.page(i)[:] = d
            assert client.put_many(keys, [pool.page(i) for i in range(64)]) == [Status.OK] * 64
            kill = cluster.kill_master if victim == "master" else lambda: cluster.kill_store(0)

            def first_in(i: int) -> None:
                if not killed:
                    killed.append(i)
                    kill()

            killed: list[int] = []
            into = [pool.page(64 + i) for i in range(64)]
            pool.mem[64 * PAGE :] = POISON
            hits = client.get_many(keys, into, on_arrival=first_in)
            assert killed and hits[killed[0]]
            assert not all(hits)
            assert all(bytes(into[i]) == data[i] for i in range(64) if hits[i])
            if victim == "master":  # backed off: every call a miss at once
                assert client.exists_many(keys, answer_s=1.0).found == [False] * 64
            assert not any(client.get_many(keys[:4], into[:4]))
            status = client.put_many([os.urandom(16)], [pool.page(0)])
            assert status in ([Status.UNAVAILABLE], [Status.NO_SPACE])
    finally:
        cluster.stop()


def test_a_stopped_master_makes_lookups_bounded_misses(cluster):
    """SIGSTOP: Mooncake's calls hang for its RPC timeout; a lookup answers within its bound,
    every key an unanswered miss."""
    with StoreClient(cluster.address) as client:
        keys, data = random_pages(4)
        assert client.put_many(keys, data) == [Status.OK] * 4
        assert client.exists_many(keys).found == [True] * 4
        cluster.pause_master()
        try:
            result = asyncio.run(_exists_within(client.backend, keys, 0.2, 10.0))
            assert result.found == [False] * 4 and result.unanswered == 4
        finally:
            cluster.resume_master()


async def _exists_within(backend, keys, answer_s, limit_s):
    return await asyncio.wait_for(backend.exists_many(keys, answer_s=answer_s), limit_s)


def test_mooncakes_tcp_timeouts_never_outlive_its_transfer_wait():
    """Mooncake stops waiting for a transfer after 60 s while its TCP session may still write
    into the buffer: the progress and status timeouts are set from ``timeout_s`` but never
    above 25 s, a higher value already in the environment lowered (before: ``timeout_s`` 90
    let a get return while its session still wrote into the pool)."""
    from pagekv.store.mooncake.handle import TCP_STALL_MAX_S, mooncake_timeouts

    tcp = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
    assert mooncake_timeouts(2.0, {}) == {"MC_RPC_TIMEOUT_MS": "2000", **dict.fromkeys(tcp, "2")}
    assert mooncake_timeouts(90.0, {}) == {"MC_RPC_TIMEOUT_MS": "90000",
                                           **dict.fromkeys(tcp, str(TCP_STALL_MAX_S))}  # fmt: skip
    preset = {"MC_RPC_TIMEOUT_MS": "500", tcp[0]: "120", tcp[1]: "3"}
    assert mooncake_timeouts(2.0, preset) == {tcp[0]: "2"}  # lower presets are kept
    assert 2 * TCP_STALL_MAX_S < 60


def test_a_queued_part_cancelled_gives_its_trailer_slots_back(cluster):
    """Gets whose parts wait in the data pool behind a stalled one are cancelled: their parts
    never run, and their trailer slots must come back (before: they leaked, 4096 a call, until
    every get and put of the healthy store was refused)."""
    backend = open_backend(cluster.address + "&workers=1")
    pool = Pool(backend, 4)
    keys, data = random_pages(2)
    pool.page(0)[:] = data[0]
    pool.page(1)[:] = data[1]

    async def main() -> list[bool]:
        assert await backend.put_many(keys, [pool.page(0), pool.page(1)]) == [Status.OK] * 2
        cluster.pause_store(0)
        try:
            stalled = asyncio.ensure_future(backend.get_many(keys[:1], [pool.page(2)]))
            await asyncio.sleep(0)  # (a yield: its part is submitted, its thread stalls)
            for n in (4096, 4096, 4096, 4095):  # all the slots but the stalled get's one
                absent = [os.urandom(16) for _ in range(n)]
                into = [bytearray(16) for _ in absent]
                queued = asyncio.ensure_future(backend.get_many(absent, into))
                await asyncio.sleep(0)  # its part submitted, queued behind the stalled one
                queued.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await queued
        finally:
            cluster.resume_store(0)
        await stalled
        return await backend.get_many(keys, [pool.page(2), pool.page(3)])  # two slots

    try:
        assert asyncio.run(main()) == [True, True]
        assert [bytes(pool.page(2)), bytes(pool.page(3))] == data
    finally:
        backend.close()


def test_close_with_calls_in_flight_gives_misses_never_errors(cluster):
    """``close()`` while one get's first part stalls in Mooncake and another get waits in the
    pool: both return (the stalled part's answer, misses for the rest), neither raises; a call
    after close is a miss (before: RuntimeError from the shut-down pool, and CancelledError
    from a queued part the pool cancelled, the caller's task never cancelled)."""
    backend = open_backend(cluster.address + f"&workers=1&max_call_bytes={PAGE}")
    pool = Pool(backend, 8)
    keys, data = random_pages(4)
    for i, d in enumerate(data):
        pool.page(i)[:] = d

    async def main():
        assert await backend.put_many(keys, [pool.page(i) for i in range(4)]) == [Status.OK] * 4
        pool.mem[4 * PAGE :] = POISON
        cluster.pause_store(0)
        try:
            first = asyncio.ensure_future(
                backend.get_many(keys[:3], [pool.page(4 + i) for i in range(3)])
            )
            await asyncio.sleep(0)  # its first part stalls on the only data thread
            queued = asyncio.ensure_future(backend.get_many(keys[3:], [pool.page(7)]))
            await asyncio.sleep(0)  # its part waits in the pool
            backend.close()
        finally:
            cluster.resume_store(0)
        return await first, await queued, await backend.get_many(keys[:1], [pool.page(4)])

    first, queued, after = asyncio.run(main())
    assert first[1:] == [False, False] and queued == [False] and after == [False]
    assert all(bytes(pool.page(4 + i)) == data[i] for i in range(3) if first[i])


def test_ping_asks_the_master_now(cluster):
    """Mooncake's health_check() reads the last result of its own background ping; ``ping``
    makes a round trip: a stopped master does not answer (before: [True] for seconds)."""
    with StoreClient(cluster.address) as client:
        assert client.ping() == [True]
        cluster.pause_master()
        try:
            assert client.ping(answer_s=0.5) == [False]
        finally:
            cluster.resume_master()


def test_a_put_racing_an_unfinished_put_of_its_key_is_not_ok(cluster):
    """Mooncake answers 0 to a put of a key whose first put is still in flight, and the first
    may then fail: the second put must not report the value stored unless a read finds it
    (before: OK, and nothing was ever stored)."""
    import sys

    backend = open_backend(cluster.address)
    pool = Pool(backend, 4)
    key = os.urandom(16)
    pool.page(0)[:] = os.urandom(PAGE)
    pool.page(1)[:] = os.urandom(PAGE)

    def first_put_in_mooncake() -> bool:
        return any(f.f_code.co_name == "_put_direct" for f in sys._current_frames().values())

    async def main():
        cluster.pause_store(0)
        try:
            first = asyncio.ensure_future(backend.put_many([key], [pool.page(0)]))
            await asyncio.sleep(0)
            await asyncio.to_thread(wait_until, first_put_in_mooncake, 10, "the first put")
            second = await backend.put_many([key], [pool.page(1)])
        finally:
            cluster.resume_store(0)
        await first
        return second, await backend.get_many([key], [pool.page(2)])

    try:
        second, got = asyncio.run(main())
        if second[0] in (Status.OK, Status.EXISTS):
            assert got == [True]
    finally:
        backend.close()


def test_unregistered_puts_larger_than_the_local_buffer(cluster):
    """Mooncake stages a copying put whole in its ``local_buffer`` (16 MiB): a put of 300
    unregistered 64 KiB values (19 MiB) is put in groups that fit, all stored; a single value
    that cannot fit is UNAVAILABLE, never an exception (before: all 300 UNAVAILABLE)."""
    with StoreClient(cluster.address) as client:
        keys, data = random_pages(300)
        assert client.put_many(keys, data) == [Status.OK] * 300
        assert client.get_many(keys[::37]) == data[::37]
        assert client.put_many([os.urandom(16)], [os.urandom(20 << 20)]) == [Status.UNAVAILABLE]
