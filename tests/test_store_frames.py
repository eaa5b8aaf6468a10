"""Multi-frame values (protocol 2): one key, several frames, one checksum over all of them."""

import os
import random

import msgpack
import numpy as np
import pytest
import xxhash
import zmq

from pagekv.store import AsyncStoreClient, Code, Status, StoreClient
from pagekv.store.node.block_store import block_cost
from pagekv.store.wire.protocol import SHARED_BUFFER_BYTES, checksum_frames
from tests.test_store_node import Running, ask, raw_socket


@pytest.fixture
def node():
    running = Running(capacity="64MiB", max_block_size="8MiB", max_message_size="16MiB")
    yield running
    running.stop()


def value(rng: random.Random, frames: int, most: int = 3000) -> list[bytes]:
    return [os.urandom(rng.randint(1, most)) for _ in range(frames)]


def poisoned_like(frames: list[bytes]) -> list[bytearray]:
    return [bytearray(b"\xa5" * len(f)) for f in frames]


@pytest.mark.parametrize("nframes", [1, 2, 64])
def test_round_trip_n_frames(node, nframes):
    rng = random.Random(nframes)
    keys = [os.urandom(16) for _ in range(5)]
    values = [value(rng, nframes, 20_000 if nframes < 64 else 3000) for _ in keys]
    with StoreClient(node.address, timeout_s=3) as client:
        assert client.put_many(keys, values) == [Status.OK] * 5
        into = [poisoned_like(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * 5
        assert [[bytes(b) for b in v] for v in into] == values
        views = client.get_many(keys)
    for got, want in zip(views, values):
        if nframes == 1:  # single-frame values keep the one-memoryview return type
            assert isinstance(got, memoryview) and got.readonly and bytes(got) == want[0]
        else:
            assert [bytes(g) for g in got] == want and all(g.readonly for g in got)
    # the node keeps the frames as received (small ones copied out of libzmq's shared receive
    # buffer; over the bulk lane, large ones in the buffer they were received into), one block
    # per value
    blocks = node.node.store._blocks
    assert all(len(blocks[k].frames) == nframes for k in keys)
    for k in keys:
        for f in blocks[k].frames:
            large = (zmq.Frame, np.ndarray)
            assert isinstance(f, large if len(f) > SHARED_BUFFER_BYTES else bytes)
    costs = [block_cost(k, sum(map(len, v)), nframes) for k, v in zip(keys, values)]
    assert node.node.store.used == sum(costs) and len(node.node.store) == 5


def test_mixed_batch_and_single_buffer_values(node):
    rng = random.Random(7)
    keys = [os.urandom(16) for _ in range(12)]
    values = [value(rng, rng.choice([1, 2, 3, 8])) for _ in keys]
    # single-frame values passed as plain bytes-likes (the pre-2 API), the others as lists
    args = [v[0] if len(v) == 1 else v for v in values]
    with StoreClient(node.address, timeout_s=3) as client:
        assert client.put_many(keys, args) == [Status.OK] * 12
        into = [bytearray(b"\xa5" * len(v[0])) if len(v) == 1 else poisoned_like(v) for v in values]
        assert client.get_many(keys, into=into) == [True] * 12
        for got, want in zip(into, values):
            assert (bytes(got) if len(want) == 1 else [bytes(g) for g in got]) == (
                want[0] if len(want) == 1 else want
            )


@pytest.mark.asyncio
async def test_async_round_trip_mixed(node):
    rng = random.Random(3)
    keys = [os.urandom(16) for _ in range(6)]
    values = [value(rng, n) for n in (1, 2, 64, 1, 5, 2)]
    client = AsyncStoreClient(node.address, timeout_s=3)
    try:
        assert await client.put_many(keys, values) == [Status.OK] * 6
        into = [poisoned_like(v) for v in values]
        assert await client.get_many(keys, into=into) == [True] * 6
        assert [[bytes(b) for b in v] for v in into] == values
        got = await client.get_many(keys[1:3])
        assert [[bytes(g) for g in v] for v in got] == values[1:3]
    finally:
        client.close()


def test_checksum_covers_every_frame_in_order(node):
    frames = [os.urandom(1000), os.urandom(2000), os.urandom(10)]
    assert checksum_frames(frames) == xxhash.xxh3_64_intdigest(b"".join(frames))
    assert checksum_frames(frames[::-1]) != checksum_frames(frames)


def test_scatter_mismatch_is_a_counted_miss_and_leaves_buffers(node):
    key, frames = os.urandom(16), [os.urandom(100), os.urandom(200)]
    with StoreClient(node.address, timeout_s=3) as client:
        assert client.put_many([key], [frames]) == [Status.OK]
        wrong = [
            [bytearray(b"\xa5" * 100), bytearray(b"\xa5" * 201)],  # second size off by one
            [bytearray(b"\xa5" * 200), bytearray(b"\xa5" * 100)],  # sizes swapped
            [bytearray(b"\xa5" * 300)],  # one buffer for a two-frame value
            [bytearray(b"\xa5" * 100), bytearray(b"\xa5" * 200), bytearray(b"\xa5")],
        ]
        for into in wrong:
            assert client.get_many([key], into=[into]) == [False]
            assert all(set(b) == {0xA5} for b in into)
        assert client.counters["size_mismatch"] == len(wrong)
        right = poisoned_like(frames)
        assert client.get_many([key], into=[right]) == [True]
        assert [bytes(b) for b in right] == frames


def test_flipped_byte_in_second_frame_is_a_miss():
    running = Running(capacity="16MiB", verify_puts=False)
    try:
        frames = [os.urandom(512), os.urandom(512)]
        cs = checksum_frames(frames)
        tampered = bytearray(frames[1])
        tampered[300] ^= 0x10
        sock = raw_socket(running.address)
        reply, _ = ask(sock, [put_head([b"tampered-key-001"], [2], [512, 512], [cs]),
                              frames[0], bytes(tampered)])  # fmt: skip
        assert reply["status"] == [Status.OK]  # the node was told not to verify
        with StoreClient(running.address, timeout_s=3) as client:
            assert client.get_many([b"tampered-key-001"]) == [None]
            into = poisoned_like(frames)
            assert client.get_many([b"tampered-key-001"], into=[into]) == [False]
            assert client.counters["checksum_mismatch"] == 2
    finally:
        running.stop()


def test_node_refuses_tampered_frame_when_verifying(node):
    frames = [os.urandom(512), os.urandom(512)]
    cs = checksum_frames(frames)
    sock = raw_socket(node.address)
    bad = [frames[0], frames[1][:-1] + bytes([frames[1][-1] ^ 1])]
    reply, _ = ask(sock, [put_head([b"k1"], [2], [512, 512], [cs]), *bad])
    assert reply["status"] == [Status.BAD_CHECKSUM] and node.node.store.used == 0


def put_head(keys, counts, sizes, sums):
    head = {"v": 2, "id": 1, "op": "PUT", "keys": keys, "counts": counts, "sizes": sizes,
            "sums": sums}  # fmt: skip
    return msgpack.packb(head, use_bin_type=True)


@pytest.mark.parametrize(
    "counts, sizes, payloads, code",
    [
        ([2], [3, 3], [b"abc"], Code.BAD_FRAMES),  # one frame short
        ([1], [3], [b"abc", b"def"], Code.BAD_FRAMES),  # one frame too many
        ([2], [3, 3], [b"abc", b"defg"], Code.BAD_FRAMES),  # second frame's size wrong
        ([3], [3, 3, 3], [b"abc", b"def"], Code.BAD_FRAMES),
        ([2], [3], [b"abc", b"def"], Code.BAD_HEADER),  # sizes do not match counts
        ([0], [], [], Code.BAD_HEADER),  # a value has at least one frame
        ([1, 1], [3, 3], [b"abc", b"def"], Code.BAD_HEADER),  # counts longer than keys
    ],
)
def test_wrong_frame_counts_and_sizes_are_refused_whole(node, counts, sizes, payloads, code):
    sock = raw_socket(node.address)
    sums = [checksum_frames(payloads[:1] or [b""])]
    reply, _ = ask(sock, [put_head([b"key-a"], counts, sizes, sums), *payloads])
    assert reply["code"] == code and reply["error"]
    assert node.node.store.used == 0 and len(node.node.store) == 0
    assert ask(sock, [msgpack.packb({"v": 2, "id": 2, "op": "PING"})])[0]["code"] == Code.OK


def test_value_argument_errors(node):
    with StoreClient(node.address, timeout_s=3) as client:
        with pytest.raises(ValueError, match="at least one frame"):
            client.put_many([b"k"], [[]])
        with pytest.raises(TypeError):
            client.put_many([b"k"], [[b"a", 3]])
        with pytest.raises(TypeError):
            client.put_many([b"k"], [42])
        with pytest.raises(ValueError, match="read-only"):
            client.get_many([b"k"], into=[[bytearray(2), b"ro"]])
        with pytest.raises(ValueError, match="read-only"):  # a flat view is taken as it is
            client.get_many([b"k"], into=[memoryview(b"ro")])
        assert node.node.store.used == 0
