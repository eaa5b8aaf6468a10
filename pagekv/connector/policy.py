"""Fetch or recompute: whether the part of a prefix that only the store holds is worth fetching.

A prefix found at admission has two parts: leading pages already in the host tier (always
used: a host -> device load runs at tens of GB/s, far above any break-even) and pages only in
the store, which must first cross the network. Those are fetched only when

    recompute_s  >=  threshold * (fetch_s + load_s)

* ``recompute_s``: the prefill time the store part would cost. Prefilling ``n`` new tokens after
  ``p`` cached ones costs ``n + n * (p + n / 2) / A`` token units (weight matmuls plus causal
  attention; ``A`` = the context length at which a token's attention FLOPs equal its matmul
  FLOPs, from the model's shape), times the seconds per unit measured on the engine's prefills.
* ``fetch_s``: bytes / store bandwidth measured on the prefetches that came from the store.
* ``load_s``: bytes / host -> device load bandwidth measured on the engine's loads.

Measurements are exponential moving averages; priors may be given. With nothing measured yet a
store hit is fetched (a probe, to measure), and after ``reprobe_after`` refusals in a row one
is fetched again, so a bandwidth that has recovered is noticed. :meth:`FetchPolicy.stats` shows
the counters, the estimates and the last decision with its inputs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import Any

from pagekv.errors import ConfigError

__all__ = ["FetchDecision", "FetchPolicy", "PolicyConfig"]

MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class PolicyConfig:
    """``mode``: ``auto`` (decide), ``always`` (fetch every store hit), ``never`` (host tier
    only). ``threshold``: how many times faster than recompute the fetch must be predicted to
    be (1.0: any gain). ``ema_alpha``: weight of a new measurement. Priors (None: unknown):
    ``store_gbps``, ``load_gbps``, ``prefill_tokens_per_s``. ``min_sample_tokens``: prefills
    shorter than this do not update the prefill speed (fixed costs and an under-filled GPU
    would make recompute look slower than it is, and so fetches look better).
    ``reprobe_after``: refusals in a row before one fetch is allowed to re-measure (0: never).
    ``min_deadline_s``: the least time a fetch is given before its prefill starts anyway."""

    mode: str = "auto"
    threshold: float = 1.0
    ema_alpha: float = 0.3
    store_gbps: float | None = None
    load_gbps: float | None = None
    prefill_tokens_per_s: float | None = None
    min_sample_tokens: int = 1024
    reprobe_after: int = 16
    min_deadline_s: float = 0.02

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"PolicyConfig.mode must be one of {MODES}, got {self.mode!r}")
        if not self.threshold > 0:
            raise ConfigError(f"PolicyConfig.threshold must be > 0, got {self.threshold}")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError(f"PolicyConfig.ema_alpha must be in (0, 1], got {self.ema_alpha}")
        for name in ("store_gbps", "load_gbps", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"PolicyConfig.{name} must be > 0 or None, got {value}")
        if self.min_sample_tokens < 1 or self.reprobe_after < 0 or self.min_deadline_s < 0:
            raise ConfigError(f"PolicyConfig: bad sample/reprobe/deadline settings {self}")


@dataclass(frozen=True)
class FetchDecision:
    """What to reuse of a prefix: ``use_tokens`` = the host part, plus the store part when
    ``fetch``. ``deadline_s``: how long the fetch may take (None: the engine's own bound).
    Predictions are None where an input was not measured yet."""

    prompt_tokens: int
    host_tokens: int
    store_tokens: int
    fetch: bool
    reason: str
    use_tokens: int
    predicted_fetch_s: float | None = None
    predicted_recompute_s: float | None = None
    deadline_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Ema:
    def __init__(self, alpha: float, prior: float | None) -> None:
        self.alpha, self.value, self.samples = alpha, prior, 0

    def add(self, sample: float) -> None:
        if not (sample > 0 and math.isfinite(sample)):
            return
        self.value = sample if self.value is None else (
            self.alpha * sample + (1 - self.alpha) * self.value
        )  # fmt: skip
        self.samples += 1


class FetchPolicy:
    """Decides, per request, whether to fetch the store part of a prefix (see module doc).

    ``bytes_per_token``: KV bytes of one token (all layers); ``attention_context``: the ``A``
    of the cost model (``math.inf``: attention ignored). Thread-safe.
    """

    def __init__(
        self,
        config: PolicyConfig | None = None,
        *,
        bytes_per_token: int,
        attention_context: float = math.inf,
    ) -> None:
        self.config = config or PolicyConfig()
        if bytes_per_token <= 0 or not attention_context > 0:
            raise ConfigError("FetchPolicy: bytes_per_token and attention_context must be > 0")
        self.bytes_per_token, self.attention_context = bytes_per_token, attention_context
        a = self.config.ema_alpha
        gbps = (self.config.store_gbps, self.config.load_gbps)
        self._store_bps = _Ema(a, gbps[0] * 1e9 if gbps[0] else None)
        self._load_bps = _Ema(a, gbps[1] * 1e9 if gbps[1] else None)
        tps = self.config.prefill_tokens_per_s
        self._s_per_unit = _Ema(a, 1.0 / tps if tps else None)
        self._lock = threading.Lock()
        self._refused_in_row = 0
        self.counters = dict.fromkeys(
            ("decisions", "store_hits", "fetch_accepted", "fetch_refused", "probes"), 0
        )
        self.last: FetchDecision | None = None

    # ---- the cost model --------------------------------------------------------------------
    def work(self, new_tokens: int, prefix_tokens: int) -> float:
        """Token units of prefilling ``new_tokens`` after ``prefix_tokens`` cached ones."""
        n, p = new_tokens, prefix_tokens
        return n + n * (p + n / 2) / self.attention_context

    def predict_prefill_s(self, new_tokens: int, prefix_tokens: int) -> float | None:
        s = self._s_per_unit.value
        return None if s is None else s * self.work(new_tokens, prefix_tokens)

    def _predict(self, prompt: int, host: int, store: int) -> tuple[float | None, float | None]:
        nbytes = store * self.bytes_per_token
        fetch = None if self._store_bps.value is None else nbytes / self._store_bps.value
        if fetch is not None and self._load_bps.value is not None:
            fetch += nbytes / self._load_bps.value
        s = self._s_per_unit.value
        recompute = None if s is None else s * (
            self.work(prompt - host, host) - self.work(prompt - host - store, host + store)
        )  # fmt: skip
        return fetch, recompute

    # ---- decisions -------------------------------------------------------------------------
    def decide(self, prompt_tokens: int, host_tokens: int, store_tokens: int) -> FetchDecision:
        """Whether to fetch the ``store_tokens`` that follow ``host_tokens`` in a prompt of
        ``prompt_tokens`` (the reusable prefix must leave at least one token to compute)."""
        if min(host_tokens, store_tokens) < 0 or host_tokens + store_tokens >= prompt_tokens:
            raise ConfigError(
                f"decide: prefix {host_tokens}+{store_tokens} must be shorter than the "
                f"prompt ({prompt_tokens} tokens)"
            )
        with self._lock:
            decision = self._decide(prompt_tokens, host_tokens, store_tokens)
            self.counters["decisions"] += 1
            if store_tokens:
                self.counters["store_hits"] += 1
                self.counters["fetch_accepted" if decision.fetch else "fetch_refused"] += 1
                self.counters["probes"] += decision.reason.startswith("probe")
            self.last = decision
            return decision

    def _decide(self, prompt: int, host: int, store: int) -> FetchDecision:
        fetch_s, recompute_s = self._predict(prompt, host, store)

        def out(fetch: bool, reason: str, deadline: float | None = None) -> FetchDecision:
            if store and not fetch:
                self._refused_in_row += 1
            elif store:
                self._refused_in_row = 0
            return FetchDecision(prompt, host, store, fetch, reason,
                                 host + (store if fetch else 0), fetch_s, recompute_s,
                                 deadline)  # fmt: skip

        mode = self.config.mode
        if not store:
            return out(False, "no store hit")
        if mode != "auto":
            return out(mode == "always", f"mode {mode}")
        if fetch_s is None or recompute_s is None:
            return out(True, "probe: bandwidth or prefill speed not measured yet")
        ratio = recompute_s / fetch_s if fetch_s > 0 else math.inf
        deadline = max(self.config.min_deadline_s, recompute_s)
        if ratio >= self.config.threshold:
            return out(True, f"fetch predicted {ratio:.2f}x faster than recompute", deadline)
        every = self.config.reprobe_after
        if every and self._refused_in_row + 1 >= every:
            return out(True, f"probe: re-measuring after {every} refusals", deadline)
        return out(False, f"fetch predicted {ratio:.2f}x recompute, threshold "
                          f"{self.config.threshold:g}")  # fmt: skip

    # ---- measurements ----------------------------------------------------------------------
    def observe_fetch(self, nbytes: int, seconds: float) -> None:
        """A prefetch brought ``nbytes`` from the store in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._store_bps.add(nbytes / seconds)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` went host -> device in ``seconds`` (time until the last layer was there)."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._load_bps.add(nbytes / seconds)

    def observe_prefill(self, new_tokens: int, prefix_tokens: int, seconds: float) -> None:
        """A prefill of ``new_tokens`` after ``prefix_tokens`` computed in ``seconds``."""
        if new_tokens >= self.config.min_sample_tokens and seconds > 0:
            with self._lock:
                self._s_per_unit.add(seconds / self.work(new_tokens, prefix_tokens))

    # ---- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters, the current estimates and the last decision (a JSON-able dict)."""
        with self._lock:
            s, store, load = self._s_per_unit, self._store_bps, self._load_bps
            return {
                **self.counters,
                "mode": self.config.mode,
                "threshold": self.config.threshold,
                "store_gbps": None if store.value is None else store.value / 1e9,
                "load_gbps": None if load.value is None else load.value / 1e9,
                "prefill_tokens_per_s": None if s.value is None else 1.0 / s.value,
                "samples": {"store": store.samples, "load": load.samples, "prefill": s.samples},
                "last": None if self.last is None else self.last.as_dict(),
            }
