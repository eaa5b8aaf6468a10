"""The bulk lane (plain TCP for PUT and GET payloads, received straight into place by the native
receive): values exact on fresh random data both ways, several clients at once, a node killed
mid-transfer, a PUT cut off mid-payload, an unreachable lane (a node failure), malformed and
oversized input and anything but a PUT or GET refused, and a call that stops waiting early never
leaving a transfer writing into the caller's buffers. Tests marked with the ``receive`` fixture
check that the native call did the receiving."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import random
import socket
import struct
import threading
import time

import pytest

from pagekv.errors import ProtocolError
from pagekv.store import (
    AsyncStoreClient,
    Code,
    NodeConfig,
    Status,
    StoreClient,
    StoreNode,
)
from pagekv.store import config as store_config
from pagekv.store.client import lane as lane_module
from pagekv.store.client.client import INLINE_PUT_BYTES
from pagekv.store.config import ClientConfig
from pagekv.store.launch import NodeProcess
from pagekv.store.wire import native
from pagekv.store.wire.lane import (
    HEAD_BYTES,
    MAGIC,
    PREFIX,
    SAME_HOST_SOCKET_BUFFER,
    read_head,
    send_message,
    timeval,
)
from pagekv.store.wire.protocol import Reply, decode_request, encode_reply
from tests.helpers import POISON, wait_until

MIB = 1 << 20


def rand_values(rng: random.Random, n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    return [rng.randbytes(16) for _ in range(n)], [rng.randbytes(size) for _ in range(n)]


@pytest.fixture
def receive(monkeypatch):
    """The lane's receive is the native call (``PAGEKV_NATIVE_COPY=on``; skipped without a C
    compiler); checks after the test that it did the receiving in this process (nodes in other
    processes are not counted)."""
    calls = []
    real, real_message = native.NativeCopy.recv_verify, native.NativeCopy.recv_message

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    def counted_message(self, *args, **kwargs):  # a head, and the payload where expected
        if kwargs.get("frames"):
            calls.append(1)
        return real_message(self, *args, **kwargs)

    monkeypatch.setenv("PAGEKV_NATIVE_COPY", "auto")
    if native.load() is None:
        pytest.skip(f"native receive unavailable: {native.unavailable_reason()}")
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", "on")
    monkeypatch.setattr(native.NativeCopy, "recv_verify", counted)
    monkeypatch.setattr(native.NativeCopy, "recv_message", counted_message)
    yield
    assert calls, "the native receive was never called"


@pytest.fixture
def lane_needed():
    """Skips a test of the lane's client side where this process has no native receive (the
    client takes no lane without it)."""
    if native.load() is None:
        pytest.skip(f"no lane without the native receive: {native.unavailable_reason()}")


@pytest.fixture
def served():
    """A node (thread of this process) with its bulk lane on, and a stop function."""
    nodes = []

    def start(**cfg):
        node = StoreNode(NodeConfig(port=0, **{"capacity": "256MiB", **cfg}))
        thread = threading.Thread(target=node.serve_forever, daemon=True)
        thread.start()
        nodes.append((node, thread))
        return node

    yield start
    for node, thread in nodes:
        node.stop()
        thread.join(timeout=5)


@pytest.mark.usefixtures("receive")
def test_values_round_trip_over_the_lane_into_place(served):
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 24, 3 << 18)  # 768 KiB each: several requests
    cfg = ClientConfig((node.address,), streams=2, max_message_bytes=4 << 20)
    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [bytearray([POISON]) * len(v) for v in values]
        arrived = []
        assert client.get_many(keys, into=into, on_arrival=arrived.append) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        assert sorted(arrived) == list(range(len(keys)))
        views = client.get_many([*keys[:3], b"missing-key-0000"])
        assert [bytes(v) for v in views[:3]] == values[:3] and views[3] is None
        counters = client.counters
    assert counters["bulk_requests"] >= 4 and client.routes()[0].get == "lane"
    assert counters["bulk_bytes_in"] >= sum(map(len, values))
    stats = node.stats()
    assert stats["bulk_requests"] >= 4 and stats["bulk_bytes_out"] >= sum(map(len, values))


def lane_socket_ends(node, **config) -> tuple[list[dict], list[dict]]:
    """PUT and GET 8 random 1 MiB values through a 2-stream client (``config``: more
    ClientConfig fields) over ``node``'s lane, checked exact, then every open lane connection's
    client and node ends as read before the client closes: ``{SO_SNDBUF: bytes, SO_RCVBUF:
    bytes, "same_host": both ends at one address}``; at least one end on each side."""
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 8, 1 << 20)
    cfg = ClientConfig((node.address,), streams=2, **config)
    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [bytearray([POISON]) * len(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        assert client.routes()[0].get == "lane"
        socks = [c.sock for c in lane_of(client)._lanes[0].conns if c.sock is not None]
        sides = [[_buffers(sock) for sock in socks],
                 [_buffers(sock) for sock in node.bulk._connections()]]  # fmt: skip
    assert all(sides)
    return sides[0], sides[1]


def _buffers(sock: socket.socket) -> dict:
    out: dict = {opt: sock.getsockopt(socket.SOL_SOCKET, opt)
                 for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF)}  # fmt: skip
    out["same_host"] = sock.getsockname()[0] == sock.getpeername()[0]
    return out


@pytest.mark.usefixtures("receive")
def test_socket_buffer_sizes_the_lane_connections_at_both_ends(served):
    """``socket_buffer`` (``--socket-buffer``) is every connection's SO_SNDBUF/SO_RCVBUF, the
    lane's too, at the node and at the client; values still arrive exact."""
    size = 96 << 10  # the kernel reports twice what was asked (its bookkeeping)
    node = served(socket_buffer=size)
    clients, nodes = lane_socket_ends(node, socket_buffer=size)
    for end in clients + nodes:
        assert end[socket.SO_SNDBUF] == end[socket.SO_RCVBUF] == 2 * size


@pytest.mark.usefixtures("receive")
def test_same_host_lane_connections_take_small_reply_buffers_by_default(served):
    """With no ``socket_buffer`` set, a lane connection whose two ends have one address (here
    loopback) carries GET replies through SAME_HOST_SOCKET_BUFFER (the node's send buffer, the
    client's receive buffer) instead of autotuning's megabytes; values still arrive exact.
    Fails without the rule (the kernel's autotuned sizes)."""
    clients, nodes = lane_socket_ends(served())
    for ends, option in ((clients, socket.SO_RCVBUF), (nodes, socket.SO_SNDBUF)):
        for end in ends:
            assert end["same_host"]
            assert end[option] == 2 * SAME_HOST_SOCKET_BUFFER  # the kernel reports twice


