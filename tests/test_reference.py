"""Reference page-first <-> layer-first conversions: round trips, skips, errors."""

import random

import pytest
import torch

from pagekv.connector import HostPagePool, KVGeometry
from pagekv.kernels import DeviceKV, copy_slots_ref, load_ref, save_ref
from tests.helpers import ALL_DTYPES, as_bits, bits_equal, poison_, random_tensor


def random_geometry(dtype, mla):
    layers, page = random.randint(1, 5), random.choice([1, 2, 3, 16])
    if mla:
        return KVGeometry.mla(layers, page, random.choice([8, 64, 576]), dtype)
    return KVGeometry(layers, page, random.randint(1, 4), random.choice([8, 16, 128]), dtype)


def device_caches(geo, num_slots, per_layer=False):
    shape = (geo.num_layers, num_slots, *geo.device_layer_shape)
    groups = [random_tensor(shape, geo.dtype) for _ in range(geo.num_kv)]
    if per_layer:
        groups = [list(g.unbind(0)) for g in groups]
    return groups


def expected_host_page(geo, groups, slot_row, old_page):
    """Explicit loop oracle: the host block of one page from device slots ``slot_row``."""
    page = old_page.clone()
    for layer in range(geo.num_layers):
        for j, slot in enumerate(slot_row.tolist()):
            if slot < 0:
                continue
            if geo.is_mla:
                page[layer, j] = groups[0][layer][slot]
            else:
                page[layer, 0, j] = groups[0][layer][slot]
                page[layer, 1, j] = groups[1][layer][slot]
    return page


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "list"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_save_then_load_round_trip(dtype, mla, per_layer, index_dtype):
    for _ in range(3):
        geo = random_geometry(dtype, mla)
        num_pages, n = random.randint(2, 6), None
        n = random.randint(1, num_pages)
        num_slots = n * geo.page_size + random.randint(0, 9)
        groups = device_caches(geo, num_slots, per_layer)
        kv = DeviceKV.from_caches(geo, *groups)
        pool = HostPagePool(geo, num_pages, pin=False)
        poison_(pool.buffer)
        ids = torch.randperm(num_pages)[:n]
        slots = torch.randperm(num_slots)[: n * geo.page_size].view(n, -1).to(index_dtype)
        save_ref(kv, slots, pool.buffer, ids)
        for i, page in enumerate(ids.tolist()):
            want = expected_host_page(geo, groups, slots[i], torch.empty_like(pool.buffer[0]))
            assert bits_equal(pool.buffer[page], want)
        untouched = sorted(set(range(num_pages)) - set(ids.tolist()))
        assert (as_bits(pool.buffer[untouched]).view(torch.uint8) == 0xA5).all()

        # Load into poisoned caches (as a different slot permutation) and compare.
        back = [poison_(torch.empty_like(torch.stack(list(g)) if per_layer else g)) for g in groups]
        back_kv = DeviceKV.from_caches(geo, *back)
        dst = torch.randperm(num_slots)[: n * geo.page_size].view(n, -1).to(index_dtype)
        load_ref(pool.buffer, ids, back_kv, dst)
        for g_src, g_dst in zip(groups, back):
            src = torch.stack(list(g_src))
            assert bits_equal(g_dst[:, dst.flatten().long()], src[:, slots.flatten().long()])
            rest = torch.ones(num_slots, dtype=torch.bool)
            rest[dst.flatten().long()] = False
            assert (as_bits(g_dst[:, rest]).view(torch.uint8) == 0xA5).all()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_one_layer_at_a_time(mla):
    geo = random_geometry(torch.bfloat16, mla)
    n, num_slots = 3, 3 * geo.page_size + 4
    groups = device_caches(geo, num_slots)
    pool = HostPagePool(geo, 4, pin=False)
    slots = torch.randperm(num_slots)[: n * geo.page_size]
    ids = [3, 0, 2]
    poison_(pool.buffer)
    for layer in range(geo.num_layers):  # layer-wise save equals the all-layer save
        save_ref(DeviceKV.from_caches(geo, *groups), slots, pool.buffer, ids, layer=layer)
    whole = HostPagePool(geo, 4, pin=False)
    poison_(whole.buffer)
    save_ref(DeviceKV.from_caches(geo, *groups), slots, whole.buffer, ids)
    assert bits_equal(pool.buffer, whole.buffer)

    back = [poison_(torch.empty_like(g)) for g in groups]
    kv = DeviceKV.from_caches(geo, *back)
    for layer in range(geo.num_layers):
        load_ref(pool.buffer, ids, kv, slots, layer=layer)
        for g_src, g_dst in zip(groups, back):
            assert bits_equal(g_dst[layer, slots], g_src[layer, slots])
            if layer + 1 < geo.num_layers:  # later layers not yet written
                assert (as_bits(g_dst[layer + 1]).view(torch.uint8) == 0xA5).all()


