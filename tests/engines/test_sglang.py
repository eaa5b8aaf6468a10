"""pagekv as SGLang 0.5.23's HiCache L3 backend, driven by SGLang's own classes (issue 11).

Runs in the SGLang venv (``make test-sglang``, which sets PAGEKV_REQUIRE_SGLANG=1: there a
missing SGLang fails the run). In the main venv, without SGLang, the module is skipped.
Every test talks to real ``pagekv serve`` processes on loopback.

SGLang code these tests run, unmodified: ``StorageBackendFactory`` ("dynamic", and its fault
injector); the MHA and MLA host pools (every layout pagekv stores; their page metadata,
``get_data_page``/``set_from_flat_data_page`` as the byte oracle); ``HiCacheController``'s
``attach_storage_backend`` (storage config from ranks and device-pool type, the interface_v1
switch, the four storage threads), ``prefetch`` → ``_storage_hit_query`` (``batch_exists`` per
128 pages) → hit reduction → ``_page_transfer`` (``batch_get_v1``, or legacy ``batch_get`` +
``set_from_flat_data_page``) → ack reduction, ``write_storage`` → backup thread
(``backup_skip`` on MLA non-writer ranks, ``batch_set_v1`` or legacy ``batch_set``), and
``detach_storage_backend`` (``close``); SGLang's own page hashes (``get_storage_hash_str``).

Not run here: GPU ⇄ host transfers (SGLang's kernels, pinned memory), the radix cache's
decisions (prefetch threshold and host-capacity limits, prefetch policies and termination,
existence cache), cross-rank reductions with more than one process (ranks are set with
SGLang's parallel-context overrides in one process), hybrid models (v2 calls, refused at
start-up), and a real ``sglang.launch_server``.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PAGEKV_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="SGLang lives in its own venv: make test-sglang")

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from pagekv.connector.sglang import PagekvStorage
from pagekv.errors import ConfigError
from pagekv.store import StoreClient
from pagekv.store.client.routing import Router
from pagekv.store.launch import NodeProcess, start_nodes
from tests.engines import sglang_harness as h

ROOT = str(Path(__file__).resolve().parents[2])

CASES = [("mha", layout) for layout in h.MHA_LAYOUTS] + [
    ("mla", layout) for layout in h.MLA_LAYOUTS
]


@pytest.fixture(scope="module")
def node():
    (n,) = start_nodes(1, "--capacity", "512MiB")
    yield n
    n.stop()


@pytest.fixture
def gen(request) -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)


def make_pool(kind: str, layout: str, pages: int, **kw):
    return (h.mla_pool if kind == "mla" else h.mha_pool)(layout, pages=pages, **kw)


def stored_prompt(ctl: h.Controller, pages: int, gen: torch.Generator):
    """Fresh random pages backed up through the controller: (tokens, host slots, bytes)."""
    pool = ctl.pool
    tokens = h.random_tokens(pages * pool.page_size, gen)
    src = pool.alloc(len(tokens))
    h.fill_random(pool, src, gen)
    assert ctl.backup(src, tokens) == len(tokens)
    return tokens, src, h.page_bytes(pool, src)


# ---- 1. SGLang's factory, host pools and controller threads ---------------------------------
@pytest.mark.parametrize(("kind", "layout"), CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_controller_backup_and_prefetch(node, gen, kind, layout):
    """Factory-built backend, SGLang's host pool for ``layout``, SGLang's controller threads:
    backups and prefetches (more than one 128-page batch, a partial prefix, a miss) run at
    once; every loaded page equals what was backed up, byte for byte."""
    pool = make_pool(kind, layout, pages=1200)
    ctl = h.Controller(pool, h.extra_config([node.address]), mla=kind == "mla")
    try:
        backend = ctl.backend
        assert isinstance(backend, PagekvStorage)
        assert ctl.ctl.page_get_func == ctl.ctl._page_get_zero_copy  # interface_v1 honoured
        tokens_a, _, ref_a = stored_prompt(ctl, 150, gen)
        tokens_b = h.random_tokens(150 * pool.page_size, gen)
        src_b = pool.alloc(len(tokens_b))
        h.fill_random(pool, src_b, gen)
        ref_b = h.page_bytes(pool, src_b)
        head = 37 * pool.page_size
        partial = tokens_a[:head] + h.random_tokens(20 * pool.page_size, gen)
        results: dict[str, object] = {}

        def run(name, fn, *args):
            results[name] = fn(*args)

        jobs = [("backup_b", ctl.backup, src_b, tokens_b), ("full", ctl.prefetch, tokens_a),
                ("again", ctl.prefetch, tokens_a), ("partial", ctl.prefetch, partial),
                ("miss", ctl.prefetch, h.random_tokens(8 * pool.page_size, gen))]  # fmt: skip
        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=2 * h.WAIT_S)
        assert set(results) == {name for name, *_ in jobs}, "a controller call never returned"
        assert results["backup_b"] == len(tokens_b)
        for name in ("full", "again"):
            loaded, host = results[name]
            assert loaded == len(tokens_a)
            assert h.page_bytes(pool, host) == ref_a
        loaded, host = results["partial"]
        assert loaded == head
        assert h.page_bytes(pool, host) == ref_a[:37]
        assert results["miss"] == (0, None)
        loaded, host = ctl.prefetch(tokens_b)
        assert loaded == len(tokens_b) and h.page_bytes(pool, host) == ref_b
        stats = backend.stats()
        assert stats["get"].get("errors", 0) == stats["set"].get("errors", 0) == 0
        assert stats["set"]["stored"] == 300 and stats["get"]["hits"] == 150 * 3 + 37
    finally:
        ctl.close()


def test_three_threads_hammer_one_backend(node, gen):
    """The three controller calls from three threads at once, many times: each thread gets
    right answers (its own store client; ZeroMQ sockets are never shared)."""
    pool = h.mha_pool("page_first", pages=400)
    backend = PagekvStorage(h.storage_config(h.extra_config([node.address])), {})
    backend.register_mem_pool_host(pool)
    ps, rounds = pool.page_size, 25
    tokens = h.random_tokens(64 * ps, gen)
    src = pool.alloc(len(tokens))
    h.fill_random(pool, src, gen)
    keys, ref = h.page_hashes(tokens, ps), h.page_bytes(pool, src)
    assert all(backend.batch_set_v1(keys, src))
    fresh = [pool.alloc(8 * ps) for _ in range(rounds)]
    for idx in fresh:
        h.fill_random(pool, idx, gen)
    dst = pool.alloc(len(tokens))
    failures: list[str] = []
    barrier = threading.Barrier(3)

    def setter():
        barrier.wait()
        for r, idx in enumerate(fresh):
            new_keys = h.page_hashes(h.random_tokens(8 * ps, gen_for(r)), ps)
            if not all(backend.batch_set_v1(new_keys, idx)):
                failures.append(f"set round {r}")

    def exister():
        barrier.wait()
        for r in range(rounds * 4):
            if backend.batch_exists(keys) != len(keys):
                failures.append(f"exists round {r}")

    def getter():
        barrier.wait()
        for r in range(rounds):
            h.poison(pool, dst)
            if not all(backend.batch_get_v1(keys, dst)) or h.page_bytes(pool, dst) != ref:
                failures.append(f"get round {r}")

    seeds = torch.randint(0, 1 << 30, (rounds,), generator=gen).tolist()

    def gen_for(r):
        return torch.Generator().manual_seed(seeds[r])

    threads = [threading.Thread(target=f) for f in (setter, exister, getter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    stats = backend.stats()
    assert stats["max_in_flight"] >= 2, stats
    backend.close()


LEGACY_CASES = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_head"),
                ("mla", "layer_first"), ("mla", "page_first")]  # fmt: skip


@pytest.mark.parametrize(("kind", "layout"), LEGACY_CASES)
def test_legacy_interface_reads_zero_copy_pages_and_back(node, gen, kind, layout):
    """Without ``interface_v1`` SGLang's controller copies flat pages (``batch_get`` /
    ``batch_set``). Those are the same keys and values as the zero-copy path's: a page backed
    up by either is prefetched by both, byte for byte."""
    legacy_extra = h.extra_config([node.address])
    del legacy_extra["interface_v1"]
    mla = kind == "mla"
    legacy = h.Controller(make_pool(kind, layout, 200), legacy_extra, mla=mla)
    zero = h.Controller(make_pool(kind, layout, 200), h.extra_config([node.address]), mla=mla)
    try:
        assert legacy.ctl.page_get_func == legacy.ctl._generic_page_get
        by_legacy = stored_prompt(legacy, 20, gen)
        by_zero = stored_prompt(zero, 20, gen)
        for ctl, (tokens, _, ref) in [(zero, by_legacy), (legacy, by_zero), (legacy, by_legacy)]:
            loaded, host = ctl.prefetch(tokens)
            assert loaded == len(tokens)
            assert h.page_bytes(ctl.pool, host) == ref
        backend, pool = legacy.backend, legacy.pool
        keys = h.page_hashes(by_zero[0], pool.page_size)
        assert backend.exists(keys[3]) and not backend.exists("f" * 64)
        assert h.flat_bytes(backend.get(keys[3])) == by_zero[2][3]
        assert backend.get("f" * 64) is None
        page = pool.get_dummy_flat_data_page()
        page.view(torch.uint8).copy_(torch.randint(0, 256, (page.nbytes,), generator=gen))
        assert backend.set("e" * 64, page) and backend.exists("e" * 64)
        assert h.flat_bytes(backend.get("e" * 64)) == h.flat_bytes(page)
    finally:
        legacy.close()
        zero.close()


def test_tp_ranks_mla_shares_pages_and_rank0_writes(node, gen):
    """MLA (rank-replicated): SGLang's controller skips backups on TP rank 1, and rank 1 reads
    rank 0's pages. MHA: each rank has its own pages."""
    rank1 = h.Controller(h.mla_pool("page_first", pages=100), h.extra_config([node.address]),
                         mla=True, tp_rank=1, tp_size=2)  # fmt: skip
    rank0 = h.Controller(h.mla_pool("page_first", pages=100), h.extra_config([node.address]),
                         mla=True, tp_rank=0, tp_size=2)  # fmt: skip
    mha1 = h.Controller(h.mha_pool("page_first", pages=100), h.extra_config([node.address]),
                        tp_rank=1, tp_size=2)  # fmt: skip
    mha0 = h.Controller(h.mha_pool("page_first", pages=100), h.extra_config([node.address]),
                        tp_rank=0, tp_size=2)  # fmt: skip
    try:
        tokens = h.random_tokens(12 * rank1.pool.page_size, gen)
        src = rank1.pool.alloc(len(tokens))
        h.fill_random(rank1.pool, src, gen)
        assert rank1.backup(src, tokens) == 0  # not the storage writer: nothing sent
        assert rank1.backend.batch_exists(h.page_hashes(tokens, 8)) == 0
        tokens, _, ref = stored_prompt(rank0, 12, gen)
        loaded, host = rank1.prefetch(tokens)
        assert loaded == len(tokens) and h.page_bytes(rank1.pool, host) == ref
        tokens, _, ref = stored_prompt(mha0, 12, gen)
        assert mha1.prefetch(tokens) == (0, None)
        loaded, host = mha0.prefetch(tokens)
        assert loaded == len(tokens) and h.page_bytes(mha0.pool, host) == ref
    finally:
        for ctl in (rank1, rank0, mha1, mha0):
            ctl.close()


