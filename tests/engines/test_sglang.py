"""pagekv as SGLang 0.5.23's HiCache storage backend, through SGLang's own start-up and serving
path (issue 27). Runs in the SGLang venv (``make test-sglang``, which sets
PAGEKV_REQUIRE_SGLANG=1: there a missing SGLang fails the run); skipped without SGLang.

Every cache is built as the server builds it (tests/engines/sglang_stack.py): the README's
launch line parsed by SGLang's own ``prepare_server_args``, the model runner's pool builder,
the scheduler's ``build_kv_cache`` → ``create_tree_cache`` → ``UnifiedRadixCache.init_hicache``
→ ``attach_hybrid_pool_to_unified_cache`` → the stack strategy (plain KV, SWA, Mamba) →
``HybridCacheController`` → SGLang's backend factory (``dynamic``) → ``PagekvStorage``, against
real ``pagekv serve`` nodes. Requests are driven with the scheduler's own calls (prefix match,
slot allocation, ``release_kv_cache`` write-through and write-back to storage, the storage
prefetch, ``check_prefetch_progress``, ``PrefillAdder.add_one_req`` load-back). Stubbed, because
a CPU-only machine cannot run them (sglang_stack's docstring): the model forward (random bytes
where it writes), SGLang's CUDA device⇄host copy kernels (byte-for-byte torch stand-ins),
pinned memory, process groups (one rank), the model runner object that hands the pools over.

Exercised: start-up of plain MHA (4 host layouts), plain MLA (3), SWA-hybrid (GPT-OSS-like) and
Mamba-hybrid (Qwen3-Next-like) stacks; v1 (KV) and v2 (SWA, Mamba sidecars) backend calls from
SGLang's controller threads; the three prefetch policies and ``hicache_storage_pass_prefix_keys``;
the legacy (non-``interface_v1``) calls; two processes; a node stopped and killed mid-batch;
SGLang's fault injector; a pool that cannot be stored; TP ranks, DeepSeek-V4's logical KV anchor
with a side pool, and an MLA model's MHA draft pool (backend level, on SGLang's own pool classes:
no CPU builder makes those stacks). Not exercised here: real GPU copies, TP/PP > 1 process
groups, DSA stacks, ``buffer_only`` host memory.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PAGEKV_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="SGLang lives in its own venv: make test-sglang")

import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import xxhash

from pagekv.connector.sglang import PagekvStorage
from pagekv.errors import ConfigError
from pagekv.store import StoreClient
from pagekv.store.client.routing import Router
from pagekv.store.launch import NodeProcess, start_nodes
from tests.engines import sglang_stack as st
from tests.helpers import sigstop

ROOT = str(Path(__file__).resolve().parents[2])
TEST_EXTRA = {"prefetch_threshold": 1}  # SGLang prefetches from 256 tokens by default
LAYOUTS = {"mha": ("page_first", "page_first_direct", "page_head", "layer_first"),
           "mla": ("page_first", "page_first_direct", "layer_first")}  # fmt: skip
ROUND_TRIPS = [(kind, layout) for kind in ("mha", "mla") for layout in LAYOUTS[kind]]
ROUND_TRIPS += [("swa", "page_first"), ("mamba", "page_first")]
POOLS = {"mha": {"kv"}, "mla": {"kv"}, "swa": {"kv", "swa"}, "mamba": {"kv", "mamba"}}


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


@pytest.fixture
def stacks(tmp_path):
    """``make(kind, stores, **launch)``: a stack built from the README's launch line; every
    one still open is closed (its storage backend detached) when the test ends."""
    made: list[st.Stack] = []

    def make(kind, stores, *, extra=None, page_size=None, max_total_tokens=1024, **launch):
        model_dir = st.write_model_config(tmp_path / f"model-{kind}", kind)
        flags = st.launch_flags(model_dir, stores, extra={**TEST_EXTRA, **(extra or {})},
                                **launch)  # fmt: skip
        args = st.server_args(model_dir, flags, page_size=page_size)
        stack = st.build_cache(kind, args, max_total_tokens=max_total_tokens)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        if stack.cache.enable_storage:
            stack.close()


def backend_of(stack: st.Stack) -> PagekvStorage:
    """The stack's pagekv backend (inside SGLang's fault injector when that is on)."""
    backend = stack.storage_backend
    backend = getattr(backend, "_backend", backend)
    assert isinstance(backend, PagekvStorage)
    return backend


def random_tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, 500, (n,), generator=gen).tolist()


def close(stack: st.Stack) -> None:
    stack.close()


def assert_rows(written_state: st.State, read: st.Read, lo: int = 0, hi: int | None = None):
    """Every row ``read`` loaded at prompt positions ``lo <= p < hi`` (default: all) equals the
    written one; a region may be absent only when nothing was loaded at all (a request whose
    prefix storage could not serve)."""
    state = {name: (positions, rows) if positions is None else
             _between(positions, rows, lo, len(written_state[name][1]) if hi is None else hi)
             for name, (positions, rows) in read.state.items()}  # fmt: skip
    problems = st.mismatches(written_state, state)
    if read.loaded_tokens == 0 and read.device_hit_tokens == 0:
        problems = [p for p in problems if not p.endswith("written, not loaded")]
    assert problems == []


def _between(positions: torch.Tensor, rows: torch.Tensor, lo: int, hi: int):
    keep = (positions >= lo) & (positions < hi)
    return positions[keep], rows[keep]


# ---- 1. the server's start-up path --------------------------------------------------------------
@pytest.mark.parametrize("kind", st.KINDS)
def test_readme_launch_line_starts_with_pagekv_attached(node, stacks, kind):
    """The README's launch line, parsed by SGLang, builds the server's cache with pagekv as
    its storage tier: every pool of the model's stack stored, none refused, one start-up
    line. Fails on f1eb0b9 for every kind: the server's HybridCacheController registers the KV
    anchor through ``register_mem_host_pool_v2``, where pagekv raised ConfigError."""
    with backend_log() as lines:
        stack = stacks(kind, [node.address])
    assert type(stack.controller).__name__ == "HybridCacheController"
    backend = backend_of(stack)
    stats = backend.stats()
    assert stats["off"] is None
    assert set(stats["pools"]) == POOLS[kind] == set(stack.host_pools)
    assert stack.controller.page_get_func == stack.controller._page_get_zero_copy  # interface_v1
    assert len(lines) == 1 and lines[0].startswith("pagekv: storing kv (")


# ---- 2. a prompt through the stored tier, page for page --------------------------------------
@pytest.mark.parametrize(("kind", "layout"), ROUND_TRIPS, ids=[f"{k}-{v}" for k, v in ROUND_TRIPS])
def test_prompt_written_by_one_server_loads_in_a_fresh_one(node, stacks, gen, kind, layout):
    """Server A prefills a prompt (random device KV and state), finishes it: SGLang writes it
    through to host and back to pagekv. Server B (fresh cache, own backend and client) gets
    the prompt: SGLang's storage prefetch brings every page, the load-back puts them on its
    poisoned device, and every loaded row (KV, SWA window, Mamba state) equals A's. A third
    server given half the prompt and a new tail loads the stored half (Mamba: nothing, its
    state exists only where A's request ended, and trailing_pages says so)."""
    page = st.DEFAULT_PAGE_SIZE[kind]
    tokens = random_tokens(96, gen)
    writer = stacks(kind, [node.address], layout=layout)
    written = st.write_request(writer, tokens, generator=gen)
    assert written.stored_pages == len(tokens) // page
    close(writer)

    reader = stacks(kind, [node.address], layout=layout)
    read = st.read_request(reader, tokens)
    assert read.storage_tokens == len(tokens) and read.loaded_tokens == len(tokens)
    assert_rows(written.state, read)
    if kind == "swa":  # the sliding window's rows came back too, not only the full layers
        positions = read.state["swa.k.L0"][0].tolist()
        assert positions and positions[-1] == len(tokens) - 1
    assert backend_of(reader).stats()["get"].get("errors", 0) == 0
    close(reader)

    half = len(tokens) // 2
    other = stacks(kind, [node.address], layout=layout)
    partial = st.read_request(other, tokens[:half] + random_tokens(half, gen))
    assert partial.storage_tokens == (0 if kind == "mamba" else half)
    assert_rows(written.state, partial)


@pytest.fixture(params=["memory", "disk"])
def any_node(request, node, tmp_path):
    """The module's node, or a node with 1 MiB of memory and a disk tier (``--disk``) of
    eight 1 MiB segments."""
    if request.param == "memory":
        yield node
        return
    disk = NodeProcess("--capacity", "1MiB", "--max-block-size", "256KiB", "--disk",
                       str(tmp_path / "disk"), "--disk-capacity", "8MiB",
                       "--disk-segment-size", "1MiB").start()  # fmt: skip
    try:
        yield disk
    finally:
        disk.stop()


def test_prompt_longer_than_a_storage_batch(any_node, stacks, gen):
    """SGLang moves pages in batches of 128 (STORAGE_BATCH_SIZE): 200 pages all arrive. With a
    node's disk tier: two prompts of 250 pages (1.6 MB, more than its memory) written, the
    first (by then partly on disk) all arrives."""
    node = any_node
    disk = "--disk" in node.args
    pages = 250 if disk else 200
    tokens = random_tokens(pages * 8, gen)
    writer = stacks("mha", [node.address], page_size=8, max_total_tokens=4096)
    written = st.write_request(writer, tokens, generator=gen)
    assert written.stored_pages == pages
    if disk:
        later = st.write_request(writer, random_tokens(pages * 8, gen), generator=gen)
        assert later.stored_pages == pages
    close(writer)
    reader = stacks("mha", [node.address], page_size=8, max_total_tokens=4096)
    read = st.read_request(reader, tokens)
    assert read.storage_tokens == len(tokens)
    assert_rows(written.state, read)
    if disk:
        with StoreClient([node.address]) as c:
            assert c.stats()[0]["disk_hits"] > 0


@pytest.fixture(params=["pagekv", "mooncake"])
def store(request):
    """The address of a store of each backend: the module's pagekv node, or a Mooncake Store
    (master and store processes, TCP; tests/conftest.py)."""
    if request.param == "pagekv":
        return request.getfixturevalue("node").address
    return request.getfixturevalue("mooncake").address


def test_two_processes(store, stacks, tmp_path):
    """Another process writes one prompt per kind through the README's launch line; this one
    loads each, byte for byte; with each store backend."""
    out = tmp_path / "written"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tests.engines.sglang_stack", "write", "--kinds", *st.KINDS,
           "--store", store, "--extra", json.dumps(TEST_EXTRA), "--out", str(out),
           "--tokens", "96", "--seed", str(int.from_bytes(os.urandom(3), "little"))]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind in st.KINDS:
        written = torch.load(f"{out}.{kind}.pt")
        read = st.read_request(stacks(kind, [store]), written["tokens"])
        assert read.storage_tokens == 96, kind
        assert_rows(written["state"], read)


