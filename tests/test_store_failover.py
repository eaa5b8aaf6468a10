"""Any failure of one replica moves the keys on to the next; nothing but per-key misses comes out.

A real node holds every key; in front of it (as each key's first replica) sits a proxy that
breaks its replies in one way per test, or a node that never answers. The client must return
the real data from the healthy replica and raise nothing.
"""

import asyncio
import errno
import os
import random
import time

import msgpack
import pytest
import zmq

from pagekv.store import AsyncStoreClient, ClientConfig, Status, StoreClient
from pagekv.store.client.routing import Router
from tests.store_fakes import TamperingProxy, black_hole
from tests.test_store_node import Running


@pytest.fixture
def healthy():
    # 2 I/O threads: the node advertises stream ports on any host (as on a 16-core one), which
    # the proxies must hide for their tampering to reach the client
    running = Running(capacity="64MiB", io_threads=2)
    yield running
    running.stop()


def head_of(reply: list[bytes]) -> dict:
    return msgpack.unpackb(reply[0], raw=False)


def with_head(reply: list[bytes], **changes) -> list[bytes]:
    head = head_of(reply)
    head.update(changes)
    for name in [k for k, v in changes.items() if v is None]:
        del head[name]
    return [msgpack.packb(head, use_bin_type=True), *reply[1:]]


