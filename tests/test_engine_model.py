"""The reference engine's model against transformers' LlamaForCausalLM (same weights, fp32),
its weight loading, configs and paged cache allocator."""

import json

import pytest
import torch

from pagekv.engine import (
    PRESETS,
    CacheFull,
    Engine,
    EngineConfig,
    ModelConfig,
    PagedKVCache,
    Request,
    RopeScaling,
    read_safetensors,
)
from pagekv.errors import ConfigError

transformers = pytest.importorskip("transformers")

# GQA (4 query heads per KV head), Llama-3 RoPE scaling with a short original context so that
# all three frequency bands are exercised by prompts of a few hundred tokens
TINY = ModelConfig(
    vocab_size=300, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=8,
    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64),
    rms_norm_eps=1e-6, name="tiny-test",
)  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matmuls are too small to split: one thread is faster, and spares a
    shared machine's other cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_config(m: ModelConfig, **extra):
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        s = m.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position)  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=m.tie_word_embeddings,
        max_position_embeddings=4096, **extra,
    )  # fmt: skip


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def check_against_hf(engine, hf, prompt, new_tokens=6):
    """Prefill + decode through the paged cache vs one full transformers forward over the
    prompt and the generated tokens: logits of every generated position, greedy tokens."""
    result = engine.generate(Request(prompt, new_tokens, reuse=False, save=False))
    ref = hf_logits(hf, list(prompt) + result.tokens)
    torch.testing.assert_close(result.first_logits, ref[len(prompt) - 1], rtol=1e-4, atol=1e-5)
    assert result.tokens == ref[len(prompt) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_random_weights_match_transformers(batch_invariant):
    cfg = EngineConfig(TINY, num_slots=1024, batch_invariant=batch_invariant, prefill_chunk=32)
    engine = Engine(cfg)
    hf = transformers.LlamaForCausalLM(hf_config(TINY)).eval()
    hf.load_state_dict(engine.model.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(11)
    for length in (1, 5, 33, 300):  # one token, under a chunk, over one, many chunks
        check_against_hf(engine, hf, torch.randint(0, TINY.vocab_size, (length,), generator=gen))


@pytest.mark.parametrize("tied", [False, True])
def test_loads_a_transformers_directory(tmp_path, tied):
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(
        hf_config(ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": tied}))
    ).eval()
    hf.save_pretrained(tmp_path)  # safetensors, written by transformers
    model = ModelConfig.from_hf(tmp_path)
    assert (model.num_kv_heads, model.rope_scaling, model.tie_word_embeddings) == (
        2, TINY.rope_scaling, tied,
    )  # fmt: skip
    engine = Engine(EngineConfig(model, num_slots=512, weights=str(tmp_path)))
    prompt = torch.randint(0, TINY.vocab_size, (70,)).tolist()
    check_against_hf(engine, hf, prompt)


def test_safetensors_reader_round_trip_and_garbage(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
               "c": torch.arange(5, dtype=torch.int64)}  # fmt: skip
    safetensors_torch.save_file(tensors, tmp_path / "x.safetensors")
    back = read_safetensors(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError):
        read_safetensors(tmp_path / "bad.safetensors")


def test_missing_weights_and_bad_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(TINY).to_dict()))
    with pytest.raises(ConfigError, match="no model"):
        Engine(EngineConfig(TINY, num_slots=64, weights=str(tmp_path)))
    with pytest.raises(ConfigError):
        ModelConfig(100, 64, 128, 2, num_heads=6, num_kv_heads=4)  # heads not a multiple
    with pytest.raises(ConfigError):
        ModelConfig.from_hf({**hf_config(TINY).to_dict(), "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ConfigError):
        EngineConfig(TINY, page_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            EngineConfig(TINY, device="cuda")


def test_request_validation():
    engine = Engine(EngineConfig(PRESETS["tiny"], num_slots=64))
    with pytest.raises(ConfigError):
        engine.generate(Request([1, 2, 512]))  # outside the vocabulary
    with pytest.raises(ConfigError):
        engine.generate(Request(list(range(60)), max_new_tokens=8))  # more than the cache
    with pytest.raises(ConfigError):
        Request([], 4)
    with pytest.raises(ConfigError):
        Request([1], 0)
    assert engine.cache.free_pages == engine.cache.num_pages  # nothing leaked


def test_allocator_gives_lowest_pages_and_refuses_when_full():
    cache = PagedKVCache(EngineConfig(PRESETS["tiny"], page_size=4).geometry, 8, "cpu")
    a = cache.allocate(9)  # 3 pages
    b = cache.allocate(4)
    assert (a.pages, a.base, b.pages) == ([0, 1, 2], 0, [3])
    assert torch.equal(a.cpu, torch.arange(12))
    cache.free(a)
    c = cache.allocate(16)  # pages 0-2 and 4: not one run
    assert c.pages == [0, 1, 2, 4] and c.base == -1
    with pytest.raises(CacheFull):
        cache.allocate(20)
    assert cache.free_pages == 3  # a refused allocation takes nothing
    cache.free(b)
    cache.free(c)
    cache.free(c)  # a second free of the same table is a no-op
    assert cache.free_pages == 8 and cache.allocate(32).base == 0


def test_fused_weights_are_the_parameters():
    """Q/K/V and gate/up are one product each; the HF-named parameters are views of the fused
    weights, so loading a state dict (or any in-place write) reaches the forward."""
    engine = Engine(EngineConfig(TINY, num_slots=256))
    attn, mlp = engine.model.model.layers[1].self_attn, engine.model.model.layers[1].mlp
    stacked = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(attn.qkv_weight, stacked)
    assert torch.equal(mlp.gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    state = {k: torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    engine.model.load_state_dict(state)
    assert torch.equal(attn.qkv_weight[: attn.q_proj.weight.shape[0]],
                       state["model.layers.1.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(mlp.gate_up_weight[mlp.gate_proj.weight.shape[0] :],
                       state["model.layers.1.mlp.up_proj.weight"])  # fmt: skip