# ---- 3. SGLang's prefetch policies --------------------------------------------------------------
POLICIES = [(policy, keys) for policy in ("timeout", "wait_complete", "best_effort")
            for keys in (False, True)]  # fmt: skip


@pytest.mark.parametrize(("policy", "prefix_keys"), POLICIES)
def test_prefetch_policies_and_prefix_keys(node, stacks, gen, policy, prefix_keys):
    """Each ``--hicache-storage-prefetch-policy``, with and without
    ``hicache_storage_pass_prefix_keys``: a reader that holds the first half of a stored
    prompt prefetches the rest (prefix keys passed along when asked for: pagekv's keys are
    SGLang's chained page hashes, so they need none). ``timeout`` and ``wait_complete`` bring
    every page; ``best_effort`` takes what has arrived when the request is scheduled: any
    whole-page count, every loaded row right."""
    tokens = random_tokens(128, gen)
    extra = {"hicache_storage_pass_prefix_keys": prefix_keys}
    written = st.write_request(stacks("mha", [node.address], extra=extra, prefetch_policy=policy),
                               tokens, generator=gen)  # fmt: skip
    reader = stacks("mha", [node.address], extra=extra, prefetch_policy=policy)
    assert reader.cache.hicache_storage_pass_prefix_keys is prefix_keys
    first = st.read_request(reader, tokens[:64])
    second = st.read_request(reader, tokens, poison_first=False)
    assert second.device_hit_tokens == 64  # the first request's pages, kept on device
    if policy != "best_effort":
        assert first.storage_tokens == 64 and second.storage_tokens == 64
    for read in (first, second):
        assert read.storage_tokens % 16 == 0
    # rows that came from storage: the first read's, then the second's past the device hit
    # (the rows the first request computed itself are the harness's, not a forward's)
    assert_rows(written.state, first, hi=first.storage_tokens)
    assert_rows(written.state, second, hi=first.storage_tokens)
    assert_rows(written.state, second, lo=64, hi=64 + second.storage_tokens)


