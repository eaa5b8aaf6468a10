"""pagekv as SGLang 0.5.23's HiCache L3 backend, driven by SGLang's own classes (issue 11).

Runs in the SGLang venv (``make test-sglang``, which sets PAGEKV_REQUIRE_SGLANG=1: there a
missing SGLang fails the run). In the main venv, without SGLang, the module is skipped.
Every test talks to real ``pagekv serve`` processes on loopback.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PAGEKV_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="SGLang lives in its own venv: make test-sglang")

import threading  # noqa: E402

import torch  # noqa: E402

from pagekv.connector.sglang import PagekvStorage  # noqa: E402
from pagekv.store.launch import start_nodes  # noqa: E402
from tests.engines import sglang_harness as h  # noqa: E402

CASES = [("mha", layout) for layout in h.MHA_LAYOUTS] + [("mla", layout) for layout in h.MLA_LAYOUTS]


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
