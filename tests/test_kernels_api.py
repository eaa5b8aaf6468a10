"""pagekv.kernels API on CPU: dispatch to the torch path, validation, store_kv semantics."""

import pytest
import torch

from pagekv.connector import HostPagePool, KVGeometry
from pagekv.kernels import (
    DeviceKV,
    copy_slots,
    copy_slots_ref,
    load,
    load_ref,
    save,
    save_ref,
    store_kv,
)
from tests.helpers import ALL_DTYPES, as_bits, bits_equal, poison_, random_tensor

GEO = KVGeometry(3, 4, 2, 16, "bf16")


def caches(geo, num_slots):
    shape = (geo.num_layers, num_slots, *geo.device_layer_shape)
    return [random_tensor(shape, geo.dtype) for _ in range(geo.num_kv)]


@pytest.mark.parametrize("geo", [GEO, KVGeometry.mla(2, 8, 64, "fp16")], ids=["mha", "mla"])
def test_cpu_dispatch_matches_reference(geo):
    groups = caches(geo, 40)
    kv = DeviceKV.from_caches(geo, *groups)
    a, b = HostPagePool(geo, 6, pin=False), HostPagePool(geo, 6, pin=False)
    poison_(a.buffer), poison_(b.buffer)
    ids = torch.tensor([4, 1, 3])
    slots = torch.randperm(40)[: 3 * geo.page_size].view(3, -1)
    assert save(kv, slots, a.buffer, ids) == "torch"
    save_ref(kv, slots, b.buffer, ids)
    assert bits_equal(a.buffer, b.buffer)
    out1 = [poison_(torch.empty_like(g)) for g in groups]
    out2 = [poison_(torch.empty_like(g)) for g in groups]
    assert load(a.buffer, ids, DeviceKV.from_caches(geo, *out1), slots, layer=1) == "torch"
    load_ref(a.buffer, ids, DeviceKV.from_caches(geo, *out2), slots, layer=1)
    assert all(bits_equal(x, y) for x, y in zip(out1, out2))


def test_cuda_backend_requested_on_cpu_is_an_error():
    kv = DeviceKV.from_caches(GEO, *caches(GEO, 8))
    pool = HostPagePool(GEO, 2, pin=False)
    for backend in ("kernel", "direct"):
        with pytest.raises(ValueError, match="needs CUDA"):
            load(pool.buffer, [0], kv, torch.arange(4), backend=backend)
    with pytest.raises(ValueError, match="backend must be one of"):
        save(kv, torch.arange(4), pool.buffer, [0], backend="fast")
    with pytest.raises(ValueError, match="num_blocks"):
        save(kv, torch.arange(4), pool.buffer, [0], num_blocks=0)


def test_validation_before_any_write():
    groups = caches(GEO, 8)
    kv = DeviceKV.from_caches(GEO, *groups)
    pool = HostPagePool(GEO, 2, pin=False)
    poison_(pool.buffer)
    before = pool.buffer.clone()
    with pytest.raises(IndexError, match="slot 8"):
        save(kv, torch.tensor([0, 1, 2, 8]), pool.buffer, [0])
    with pytest.raises(IndexError, match="page id 2"):
        save(kv, torch.arange(4), pool.buffer, [2])
    with pytest.raises(ValueError, match="page_ids repeat"):
        save(kv, torch.arange(8), pool.buffer, [1, 1])
    with pytest.raises(ValueError, match="slots repeat"):
        load(pool.buffer, [0], kv, torch.tensor([1, 1, 2, 3]))
    assert bits_equal(pool.buffer, before)


