"""Prefetch with device_slots on the CUDA kernels (contract 8 in kv_connector.py): chunks on the
load stream while later pages still arrive, ordered after the caller's stream, and the slot
reuse race of a short prefetch made deterministic by holding a stream back until the test
opens it (``StreamGate``)."""

import asyncio
import concurrent.futures

import pytest
import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.store.launch import NodeProcess
from tests.helpers import (
    GatedStore,
    StreamGate,
    bits_equal,
    kv_caches,
    poison_,
    random_tensor,
    wait_until,
)

pytestmark = pytest.mark.cuda
GEO = KVGeometry(4, 16, 8, 128, "bf16")  # 256 KiB pages: 64-page (16 MiB) chunks
SLOTS = 8192
PAGES = 200  # 3 chunks of 64, then 8 pages at the end
N = PAGES * GEO.page_size


@pytest.fixture(scope="module")
def node():
    n = NodeProcess("--capacity", "2GiB").start()
    yield n
    n.stop()


def caches(poisoned=False):
    return kv_caches(GEO, SLOTS, "cuda", poisoned=poisoned)


def connector(node, kv):
    """A connector whose lookups wait up to 5 s (the default's 50 ms is an engine's step
    budget: a host busy with 8 test workers missed it and the prefetch found nothing)."""
    ns = KeyNamespace("gpu-streaming", GEO)
    return KVConnector(GEO, kv, node.address, host_pages=PAGES + 8, namespace=ns,
                       lookup_timeout_s=5)  # fmt: skip


@pytest.fixture(scope="module")
def stored(node):
    """A prompt of PAGES pages in the store and its KV ``[layers, N, ...]`` in token order."""
    src = caches()
    w = connector(node, src)
    try:
        tokens = torch.randint(0, 32000, (N,)).tolist()
        slots = torch.randperm(SLOTS, device="cuda")[:N]
        w.save(tokens, slots)
        w.flush_sync(timeout=60)
        kv = [c[:, slots].clone() for c in src]
    finally:
        w.close()
    return tokens, kv


@pytest.fixture
def engine(node, stored):
    """Engine B (poisoned cache), warmed up: kernels built, pointer table, allocator segments
    and staging used once by a streamed prefetch, then the host tier emptied (the pages come
    from the store again)."""
    dst = caches(poisoned=True)
    b = connector(node, dst)
    h = asyncio.run(b.prefetch(stored[0], device_slots=torch.arange(SLOTS - N, SLOTS)))
    assert h.loaded_tokens == N
    b.release(h)
    h.loaded_event.synchronize()  # its chunks landed (the pages' holds go with them): not a
    # device sync, which does not wait for a chunk the connector's issuer has yet to enqueue
    b.cache.evict(PAGES + 8)
    assert b.cache.describe()["host_cached"] == 0
    for c in dst:
        poison_(c)
    yield b, dst
    b.close()


def same(kv, slots, expected):
    torch.cuda.synchronize()
    return all(bits_equal(c[:, slots], e) for c, e in zip(kv, expected))


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_chunks_land_while_later_pages_arrive(stored, engine, where):
    tokens, kv = stored
    b, dst = engine
    gate = GatedStore(b, allowed=64)
    slots = torch.randperm(SLOTS)[:N].to(where)
    first = slots[: 64 * GEO.page_size].cuda()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(b.prefetch_sync, tokens, device_slots=slots, timeout_s=60)
        wait_until(lambda: same(dst, first, [e[:, : first.numel()] for e in kv]),
                   what="the first chunk")  # fmt: skip
        assert not result.done()  # on the device while page 64 is still held back
        gate.allow(PAGES)
        h = result.result(timeout=60)
    assert h.num_tokens == h.loaded_tokens == N
    assert len(h.loads) == 4 and h.loaded_event.events == h.loads
    h.wait_loaded()  # the reads below, on this stream, come after every chunk
    got = [c[:, slots.cuda()] for c in dst]
    assert all(bits_equal(g, e) for g, e in zip(got, kv))
    b.release(h)


def test_load_comes_after_the_callers_stream_and_reads_a_copy_of_its_slots(stored, engine):
    """The engine's stream is held back with the slot table and an old write into those
    slots still queued: the chunks must land after both. Then the engine reuses its slot
    tensor at once: the chunks must still use the values it had at the call."""
    tokens, kv = stored
    b, dst = engine
    perm = torch.randperm(SLOTS, device="cuda")[:N]
    other = torch.randperm(SLOTS, device="cuda")[:N]
    old = [random_tensor(e.shape, e.dtype, "cuda") for e in kv]
    slots = torch.empty_like(perm)
    torch.cuda.synchronize()
    with StreamGate(torch.cuda.current_stream()):  # the engine's stream, held back
        slots.copy_(perm)  # written late: once the gate opens
        for c, o in zip(dst, old):
            c.index_copy_(1, perm, o)  # the slots' previous use, late too
        # returns with the engine's stream still held (a prefetch that waited on it would
        # time out here)
        h = b.prefetch_sync(tokens, device_slots=slots, timeout_s=30)
        slots.copy_(other)  # the engine's next step reuses its tensor
    assert h.loaded_tokens == N
    h.wait_loaded()
    assert same(dst, perm, kv)
    b.release(h)


@pytest.mark.parametrize("engine_waits", [True, False])
def test_engine_writes_after_a_short_prefetch_are_not_overwritten(stored, engine, engine_waits):
    """min_tokens out of reach: num_tokens is 0, but three chunks were launched into the slots
    (held back on the load stream until the test opens it). The engine recomputes the prompt
    into the same slots at once. After wait_loaded its values stay; without it (the control,
    the engine's writes done before the chunks may run) the late chunks land on top: the race
    is real, and wait_loaded is what orders it."""
    tokens, kv = stored
    b, dst = engine
    slots = torch.arange(N, device="cuda")
    mine = [random_tensor(e.shape, e.dtype, "cuda") for e in kv]
    torch.cuda.synchronize()
    with StreamGate(b._load_stream):
        h = asyncio.run(b.prefetch(tokens, device_slots=slots, min_tokens=N + GEO.page_size))
        assert h.num_tokens == 0 and h.loaded_tokens == 0 and len(h.loads) == 3
        if engine_waits:
            h.wait_loaded()
        for c, m in zip(dst, mine):  # the engine's recompute, on its stream
            c.index_copy_(1, slots, m)
        if not engine_waits:
            torch.cuda.current_stream().synchronize()
    if engine_waits:
        assert same(dst, slots, mine)
    else:  # the control: the late chunks overwrote the engine's values
        n = 3 * 64 * GEO.page_size
        assert same(dst, slots[:n], [e[:, :n] for e in kv])
    b.cache.reap()
    assert b.cache.num_held == 0  # released after the chunks' events


def test_streamed_prefetch_makes_no_host_sync(stored, engine):
    """torch's sync debug mode turns any host synchronisation (engine thread or loop thread)
    into an error, which would fail the prefetch."""
    tokens, kv = stored
    b, dst = engine
    slots = torch.randperm(SLOTS)[:N]  # CPU slots, uploaded through the staging ring
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        h = asyncio.run(b.prefetch(tokens, device_slots=slots))
        h.wait_loaded()
        b.release(h)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert h.loaded_tokens == N
    assert same(dst, slots.cuda(), kv)
