"""KV events against vLLM 0.32's own types (``vllm.distributed.kv_events``):

* a node's batches are byte for byte what vLLM's msgspec encoder writes for the same
  ``KVEventBatch``, and tests/kv_events.py's msgpack decoder reads vLLM's bytes as vLLM does;
* a subscriber decoding with vLLM's own decoder rebuilds a node's contents (PUTs, evictions,
  deletes, missed batches);
* the connector's events: only confirmed saves, sent once every writer rank confirmed them;
* a real vLLM engine with ``kv_events_config``: vLLM's own publisher sends ``BlockStored``
  events of medium ``PAGEKV`` whose block hashes and tokens are those of vLLM's own events for
  the same prompt blocks.
"""

from __future__ import annotations

import functools
import os
import random

import pytest

if os.environ.get("PAGEKV_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401 - `make test-vllm`: no vLLM is a failure, not a skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm installs it)")

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from pagekv.store import Status
from pagekv.store.launch import start_nodes
from pagekv.store.node.event_publisher import encode_batch
from pagekv.store.node.events import DISK, MEMORY
from tests.kv_events import Subscriber, decode_batch
from tests.test_store_events import MIB, Served, fresh, matches

from .test_vllm import EXTRA, MODEL_ID
from .vllm_fixtures import BLOCK, Engine

VLLM_DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


def _stored(keys, medium):
    return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=0,
                       lora_id=None, medium=medium, lora_name=None)  # fmt: skip


