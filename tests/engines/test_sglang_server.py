"""SGLang 0.5.23's real ``launch_server`` with pagekv as its storage tier, on CPU (issue 27).

Three server processes of a tiny random-weight Llama, started by SGLang's own start-up code
(tests/engines/sglang_server.py: ``prepare_server_args`` + ``run_server``, CPU stand-ins listed
there) with the README's launch line: W and R with pagekv on one ``pagekv serve`` node, P
without HiCache. W serves prompt A and backs its pages up to the node; R, which never saw A,
serves prompt B (A's 320-token prefix, another tail) and gets the prefix from storage; P
computes both. Greedy outputs of W and R equal P's. About 2-5 minutes on a 2-core machine,
almost all of it Python imports of the three servers' processes, which start at once.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PAGEKV_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="SGLang lives in its own venv: make test-sglang")

import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from pagekv.store import StoreClient
from pagekv.store.launch import start_nodes
from tests.cli_helpers import port_free
from tests.engines import sglang_stack as st

pytestmark = pytest.mark.slow
ROOT = str(Path(__file__).resolve().parents[2])
START_S = 600.0  # a server's start-up: imports of three processes on a loaded 2-core machine
PREFIX, TAIL, NEW = 320, 16, 16  # tokens: shared prefix (20 pages of 16), own tails, outputs


def tiny_llama(directory: Path) -> Path:
    """A 2-layer Llama with random weights (std 0.5, so greedy outputs depend on the context),
    float32, written with transformers; the server skips tokenizer init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


class Server:
    """One ``python -m tests.engines.sglang_server`` process tree on a free port."""

    def __init__(self, name: str, flags: list[str], log: Path) -> None:
        self.name, self.port = name, _free_port()
        cpu = ["--device", "cpu", "--attention-backend",
               "torch_native", "--skip-tokenizer-init", "--dtype", "float32",
               "--max-total-tokens", "4096", "--page-size", "16", "--hicache-ratio", "2",
               "--sleep-on-idle", "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engines.sglang_server", *flags, *cpu],
            cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.tail()}")
            if "error while attempting to bind" in self.log.read_text(errors="replace"):
                # uvicorn logs a failed bind and lingers: fail now, not at the deadline
                raise RuntimeError(f"{self.name} could not bind port {self.port}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready: {self.tail()}")
            time.sleep(1.0)  # polling a server's health endpoint while it starts

    def generate(self, ids: list[int]) -> dict:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW,
                                                      "ignore_eos": True}}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/generate", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.load(reply)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


_TAKEN: set[int] = set()


def _free_port(low: int = 15000, high: int = 21999) -> int:
    """A free port that only an explicit bind can take: below the kernel's ephemeral range
    (where ``bind(0)`` and every outgoing connection of the three servers draw theirs: one of
    those took a server's port between this choice and uvicorn's bind) and below the
    22000-29999 that SGLang draws its own ports from (``get_free_port_below_ephemeral``)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    candidates = [p for p in range(low, min(high, ephemeral_low - 1) + 1) if p not in _TAKEN]
    for port in random.sample(candidates, min(64, len(candidates))):
        if port_free(port):  # uvicorn binds with SO_REUSEADDR, as port_free tries it
            _TAKEN.add(port)
            return port
    raise RuntimeError(f"no free port in {low}-{high} below the ephemeral range")


def test_two_servers_share_a_prefix_through_pagekv(tmp_path):
    """W serves A and backs it up to pagekv; R (fresh, never saw A) serves B = A's prefix +
    another tail and loads the prefix from storage (SGLang's ``cached_tokens_details``); the
    outputs of both equal those of P, a server without HiCache."""
    model = tiny_llama(tmp_path / "tiny-llama")
    (node,) = start_nodes(1, "--capacity", "256MiB")
    servers: list[Server] = []
    try:
        pagekv = st.launch_flags(model, [node.address])
        servers = [Server("W", pagekv, tmp_path / "w.log"), Server("R", pagekv, tmp_path / "r.log"),
                   Server("P", ["--model-path", str(model)], tmp_path / "p.log")]  # fmt: skip
        deadline = time.monotonic() + START_S
        for server in servers:
            server.wait_ready(deadline)
        writer, reader, plain = servers
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        prefix = torch.randint(3, 512, (PREFIX,), generator=gen).tolist()
        prompt_a = prefix + torch.randint(3, 512, (TAIL,), generator=gen).tolist()
        prompt_b = prefix + torch.randint(3, 512, (TAIL,), generator=gen).tolist()

        out_a = writer.generate(prompt_a)
        with StoreClient(node.address) as client:  # W's write-back: A's 21 full pages
            deadline = time.monotonic() + 60
            while client.stats()[0]["blocks"] < (PREFIX + TAIL) // 16:
                assert time.monotonic() < deadline, writer.tail()
                time.sleep(0.1)  # polling the node's block count while W writes back
        out_b = reader.generate(prompt_b)
        details = out_b["meta_info"].get("cached_tokens_details") or {}
        assert details.get("storage", 0) == PREFIX, (out_b["meta_info"], reader.tail())
        ref_a, ref_b = plain.generate(prompt_a), plain.generate(prompt_b)
        assert out_a["output_ids"] == ref_a["output_ids"]
        assert out_b["output_ids"] == ref_b["output_ids"]
        assert len(set(ref_b["output_ids"])) > 1  # the model's outputs vary with the context
    finally:
        for server in servers:
            server.stop()
        node.stop()