def test_calls_never_raise_and_bad_config_is_a_typed_error(node, gen):
    """Bad extra config: ConfigError at start-up (SGLang refuses to start, naming it). Bad
    calls at run time: False / 0 / None, counted, never an exception."""
    pool = h.mha_pool("page_first", pages=40)
    for bad in ({"store": []}, {"store": "http://x"}, {"replicas": 2}, {"timeout_s": 0},
                {"down_backoff_s": [2, 1]}, {"skip_existing": "yes"}):  # fmt: skip
        with pytest.raises(ConfigError):
            h.make_backend(pool, h.extra_config([node.address]) | bad)
    extra = h.extra_config([node.address])
    del extra["store"]
    with pytest.raises(ConfigError, match="store"):
        h.make_backend(pool, extra)
    backend = PagekvStorage(h.storage_config(h.extra_config([node.address])), {})
    keys = h.page_hashes(h.random_tokens(4 * pool.page_size, gen), pool.page_size)
    idx = pool.alloc(4 * pool.page_size)
    assert backend.batch_get_v1(keys, idx) == [False] * 4  # no host pool registered yet
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(keys, idx[:-1]) == [False] * 4  # slots for 3.9 pages
    assert backend.batch_set_v1([*keys[:2], None, 7], idx) == [False] * 4  # not page hashes
    assert backend.batch_get(keys, [None]) == [None] * 4
    assert backend.batch_set(keys, None) is False
    assert backend.batch_exists([]) == 0 and backend.batch_get_v1([], idx[:0]) == []
    stats = backend.stats()
    assert stats["get"]["errors"] == 2 and stats["set"]["errors"] == 2
    assert all(backend.batch_set_v1(keys, idx))  # still serving
    backend.close()
    assert backend.batch_exists(keys) == 0 and backend.batch_get_v1(keys, idx) == [False] * 4