# ---- 4. failures ---------------------------------------------------------------------------------
def test_node_stopped_then_killed_while_a_server_prefetches(stacks, gen):
    """Two nodes, one copy of each page. The node holding a later page is stopped (SIGSTOP)
    while a server prefetches the prompt, then killed: the server's request goes on with the
    leading pages the live node holds (the rest recomputed), every loaded row right, within
    SGLang's prefetch timeout plus the store bound; nothing raises."""
    nodes = start_nodes(2, "--capacity", "128MiB")
    try:
        stores, extra = [n.address for n in nodes], {"timeout_s": 1.0}
        tokens = random_tokens(48 * 16, gen)
        writer = stacks("mha", stores, extra=extra)
        written = st.write_request(writer, tokens, generator=gen)
        keys = backend_of(writer).store_keys(_page_hashes(writer, tokens))
        close(writer)
        router = Router(stores, 1, (0.25, 8.0))
        on_first = [router.ranking(k)[0] == 0 for k in keys]
        assert 0 < sum(on_first) < len(keys)
        live = next(i for i, first in enumerate(on_first) if not first)  # pages before it

        reader = stacks("mha", stores, extra=extra)
        backend = backend_of(reader)
        sigstop(nodes[1].proc.pid)  # every thread stopped: none answers after
        result: dict = {}
        worker = threading.Thread(
            target=lambda: result.update(read=st.read_request(reader, tokens))
        )
        start = time.monotonic()
        worker.start()
        wait_for(lambda: backend.stats()["in_flight"] >= 1, 10.0)  # its EXISTS waits on node 1
        nodes[1].kill()
        worker.join(timeout=60)
        assert not worker.is_alive()
        read = result["read"]
        assert read.storage_tokens <= live * 16 and read.storage_tokens % 16 == 0
        assert_rows(written.state, read)
        assert time.monotonic() - start < 30
    finally:
        for n in nodes:
            n.stop()