@pytest.mark.usefixtures("receive")
@pytest.mark.parametrize("cores, slots", [(1, 1), (64, native.RECV_SLOTS)])
def test_each_connection_receives_with_a_helper_where_the_cores_allow(
    served, monkeypatch, cores, slots
):
    """Three threads per lane connection must fit the cores for its receives to get a helper
    (a bounce of RECV_SLOTS chunks); else one chunk. Values exact either way, also values the
    helper hands on chunk by chunk (several MiB, chunk starts not aligned to the values)."""
    monkeypatch.setattr(store_config, "_usable_cores", lambda: cores)
    node = served()
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(6)]
    values = [rng.randbytes(rng.randrange(1 << 20, 5 << 20)) for _ in keys]
    values.append(rng.randbytes(1000))  # small frames land in place, in the same reply
    keys.append(rng.randbytes(16))
    cfg = ClientConfig((node.address,), streams=2)
    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [bytearray([POISON]) * len(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        conns = lane_of(client)._lanes[0].conns
        assert [len(c.bounce) for c in conns] == [slots * native.BLOCK_BYTES] * 2


@pytest.mark.usefixtures("receive")
@pytest.mark.asyncio
async def test_async_client_multi_frame_values_over_the_lane(served):
    node = served()
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(8)]
    frames = [[rng.randbytes(1 << 17), rng.randbytes(1 << 16)] for _ in keys]  # K and V parts
    client = AsyncStoreClient(node.address, config=ClientConfig((node.address,), streams=3))
    try:
        assert await client.put_many(keys, frames) == [Status.OK] * len(keys)
        into = [[bytearray([POISON]) * len(f) for f in parts] for parts in frames]
        assert await client.get_many(keys, into=into) == [True] * len(keys)
        assert [[bytes(f) for f in parts] for parts in into] == frames
        wrong = [[bytearray(len(parts[0]) + len(parts[1]))] for parts in frames]  # one frame
        assert await client.get_many(keys, into=wrong) == [False] * len(keys)
        assert client.counters["size_mismatch"] == len(keys)
        assert client.counters["bulk_requests"] >= 2
    finally:
        client.close()


@pytest.mark.usefixtures("receive")
def test_several_clients_at_once_each_value_exact(served):
    node = served()
    rng = random.Random(os.urandom(8))
    shared_keys, shared = rand_values(rng, 8, 1 << 18)
    errors: list[str] = []

    def work(seed: int) -> None:
        r = random.Random(seed)
        keys, values = rand_values(r, 16, r.choice([1 << 16, 1 << 18, 1 << 20]))
        with StoreClient(node.address, config=ClientConfig((node.address,), streams=2)) as c:
            statuses = c.put_many(keys, values)
            c.put_many(shared_keys, shared)  # every client writes the same shared values
            for _ in range(3):
                into = [bytearray([POISON]) * len(v) for v in values + shared]
                got = c.get_many(keys + shared_keys, into=into)
                for ok, buf, value, st in zip(got, into, values + shared,
                                              statuses + [Status.OK] * 8):  # fmt: skip
                    if st == Status.OK and (not ok or bytes(buf) != value):
                        errors.append(f"client {seed}: a value came back wrong or missing")

    threads = [threading.Thread(target=work, args=(rng.getrandbits(32),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert node.stats()["bulk_requests"] >= 4 * 3


def test_without_a_compiler_neither_end_uses_the_lane(served, monkeypatch, tmp_path, caplog):
    """``PAGEKV_NATIVE_COPY=auto``, a fresh cache and no compiler: a client says once why it
    uses no lane and puts and gets every value exactly over ZeroMQ, although its node offers
    one; a node started so offers no lane (its PUT receive needs the library) and says why."""
    if native.load() is None:
        pytest.skip(f"native receive unavailable: {native.unavailable_reason()}")
    node = served()  # with the library: it offers its lane
    monkeypatch.setenv("PAGEKV_NATIVE_COPY", "auto")
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.load() is None
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 12, 3 << 18)
    with caplog.at_level("WARNING"):
        with StoreClient(node.address, config=ClientConfig((node.address,), streams=2)) as c:
            assert c.put_many(keys, values) == [Status.OK] * len(keys)
            for _ in range(2):
                into = [bytearray([POISON]) * len(v) for v in values]
                assert c.get_many(keys, into=into) == [True] * len(keys)
                assert [bytes(b) for b in into] == values
            assert c.counters["bulk_requests"] == 0 and c.counters["bulk_failures"] == 0
    assert node.stats()["bulk_port"] > 0 and node.stats()["bulk_requests"] == 0
    assert "this client uses no bulk lane" in caplog.text and "no-such-cc" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        bare = served()
    assert bare.stats()["bulk_port"] == 0
    assert "no bulk lane" in caplog.text and "no-such-cc" in caplog.text


def lane_of(client):
    """The lane transport of a client (blocking or async): tests point it at fake ports."""
    return getattr(client, "_client", client)._lane


@pytest.mark.usefixtures("receive")
def test_a_lane_that_cannot_be_reached_is_a_node_failure(served):
    """The node advertises a lane that does not connect (as if firewalled): the client PINGs
    it once more (a restarted node's lane moves), finds the same port, and fails the node's
    PUTs and GETs as any node failure (unavailable and misses with one node; nothing goes over
    ZeroMQ instead). Once the lane is reachable and the node's back-off is over, the next PING
    gives the lane back and every value comes back exactly over it."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 6, 1 << 16)
    with StoreClient(node.address) as client:  # stored while the lane is reachable
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
    cfg = ClientConfig((node.address,), streams=2, connect_timeout_s=1.0, backoff_min_s=0.01,
                       backoff_max_s=0.01)  # fmt: skip
    real = node.bulk.port
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        node.bulk.port = s.getsockname()[1]  # what its PING replies advertise
    puts = node.stats()["op_put"]
    with StoreClient(node.address, config=cfg) as client:
        other, more = rand_values(rng, 3, 1 << 16)
        assert client.put_many(other, more) == [Status.UNAVAILABLE] * len(other)
        assert client.counters["node_failures"] == 1 and client.counters["bulk_failures"] >= 2
        assert node.stats()["op_put"] == puts and node.stats()["op_ping"] >= 2  # PINGed again
        into = [bytearray([POISON]) * len(v) for v in values]
        assert client.get_many(keys, into=into) == [False] * len(keys)
        assert all(bytes(b) == bytes([POISON]) * len(b) for b in into)
        assert client.counters["node_failures"] == 2 and client.counters["bulk_failures"] >= 4
        assert node.stats()["op_get"] == 0
        node.bulk.port = real
        deadline = time.monotonic() + 10
        while True:  # the back-off (10 ms) and the replaced links' handshake, bounded
            got = client.get_many(keys, into=into)
            if got == [True] * len(keys) or time.monotonic() > deadline:
                break
        assert got == [True] * len(keys) and [bytes(b) for b in into] == values
        assert client.routes()[0].get == "lane", client.routes()
        assert client.counters["bulk_requests"] >= 1  # (the node counts after its reply)


def test_no_lane_beside_curve_or_when_off(tmp_path):
    import zmq.auth

    zmq.auth.create_certificates(str(tmp_path), "server")
    allow = tmp_path / "allow"
    allow.mkdir()
    zmq.auth.create_certificates(str(allow), "client")
    secure = StoreNode(NodeConfig(port=0, capacity="16MiB",
                                  curve_secret_key=str(tmp_path / "server.key_secret"),
                                  curve_allow=str(allow)))  # fmt: skip
    off = StoreNode(NodeConfig(port=0, capacity="16MiB", bulk=False))
    on = StoreNode(NodeConfig(port=0, capacity="16MiB"))
    try:
        assert secure.bulk is None and off.bulk is None and on.bulk is not None
        assert secure.stats()["bulk_port"] == 0 and on.stats()["bulk_port"] > 0
    finally:
        for n in (secure, off, on):
            n.close()


def _raw(port: int) -> socket.socket:
    """A raw lane connection as the client makes one: blocking, its waits bounded by the
    socket's own timeouts (read_head's native receive needs a blocking socket)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(None)
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        s.setsockopt(socket.SOL_SOCKET, option, timeval(10))
    return s


def _hung_up(sock: socket.socket) -> bool:
    """The peer closed: end of stream, or a reset (it closed with our bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _answer(sock: socket.socket) -> Reply:
    """The node's next reply on a raw lane connection, read within a 1 MiB node's limits."""
    return _lane_reply(sock, max_frames=16, max_bytes=1 << 20)[0]


def test_malformed_and_oversized_messages_get_an_error_and_the_node_serves_on(served):
    node = served(max_message_size="1MiB", max_block_size="1MiB")
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 4, 1 << 16)
    with StoreClient(node.address) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
    port = node.stats()["bulk_port"]
    bad = [
        b"GET / HTTP/1.1\r\n\r\n" + bytes(8),  # not our framing
        PREFIX.pack(MAGIC, 10, 1, 2 << 20) + struct.pack("<Q", 2 << 20),  # over the payload limit
        PREFIX.pack(MAGIC, 2 << 20, 0, 0),  # header over its limit
        PREFIX.pack(MAGIC, 4, 2, 10) + struct.pack("<2Q", 3, 3) + bytes(4),  # sizes: 6, not 10
    ]
    for message in bad:
        with _raw(port) as s:
            s.sendall(message)
            reply = _answer(s)
            assert reply is not None and reply.code != 0 and reply.error
            assert _hung_up(s)
    with _raw(port) as s:  # a well-framed message whose header is not msgpack: answered, kept
        send_message(s, b"\xc1\xc1", [])
        assert _answer(s).code != 0
        send_message(s, b"\x80", [b"x" * 10])  # a map without version
        assert _answer(s).code != 0
    with _raw(port) as s:  # half a message, then gone
        s.sendall(PREFIX.pack(MAGIC, 30, 1, 100)[:10])
    with StoreClient(node.address) as client:  # nothing stored was touched; it still serves
        into = [bytearray(len(v)) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
    assert node.stats()["bulk_bad_messages"] >= len(bad) + 2


def test_connections_over_the_cap_are_closed_and_the_rest_served(served):
    node = served(bulk_connections=2)
    port = node.stats()["bulk_port"]
    held = [_raw(port), _raw(port)]
    try:
        for s in held:  # both are served (the accept thread took them)
            send_message(s, b"\xc1", [])
            assert _answer(s) is not None
        extra = _raw(port)
        assert _hung_up(extra)  # closed at once
        extra.close()
        assert node.stats()["bulk_refused"] >= 1
    finally:
        for s in held:
            s.close()


@pytest.mark.usefixtures("receive")
def test_a_node_killed_mid_transfer_gives_misses_never_wrong_data():
    node = NodeProcess("--capacity", "512MiB").start()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 96, 2 << 20)  # 192 MiB
    try:
        cfg = ClientConfig((node.address,), streams=2, timeout_s=2.0)
        with StoreClient(node.address, config=cfg) as client:
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
            into = [bytearray([POISON]) * len(v) for v in values]
            arrived = threading.Event()

            def kill_on_first(_i: int) -> None:
                if not arrived.is_set():
                    arrived.set()
                    node.proc.kill()  # SIGKILL while the rest is on its way

            got = client.get_many(keys, into=into, on_arrival=kill_on_first)
            assert arrived.is_set()
            for ok, buf, value in zip(got, into, values):
                assert not ok or bytes(buf) == value
            assert not all(got)  # the kill did cut the transfer
            assert client.get_many(keys[:2], into=into[:2]) == [False, False]
    finally:
        node.stop()


def _found_reply_head(conn: socket.socket, checksum: int, nbytes: int) -> bytes:
    """Read one GET from ``conn`` and return the head of its reply as a fake lane sends it:
    its one key found, one frame of ``nbytes`` with ``checksum`` (the frame's bytes follow)."""
    head = read_head(conn, native.load(), bytearray(HEAD_BYTES), max_frames=8,
                     max_frame_bytes=1 << 20, max_payload_bytes=1 << 20)  # fmt: skip
    req = decode_request(head.header)
    rep = encode_reply(Reply(req.id, status=[0], sums=[checksum], counts=[1]))
    return PREFIX.pack(MAGIC, len(rep), 1, nbytes) + struct.pack("<Q", nbytes) + rep


class _FakeLane:
    """A fake node's bulk lane on a loopback port (``port``): a subclass sets what it serves,
    then calls this, which starts its ``_run`` (accepting on ``listener``) on a thread."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        raise NotImplementedError


class _StallingLane(_FakeLane):
    """A fake node's bulk lane: answers a GET with the value's first half, then waits for
    ``release`` before sending the rest (a slow or stuck node, deterministically)."""

    def __init__(self, value: bytes, checksum: int) -> None:
        self.value, self.checksum = value, checksum
        self.half_sent, self.release, self.finished = (threading.Event() for _ in range(3))
        super().__init__()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            n = len(self.value)
            conn.sendall(_found_reply_head(conn, self.checksum, n) + self.value[: n // 2])
            self.half_sent.set()
            self.release.wait(30)
            try:
                conn.sendall(self.value[n // 2 :])
            except OSError:
                pass  # the client hung up: what it must do when it stops waiting
            self.finished.set()


class _ShapeLane(_FakeLane):
    """A fake node's bulk lane that answers one GET with ``values`` (per key: None, not found,
    or its frames), each frame of ``n`` bytes: frames that fit destinations of ``n`` bytes
    each, one per key, so that the client receives them there with the head."""

    def __init__(self, values: list[list[bytes] | None]) -> None:
        self.values = values
        super().__init__()

    def _run(self) -> None:
        import xxhash

        conn, _ = self.listener.accept()
        with conn:
            head = read_head(conn, native.load(), bytearray(HEAD_BYTES), max_frames=8,
                             max_frame_bytes=1 << 20, max_payload_bytes=1 << 20)  # fmt: skip
            req = decode_request(head.header)
            found = [v for v in self.values if v is not None]
            rep = Reply(req.id, status=[int(Status.NOT_FOUND if v is None else Status.OK)
                                        for v in self.values],
                        sums=[xxhash.xxh3_64_intdigest(b"".join(v)) for v in found],
                        counts=[len(v) for v in found])  # fmt: skip
            send_message(conn, encode_reply(rep), [f for v in found for f in v])
            conn.recv(1)  # until the client hangs up


@pytest.mark.usefixtures("receive")
@pytest.mark.asyncio
@pytest.mark.parametrize("shape", ["two frames, then not found", "not found, one, two frames"])
async def test_frames_that_fit_the_destinations_but_not_their_keys_are_sorted_out(served, shape):
    """Frames received with their head land in the call's destinations in order. When the
    reply then places them otherwise (a found value of two frames where its key's destination
    is one, a key not found before a found one), each key is checked with its own value's
    frames wherever they landed: a key found as the destination expects is a hit with its
    bytes, the others misses, never another key's bytes as a value."""
    node = served()
    rng = random.Random(os.urandom(8))
    n = 64 << 10
    frame = [rng.randbytes(n) for _ in range(3)]
    if shape == "two frames, then not found":
        values, expect = [frame[:2], None], [False, False]
    else:
        values, expect = [None, frame[:1], frame[1:]], [False, True, False]
    lane = _ShapeLane(values)
    client = AsyncStoreClient(node.address, config=ClientConfig((node.address,), streams=1))
    try:
        assert await client.ping() == [True]
        lane_of(client)._ports[0] = lane.port  # this node's GETs go to the fake lane
        into = [bytearray([POISON]) * n for _ in values]
        keys = [bytes([97 + k]) * 16 for k in range(len(values))]
        assert await client.get_many(keys, into=into) == expect
        for k, hit in enumerate(expect):
            if hit:
                assert bytes(into[k]) == b"".join(values[k])
        assert client.router.counters["size_mismatch"] == 1
        assert client.router.counters["checksum_mismatch"] == 0
    finally:
        client.close()


@pytest.mark.usefixtures("receive")
@pytest.mark.asyncio
async def test_a_cancelled_get_never_leaves_the_lane_writing_into_the_buffer(served):
    """The call is cancelled while half of a value is in the caller's buffer: when the call
    returns, nothing may write into that buffer any more (the caller reuses it at once). The
    fake node sends the second half only after the call returned; without the client's abort
    and wait, its connection thread would still be in ``recv_into`` and write it there."""
    import xxhash

    node = served()
    rng = random.Random(os.urandom(8))
    value = rng.randbytes(1 << 20)
    lane = _StallingLane(value, xxhash.xxh3_64_intdigest(value))
    client = AsyncStoreClient(node.address, config=ClientConfig((node.address,), streams=1))
    try:
        assert await client.ping() == [True]
        lane_of(client)._ports[0] = lane.port  # this node's GETs go to the fake lane
        into = bytearray([POISON]) * len(value)
        task = asyncio.ensure_future(client.get_many([b"k" * 16], into=[into]))
        while not lane.half_sent.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # let the first half land in the buffer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snapshot = bytes(into)
        lane.release.set()
        await asyncio.get_running_loop().run_in_executor(None, lane.finished.wait, 30)
        assert lane.finished.is_set()
        assert bytes(into) == snapshot  # nothing landed after the call returned
        assert snapshot[len(value) // 2 :] == bytes([POISON]) * (len(value) - len(value) // 2)
    finally:
        lane.release.set()
        client.close()


class _SilentLane(_FakeLane):
    """A fake node's bulk lane that reads requests and never answers (a stuck node): counts
    its connections and the requests it read."""

    def __init__(self) -> None:
        self.connections, self.requests = 0, []
        self.got_one = threading.Event()
        super().__init__()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    head = read_head(conn, native.load(), bytearray(HEAD_BYTES),
                                     max_frames=8, max_frame_bytes=1 << 20,
                                     max_payload_bytes=1 << 20)  # fmt: skip
                    self.requests.append(decode_request(head.header).id)
                    self.got_one.set()
            except (OSError, ProtocolError):
                return  # the client hung up


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["cancel", "close"])
async def test_a_call_ended_while_its_reply_is_awaited_is_not_sent_again(served, end):
    """A GET whose request the node has and whose reply has not started: cancelling the call
    (or closing the client) ends it at once. The shut-down connection must not pass for one
    the node closed while idle, whose request is sent again on a new connection and waited
    for: that kept the loop blocked until the node answered or the timeout (10 s) passed."""
    node = served()
    lane = _SilentLane()
    client = AsyncStoreClient(node.address, config=ClientConfig((node.address,), streams=1))
    try:
        assert await client.ping() == [True]
        lane_of(client)._ports[0] = lane.port  # this node's GETs go to the fake lane
        into = bytearray([POISON]) * 4096
        task = asyncio.ensure_future(client.get_many([b"k" * 16], into=[into]))
        await asyncio.get_running_loop().run_in_executor(None, lane.got_one.wait, 10)
        assert lane.requests, "the request never reached the lane"
        threads = [conn.thread for lane in lane_of(client)._lanes.values() for conn in lane.conns]
        start = time.monotonic()
        if end == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            client.close()
            assert await task == [False]
        took = time.monotonic() - start
        assert took < 2.0, f"ending the call took {took:.2f} s"
        assert (lane.connections, len(lane.requests)) == (1, 1)  # never sent again
        assert into == bytearray([POISON]) * 4096
        if end == "close":  # this client's connection threads (other tests' may linger)
            assert threads and not any(thread.is_alive() for thread in threads)
    finally:
        client.close()
        lane.listener.close()


@pytest.mark.usefixtures("receive")
@pytest.mark.asyncio
async def test_a_reply_read_while_the_loop_forgot_the_nodes_limits_is_read_whole(
    served, monkeypatch
):
    """The loop forgets a node's limits (to PING it again) when another call to it fails; a
    connection's thread reading a reply meanwhile still reads it against the limits the node
    gave, not the 8 MiB assumed for a node never PINGed: a 12 MiB value arrives whole."""
    from pagekv.store.client import lane

    node = served()
    client = AsyncStoreClient(node.address, config=ClientConfig((node.address,), streams=1))
    try:
        value = random.Random(os.urandom(8)).randbytes(12 << 20)
        assert await client.put_many([b"k" * 16], [value]) == [Status.OK]
        reading, forgotten = threading.Event(), threading.Event()
        receive = lane._Conn._receive

        def forgotten_first(conn, call):
            reading.set()
            forgotten.wait(10)
            return receive(conn, call)

        monkeypatch.setattr(lane._Conn, "_receive", forgotten_first)
        into = bytearray([POISON]) * len(value)
        task = asyncio.ensure_future(client.get_many([b"k" * 16], into=[into]))
        await asyncio.get_running_loop().run_in_executor(None, reading.wait, 10)
        client.router.forget(0)  # as after another call's failure on this node
        forgotten.set()
        assert await task == [True]
        assert into == value
    finally:
        client.close()


class _TricklingLane(_FakeLane):
    """A fake node's bulk lane that answers a GET with the value 64 KiB at a time, one piece
    every ``pause_s`` (a node on a failing link: never idle long, never done)."""

    def __init__(self, value: bytes, checksum: int, pause_s: float) -> None:
        self.value, self.checksum, self.pause_s = value, checksum, pause_s
        super().__init__()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            n = len(self.value)
            try:
                conn.sendall(_found_reply_head(conn, self.checksum, n))
                for at in range(0, n, 64 << 10):
                    conn.sendall(self.value[at : at + (64 << 10)])
                    time.sleep(self.pause_s)  # the trickle's pace (the peer is slow)
            except OSError:
                return  # the client gave up and hung up: what it must do


@pytest.mark.usefixtures("receive")
@pytest.mark.asyncio
async def test_a_reply_that_trickles_in_is_given_up_at_its_deadline(served):
    """A reply whose bytes keep coming, too slowly (64 KiB every 0.2 s: 3.2 s for 1 MiB), is
    given up once ``timeout_for`` its bytes has passed, as on the ZeroMQ path: a miss within
    that bound (plus a loaded machine's second), not the whole value 3.2 s later. The
    socket's receive timeout alone bounds only each wait for the next byte."""
    import xxhash

    node = served()
    value = random.Random(os.urandom(8)).randbytes(1 << 20)
    lane = _TricklingLane(value, xxhash.xxh3_64_intdigest(value), pause_s=0.2)
    cfg = ClientConfig((node.address,), streams=1, timeout_s=0.5)
    client = AsyncStoreClient(node.address, config=cfg)
    try:
        assert await client.ping() == [True]
        lane_of(client)._ports[0] = lane.port  # this node's GETs go to the fake lane
        into = bytearray([POISON]) * len(value)
        start = time.monotonic()
        assert await client.get_many([b"k" * 16], into=[into]) == [False]
        took = time.monotonic() - start
        assert took < cfg.timeout_for(len(value)) + 1.0, f"the GET took {took:.2f} s"
    finally:
        client.close()
        lane.listener.close()


@pytest.mark.asyncio
async def test_an_arrival_callback_that_raises_ends_the_get_and_the_client_serves_on(served):
    """The async client hands lane replies on from one callback per call: an ``on_arrival``
    that raises makes ``get_many`` raise that error, nothing is handed on after it, and the
    next call on the same client gets every value exact."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 32, 1 << 18)
    cfg = ClientConfig((node.address,), streams=2, max_message_bytes=1 << 20)
    client = AsyncStoreClient(node.address, config=cfg)
    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        seen: list[int] = []

        def explode(i: int) -> None:
            seen.append(i)
            if len(seen) == 5:
                raise LookupError("the caller's callback failed")

        into = [bytearray([POISON]) * len(v) for v in values]
        with pytest.raises(LookupError, match="callback failed"):
            await client.get_many(keys, into=into, on_arrival=explode)
        into = [bytearray([POISON]) * len(v) for v in values]
        arrived: list[int] = []
        assert await client.get_many(keys, into=into, on_arrival=arrived.append) == [True] * 32
        assert [bytes(b) for b in into] == values and sorted(arrived) == list(range(32))
        assert len(seen) == 5  # the first call's later replies never reached its callback
        assert client.counters["bulk_requests"] > 0
    finally:
        client.close()


def test_an_idle_connection_that_was_aborted_is_replaced_not_sent_on(served):
    """A call that stops early aborts its node's lane connections, some of them idle: the
    next call must open new ones, not fail on the shut-down sockets (and mark the node
    failed)."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 16, 1 << 18)
    cfg = ClientConfig((node.address,), streams=2, max_message_bytes=1 << 20)
    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        assert client.get_many(keys) == values  # both connections made, now idle
        lane_of(client).abort({0})
        into = [bytearray([POISON]) * len(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        assert client.counters["bulk_failures"] == 0 and client.counters["node_failures"] == 0


@pytest.mark.usefixtures("receive")
def test_a_value_corrupted_on_the_lane_is_a_miss():
    """A fake lane sends a value with one bit flipped under the original checksum: the client
    must report a miss (counted), never the corrupted bytes as a hit."""
    import xxhash

    rng = random.Random(os.urandom(8))
    value = rng.randbytes(1 << 18)
    bad = bytearray(value)
    bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
    lane = _StallingLane(bytes(bad), xxhash.xxh3_64_intdigest(value))
    lane.release.set()
    node = StoreNode(NodeConfig(port=0, capacity="16MiB"))
    thread = threading.Thread(target=node.serve_forever, daemon=True)
    thread.start()
    try:
        with StoreClient(node.address, config=ClientConfig((node.address,), streams=1)) as c:
            assert c.ping() == [True]
            lane_of(client=c)._ports[0] = lane.port
            into = bytearray(len(value))
            assert c.get_many([b"k" * 16], into=[into]) == [False]
            assert c.counters["checksum_mismatch"] == 1
    finally:
        node.stop()
        thread.join(timeout=5)


@pytest.mark.usefixtures("receive")
def test_the_lane_stores_puts_checked_and_refuses_what_it_cannot_read(served):
    """Over raw lane connections: a PUT (one-frame and two-frame values, one of them with a
    flipped bit) stores exactly the good values, each read back exactly, the bad one
    ``BAD_CHECKSUM`` and not stored; a PUT whose header declares other frames than the message
    carries, or a GET with payload, is refused and the connection closed (nothing stored);
    any other op gets ``BAD_OP`` and the connection serves the next request."""
    import xxhash

    from pagekv.store.wire.protocol import Op, Request, encode_request

    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 3, 1 << 19)
    halves = [rng.randbytes(3 << 16), rng.randbytes(100)]  # a two-frame value, one frame small
    keys.append(rng.randbytes(16))
    sums = [xxhash.xxh3_64_intdigest(v) for v in values] + [
        xxhash.xxh3_64_intdigest(b"".join(halves))
    ]
    sent = [*values, *halves]
    flipped = bytearray(values[1])
    flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
    sent[1] = bytes(flipped)
    node = served()
    port = node.stats()["bulk_port"]
    req = Request(Op.PUT, 7, keys, [len(f) for f in sent], sums, [1, 1, 1, 2])
    with _raw(port) as s:
        send_message(s, encode_request(req), sent)
        reply = _answer(s)
        assert reply.id == 7 and reply.code == Code.OK
        assert reply.status == [Status.OK, Status.BAD_CHECKSUM, Status.OK, Status.OK]
        for op in (Op.EXISTS, Op.DELETE, Op.PING, Op.STATS):  # the connection serves on
            send_message(s, encode_request(Request(op, 8, keys[:1])), [])
            reply = _answer(s)
            assert reply.id == 8 and reply.code == Code.BAD_OP, op
    assert node.stats()["bulk_puts"] == 1 and node.stats()["blocks"] == 3
    with StoreClient(node.address) as client:
        into = [bytearray([POISON]) * len(v) for v in values] + [
            [bytearray([POISON]) * len(h) for h in halves]]  # fmt: skip
        assert client.get_many(keys, into=into) == [True, False, True, True]
        assert [bytes(into[0]), bytes(into[2])] == [values[0], values[2]]
        assert [bytes(b) for b in into[3]] == halves
    other = rand_values(rng, 2, 1 << 16)
    wrong = [
        # the header declares 2 frames of 64 KiB, the message carries one of 128 KiB
        (Request(Op.PUT, 9, other[0], [1 << 16] * 2, [0, 0], [1, 1]), [b"".join(other[1])]),
        (Request(Op.GET, 10, other[0]), other[1]),  # a GET with payload
    ]
    for bad, frames in wrong:
        with _raw(port) as s:
            send_message(s, encode_request(bad), frames)
            reply = _answer(s)
            assert reply.id == bad.id and reply.code == Code.BAD_FRAMES, reply
            assert _hung_up(s)
    assert node.stats()["blocks"] == 3 and node.stats()["bulk_puts"] == 1


def test_a_clients_puts_and_gets_go_over_the_lane(served):
    """A client's PUTs go over the lane of a node that offers one, are stored exactly (their
    checksums taken as they landed) and read back exactly, over the lane too."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 24, 3 << 18)
    with StoreClient(node.address, config=ClientConfig((node.address,), streams=2)) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        sent = client.counters["bulk_bytes_out"]
        assert sent == sum(map(len, values)) and node.stats()["op_put"] >= 1
        assert node.stats()["bulk_bytes_in"] == sent and node.stats()["bulk_puts"] >= 2
        into = [bytearray([POISON]) * len(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        assert client.put_many(keys[:2], values[:2]) == [Status.EXISTS] * 2


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_a_client_hashing_on_its_loop_cuts_puts_smaller(served, copy_threads):
    """A client without a copy pool hashes each PUT request on its loop before sending it, and
    cuts its PUTs at INLINE_PUT_BYTES (4 MiB: two requests for 8 values of 1 MiB); one with a
    pool at the message limit (one request). Either way every value is stored exactly."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 8, MIB)
    cfg = ClientConfig((node.address,), streams=1, copy_threads=copy_threads)
    with StoreClient(node.address, config=cfg) as client:
        before = node.stats()["op_put"]
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        requests = node.stats()["op_put"] - before
        assert requests == (8 * MIB // INLINE_PUT_BYTES if copy_threads == 1 else 1)
        assert client.counters["bulk_bytes_out"] == 8 * MIB  # over the lane either way
        into = [bytearray([POISON]) * MIB for _ in keys]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values


def test_a_batch_is_dealt_over_every_lane_connection(served):
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 32, 1 << 18)
    cfg = ClientConfig((node.address,), streams=4, max_message_bytes=1 << 20)
    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        into = [bytearray(len(v)) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert [bytes(b) for b in into] == values
        assert node.stats()["bulk_connections"] == 4  # one per stream, all used
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert node.stats()["bulk_connections"] == 4  # and kept


@pytest.mark.usefixtures("receive")
@pytest.mark.asyncio
async def test_a_stalled_connection_leaves_the_node_s_other_calls_to_the_rest(served, monkeypatch):
    """A node's calls wait in one queue that its connections take from as they have room: while
    one connection is held up (a sender on a busy core, a slow socket), the others carry every
    call it has not taken, so a GET ends about when its fastest connections do. Dealt to the
    connections in turn up front, a quarter of the calls waited behind the stalled one."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 32, 64 << 10)
    cfg = ClientConfig((node.address,), streams=4, max_message_bytes=64 << 10)  # a value a call
    client = AsyncStoreClient(node.address, config=cfg)
    stalled: list[threading.Thread] = []  # the first connection thread to receive
    lock, release = threading.Lock(), threading.Event()
    real = lane_module._Conn._receive

    def receive(self, call):
        with lock:
            if not stalled:
                stalled.append(threading.current_thread())
        if stalled[0] is threading.current_thread():
            assert release.wait(30), "the stalled connection was never released"
        return real(self, call)

    try:
        assert await client.put_many(keys, values) == [Status.OK] * len(keys)
        monkeypatch.setattr(lane_module._Conn, "_receive", receive)
        arrived: list[int] = []
        rest_in = threading.Event()  # all but what the stalled connection took (DEPTH at most)

        def on_arrival(i: int) -> None:
            arrived.append(i)
            if len(arrived) >= len(keys) - lane_module.DEPTH:
                rest_in.set()

        into = [bytearray([POISON]) * len(v) for v in values]
        task = asyncio.ensure_future(client.get_many(keys, into=into, on_arrival=on_arrival))
        came = await asyncio.get_running_loop().run_in_executor(None, rest_in.wait, 10)
        release.set()
        assert came, f"{len(arrived)} of {len(keys)} values came while one connection stalled"
        assert await task == [True] * len(keys)
        assert [bytes(b) for b in into] == values
    finally:
        release.set()
        client.close()


@pytest.mark.parametrize("io_threads", [1, 2])
def test_a_node_restarted_on_its_port_is_read_again_at_once(io_threads):
    """The client's lane connections to a node go stale when it restarts (its new lane has
    another port): the next GET must not be a miss: it is sent again on a new connection or
    over ZeroMQ, and the client learns the new lane. With 2 I/O threads the node also offers
    stream ports, which change with the restart: the client's ZeroMQ links that lost their
    connection go back to the main port at once, so the PUT after the restart is stored."""
    args = ("--capacity", "64MiB", "--io-threads", str(io_threads))
    node = NodeProcess(*args).start()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 8, 1 << 18)
    cfg = ClientConfig((node.address,), streams=2, timeout_s=5.0)
    try:
        with StoreClient(node.address, config=cfg) as client:
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
            into = [bytearray(len(v)) for v in values]
            assert client.get_many(keys, into=into) == [True] * len(keys)
            node.stop()
            node = NodeProcess(*args, port=node.port).start()
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
            into = [bytearray([POISON]) * len(v) for v in values]
            assert client.get_many(keys, into=into) == [True] * len(keys)
            assert [bytes(b) for b in into] == values
            assert client.get_many(keys, into=into) == [True] * len(keys)
            assert client.counters["bulk_requests"] >= 2  # the new lane is used again
    finally:
        node.stop()


@pytest.mark.usefixtures("receive")
def test_a_put_cut_off_mid_payload_stores_nothing_and_gives_its_room_back(served):
    """Connections that declare 8 MiB PUTs and close after half the payload: nothing of them is
    stored, and the room the node kept for them while they arrived is given back (else the
    next put would evict the blocks below: 3 x 8 MiB kept is more than the 16 MiB capacity)."""
    import xxhash

    from pagekv.store.wire.protocol import Op, Request, encode_request

    node = served(capacity="16MiB")
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 4, 1 << 20)
    with StoreClient(node.address) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
    port = node.stats()["bulk_port"]
    big = rng.randbytes(8 << 20)
    for n in range(3):
        req = Request(Op.PUT, n + 1, [rng.randbytes(16)], [len(big)],
                      [xxhash.xxh3_64_intdigest(big)], [1])  # fmt: skip
        with _raw(port) as s:
            header = encode_request(req)
            prefix = PREFIX.pack(MAGIC, len(header), 1, len(big)) + struct.pack("<Q", len(big))
            s.sendall(prefix + header + big[: len(big) // 2])
            s.shutdown(socket.SHUT_WR)
            assert _hung_up(s)  # the node ends the connection: nothing to answer
    with StoreClient(node.address) as client:
        more_keys, more = rand_values(rng, 1, 1 << 20)
        assert client.put_many(more_keys, more) == [Status.OK]
        into = [bytearray([POISON]) * len(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)  # none evicted
        assert [bytes(b) for b in into] == values
    stats = node.stats()
    assert stats["blocks"] == 5 and stats["evictions"] == 0 and stats["bulk_puts"] == 2


def _lane_get(sock: socket.socket, rid: int, keys: list[bytes]) -> None:
    from pagekv.store.wire.protocol import Op, Request, encode_request

    send_message(sock, encode_request(Request(Op.GET, rid, keys)), [])


def _lane_reply(
    sock: socket.socket, max_frames: int = 64, max_bytes: int = 64 << 20
) -> tuple[Reply, list[bytes]]:
    """A reply read whole off a raw lane connection, within these limits (a frame's bytes and
    the payload's): the reply and its frames."""
    from pagekv.store.wire.lane import recv_exact
    from pagekv.store.wire.protocol import decode_reply

    head = read_head(
        sock,
        native.load(),
        bytearray(HEAD_BYTES),
        max_frames=max_frames,
        max_frame_bytes=max_bytes,
        max_payload_bytes=max_bytes,
    )
    frames = []
    for size in head.sizes:
        buf = bytearray(size)
        recv_exact(sock, memoryview(buf))
        frames.append(bytes(buf))
    return decode_reply(head.header), frames


@pytest.mark.parametrize("shm", [False, True], ids=["heap", "shm"])
def test_a_reply_read_late_is_the_value_it_answered_with(served, shm):
    """A GET reply's blocks are the lane's until the kernel holds every byte: the client asks
    and reads nothing; meanwhile the value is deleted and new values are put, as many as the
    node holds, onto the memory it freed. The reply, read after, is still the value's bytes,
    exactly, and the connection serves on. (A send that handed the kernel the blocks' pages
    instead of copying them, and released them when the call returned, fails this: tried with
    vmsplice, see docs/benchmarks.md.)"""
    rng = random.Random(os.urandom(8))
    size = 4 << 20
    node = served(shm=shm, capacity=48 << 20)
    key, value = rng.randbytes(16), rng.randbytes(size)
    with StoreClient(node.address) as client:
        assert client.put_many([key], [value]) == [Status.OK]
        with _raw(node.stats()["bulk_port"]) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            _lane_get(s, 1, [key])
            assert s.recv(1, socket.MSG_PEEK)  # the reply started: the node has answered
            assert client.delete_many([key]) == [True]
            for _ in range(3):  # more than the node holds: the freed memory is reused
                keys, values = rand_values(rng, 10, size)
                status = client.put_many(keys, values)
                assert set(status) <= {Status.OK, Status.NO_SPACE}
            # a value the node still holds: a batch's values are stored in any order over the
            # client's connections (as many as the cores allow), and may evict one another
            held = client.get_many(keys)
            later = next((k, v) for k, v, got in zip(keys, values, held)
                         if got is not None and bytes(got) == v)  # fmt: skip
            reply, frames = _lane_reply(s)
            assert reply.id == 1 and reply.status == [Status.OK]
            assert b"".join(frames) == value
            for rid in (2, 3):  # the connection serves on
                _lane_get(s, rid, [later[0]])
                reply, frames = _lane_reply(s)
                assert reply.id == rid and b"".join(frames) == later[1]


def test_a_failing_connection_leaves_the_others_their_closing_sentinels(monkeypatch):
    """A node's connections share one queue and each ends on one closing sentinel (None) of
    it. A connection that fails while it is closing fails the node's waiting calls and must
    leave the sentinels it meets to the other connections: one taken twice left another
    connection's thread waiting on the queue for ever."""
    from types import SimpleNamespace

    monkeypatch.setattr(lane_module._Conn, "_send", lambda self, call, idle=False: True)

    def silent(self, call):
        raise TimeoutError("no answer in time")  # the node's waiting calls are failed too

    monkeypatch.setattr(lane_module._Conn, "_receive", silent)
    lane = lane_module._NodeLane(9)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    for item in [(object(), fut), None, None]:  # a call, then the close of two connections
        lane.work.put(item)
    cfg = ClientConfig(("tcp://127.0.0.1:9",))
    conn = lane_module._Conn(("127.0.0.1", 9), cfg, SimpleNamespace(limits=[None]), 0, None, 1,
                             lane)  # fmt: skip
    conn.thread.join(10)
    assert not conn.thread.is_alive()
    assert fut.result(timeout=0) is None  # failed like a node failure
    assert lane.work.qsize() == 1 and lane.work.get_nowait() is None  # the other's sentinel


@pytest.mark.parametrize("failure", ["stalled", "moved"])
def test_a_resend_stops_at_the_first_send_that_fails(monkeypatch, failure):
    """Calls sent again on a new connection (theirs went stale or was aborted): a send that
    fails there ends that connection, as any failed send does. Those sent before it and after
    it end with it (MOVED each when no connection could be made, so the client PINGs the node
    and runs them on what it says); none is sent behind a message the node got only part of
    (a stalled send), nor tries to connect once more per call."""
    from types import SimpleNamespace

    outcome = {"stalled": lane_module._STALLED, "moved": lane_module.MOVED}[failure]
    outcomes = iter([True, outcome] if failure == "stalled" else [outcome])
    sent = []

    def send(self, call, idle=False):
        sent.append(call.request.id)
        return next(outcomes)  # a third send would raise StopIteration

    monkeypatch.setattr(lane_module._Conn, "_send", send)
    lane = lane_module._NodeLane(9)
    cfg = ClientConfig(("tcp://127.0.0.1:9",))
    conn = lane_module._Conn(("127.0.0.1", 9), cfg, SimpleNamespace(limits=[None]), 0, None, 1,
                             lane)  # fmt: skip
    try:
        calls = [(SimpleNamespace(request=SimpleNamespace(id=i)), concurrent.futures.Future())
                 for i in range(4)]  # fmt: skip
        out: collections.deque = collections.deque()
        conn._resend(calls, out, again=True)  # its thread is idle, waiting for work
        left = lane_module.MOVED if failure == "moved" else None
        assert sent == ([0, 1] if failure == "stalled" else [0])
        assert [fut.result(timeout=0) for _, fut in calls] == [left] * 4
        assert not out and conn.sock is None
    finally:
        lane.work.put(None)
        conn.thread.join(10)


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
async def test_calls_waiting_when_the_client_closes_are_never_sent(served):
    """close() ends the calls out on the lane and those still waiting in a node's queue at
    once: the connection threads took the waiting ones, connected again and sent them after
    close(), which waited its full 5 s for them."""
    node = served()
    fake = _SilentLane()
    cfg = ClientConfig((node.address,), streams=1, timeout_s=6.0, max_message_bytes=64 << 10)
    client = AsyncStoreClient(node.address, config=cfg)
    try:
        assert await client.ping() == [True]
        lane_of(client)._ports[0] = fake.port  # a node that never answers its lane
        into = [bytearray([POISON]) * (64 << 10) for _ in range(4)]  # 4 calls: 2 out, 2 wait
        task = asyncio.ensure_future(client.get_many([bytes([i]) * 16 for i in range(4)],
                                                     into=into))  # fmt: skip
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, wait_until, lambda: len(fake.requests) == 2, 10)
        threads = [c.thread for lane in lane_of(client)._lanes.values() for c in lane.conns]
        start = time.monotonic()
        client.close()
        took = time.monotonic() - start
        assert not any(t.is_alive() for t in threads) and took < 2.0, took
        assert await task == [False] * 4
        assert (fake.connections, len(fake.requests)) == (1, 2)  # nothing sent after close()
        assert into == [bytearray([POISON]) * (64 << 10)] * 4
    finally:
        client.close()
        fake.listener.close()


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
async def test_a_close_while_a_put_hands_out_its_calls_leaves_no_lane_behind(served, monkeypatch):
    """A put_many yields to the loop between its requests; a close() run then by another task
    must end the rest: the next request made a new lane after close(), sent it, and left its
    connection threads running."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 6, 64 << 10)
    cfg = ClientConfig((node.address,), streams=2, max_message_bytes=64 << 10)  # a value a call
    client = AsyncStoreClient(node.address, config=cfg)
    assert await client.ping() == [True]
    first = asyncio.Event()
    real_ready = lane_module.ready

    def ready(call):
        first.set()  # the run yields after handing this call on
        return real_ready(call)

    monkeypatch.setattr(lane_module, "ready", ready)

    async def closer():
        await first.wait()
        client.close()

    try:
        put = asyncio.ensure_future(client.put_many(keys, values))
        await asyncio.gather(put, closer())
        assert not lane_of(client)._lanes, "a lane was made after close()"
        assert node.stats()["bulk_connections"] <= 2
    finally:
        client.close()


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
async def test_cancelling_one_put_leaves_another_operation_s_waiting_calls_alone(
    served, monkeypatch
):
    """Cancelling an operation aborts its node's connections; the send that abort interrupts
    must not fail the calls of other operations waiting in the node's queue (they ended
    UNAVAILABLE and the node was taken for failed): only a node that does not answer in time
    fails its waiting calls."""
    from pagekv.store.node import lane as node_lane

    node = served()
    rng = random.Random(os.urandom(8))
    big_key, big = rng.randbytes(16), rng.randbytes(24 << 20)  # more than the socket buffers
    keys, values = rand_values(rng, 6, 64 << 10)
    cfg = ClientConfig((node.address,), streams=1, max_message_bytes=32 << 20)
    client = AsyncStoreClient(node.address, config=cfg)
    entered, release = threading.Event(), threading.Event()
    real = node_lane.BulkServer._receive

    def receive(self, conn, head, req, bounce, hashed):  # the node slow to read the big PUT
        if req.keys[0] == big_key:
            entered.set()
            release.wait(30)
        return real(self, conn, head, req, bounce, hashed)

    try:
        assert await client.ping() == [True]
        monkeypatch.setattr(node_lane.BulkServer, "_receive", receive)
        a = asyncio.ensure_future(client.put_many([big_key], [big]))
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, entered.wait, 10)
        b = asyncio.ensure_future(client.put_many(keys, values))  # waits behind A's send
        work = lane_of(client)._lanes[0].work
        await loop.run_in_executor(None, wait_until, lambda: work.qsize() >= 1, 10)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        release.set()
        assert await asyncio.wait_for(b, 20) == [Status.OK] * len(keys)
    finally:
        release.set()
        client.close()


def watch_aborts(monkeypatch) -> threading.Event:
    """An event set each time a lane connection's abort() has shut it down."""
    aborted, real_abort = threading.Event(), lane_module._Conn.abort

    def abort(self):
        real_abort(self)
        aborted.set()

    monkeypatch.setattr(lane_module._Conn, "abort", abort)
    return aborted


async def one_stream_client(node, count):
    """A client of ``node`` over one lane connection, one 64 KiB value a request, with
    ``count`` such values stored: (client, keys, values)."""
    keys, values = rand_values(random.Random(os.urandom(8)), count, 64 << 10)
    cfg = ClientConfig((node.address,), streams=1, max_message_bytes=64 << 10)
    client = AsyncStoreClient(node.address, config=cfg)
    assert await client.put_many(keys, values) == [Status.OK] * count
    return client, keys, values


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["cancel", "close"])
async def test_a_call_ended_while_its_connection_is_made_is_not_sent(served, monkeypatch, end):
    """abort() that lands while a connection is being made (no socket to shut down yet) must
    still end the call: it was sent once connected and waited for, and the run's clean-up held
    the event loop until the node answered or the timeout passed."""
    node = served()
    fake = _SilentLane()
    client = AsyncStoreClient(node.address, config=ClientConfig((node.address,), streams=1,
                                                                timeout_s=3.0))  # fmt: skip
    connecting, real_connect = threading.Event(), lane_module._Conn._connect

    def connect(self):
        connecting.set()
        assert aborted.wait(10)  # the handshake still under way when the call is ended
        return real_connect(self)

    try:
        assert await client.ping() == [True]
        lane_of(client)._ports[0] = fake.port
        monkeypatch.setattr(lane_module._Conn, "_connect", connect)
        aborted = watch_aborts(monkeypatch)
        into = bytearray([POISON]) * 4096
        task = asyncio.ensure_future(client.get_many([b"k" * 16], into=[into]))
        assert await asyncio.get_running_loop().run_in_executor(None, connecting.wait, 10)
        start = time.monotonic()
        if end == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            client.close()
            assert await task == [False]
        assert time.monotonic() - start < 2.0 and not fake.requests
        assert into == bytearray([POISON]) * 4096
    finally:
        client.close()
        fake.listener.close()


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
async def test_requests_out_on_an_aborted_socket_end_before_the_next_is_sent(served, monkeypatch):
    """A connection with a request still out when abort() lands must end that request before
    it sends the next on a new socket: the next was sent at once, the reply read for the one
    still out was the next one's, and the mismatch failed the next one and the node."""
    client, keys, values = await one_stream_client(served(), 4)
    a_read, aborted = threading.Event(), watch_aborts(monkeypatch)
    real_receive = lane_module._Conn._receive

    def receive(self, call):
        result = real_receive(self, call)
        if call.request.keys == [keys[0]] and not a_read.is_set():
            a_read.set()  # A's reply read; B's first request is out behind it
            assert aborted.wait(10)
        return result

    monkeypatch.setattr(lane_module._Conn, "_receive", receive)
    try:
        a = asyncio.ensure_future(client.get_many([keys[0]], into=[bytearray(64 << 10)]))
        into = [bytearray([POISON]) * (64 << 10) for _ in range(3)]
        b = asyncio.ensure_future(client.get_many(keys[1:], into=into))
        assert await asyncio.get_running_loop().run_in_executor(None, a_read.wait, 10)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        got = await asyncio.wait_for(b, 20)  # B's first request was out on the aborted socket
        assert got[1:] == [True, True] and [bytes(v) for v in into[1:]] == values[2:]
    finally:
        client.close()


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
async def test_cancelling_one_get_fails_no_other_operation_s_request(served, monkeypatch):
    """Cancelling an operation aborts its node's connections so that nothing writes into its
    buffers once it has returned; another operation's request out on an aborted connection
    (pipelined behind the cancelled one's) is not the node's failure: it goes again on a new
    connection and gets its value, and the node is not taken for failed (it was: a miss, and
    the node backed off)."""
    client, keys, values = await one_stream_client(served(), 4)
    b_queued, a_read, aborted = threading.Event(), threading.Event(), watch_aborts(monkeypatch)
    real_send, real_receive = lane_module._Conn._send, lane_module._Conn._receive

    def send(self, call, idle=False):  # A goes out once B's calls wait: B's first follows it
        if call.request.keys == [keys[0]]:
            assert b_queued.wait(10)
        return real_send(self, call, idle)

    def receive(self, call):
        result = real_receive(self, call)
        if call.request.keys == [keys[0]]:
            a_read.set()  # A's reply read; B's first request is out behind it
            assert aborted.wait(10)
        return result

    def answer(self, req):  # B's first reply leaves the node only once the abort landed
        if getattr(req, "keys", None) == [keys[1]]:
            aborted.wait(10)
        return real_answer(self, req)

    from pagekv.store.node import lane as node_lane

    real_answer = node_lane.BulkServer._answer
    monkeypatch.setattr(node_lane.BulkServer, "_answer", answer)
    monkeypatch.setattr(lane_module._Conn, "_send", send)
    monkeypatch.setattr(lane_module._Conn, "_receive", receive)
    loop = asyncio.get_running_loop()
    try:
        a = asyncio.ensure_future(client.get_many([keys[0]], into=[bytearray(64 << 10)]))
        into = [bytearray([POISON]) * (64 << 10) for _ in range(3)]
        b = asyncio.ensure_future(client.get_many(keys[1:], into=into))
        await loop.run_in_executor(
            None, wait_until, lambda: lane_of(client)._lanes[0].work.qsize() >= 3, 10
        )
        b_queued.set()
        assert await loop.run_in_executor(None, a_read.wait, 10)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        assert await asyncio.wait_for(b, 20) == [True] * 3
        assert [bytes(v) for v in into] == values[1:]
        assert client.counters["node_failures"] == 0 and client.counters["bulk_failures"] == 0
        assert not lane_of(client)._lanes[0].abandoned
    finally:
        b_queued.set()
        aborted.set()
        client.close()


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
async def test_a_get_cancelled_as_its_connection_takes_it_is_never_sent(served, monkeypatch):
    """The connection has taken A's GET (behind B's, out on it) when A is cancelled: A is not
    sent (it was, on a new socket, and its run held the loop until the node answered), and
    B's request, out on the aborted socket, goes again and gets its value."""
    client, keys, values = await one_stream_client(served(), 2)
    a_queued, a_taken, aborted = threading.Event(), threading.Event(), watch_aborts(monkeypatch)
    real_send = lane_module._Conn._send
    sent: list[tuple[bytes, object]] = []

    def send(self, call, idle=False):
        key = call.request.keys[0]
        if key == keys[1] and not sent:
            assert a_queued.wait(10)  # B goes out once A waits: A is taken right after
        if key == keys[0] and not a_taken.is_set():
            a_taken.set()  # A taken up; its run is cancelled now
            assert aborted.wait(10)
        outcome = real_send(self, call, idle)
        sent.append((key, outcome))
        return outcome

    monkeypatch.setattr(lane_module._Conn, "_send", send)
    loop = asyncio.get_running_loop()
    work = lane_of(client)
    try:
        into = [bytearray([POISON]) * (64 << 10)]
        b = asyncio.ensure_future(client.get_many([keys[1]], into=into))
        await loop.run_in_executor(None, wait_until, lambda: 0 in work._lanes, 10)
        await loop.run_in_executor(None, wait_until, lambda: work._lanes[0].work.qsize() == 0, 10)
        a = asyncio.ensure_future(client.get_many([keys[0]], into=[bytearray(64 << 10)]))
        await loop.run_in_executor(None, wait_until, lambda: work._lanes[0].work.qsize() >= 1, 10)
        a_queued.set()
        assert await loop.run_in_executor(None, a_taken.wait, 10)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        assert await asyncio.wait_for(b, 20) == [True] and bytes(into[0]) == values[1]
        assert all(outcome is not True for key, outcome in sent if key == keys[0])
        assert client.counters["node_failures"] == 0 and client.counters["bulk_failures"] == 0
    finally:
        a_queued.set()
        aborted.set()
        client.close()


@pytest.mark.usefixtures("lane_needed")
@pytest.mark.asyncio
async def test_an_abort_during_the_sending_again_sorts_the_calls_again(served, monkeypatch):
    """Another operation's cancel aborts the connection B's two GETs are out on; while they
    are sent again, a second abort lands: both are sent again once more (B's first was sent
    on the socket the second abort shut down, then read B's second reply as its own: both
    failed, the node taken for failed)."""
    from pagekv.store.node import lane as node_lane

    client, keys, values = await one_stream_client(served(), 2)
    release = threading.Event()
    real_send, real_answer = lane_module._Conn._send, node_lane.BulkServer._answer
    sends: list[bytes] = []

    def send(self, call, idle=False):
        sends.append(call.request.keys[0])
        if len(sends) == 4:  # B's second, sent again: a second abort lands now
            self.abort()
        return real_send(self, call, idle)

    def answer(self, req):  # the node holds B's first reply until the first abort landed
        if getattr(req, "keys", None) == [keys[0]]:
            release.wait(10)
        return real_answer(self, req)

    monkeypatch.setattr(lane_module._Conn, "_send", send)
    monkeypatch.setattr(node_lane.BulkServer, "_answer", answer)
    loop = asyncio.get_running_loop()
    try:
        into = [bytearray([POISON]) * (64 << 10) for _ in range(2)]
        b = asyncio.ensure_future(client.get_many(keys, into=into))
        await loop.run_in_executor(None, wait_until, lambda: len(sends) >= 2, 10)
        lane_of(client).abort({0})  # as another operation's cancel: none of B's is abandoned
        release.set()
        assert await asyncio.wait_for(b, 20) == [True, True]
        assert [bytes(v) for v in into] == values and len(sends) >= 4
        assert client.counters["node_failures"] == 0 and client.counters["bulk_failures"] == 0
    finally:
        release.set()
        client.close()


@pytest.mark.usefixtures("lane_needed")
def test_a_kept_connection_found_closed_behind_a_request_out_sends_both_again(served, monkeypatch):
    """A node that restarted closed the client's kept connections: the first request on one
    is found stale by its reply and sent again, but the second, pipelined behind it, found
    it by a failed send and failed (a miss, the node taken for failed). Both go again on a
    new connection, once."""
    node = served()
    rng = random.Random(os.urandom(8))
    keys, values = rand_values(rng, 4, 64 << 10)
    cfg = ClientConfig((node.address,), streams=1, max_message_bytes=64 << 10)  # a value a call
    real_send = lane_module._Conn._send
    broken: list[socket.socket] = []

    def send(self, call, idle=False):
        if not idle and self.sock is not None and not broken:  # a request is out on it
            broken.append(self.sock)
            self.sock.shutdown(socket.SHUT_RDWR)  # as the node's close: the send fails
        return real_send(self, call, idle)

    with StoreClient(node.address, config=cfg) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)
        monkeypatch.setattr(lane_module._Conn, "_send", send)
        into = [bytearray([POISON]) * len(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * len(keys)
        assert broken and [bytes(b) for b in into] == values
        assert client.counters["bulk_failures"] == 0 and client.counters["node_failures"] == 0
