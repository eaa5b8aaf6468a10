import pytest
import torch

from pagekv.connector import HostPagePool, InvalidPageError, KVGeometry, PoolExhausted
from tests.helpers import as_bits, random_tensor

MHA = KVGeometry(3, 4, 2, 16, "fp16")
MLA = KVGeometry.mla(3, 4, 72, "bf16")


@pytest.mark.parametrize("geo", [MHA, MLA])
def test_layout_and_views(geo):
    pool = HostPagePool(geo, 5, pin=False)
    assert tuple(pool.buffer.shape) == (5, *geo.host_page_shape)
    assert pool.buffer.dtype == geo.dtype and pool.buffer.is_contiguous()
    assert not pool.is_pinned
    for i in range(5):
        view = pool.page_view(i)
        assert view.nbytes == geo.page_bytes and not view.readonly
        data = random_tensor(geo.host_page_shape, geo.dtype)
        view[:] = data.view(torch.uint8).reshape(-1).numpy().tobytes()
        assert torch.equal(as_bits(pool.page_tensor(i)), as_bits(data))
        # The view aliases page i's block exactly: byte offset i * page_bytes.
        base = pool.buffer.data_ptr()
        assert pool.page_tensor(i).data_ptr() == base + i * geo.page_bytes
    # Writing through a view leaves neighbours alone.
    before = pool.buffer.clone()
    pool.page_view(2)[:] = bytes(geo.page_bytes)
    assert torch.equal(as_bits(pool.buffer[[0, 1, 3, 4]]), as_bits(before[[0, 1, 3, 4]]))


@pytest.mark.parametrize("geo", [MHA, MLA])
def test_page_views_are_the_pages_and_check_every_id_first(geo):
    pool = HostPagePool(geo, 5, pin=False)
    ids = [3, 0, 4, 3]
    views = pool.page_views(ids)
    for i, view in zip(ids, views):
        assert view.nbytes == geo.page_bytes and not view.readonly
        data = random_tensor(geo.host_page_shape, geo.dtype)
        view[:] = data.view(torch.uint8).reshape(-1).numpy().tobytes()
        assert torch.equal(as_bits(pool.page_tensor(i)), as_bits(data))
        assert bytes(view) == bytes(pool.page_view(i))
    for bad in ([0, 5], [-1], [1, True], [2.0]):
        with pytest.raises(InvalidPageError):
            pool.page_views(bad)
    assert pool.page_views([]) == []


def test_alloc_free_cycle():
    pool = HostPagePool(MHA, 4, pin=False)
    a = pool.alloc(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    with pytest.raises(PoolExhausted, match="2 pages requested, 1 of 4 free"):
        pool.alloc(2)
    assert pool.num_free == 1  # nothing taken by the failed call
    pool.free(a[:2])
    assert pool.num_free == 3
    b = pool.alloc(3)
    assert len(set(b)) == 3 and a[2] not in b
    assert pool.alloc(0) == []


def test_free_errors_free_nothing():
    pool = HostPagePool(MHA, 4, pin=False)
    a = pool.alloc(2)
    with pytest.raises(InvalidPageError, match="not allocated"):
        pool.free([a[0], 3])  # 3 never allocated
    with pytest.raises(InvalidPageError, match="repeat"):
        pool.free([a[0], a[0]])
    with pytest.raises(InvalidPageError, match="not in"):
        pool.free([4])
    with pytest.raises(InvalidPageError, match="must be an int"):
        pool.free(["1"])
    assert pool.num_free == 2 and pool.is_allocated(a[0]) and pool.is_allocated(a[1])
    pool.free(a)
    with pytest.raises(InvalidPageError, match="double free"):
        pool.free([a[0]])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_pool_size(bad):
    with pytest.raises(ValueError):
        HostPagePool(MHA, bad, pin=False)


def test_bad_args():
    pool = HostPagePool(MHA, 2, pin=False)
    with pytest.raises(ValueError):
        pool.alloc(-1)
    with pytest.raises(InvalidPageError):
        pool.page_view(2)
    with pytest.raises(InvalidPageError):
        pool.page_tensor(-1)
    with pytest.raises(TypeError):
        HostPagePool("geo", 2)


def test_unpinned_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert not HostPagePool(MHA, 2).is_pinned