@pytest.mark.parametrize("n", [0, 1, 15, 16, 300, 70_000])
def test_node_batches_are_vllms_bytes(n):
    rng = random.Random(os.urandom(8))
    keys = [rng.randbytes(16) for _ in range(n)]
    ts = rng.random() * 2e9
    ours = encode_batch(ts, [None, (True, MEMORY, keys), (False, DISK, keys[: n // 2])])
    theirs = msgspec.msgpack.encode(KVEventBatch(ts=ts, events=[
        AllBlocksCleared(), _stored(keys, MEMORY),
        BlockRemoved(block_hashes=keys[: n // 2], medium=DISK)]))  # fmt: skip
    assert ours == theirs
    assert VLLM_DECODE(ours) == KVEventBatch(ts=ts, events=[
        AllBlocksCleared(), _stored(keys, MEMORY),
        BlockRemoved(block_hashes=keys[: n // 2], medium=DISK)])  # fmt: skip
    # the tests' own decoder reads vLLM's bytes (its extra fields too) as vLLM does
    lora = BlockStored(block_hashes=[7, 8], parent_block_hash=6, token_ids=[1, 2, 3, 4],
                       block_size=2, lora_id=3, medium="GPU", lora_name="x",
                       group_idx=1)  # fmt: skip
    mine = decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=ts, events=[lora],
                                                            data_parallel_rank=2)))  # fmt: skip
    (ev,) = mine.events
    assert (mine.ts, mine.data_parallel_rank, ev.block_hashes, ev.parent_block_hash,
            ev.token_ids, ev.lora_id, ev.medium, ev.extra) == (
        ts, 2, [7, 8], 6, [1, 2, 3, 4], 3, "GPU", {"group_idx": 1})  # fmt: skip


def test_vllm_decoder_rebuilds_a_nodes_contents(tmp_path):
    served = Served(capacity=2 * MIB, max_block_size=256 << 10, max_message_size=4 * MIB,
                    events_endpoint=f"ipc://{tmp_path}/ev",
                    events_replay_endpoint=f"ipc://{tmp_path}/rp")  # fmt: skip
    try:
        keys, vals = fresh(60, 60_000)
        pub = served.node.publisher
        with Subscriber(pub.endpoint, pub.replay_endpoint, decode=VLLM_DECODE) as sub, \
                served.client() as c:  # fmt: skip
            sub.drop = {1, 2}
            for i in range(0, 60, 6):
                assert c.put_many(keys[i : i + 6], vals[i : i + 6]) == [Status.OK] * 6
                matches(sub, served)
            assert c.delete_many(sorted(served.contents()[MEMORY])[:2]) == [True, True]
            matches(sub, served)
            assert sub.replays >= 1 and isinstance(sub.batches[0], KVEventBatch)
    finally:
        served.stop()


# ---- the connector's events --------------------------------------------------------------------
def test_connector_events_need_every_writer_and_a_confirmed_save():
    from pagekv.connector.vllm.events import MEDIUM, ConfirmedEvents, PagekvKVEvents, stored_events
    from pagekv.connector.vllm.metadata import BlockTransfer, SavedBlock
    from pagekv.connector.vllm.worker import SaveOutcomes

    hashes = [os.urandom(32) for _ in range(3)]
    spec = BlockTransfer("r", (4, 5, 6), tuple(hashes), described=tuple(
        SavedBlock(hashes[i - 1] if i else None, tuple(range(i * 4, i * 4 + 4)))
        for i in range(3)))  # fmt: skip
    ranks = [SaveOutcomes(functools.partial(stored_events, block_size=4)) for _ in range(2)]
    keys = [[os.urandom(16) for _ in range(3)] for _ in ranks]  # each rank's own keys
    for rank, k in zip(ranks, keys):
        rank.saved(k, spec)
    tally = ConfirmedEvents(writers=2)
    ranks[0].stored(keys[0][:2])
    ranks[0].unsaved(keys[0][2:])  # its third save failed: never confirmed, reported unsaved
    ranks[1].stored([os.urandom(16)])  # a key it did not save: nothing
    ranks[1].unsaved([os.urandom(16)])
    assert ranks[0].take_unsaved() == {hashes[2]} and ranks[1].take_unsaved() == set()
    tally.add(PagekvKVEvents(ranks[0].take_events()))
    tally.add(PagekvKVEvents(ranks[1].take_events()))
    assert list(tally.take()) == []  # rank 1 has confirmed nothing yet
    ranks[1].stored(keys[1])
    ranks[1].unsaved(keys[1])  # already stored: no longer followed
    assert ranks[1].take_unsaved() == set()
    tally.add(PagekvKVEvents(ranks[1].take_events()))
    events = list(tally.take())
    assert [e.block_hashes for e in events] == [[vllm_hash(hashes[0])], [vllm_hash(hashes[1])]]
    assert events[1].parent_block_hash == vllm_hash(hashes[0])
    assert events[1].token_ids == [4, 5, 6, 7] and events[1].block_size == 4
    assert {e.medium for e in events} == {MEDIUM}
    assert list(tally.take()) == []


def vllm_hash(h):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(h)


def _received(sub: zmq.Socket, wait_ms: int) -> list:
    """The events vLLM's publisher sent within ``wait_ms`` of the first (or none)."""
    events: list = []
    while sub.poll(wait_ms):
        wait_ms = 200
        _, _, payload = sub.recv_multipart()
        events.extend(VLLM_DECODE(payload).events)
    return events


def test_vllm_publishes_pagekv_stores_with_its_own_hashes(models, tmp_path):
    (node,) = start_nodes(1, "--capacity", "256MiB")
    endpoint = f"ipc://{tmp_path}/vllm-events"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    rng = random.Random(os.urandom(8))
    prompt = [rng.randrange(3, 512) for _ in range(3 * BLOCK + 20)]  # 3 full blocks
    engine = Engine(models.good, store=[node.address], extra=EXTRA, model_id=MODEL_ID,
                    kv_events=endpoint)  # fmt: skip
    try:
        engine.generate([prompt], max_tokens=2)
        assert engine.call("flush")["ok"]  # the write-back confirmed by the store
        events = _received(sub, 10_000)
        for _ in range(20):  # each step carries the confirmations the workers have to vLLM
            if len(pagekv(events)) >= 3:
                break
            engine.generate([[5, 6, 7]], max_tokens=1)
            events += _received(sub, 2_000)
    finally:
        engine.close()
        sub.close()
        node.stop()
    ours = pagekv(events)
    gpu = [e for e in events if isinstance(e, BlockStored) and e.medium != "PAGEKV"]
    gpu_blocks = {h: (e.parent_block_hash if i == 0 else e.block_hashes[i - 1],
                      e.token_ids[i * BLOCK : (i + 1) * BLOCK])
                  for e in gpu for i, h in enumerate(e.block_hashes)}  # fmt: skip
    assert len(ours) == 3, ours
    for ev in ours:  # vLLM's hash, parent and tokens of the same block
        (h,) = ev.block_hashes
        assert (ev.parent_block_hash, ev.token_ids) == gpu_blocks[h]
        assert ev.block_size == BLOCK
    blocks = {tuple(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)}
    assert {tuple(ev.token_ids) for ev in ours} == blocks


def pagekv(events: list) -> list:
    return [e for e in events if getattr(e, "medium", None) == "PAGEKV"]
