"""What a block's key must know about the computation that produced it, beyond its layout: the
weights vLLM actually loaded and the attention backend its layers actually run.

Weights (``weights_id``, default ``"auto"``): a fingerprint of the weight files under the model's
path (a local directory or file, or its snapshot in the Hugging Face cache), of the model config
vLLM runs with (``hf_config``, overrides included), the model dtype, the quantization method and
the load format. Per weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``,
... anywhere under the path) it takes the relative name and size and

* a file of the Hugging Face cache (a link into ``blobs/``): its blob name, the hub's content
  hash, so every machine that downloaded the same revision has the same fingerprint;
* any other file: its ``mtime_ns`` and a hash of its first bytes (for safetensors: the whole
  header, i.e. every tensor's name, dtype, shape and offsets). Rewriting a file changes its
  mtime, so new weights under the same path miss. A copy that keeps mtimes (``cp -p``,
  ``rsync -a``, ``tar`` in POSIX format) fingerprints the same on another machine; one that
  does not misses until ``weights_id`` names the weights.

Nothing reads the weights' bytes beyond those headers: start-up cost is a directory walk and a
few kilobytes per file, whatever the checkpoint's size. ``weights_id`` set to another string
uses that string instead (the user vouches that equal strings mean equal weights);
``"none"`` leaves the weights out of the keys (engines then share blocks whatever they loaded:
only for setups that guarantee it themselves). Weights that cannot be located (object
storage, a load format that reads no files) are a ``ConfigError`` asking for ``weights_id``.

Attention backend: the names of the backend classes of the model's KV layers, read from the
layers the worker built (so ``"auto"`` is resolved exactly as vLLM resolved it).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import xxhash

from pagekv.errors import ConfigError

__all__ = ["attention_backends", "model_identity", "weights_fingerprint"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".msgpack",
                   ".h5", ".tensors")  # fmt: skip
_HEAD_BYTES = 64 << 10  # bytes hashed of a file that is not safetensors
_MAX_HEADER = 100 << 20  # safetensors' own limit on its header


def _config_digest(hf_config: Any) -> str:
    """The model config vLLM runs with, less the parts that name where it came from."""
    try:
        raw = hf_config.to_dict()
    except Exception:  # not a transformers config: its public attributes
        raw = dict(vars(hf_config))
    canon = {k: v for k, v in raw.items() if not k.startswith("_") and k != "transformers_version"}
    try:
        text = json.dumps(canon, sort_keys=True, default=repr)
    except TypeError:  # keys of mixed types
        text = repr(sorted(canon.items(), key=lambda kv: str(kv[0])))
    return xxhash.xxh3_128_hexdigest(text.encode())


def _file_identity(path: Path, rel: str) -> list[Any]:
    """``[name, size, content id]`` of one weight file (see the module docstring)."""
    st = path.stat()  # follows the hub cache's links to the blob
    if path.is_symlink():
        target = Path(os.readlink(path))
        if target.parent.name == "blobs":  # Hugging Face cache: the blob's name is its hash
            return [rel, st.st_size, "blob:" + target.name]
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        head = f.read(8)
        digest.update(head)
        if path.suffix == ".safetensors" and len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            digest.update(f.read(min(n, _MAX_HEADER)))
        else:
            digest.update(f.read(_HEAD_BYTES))
    return [rel, st.st_size, st.st_mtime_ns, digest.hexdigest()]


def _weight_files(root: Path) -> list[tuple[Path, str]]:
    if root.is_file():
        return [(root, root.name)]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(WEIGHT_SUFFIXES):
                path = Path(dirpath) / name
                found.append((path, path.relative_to(root).as_posix()))
    return found


def _locate(model_config: Any, load_config: Any) -> Path:
    """Where vLLM read the weights from: the model path, or its Hugging Face cache snapshot."""
    if getattr(model_config, "model_weights", ""):
        raise ConfigError(
            f"pagekv cannot fingerprint weights streamed from {model_config.model_weights!r}: "
            "set extra_config 'weights_id' to a string naming these weights"
        )
    model = model_config.model
    if os.path.exists(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(
            model, revision=model_config.revision, local_files_only=True,
            cache_dir=getattr(load_config, "download_dir", None),
        )  # fmt: skip
    except Exception as e:
        raise ConfigError(
            f"pagekv cannot locate the weights of {model!r} (revision "
            f"{model_config.revision!r}) to fingerprint them ({type(e).__name__}: {e}); set "
            "extra_config 'weights_id' to a string naming these weights"
        ) from None
    return Path(snapshot)


def weights_fingerprint(model_config: Any, load_config: Any, weights_id: str) -> str:
    """The weights part of the key namespace (see the module docstring). Raises
    ``ConfigError`` when ``"auto"`` cannot tell which weights were loaded."""
    if weights_id == "none":
        return "none"
    if weights_id != "auto":
        return "user:" + weights_id
    load_format = str(getattr(load_config, "load_format", "auto"))
    parts: dict[str, Any] = dict(
        config=_config_digest(model_config.hf_config), dtype=str(model_config.dtype),
        quant=str(model_config.quantization), format=load_format,
    )  # fmt: skip
    if load_format != "dummy":  # dummy weights: a fixed seed, the config says it all
        root = _locate(model_config, load_config)
        files = _weight_files(root)
        if not files:
            raise ConfigError(
                f"pagekv found no weight files under {str(root)!r} to fingerprint; set "
                "extra_config 'weights_id' to a string naming these weights"
            )
        parts["files"] = [_file_identity(path, rel) for path, rel in files]
    text = json.dumps(parts, sort_keys=True)
    return "auto:" + xxhash.xxh3_128_hexdigest(text.encode())


def model_identity(vllm_config: Any, model_id: str | None, weights_id: str) -> str:
    """The ``model_id`` part of the key namespace: the model's name (``model_id`` or vLLM's
    model name and revision) and the weights fingerprint."""
    model = vllm_config.model_config
    name = model_id or model.model + (f"@{model.revision}" if model.revision else "")
    fingerprint = weights_fingerprint(model, vllm_config.load_config, weights_id)
    return f"{name}|weights={fingerprint}"


def attention_backends(vllm_config: Any, layer_names: list[str]) -> str:
    """The attention backend(s) of the KV layers as built in this worker: distinct backend
    names, sorted, ``+``-joined. Raises ``ConfigError`` if a layer cannot be found."""
    context = vllm_config.compilation_config.static_forward_context
    names = set()
    for layer in layer_names:
        module = context.get(layer)
        if module is None or not hasattr(module, "get_attn_backend"):
            raise ConfigError(f"pagekv: cannot tell the attention backend of layer {layer!r}")
        names.add(module.get_attn_backend().get_name())
    return "+".join(sorted(names))