def test_backend_calls_when_a_node_dies_mid_batch(stacks, gen):
    """At the backend's own surface, on the server's host pool: a node stopped then killed
    while a ``batch_get_v1`` and a ``batch_set_v1`` are in flight: its pages are False (left
    untouched), the other node's arrive, within the bound; a page the write reports stored
    reads back right; later writes fail over. Every node down: calls answer at once. A node
    back on its port: the backend works again."""
    nodes = start_nodes(2, "--capacity", "128MiB")
    try:
        stores = [n.address for n in nodes]
        stack = stacks("mha", stores, extra={"timeout_s": 1.0})
        backend, pool = backend_of(stack), stack.host_pools["kv"]
        ps, n = pool.page_size, 32
        src, dst, busy = (pool.alloc(n * ps) for _ in range(3))
        for slots in (src, busy):
            fill_host(pool, slots, gen)
        keys, busy_keys = (_hashes(random_tokens(n * ps, gen), ps) for _ in range(2))
        ref, busy_ref = host_pages(pool, src), host_pages(pool, busy)
        assert all(backend.batch_set_v1(keys, src))
        router = Router(stores, 1, (0.25, 8.0))
        on_live = [router.ranking(k)[0] == 0 for k in backend.store_keys(keys)]
        assert 0 < sum(on_live) < n
        poison_host(pool, dst)
        poisoned = host_pages(pool, dst)

        sigstop(nodes[1].proc.pid)  # every thread stopped: none answers after
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
        got = host_pages(pool, dst)
        assert all(g == (r if live else p) for g, r, p, live in zip(got, ref, poisoned, on_live))
        assert backend.batch_exists(keys) == on_live.index(False)
        stored = result["set"]
        poison_host(pool, dst)
        assert backend.batch_get_v1(busy_keys, dst) == stored
        got = host_pages(pool, dst)
        assert all(g == r for g, r, ok in zip(got, busy_ref, stored) if ok)
        fresh = pool.alloc(8 * ps)
        fill_host(pool, fresh, gen)
        assert all(backend.batch_set_v1(_hashes(random_tokens(8 * ps, gen), ps), fresh))

        nodes[0].kill()
        gated = stacks("mha", stores, extra={"timeout_s": 1.0, "down_backoff_s": [30.0, 60.0]})
        gated_backend, gated_pool = backend_of(gated), gated.host_pools["kv"]
        g_src, g_dst = gated_pool.alloc(n * ps), gated_pool.alloc(n * ps)
        start = time.monotonic()
        assert gated_backend.batch_exists(keys) == 0  # one bounded round trip to both nodes
        assert time.monotonic() - start < 1.0 + 2.0
        before = host_pages(gated_pool, g_dst)
        start = time.monotonic()
        assert gated_backend.batch_exists(keys) == 0
        assert gated_backend.batch_get_v1(keys, g_dst) == [False] * n
        assert gated_backend.batch_set_v1(keys, g_src) == [False] * n
        assert time.monotonic() - start < 0.5
        assert gated_backend.stats()["get"]["store_down"] == n
        assert host_pages(gated_pool, g_dst) == before

        nodes[0] = NodeProcess("--capacity", "128MiB", port=nodes[0].port).start()
        wait_for(lambda: all(backend.batch_set_v1(keys, src)), 30.0)
        poison_host(pool, dst)
        assert all(backend.batch_get_v1(keys, dst)) and host_pages(pool, dst) == ref
        assert backend.stats()["get"].get("errors", 0) == 0  # failures were misses, not errors
    finally:
        for nd in nodes:
            nd.stop()


