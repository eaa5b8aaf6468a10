import pytest

from pagekv.connector import HostPagePool, InvalidPageError, KVGeometry, PageCache, PoolExhausted

GEO = KVGeometry(2, 4, 1, 8, "fp32")


def make(num_pages=4):
    pool = HostPagePool(GEO, num_pages, pin=False)
    return pool, PageCache(pool)


def fill(cache, keys):
    """Allocate, publish and release one page per key; returns the page ids."""
    pages = cache.allocate(len(keys))
    for k, p in zip(keys, pages):
        assert cache.publish(k, p)
    cache.release(pages)
    return pages


def test_publish_lookup_acquire():
    pool, cache = make()
    pages = fill(cache, [b"a", b"b", b"c"])
    assert len(cache) == 3 and pool.num_free == 1
    assert cache.match_prefix([b"a", b"b", b"x", b"c"]) == 2
    assert cache.match_prefix([b"x", b"a"]) == 0
    held = cache.acquire([b"a", b"b", b"x", b"c"])
    assert held == pages[:2]
    assert cache.refcount(pages[0]) == 1 and cache.refcount(pages[2]) == 0
    cache.release(held)
    assert cache.num_held == 0 and len(cache) == 3


def test_acquire_each_holds_every_cached_key_and_skips_misses():
    _, cache = make()
    pages = fill(cache, [b"a", b"b", b"c"])
    held = cache.acquire_each([b"x", b"b", b"a", b"y"])
    assert held == [None, pages[1], pages[0], None]
    assert [cache.refcount(p) for p in pages] == [1, 1, 0]
    assert cache.num_evictable == 1  # only c can go
    assert cache.evict(3) == 1 and b"c" not in cache and b"a" in cache
    cache.release([p for p in held if p is not None])
    assert cache.num_held == 0 and cache.num_evictable == 2
    assert cache.acquire_each([]) == []


def test_lru_eviction_order_and_held_pages_survive():
    _, cache = make(4)
    pa, pb, pc, pd = fill(cache, [b"a", b"b", b"c", b"d"])
    cache.acquire([b"a"])  # touches a (now newest) and holds it
    new = cache.allocate(2)  # evicts the two oldest unheld: b, c
    assert set(new) == {pb, pc}
    assert b"a" in cache and b"d" in cache and b"b" not in cache and b"c" not in cache
    assert cache.num_evictions == 2
    with pytest.raises(PoolExhausted, match="1 evictable, 3 held"):
        cache.allocate(2)  # d is evictable, a and the two new are held
    assert b"d" in cache  # the failed call evicted nothing
    cache.release([pa])
    assert set(cache.allocate(2)) == {pa, pd}
    assert len(cache) == 0


def test_touch_on_acquire_changes_victim():
    _, cache = make(2)
    _, pb = fill(cache, [b"a", b"b"])
    cache.release(cache.acquire([b"a"]))
    assert cache.allocate(1) == [pb]


def test_publish_duplicate_key_and_private_release():
    pool, cache = make(3)
    fill(cache, [b"k"])
    (p,) = cache.allocate(1)
    assert cache.publish(b"k", p) is False
    cache.release([p])  # private page goes back to the pool
    assert pool.num_free == 2 and not pool.is_allocated(p)


def test_publish_errors():
    pool, cache = make(3)
    (p,) = fill(cache, [b"k"])
    with pytest.raises(InvalidPageError):
        cache.publish(b"x", p)  # already cached, not private
    q = pool.alloc(1)[0]  # allocated behind the cache's back: not held
    with pytest.raises(InvalidPageError):
        cache.publish(b"x", q)
    with pytest.raises(TypeError):
        cache.publish("str-key", q)


def test_release_errors_release_nothing():
    _, cache = make(3)
    (p,) = fill(cache, [b"k"])
    held = cache.acquire([b"k"])
    with pytest.raises(InvalidPageError, match="released 2x but held 1x"):
        cache.release(held * 2)
    assert cache.refcount(p) == 1
    with pytest.raises(InvalidPageError):
        cache.release([99])
    cache.release(held)
    with pytest.raises(InvalidPageError):
        cache.release(held)


def test_remove_held_page_frees_on_last_release():
    pool, cache = make(2)
    (p,) = fill(cache, [b"k"])
    held = cache.acquire([b"k"])
    assert cache.remove(b"k") and b"k" not in cache
    assert pool.is_allocated(p)  # still held: never reused under a reader
    assert cache.allocate(1) != [p]
    cache.release(held)
    assert not pool.is_allocated(p)
    assert cache.remove(b"k") is False


def test_evict_explicit():
    pool, cache = make(3)
    fill(cache, [b"a", b"b", b"c"])
    cache.acquire([b"a"])
    assert cache.evict(5) == 2 and len(cache) == 1 and pool.num_free == 2
    assert cache.num_evictable == 0


def test_allocate_validation():
    _, cache = make(2)
    with pytest.raises(ValueError):
        cache.allocate(-1)


def failed_transfer():
    """A copy issuer's completion whose job raised (the issuer's own failure path, no GPU)."""
    from pagekv.connector.copy_issuer import Completion

    completion = Completion()
    completion._set(None, RuntimeError("no memory for the index tensors"))
    return completion


def test_a_failed_transfer_lets_its_pages_go_and_never_poisons_the_cache():
    """A release deferred on a transfer that then fails releases its pages (nothing touches
    them any more), and the cache keeps working: allocate, available, reap and release never
    raise because of it. Before: every one of them raised CopyFailed from then on, and the
    pages stayed held."""
    from pagekv.connector.copy_issuer import Completion

    pool, cache = make(4)
    keys = [b"k%015d" % i for i in range(2)]
    fill(cache, keys)
    held = cache.acquire(keys)
    pending = Completion()  # queued on the issuer, not yet enqueued
    cache.release(held, after=[pending])
    assert cache.available() == 2  # the other two pages; the held ones wait
    pending._set(None, RuntimeError("no memory for the index tensors"))
    assert cache.reap() == 2 and cache.available() == 4
    assert [cache.refcount(p) for p in held] == [0, 0]
    pages = cache.allocate(4)  # evicts the two cached pages
    cache.release(pages, after=failed_transfer())  # already failed: released now
    assert pool.num_free == 4


def test_a_page_whose_copy_failed_is_never_read():
    """A page published while its copy is queued, whose copy then fails, holds no value: the
    reader asking for its ready events gets CopyFailed and the key leaves the index (the
    page goes back on the reader's release); a page whose copy already failed is not
    published at all."""
    from pagekv.connector.copy_issuer import Completion
    from pagekv.errors import CopyFailed

    pool, cache = make(4)
    a, b, c = cache.allocate(3)
    copy = Completion()
    assert cache.publish(b"a" * 16, a, ready=copy) and cache.publish(b"b" * 16, b, ready=copy)
    cache.release([b])  # b: cached, evictable, never read
    copy._set(None, RuntimeError("no memory for the index tensors"))
    with pytest.raises(CopyFailed):
        cache.ready_events([a, a])
    assert b"a" * 16 not in cache and b"b" * 16 in cache
    cache.release([a])
    assert pool.num_free == 2  # a is back (b still cached, c private)
    with pytest.raises(CopyFailed):
        cache.ready_events([b])
    assert len(cache) == 0 and pool.num_free == 3
    assert not cache.publish(b"c" * 16, c, ready=failed_transfer())
    assert b"c" * 16 not in cache
    cache.release([c])
    assert pool.num_free == 4