def test_clear_and_stats(node, gen):
    """clear(): the pages stored so far are no longer seen by this backend; new ones are.
    get_stats(): SGLang's StorageMetrics, with pagekv's counters attached."""
    pool = h.mha_pool("page_first", pages=64)
    backend = h.make_backend(pool, h.extra_config([node.address]))
    ps = pool.page_size
    keys = h.page_hashes(h.random_tokens(8 * ps, gen), ps)
    src, dst = pool.alloc(8 * ps), pool.alloc(8 * ps)
    h.fill_random(pool, src, gen)
    assert all(backend.batch_set_v1(keys, src)) and backend.batch_exists(keys) == 8
    metrics = backend.get_stats()
    assert type(metrics).__name__ == "StorageMetrics"
    assert metrics.backup_pgs == [8] and metrics.backup_bandwidth[0] > 0
    assert metrics.pagekv["set"]["stored"] == 8 and metrics.pagekv["set"]["bytes"] > 0
    assert backend.get_stats().backup_pgs == []  # samples are drained, counters are not
    backend.clear()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, dst) == [False] * 8
    assert all(backend.batch_set_v1(keys, src))
    h.poison(pool, dst)
    assert all(backend.batch_get_v1(keys, dst))
    assert h.page_bytes(pool, dst) == h.page_bytes(pool, src)
    stats = backend.stats()
    assert stats["epoch"] == 1 and stats["get"]["hits"] == 8 and stats["get"]["misses"] == 8
    backend.close()