@pytest.mark.parametrize("kind", ["mha", "mamba"])
def test_sglang_fault_injector_keeps_data_correct(node, stacks, gen, monkeypatch, kind):
    """SGLang's own injector (SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE=0.2) fails one backend
    call in five, v1 and v2 alike: prompts come back short or not at all, and every row
    that does come back is right."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.2")
    short = 0
    # a first token of its own for each prompt: a page's key names the prefix up to it, so two
    # prompts opening alike share mamba's 1-token first page, whose rows the store keeps from
    # the first write (one run in ~20 drew such a pair: the later rows read back "wrong")
    for first in torch.randperm(500, generator=gen)[:8].tolist():
        tokens = [first, *random_tokens(63, gen)]
        writer = stacks(kind, [node.address])
        assert type(writer.storage_backend).__name__ == "HiCacheStorageFailureInjector"
        written = st.write_request(writer, tokens, generator=gen)
        close(writer)
        read = st.read_request(stacks(kind, [node.address]), tokens)
        assert read.storage_tokens <= len(tokens)
        assert_rows(written.state, read)
        short += read.storage_tokens < len(tokens)
    assert short > 0  # the injector fired (P(no failure in ~40 calls) < 1e-3)


# ---- 5. pools that cannot be stored as regions ---------------------------------------------
def test_a_pool_without_page_regions_is_stored_through_its_flat_pages(node, stacks, gen,
                                                                       monkeypatch):  # fmt: skip
    """SGLang's Mamba host pool refuses zero-copy page regions in some set-ups (registered
    slot side states, layer-first layout): pagekv then stores it through its flat page API
    (copied), under another name, and the state still round-trips."""
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    def refuse(self, indices):
        raise NotImplementedError("Mamba storage zero-copy does not carry side states")

    monkeypatch.setattr(MambaPoolHost, "get_page_buffer_meta", refuse)
    tokens = random_tokens(64, gen)
    writer = stacks("mamba", [node.address])
    assert "-flat" in backend_of(writer).stats()["pools"]["mamba"]
    written = st.write_request(writer, tokens, generator=gen)
    close(writer)
    read = st.read_request(stacks("mamba", [node.address]), tokens)
    assert read.storage_tokens == len(tokens)
    assert_rows(written.state, read)


def test_a_pool_that_cannot_be_stored_turns_the_tier_off(node, stacks, gen, monkeypatch):
    """A pool with neither page regions nor flat pages: the server still starts (one
    warning line naming the pool), serves from its device and host tiers, and the storage
    tier answers every call with a miss."""
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    def refuse(self, *args, **kwargs):
        raise NotImplementedError("not on this pool")

    for method in ("get_page_buffer_meta", "get_dummy_flat_data_page"):
        monkeypatch.setattr(MambaPoolHost, method, refuse)
    with backend_log(logging.WARNING) as warnings:
        stack = stacks("mamba", [node.address])
    assert len(warnings) == 1 and "mamba" in warnings[0]
    assert "without the storage tier" in warnings[0]
    backend = backend_of(stack)
    assert backend.stats()["off"] is not None
    tokens = random_tokens(32, gen)
    written = st.write_request(stack, tokens, generator=gen)
    assert written.stored_pages == 0
    again = st.read_request(stack, tokens, poison_first=False)  # served from its own tiers
    assert again.storage_tokens == 0 and again.device_hit_tokens == len(tokens)
    assert backend.stats()["set"].get("off", 0) > 0


# ---- 6. the backend's own surface, on the server's pools ---------------------------------------
def test_tp_ranks_mla_shares_pages_and_rank0_writes(node, stacks, gen):
    """MLA pages are rank-replicated: TP rank 0 writes, every rank reads the same keys; MHA
    ranks each have their own. One process cannot hold two TP ranks of SGLang's server, so the
    backends of ranks 1 are made here by SGLang's backend factory with rank 1's storage config,
    on the server's own host pools."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    for kind, shared in (("mla", True), ("mha", False)):
        rank0 = stacks(kind, [node.address])
        pool, config = rank0.host_pools["kv"], rank0.controller.storage_config
        rank1_config = type(config)(**{**vars(config), "tp_rank": 1, "tp_size": 2})
        config0 = type(config)(**{**vars(config), "tp_size": 2})
        backend0 = StorageBackendFactory.create_backend("dynamic", config0, pool)
        backend0.register_mem_pool_host(pool)
        backend1 = StorageBackendFactory.create_backend("dynamic", rank1_config, pool)
        backend1.register_mem_pool_host(pool)
        ps = pool.page_size
        src, dst = pool.alloc(8 * ps), pool.alloc(8 * ps)
        fill_host(pool, src, gen)
        keys = _hashes(random_tokens(8 * ps, gen), ps)
        assert all(backend0.batch_set_v1(keys, src))
        poison_host(pool, dst)
        assert backend1.batch_exists(keys) == (8 if shared else 0)
        assert backend1.batch_get_v1(keys, dst) == [shared] * 8
        if shared:
            assert host_pages(pool, dst) == host_pages(pool, src)
        for b in (backend0, backend1):
            b.close()