def test_copy_slots_cpu():
    src, dst = caches(GEO, 10), [poison_(torch.empty(3, 6, 2, 16, dtype=GEO.dtype)) for _ in "kv"]
    want = [d.clone() for d in dst]
    s, d = torch.tensor([9, 0, -1, 4]), torch.tensor([5, 1, 2, -1])
    copy_slots_ref(DeviceKV.from_caches(GEO, *src), s, DeviceKV.from_caches(GEO, *want), d)
    out = copy_slots(DeviceKV.from_caches(GEO, *src), s, DeviceKV.from_caches(GEO, *dst), d)
    assert out == "torch" and all(bits_equal(x, y) for x, y in zip(dst, want))
    with pytest.raises(ValueError, match="direct"):
        copy_slots(
            DeviceKV.from_caches(GEO, *src), s, DeviceKV.from_caches(GEO, *dst), d, backend="direct"
        )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_cpu_equals_index_put(dtype, index_dtype):
    tokens, slots = 7, 32
    k, v = random_tensor((tokens, 2, 8), dtype), random_tensor((tokens, 2, 8), dtype)
    kc, vc = (
        poison_(torch.empty(slots, 2, 8, dtype=dtype)),
        poison_(torch.empty(slots, 2, 8, dtype=dtype)),
    )
    loc = torch.randperm(slots)[:tokens].to(index_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    as_bits(want_k)[loc.long()] = as_bits(k)
    as_bits(want_v)[loc.long()] = as_bits(v)
    assert store_kv(k, v, kc, vc, loc) == "torch"
    assert bits_equal(kc, want_k) and bits_equal(vc, want_v)


def test_store_kv_skip_and_mla_and_strided_source():
    qkv = random_tensor((5, 3, 4, 16), torch.float16)  # k and v are views of a fused qkv output
    k, v = qkv[:, 1], qkv[:, 2]
    kc = poison_(torch.empty(9, 4, 16, dtype=torch.float16))
    vc = poison_(torch.empty(9, 4, 16, dtype=torch.float16))
    loc = torch.tensor([3, -1, 0, 8, -5])
    store_kv(k, v, kc, vc, loc)
    assert bits_equal(kc[[3, 0, 8]], k[[0, 2, 3]]) and bits_equal(vc[[3, 0, 8]], v[[0, 2, 3]])
    assert (as_bits(kc[[1, 2, 4, 5, 6, 7]]).view(torch.uint8) == 0xA5).all()
    latent, cache = (
        random_tensor((4, 576), torch.bfloat16),
        poison_(torch.empty(6, 576, dtype=torch.bfloat16)),
    )
    store_kv(latent, None, cache, None, torch.tensor([5, 0, 2, 1]))
    assert bits_equal(cache[[5, 0, 2, 1]], latent)


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(kc=a["kc"].float()), TypeError, "dtype"),
        (lambda a: a.update(v=a["v"][:, :1]), ValueError, "rows differ"),
        (lambda a: a.update(loc=a["loc"].float()), TypeError, "out_loc"),
        (lambda a: a.update(loc=a["loc"][:2]), ValueError, "tokens"),
        (lambda a: a.update(loc=a["loc"].view(1, -1)), ValueError, "1-D"),
        (lambda a: a.update(loc=torch.tensor([0, 1, 9])), IndexError, "slot 9"),
        (lambda a: a.update(v_cache=None), ValueError, "both v and v_cache"),
        (lambda a: a.update(k=a["k"].transpose(1, 2)), ValueError, "rows differ"),
        (
            lambda a: a.update(k=random_tensor((3, 8, 2), torch.bfloat16).transpose(1, 2)),
            ValueError,
            "contiguous",
        ),
    ],
)
def test_store_kv_errors_write_nothing(mutate, exc, match):
    args = dict(
        k=random_tensor((3, 2, 8), torch.bfloat16),
        v=random_tensor((3, 2, 8), torch.bfloat16),
        kc=poison_(torch.empty(9, 2, 8, dtype=torch.bfloat16)),
        vc=poison_(torch.empty(9, 2, 8, dtype=torch.bfloat16)),
        loc=torch.tensor([0, 4, 2]),
    )
    args["v_cache"] = args["vc"]
    mutate(args)
    kc0 = args["kc"].clone()
    with pytest.raises(exc, match=match):
        store_kv(args["k"], args["v"], args["kc"], args["v_cache"], args["loc"])
    assert bits_equal(args["kc"], kc0)


@pytest.mark.parametrize(
    "offset, stride_elems, want",
    [(0, 64, 16), (8, 64, 8), (4, 64, 4), (0, 68, 8), (0, 66, 4)],
    ids=["all-16", "layer-at-8", "layer-at-4", "stride-136B", "stride-132B"],
)
def test_access_width_is_the_widest_dividing_rows_strides_and_addresses(offset, stride_elems, want):
    """The kernels read 16, 8 or 4 bytes at a time: the widest that divides the row size, the
    slot stride, every layer's address and the host buffer's address."""
    from pagekv.kernels import ops

    geo = KVGeometry(2, 4, 1, 32, "bf16")  # 64-byte rows
    raw = torch.empty(4 * 2048 + 32, dtype=torch.uint8)
    base = (-raw.data_ptr()) % 16 + offset  # the layers start `offset` past a 16-byte line
    layers = []
    for i in range(geo.num_layers * geo.num_kv):  # 2 KiB apart: 8 rows of <= 136 B each fit
        at = base + i * 2048
        rows = raw[at : at + 8 * stride_elems * 2].view(torch.bfloat16).view(8, stride_elems)
        layers.append(rows[:, : geo.row_elems])
    kv = DeviceKV(geo, (tuple(layers[:2]), tuple(layers[2:])))
    assert kv.alignment % want == 0
    assert want == 16 or kv.alignment % (2 * want) != 0
    aligned_host = raw.data_ptr() + (-raw.data_ptr()) % 16
    assert ops._launch_shape(True, kv, aligned_host)[0] == want
    assert ops._launch_shape(True, kv, aligned_host + 4)[0] == 4
    with pytest.raises(ValueError, match="4-byte aligned"):
        ops._vector_width(kv.alignment, aligned_host + 2)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_geometry_element_size_is_the_dtypes(dtype):
    geo = KVGeometry(1, 1, 1, 4, dtype)
    assert geo.element_size == torch.empty((), dtype=dtype).element_size()
    assert geo.item_bytes == 4 * geo.element_size
