"""The same-host transport (``pagekv serve --shm``): values copied out of the node's shared
segment are exactly the stored ones or misses, under concurrency, eviction and a killed node;
a segment this client cannot use (refused access, a vanished file, another host) is found at
its PING and the node's GETs go over TCP; the TCP path of a --shm node stays correct."""

import asyncio
import multiprocessing
import os
import random
import stat
import subprocess
import threading
import time

import pytest

from pagekv.store import AsyncStoreClient, ClientConfig, Status, StoreClient
from pagekv.store.client import shm
from pagekv.store.launch import NodeProcess
from pagekv.store.node.segment import FreeSpace
from pagekv.store.wire.protocol import Op
from tests.helpers import wait_until

MIB = 1 << 20


@pytest.fixture
def node():
    proc = NodeProcess("--shm", "--capacity", "32MiB", "--max-block-size", "4MiB",
                       "--max-message-size", "8MiB").start()  # fmt: skip
    yield proc
    proc.stop()


def segment_of(client: StoreClient) -> dict:
    """The segment the node advertises, as the client mapped it at its PING."""
    assert client.ping() == [True] and client.routes()[0].get == "shm", client.routes()
    return client._client._shm._mapped[0].advert


def tcp_only(address: str) -> ClientConfig:
    return ClientConfig((address,), timeout_s=5, shm=False)


def values_for(rng: random.Random, n: int, frames: int, most: int) -> list[list[bytes]]:
    return [[rng.randbytes(rng.randint(1, most)) for _ in range(frames)] for _ in range(n)]


def poisoned(value: list[bytes]) -> list[bytearray]:
    return [bytearray(b"\xa5" * len(f)) for f in value]


def test_free_space_never_overlaps_and_coalesces():
    rng, total = random.Random(7), 1000
    space, owner, live = FreeSpace(total), [None] * total, []
    for step in range(20_000):
        if live and (rng.random() < 0.5 or space.free_granules < 50):
            extent = live.pop(rng.randrange(len(live)))
            for g in range(extent.start, extent.start + extent.count):
                owner[g] = None
            space.free(extent)
            continue
        extent = space.alloc(rng.randint(1, 40))
        if extent is None:
            continue
        assert all(owner[g] is None for g in range(extent.start, extent.start + extent.count))
        for g in range(extent.start, extent.start + extent.count):
            owner[g] = step
        live.append(extent)
        assert space.free_granules == owner.count(None)
    for extent in live:
        space.free(extent)
    assert space.alloc(total) is not None  # every free run merged back into one


