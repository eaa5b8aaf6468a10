"""The engine contract on the GPU, each race made deterministic: ``torch.cuda._sleep`` holds one
stream back so the other side of the race always runs first (docs in kv_connector.py)."""

import asyncio

import pytest
import torch

from pagekv.connector import KeyNamespace, KVConnector, KVGeometry
from pagekv.kernels import DeviceKV, load
from pagekv.store.launch import NodeProcess
from tests.helpers import bits_equal, poison_, random_tensor

pytestmark = pytest.mark.cuda
GEO = KVGeometry(4, 16, 8, 128, "bf16")  # 256 KiB pages
SLOTS = 4096
PAGES = 32
SLEEP = 400_000_000  # GPU cycles: ~0.2-0.3 s on an H100, far longer than any copy here


@pytest.fixture(scope="module")
def node():
    n = NodeProcess("--capacity", "2GiB").start()
    yield n
    n.stop()


def caches(geo=GEO, poisoned=False):
    shape = (geo.num_layers, SLOTS, *geo.device_layer_shape)
    groups = 1 if geo.is_mla else 2
    if poisoned:
        return [poison_(torch.empty(shape, dtype=geo.dtype, device="cuda")) for _ in range(groups)]
    return [random_tensor(shape, geo.dtype, "cuda") for _ in range(groups)]


def connector(node, kv, geo=GEO, host_pages=2 * PAGES, rank=0, size=1):
    ns = KeyNamespace("gpu-contract", geo, rank, size)
    return KVConnector(geo, kv, node.address, host_pages=host_pages, namespace=ns)


def prompt(n=PAGES * GEO.page_size):
    return torch.randint(0, 32000, (n,)).tolist()


