"""AsyncStoreClient: the same operations, timeouts against dead nodes, cancellation."""

import asyncio
import os
import signal
import socket

import pytest
import zmq
import zmq.asyncio

from pagekv.store import AsyncStoreClient, Status, StoreUnavailable


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.asyncio
async def test_async_operations(node):
    client = AsyncStoreClient(node.address, timeout_s=3)
    keys = [os.urandom(16) for _ in range(5)]
    data = [os.urandom(10_000) for _ in keys]
    assert await client.put_many(keys, data) == [Status.OK] * 5
    into = [bytearray(10_000) for _ in keys]
    assert await client.get_many(keys, into=into) == [True] * 5
    assert [bytes(b) for b in into] == data
    assert (await client.exists_many([*keys[:2], b"no-such-key-0000", keys[2]])).leading == 2
    assert await client.delete_many(keys[:1]) == [True]
    assert (await client.stats())[0]["blocks"] == 4
    # concurrent calls on one client share the node socket safely
    results = await asyncio.gather(*(client.get_many([k]) for k in keys[1:]))
    assert [bytes(r[0]) for r in results] == data[1:]
    client.close()


@pytest.mark.asyncio
async def test_dead_node_times_out_as_unavailable():
    client = AsyncStoreClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3)
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await client.put_many([b"k" * 16], [b"v"]) == [Status.UNAVAILABLE]
    assert await client.get_many([b"k" * 16]) == [None]
    assert loop.time() - start < 2.0
    with pytest.raises(StoreUnavailable):
        await client.stats()
    client.close()


@pytest.mark.asyncio
async def test_cancellation_leaves_client_usable(node):
    client = AsyncStoreClient(node.address, timeout_s=3)
    big = os.urandom(8 << 20)
    assert await client.put_many([b"big-block-key-01"], [big]) == [Status.OK]
    for _ in range(5):
        task = asyncio.create_task(client.get_many([b"big-block-key-01"]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # the stale replies of the cancelled requests are never taken as this answer
    small = os.urandom(100)
    assert await client.put_many([b"small-block-key1"], [small]) == [Status.OK]
    got = await client.get_many([b"small-block-key1", b"big-block-key-01"])
    assert bytes(got[0]) == small and bytes(got[1]) == big
    client.close()


@pytest.mark.asyncio
async def test_a_send_refused_for_want_of_a_connection_never_escapes(node, monkeypatch):
    """zmq.Again from a send (the connection went between a writable event and the send: seen
    under load against a node that had just stopped) once escaped as the caller's exception,
    through KVIndex's lookup into an engine's scheduler. The request waits for the connection
    instead (here the node is up: it goes through), or fails at its deadline."""
    from pagekv.store.client import zeromq

    client = AsyncStoreClient(node.address, timeout_s=3)
    keys = [os.urandom(16) for _ in range(3)]
    assert await client.put_many(keys, [b"v"] * 3) == [Status.OK] * 3
    real, fails = zeromq._send, [1]

    def flaky(sock, call):
        if fails[0]:
            fails[0] -= 1
            raise zmq.Again()
        return real(sock, call)

    monkeypatch.setattr(zeromq, "_send", flaky)
    found = await client.exists_many(keys)
    assert fails == [0] and found.found == [True] * 3 and found.unanswered == 0
    assert client.counters["send_errors"] == 0 and client.counters["node_failures"] == 0
    client.close()


@pytest.mark.asyncio
async def test_a_cancelled_put_never_leaves_zeromq_reading_the_callers_buffers():
    """ZeroMQ sends a PUT's values zero-copy: libzmq reads them from the caller's buffers
    while it sends. A ``put_many`` cancelled while its requests wait for a stopped node must
    leave nothing queued that still reads them: the caller overwrites its buffers as soon as
    the call returns, and the node, resumed, must never receive a value that no longer
    matches its checksum (each such value is refused: ``checksum_failures``). Every key reads
    back as its value or as a miss."""
    from pagekv.store import ClientConfig
    from tests.cli_helpers import Node
    from tests.helpers import sigstop
    from tests.test_metrics import scrape

    node = Node("--capacity", "256MiB", "--metrics-port", "0")
    try:
        cfg = ClientConfig((node.address,), streams=1, bulk=False, shm=False, timeout_s=10.0)
        client = AsyncStoreClient(node.address, config=cfg)
        assert await client.ping() == [True]
        keys = [os.urandom(16) for _ in range(12)]
        # 48 MiB (more than the kernel buffers), each value a large frame then a small one
        # (which libzmq copies: a request's last frame is not the one it reads last)
        values = [[os.urandom(4 << 20), os.urandom(7)] for _ in keys]
        buffers = [[bytearray(f) for f in v] for v in values]
        sigstop(node.proc.pid)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.put_many(keys, buffers), 1.0)
        for frames in buffers:  # the caller's again
            for buf in frames:
                buf[:] = bytes(len(buf))
        node.proc.send_signal(signal.SIGCONT)
        # on the same stream: answered once the node has read what was queued before it
        assert await client.put_many([os.urandom(16)], [b"after"]) == [Status.OK]
        _, metrics = scrape(node.metrics_url + "/metrics")
        assert metrics[("pagekv_node_checksum_failures_total", ())] == 0
        got = await client.get_many(keys)
        assert all(g is None or [bytes(f) for f in g] == v for g, v in zip(got, values))
        client.close()
    finally:
        node.proc.send_signal(signal.SIGCONT)
        node.stop()
