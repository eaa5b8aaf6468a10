"""The masked attention a captured decode step runs (pagekv.engine.decode_graph), on CPU:
the same output as the eager decode's attention over the request's first ``pos + 1`` rows,
with query heads grouped per K/V head. The graphs themselves run in tests/gpu."""

import pytest
import torch

from pagekv.engine import PRESETS, EngineConfig
from pagekv.engine.attention import attention
from pagekv.engine.decode_graph import _MaskedAttention, _Static
from pagekv.engine.kv_cache import PagedKVCache
from pagekv.errors import ConfigError
from pagekv.geometry import KVGeometry


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("pos", [0, 5, 37])
def test_masked_rows_attend_like_the_eager_decode(heads, kv_heads, pos):
    geo = KVGeometry(2, 16, kv_heads, 32, "fp32")
    cache = PagedKVCache(geo, 8, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    base, length = 32, 48  # the request's run of slots: [32, 80)
    i64 = {"dtype": torch.int64}
    st = _Static(
        token=torch.zeros(1, **i64), pos=torch.tensor([pos]), start=torch.zeros(1, **i64),
        out=torch.zeros(length, **i64), rows=torch.arange(length), base=base,
    )  # fmt: skip
    q, k, v = torch.randn(1, heads, 32), torch.randn(1, kv_heads, 32), torch.randn(1, kv_heads, 32)
    out_loc = st.pos + st.base
    got = _MaskedAttention(cache, st, out_loc)(1, q, k, v)
    assert torch.equal(cache.k[1, base + pos], k[0]) and torch.equal(cache.v[1, base + pos], v[0])
    rows = slice(base, base + pos + 1)
    want = attention(q, cache.k[1, rows], cache.v[1, rows])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_graphs_need_cuda():
    with pytest.raises(ConfigError, match="CUDA"):
        EngineConfig(PRESETS["tiny"], decode_graphs=True)
    assert EngineConfig(PRESETS["tiny"]).decode_graphs is False
