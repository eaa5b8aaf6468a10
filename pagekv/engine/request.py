"""What the engine is asked (:class:`Request`) and what it answers (:class:`Result`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagekv.errors import ConfigError

__all__ = ["Request", "Result"]


@dataclass(frozen=True)
class Request:
    """A prompt to complete greedily with ``max_new_tokens`` tokens. ``reuse``: look the
    prompt's prefix up in the host tier and the store (else recompute it all); ``save``: save
    the prompt's full pages after prefill."""

    prompt: tuple[int, ...]
    max_new_tokens: int = 16
    reuse: bool = True
    save: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        prompt = tuple(int(t) for t in self.prompt)
        if not prompt or min(prompt) < 0:
            raise ConfigError("Request.prompt must be a non-empty list of token ids >= 0")
        object.__setattr__(self, "prompt", prompt)
        if isinstance(self.max_new_tokens, bool) or not (
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1
        ):
            raise ConfigError(
                f"Request.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"
            )


@dataclass
class Result:
    """One request's output and timings (seconds, wall clock).

    ``ttft_s``: from the call to the first token on the host (lookup, fetch, load and prefill
    included). ``reused_host`` / ``reused_store``: prompt tokens whose KV came from the host
    tier / the store instead of being computed. ``load_s``: until the reused KV's last layer
    was on the device; ``load_stall_s``: how long prefill waited for it. ``first_logits``:
    float32 CPU logits of the first generated token (owned by the caller).
    """

    name: str
    prompt_tokens: int
    tokens: list[int]
    ttft_s: float
    reused_host: int = 0
    reused_store: int = 0
    lookup_s: float = 0.0
    prefetch_s: float = 0.0
    load_s: float = 0.0
    load_stall_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    saved_pages: int = 0
    decision: dict[str, Any] | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def reused_tokens(self) -> int:
        return self.reused_host + self.reused_store

    @property
    def tier(self) -> str:
        if self.reused_host and self.reused_store:
            return "host+store"
        return "host" if self.reused_host else "store" if self.reused_store else "-"

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_s if steps and self.decode_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """A JSON-able dict of everything but the logits."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "first_logits"}
        out.update(reused_tokens=self.reused_tokens, tier=self.tier,
                   decode_tokens_per_s=self.decode_tokens_per_s)  # fmt: skip
        return out
