"""The engine contract on CPU: pool pressure, hand-over of fetched pages, bounded lookups,
lifecycle (pagekv/connector/kv_connector.py). GPU races: tests/gpu/test_engine_contract_gpu.py;
stopped nodes and process exit: tests/test_engine_contract_mp.py."""

import asyncio
import os
import random
import signal
import threading
import time

import pytest
import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry, KVIndex, PageCache
from pagekv.connector.host_pool import HostPagePool
from pagekv.errors import ConnectorClosed, PagekvError, WriteBackFailed
from pagekv.store import ClientConfig, ExistsResult, Status, StoreClient
from pagekv.store.launch import NodeProcess
from tests.helpers import bits_equal, poison_, random_tensor, sigstop, wait_until

GEO = KVGeometry(2, 4, 2, 16, "bf16")
NUM_SLOTS = 512


def caches(poisoned=False):
    shape = (GEO.num_layers, NUM_SLOTS, *GEO.device_layer_shape)
    if poisoned:
        return [poison_(torch.empty(shape, dtype=GEO.dtype)) for _ in range(2)]
    return [random_tensor(shape, GEO.dtype) for _ in range(2)]


def connector(address, kv, host_pages=64, **kw):
    ns = KeyNamespace("contract-model", GEO)
    return KVConnector(GEO, kv, address, host_pages=host_pages, namespace=ns, **kw)


def prompt(n):
    return [random.randrange(32000) for _ in range(n)]


def stored_prompt(address, pages):
    """A prompt whose ``pages`` pages are in the store; returns (tokens, src caches, slots)."""
    src = caches()
    tokens = prompt(pages * GEO.page_size)
    slots = torch.randperm(NUM_SLOTS)[: len(tokens)]
    a = connector(address, src, host_pages=pages + 4)
    try:
        assert a.save(tokens, slots).pages == pages
        a.flush_sync(timeout=30)
    finally:
        a.close()
    return tokens, src, slots


def same_rows(dst, dst_slots, src, src_slots):
    return all(bits_equal(d[:, dst_slots], s[:, src_slots]) for d, s in zip(dst, src))


# ---- item 7: pool pressure ----------------------------------------------------------------
def test_prefetch_takes_the_prefix_that_fits(node):
    tokens, src, slots = stored_prompt(node.address, 12)
    dst = caches(poisoned=True)
    b = connector(node.address, dst, host_pages=5)  # room for 5 of the 12 pages
    try:
        h = asyncio.run(b.prefetch(tokens))
        assert h.num_pages == 5 and h.fetched == 5  # before: 0 (the whole fetch failed)
        b.load(h, torch.arange(h.num_tokens))
        assert same_rows(dst, torch.arange(20), src, slots[:20])
        b.release(h)
        assert b.stats()["prefetch_pool_short"] == 7
    finally:
        b.close()


def test_fetched_pages_survive_eviction_before_the_prefetch_takes_them(node):
    """Worst case: every unheld page is evicted the moment the fetch lets go of it (as a save
    on another thread would do under pool pressure). The prefetch must still get its pages."""
    tokens, src, slots = stored_prompt(node.address, 8)
    dst = caches(poisoned=True)
    b = connector(node.address, dst, host_pages=8)
    release = b.cache.release

    def release_then_evict(pages, **kw):
        release(pages, **kw)
        b.cache.evict(1 << 30)

    b.cache.release = release_then_evict
    try:
        h = asyncio.run(b.prefetch(tokens))
        assert h.num_pages == 8  # before: 0 (evicted between publish and acquire)
        b.load(h, torch.arange(32))
        assert same_rows(dst, torch.arange(32), src, slots)
        b.release(h)
    finally:
        b.cache.release = release
        b.close()


def test_overlapping_prefetches_each_hold_their_pages(node):
    tokens, _, _ = stored_prompt(node.address, 6)
    b = connector(node.address, caches(), host_pages=8)
    try:

        async def both():
            return await asyncio.gather(b.prefetch(tokens), b.prefetch(tokens))

        h1, h2 = asyncio.run(both())
        assert h1.num_pages == h2.num_pages == 6
        assert all(b.cache.refcount(p) == 2 for p in h1.page_ids)
        b.release(h1)
        b.release(h2)
        assert b.cache.num_held == 0 and b.cache.num_evictable == 6
    finally:
        b.close()