@pytest.mark.parametrize("native_copy", ["off", "auto"])
@pytest.mark.parametrize("frames,most", [(1, 3 * MIB), (3, 200_000), (16, 5000)])
def test_shortcut_reads_exact_values(node, frames, most, native_copy, monkeypatch):
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", native_copy)
    rng = random.Random(frames)
    keys = [rng.randbytes(16) for _ in range(12)]
    values = values_for(rng, len(keys), frames, most)
    with StoreClient(node.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [poisoned(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [[bytes(f) for f in v] for v in into] == values
        assert client.counters["shm_hits"] == len(keys)
        missing = rng.randbytes(16)
        assert client.get_many([missing], into=[bytearray(10)]) == [False]
        stats = client.stats()[0]
        assert stats["op_locate"] >= 2 and stats["shm_bytes_used"] >= sum(map(len, values[0]))


@pytest.mark.parametrize("native_copy", ["off", "auto"])
@pytest.mark.parametrize("pipeline", [2, 3])
def test_next_chunk_is_copied_while_the_last_is_published(node, native_copy, monkeypatch, pipeline):
    """Chunks (here one call, one value each): chunk k+1's copy runs while chunk k's values
    are announced; every value exact; and the call never returns while a copy ahead still
    writes into its buffers, also when announcing raises (with 2 or 3 chunks copied at once)."""
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", native_copy)
    monkeypatch.setattr(shm, "CHUNK_BYTES", 1)
    monkeypatch.setattr(shm, "PARALLEL_BYTES", 0)  # pipelined however small
    monkeypatch.setattr(shm, "PIPELINE", pipeline)
    rng = random.Random(11)
    keys = [rng.randbytes(16) for _ in range(6)]
    values = values_for(rng, len(keys), 2, 50_000)
    copy = shm.ShmTransport._copy
    announced, overlapped, copying = threading.Event(), [], []

    def watched(self, jobs):
        copying.append([job.call.idxs[job.k] for job in jobs])
        if len(copying) > 1:  # a copy ahead
            overlapped.append(announced.wait(timeout=10))  # the last chunk is being announced
            announced.clear()
        return copy(self, jobs)

    monkeypatch.setattr(shm.ShmTransport, "_copy", watched)
    cfg = ClientConfig((node.address,), timeout_s=30, max_message_bytes=120_000)  # a call each
    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [poisoned(v) for v in values]
        arrived = []

        def on_arrival(i):
            arrived.append(i)
            announced.set()

        assert client.get_many(keys, into=into, on_arrival=on_arrival) == [True] * len(keys)
        assert [[bytes(f) for f in v] for v in into] == values
        assert arrived == sorted(i for chunk in copying for i in chunk) == list(range(len(keys)))
        assert len(copying) >= 3 and overlapped == [True] * (len(copying) - 1)

        gate, looked, landed = threading.Event(), threading.Event(), threading.Event()
        ahead = threading.Event()
        started = []

        def held_back(self, jobs):
            """The first copy waits until a copy ahead has started (copies start as LOCATEs
            are answered: without this the first chunk could be announced before the second's
            LOCATE is back, and there would be no copy ahead to check). That copy ahead starts
            writing once announcing has failed, and is held until the test has looked (at most
            1 s: a client that waits for it, as it must, cannot let the test look first, so
            the copy goes on when that bound runs out)."""
            started.append(1)
            if len(started) > 1:
                ahead.set()
                assert gate.wait(timeout=10)
                looked.wait(timeout=1)
                result = copy(self, jobs)
                landed.set()
                return result
            assert ahead.wait(timeout=10)
            return copy(self, jobs)

        def refuse(i):
            gate.set()
            raise RuntimeError("announcing failed")

        monkeypatch.setattr(shm.ShmTransport, "_copy", held_back)
        into = [poisoned(v) for v in values]
        with pytest.raises(RuntimeError, match="announcing failed"):
            client.get_many(keys, into=into, on_arrival=refuse)
        early = not landed.is_set()
        looked.set()
        assert not early, "returned while a copy ahead was still to write into the buffers"
        assert [bytes(f) for f in into[1]] == values[1]


def test_tcp_path_of_a_shm_node(node):
    """Values sent from the segment over TCP (zero-copy views), with and without ``into``."""
    rng = random.Random(3)
    keys = [rng.randbytes(16) for _ in range(8)]
    values = values_for(rng, len(keys), 3, 300_000)
    with StoreClient(node.address, config=tcp_only(node.address)) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [poisoned(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [[bytes(f) for f in v] for v in into] == values
        got = client.get_many(keys)
        assert [[bytes(f) for f in v] for v in got] == values
        assert "shm_hits" not in client.counters and client.routes()[0].get == "lane"


def test_the_segments_puts_and_gets_are_cut_by_the_copy_chunk_not_the_message_limit(node):
    """A RESERVE, a COMMIT and a LOCATE's reply carry no values: PUTs and GETs through the
    shortcut carry up to a copy chunk's worth at once (``shm.CHUNK_BYTES``), not the node's
    8 MiB message limit. 20 values of 1 MiB: one RESERVE, one COMMIT, one LOCATE (three each
    with the message limit); each value exact; over TCP the same GET is cut by the limit."""
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(20)]
    values = [[rng.randbytes(MIB)] for _ in keys]
    with StoreClient(node.address) as client:
        segment_of(client)
        before = client.stats()[0]
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        after = client.stats()[0]
        assert client.counters["shm_puts"] == len(keys)
        assert after["op_reserve"] - before["op_reserve"] == 1
        assert after["op_commit"] - before["op_commit"] == 1
        locates = after["op_locate"]
        into = [poisoned(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [[bytes(f) for f in v] for v in into] == values
        assert client.counters["shm_hits"] == len(keys)
        assert client.stats()[0]["op_locate"] == locates + 1
    with StoreClient(node.address, config=tcp_only(node.address)) as client:
        gets = client.stats()[0]["op_get"]
        into = [poisoned(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [[bytes(f) for f in v] for v in into] == values
        assert client.stats()[0]["op_get"] - gets >= 3


def test_segment_file_is_private_and_removed_at_exit():
    proc = NodeProcess("--shm", "--capacity", "8MiB").start()
    try:
        with StoreClient(proc.address, timeout_s=5) as client:
            advert = segment_of(client)
        st = os.stat(advert["path"])
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert st.st_size == advert["size"] >= 8 * MIB
        assert advert["path"].startswith("/dev/shm/pagekv-seg-")
    finally:
        proc.stop()
    assert not os.path.exists(advert["path"])


def _read_as_nobody(address: str, keys: list, sizes: list, conn) -> None:  # a forked child
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        with StoreClient(address, timeout_s=5) as client:
            into = [bytearray(n) for n in sizes]
            ok = client.get_many(keys, into=into)
            conn.send((ok, [bytes(b) for b in into], dict(client.counters), client.routes()))
    except BaseException as e:  # report, never hang the parent
        conn.send(repr(e))


def test_another_user_cannot_map_the_segment_and_falls_back_to_tcp(node):
    keys = [os.urandom(16) for _ in range(4)]
    values = [os.urandom(100_000) for _ in keys]
    with StoreClient(node.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        path = segment_of(client)["path"]
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user (nobody); the file is 0600 (checked)")
    denied = subprocess.run(["head", "-c1", path], user=65534, capture_output=True, timeout=10)
    assert denied.returncode != 0 and b"denied" in denied.stderr
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_read_as_nobody, args=(node.address, keys, [len(v) for v in values],
                                                      child))  # fmt: skip
    proc.start()
    try:
        assert parent.poll(30), "the child did not report"
        result = parent.recv()
    finally:
        proc.join(10)
    assert not isinstance(result, str), result
    ok, got, counters, routes = result
    assert ok == [True] * len(keys) and got == values  # over TCP
    assert routes[0].get == "lane" and "no access" in routes[0].why, routes
    assert counters["shm_hits"] == 0


def test_segment_gone_falls_back_to_tcp(node):
    keys = [os.urandom(16) for _ in range(6)]
    values = [os.urandom(70_000) for _ in keys]
    with StoreClient(node.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        os.unlink(segment_of(client)["path"])  # e.g. a tmpfs cleaner
    with StoreClient(node.address, timeout_s=5) as client:
        into = [bytearray(len(v)) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        assert client.routes()[0].get == "lane" and "gone" in client.routes()[0].why
        assert client.counters["shm_hits"] == 0


def test_other_host_falls_back_to_tcp(node):
    keys = [os.urandom(16) for _ in range(3)]
    values = [os.urandom(5000) for _ in keys]
    with StoreClient(node.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        client._client._shm.host = "another-machine:boot"
        assert client.ping() == [True]  # a PING chooses the node's transports again
        into = [bytearray(len(v)) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        assert client.routes()[0].why == "shm: another host"
        assert client.counters["shm_hits"] == 0


@pytest.mark.parametrize("native_copy", ["off", "auto"])
def test_space_reused_during_the_copy_is_caught(node, monkeypatch, native_copy):
    """Between LOCATE and the copy, another client fills the node: every located block is
    evicted and its space rewritten. The copies must all fail the check (misses: the blocks
    are gone), on the pool (numpy) and in one native call alike."""
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", native_copy)
    keys = [os.urandom(16) for _ in range(8)]
    values = [os.urandom(1 * MIB) for _ in keys]
    real, evicted, lock = shm._sources, [], threading.Lock()

    def evict_first(job):  # right before the copies (on the transport's driver thread)
        with lock:
            if not evicted:
                with StoreClient(node.address, timeout_s=5) as other:
                    filler = [os.urandom(16) for _ in range(40)]
                    other.put_many(filler, [os.urandom(1 * MIB) for _ in filler])
                    evicted.append(other.exists_many(keys).found)
        return real(job)

    with StoreClient(node.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        monkeypatch.setattr(shm, "_sources", evict_first)
        into = [bytearray(b"\xa5" * len(v)) for v in values]
        got = client.get_many(keys, into=into)
    assert evicted == [[False] * len(keys)]
    assert got == [False] * len(keys)
    assert client.counters["shm_evicted"] == len(keys)
    assert client.counters["shm_hits"] == 0


def test_readers_racing_an_evicting_writer_get_exact_bytes_or_misses():
    """A tiny node, a writer that keeps evicting, shortcut and TCP readers: every True is
    the exact value; TCP readers never see a checksum mismatch (space is not reused while a
    reply still sends it)."""
    proc = NodeProcess("--shm", "--capacity", "2MiB", "--max-block-size", "256KiB",
                       "--max-message-size", "1MiB").start()  # fmt: skip
    rng, stop = random.Random(11), threading.Event()
    keys = [rng.randbytes(16) for _ in range(64)]
    values = {k: rng.randbytes(rng.choice((4096, 65536, 200_000))) for k in keys}
    stats = {"hits": 0, "wrong": 0, "tcp_mismatch": 0}
    clients: list[StoreClient] = []

    def write() -> None:
        with StoreClient(proc.address, timeout_s=5) as client:
            while not stop.is_set():
                batch = rng.sample(keys, 8)
                client.delete_many(batch)
                client.put_many(batch, [values[k] for k in batch])

    def read(seed: int, tcp: bool) -> None:
        r = random.Random(seed)
        cfg = tcp_only(proc.address) if tcp else ClientConfig((proc.address,), timeout_s=5)
        with StoreClient(proc.address, config=cfg) as client:
            clients.append(client)
            while not stop.is_set():
                batch = r.sample(keys, 6)
                into = [bytearray(b"\x5a" * len(values[k])) for k in batch]
                for k, ok, buf in zip(batch, client.get_many(batch, into=into), into):
                    stats["hits"] += ok
                    stats["wrong"] += ok and bytes(buf) != values[k]
            stats["tcp_mismatch"] += client.counters["checksum_mismatch"]

    def caught() -> int:  # copies whose block was evicted and its space reused meanwhile
        return sum(c.counters.get("shm_evicted", 0) for c in list(clients))

    threads = [threading.Thread(target=write)]
    threads += [threading.Thread(target=read, args=(s, s == 0)) for s in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 40  # the race is rare on a loaded machine
        while time.monotonic() < deadline and (stats["hits"] < 2000 or not caught()):
            time.sleep(0.05)  # the load runs until it has done enough, bounded; no sync
    finally:
        stop.set()
        for t in threads:
            t.join(20)
        proc.stop()
    stats["caught"] = caught()
    assert stats["hits"] > 0 and stats["wrong"] == 0 and stats["tcp_mismatch"] == 0, stats
    assert stats["caught"] > 0, f"the race never happened: {stats}"


def test_node_killed_while_mapped_is_a_miss_and_its_segment_is_cleaned_up():
    proc = NodeProcess("--shm", "--capacity", "8MiB").start()
    keys = [os.urandom(16) for _ in range(4)]
    values = [os.urandom(50_000) for _ in keys]
    with StoreClient(proc.address, timeout_s=1) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        path = segment_of(client)["path"]
        proc.kill()  # SIGKILL: the segment stays mapped here, and on disk
        into = [bytearray(b"\xa5" * len(v)) for v in values]
        assert client.get_many(keys, into=into) == [False] * len(keys)
        assert all(bytes(b) == b"\xa5" * len(b) for b in into)
        assert client.counters["shm_hits"] == 0
    # any --shm node that starts removes dead nodes' segments: in a parallel test run (pytest
    # -n) another test's node may have removed it already; in a serial run it is still there
    existed = os.path.exists(path)
    fresh = NodeProcess("--shm", "--capacity", "8MiB").start()
    try:
        assert not os.path.exists(path)
    finally:
        fresh.stop()
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        assert existed, "a SIGKILLed node's segment must stay until a node removes it"


def test_concurrent_clients_blocking_and_async(node):
    import asyncio

    rng = random.Random(5)
    keys = [rng.randbytes(16) for _ in range(24)]
    values = values_for(rng, len(keys), 2, 300_000)
    with StoreClient(node.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
    wrong, hits = [], []

    def read(seed: int) -> None:
        r = random.Random(seed)
        with StoreClient(node.address, timeout_s=5) as client:
            for _ in range(10):
                idx = r.sample(range(len(keys)), 8)
                into = [poisoned(values[i]) for i in idx]
                ok = client.get_many([keys[i] for i in idx], into=into)
                wrong.extend(i for i, b in zip(idx, into) if [bytes(f) for f in b] != values[i])
                assert ok == [True] * 8
            hits.append(client.counters["shm_hits"])

    async def read_async() -> int:
        client = AsyncStoreClient(node.address, timeout_s=5)
        try:
            into = [poisoned(v) for v in values]
            assert await client.get_many(keys, into=into) == [True] * len(keys)
            wrong.extend(i for i, b in enumerate(into) if [bytes(f) for f in b] != values[i])
            return client.counters["shm_hits"]
        finally:
            client.close()

    threads = [threading.Thread(target=read, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    async_hits = asyncio.run(read_async())
    for t in threads:
        t.join(30)
    assert wrong == [] and hits == [80] * 4 and async_hits == len(keys)


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_values_of_several_nodes_are_copied_in_key_order(monkeypatch, kind):
    """With the values spread over three --shm nodes, the calls are copied in key order across
    the nodes, not node by node: a caller streaming the leading values onward (the connector's
    prefetch with its load overlapped) gets them as early from three nodes as from one (here a
    call holds one value, so the order is exact; in general it is by each call's first key).
    Copied node by node, the leading run of keys reached past the first node's share only when
    the last node's copies began."""
    monkeypatch.setattr(shm, "CHUNK_BYTES", 1)  # one call per chunk
    monkeypatch.setattr(shm, "PARALLEL_BYTES", 0)  # pipelined however small
    nodes = [NodeProcess("--shm", "--capacity", "32MiB").start() for _ in range(3)]
    try:
        eps = [n.address for n in nodes]
        rng = random.Random(5)
        keys = [rng.randbytes(16) for _ in range(30)]
        values = [[rng.randbytes(40_000)] for _ in keys]
        into = [poisoned(v) for v in values]
        arrived: list[int] = []
        with StoreClient(eps, timeout_s=30) as client:
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
            assert min(s["blocks"] for s in client.stats()) > 0  # every node holds some
        cfg = ClientConfig(tuple(eps), timeout_s=30, max_message_bytes=50_000)  # a value a call
        if kind == "blocking":
            with StoreClient(eps, config=cfg) as client:
                got = client.get_many(keys, into=into, on_arrival=arrived.append)
                hits = client.counters["shm_hits"]
        else:
            client = AsyncStoreClient(eps, config=cfg)
            try:
                got = asyncio.run(client.get_many(keys, into=into, on_arrival=arrived.append))
                hits = client.counters["shm_hits"]
            finally:
                client.close()
        assert got == [True] * len(keys) and hits == len(keys)
        assert [[bytes(f) for f in v] for v in into] == values
        assert arrived == sorted(arrived) == list(range(len(keys)))
    finally:
        for n in nodes:
            n.stop()


def test_copies_start_before_the_last_locate_is_answered(monkeypatch):
    """The first calls' values are copied and handed on while later LOCATEs are still out: here
    the last LOCATE is only sent once the first value has arrived (a GET that waited for every
    LOCATE before copying would wait here for ever: bounded at 20 s)."""
    from pagekv.store.client.zeromq import ZmqTransport

    monkeypatch.setattr(shm, "CHUNK_BYTES", 1)  # one call per chunk
    first = asyncio.Event()
    real = ZmqTransport.run

    async def run(self, calls):
        if len(calls) < 2 or any(c.request.op is not Op.LOCATE for c in calls):
            return await real(self, calls)
        head = await real(self, calls[:-1])
        await asyncio.wait_for(first.wait(), 20)
        return {**head, **await real(self, calls[-1:])}

    monkeypatch.setattr(ZmqTransport, "run", run)
    node = NodeProcess("--shm", "--capacity", "32MiB").start()
    try:
        rng = random.Random(9)
        keys = [rng.randbytes(16) for _ in range(6)]
        values = [[rng.randbytes(40_000)] for _ in keys]
        into = [poisoned(v) for v in values]
        with StoreClient([node.address], timeout_s=30) as client:
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
        cfg = ClientConfig((node.address,), timeout_s=30, max_message_bytes=50_000)  # 1 a call
        client = AsyncStoreClient(cfg.endpoints, config=cfg)
        try:

            def arrived(i):
                first.set()

            got = asyncio.run(client.get_many(keys, into=into, on_arrival=arrived))
            assert got == [True] * len(keys) and client.counters["shm_hits"] == len(keys)
        finally:
            client.close()
        assert [[bytes(f) for f in v] for v in into] == values
    finally:
        node.stop()


# ---- PUTs written straight into the segment (RESERVE, copy, COMMIT) ------------------------


def test_puts_written_into_the_segment_land_exact(node):
    """A same-host client writes its PUTs into the node's segment itself: every value (one
    frame or several) reads back exact over TCP and through the segment; the node saw
    RESERVE/COMMIT and no PUT; a key already stored is EXISTS, a value over the limit
    TOO_LARGE, without touching the segment."""
    rng = random.Random(21)
    keys = [rng.randbytes(16) for _ in range(10)]
    values = values_for(rng, len(keys), 3, 300_000)
    with StoreClient(node.address, timeout_s=5) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        assert client.counters["shm_puts"] == len(keys)
        big = [rng.randbytes(5 * MIB)]  # over --max-block-size 4MiB
        got = client.put_many([keys[0], rng.randbytes(16)], [values[0], big])
        assert got == [Status.EXISTS, Status.TOO_LARGE]
        stats = client.stats()[0]
        assert stats["op_reserve"] >= 2 and stats["op_commit"] >= 1 and stats["op_put"] == 0
        assert stats["shm_reserved"] == 0
        into = [poisoned(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [[bytes(f) for f in v] for v in into] == values
    with StoreClient(node.address, config=tcp_only(node.address)) as tcp:
        got = tcp.get_many(keys)
        assert [[bytes(f) for f in v] for v in got] == values


def _raw(address: str):
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _ask(sock, req):
    from pagekv.store.wire.protocol import decode_reply, encode_request

    sock.send(encode_request(req))
    assert sock.poll(5000), "no reply"
    return decode_reply(sock.recv_multipart()[0])


def test_a_commit_whose_bytes_do_not_match_is_refused_and_its_space_freed(node):
    """The bytes in a reservation must be the COMMIT's checksum (the node verifies them):
    wrong bytes are BAD_CHECKSUM and nothing is stored; a COMMIT without a reservation is
    NO_SPACE; a key reserved twice is EXISTS for the second; a key stored over TCP between
    RESERVE and COMMIT commits as EXISTS. Every reservation's space comes back."""
    import mmap

    import xxhash

    from pagekv.store.wire.protocol import Op, Request

    sock = _raw(node.address)
    try:
        with StoreClient(node.address, config=tcp_only(node.address)) as tcp:
            before = tcp.stats()[0]["shm_bytes_used"]
            value = os.urandom(100_000)
            a, b, c = (os.urandom(16) for _ in range(3))
            rep = _ask(sock, Request(Op.RESERVE, 1, [a, b, c], [len(value)] * 3, [], [1, 1, 1]))
            assert rep.status == [Status.OK] * 3 and len(rep.offs) == 3
            assert _ask(sock, Request(Op.RESERVE, 2, [a], [10], [], [1])).status == [Status.EXISTS]
            advert = rep.shm
            with open(advert["path"], "r+b") as f:
                mm = mmap.mmap(f.fileno(), advert["size"])
                for off in rep.offs:
                    mm[off : off + len(value)] = value
                mm[rep.offs[0]] ^= 0xFF  # a's bytes are not the value any more
                mm.close()
            assert tcp.put_many([c], [value]) == [Status.OK]  # c stored meanwhile over TCP
            cs = xxhash.xxh3_64_intdigest(value)
            rep = _ask(sock, Request(Op.COMMIT, 3, [a, b, c, os.urandom(16)], [], [cs] * 4))
            assert rep.status == [Status.BAD_CHECKSUM, Status.OK, Status.EXISTS,
                                  Status.NO_SPACE]  # fmt: skip
            assert tcp.exists_many([a, b, c]).found == [False, True, True]
            assert bytes(tcp.get_many([b])[0]) == value
            assert tcp.delete_many([b, c]) == [True, True]
            stats = tcp.stats()[0]
            assert stats["shm_reserved"] == 0
            # b's space is freed once the lane thread that sent its GET reply marks the send
            # done, which may come after the client has the bytes: until then it is quarantined
            assert stats["shm_bytes_used"] - before == stats["shm_bytes_quarantined"]
            wait_until(lambda: tcp.stats()[0]["shm_bytes_used"] == before, 10.0,
                       "the deleted blocks' space, their replies sent")  # fmt: skip
    finally:
        sock.close(linger=0)


def test_a_reservation_never_committed_is_freed():
    from pagekv.store.node.block_store import RESERVATION_S, BlockStore
    from pagekv.store.node.segment import Segment

    segment = Segment(8 * MIB)
    try:
        store = BlockStore(8 * MIB, max_block_bytes=MIB, segment=segment)
        status, held = store.reserve(b"k" * 16, (1000, 24), now=100.0)
        assert held is not None and held.sizes == (1000, 24)
        assert status is Status.OK and store.used > 0 and segment.used_bytes() > 0
        assert store.expire(now=100.0 + RESERVATION_S - 1) == 0
        assert store.expire(now=100.0 + RESERVATION_S) == 1
        assert store.used == 0 and segment.used_bytes() == 0
        assert store.commit(b"k" * 16, 0) is Status.NO_SPACE and len(store) == 0
    finally:
        segment.unlink()


def test_a_node_without_a_segment_refuses_reserve_and_commit():
    from pagekv.store.wire.protocol import Code, Op, Request

    proc = NodeProcess("--capacity", "8MiB").start()
    sock = _raw(proc.address)
    try:
        assert _ask(sock, Request(Op.RESERVE, 1, [b"k"], [1], [], [1])).code == Code.BAD_OP
        assert _ask(sock, Request(Op.COMMIT, 2, [b"k"], [], [0])).code == Code.BAD_OP
    finally:
        sock.close(linger=0)
        proc.stop()


def test_a_locate_whose_found_values_were_all_evicted_defers_nothing():
    """A LOCATE deferring keys (a node's disk tier) whose only found value was evicted during
    its copy: the GET reply says NOT_FOUND for all (a reply deferring every key is a failing
    node's), and the evicted one is counted."""
    from types import SimpleNamespace

    from pagekv.store.client.routing import Call
    from pagekv.store.wire.protocol import Op, Reply, Request

    transport = shm.ShmTransport(SimpleNamespace(counters={}), zmq=None, workers=1)
    keys = [os.urandom(16) for _ in range(3)]
    call = Call(0, Request(Op.GET, 7, keys), [], [0, 1, 2])
    located = Reply(8, status=[int(Status.OK), int(Status.DEFERRED), int(Status.NOT_FOUND)])
    job = shm._Job(call, 0, None, 0, [4], 1, 1, [bytearray(4)], why="evicted")
    results: dict = {}
    transport._hand_on([shm._Plan(call, located, [job])], results)
    reply, frames = results[7]
    assert reply.status == [int(Status.NOT_FOUND)] * 3 and frames == [] and not reply.sums
    assert transport.counters["shm_evicted"] == 1


@pytest.mark.asyncio
async def test_a_client_used_again_after_close_reads_through_the_segment_again(node):
    """``close`` ends the client's connections and copy threads, not the client: as over TCP,
    its next calls open what they need (here: map the segment again, new copy threads) and
    read every value exact, never raise."""
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(6)]
    values = [rng.randbytes(2 << 20) for _ in keys]
    client = AsyncStoreClient(node.address, config=ClientConfig((node.address,), timeout_s=5))
    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        for _ in range(3):
            into = [bytearray(b"\xa5" * len(v)) for v in values]
            assert await client.get_many(keys, into=into) == [True] * len(keys)
            assert [bytes(b) for b in into] == values
            assert client.routes()[0].get == "shm"
            client.close()
        assert client.counters["shm_hits"] >= 3 * len(keys)
    finally:
        client.close()
