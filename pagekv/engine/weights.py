"""Building the model: random weights from a seed, or a transformers-format directory
(``config.json`` + ``model.safetensors`` / sharded ``model-*.safetensors`` with an index, or
``pytorch_model.bin``).

safetensors is read here directly (an 8-byte header length, a JSON header of dtype / shape /
byte range per tensor, then the raw bytes), through a private memory map: the format is that
small, and the engine then needs no extra package.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch

from pagekv.errors import ConfigError

from .config import ModelConfig
from .model import Llama, Rotary

__all__ = ["build_model", "read_safetensors"]

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of one ``.safetensors`` file, as CPU tensors over a copy-on-write memory map
    (nothing is read until used). Raises ``ConfigError`` for a malformed file."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    size = int.from_bytes(mapped[:8], "little")
    if not 0 < size <= len(mapped) - 8:
        raise ConfigError(f"{path}: not a safetensors file (header size {size})")
    header = json.loads(mapped[8 : 8 + size])
    data = torch.frombuffer(mapped, dtype=torch.uint8)[8 + size :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ConfigError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        raw = data[begin:end]
        itemsize = dtype.itemsize
        if begin % itemsize:
            raw = raw.clone()  # a view of another dtype needs an aligned start
        out[name] = raw.view(dtype).reshape(meta["shape"])
    return out


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).exists():
            return [directory / name]
    raise ConfigError(f"{directory}: no model.safetensors(.index.json) or pytorch_model.bin")


def _load_state(model: Llama, directory: Path) -> None:
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for file in _checkpoint_files(directory):
        if file.suffix == ".safetensors":
            tensors = read_safetensors(file)
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        for name, tensor in tensors.items():
            if name not in params:
                continue  # e.g. rotary inv_freq buffers of older checkpoints
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ConfigError(
                    f"{file.name}: {name} has shape {tuple(tensor.shape)}, the config says "
                    f"{tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            seen.add(name)
    if model.config.tie_word_embeddings:
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise ConfigError(
            f"{directory}: missing weights {missing[:4]}{'...' if len(missing) > 4 else ''}"
        )


@torch.no_grad()
def build_model(
    config: ModelConfig,
    *,
    max_position: int,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    weights: str | Path | None = None,
) -> Llama:
    """A :class:`Llama` on ``device`` in ``dtype`` with RoPE tables for ``max_position``
    positions: weights from ``weights`` (a transformers directory) or random from ``seed``.
    The meta device keeps an 8B model from ever being materialised twice."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Llama(config)
    model = model.to(dtype).to_empty(device=device)
    model.fuse()  # before the weights are written: they go through the views
    model.tie_weights()
    if weights is None:
        model.init_random(seed)
    else:
        _load_state(model, Path(weights))
    model.rotary = Rotary(config, max_position, device)
    return model.eval().requires_grad_(False)