def hold_back(stream):
    """Queue a long sleep on ``stream``: whatever is queued after it runs late."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP)


def snapshot(kv, slots):
    return [c[:, slots].clone() for c in kv]


def same(kv, slots, expected):
    torch.cuda.synchronize()
    return all(bits_equal(c[:, slots], e) for c, e in zip(kv, expected))


def test_slots_overwritten_right_after_save_do_not_reach_the_store(node):
    """Item 1, as the issue found it: a 1 GiB save (Llama-3-8B rows) whose slots the next
    request overwrites on the engine's stream at once. Before: most saved rows were the new
    values, since the device -> host copy was still running."""
    big = KVGeometry(32, 16, 8, 128, "bf16")
    n = 8192
    kv = [random_tensor((32, 2 * n, 8, 128), big.dtype, "cuda") for _ in range(2)]
    ns = KeyNamespace("gpu-contract-big", big)
    a = KVConnector(big, kv, node.address, host_pages=n // 16 + 8, namespace=ns)
    a.writes_to_store = False  # the host pages are what the store would get
    try:
        tokens, slots = prompt(n), torch.randperm(n, device="cuda")
        expected = snapshot(kv, slots)
        junk = [random_tensor(e.shape, e.dtype, "cuda") for e in expected]
        for c, e in zip(kv, expected):  # warm-up: an allocation would sync the device
            c.index_copy_(1, slots, e)
        torch.cuda.synchronize()
        assert a.save(tokens, slots).pages == n // 16
        for c, j in zip(kv, junk):  # the next request's KV, on the engine's stream, at once
            c.index_copy_(1, slots, j)
        torch.cuda.synchronize()
        h = asyncio.run(a.prefetch(tokens))
        assert h.num_pages == n // 16 and h.fetched == 0  # from the host tier
        out = torch.arange(n, 2 * n, device="cuda")
        a.load(h, out)
        assert same(kv, out, expected)
        a.release(h)
    finally:
        a.close()


@pytest.mark.parametrize("engine_waits", [True, False])
def test_host_tier_hit_right_after_save_loads_the_saved_bytes(node, engine_waits):
    """Item 2: the load waits on the pages' ready event even when the engine orders its own
    streams (engine_waits=False)."""
    kv = caches()
    a = connector(node, kv)
    try:
        tokens, slots = prompt(), torch.randperm(SLOTS // 2, device="cuda")[: PAGES * 16]
        expected = snapshot(kv, slots)
        hold_back(a._save_stream)
        saved = a.save(tokens, slots, engine_waits=engine_waits)
        h = asyncio.run(a.prefetch(tokens))
        assert h.fetched == 0 and h.num_pages == PAGES  # host-tier hit
        out = torch.arange(SLOTS // 2, SLOTS // 2 + PAGES * 16, device="cuda")
        a.load(h, out)
        assert same(kv, out, expected)
        a.release(h)
        saved.wait()
        assert saved.done()
    finally:
        a.close()


def stored(node, n_prompts, geo=GEO):
    """Prompts whose pages are in the store, with their KV (for checking loads)."""
    kv = caches(geo)
    w = connector(node, kv, geo, host_pages=n_prompts * PAGES + 4)
    out = []
    try:
        for i in range(n_prompts):
            tokens = prompt()
            slots = torch.arange(i * PAGES * 16, (i + 1) * PAGES * 16, device="cuda")
            w.save(tokens, slots)
            out.append((tokens, snapshot(kv, slots)))
        w.flush_sync(timeout=60)
    finally:
        w.close()
    return out


@pytest.mark.parametrize("layerwise", [False, True])
def test_release_right_after_load_then_eviction_and_refill(node, layerwise):
    """Item 3: releasing a prefetch while its load still reads the pages; a second prefetch
    then needs the whole pool. Before, it evicted and refilled the pages under the load."""
    (tok_a, kv_a), (tok_b, _) = stored(node, 2)
    dst = caches(poisoned=True)
    b = connector(node, dst, host_pages=PAGES)  # room for one prompt only
    try:
        h = asyncio.run(b.prefetch(tok_a))
        assert h.num_pages == PAGES
        out = torch.arange(PAGES * 16, device="cuda")
        b.load_async(h, out) if layerwise else b.load(h, out)  # warm-up: allocator segments
        torch.cuda.synchronize()
        hold_back(b._load_stream)
        if layerwise:
            b.load_async(h, out)
        else:
            with torch.cuda.stream(b._load_stream):
                b.load(h, out)
        b.release(h)
        h2 = asyncio.run(b.prefetch(tok_b))  # must not get A's pages while they are read
        assert h2.num_pages < PAGES
        assert same(dst, out, kv_a)
        b.release(h2)
        torch.cuda.synchronize()
        h3 = asyncio.run(b.prefetch(tok_b))
        assert h3.num_pages == PAGES  # once the load is done the pages are reusable
        b.release(h3)
    finally:
        b.close()


def test_layerwise_index_tensors_survive_engine_allocations(node):
    """Item 4: the engine allocates and writes new tensors while later layers still load."""
    ((tokens, kv_a),) = stored(node, 1)
    dst = caches(poisoned=True)
    b = connector(node, dst)
    try:
        h = asyncio.run(b.prefetch(tokens))
        hold_back(b._load_stream)
        out = torch.randperm(SLOTS, device="cuda")[: PAGES * 16]
        layers = b.load_async(h, out.cpu())
        junk = [torch.full((n,), -7, dtype=torch.int64, device="cuda") for n in (PAGES, PAGES * 16)
                for _ in range(64)]  # fmt: skip
        for i in range(GEO.num_layers):
            layers.wait_layer(i)
        assert same(dst, out, kv_a)
        del junk
        b.release(h)
    finally:
        b.close()


def test_mla_non_writer_rank_pages_are_not_refilled_under_its_save(node):
    """Item 3, MLA: rank 1 saves but does not write back; its pages must stay held until the
    device -> host copy is done, or a fetch refills them and the late copy lands on top."""
    mla = KVGeometry.mla(4, 16, 576, "bf16")
    ((tok_b, kv_b),) = stored(node, 1, mla)
    kv = caches(mla)
    r1 = connector(node, kv, mla, host_pages=PAGES, rank=1, size=2)
    try:
        hold_back(r1._save_stream)
        r1.save(prompt(), torch.arange(PAGES * 16, device="cuda"), engine_waits=False)
        h = asyncio.run(r1.prefetch(tok_b))  # wants the whole pool while the save copies
        torch.cuda.synchronize()  # the held-back save copy lands now
        out = torch.arange(SLOTS - PAGES * 16, SLOTS, device="cuda")
        n = h.num_tokens
        if n:  # before: all PAGES pages, refilled by the fetch, then overwritten by the save
            r1.load(h, out[:n])
            assert same(kv, out[:n], [e[:, :n] for e in kv_b])
        r1.release(h)
        h = asyncio.run(r1.prefetch(tok_b))  # the save is done: its pages can be reused now
        assert h.num_pages == PAGES
        r1.load(h, out)
        assert same(kv, out, kv_b)
        r1.release(h)
    finally:
        r1.close()


def test_save_and_load_async_make_no_host_sync(node):
    """Item 5: torch's sync debug mode turns any host synchronisation into an error."""
    kv = caches()
    a = connector(node, kv)
    try:
        tokens, slots = prompt(), torch.randperm(SLOTS)[: PAGES * 16]  # CPU slots, as engines
        a.save(tokens, slots)
        h = asyncio.run(a.prefetch(tokens))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            a.save(prompt(), slots)
            layers = a.load_async(h, torch.arange(PAGES * 16))
            for i in range(GEO.num_layers):
                layers.wait_layer(i)
            a.release(h)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        a.close()