def test_negative_slots_skip():
    geo = KVGeometry(2, 4, 2, 8, "fp16")
    groups = device_caches(geo, 16)
    pool = HostPagePool(geo, 2, pin=False)
    poison_(pool.buffer)
    slots = torch.tensor([[0, -1, 5, 6], [-1, -1, 9, 2]])
    save_ref(DeviceKV.from_caches(geo, *groups), slots, pool.buffer, [1, 0])
    host = pool.buffer
    assert (as_bits(host[1, :, :, 1]).view(torch.uint8) == 0xA5).all()
    assert (as_bits(host[0, :, :, :2]).view(torch.uint8) == 0xA5).all()
    assert bits_equal(host[1, :, 0, 2], groups[0][:, 5])
    back = [poison_(torch.empty_like(g)) for g in groups]
    load_ref(host, [1, 0], DeviceKV.from_caches(geo, *back), slots)
    written = [0, 5, 6, 9, 2]
    for g_src, g_dst in zip(groups, back):
        assert bits_equal(g_dst[:, written], g_src[:, written])
        others = [s for s in range(16) if s not in written]
        assert (as_bits(g_dst[:, others]).view(torch.uint8) == 0xA5).all()
    # All skipped: nothing happens, no error.
    load_ref(host, [0], DeviceKV.from_caches(geo, *back), torch.full((4,), -1))


def test_vllm_per_layer_blocks():
    geo = KVGeometry(3, 4, 2, 16, "bf16")
    num_blocks, block_size = 5, 8
    layers = [random_tensor((2, num_blocks, block_size, 2, 16), geo.dtype) for _ in range(3)]
    kv = DeviceKV.from_vllm(geo, layers)
    assert kv.num_slots == num_blocks * block_size
    pool = HostPagePool(geo, 2, pin=False)
    slots = torch.tensor([[9, 10, 11, 12], [33, 1, 2, 39]])  # block 1 offsets 1..4, ...
    save_ref(kv, slots, pool.buffer, [0, 1])
    for layer in range(3):
        assert bits_equal(pool.buffer[0, layer, 0, 0], layers[layer][0, 1, 1])
        assert bits_equal(pool.buffer[1, layer, 1, 3], layers[layer][1, 4, 7])


def test_copy_slots_layer_first():
    geo = KVGeometry(2, 4, 2, 8, "fp32")
    src = device_caches(geo, 20)
    dst = [poison_(torch.empty((2, 12, 2, 8), dtype=geo.dtype)) for _ in range(2)]
    s_idx = torch.tensor([3, 7, -1, 19, 0])
    d_idx = torch.tensor([11, 0, 5, -1, 4])
    copy_slots_ref(DeviceKV.from_caches(geo, *src), s_idx, DeviceKV.from_caches(geo, *dst), d_idx)
    for a, b in zip(src, dst):
        assert bits_equal(b[:, [11, 0, 4]], a[:, [3, 7, 0]])
        assert (as_bits(b[:, [1, 2, 3, 5, 6, 7, 8, 9, 10]]).view(torch.uint8) == 0xA5).all()


# ---- errors: raised before anything is written ------------------------------------------------
GEO = KVGeometry(2, 4, 2, 8, "bf16")


