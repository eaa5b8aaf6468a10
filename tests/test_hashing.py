import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagekv.connector import KEY_BYTES, KeyNamespace, KVGeometry, page_keys

GEO = KVGeometry(4, 16, 2, 64, "bf16")
NS = KeyNamespace("llama-3-8b", GEO, tp_rank=0, tp_size=1)


def rand_tokens(n, hi=2**32):
    return [random.randrange(hi) for _ in range(n)]


def test_one_key_per_full_page():
    toks = rand_tokens(16 * 5 + 7)
    keys = page_keys(toks, NS)
    assert len(keys) == 5 and all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 5
    assert page_keys(toks[:15], NS) == []
    assert page_keys([], NS) == []


def test_prefix_stability():
    toks = rand_tokens(16 * 8)
    full = page_keys(toks, NS)
    for n in range(0, len(toks) + 1, 5):
        assert page_keys(toks[:n], NS) == full[: n // 16]
    assert page_keys(toks + rand_tokens(40), NS)[:8] == full


@pytest.mark.parametrize("page", [0, 3, 7])
def test_change_in_page_i_changes_keys_i_on_only(page):
    toks = rand_tokens(16 * 8)
    before = page_keys(toks, NS)
    pos = page * 16 + random.randrange(16)
    toks[pos] = (toks[pos] + 1) % 2**32
    after = page_keys(toks, NS)
    assert after[:page] == before[:page]
    assert all(a != b for a, b in zip(after[page:], before[page:]))


def test_list_numpy_torch_agree():
    toks = rand_tokens(16 * 6, hi=2**31)
    want = page_keys(toks, NS)
    assert page_keys(tuple(toks), NS) == want
    assert page_keys(np.array(toks, dtype=np.int64), NS) == want
    assert page_keys(np.array(toks, dtype=np.uint32), NS) == want
    assert page_keys(np.array(toks, dtype=">i8"), NS) == want  # big-endian input
    assert page_keys(torch.tensor(toks, dtype=torch.int64), NS) == want
    assert page_keys(torch.tensor(toks, dtype=torch.int32), NS) == want
    assert page_keys([np.int64(t) for t in toks], NS) == want
    assert page_keys(np.array(toks[::2] * 2)[::1], NS)  # views work


def test_max_token_ok():
    assert len(page_keys([2**32 - 1] * 16, NS)) == 1


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2, -1],
        [1, 2**32],
        [1, 2.0],
        [1, "a"],
        np.array([1, -5]),
        np.array([1.0, 2.0]),
        np.array([[1, 2]]),
        np.array([2**33], dtype=np.uint64),
        torch.tensor([1, -1]),
        torch.tensor([1.5]),
        torch.tensor([True]),
        "abc",
    ],
)
def test_bad_tokens_raise_value_error(bad):
    with pytest.raises(ValueError):
        page_keys(bad, NS)


def test_namespace_separates_keys():
    toks = rand_tokens(32)
    variants = [
        KeyNamespace("other-model", GEO),
        KeyNamespace("llama-3-8b", KVGeometry(4, 16, 2, 64, "fp16")),
        KeyNamespace("llama-3-8b", GEO, tp_rank=1, tp_size=2),
        KeyNamespace("llama-3-8b", GEO, tp_rank=0, tp_size=2),
    ]
    keys = {page_keys(toks, NS)[0], *(page_keys(toks, ns)[0] for ns in variants)}
    assert len(keys) == 1 + len(variants)


def test_mla_keys_rank_independent():
    mla = KVGeometry.mla(4, 16, 576)
    toks = rand_tokens(32)
    ranks = [KeyNamespace("ds", mla, r, 8) for r in range(8)] + [KeyNamespace("ds", mla)]
    assert len({tuple(page_keys(toks, ns)) for ns in ranks}) == 1


@pytest.mark.parametrize(
    "kwargs",
    [dict(model_id=""), dict(tp_rank=2, tp_size=2), dict(tp_rank=-1), dict(tp_size=0)],
)
def test_namespace_validation(kwargs):
    base = dict(model_id="m", geometry=GEO)
    with pytest.raises(ValueError):
        KeyNamespace(**{**base, **kwargs})
    with pytest.raises(TypeError):
        KeyNamespace("m", "not a geometry")
    with pytest.raises(TypeError):
        page_keys([1], "ns")


_CHILD = """
import json, sys
from pagekv.connector import KeyNamespace, KVGeometry, page_keys
toks = json.loads(sys.argv[1])
ns = KeyNamespace("llama-3-8b", KVGeometry(4, 16, 2, 64, "bf16"), tp_rank=0, tp_size=1)
print(json.dumps([k.hex() for k in page_keys(toks, ns)]))
"""


def test_cross_process_determinism():
    toks = rand_tokens(16 * 4)
    want = [k.hex() for k in page_keys(toks, NS)]
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(toks)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(out) == want
