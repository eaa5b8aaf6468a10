"""A store node in this process (a thread) and real sockets: operations, bad input, fuzz, CURVE."""

import os
import random
import struct
import threading
import time

import msgpack
import pytest
import zmq

from pagekv.connector import HostPagePool, KVGeometry
from pagekv.store import (
    Code,
    CurveClientKeys,
    NodeConfig,
    Status,
    StoreClient,
    StoreNode,
    StoreUnavailable,
)
from pagekv.store.wire.protocol import checksum
from tests.helpers import bits_equal, wait_until


class Running:
    def __init__(self, **cfg):
        self.node = StoreNode(NodeConfig(port=0, **cfg))
        self.thread = threading.Thread(target=self.node.serve_forever, daemon=True)
        self.thread.start()
        self.address = self.node.address

    def stop(self):
        self.node.stop()
        self.thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture
def node():
    running = Running(
        capacity="64MiB", max_block_size="4MiB", max_message_size="16MiB", max_keys=512
    )
    yield running
    running.stop()


def raw_socket(address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def ask(sock, frames, timeout_ms=3000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "node did not answer"
    reply = sock.recv_multipart()
    return msgpack.unpackb(reply[0], raw=False), reply[1:]


def head(**fields):
    keys = fields.get("keys")
    if fields.get("op") == "PUT" and "counts" not in fields and isinstance(keys, list):
        fields["counts"] = [1] * len(keys)  # one frame per key unless said otherwise
    return msgpack.packb({"v": 2, "id": 1, **fields}, use_bin_type=True)


def test_operations_with_pool_pages(node):
    geo = KVGeometry(2, 16, 2, 64, "bf16")
    pool = HostPagePool(geo, 6, pin=False)
    for i in range(3):
        pool.page_view(i)[:] = os.urandom(geo.page_bytes)
    keys = [os.urandom(16) for _ in range(3)]
    with StoreClient(node.address, timeout_s=3) as client:
        assert client.put_many(keys, [pool.page_view(i) for i in range(3)]) == [Status.OK] * 3
        assert client.exists_many([*keys, b"missing-key-0000"]).found == [True] * 3 + [False]
        ok = client.get_many(keys, into=[pool.page_view(i) for i in (3, 4, 5)])
        assert ok == [True] * 3
        assert bits_equal(pool.buffer[3:], pool.buffer[:3])
        views = client.get_many([keys[1], b"nope-nope-nope-0"])
        assert bytes(views[0]) == bytes(pool.page_view(1)) and views[1] is None
        assert client.delete_many(keys[:1]) == [True]
        assert client.exists_many(keys).leading == 0
        stats = client.stats()[0]
        assert stats["blocks"] == 2 and stats["op_put"] == 1 and stats["bytes"] > 0
        assert client.ping() == [True]


def test_client_argument_errors(node):
    with StoreClient(node.address) as client:
        with pytest.raises(ValueError, match="keys"):
            client.put_many([b""], [b"x"])
        with pytest.raises(ValueError, match="buffers"):
            client.put_many([b"k"], [])
        with pytest.raises(ValueError, match="keys"):
            client.get_many(["str-key"])


@pytest.mark.parametrize(
    "frames, code",
    [
        ([b"\xc1garbage"], Code.BAD_HEADER),
        ([head(op="GET", keys="k")], Code.BAD_HEADER),
        ([msgpack.packb({"v": 9, "id": 1, "op": "GET"})], Code.BAD_VERSION),
        ([head(op="SHRED")], Code.BAD_OP),
        ([head(op="PUT", keys=[b"k1", b"k2"], sizes=[1, 1], sums=[0, 0]), b"x"], Code.BAD_FRAMES),
        ([head(op="PUT", keys=[b"k1"], sizes=[5], sums=[0]), b"x"], Code.BAD_FRAMES),
        ([head(op="GET", keys=[b"k1"]), b"unexpected"], Code.BAD_FRAMES),
        ([head(op="EXISTS", keys=[b"k%d" % i for i in range(513)])], Code.TOO_LARGE),
    ],
)
def test_bad_requests_get_error_replies_and_store_nothing(node, frames, code):
    sock = raw_socket(node.address)
    reply, _ = ask(sock, frames)
    assert reply["code"] == code and reply["error"]
    assert node.node.store.used == 0
    assert ask(sock, [head(op="PING")])[0]["code"] == Code.OK


def test_per_key_statuses(node):
    sock = raw_socket(node.address)
    big = os.urandom((4 << 20) + 1)
    ok = os.urandom(1000)
    keys = [b"good", b"k" * 300, b"big", b"badsum"]
    frames = [ok, ok, big, ok]
    sums = [checksum(ok), checksum(ok), checksum(big), checksum(ok) ^ 1]
    h = head(op="PUT", keys=keys, sizes=[len(f) for f in frames], sums=sums)
    reply, _ = ask(sock, [h, *frames])
    assert reply["status"] == [Status.OK, Status.BAD_KEY, Status.TOO_LARGE, Status.BAD_CHECKSUM]
    assert list(node.node.store._blocks) == [b"good"]


def test_message_over_limit_is_dropped_and_node_serves_on(node):
    sock = raw_socket(node.address)
    sock.send_multipart([head(op="PUT", keys=[b"x"], sizes=[17 << 20], sums=[0]), bytes(17 << 20)])
    assert not sock.poll(500)  # ZMQ_MAXMSGSIZE: the peer is disconnected, nothing to answer
    with StoreClient(node.address, timeout_s=3) as client:
        assert client.put_many([b"after"], [b"ok!!"]) == [Status.OK]
        assert bytes(client.get_many([b"after"])[0]) == b"ok!!"


def mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.6 and data:
            del data[rng.randrange(len(data)) :]
        elif choice < 0.8:
            data[rng.randrange(len(data) + 1) : 0] = os.urandom(rng.randint(1, 8))
        else:
            data = bytearray(os.urandom(rng.randint(0, 64)))
    return bytes(data)


def random_request(rng: random.Random, stored: dict) -> list[bytes]:
    keys = [os.urandom(rng.randint(0, 20)) for _ in range(rng.randint(0, 4))]
    kind = rng.random()
    fields = dict(
        op=rng.choice(["PUT", "GET", "EXISTS", "DELETE", "STATS", "PING", "X"]), keys=keys
    )
    payloads = [os.urandom(rng.randint(0, 10)) for _ in range(rng.randint(0, 3))]
    if fields["op"] == "PUT":
        counts = [rng.randint(0, 3) for _ in keys]  # 0: invalid, >1: a multi-frame value
        nframes = sum(counts) + rng.choice([0, 0, 0, -1, 1])  # sometimes a frame off
        fields.update(counts=counts, sizes=[rng.randint(0, 10) for _ in range(sum(counts))],
                      sums=[rng.randint(0, 5) for _ in keys])  # fmt: skip
        payloads = [os.urandom(rng.choice(fields["sizes"] or [3])) for _ in range(max(0, nframes))]
    if kind < 0.1:  # well-formed values of the wrong types
        fields[rng.choice([*list(fields), "id", "v"])] = rng.choice([None, "s", 1.5, [1], {"a": 1}])
    frame = head(**fields)
    if kind > 0.5:
        frame = mutate(frame, rng)
    return [frame, *payloads]


def test_fuzz_keeps_node_alive_and_data_intact(node):
    """20,000 malformed and mutated requests: each answered, stored blocks byte-identical."""
    rng = random.Random(1234)
    client = StoreClient(node.address, timeout_s=3)
    stored = {os.urandom(16): os.urandom(rng.randint(1, 4096)) for _ in range(50)}
    keys = list(stored)
    assert set(client.put_many(keys, list(stored.values()))) == {Status.OK}
    sock = raw_socket(node.address)
    start, n, answered, refused = time.monotonic(), 20_000, 0, 0
    for _ in range(n):
        frames = random_request(rng, stored)
        reply, _ = ask(sock, frames)
        answered += isinstance(reply, dict)
        refused += isinstance(reply, dict) and reply.get("code", 0) != 0
    took = time.monotonic() - start
    print(f"\n[fuzz] {n} requests in {took:.1f} s: {answered} answered, {refused} refused")
    assert answered == n and took < 120
    got = client.get_many(keys)
    # the fuzz may have deleted a random key only by guessing 16 random bytes: never happens
    assert all(g is not None and bytes(g) == stored[k] for k, g in zip(keys, got))
    assert client.stats()[0]["bad_requests"] > n // 4
    client.close()


@pytest.fixture
def certs(tmp_path):
    import zmq.auth

    allowed, other = tmp_path / "allowed", tmp_path / "other"
    for d in (allowed, other):
        d.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(tmp_path, "server")
    _client_pub, client_sec = zmq.auth.create_certificates(allowed, "client")
    _, rogue_sec = zmq.auth.create_certificates(other, "rogue")
    return dict(server_pub=server_pub, server_sec=server_sec, allow=str(allowed),
                client=client_sec, rogue=rogue_sec)  # fmt: skip


def test_curve_allowed_client_served_others_not(certs):
    running = Running(curve_secret_key=certs["server_sec"], curve_allow=certs["allow"])
    try:
        good = CurveClientKeys.from_files(certs["server_pub"], certs["client"])
        with StoreClient(running.address, curve=good, timeout_s=3) as client:
            assert client.put_many([b"secret"], [b"payload"]) == [Status.OK]
            assert bytes(client.get_many([b"secret"])[0]) == b"payload"
        rogue = CurveClientKeys.from_files(certs["server_pub"], certs["rogue"])
        with StoreClient(running.address, curve=rogue, timeout_s=0.5) as client:
            assert client.get_many([b"secret"]) == [None]
            with pytest.raises(StoreUnavailable):
                client.stats()
        with StoreClient(running.address, timeout_s=0.5) as plain:
            assert plain.put_many([b"x"], [b"y"]) == [Status.UNAVAILABLE]
        assert b"x" not in running.node.store
    finally:
        running.stop()


@pytest.mark.timeout(60)
def test_probe_after_a_refused_handshake_says_so_and_never_blocks(certs):
    """A handshake refused before the PING is sent (a CURVE key not allowed; the race is won
    here by waiting for it) leaves the socket no pipe to the node, for good: a blocking send
    there waited until the test run's timeout. The probe reports the refusal instead."""
    from zmq.utils.monitor import recv_monitor_message

    from pagekv.store.client import probe as probe_module

    running = Running(curve_secret_key=certs["server_sec"], curve_allow=certs["allow"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        rogue = CurveClientKeys.from_files(certs["server_pub"], certs["rogue"])
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey, sock.curve_publickey = rogue.server_public, rogue.public
        sock.curve_secretkey = rogue.secret
        monitor = sock.get_monitor_socket()
        sock.connect(running.address)
        events = []
        while zmq.EVENT_HANDSHAKE_FAILED_AUTH not in [e for e, _ in events]:
            assert monitor.poll(10_000), f"no refusal seen: {events}"
            event = recv_monitor_message(monitor)
            events.append((int(event["event"]), int(event["value"])))
        # the refusal ends the session (a protocol error: no reconnect) and with it the
        # socket's one pipe: from then on nothing can be sent on it
        wait_until(lambda: not sock.poll(50, zmq.POLLOUT), 10, "the socket's pipe to go")
        # the probe reads the same events, replayed on a pair in the monitor's wire format
        replay, feed = (
            zmq.Context.instance().socket(zmq.PAIR),
            zmq.Context.instance().socket(zmq.PAIR),
        )
        replay.bind(f"inproc://replay-{id(replay)}")
        feed.connect(f"inproc://replay-{id(replay)}")
        for kind, value in events:
            feed.send_multipart([struct.pack("=hi", kind, value), running.address.encode()])
        result = probe_module._watch(running.address, sock, replay, True, 2.0)
        assert result.outcome is probe_module.Outcome.AUTH_FAILED, result
        sock.disable_monitor()
        for s in (monitor, replay, feed):
            s.close(linger=0)
    finally:
        sock.close(linger=0)
        running.stop()


def test_internal_error_is_answered_and_node_serves_on(node, monkeypatch):
    def broken(*_request):
        raise RuntimeError("simulated bug")

    with StoreClient(node.address, timeout_s=3) as client:
        assert client.put_many([b"kept"], [b"data"]) == [Status.OK]
        monkeypatch.setattr(node.node, "_dispatch", broken)
        sock = raw_socket(node.address)
        reply, _ = ask(sock, [head(op="PING")])
        assert reply["code"] == Code.INTERNAL and "simulated bug" in reply["error"]
        monkeypatch.undo()
        assert bytes(client.get_many([b"kept"])[0]) == b"data"
        assert client.stats()[0]["internal_errors"] == 1


@pytest.mark.parametrize("curve", [False, True])
def test_guard_accounts_for_every_wire_byte(certs, curve):
    """What the guard counts as read matches what TCP delivered, byte for byte (after the
    handshake): otherwise it would drift and one day close a well-behaved client."""
    cfg = dict(curve_secret_key=certs["server_sec"], curve_allow=certs["allow"]) if curve else {}
    running = Running(capacity="64MiB", **cfg)
    keys = CurveClientKeys.from_files(certs["server_pub"], certs["client"]) if curve else None
    try:
        with StoreClient(running.address, timeout_s=3, curve=keys) as client:
            for i in range(200):
                ks = [os.urandom(16) for _ in range(3)]
                sizes = (i % 300, 222 + i % 3, 70_000 + i)  # short and long frames, both sides
                values = [os.urandom(sizes[0]), [os.urandom(sizes[1]), b"x"], os.urandom(sizes[2])]
                assert client.put_many(ks, values) == [Status.OK] * 3
                assert None not in client.get_many(ks) and client.exists_many(ks).leading == 3
            guard = running.node.guard
            unexplained = [guard.unexplained(fd) for fd in guard.conns]
        assert unexplained and all(0 <= u < 1024 for u in unexplained), unexplained
    finally:
        running.stop()


def test_signal_handler_takes_no_lock_and_stops_the_node():
    """A second SIGTERM can run its handler inside the first one's: a handler that takes the
    stop event's lock then waits on itself forever. Here another thread runs the installed
    handler while this thread holds that lock: it must return at once, and the node stop."""
    import signal

    node = StoreNode(NodeConfig(port=0, capacity="16MiB"))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        node.install_signal_handlers()
        handler = signal.getsignal(signal.SIGTERM)
        serving = threading.Thread(target=node.serve_forever, daemon=True)
        serving.start()
        with node._stop._cond:  # what the main thread holds inside Event.set()
            caller = threading.Thread(target=handler, args=(signal.SIGTERM, None), daemon=True)
            caller.start()
            caller.join(timeout=5)
            assert not caller.is_alive(), "the signal handler blocked on the stop event's lock"
        serving.join(timeout=10)
        assert not serving.is_alive()
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
        node.stop()