def flip_payload(reply: list[bytes]) -> list[bytes]:
    if len(reply) < 2:
        return reply
    frame = bytearray(reply[1])
    frame[len(frame) // 2] ^= 0x40
    return [reply[0], bytes(frame), *reply[2:]]


BREAKAGES = {
    "error code": lambda r: with_head(r, code=6, error="boom", status=None),
    "unknown code": lambda r: with_head(r, code=42),
    "not msgpack": lambda r: [b"\xc1\xc1 garbage", *r[1:]],
    "wrong version": lambda r: with_head(r, v=99),
    "unknown status": lambda r: with_head(r, status=[99] * len(head_of(r).get("status", [0]))),
    "status not a list": lambda r: with_head(r, status="ok"),
    "short checksums": lambda r: with_head(r, sums=head_of(r).get("sums", [1])[:-1]),
    "missing checksums": lambda r: with_head(r, sums=None),
    "checksum not an int": lambda r: with_head(r, sums=["x"] * len(head_of(r).get("sums", []))),
    "missing counts": lambda r: with_head(r, counts=None),
    "too few statuses": lambda r: with_head(r, status=head_of(r).get("status", [0, 0])[:-1]),
    "frames dropped": lambda r: r[:1],
    "frame added": lambda r: [*r, b"extra"],
    "payload bit flip": flip_payload,
    "no answer": lambda r: None,
}


class Pair:
    """A tampering proxy in front of a real node (first replica of every test key) and the
    real node itself (second replica); both hold every key."""

    def __init__(self, healthy, breakage, timeout_s=0.5):
        self.proxy = TamperingProxy(healthy.address, BREAKAGES[breakage])
        self.endpoints = (self.proxy.address, healthy.address)
        self.config = ClientConfig(self.endpoints, replicas=2, timeout_s=timeout_s, bulk=False)
        router = Router(self.endpoints, 2, (0.1, 1))
        keys = (os.urandom(16) for _ in range(1000))
        self.keys = [k for k in keys if router.ranking(k)[0] == 0][:24]
        self.values = [[os.urandom(3000), os.urandom(5000)] if i % 3 else os.urandom(20_000)
                       for i in range(len(self.keys))]  # fmt: skip
        with StoreClient(healthy.address, timeout_s=3) as client:
            assert client.put_many(self.keys, self.values) == [Status.OK] * len(self.keys)
        self.proxy.tampering = True

    def poisoned(self):
        return [[bytearray(b"\xa5" * len(f)) for f in v] if isinstance(v, list)
                else bytearray(b"\xa5" * len(v)) for v in self.values]  # fmt: skip

    def check(self, into):
        for got, want in zip(into, self.values):
            assert (bytes(got) if not isinstance(want, list) else [bytes(g) for g in got]) == want

    def close(self):
        self.proxy.close()


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_blocking_client_fails_over_per_key(healthy, breakage):
    pair = Pair(healthy, breakage)
    try:
        with StoreClient(pair.endpoints, config=pair.config) as client:
            into = pair.poisoned()
            assert client.get_many(pair.keys, into=into) == [True] * len(pair.keys)
            pair.check(into)
            views = client.get_many(pair.keys[:4])
            assert [bytes(v) if not isinstance(v, list) else [bytes(x) for x in v]
                    for v in views] == pair.values[:4]  # fmt: skip
            assert client.exists_many(pair.keys).leading == len(pair.keys)
            fresh = [os.urandom(16) for _ in range(6)]
            # (both replicas are the one real node here: the copy through the proxy may store a
            # key first, the direct copy then finds it there: EXISTS; who reports the delete
            # varies too)
            assert set(client.put_many(fresh, [b"f" * 100] * 6)) <= {Status.OK, Status.EXISTS}
            assert len(client.delete_many(pair.keys[:2])) == 2
            assert client.exists_many(pair.keys[:2]).found == [False, False]
        assert pair.proxy.requests > 0
    finally:
        pair.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("breakage", ["error code", "unknown status", "short checksums",
                                      "not msgpack", "no answer", "frames dropped"])  # fmt: skip
async def test_async_client_fails_over_per_key(healthy, breakage):
    pair = Pair(healthy, breakage)
    client = AsyncStoreClient(pair.endpoints, config=pair.config)
    try:
        into = pair.poisoned()
        assert await client.get_many(pair.keys, into=into) == [True] * len(pair.keys)
        pair.check(into)
        assert (await client.exists_many(pair.keys)).leading == len(pair.keys)
        fresh = [os.urandom(16) for _ in range(6)]
        # (both replicas are the one real node, as in the blocking test: the copy through the
        # proxy may store a key before the direct copy, which then finds it there: EXISTS)
        assert set(await client.put_many(fresh, [b"f" * 100] * 6)) <= {Status.OK, Status.EXISTS}
        assert (await client.exists_many(fresh)).found == [True] * 6
    finally:
        client.close()
        pair.close()


def mutate_reply(rng: random.Random, reply: list[bytes]) -> list[bytes] | None:
    """One random corruption of a reply: header bytes, payload bytes, frames, or silence."""
    reply = list(reply)
    kind = rng.random()
    if kind < 0.35:
        head = bytearray(reply[0])
        for _ in range(rng.randint(1, 3)):
            head[rng.randrange(len(head))] = rng.randrange(256)
        reply[0] = bytes(head)
    elif kind < 0.55 and len(reply) > 1:
        i = rng.randrange(1, len(reply))
        frame = bytearray(reply[i])
        frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        reply[i] = bytes(frame)
    elif kind < 0.7:
        reply = reply[: rng.randrange(len(reply))] or [b""]
    elif kind < 0.8:
        reply.insert(rng.randrange(1, len(reply) + 1), os.urandom(rng.randint(0, 64)))
    elif kind < 0.9:
        head = head_of(reply) if reply[0][:1] != b"" else {}
        field = rng.choice(["status", "sums", "counts", "code", "id", "hits"])
        head[field] = rng.choice([None, -1, 2**64 - 1, "x", [1.5], [None], {}, [7] * 3])
        reply[0] = msgpack.packb(head, use_bin_type=True)
    else:
        return None
    return reply


def test_tampered_replies_give_no_wrong_and_no_lost_reads(healthy):
    """Every reply of the first replica corrupted at random: every read still returns the
    right bytes (from the second replica) and no exception escapes."""
    rng = random.Random(99)
    # each unanswered request costs one timeout; the replica that does answer must be read
    # within it, also on a loaded 2-core machine (0.15 s lost reads there)
    pair = Pair(healthy, "no answer", timeout_s=0.5)
    pair.proxy.tamper = lambda reply: mutate_reply(rng, reply)
    wrong = lost = reads = 0
    deadline = time.monotonic() + 60
    try:
        with StoreClient(pair.endpoints, config=pair.config) as client:
            client.router.health[0].backoff_min = client.router.health[0].backoff_max = 0.001
            while pair.proxy.requests < 400 and time.monotonic() < deadline:
                i = rng.randrange(len(pair.keys))
                got = client.get_many([pair.keys[i]])[0]
                reads += 1
                want = pair.values[i]
                if got is None:
                    lost += 1
                elif (
                    bytes(got) if not isinstance(want, list) else [bytes(g) for g in got]
                ) != want:
                    wrong += 1
        print(f"tampered replies: {pair.proxy.requests}, reads {reads}, wrong {wrong}, lost {lost}")
        assert pair.proxy.requests >= 400 and wrong == 0 and lost == 0
    finally:
        pair.close()


@pytest.mark.asyncio
async def test_concurrent_calls_to_a_black_hole_each_take_one_timeout():
    hole = black_hole()
    client = AsyncStoreClient(hole.address, timeout_s=0.5)
    client.router.health[0].backoff_min = 0.001
    try:
        loop = asyncio.get_running_loop()

        async def timed(coro):
            start = loop.time()
            result = await coro
            return result, loop.time() - start

        calls = [timed(client.get_many([os.urandom(16)])) for _ in range(4)]
        calls += [timed(client.put_many([os.urandom(16)], [b"v"])) for _ in range(4)]
        outcomes = await asyncio.gather(*calls)
        durations = [d for _, d in outcomes]
        assert [r for r, _ in outcomes] == [[None]] * 4 + [[Status.UNAVAILABLE]] * 4
        assert max(durations) < 1.0, durations  # one timeout (0.5 s) each, not k of them
    finally:
        client.close()
        hole.close()


def test_dead_single_node_costs_one_timeout_then_nothing():
    hole = black_hole()  # a stopped node: connected, never answers
    try:
        with StoreClient(hole.address, timeout_s=0.5) as client:
            start = time.monotonic()
            assert client.get_many([b"k" * 16]) == [None]
            first = time.monotonic() - start
            hole.close()  # now nothing listens: the fresh connection never comes up
            start = time.monotonic()
            for _ in range(20):
                assert client.get_many([b"k" * 16]) == [None]
                assert client.put_many([b"k" * 16], [b"v"]) == [Status.UNAVAILABLE]
                assert client.exists_many([b"k" * 16]).found == [False]
            later = time.monotonic() - start
        assert 0.4 < first < 1.2 and later < 1.5, (first, later)
    finally:
        hole.close()


def test_unknown_status_from_the_only_node_is_a_miss_not_an_exception(healthy):
    """A reply's bit flip turning a status into an unknown value (issue 9: it escaped as a
    ValueError and killed the connector's write-back worker)."""
    proxy = TamperingProxy(healthy.address, lambda r: with_head(r, status=[77] * len(
        head_of(r).get("status", [0]))))  # fmt: skip
    keys = [os.urandom(16) for _ in range(5)]
    calls = [  # each on a client of its own: after a bad reply the node is backed off and its
        # connection made again, and a call while that is under way is not sent (not counted)
        (lambda c: c.put_many(keys, [b"v" * 10] * 5), [Status.UNAVAILABLE] * 5),
        (lambda c: c.get_many(keys), [None] * 5),
        (lambda c: c.exists_many(keys).found, [False] * 5),
        (lambda c: c.delete_many(keys), [False] * 5),
    ]
    try:
        cfg = ClientConfig((proxy.address,), timeout_s=0.5, bulk=False)  # proxied: ZeroMQ
        for call, miss in calls:
            proxy.tampering = False
            with StoreClient(proxy.address, config=cfg) as client:
                client.ping()
                proxy.tampering = True
                assert call(client) == miss
                assert client.counters["bad_replies"] >= 1
    finally:
        proxy.close()


def test_a_socket_failing_mid_send_is_a_failed_request_never_an_exception(node, monkeypatch):
    """A send that fails past its first frame (the peer gone mid-message: EFAULT from libzmq)
    may leave part of a message in the socket: the request fails, the socket is replaced, and
    the next call goes through on the new one."""
    from pagekv.store.client import zeromq

    real, fails = zeromq._send, [1]

    def breaking(sock, call):
        if fails[0]:
            fails[0] -= 1
            raise zmq.ZMQError(errno.EFAULT)
        return real(sock, call)

    keys = [os.urandom(16) for _ in range(3)]
    cfg = ClientConfig((node.address,), timeout_s=3, bulk=False)  # a ZeroMQ socket's failure
    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, [b"v"] * 3) == [Status.OK] * 3
        monkeypatch.setattr(zeromq, "_send", breaking)
        assert client.get_many(keys) == [None] * 3
        assert client.counters["send_errors"] == 1
        client.router.health[0].down_until = 0.0  # its back-off over: the next call goes to it
        assert [bytes(v) for v in client.get_many(keys)] == [b"v"] * 3
