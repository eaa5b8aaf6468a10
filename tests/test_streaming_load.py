"""Prefetch with device_slots on CPU (the torch path: each chunk is copied when it becomes
leading) against a real store node: bit-exact loads into a poisoned cache, chunks that land while
later pages are still arriving, and what a short prefetch leaves in the slots."""

import asyncio
import concurrent.futures
import random
import threading
import time

import pytest
import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry, streaming_load
from pagekv.errors import InvalidSlotError
from pagekv.store import StoreClient
from tests.helpers import GatedStore, as_bits, bits_equal, poison_, random_tensor, wait_until

GEO = KVGeometry(3, 4, 2, 16, "bf16")  # 1.5 KiB pages
NUM_SLOTS = 1024
PAGES = 50
CHUNK = 8


def caches(poisoned=False):
    shape = (GEO.num_layers, NUM_SLOTS, *GEO.device_layer_shape)
    if poisoned:
        return [poison_(torch.empty(shape, dtype=GEO.dtype)) for _ in range(2)]
    return [random_tensor(shape, GEO.dtype) for _ in range(2)]


def connector(node, kv, host_pages=4 * PAGES):
    ns = KeyNamespace("stream-model", GEO)
    return KVConnector(GEO, kv, node.address, host_pages=host_pages, namespace=ns)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(streaming_load, "CHUNK_PAGES", CHUNK)


@pytest.fixture
def stored(node):
    """A prompt of PAGES full pages (and a partial one) in the store, its KV (per cache group,
    ``[layers, tokens, ...]`` in token order), and engine B with a poisoned cache."""
    src = caches()
    a = connector(node, src)
    tokens = [random.randrange(32000) for _ in range(PAGES * GEO.page_size + 3)]
    slots = torch.randperm(NUM_SLOTS)[: len(tokens)]
    a.save(tokens, slots)
    a.flush_sync(timeout=10)
    kv = [c[:, slots[: PAGES * GEO.page_size]].clone() for c in src]
    a.close()
    dst = caches(poisoned=True)
    b = connector(node, dst)
    yield tokens, kv, b, dst
    b.close()


def out_slots():
    """Random destination slots for every full page, with room to spare (the partial page)."""
    return torch.randperm(NUM_SLOTS)[: PAGES * GEO.page_size + GEO.page_size]


def loaded(dst, slots, kv, pages):
    """Whether the slots of the first ``pages`` pages hold the source KV."""
    n = pages * GEO.page_size
    return all(bits_equal(d[:, slots[:n]], s[:, :n]) for d, s in zip(dst, kv))


def poisoned_except(dst, slots, pages):
    """Every slot but those of the first ``pages`` pages still holds the poison."""
    keep = torch.ones(NUM_SLOTS, dtype=torch.bool)
    keep[slots[: pages * GEO.page_size]] = False
    return all((as_bits(d[:, keep]).view(torch.uint8) == 0xA5).all() for d in dst)


def test_prefetch_loads_every_page_bit_exact(stored):
    tokens, kv, b, dst = stored
    slots = out_slots()
    h = asyncio.run(b.prefetch(tokens, device_slots=slots))
    assert h.num_tokens == h.loaded_tokens == PAGES * GEO.page_size and h.fetched == PAGES
    assert h.streaming.chunks == 1  # 50 pages: below the default chunk, all loaded at the end
    h.wait_loaded()  # nothing to wait for on CPU
    assert h.loaded_event is None
    assert loaded(dst, slots, kv, PAGES)
    assert poisoned_except(dst, slots, PAGES)  # the partial page's slots stay untouched
    b.release(h)
    assert b.cache.num_held == 0


def test_host_tier_pages_load_before_any_page_arrives(stored, small_chunks):
    """Pages already in the host tier are leading at once: loaded before the fetch of the
    rest delivers anything."""
    tokens, kv, b, dst = stored
    b.release(asyncio.run(b.prefetch(tokens[: 20 * GEO.page_size])))
    gate = GatedStore(b)
    slots = out_slots()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        table = slots.view(-1, GEO.page_size)  # [pages, page_size] is accepted too
        result = pool.submit(b.prefetch_sync, tokens, device_slots=table, timeout_s=30)
        wait_until(lambda: loaded(dst, slots, kv, 20), what="the host-tier pages")
        assert not result.done() and gate.arrived == 0
        gate.allow(PAGES)
        h = result.result(timeout=30)
    assert h.fetched == PAGES - 20 and h.loaded_tokens == PAGES * GEO.page_size
    assert h.streaming.chunks == 1 + 3 + 1  # 20 at once; 3 chunks of 8; the last 6
    assert loaded(dst, slots, kv, PAGES) and poisoned_except(dst, slots, PAGES)
    b.release(h)