# ---- 2. two processes: same format hits, another layout or dtype misses ---------------------
def test_two_processes_share_pages_only_in_one_format(node, gen, tmp_path):
    """Process A backs pages up (page_first, bf16). This process, with its own host pools,
    prefetches them: identical bytes in the same format; another layout of the same dtype and
    page size, another dtype of the same size, another model or TP rank: a miss, and the
    poisoned pages stay as they were (never garbage)."""
    seed, out = int(torch.randint(0, 1 << 30, (1,), generator=gen)), tmp_path / "written"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tests.engines.sglang_writer", "--store", node.address,
           "--layout", "page_first", "--dtype", "bfloat16", "--pages", "40", "--seed", str(seed),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(out.with_suffix(".json").read_text())
    blob, size = out.with_suffix(".bin").read_bytes(), meta["page_bytes"]
    tokens, ref = meta["tokens"], [blob[i : i + size] for i in range(0, len(blob), size)]
    assert meta["written"] == len(tokens) and len(ref) == 40

    ctl = h.Controller(h.mha_pool("page_first", pages=100), h.extra_config([node.address]))
    try:
        loaded, host = ctl.prefetch(tokens)
        assert loaded == len(tokens) and h.page_bytes(ctl.pool, host) == ref
    finally:
        ctl.close()
    others = [("page_first_direct", torch.bfloat16, {}), ("page_head", torch.bfloat16, {}),
              ("layer_first", torch.bfloat16, {}), ("page_first", torch.float16, {}),
              ("page_first", torch.bfloat16, {"model": "other-model"}),
              ("page_first", torch.bfloat16, {"tp_rank": 0, "tp_size": 2})]  # fmt: skip
    for layout, dtype, config in others:
        pool = h.mha_pool(layout, pages=100, dtype=dtype)
        ctl = h.Controller(pool, h.extra_config([node.address]), **config)
        try:
            assert ctl.prefetch(tokens) == (0, None), (layout, dtype, config)
            dst = pool.alloc(len(tokens))
            h.poison(pool, dst)
            before = h.page_bytes(pool, dst)
            keys = h.page_hashes(tokens, pool.page_size)
            assert ctl.backend.batch_get_v1(keys, dst) == [False] * len(keys)
            assert h.page_bytes(pool, dst) == before
        finally:
            ctl.close()


