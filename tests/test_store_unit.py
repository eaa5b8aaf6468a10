"""Store pieces without sockets: protocol encoding/validation, block store, configs, routing."""

import msgpack
import pytest
import zmq

from pagekv.store import ClientConfig, Code, NodeConfig, Op, ProtocolError, Status, parse_size
from pagekv.store.client.routing import Router
from pagekv.store.node.block_store import BLOCK_OVERHEAD, FRAME_OVERHEAD, BlockStore, block_cost
from pagekv.store.node.guard import source_fd
from pagekv.store.wire.protocol import (
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)


def test_request_round_trip():
    req = Request(Op.PUT, 7, [b"a" * 16, b"b" * 16], [10, 20], [1, 2], [1, 1])
    assert decode_request(encode_request(req)) == req
    multi = Request(Op.PUT, 8, [b"a", b"b"], [3, 4, 5, 6], [1, 2], [3, 1])
    assert decode_request(encode_request(multi)) == multi
    # counts left empty: one frame per key on the wire
    assert decode_request(encode_request(Request(Op.PUT, 9, [b"a"], [3], [1]))).counts == [1]
    for op in (Op.GET, Op.EXISTS, Op.DELETE):
        r = Request(op, 3, [b"k"])
        assert decode_request(encode_request(r)) == r
    assert decode_request(encode_request(Request(Op.PING, 1))).op is Op.PING


def test_reply_round_trip():
    rep = Reply(5, Code.OK, "", [0, 1], [99], 1, {"blocks": 3}, [2])
    assert decode_reply(encode_reply(rep)) == rep


def pack(**head):
    return msgpack.packb(head, use_bin_type=True)


def put_head(**fields):
    return pack(v=2, id=1, op="PUT", **fields)


@pytest.mark.parametrize(
    "frame, code",
    [
        (b"\xc1not msgpack", Code.BAD_HEADER),
        (msgpack.packb([1, 2]), Code.BAD_HEADER),
        (pack(v=1, id=1, op="GET"), Code.BAD_VERSION),
        (pack(id=1, op="GET"), Code.BAD_VERSION),
        (pack(v=2, id=1, op="FROB"), Code.BAD_OP),
        (pack(v=2, id="x", op="GET"), Code.BAD_HEADER),
        (pack(v=2, id=True, op="GET"), Code.BAD_HEADER),
        (pack(v=2, id=-4, op="GET"), Code.BAD_HEADER),
        (pack(v=2, id=1, op="GET", keys="abc"), Code.BAD_HEADER),
        (pack(v=2, id=1, op="GET", keys=["str"]), Code.BAD_HEADER),
        (put_head(keys=[b"k"], counts=[1], sizes=[1, 2], sums=[1]), Code.BAD_HEADER),
        (put_head(keys=[b"k"], counts=[1], sizes=[-1], sums=[1]), Code.BAD_HEADER),
        (put_head(keys=[b"k"], counts=[1], sizes=[1]), Code.BAD_HEADER),
        (put_head(keys=[b"k"], sizes=[1], sums=[1]), Code.BAD_HEADER),  # no counts
        (put_head(keys=[b"k"], counts=[0], sizes=[], sums=[1]), Code.BAD_HEADER),
        (put_head(keys=[b"k"], counts=[2], sizes=[1], sums=[1]), Code.BAD_HEADER),
        (put_head(keys=[b"k", b"j"], counts=[2], sizes=[1, 1], sums=[1, 1]), Code.BAD_HEADER),
        (put_head(keys=[b"k"], counts=[True], sizes=[1], sums=[1]), Code.BAD_HEADER),
        (put_head(keys=[b"k"], counts=[1 << 62], sizes=[1], sums=[1]), Code.BAD_HEADER),
        (b"\x00" * (2 << 20), Code.TOO_LARGE),
    ],
)
def test_bad_requests_name_the_problem(frame, code):
    with pytest.raises(ProtocolError) as info:
        decode_request(frame)
    assert info.value.code is code and str(info.value)


def test_block_store_lru_capacity_and_immutability():
    one = block_cost(b"a", 300, 1)
    store = BlockStore(3 * one + 50, max_block_bytes=400, high_watermark=0.8, low_watermark=0.5)
    assert store.put(b"a", (b"x" * 300,), 300, 1) is Status.OK
    assert store.put(b"b", (b"y" * 100, b"y" * 200), 300, 2) is Status.OK  # one block
    assert store.put(b"a", (b"z" * 300,), 300, 9) is Status.EXISTS  # not rewritten
    assert store.get(b"a").frames == (b"x" * 300,) and store.get(b"a").checksum == 1
    assert store.used == one + block_cost(b"b", 300, 2) and store.payload == 602
    # "a" was touched: "b" is the oldest; the third block evicts down to the low watermark
    assert store.put(b"c", (b"w" * 300,), 300, 3) is Status.OK
    assert b"b" not in store and b"a" in store and b"c" in store
    assert store.evictions == 1 and store.used == 2 * one
    assert store.put(b"d", (b"q" * 500,), 500, 4) is Status.TOO_LARGE
    assert store.put(b"", (b"q",), 1, 4) is Status.BAD_KEY
    assert store.put(b"k" * 300, (b"q",), 1, 4) is Status.BAD_KEY
    assert store.delete(b"a") and not store.delete(b"a")
    assert store.used == one and store.payload == 301
    assert store.get(b"zz") is None and store.misses == 1
    assert store.stats()["blocks"] == 1


