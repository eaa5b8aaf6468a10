"""A Llama-architecture causal LM in plain torch: RMSNorm, RoPE (optionally Llama-3 scaled),
grouped-query attention and a SwiGLU MLP. Parameter names follow transformers'
``LlamaForCausalLM``, so its state dicts load as they are.

The model knows nothing of paging: each attention layer hands its rotated ``q, k, v`` to an
``attention`` object (:class:`pagekv.engine.attention.PagedAttention`) that writes the new K/V
into the paged cache and attends over it.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, RopeScaling

__all__ = ["Attend", "Llama", "rope_inv_freq"]

INIT_STD = 0.02


class Attend(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [T, H, D]``, ``k/v [T, KVH, D]`` of the step's tokens -> output ``[T, H, D]``."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # one kernel on CUDA, not five
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of RoPE (float32), with Llama-3 scaling when given: long
    wavelengths are slowed by ``factor``, short ones kept, the band between interpolated."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv
    old = scaling.original_max_position
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


class Rotary(nn.Module):
    """cos/sin tables (float32) for positions ``[0, max_position)``, applied half-rotated."""

    def __init__(self, config: ModelConfig, max_position: int, device: torch.device) -> None:
        super().__init__()
        inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, head_dim]`` of ``positions`` in ``dtype``: made once per forward
        and shared by every layer (per layer it cost four more kernel launches each)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def _rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE of ``x [T, heads, head_dim]`` (any heads: Q, K or both at once)."""
    cos, sin = tables
    return x * cos + _rotate_half(x) * sin


def _fused(*linears: nn.Linear) -> torch.Tensor:
    """The weights of ``linears`` stacked into one tensor; each weight becomes a view of it."""
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        start += rows
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer, self.heads, self.kv_heads, self.head_dim = (
            layer,
            config.num_heads,
            config.num_kv_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        """One ``[(heads + 2 kv_heads) * head_dim, hidden]`` weight for Q, K and V: the three
        parameters become views into it (state dicts, loading and init write through them),
        and a forward makes one product and one RoPE launch for Q and K instead of two each:
        the engine's host time per layer is mostly launches."""
        self.qkv_weight = _fused(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend
    ) -> torch.Tensor:
        t, heads, kv_heads, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_weight)
        qk = _rope(qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), rope)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
        out = attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        """One weight for the gate and up products (see :meth:`SelfAttention.fuse`)."""
        self.gate_up_weight = _fused(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama(nn.Module):
    """Built on the meta device by :func:`pagekv.engine.weights.build_model`, which places it,
    fuses its projections (:meth:`fuse`), fills its weights and sets :attr:`rotary` (RoPE
    tables on the model's device)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: Rotary | None = None

    def fuse(self) -> None:
        """Fuse each layer's Q/K/V and gate/up weights (parameters stay, as views): call once
        the model is on its device, before its weights are filled."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Fill every parameter from ``seed`` (normal, std 0.02; norms 1): the same weights in
        every process on the same kind of device."""
        self.tie_weights()
        gen = torch.Generator(self.lm_head.weight.device).manual_seed(seed)
        for name, param in sorted(self.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=gen)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (after the final norm) of ``input_ids [T]`` at
        ``positions [T]``; ``attend`` reads and writes the KV cache."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, attend)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