def test_leading_pages_load_while_later_pages_are_still_arriving(stored, small_chunks):
    tokens, kv, b, dst = stored
    gate = GatedStore(b, allowed=CHUNK)
    slots = out_slots()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(b.prefetch_sync, tokens, device_slots=slots, timeout_s=30)
        wait_until(lambda: loaded(dst, slots, kv, CHUNK), what="the first chunk")
        assert not result.done()  # loaded while the prefetch still waits for page CHUNK
        assert poisoned_except(dst, slots, CHUNK)
        gate.allow(PAGES)
        h = result.result(timeout=30)
    assert h.loaded_tokens == h.num_tokens == PAGES * GEO.page_size
    assert h.streaming.chunks == PAGES // CHUNK + 1  # 6 chunks of 8, then the last 2 pages
    assert loaded(dst, slots, kv, PAGES) and poisoned_except(dst, slots, PAGES)
    b.release(h)


def test_missing_page_loads_exactly_the_leading_pages(node, stored, small_chunks):
    tokens, kv, b, dst = stored
    with StoreClient(node.address) as c:
        assert c.delete_many([b.keys(tokens)[20]]) == [True]
    slots = out_slots()
    h = asyncio.run(b.prefetch(tokens, device_slots=slots))
    assert h.num_tokens == h.loaded_tokens == 20 * GEO.page_size
    assert h.streaming.chunks == 3  # 8, 8, then the 4 left when page 20 was missing
    assert loaded(dst, slots, kv, 20) and poisoned_except(dst, slots, 20)
    b.release(h)


def test_deadline_loads_the_pages_that_arrived(stored, small_chunks):
    tokens, kv, b, dst = stored
    gate = GatedStore(b, allowed=12)
    slots = out_slots()
    h = asyncio.run(b.prefetch(tokens, deadline=time.monotonic() + 0.5, device_slots=slots))
    assert h.num_tokens == h.loaded_tokens == 12 * GEO.page_size
    assert h.streaming.chunks == 2  # 8, then the 4 that were leading at the deadline
    assert loaded(dst, slots, kv, 12) and poisoned_except(dst, slots, 12)
    b.release(h)
    gate.allow(PAGES)  # the fetch goes on into the host tier
    wait_until(lambda: b.cache.match_prefix(b.keys(tokens)) == PAGES, what="the rest")
    assert poisoned_except(dst, slots, 12)  # nothing loaded after the prefetch returned


def test_min_tokens_not_reached_holds_nothing_and_loads_no_remainder(node, stored, small_chunks):
    tokens, kv, b, dst = stored
    with StoreClient(node.address) as c:
        assert c.delete_many([b.keys(tokens)[20]]) == [True]
    slots = out_slots()
    h = asyncio.run(b.prefetch(tokens, min_tokens=PAGES * GEO.page_size, device_slots=slots))
    assert h.num_tokens == 0 and h.loaded_tokens == 0
    h.wait_loaded()  # what an engine does before writing the slots; nothing to wait on CPU
    assert b.cache.num_held == 0
    # the two chunks that were leading are in the slots; the last 4 pages were not loaded
    assert h.streaming.chunks == 2
    assert loaded(dst, slots, kv, 16) and poisoned_except(dst, slots, 16)


def test_device_slots_are_validated_before_anything_is_fetched(node, stored):
    tokens, _, b, _ = stored
    before = node.stats()["op_get"]
    with pytest.raises(ValueError, match="device_slots needs"):
        asyncio.run(b.prefetch(tokens, device_slots=torch.arange(PAGES * GEO.page_size - 1)))
    bad = torch.arange(PAGES * GEO.page_size)
    bad[7] = NUM_SLOTS
    with pytest.raises(InvalidSlotError):
        b.prefetch_sync(tokens, device_slots=bad, timeout_s=5)
    assert node.stats()["op_get"] == before and b.cache.num_held == 0


def test_slot_tensor_may_be_reused_right_after_the_call(stored, small_chunks):
    tokens, kv, b, dst = stored
    gate = GatedStore(b)
    slots = out_slots()
    mine = slots.clone()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(b.prefetch_sync, tokens, device_slots=mine, timeout_s=30)
        wait_until(lambda: gate.calls > 0, what="the fetch")  # the call has taken the slots
        mine.copy_(torch.randperm(NUM_SLOTS)[: mine.numel()])  # the engine's next step
        gate.allow(PAGES)
        h = result.result(timeout=30)
    assert h.loaded_tokens == PAGES * GEO.page_size
    assert loaded(dst, slots, kv, PAGES) and poisoned_except(dst, slots, PAGES)
    b.release(h)