def test_a_logical_kv_anchor_leaves_every_hit_to_its_side_pools(node, stacks, gen):
    """DeepSeek-V4's host stack: a logical KV anchor (SGLang's ``LogicalHostPool``, no buffer)
    and compressed side pools holding the bytes (``DeepSeekV4PagedHostPool``), registered in
    the order SGLang's HybridCacheController registers them (the anchor, then every entry
    through v2, the anchor again as ``kv``). The controller moves the anchor's pages with the
    v1 calls and takes the smallest hit of those and the side pools': the v1 calls answer every
    page done (as SGLang's Mooncake backend does), the side pools decide. Before: the anchor's
    v2 registration turned the tier off ("empty pages") and the v1 calls answered False."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = stacks("mla", [node.address]).controller.storage_config  # rank-replicated pages
    ps, c4 = 64, "deepseek_v4_c4"

    def server():
        anchor = LogicalHostPool(16 * ps, ps, layout="page_first")
        device = [torch.zeros(17, 640, dtype=torch.uint8) for _ in range(3)]
        side = DeepSeekV4PagedHostPool(c4, device, 640, 16, ps, layout="page_first",
                                       pin_memory=False)  # fmt: skip
        backend = StorageBackendFactory.create_backend("dynamic", config, anchor)
        backend.register_mem_pool_host(anchor)
        for name, pool in (("kv", anchor), (c4, side)):
            backend.register_mem_host_pool_v2(pool, name)
        backend.on_host_pools_registered()
        assert backend.stats()["off"] is None and set(backend.stats()["pools"]) == {c4}
        return anchor, side, backend

    def side_pages(side, slots):
        return [xxhash.xxh3_64_intdigest(side.kv_buffer[p].numpy().tobytes())
                for p in (slots[::ps] // ps).tolist()]  # fmt: skip

    keys = _hashes(random_tokens(4 * ps, gen), ps)
    anchor, written, writer = server()
    src = anchor.alloc(4 * ps)
    for p in (src[::ps] // ps).tolist():
        written.kv_buffer[p] = torch.randint(0, 256, written.kv_buffer[p].shape,
                                             dtype=torch.uint8, generator=gen)  # fmt: skip
    assert writer.batch_set_v1(keys, src) == [True] * 4
    assert writer.batch_set_v2([_transfer(c4, keys, src)])[c4] == [True] * 4
    anchor, read, reader = server()
    dst = anchor.alloc(8 * ps)[4 * ps :]  # other slots than the writer's
    read.kv_buffer.fill_(0x5A)
    wanted = [PoolTransfer(c4, hit_policy=PoolHitPolicy.ALL_PAGES)]
    assert reader.batch_exists_v2(keys, wanted).kv_hit_pages == 4
    other = _hashes(random_tokens(4 * ps, gen), ps)
    assert reader.batch_exists_v2(other, wanted).kv_hit_pages == 0  # no hit from the anchor
    assert reader.batch_get_v1(keys, dst) == [True] * 4
    assert reader.batch_get_v2([_transfer(c4, keys, dst)])[c4] == [True] * 4
    assert side_pages(read, dst) == side_pages(written, src)
    for b in (writer, reader):
        b.close()


def test_per_rank_pages_of_an_mla_model_turn_the_tier_off_at_tp2(node, stacks):
    """An MLA model with an MHA draft pool (an EAGLE-style draft): the draft's pages differ per
    TP rank, but SGLang writes an MLA model's pools from rank 0 only (its controller's
    ``should_backup``) and takes the smallest hit of all ranks, so at TP 2 no request would
    ever hit. The tier goes off with one warning naming the pool; at TP 1 the pool is stored.
    Before: stored under per-rank keys, rank 1 never found its pages, silently."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    kv = stacks("mla", [node.address])
    draft = stacks("mha", [node.address]).host_pools["kv"]  # a real MHA host pool
    pool, config = kv.host_pools["kv"], kv.controller.storage_config
    for tp_size, off in ((1, False), (2, True)):
        rank_config = type(config)(**{**vars(config), "tp_rank": tp_size - 1, "tp_size": tp_size})
        backend = StorageBackendFactory.create_backend("dynamic", rank_config, pool)
        with backend_log(logging.WARNING) as warnings:
            backend.register_mem_pool_host(pool)
            backend.register_mem_host_pool_v2(pool, "kv")
            backend.register_mem_host_pool_v2(draft, "draft")
        assert (backend.stats()["off"] is not None) == off
        assert len(warnings) == off and (not off or "draft" in warnings[0])
        backend.close()