# ---- 3. failures ------------------------------------------------------------------------------
def test_node_killed_mid_batch(gen):
    """Two nodes, one page copy each. A node stopped then killed while a batch_get_v1 and a
    batch_set_v1 are in flight: its pages are False (left untouched), the other node's pages
    arrive, no exception, within the time bound; a page the write reports stored reads back
    right; later writes fail over. Every node down: after one bounded call, calls
    answer at once. A node back on its port: the first backend works again."""
    nodes = start_nodes(2, "--capacity", "128MiB")
    try:
        extra = h.extra_config([n.address for n in nodes], timeout_s=1.0)
        pool = h.mha_pool("page_first", pages=300)
        backend = h.make_backend(pool, extra)
        ps, n = pool.page_size, 64
        tokens = h.random_tokens(n * ps, gen)
        src, dst = pool.alloc(n * ps), pool.alloc(n * ps)
        h.fill_random(pool, src, gen)
        keys, ref = h.page_hashes(tokens, ps), h.page_bytes(pool, src)
        assert all(backend.batch_set_v1(keys, src))
        router = Router([nd.address for nd in nodes], 1, (0.25, 8.0))
        on_live = [router.ranking(k)[0] == 0 for k in backend.store_keys(keys)]
        assert 0 < sum(on_live) < n
        h.poison(pool, dst)
        poisoned = h.page_bytes(pool, dst)

        busy_tokens = h.random_tokens(n * ps, gen)
        busy = pool.alloc(n * ps)
        h.fill_random(pool, busy, gen)
        busy_keys, busy_ref = h.page_hashes(busy_tokens, ps), h.page_bytes(pool, busy)

        nodes[1].proc.send_signal(signal.SIGSTOP)
        result: dict = {}
        calls = {"get": lambda: backend.batch_get_v1(keys, dst),
                 "set": lambda: backend.batch_set_v1(busy_keys, busy)}  # fmt: skip
        workers = [threading.Thread(target=lambda k=k: result.update({k: calls[k]()}))
                   for k in calls]  # fmt: skip
        start = time.monotonic()
        for w in workers:
            w.start()
        wait_for(lambda: backend.stats()["in_flight"] >= 2, 5.0)
        nodes[1].kill()
        for w in workers:
            w.join(timeout=10)
        assert not any(w.is_alive() for w in workers)
        assert time.monotonic() - start < 3 * 1.0 + 2.0  # a write: EXISTS, then PUT
        assert result["get"] == on_live
        got = h.page_bytes(pool, dst)
        assert [g == (r if live else p) for g, r, p, live in zip(got, ref, poisoned, on_live)] == [
            True
        ] * n
        assert backend.batch_exists(keys) == on_live.index(False)
        stored = result["set"]  # pages the dead node was to take went to the live one, or False
        h.poison(pool, dst)
        assert backend.batch_get_v1(busy_keys, dst) == stored
        assert [g == r for g, r, ok in zip(h.page_bytes(pool, dst), busy_ref, stored) if ok] == [
            True
        ] * sum(stored)
        fresh_tokens = h.random_tokens(16 * ps, gen)
        fresh = pool.alloc(16 * ps)
        h.fill_random(pool, fresh, gen)
        assert all(backend.batch_set_v1(h.page_hashes(fresh_tokens, ps), fresh))  # failover

        nodes[0].kill()
        # every node gone: a backend that finds so answers "miss" at once while it backs off
        gated = h.make_backend(pool, dict(extra, down_backoff_s=[30.0, 60.0]))
        start = time.monotonic()
        assert gated.batch_exists(keys) == 0  # one round trip to both nodes, bounded
        assert time.monotonic() - start < 1.0 + 2.0
        before = h.page_bytes(pool, dst)
        start = time.monotonic()
        assert gated.batch_exists(keys) == 0
        assert gated.batch_get_v1(keys, dst) == [False] * n
        assert gated.batch_set_v1(keys, src) == [False] * n
        assert time.monotonic() - start < 0.5
        assert gated.stats()["get"]["store_down"] == n
        assert h.page_bytes(pool, dst) == before
        gated.close()

        nodes[0] = NodeProcess("--capacity", "128MiB", port=nodes[0].port).start()
        wait_for(lambda: all(backend.batch_set_v1(keys, src)), 30.0)
        h.poison(pool, dst)
        assert all(backend.batch_get_v1(keys, dst)) and h.page_bytes(pool, dst) == ref
        assert backend.stats()["get"].get("errors", 0) == 0  # failures were misses, not errors
    finally:
        for nd in nodes:
            nd.stop()