def _setup():
    groups = device_caches(GEO, 16)
    pool = HostPagePool(GEO, 3, pin=False)
    poison_(pool.buffer)
    return groups, pool


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(slots=torch.arange(7)), ValueError, "slots has shape"),
        (lambda a: a.update(slots=torch.arange(8).float()), TypeError, "int32 or int64"),
        (lambda a: a.update(slots=torch.arange(8) + 9), IndexError, "slot 16"),
        (lambda a: a.update(page_ids=[0, 3]), IndexError, "page id 3"),
        (lambda a: a.update(page_ids=[-1, 0]), IndexError, "page id -1"),
        (lambda a: a.update(page_ids=[[0, 1]]), ValueError, "1-D"),
        (lambda a: a.update(layer=2), IndexError, "layer 2"),
        (lambda a: a.update(layer="0"), TypeError, "layer"),
        (lambda a: a.update(host=torch.empty(3, 2, 2, 4, 2, 8)), TypeError, "dtype"),
        (
            lambda a: a.update(host=torch.empty(3, 2, 2, 4, 2, 9, dtype=torch.bfloat16)),
            ValueError,
            "host has shape",
        ),
    ],
)
@pytest.mark.parametrize("op", ["save", "load"])
def test_errors_write_nothing(mutate, exc, match, op):
    groups, pool = _setup()
    args = dict(slots=torch.arange(8), page_ids=[0, 1], host=pool.buffer, layer=None)
    mutate(args)
    before_host, before_dev = pool.buffer.clone(), [g.clone() for g in groups]
    kv = DeviceKV.from_caches(GEO, *groups)
    with pytest.raises(exc, match=match):
        if op == "save":
            save_ref(kv, args["slots"], args["host"], args["page_ids"], layer=args["layer"])
        else:
            load_ref(args["host"], args["page_ids"], kv, args["slots"], layer=args["layer"])
    assert bits_equal(pool.buffer, before_host)
    assert all(bits_equal(g, b) for g, b in zip(groups, before_dev))


def test_save_repeated_page_and_load_repeated_slot():
    groups, pool = _setup()
    kv = DeviceKV.from_caches(GEO, *groups)
    with pytest.raises(ValueError, match="page_ids repeat"):
        save_ref(kv, torch.arange(8), pool.buffer, [1, 1])
    with pytest.raises(ValueError, match="slots repeat"):
        load_ref(pool.buffer, [0, 1], kv, torch.tensor([0, 1, 2, 3, 4, 5, 6, 0]))
    load_ref(pool.buffer, [1, 1], kv, torch.arange(8))  # one page into two slot sets is fine


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda g: DeviceKV.from_caches(GEO, g[0]), ValueError, "both K and V"),
        (lambda g: DeviceKV.from_caches(GEO, g[0].float(), g[1]), TypeError, "dtype"),
        (lambda g: DeviceKV.from_caches(GEO, g[0][:1], g[1][:1]), ValueError, "layers"),
        (lambda g: DeviceKV.from_caches(GEO, g[0], g[1][:, :8]), ValueError, "slots"),
        (lambda g: DeviceKV.from_caches(GEO, g[0][..., :4], g[1]), ValueError, "shape"),
        (lambda g: DeviceKV.from_caches(GEO, "k", g[1]), TypeError, "k_cache"),
        (
            lambda g: DeviceKV.from_caches(GEO, g[0].transpose(2, 3), g[1]),
            ValueError,
            "shape",
        ),
        (lambda g: DeviceKV.from_vllm(GEO, [g[0]]), ValueError, "expected"),
        (
            lambda g: DeviceKV.from_caches(KVGeometry.mla(2, 4, 16), g[0], g[1]),
            ValueError,
            "latent",
        ),
    ],
)
def test_device_kv_validation(build, exc, match):
    groups = device_caches(GEO, 16)
    with pytest.raises(exc, match=match):
        build(groups)


def test_non_contiguous_rows_rejected():
    geo = KVGeometry(2, 4, 2, 8, "bf16")
    k = torch.empty(2, 16, 8, 2, dtype=geo.dtype).transpose(2, 3)  # [.., 2, 8] with stride 1 != 1
    with pytest.raises(ValueError, match="contiguous"):
        DeviceKV.from_caches(geo, k, k)
