"""The weights fingerprint in the vLLM connector's key namespace (pagekv.connector.vllm.identity),
without vLLM: model and load configs are stand-ins with the fields it reads, weight files are
small safetensors files written here."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagekv.connector.vllm.identity import model_identity, weights_fingerprint
from pagekv.errors import ConfigError


class HfConfig:
    def __init__(self, **fields) -> None:
        self.fields = dict(model_type="llama", hidden_size=128, **fields)

    def to_dict(self) -> dict:
        return dict(self.fields, _name_or_path="/somewhere", transformers_version="9.9")


def write_safetensors(path: Path, values: bytes, name: str = "w") -> None:
    """A one-tensor safetensors file: u64 header length, JSON header, the tensor's bytes."""
    header = json.dumps({name: {"dtype": "U8", "shape": [len(values)],
                                "data_offsets": [0, len(values)]}}).encode()  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + values)


def model(path: Path, **kw) -> SimpleNamespace:
    fields = dict(model=str(path), revision=None, hf_config=HfConfig(), dtype="float32",
                  quantization=None, model_weights="")  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


LOAD = SimpleNamespace(load_format="auto", download_dir=None)


def fingerprint(path: Path, **kw) -> str:
    return weights_fingerprint(model(path, **kw), LOAD, "auto")


def test_new_weights_under_the_same_path_change_the_fingerprint(tmp_path):
    """Same file name, size and header, other values: the keys must change (vLLM's model
    name and path are the same, so on f1eb0b9 the keys did not)."""
    write_safetensors(tmp_path / "m" / "model.safetensors", b"\x01" * 64)
    before = fingerprint(tmp_path / "m")
    assert fingerprint(tmp_path / "m") == before  # deterministic
    write_safetensors(tmp_path / "m" / "model.safetensors", b"\x02" * 64)
    os.utime(tmp_path / "m" / "model.safetensors", ns=(1, 1))  # even with an old mtime
    assert fingerprint(tmp_path / "m") != before


def test_a_copy_that_keeps_mtimes_fingerprints_the_same(tmp_path):
    write_safetensors(tmp_path / "a" / "model-00001.safetensors", b"\x01" * 64)
    write_safetensors(tmp_path / "a" / "sub" / "model-00002.safetensors", b"\x03" * 32)
    (tmp_path / "a" / "config.json").write_text("{}")
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # copy2: mtimes kept (another machine)
    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "c", copy_function=shutil.copyfile)
    assert fingerprint(tmp_path / "c") != fingerprint(tmp_path / "a")  # mtimes not kept


def test_hub_cache_files_are_named_by_their_blob(tmp_path):
    """Files of the Hugging Face cache link to blobs named by their content hash: two machines
    that downloaded the same revision (different mtimes) share keys; another blob does not."""

    def hub(root: Path, blob: str, values: bytes) -> Path:
        write_safetensors(root / "blobs" / blob, values)
        snapshot = root / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / blob)
        return snapshot

    one = hub(tmp_path / "one", "ab" * 32, b"\x01" * 64)
    two = hub(tmp_path / "two", "ab" * 32, b"\x01" * 64)
    os.utime(tmp_path / "two" / "blobs" / ("ab" * 32), ns=(5, 5))
    other = hub(tmp_path / "three", "cd" * 32, b"\x01" * 64)
    assert fingerprint(one) == fingerprint(two) != fingerprint(other)


def test_the_config_dtype_and_quantization_are_part_of_it(tmp_path):
    write_safetensors(tmp_path / "m" / "model.safetensors", b"\x01" * 64)
    base = fingerprint(tmp_path / "m")
    assert fingerprint(tmp_path / "m", hf_config=HfConfig(rope_theta=5e5)) != base
    assert fingerprint(tmp_path / "m", dtype="bfloat16") != base
    assert fingerprint(tmp_path / "m", quantization="fp8") != base
    other_path = tmp_path / "moved"
    shutil.copytree(tmp_path / "m", other_path)
    assert fingerprint(other_path) == base  # where the files live is not part of it


def test_weights_id_names_the_weights_or_opts_out(tmp_path):
    cfg = model(tmp_path / "nowhere")
    assert weights_fingerprint(cfg, LOAD, "sha256:abc") == "user:sha256:abc"
    assert weights_fingerprint(cfg, LOAD, "none") == "none"
    vllm = SimpleNamespace(model_config=cfg, load_config=LOAD)
    ident = model_identity(vllm, "my-model", "v7")
    assert ident == "my-model|weights=user:v7"  # a model_id keeps the weights part
    with pytest.raises(ConfigError, match="weights_id"):
        model_identity(vllm, "my-model", "auto")  # nothing there to fingerprint


def test_weights_that_cannot_be_located_are_a_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no weight files"):
        fingerprint(tmp_path / "empty")
    with pytest.raises(ConfigError, match="streamed"):
        fingerprint(tmp_path / "empty", model_weights="s3://bucket/model")
    dummy = SimpleNamespace(load_format="dummy", download_dir=None)
    assert weights_fingerprint(model(tmp_path / "empty"), dummy, "auto").startswith("auto:")
