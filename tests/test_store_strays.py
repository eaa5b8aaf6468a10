"""Stray TCP peers (port scanners, clients of another protocol, old ZeroMQ): random bytes on every
port of a node, and ZMTP 1.0/2.0 peers. The node refuses them, keeps serving, keeps its blocks."""

import os
import random
import socket
import threading
import time
import urllib.request

import pytest
import zmq
import zmq.auth

from pagekv.store import ClientConfig, CurveClientKeys, NodeConfig, Status, StoreClient, StoreNode
from tests.cli_helpers import Node, wait_for

MAIN_PORT_CONNECTIONS = 3000  # f1eb0b9 exited after 100-180 of them
OTHER_PORT_CONNECTIONS = 300  # each stream port, the bulk lane's and the metrics port
OPEN = ("connections", "bulk_open")  # a node's stats: its open connections


def flood(host: str, port: int, count: int, seed: int) -> int:
    """``count`` connections to ``host:port`` in turn, each sending 1-300 random bytes (from
    ``seed``) and hanging up; returns how many connected (fewer: the port closed meanwhile)."""
    rng = random.Random(seed)
    for i in range(count):
        data = rng.randbytes(rng.randint(1, 300))
        try:
            conn = socket.create_connection((host, port), timeout=5)
        except ConnectionRefusedError:
            return i
        with conn:
            try:
                conn.sendall(data)
            except OSError:  # the node refused what it had read: it may reset the rest
                pass
    return count