def test_direct_backend_skips_out_of_range_indices():
    """Item 8: with validate=False an out-of-range page id or slot is skipped, never copied."""
    geo = KVGeometry(2, 256, 8, 128, "bf16")  # 1 MiB runs: the direct backend's territory
    host = random_tensor((4, *geo.host_page_shape), geo.dtype).pin_memory()
    kv_t = caches(geo, poisoned=True)
    kv = DeviceKV.from_caches(geo, *kv_t)
    before = [c.clone() for c in kv_t]
    ids = torch.tensor([0, 99, 2])  # 99: out of range
    slots = torch.arange(3 * 256).view(3, 256)
    slots[2, 5] = SLOTS + 1000  # out of range
    load(host, ids, kv, slots, backend="direct", validate=False)
    torch.cuda.synchronize()
    assert bits_equal(kv_t[0][:, :256], host[0, :, 0].cuda())
    assert bits_equal(kv_t[0][:, 256:512], before[0][:, 256:512])  # page 99 skipped
    assert bits_equal(kv_t[0][:, 512 + 6 : 768], host[2, :, 0, 6:].cuda())


def busy(stream):
    """Hold ``stream`` back; the returned event completes only when the hold is over."""
    hold_back(stream)
    marker = torch.cuda.Event()
    marker.record(stream)
    return marker


def test_engine_calls_return_while_every_stream_is_busy(node):
    """Item 5, implicit syncs too (a page-locked allocation, a pageable upload): with any one
    stream held back, save / prefetch / load / load_async / release return at once."""
    kv = caches()
    a = connector(node, kv, host_pages=8 * PAGES)
    try:
        tokens, slots = prompt(), torch.randperm(SLOTS // 2)[: PAGES * 16]
        dst = torch.arange(SLOTS // 2, SLOTS // 2 + PAGES * 16)
        a.save(tokens, slots)  # warm-up: allocator segments and staging on every stream
        h = asyncio.run(a.prefetch(tokens))
        a.load(h, dst)
        a.load_async(h, dst)
        a.release(h)
        torch.cuda.synchronize()
        engine = torch.cuda.current_stream()
        for name, stream in (("save", a._save_stream), ("load", a._load_stream),
                             ("engine", engine)):  # fmt: skip
            marker = busy(stream)
            a.save(prompt(), slots)
            h = asyncio.run(a.prefetch(tokens))
            a.load(h, dst)
            layers = a.load_async(h, dst)
            a.release(h)
            layers.wait_layer(GEO.num_layers - 1)
            assert not marker.query(), f"a call waited for the {name} stream"
            torch.cuda.synchronize()
    finally:
        a.close()


BIG = KVGeometry(32, 16, 8, 128, "bf16")  # Llama-3-8B rows: 128 KiB per token
BIG_TOKENS = 8192  # 1 GiB: copies that take ~20 ms, long enough to race without a sleep


def big_connector(node, name):
    kv = [random_tensor((32, 2 * BIG_TOKENS, 8, 128), BIG.dtype, "cuda") for _ in range(2)]
    conn = KVConnector(BIG, kv, node.address, host_pages=BIG_TOKENS // 16 + 8,
                       namespace=KeyNamespace(name, BIG))  # fmt: skip
    conn.writes_to_store = False
    return kv, conn


def test_large_save_then_host_tier_load_in_reverse_page_order(node):
    """Item 2 by size: the load starts with the pages the save writes last."""
    kv, a = big_connector(node, "gpu-contract-rev")
    try:
        tokens = prompt(BIG_TOKENS)
        slots = torch.randperm(BIG_TOKENS, device="cuda")
        expected = snapshot(kv, slots)
        torch.cuda.synchronize()
        a.save(tokens, slots, engine_waits=False)
        h = asyncio.run(a.prefetch(tokens))
        rev = type(h)(h.keys, h.page_ids[::-1], h.page_size)  # same pages, last first
        out = torch.arange(BIG_TOKENS, 2 * BIG_TOKENS, device="cuda").view(-1, 16).flip(0)
        a.load(rev, out.reshape(-1))
        a.release(rev)
        h.released = True
        assert same(kv, torch.arange(BIG_TOKENS, 2 * BIG_TOKENS, device="cuda"), expected)
    finally:
        a.close()


def test_large_layerwise_load_index_tensors_survive_engine_allocations(node):
    """Item 4 by size: 32 layers of 32 MiB; the engine allocates and writes small tensors
    while the later layers still load."""
    kv, a = big_connector(node, "gpu-contract-lw")
    try:
        tokens = prompt(BIG_TOKENS)
        src = torch.randperm(BIG_TOKENS, device="cuda")
        expected = snapshot(kv, src)
        a.save(tokens, src)
        torch.cuda.synchronize()
        h = asyncio.run(a.prefetch(tokens))
        out = torch.arange(BIG_TOKENS, 2 * BIG_TOKENS)
        layers = a.load_async(h, out)
        junk = [torch.full((n,), -7, dtype=torch.int64, device="cuda")
                for n in (BIG_TOKENS // 16, BIG_TOKENS) for _ in range(64)]  # fmt: skip
        for i in range(BIG.num_layers):
            layers.wait_layer(i)
        assert same(kv, out.cuda(), expected)
        del junk
        a.release(h)
    finally:
        a.close()