def test_a_pool_of_odd_sized_pages_is_stored():
    """Opaque side pools (state, scales) may have pages of any byte count: one that is not a
    multiple of 4 is described and stored, never an exception out of the registration."""
    from pagekv.connector.sglang.pages import describe_pool

    class StatePool:  # 6 bytes of state per slot, one slot a page
        page_size, layout, dtype = 1, "page_first", torch.uint8

        def __init__(self) -> None:
            self.buf = torch.zeros((16, 6), dtype=torch.uint8)

        def get_hybrid_pool_buffer(self):
            return [self.buf]

        def get_page_buffer_meta(self, indices):
            return [self.buf.data_ptr() + 6 * i for i in indices.tolist()], [6] * len(indices)

    fmt = describe_pool(StatePool(), "state")
    assert fmt.page_bytes == 6 and "1x6" in fmt.label


def test_legacy_interface_shares_pages_with_zero_copy(node, stacks, gen):
    """Without ``interface_v1`` SGLang's controller copies flat pages (``batch_get`` /
    ``batch_set``): the same keys and values as the zero-copy calls, both ways."""
    tokens_a, tokens_b = random_tokens(64, gen), random_tokens(64, gen)
    legacy = stacks("mha", [node.address], drop_extra=["interface_v1"])
    assert legacy.controller.page_get_func == legacy.controller._generic_page_get
    by_legacy = st.write_request(legacy, tokens_a, generator=gen)
    close(legacy)
    zero = stacks("mha", [node.address])
    by_zero = st.write_request(zero, tokens_b, generator=gen)
    read = st.read_request(zero, tokens_a)
    assert read.storage_tokens == 64 and st.mismatches(by_legacy.state, read.state) == []
    close(zero)
    legacy = stacks("mha", [node.address], drop_extra=["interface_v1"])
    read = st.read_request(legacy, tokens_b)
    assert read.storage_tokens == 64 and st.mismatches(by_zero.state, read.state) == []
    backend, pool = backend_of(legacy), legacy.host_pools["kv"]
    keys = _page_hashes(legacy, tokens_b)
    assert backend.exists(keys[2]) and not backend.exists("f" * 64)
    page = pool.get_dummy_flat_data_page()
    page.view(torch.uint8).copy_(torch.randint(0, 256, (page.nbytes,), generator=gen))
    assert backend.set("e" * 64, page) and backend.exists("e" * 64)
    assert _flat(backend.get("e" * 64)) == _flat(page)
    assert backend.get("f" * 64) is None


def test_bad_config_refuses_to_start_and_calls_never_raise(node, stacks, gen):
    """A bad extra config: SGLang's start-up raises pagekv's ConfigError naming it. Bad calls
    at run time: False / 0 / None, counted, never an exception."""
    for bad in ({"store": []}, {"store": "http://x"}, {"replicas": 2}, {"timeout_s": 0},
                {"down_backoff_s": [2, 1]}, {"skip_existing": "yes"}):  # fmt: skip
        with pytest.raises(ConfigError):
            stacks("mha", [node.address], extra=bad)
    stack = stacks("mha", [node.address])
    backend, pool = backend_of(stack), stack.host_pools["kv"]
    ps = pool.page_size
    keys = _hashes(random_tokens(4 * ps, gen), ps)
    idx = pool.alloc(4 * ps)
    assert backend.batch_set_v1(keys, idx[:-1]) == [False] * 4  # slots for 3.9 pages
    assert backend.batch_set_v1([*keys[:2], None, 7], idx) == [False] * 4  # not page hashes
    assert backend.batch_get(keys, [None]) == [None] * 4
    assert backend.batch_set(keys, None) is False
    assert backend.batch_get_v2([_transfer("nope", keys, idx)]) == {"nope": [False] * 4}
    assert backend.batch_exists([]) == 0 and backend.batch_get_v1([], idx[:0]) == []
    stats = backend.stats()
    assert stats["get"]["errors"] == 2 and stats["set"]["errors"] == 2
    assert all(backend.batch_set_v1(keys, idx))  # still serving


