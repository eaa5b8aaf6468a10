"""Helpers for the real-vLLM tests: a tiny random Llama on disk, engine processes driven over
stdin/stdout (``vllm_engine_proc.py``), and the comparison of two runs.

Everything here runs in the pytest process; vLLM itself only runs in the engine processes.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINE_PROC = Path(__file__).with_name("vllm_engine_proc.py")
BLOCK = 128  # vLLM CPU's default block size: a page of the store is one block
# prompts whose reference outputs (an engine without the connector) the tests need, per weights
# ("good": make_tiny_llama seed 1, "other": seed 2); modules register theirs at import
REFERENCE: dict[str, dict[str, list[int]]] = {"good": {}, "other": {}}


def random_prompts(seed: int, lengths: dict[str, int]) -> dict[str, list[int]]:
    """Token ids in [3, 512) (the tiny model's vocabulary less its special ids), per name."""
    rng = random.Random(seed)
    return {name: [rng.randrange(3, 512) for _ in range(n)] for name, n in lengths.items()}


def make_tiny_llama(path: Path, seed: int) -> Path:
    """A random-weight Llama (2 layers, 4 heads / 2 KV heads, head_dim 32, vocab 512, fp32)
    saved with transformers. Weights are drawn with a large std so that logits are peaked and
    greedy continuations vary from token to token (a small std repeats one token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


class Engine:
    """One vLLM engine in its own process, answering JSON commands (see vllm_engine_proc)."""

    def __init__(
        self,
        model: Path,
        *,
        store: list[str] | None,
        extra: dict | None = None,
        tp: int = 1,
        model_id: str | None = None,
        role: str = "kv_both",
        start_timeout_s: float = 240.0,
        kv_events: str | None = None,
    ) -> None:
        spec = dict(model=str(model), store=store, extra=extra or {}, tp=tp, model_id=model_id,
                    role=role, kv_events=kv_events)  # fmt: skip
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        # the engine core runs in the engine process (its scheduler is reachable for `stats`);
        # with TP > 1 the workers are processes of their own
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   TOKENIZERS_PARALLELISM="0", VLLM_LOGGING_STREAM="ext://sys.stderr")  # fmt: skip
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count()) for i in range(tp))
        logs = Path(os.environ.get("PAGEKV_VLLM_LOGS", tempfile.gettempdir()))
        self.log_path = logs / f"vllm-engine-{os.getpid()}-{id(self):x}.log"
        self._log = open(self.log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE_PROC), json.dumps(spec)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=REPO,
        )  # fmt: skip
        self.ready = self._read(start_timeout_s)

    def _read(self, timeout_s: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("@@"):
                    return json.loads(line[2:])
            elif self.proc.poll() is not None:
                break
        raise RuntimeError(f"engine gave no answer within {timeout_s} s; log tail:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])

    def call(self, cmd: str, timeout_s: float = 180.0, **args: Any) -> dict:
        self.proc.stdin.write(json.dumps(dict(cmd=cmd, **args)) + "\n")
        self.proc.stdin.flush()
        out = self._read(timeout_s)
        if "error" in out:
            raise RuntimeError(f"engine: {out['error']}\nlog tail:\n{self.tail()}")
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, **kw: Any) -> list[dict]:
        return self.call("generate", prompts=prompts, max_tokens=max_tokens, **kw)["outputs"]

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout_s=timeout_s)
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def compare(got: dict, ref: dict) -> tuple[bool, float]:
    """(greedy tokens equal, largest top-20 logprob difference at the first generated token).
    A token in one top-20 and not the other counts as an infinite difference."""
    first_got, first_ref = got["logprobs"][0], ref["logprobs"][0]
    if set(first_got) != set(first_ref):
        diff = float("inf")
    else:
        diff = max(abs(first_got[t] - first_ref[t]) for t in first_ref)
    return got["tokens"] == ref["tokens"], diff