def status_of(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status


def stray_targets(node: Node, stats: dict) -> list[tuple[int, int]]:
    """(port, connections) for every port of ``node``: its ZeroMQ ports (main, then the stream
    ports), its bulk lane's and its metrics port."""
    main = int(node.address.rsplit(":", 1)[1])
    metrics = int(node.metrics_url.rsplit(":", 1)[1])
    others = [*stats["stream_ports"], stats["bulk_port"], metrics]
    return [(main, MAIN_PORT_CONNECTIONS)] + [(port, OTHER_PORT_CONNECTIONS) for port in others]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_random_bytes_on_every_port_leave_the_node_serving_and_its_blocks_intact():
    """Thousands of connections that each send 1-300 random bytes and hang up, on the node's
    ZeroMQ ports (main and stream ports), its bulk lane's and its metrics port: none of them
    reaches the node as a request, the process keeps serving (PING, /health) and every block
    PUT before reads back byte for byte. Fails on f1eb0b9 (`pagekv serve: error: Invalid
    argument` after 100-180 connections: libzmq took the bytes for a ZMTP 1.0 peer's messages,
    which carry no ZMQ_SRCFD, and reading it raised EINVAL out of the loop)."""
    node = Node("--capacity", "64MiB", "--io-threads", "2", "--metrics-port", "0",
                "--log-level", "error")  # fmt: skip
    try:
        # one connection, on every host: with one per stream (the default streams follow the
        # cores) some may still be opening as `before` is read, and the counts never match
        cfg = ClientConfig((node.address,), timeout_s=10, streams=1)
        with StoreClient(node.address, config=cfg) as client:
            keys = [os.urandom(16) for _ in range(64)]
            sizes = random.Random(7).choices(range(1, 200_000), k=len(keys))
            values = [os.urandom(size) for size in sizes]
            assert client.put_many(keys, values) == [Status.OK] * len(keys)
            before = client.stats()[0]
            host = node.address.removeprefix("tcp://").rsplit(":", 1)[0]
            start = time.monotonic()
            for seed, (port, count) in enumerate(stray_targets(node, before)):
                sent = flood(host, port, count, seed)
                assert sent == count, f"port {port} closed after {sent} connections:\n{node.log}"
            took = time.monotonic() - start

            def settled():  # the node has closed every stray connection
                stats = client.stats()[0]
                seen.append({n: stats[n] for n in OPEN} if stats else None)
                return stats is not None and all(stats[n] == before[n] for n in OPEN)

            seen: list[dict | None] = []

            def unsettled() -> str:
                was = {n: before[n] for n in OPEN}
                return f"the stray connections to be closed ({was} open before, {seen[-3:]} now)"

            wait_for(settled, 30, unsettled)
            assert node.proc.poll() is None, f"node exited {node.proc.returncode}:\n{node.log}"
            assert client.ping() == [True]
            got = client.get_many(keys)
            assert all(g is not None and bytes(g) == v for g, v in zip(got, values))
            after = client.stats()[0]
            for counter in ("bad_requests", "dropped", "internal_errors"):
                assert after[counter] == before[counter], counter  # none became a request
            assert status_of(node.metrics_url + "/health") == 200
        print(f"\n[strays] {len(before['stream_ports']) + 3} ports flooded in {took:.1f} s")
    finally:
        assert node.stop() == 0, node.log


SIGNATURE = b"\xff" + bytes(8) + b"\x7f"  # a versioned greeting's first 10 bytes
OLD_PEERS = {
    # routing id message (empty), then a two-frame message: ZMTP 1.0 frames are
    # length (flags included), flags (1: more), body
    "zmtp 1.0 unversioned": b"\x01\x00" + b"\x02\x01h" + b"\x02\x00x",
    "zmtp 1.0": SIGNATURE + b"\x00\x05" + b"\x01\x00" + b"\x02\x01h" + b"\x02\x00x",
    # revision 1, socket type DEALER; ZMTP 2.0 frames are flags (1: more), size, body
    "zmtp 2.0": SIGNATURE + b"\x01\x05" + b"\x00\x00" + b"\x01\x01h" + b"\x00\x01x",
}


@pytest.mark.parametrize("wire", OLD_PEERS.values(), ids=OLD_PEERS.keys())
def test_peers_before_zmtp_3_are_refused(node, wire):
    """A ZMTP 1.0 or 2.0 peer has no handshake: what it sends would reach the node as messages
    from anyone. The node closes the connection instead and serves on. Fails on f1eb0b9 (the
    message reached the loop, and reading its ZMQ_SRCFD raised EINVAL: the node stopped)."""
    host, port = node.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(wire)
        try:
            while conn.recv(4096):  # whatever the node sends, until it hangs up
                pass
        except ConnectionResetError:  # hung up on bytes it had not read
            pass
        except TimeoutError:
            pytest.fail("the node kept the connection of a peer before ZMTP 3 open")
    with StoreClient(node.address, timeout_s=5) as client:
        assert client.ping() == [True]
        stats = client.stats()[0]
    assert stats["bad_requests"] == 0 and stats["dropped"] == 0


def test_a_node_without_curve_beside_a_curve_node_in_one_context(tmp_path):
    """A node without CURVE sets a ZAP domain (to refuse pre-ZMTP-3 peers), so libzmq asks the
    context's ZAP handler about its clients when there is one: a CURVE node's, sharing the
    context, must admit them and still serve only its own allowed clients. Fails with the domain
    set and the handler refusing NULL handshakes, as it did on f1eb0b9 (plain PUT: UNAVAILABLE)."""
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    _, client_secret = zmq.auth.create_certificates(allowed, "client")
    curve_config = NodeConfig(port=0, capacity="16MiB", curve_secret_key=server_secret,
                              curve_allow=str(allowed))  # fmt: skip
    plain_config = NodeConfig(port=0, capacity="16MiB")
    # a node binds its stream s to I/O thread s: the shared context needs as many as either asks
    ctx = zmq.Context(io_threads=max(curve_config.io_threads, plain_config.io_threads))
    curve = StoreNode(curve_config, context=ctx)
    plain = StoreNode(plain_config, context=ctx)
    threads = [threading.Thread(target=n.serve_forever, daemon=True) for n in (curve, plain)]
    for t in threads:
        t.start()
    try:
        with StoreClient(plain.address, timeout_s=5) as client:
            assert client.put_many([b"plain"], [b"value"]) == [Status.OK]
            assert bytes(client.get_many([b"plain"])[0]) == b"value"
        keys = CurveClientKeys.from_files(server_public, client_secret)
        with StoreClient(curve.address, curve=keys, timeout_s=5) as client:
            assert client.ping() == [True]
        with StoreClient(curve.address, timeout_s=0.5) as client:
            assert client.put_many([b"x"], [b"y"]) == [Status.UNAVAILABLE]
    finally:
        for n in (curve, plain):
            n.stop()
        for t in threads:
            t.join(timeout=5)
        ctx.term()


def test_a_connection_whose_disconnect_is_reported_before_its_accept_is_not_counted():
    """libzmq hands an accepted connection to an I/O thread before it reports it ACCEPTED (from
    the listener's thread), so a peer that hangs up at once, as each stray above does, can have
    its DISCONNECTED reported first; by the time the node reads the ACCEPTED, the descriptor may
    belong to another socket. Counted in that order, the node's `connections` (and the metrics'
    open connections) stayed one too high for good, and its guard watched a descriptor that was
    no connection of its socket (seen on the GPU host: 3 where 2, 30 s after the flood). The
    events are replayed on a pair in the monitor's wire format, a live socket holding the
    descriptor they name."""
    import struct

    from pagekv.store.node.guard import ConnectionGuard
    from pagekv.store.node.monitor import ConnectionMonitor

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    replay, feed = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    other, peer = socket.socketpair()  # the socket that took the descriptor's number since
    try:
        router.bind("tcp://127.0.0.1:0")
        metrics = ConnectionMonitor(None)
        guard = ConnectionGuard(router, NodeConfig(capacity="1MiB"), {}, metrics.on_event)
        guard.monitor.close(linger=0)
        guard.monitor = replay
        replay.bind(f"inproc://guard-replay-{id(replay)}")
        feed.connect(f"inproc://guard-replay-{id(replay)}")
        fd = other.fileno()

        def report(*kinds: int) -> None:
            for kind in kinds:
                feed.send_multipart([struct.pack("=hi", kind, fd), b"tcp://127.0.0.1:1"])
            assert replay.poll(5000)
            for _ in range(50):  # inproc delivers them in order; all of them read
                guard.on_events()
                if not replay.poll(0):
                    break

        report(zmq.EVENT_DISCONNECTED, zmq.EVENT_ACCEPTED)
        assert fd not in guard.conns and metrics.open_connections == 0
        report(zmq.EVENT_ACCEPTED)  # a connection in the usual order: counted, then not
        assert fd in guard.conns and metrics.open_connections == 1
        report(zmq.EVENT_DISCONNECTED)
        assert fd not in guard.conns and metrics.open_connections == 0
    finally:
        router.disable_monitor()
        for s in (feed, replay, router):
            s.close(linger=0)
        other.close()
        peer.close()


def test_a_descriptor_counted_from_a_message_alone_is_dropped_unless_accepted():
    """The guard counts a message's bytes against its descriptor, tracking it if need be (its
    ACCEPTED may still be on its way). A message read after its connection was reported gone
    names a descriptor that may be another socket's by now (here a live socket pair's): unless
    an ACCEPTED confirms it, the guard's check drops it, so it is neither counted as a
    connection nor watched for bytes it never read."""
    from pagekv.store.node.guard import UNCONFIRMED_S, ConnectionGuard

    router = zmq.Context.instance().socket(zmq.ROUTER)
    stale, confirmed = socket.socketpair(), socket.socketpair()
    try:
        router.bind("tcp://127.0.0.1:0")
        guard = ConnectionGuard(router, NodeConfig(capacity="1MiB", guard_interval_s=0.0), {})
        for s in (stale[0], confirmed[0]):
            guard.seen(s.fileno(), 100)
            assert guard.conns[s.fileno()].seen == 100  # counted for the moment
        guard.on_event(zmq.EVENT_ACCEPTED, confirmed[0].fileno())  # its ACCEPTED came after
        guard.tick(time.monotonic() + UNCONFIRMED_S / 2)
        assert stale[0].fileno() in guard.conns  # not yet: an ACCEPTED may still come
        guard.tick(time.monotonic() + UNCONFIRMED_S + 1)
        assert stale[0].fileno() not in guard.conns
        assert guard.conns[confirmed[0].fileno()].seen == 100
        guard.close()
    finally:
        router.close(linger=0)
        for s in (*stale, *confirmed):
            s.close()