def test_cancelled_prefetch_launches_no_further_chunk(stored, small_chunks):
    tokens, kv, b, dst = stored
    gate = GatedStore(b, allowed=CHUNK)
    slots = out_slots()

    async def cancel_after_first_chunk():
        task = asyncio.ensure_future(b.prefetch(tokens, device_slots=slots))
        await asyncio.to_thread(wait_until, lambda: loaded(dst, slots, kv, CHUNK))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_after_first_chunk())
    gate.allow(PAGES)  # the rest arrives after the cancel
    wait_until(lambda: b.cache.num_held == 0, what="the cancelled prefetch's release")
    assert b.cache.match_prefix(b.keys(tokens)) == PAGES  # every page did arrive
    assert poisoned_except(dst, slots, CHUNK)


def test_prefetch_sync_past_its_timeout_loads_nothing_later(stored):
    """The loop is stuck past the timeout: the engine gets an empty handle at once, and the
    prefetch, when it runs, launches no chunk into slots the engine now owns again."""
    tokens, _, b, dst = stored
    b.release(asyncio.run(b.prefetch(tokens)))  # in the host tier: ready as soon as it runs
    stuck = threading.Event()
    b._loop.call_soon(stuck.wait)
    try:
        slots = out_slots()
        h = b.prefetch_sync(tokens, device_slots=slots, timeout_s=0.05)
        assert h.num_tokens == 0 and h.loaded_tokens == 0 and h.released
        h.wait_loaded()
    finally:
        stuck.set()
    wait_until(lambda: b.stats()["prefetches"] == 2, what="the late prefetch")
    wait_until(lambda: b.cache.num_held == 0, what="the orphan's release")
    assert poisoned_except(dst, slots, 0)


class BurstStore:
    """The connector's store client with every fetched page published in one synchronous burst
    once all have landed, as the same-host shortcut publishes a chunk of copied values from
    one callback: the prefetch's coroutine cannot run between those arrivals. Records, per
    arrival, how many chunks had been launched by then."""

    def __init__(self, conn, reverse=False):
        self.store, self.reverse = conn.store, reverse
        self.launched_at: list[int] = []
        conn.fetcher.store = self

    async def get_many(self, keys, into=None, on_arrival=None):
        got = []
        result = await self.store.get_many(keys, into=into, on_arrival=got.append)
        for i in sorted(got, reverse=self.reverse):
            self.launched_at.append(LAUNCHES[0])
            on_arrival(i)
        return result


LAUNCHES = [0]


def test_pages_published_in_one_burst_load_between_arrivals(stored, small_chunks, monkeypatch):
    """A chunk is launched as soon as it is leading, from the arrival that completes it, not
    once the whole burst has been handed over (which left the same-host shortcut's prefetch
    with its load after the fetch instead of beside it)."""
    tokens, kv, b, dst = stored
    launch = streaming_load.StreamingLoad._launch

    def counting(self, *args):
        LAUNCHES[0] += 1
        return launch(self, *args)

    monkeypatch.setattr(streaming_load.StreamingLoad, "_launch", counting)
    LAUNCHES[0] = 0
    burst = BurstStore(b)
    slots = out_slots()
    h = b.prefetch_sync(tokens, device_slots=slots, timeout_s=30)
    assert h.fetched == PAGES and h.loaded_tokens == PAGES * GEO.page_size
    assert len(burst.launched_at) == PAGES
    # the arrival after page k*CHUNK found k chunks launched: each as soon as it was complete
    assert [burst.launched_at[k * CHUNK] for k in range(PAGES // CHUNK)] == list(
        range(PAGES // CHUNK)
    )
    assert h.streaming.chunks == PAGES // CHUNK + 1
    assert loaded(dst, slots, kv, PAGES) and poisoned_except(dst, slots, PAGES)
    b.release(h)


def test_pages_arriving_last_first_still_load_in_chunks(stored, small_chunks):
    """Replies from several streams arrive out of order: the first page, last, releases every
    page at once, which is still loaded one chunk per launch (the chunk size is the launch
    size the load path is tuned for)."""
    tokens, kv, b, dst = stored
    BurstStore(b, reverse=True)
    slots = out_slots()
    h = b.prefetch_sync(tokens, device_slots=slots, timeout_s=30)
    assert h.fetched == PAGES and h.loaded_tokens == PAGES * GEO.page_size
    assert h.streaming.chunks == PAGES // CHUNK + 1
    assert loaded(dst, slots, kv, PAGES) and poisoned_except(dst, slots, PAGES)
    b.release(h)
