"""Configs of the reference engine: the model's shape and the engine's cache and paging.

``ModelConfig`` describes a Llama-architecture causal LM (presets for a tiny test model and the
shapes of Llama-3.2-1B and Llama-3-8B, or read from a transformers ``config.json``);
``EngineConfig`` the paged KV cache, the host tier and how prefill is cut into chunks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagekv.errors import ConfigError
from pagekv.geometry import KVGeometry, dtype_from_name

__all__ = ["PRESETS", "EngineConfig", "ModelConfig", "RopeScaling"]


def _positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (``rope_type: llama3``) for long contexts."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if not (self.factor >= 1 and self.high_freq_factor > self.low_freq_factor > 0):
            raise ConfigError(f"RopeScaling: bad factors {self}")
        _positive("RopeScaling", original_max_position=self.original_max_position)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama model: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    ``head_dim`` defaults to ``hidden_size // num_heads``. Raises ``ConfigError`` for a shape
    that cannot run (heads not dividing, an odd head_dim for RoPE, ...).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position: int = 131072
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _positive("ModelConfig", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                  num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                  head_dim=self.head_dim, max_position=self.max_position)  # fmt: skip
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ConfigError("ModelConfig: rope_theta and rms_norm_eps must be > 0")

    @property
    def num_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        per_layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size + 2 * h
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * per_layer + heads * self.vocab_size * h + h

    @property
    def attention_context(self) -> float:
        """Context length at which a token's attention FLOPs equal its matmul FLOPs: prefilling
        ``n`` tokens after ``p`` costs about ``n + n * (p + n / 2) / attention_context`` token
        matmul-units (used by the fetch-or-recompute policy)."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        matmul = 2 * self.num_layers * (h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size)
        attention_per_context_token = 4 * self.num_layers * self.num_heads * self.head_dim
        return matmul / attention_per_context_token

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | Path) -> ModelConfig:
        """From a transformers ``config.json`` (a dict, the file, or its directory)."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = json.loads(path.read_text())
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ConfigError(f"rope_type {kind!r} is not supported (default or llama3)")
        scaling = None
        if kind == "llama3":
            scaling = RopeScaling(
                float(rope["factor"]), float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]),
            )  # fmt: skip
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rope_theta=float(theta), rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=int(config.get("max_position_embeddings", 131072)),
            name=str(config.get("_name_or_path") or config.get("model_type") or "llama"),
        )  # fmt: skip


_LLAMA3_ROPE = RopeScaling(32.0, 1.0, 4.0, 8192)


def _preset(name: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int,
            dim: int, theta: float, **kw: Any) -> ModelConfig:  # fmt: skip
    return ModelConfig(vocab, hidden, inter, layers, heads, kv, dim, theta, name=name, **kw)


# fmt: off
PRESETS: dict[str, ModelConfig] = {
    # CPU tests and the CPU demo: fast enough for CI, still GQA (4 query heads per KV head)
    "tiny": _preset("tiny", 512, 128, 256, 2, 8, 2, 16, 10000.0),
    "small": _preset("small", 32000, 512, 1536, 8, 8, 2, 64, 500000.0),
    "llama-3.2-1b": _preset("llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, 64, 500000.0,
                            rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-3-8b": _preset("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, 128, 500000.0),
}
# fmt: on


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    ``num_slots``: token slots of the paged KV cache (rounded up to whole pages);
    ``host_pages``: pages of the connector's pinned host tier. ``prefill_chunk``: tokens per
    prefill forward. ``batch_invariant`` (default: on CPU) cuts prefill into chunks aligned to
    absolute multiples of ``prefill_chunk``, padded to full chunks, with each chunk's attention
    reading keys up to the chunk's end (zeros past the prompt): every token's computation then
    has the same shapes whether its prefix was recomputed or loaded, so reuse is bit-exact.
    Otherwise one chunk per ``prefill_chunk`` tokens of the suffix (fast; reuse matches
    recompute within rounding). ``decode_graphs`` (default: on CUDA) replays decode steps from
    CUDA graphs (:mod:`pagekv.engine.decode_graph`), as serving engines do; off, every step
    is launched from Python. ``seed`` makes random weights; ``weights`` loads a
    transformers-format directory instead. ``model_id`` names the weights in page keys
    (default: preset name and seed, or the weights directory's full path).
    """

    model: ModelConfig
    page_size: int = 16
    num_slots: int = 8192
    host_pages: int = 1024
    dtype: torch.dtype | str = "float32"
    device: str = "cpu"
    prefill_chunk: int = 0
    batch_invariant: bool | None = None
    decode_graphs: bool | None = None
    seed: int = 0
    weights: str | None = None
    model_id: str = ""
    prefetch_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _positive("EngineConfig", page_size=self.page_size, num_slots=self.num_slots,
                  host_pages=self.host_pages)  # fmt: skip
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"EngineConfig.dtype must be fp32, bf16 or fp16, got {self.dtype}")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("EngineConfig.device is cuda but CUDA is not available")
        if self.batch_invariant is None:
            object.__setattr__(self, "batch_invariant", device.type == "cpu")
        if self.decode_graphs is None:
            object.__setattr__(self, "decode_graphs", device.type == "cuda")
        elif self.decode_graphs and device.type != "cuda":
            raise ConfigError("EngineConfig.decode_graphs needs a CUDA device")
        chunk = self.prefill_chunk or (4 * self.page_size if self.batch_invariant else 16384)
        _positive("EngineConfig", prefill_chunk=chunk)
        object.__setattr__(self, "prefill_chunk", chunk)
        pages = math.ceil(self.num_slots / self.page_size)
        object.__setattr__(self, "num_slots", pages * self.page_size)
        if not self.model_id:
            # loaded weights: the directory's full path (two checkpoints of one shape must never
            # share pages; engines that keep the model elsewhere set model_id to share)
            source = (
                f"seed{self.seed}" if self.weights is None else str(Path(self.weights).resolve())
            )
            object.__setattr__(self, "model_id", f"{self.model.name}-{source}")
        if not self.prefetch_timeout_s > 0:
            raise ConfigError("EngineConfig.prefetch_timeout_s must be > 0")

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def geometry(self) -> KVGeometry:
        m = self.model
        return KVGeometry(m.num_layers, self.page_size, m.num_kv_heads, m.head_dim, self.dtype)

    def describe(self) -> str:
        m = self.model
        return (
            f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads}/"
            f"{m.num_kv_heads} heads x {m.head_dim}, {m.num_params / 1e6:,.1f}M params, "
            f"{str(self.dtype).removeprefix('torch.')} on {self.device}; "
            f"{self.num_slots} KV slots in pages of {self.page_size}"
        )
