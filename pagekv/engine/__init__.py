"""pagekv.engine: a small reference engine (Llama in plain torch, paged KV cache) that reuses
prefix KV through :class:`pagekv.connector.KVConnector`, for end-to-end tests, the demo and
the time-to-first-token benchmark. See :mod:`.engine` for the per-request flow."""

import pagekv._torch  # noqa: F401  (first: a clear ImportError when torch is missing)

from .config import PRESETS, EngineConfig, ModelConfig, RopeScaling
from .engine import Engine
from .kv_cache import CacheFull, PagedKVCache
from .model import Llama
from .request import Request, Result
from .weights import build_model, read_safetensors

__all__ = [
    "PRESETS",
    "CacheFull",
    "Engine",
    "EngineConfig",
    "Llama",
    "ModelConfig",
    "PagedKVCache",
    "Request",
    "Result",
    "RopeScaling",
    "build_model",
    "read_safetensors",
]
