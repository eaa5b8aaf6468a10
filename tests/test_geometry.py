import pytest
import torch

from pagekv.connector import KVGeometry, KVKind, dtype_from_name


def test_mha_sizes_and_shapes():
    g = KVGeometry(32, 16, 8, 128, "bf16")
    assert g.dtype is torch.bfloat16 and g.kind is KVKind.MHA
    assert g.item_bytes == 8 * 128 * 2
    assert g.bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert g.page_bytes == 32 * 16 * 2 * 8 * 128 * 2
    assert g.host_page_shape == (32, 2, 16, 8, 128)
    assert torch.empty(g.host_page_shape, dtype=g.dtype).nbytes == g.page_bytes


def test_mla_sizes_and_shapes():
    g = KVGeometry.mla(61, 64, 576, torch.float16)
    assert g.is_mla and g.num_kv == 1 and g.num_kv_heads == 1
    assert g.host_page_shape == (61, 64, 576)
    assert g.page_bytes == 61 * 64 * 576 * 2
    assert g.device_layer_shape == (576,)


def test_fingerprint_stable_and_distinct():
    a = KVGeometry(32, 16, 8, 128, "bf16")
    assert a.fingerprint == KVGeometry(32, 16, 8, 128, torch.bfloat16).fingerprint
    others = [
        KVGeometry(31, 16, 8, 128, "bf16"),
        KVGeometry(32, 32, 8, 128, "bf16"),
        KVGeometry(32, 16, 4, 128, "bf16"),
        KVGeometry(32, 16, 8, 64, "bf16"),
        KVGeometry(32, 16, 8, 128, "fp16"),
        KVGeometry(32, 16, 1, 128, "bf16", KVKind.MLA),
    ]
    assert len({a.fingerprint, *(o.fingerprint for o in others)}) == 1 + len(others)


@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(page_size=-1), ValueError, "page_size"),
        (dict(num_kv_heads=2.0), TypeError, "num_kv_heads"),
        (dict(head_dim=True), TypeError, "head_dim"),
        (dict(dtype="int8"), ValueError, "dtype"),
        (dict(dtype=torch.int32), ValueError, "dtype"),
        (dict(kind="gqa"), ValueError, "kind"),
        (dict(kind=KVKind.MLA), ValueError, "num_kv_heads"),
        (dict(head_dim=1, num_kv_heads=1, dtype="fp16"), ValueError, "head_dim"),
    ],
)
def test_validation_names_field(kwargs, exc, field):
    base = dict(num_layers=2, page_size=4, num_kv_heads=2, head_dim=64, dtype="bf16")
    with pytest.raises(exc, match=field):
        KVGeometry(**{**base, **kwargs})


def test_frozen():
    g = KVGeometry(2, 4, 2, 64)
    with pytest.raises(AttributeError):
        g.num_layers = 3


def test_dtype_names():
    assert dtype_from_name("torch.float16") is torch.float16
    assert dtype_from_name("FP32") is torch.float32
    with pytest.raises(TypeError):
        dtype_from_name(3)