def test_clear_and_stats(node, stacks, gen):
    """clear(): the pages stored so far are no longer seen by this server; new ones are.
    get_stats(): SGLang's StorageMetrics, with pagekv's counters attached."""
    stack = stacks("swa", [node.address])
    tokens = random_tokens(64, gen)
    written = st.write_request(stack, tokens, generator=gen)
    backend = backend_of(stack)
    metrics = backend.get_stats()
    assert type(metrics).__name__ == "StorageMetrics"
    assert sum(metrics.backup_pgs) == 8 and metrics.backup_bandwidth[0] > 0  # KV 4 + SWA 4
    assert metrics.pagekv["set"]["stored"] == 8 and metrics.pagekv["set"]["bytes"] > 0
    assert backend.get_stats().backup_pgs == []  # samples are drained, counters are not
    keys = _page_hashes(stack, tokens)
    assert backend.batch_exists(keys) == 4
    backend.clear()
    assert backend.batch_exists(keys) == 0 and backend.stats()["epoch"] == 1
    assert written.stored_pages == 4


def test_three_controller_threads_at_once(node, stacks, gen):
    """SGLang calls a backend from its prefetch-query, prefetch-I/O and backup threads at once:
    each thread gets right answers (its own store client; sockets are never shared)."""
    stack = stacks("mha", [node.address])
    backend, pool = backend_of(stack), stack.host_pools["kv"]
    ps, n = pool.page_size, 8
    slots = [pool.alloc(n * ps) for _ in range(3)]
    for s in slots:
        fill_host(pool, s, gen)
    keys = [_hashes(random_tokens(n * ps, gen), ps) for _ in range(3)]
    refs = [host_pages(pool, s) for s in slots]
    assert all(backend.batch_set_v1(keys[0], slots[0]))
    errors: list[str] = []

    def run(role: int) -> None:
        dst = pool.alloc(n * ps)
        for _ in range(20):
            if role == 0:
                if backend.batch_exists(keys[0]) != n:
                    errors.append("exists")
            elif role == 1:
                poison_host(pool, dst)
                if not all(backend.batch_get_v1(keys[0], dst)) or host_pages(pool, dst) != refs[0]:
                    errors.append("get")
            elif not all(backend.batch_set_v1(keys[2], slots[2])):
                errors.append("set")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert backend.stats()["max_in_flight"] >= 2


# ---- helpers ---------------------------------------------------------------------------------
def _page_hashes(stack: st.Stack, tokens: list[int]) -> list[str]:
    return _hashes(tokens, stack.page_size)


def _hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's own storage keys for ``tokens`` (chained SHA-256 hex per page)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=page_size)


def _transfer(name, keys, host_indices):
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    return PoolTransfer(name, host_indices=host_indices, keys=keys)


def _flat(page: torch.Tensor) -> bytes:
    return page.contiguous().view(torch.uint8).numpy().tobytes()


def host_pages(pool, host_indices: torch.Tensor) -> list[int]:
    """xxh3-64 of each host page's bytes, read through SGLang's own ``get_data_page``."""
    starts = host_indices[:: pool.page_size].tolist()
    return [xxhash.xxh3_64_intdigest(_flat(pool.get_data_page(s, flat=True))) for s in starts]


def fill_host(pool, host_indices: torch.Tensor, gen: torch.Generator) -> None:
    """Fresh random bytes in host pages (through SGLang's ``set_from_flat_data_page``)."""
    flat = pool.get_dummy_flat_data_page()
    for start in host_indices[:: pool.page_size].tolist():
        data = torch.randint(0, 256, (flat.nbytes,), dtype=torch.uint8, generator=gen)
        pool.set_from_flat_data_page(start, data.view(flat.dtype))


def poison_host(pool, host_indices: torch.Tensor, byte: int = 0x5A) -> None:
    flat = pool.get_dummy_flat_data_page()
    data = torch.full((flat.nbytes,), byte, dtype=torch.uint8).view(flat.dtype)
    for start in host_indices[:: pool.page_size].tolist():
        pool.set_from_flat_data_page(start, data)


@contextlib.contextmanager
def backend_log(level: int = logging.INFO):
    """The messages the backend logs at ``level`` or above while the block runs (a handler of
    its own: SGLang's logging set-up keeps records from pytest's capture)."""
    lines: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("pagekv.connector.sglang")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(min(level, old or level))
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def wait_for(ready, timeout_s: float) -> None:
    """Poll ``ready()`` until true, at most ``timeout_s`` (state waits, not sleeps)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {timeout_s} s")
        time.sleep(0.01)