def test_eviction_is_lru_by_last_release_and_constant_time_structure():
    cache = PageCache(HostPagePool(GEO, 4, pin=False))
    keys = [bytes([i]) * 16 for i in range(4)]
    pages = cache.allocate(4)
    for k, p in zip(keys, pages):
        assert cache.publish(k, p)
    cache.release([pages[2], pages[0], pages[3], pages[1]])  # last use order: 2, 0, 3, 1
    assert cache.num_evictable == 4
    cache.allocate(2)  # evicts the two least recently released
    assert keys[2] not in cache and keys[0] not in cache
    assert keys[3] in cache and keys[1] in cache


class _Event:
    def __init__(self):
        self.complete = False

    def query(self):
        return self.complete


def test_release_after_event_keeps_the_page_until_the_event_completes():
    cache = PageCache(HostPagePool(GEO, 2, pin=False))
    (page,) = cache.allocate(1)
    assert cache.publish(b"k" * 16, page)
    copy = _Event()
    cache.release([page], after=copy)
    assert cache.available() == 1 and cache.num_deferred == 1  # only the free page
    with pytest.raises(PagekvError):
        cache.allocate(2)
    with pytest.raises(PagekvError):  # a second release of the same hold is refused
        cache.release([page])
    copy.complete = True
    assert cache.available() == 2 and cache.refcount(page) == 0


def test_ready_events_are_reported_until_done():
    cache = PageCache(HostPagePool(GEO, 2, pin=False))
    (page,) = cache.allocate(1)
    writing = _Event()
    cache.publish(b"r" * 16, page, ready=writing)
    assert cache.ready_events([page]) == [writing]
    writing.complete = True
    assert cache.ready_events([page]) == []