def test_sglang_fault_injector_keeps_data_correct(node, gen, monkeypatch):
    """SGLang's own injector (SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE=0.1) fails one call
    in ten: backups and prefetches come up short, and every page they do report is right."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.1")
    pool = h.mha_pool("page_first", pages=16 * 300 * 2 + 100, layers=2, head_dim=8, page_size=4)
    ctl = h.Controller(pool, h.extra_config([node.address]))
    try:
        assert type(ctl.backend).__name__ == "HiCacheStorageFailureInjector"
        assert isinstance(ctl.backend._backend, PagekvStorage)
        short = 0
        for _ in range(16):
            tokens = h.random_tokens(300 * pool.page_size, gen)
            src = pool.alloc(len(tokens))
            h.fill_random(pool, src, gen)
            ref = h.page_bytes(pool, src)
            written = ctl.backup(src, tokens)
            loaded, host = ctl.prefetch(tokens)
            assert loaded <= written and loaded % pool.page_size == 0
            pages = loaded // pool.page_size
            if pages:
                assert h.page_bytes(pool, host[: pages * pool.page_size]) == ref[:pages]
            short += loaded < len(tokens)
        assert short > 0  # the injector did fire (P(no failure in ~140 calls) < 1e-6)
    finally:
        ctl.close()


# ---- 4. throughput ------------------------------------------------------------------------------
def test_batch_get_v1_throughput_vs_store_client(gen):
    """batch_get_v1 into a 2 GiB SGLang host pool against StoreClient.get_many of the same
    keys into the same page regions, same run: >= 0.9. After a checked round (poisoned pages,
    then digests), each 512 MiB batch is timed per side, interleaved, in alternating order; the
    sums of the per-batch bests compare. On a shared machine single timings swing by 2x, so
    the bests are taken over 6 rounds, and over up to 12 while the ratio is below the bar: the
    bests only tighten towards the uncontended times, so a real gap still fails."""
    (big,) = start_nodes(1, "--capacity", "3GiB")
    try:
        pool = h.mha_pool("page_first", pages=512, layers=32, heads=8, head_dim=128,
                          page_size=32)  # fmt: skip
        assert pool.kv_buffer.nbytes == 2 << 30
        backend = h.make_backend(pool, h.extra_config([big.address]))
        ps, n = pool.page_size, 512
        host = pool.alloc(n * ps)
        pool.kv_buffer.view(torch.int64).random_(generator=gen)
        keys = h.page_hashes(h.random_tokens(n * ps, gen), ps)
        batches = [(keys[i : i + 128], host[i * ps : (i + 128) * ps]) for i in range(0, n, 128)]
        for batch_keys, idx in batches:
            assert all(backend.batch_set_v1(batch_keys, idx))
        ref = h.page_digests(pool, host)
        base = memoryview(pool.kv_buffer.view(-1).view(torch.uint8).numpy())
        client = StoreClient(big.address)

        def regions(idx):  # the same page regions, made here from SGLang's page meta
            ptrs, sizes = pool.get_page_buffer_meta(idx)
            views = [base[p - pool.kv_buffer.data_ptr() :][:s] for p, s in zip(ptrs, sizes)]
            return [views[i : i + 2] for i in range(0, len(views), 2)]

        plain = [(backend.store_keys(bk), regions(idx)) for bk, idx in batches]
        calls = {
            "backend": lambda b: backend.batch_get_v1(*batches[b]),
            "client": lambda b: client.get_many(plain[b][0], into=plain[b][1]),
        }
        for b, (_, idx) in enumerate(batches):  # correctness (and warm-up), untimed
            for name in calls:
                tokens = slice(int(idx[0]), int(idx[-1]) + 1)
                pool.kv_buffer[:, tokens].view(torch.int16).fill_(0x5A5A)  # poison K and V
                assert all(calls[name](b))
                assert h.page_digests(pool, idx) == ref[b * 128 : (b + 1) * 128]
        best = {name: [float("inf")] * len(batches) for name in calls}
        cpu = dict.fromkeys(calls, 0.0)
        rounds, ratio = 0, 0.0
        while rounds < 6 or (ratio < 0.9 and rounds < 12):  # see the docstring
            for b in range(len(batches)):
                for name in sorted(calls, reverse=rounds % 2 == 1):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    ok = calls[name](b)
                    best[name][b] = min(best[name][b], time.perf_counter() - start)
                    cpu[name] += time.process_time() - start_cpu
                    assert all(ok)
            rounds += 1
            ratio = sum(best["client"]) / sum(best["backend"])
        client.close()
        gib = pool.kv_buffer.nbytes / (1 << 30)
        backend_s, client_s = sum(best["backend"]), sum(best["client"])
        print(f"\nbatch_get_v1 {gib / backend_s:.2f} GiB/s, StoreClient.get_many "
              f"{gib / client_s:.2f} GiB/s, ratio {ratio:.3f} (best of {rounds} per batch; "
              f"process CPU {cpu['backend']:.1f} s vs {cpu['client']:.1f} s)")  # fmt: skip
        assert ratio >= 0.9
    finally:
        big.stop()


def wait_for(ready, timeout_s: float) -> None:
    """Poll ``ready()`` until true, at most ``timeout_s`` (state waits, not sleeps)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {timeout_s} s")
        time.sleep(0.01)
