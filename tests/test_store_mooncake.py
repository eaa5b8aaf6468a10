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