# ---- item 6: bounded waits --------------------------------------------------------------
class _BlackHole:
    """A TCP port that accepts connections and never answers (a hung node)."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self):
        self.sock.close()


def test_lookup_against_a_hung_node_is_bounded(caplog):
    hole = _BlackHole()
    conn = connector(hole.address, caches(), lookup_timeout_s=0.05)
    try:
        tokens = prompt(16)
        conn.save(tokens[:8], torch.arange(8))
        with caplog.at_level("WARNING", logger="pagekv.connector"):
            for _ in range(5):
                t = time.monotonic()
                assert conn.lookup(tokens) == 8  # the host-tier hit, at once
                assert time.monotonic() - t < 0.5  # before: the store's 5 s timeout
        st = conn.stats()
        # no node answered: each lookup a skip (the node's answer bound passed) or, where the
        # client's loop ran late on a loaded machine, a timeout (the lookup's own bound passed)
        assert st["store_errors"] >= 1 and st["lookups_skipped"] + st["lookup_timeouts"] == 5
        # the node that did not answer within the bound is backed off (per node): the later
        # lookups do not wait for it again
        assert 1 <= conn.store.counters["node_failures"] <= 2
        warned = [r for r in caplog.records if "store lookup" in r.getMessage()]
        assert 1 <= len(warned) <= 2  # rate-limited
    finally:
        conn.close(timeout_s=1)
        hole.close()


def test_a_lookup_that_times_out_is_counted_once(monkeypatch):
    """A store answer that comes as the lookup's bound passes (the loop busy until then) is a
    timeout and nothing else: the coroutine finishing after the caller gave up must not count
    the lookup a second time. It did: lookups_skipped and lookup_timeouts both grew by one."""
    hole = _BlackHole()
    index = KVIndex(KeyNamespace("once-model", GEO), hole.address, lookup_timeout_s=0.05)
    try:
        keys = index.keys(prompt(4 * GEO.page_size))

        async def answers_late(keys, *, answer_s):  # holds the loop past the lookup's bound
            time.sleep(0.3)
            return ExistsResult([False] * len(keys), unanswered=len(keys))

        monkeypatch.setattr(index.store, "exists_many", answers_late)
        assert index.lookup_pages(keys) == 0
        index.loop.call(asyncio.sleep(0), 5)  # the late answer has been taken in
        assert {k: index.counters[k] for k in ("lookup_timeouts", "lookups_skipped")} == {
            "lookup_timeouts": 1, "lookups_skipped": 0}  # fmt: skip
        assert index.counters["store_errors"] == 1
    finally:
        index.close()
        hole.close()


def test_lookup_against_a_dead_node_counts_a_store_error():
    """A node that was answering and is killed: once the client knows it is down, it fails the
    lookup's EXISTS at once and reports every key as unanswered. That is a store error, not a
    silent plain miss (the vLLM scheduler's dead-node test saw store_errors stay 0)."""
    node = NodeProcess("--capacity", "16MiB").start()
    cfg = ClientConfig((node.address,), timeout_s=0.2)  # down after 0.2 s without a connection
    conn = connector(cfg, caches(), lookup_timeout_s=0.5)
    try:
        tokens = prompt(16)
        assert conn.lookup(tokens) == 0 and conn.stats()["store_errors"] == 0  # a plain miss
        node.proc.kill()
        node.proc.wait()
        fast: list[float] = []

        def failed_fast_and_counted() -> bool:
            errors, t = conn.stats()["store_errors"], time.monotonic()
            assert conn.lookup(tokens) == 0
            fast.append(time.monotonic() - t)
            return fast[-1] < 0.05 and conn.stats()["store_errors"] == errors + 1

        wait_until(failed_fast_and_counted, timeout=10, what="a fast lookup counted as an error")
    finally:
        conn.close(timeout_s=1)
        node.stop()


def test_a_stopped_node_is_backed_off_alone():
    """One of two nodes stops (SIGSTOP) while its connections stay up: lookups stay within
    their bound and keep hitting on the other node, which holds every key (replicas=2); only
    the stopped node is backed off. Fails on f1eb0b9: after the first lookup timed out, every
    lookup skipped the whole store for a back-off period, so the hits were 0."""
    nodes = [NodeProcess("--capacity", "16MiB").start() for _ in range(2)]
    cfg = ClientConfig(tuple(n.address for n in nodes), replicas=2, timeout_s=5.0)
    ns = KeyNamespace("stop-model", GEO)
    tokens = prompt(8 * GEO.page_size)
    index = KVIndex(ns, cfg, lookup_timeout_s=0.4)
    try:
        with StoreClient(cfg.endpoints, replicas=2) as client:
            keys = index.keys(tokens)[0]
            assert set(client.put_many(keys, [b"v" * 32] * len(keys))) == {Status.OK}
        assert index.lookup(tokens) == len(tokens)
        sigstop(nodes[0].proc.pid)
        try:
            for _ in range(4):
                start = time.monotonic()
                assert index.lookup(tokens) == len(tokens)  # the other node answers
                assert time.monotonic() - start < 2.0  # bounded (the bound is 0.4 s)
        finally:
            os.kill(nodes[0].proc.pid, signal.SIGCONT)
        assert index.store.counters["node_failures"] >= 1
    finally:
        index.close()
        for n in nodes:
            n.stop()


@pytest.mark.parametrize("client_timeout_s", [0.5, 1.0])
def test_unreachable_names_the_nodes_that_do_not_answer(client_timeout_s):
    """Only the dead node is named, also when the bound is the client's own timeout (as an
    engine calls it at start-up). Before: there, the dead node's unanswered PING took the
    whole bound and the live node was named too."""
    live, dead = NodeProcess("--capacity", "16MiB").start(), NodeProcess().start()
    dead.stop()
    index = KVIndex(KeyNamespace("m", GEO), ClientConfig((live.address, dead.address),
                                                        timeout_s=client_timeout_s))  # fmt: skip
    try:
        assert index.unreachable(client_timeout_s) == [dead.address]
        assert not index.connect(5.0)
    finally:
        index.close()
        live.stop()


def test_kv_index_is_the_minimum_over_ranks(node):
    namespaces = [KeyNamespace("tp-model", GEO, r, 2) for r in range(2)]
    tokens = prompt(6 * GEO.page_size)
    kv = caches()
    conns = [KVConnector(GEO, kv, node.address, host_pages=16, namespace=ns) for ns in namespaces]
    try:
        conns[0].save(tokens, torch.arange(len(tokens)))
        conns[1].save(tokens[: 3 * GEO.page_size], torch.arange(3 * GEO.page_size))
        for c in conns:
            c.flush_sync(timeout=30)
        index = KVIndex(namespaces, node.address)
        try:
            assert index.lookup(tokens) == 3 * GEO.page_size
            keys = index.keys(tokens)
            assert index.lookup(keys=keys) == 3 * GEO.page_size
            assert index.lookup(keys=[k[:2] for k in keys]) == 2 * GEO.page_size
        finally:
            index.close()
        with pytest.raises(ConnectorClosed):
            index.lookup(tokens)
    finally:
        for c in conns:
            c.close()


# ---- item 9: lifecycle ------------------------------------------------------------------
def test_failed_constructor_leaks_no_thread(node):
    before = set(threading.enumerate())  # (threads of earlier tests may end meanwhile)
    for _ in range(3):
        with pytest.raises(ValueError, match="max_pending_writes"):
            connector(node.address, caches(), max_pending_writes=0)
    assert not set(threading.enumerate()) - before


def test_dead_writeback_worker_makes_flush_fail_clearly(node):
    conn = connector(node.address, caches())

    async def broken(_keys):
        raise ValueError("unknown status 99 in a reply")  # an unexpected error, not StoreError

    conn.store.exists_many = broken
    try:
        conn.save(prompt(8), torch.arange(8))
        t = time.monotonic()
        with pytest.raises(WriteBackFailed, match="unknown status"):
            conn.flush_sync(timeout=10)  # before: spun until the timeout
        assert time.monotonic() - t < 5
        conn.save(prompt(8), torch.arange(8, 16))  # later saves are kept local, counted
        wait_until(lambda: conn.stats()["writeback_dropped"] == 2, what="the drop")
        assert conn.cache.num_held == 0
    finally:
        conn.close(timeout_s=2)


def test_close_with_the_store_down_is_bounded():
    hole = _BlackHole()
    conn = connector(hole.address, caches())
    try:
        for i in range(4):
            conn.save(prompt(8), torch.arange(8 * i, 8 * i + 8))
        t = time.monotonic()
        conn.close(timeout_s=1.0)
        assert time.monotonic() - t < 8  # before: 30 s, then an exception
        assert conn.closed
        with pytest.raises(ConnectorClosed):
            conn.lookup(prompt(4))
    finally:
        hole.close()


def test_release_right_after_load_is_safe_on_cpu(node):
    tokens, src, slots = stored_prompt(node.address, 4)
    dst = caches(poisoned=True)
    b = connector(node.address, dst, host_pages=4)
    try:
        h = asyncio.run(b.prefetch(tokens))
        layers = b.load_async(h, torch.arange(16))
        b.release(h)
        assert layers.done()
        assert same_rows(dst, torch.arange(16), src, slots)
    finally:
        b.close()


def test_key_based_calls_match_token_calls(node):
    src = caches()
    a = connector(node.address, src)
    try:
        tokens = prompt(12)
        keys = a.keys(tokens)
        assert a.save(keys=keys, device_slots=torch.arange(12)).pages == 3
        assert a.lookup(tokens) == a.lookup(keys=keys) == 12
        h = a.prefetch_sync(keys=keys, timeout_s=5)
        assert h.num_tokens == 12
        a.release(h)
        with pytest.raises(ValueError, match="exactly one"):
            a.lookup(tokens, keys=keys)
    finally:
        a.close()


def test_derived_keys_are_namespaced():
    ns = KeyNamespace("m", GEO)
    other = KeyNamespace("m", GEO, layout="vllm-LBHNC-cpu-vec16")
    hashes = [b"\x01" * 32, b"\x02" * 32]
    assert ns.derive_keys(hashes) != other.derive_keys(hashes)
    assert ns.derive_keys(["ab12"]) == ns.derive_keys([b"ab12"])  # SGLang passes hex str
    assert len(ns.derive_keys(hashes)[0]) == 16
    with pytest.raises(TypeError):
        ns.derive_keys([1])
    with pytest.raises(ValueError):
        ns.derive_keys([b""])
