"""Session fixtures of the real-vLLM tests: the tiny models, and the reference outputs (an engine
without the connector, one per weights) of every prompt the modules register in
``vllm_fixtures.REFERENCE``. Nothing here starts before a test asks for it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .vllm_fixtures import REFERENCE, Engine, make_tiny_llama


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return SimpleNamespace(root=root, good=make_tiny_llama(root / "good", seed=1),
                           other=make_tiny_llama(root / "other", seed=2))  # fmt: skip


def _reference(path, prompts: dict[str, list[int]]) -> dict[str, dict]:
    engine = Engine(path, store=None)
    try:
        outs = engine.generate(list(prompts.values()))
    finally:
        engine.close()
    return dict(zip(prompts, outs))


@pytest.fixture(scope="session")
def reference(models):
    """name -> greedy tokens and first-token top-20 logprobs, with the seed-1 weights."""
    return _reference(models.good, REFERENCE["good"])


@pytest.fixture(scope="session")
def reference_other(models):
    """The same with the seed-2 weights."""
    return _reference(models.other, REFERENCE["other"])