def test_block_cost_counts_overheads():
    assert block_cost(b"k" * 16, 512, 1) == 512 + 16 + BLOCK_OVERHEAD + FRAME_OVERHEAD
    assert block_cost(b"k", 10, 3) - block_cost(b"k", 10, 1) == 2 * FRAME_OVERHEAD


def test_block_store_rejects_what_never_fits():
    store = BlockStore(100, max_block_bytes=1000)
    assert store.put(b"k", (b"x" * 200,), 200, 0) is Status.NO_SPACE
    with pytest.raises(ValueError):
        BlockStore(0, max_block_bytes=1)


def test_parse_size():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("1.5k") == 1536
    assert parse_size(123) == 123
    for bad in ("", "GiB", "4 parsecs", "-1"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacity=0), "capacity"),
        (dict(port=70000), "port"),
        (dict(endpoint="udp://x"), "endpoint"),
        (dict(curve_secret_key="x"), "curve"),
        (dict(high_watermark=0.5, low_watermark=0.9), "watermark"),
        (dict(max_keys=0), "max_keys"),
    ],
)
def test_node_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NodeConfig(**kwargs)
    assert NodeConfig(capacity="1GiB").capacity == 1 << 30


def test_client_config_validation():
    with pytest.raises(ValueError, match="replicas"):
        ClientConfig(("tcp://127.0.0.1:1",), replicas=2)
    with pytest.raises(ValueError, match="distinct"):
        ClientConfig(("tcp://127.0.0.1:1", "tcp://127.0.0.1:1"))
    for bad in ("127.0.0.1", "udp://127.0.0.1:1", "host:port", "127.0.0.1:65536", ":7400", ""):
        with pytest.raises(ValueError, match="not an endpoint"):
            ClientConfig((bad,))
    with pytest.raises(ValueError, match="timeout_s"):
        ClientConfig(("tcp://127.0.0.1:1",), timeout_s=0)
    assert ClientConfig("tcp://127.0.0.1:1").endpoints == ("tcp://127.0.0.1:1",)
    # host:port is tcp://host:port, so both spellings shard alike (and are one node)
    assert ClientConfig(("127.0.0.1:1", "[::1]:2", "ipc:///tmp/x")).endpoints == (
        "tcp://127.0.0.1:1",
        "tcp://[::1]:2",
        "ipc:///tmp/x",
    )
    with pytest.raises(ValueError, match="distinct"):
        ClientConfig(("127.0.0.1:1", "tcp://127.0.0.1:1"))
    assert NodeConfig(endpoint="127.0.0.1:0").bind_address == "tcp://127.0.0.1:0"


def test_rendezvous_is_stable_and_balanced():
    eps = [f"tcp://127.0.0.1:{7400 + i}" for i in range(4)]
    a, b = Router(eps, 2, (0.1, 1)), Router(eps, 2, (0.1, 1))
    keys = [i.to_bytes(16, "little") for i in range(4000)]
    firsts = [a.ranking(k)[0] for k in keys]
    assert firsts == [b.ranking(k)[0] for k in keys]
    counts = [firsts.count(n) for n in range(4)]
    assert min(counts) > 800  # ~1000 each
    # Removing a node only moves the keys that ranked it first.
    c = Router(eps[:3], 2, (0.1, 1))
    moved = sum(1 for k, f in zip(keys, firsts) if f != 3 and c.ranking(k)[0] != f)
    assert moved == 0


def test_a_frame_without_a_source_descriptor_reads_none():
    """libzmq records a message's connection descriptor (ZMQ_SRCFD) only for some connections
    (not where ``getpeername`` failed as it took the connection over): reading it is None
    there, never an error. Fails on f1eb0b9 (no source_fd; the node read
    ``frame.get(zmq.SRCFD)``, which raised EINVAL out of its loop)."""
    assert source_fd(zmq.Frame(b"no metadata")) is None


def test_eviction_keeps_room_for_what_is_on_its_way_in():
    """With ``arriving`` bytes (requests received, not yet stored), a put evicts until
    blocks and arrivals together are within the low watermark."""
    store = BlockStore(1000 * 1024, max_block_bytes=64 * 1024)
    value = b"v" * (60 * 1024)
    for i in range(15):
        assert store.put(f"k{i}".encode(), (value,), len(value), 0) is Status.OK
    assert store.evictions == 0
    store.arriving = 300 * 1024
    assert store.put(b"next", (value,), len(value), 0) is Status.OK
    assert store.evictions > 0 and store.used + store.arriving <= store.high
