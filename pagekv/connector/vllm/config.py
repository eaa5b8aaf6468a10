"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``KVTransferConfig``.

    {"store": ["tcp://kv-store-0:7400"],   # required: store node endpoints
     "host_bytes": "4GiB",                 # host page pool per worker rank
     "load_async": false,                  # (n, True): load between steps, request waits
     "load_timeout_s": 2.0,                # bound on fetching one step's (or request's) pages
     "lookup_timeout_s": 0.05,             # bound on the scheduler's EXISTS per request
     "save": true, "load": true,           # turn either direction off
     "model_id": null,                     # key namespace; default: vLLM's model name
     "kv_layout": "auto",                  # GPU: ask vLLM for BLHNC; "none" leaves it to vLLM
     "layerwise": true,                    # GPU sync loads: wait per layer (PIECEWISE graphs)
     "flush_timeout_s": 10.0,              # shutdown: bound on writing back what is queued
     "replicas": 1, "store_timeout_s": 2.0,
     "max_pending_writes": 1024, "stats_log_s": 0}

Unknown keys are an error (a typo must not silently turn a feature off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagekv.errors import ConfigError
from pagekv.store import ClientConfig
from pagekv.store.config import parse_size

__all__ = ["VllmConnectorConfig"]

_LAYOUTS = ("auto", "none", "LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")


@dataclass(frozen=True)
class VllmConnectorConfig:
    """Validated connector settings. Raises ``ConfigError`` naming the bad key."""

    store: tuple[str, ...]
    host_bytes: int = 4 << 30
    load_async: bool = False
    load_timeout_s: float = 2.0
    lookup_timeout_s: float = 0.05
    save: bool = True
    load: bool = True
    model_id: str | None = None
    kv_layout: str = "auto"
    layerwise: bool = True
    flush_timeout_s: float = 10.0
    replicas: int = 1
    store_timeout_s: float = 2.0
    max_pending_writes: int = 1024
    stats_log_s: float = 0.0

    def __post_init__(self) -> None:
        store = self.store
        if isinstance(store, str):
            store = (store,)
        if not isinstance(store, (list, tuple)) or not store:
            raise ConfigError("extra_config 'store' must be a list of tcp:// endpoints")
        object.__setattr__(self, "store", tuple(store))
        try:
            object.__setattr__(self, "host_bytes", parse_size(self.host_bytes))
            self.client_config()
        except ValueError as e:
            raise ConfigError(f"extra_config: {e}") from None
        for name in ("load_async", "save", "load", "layerwise"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"extra_config '{name}' must be true or false")
        for name in ("load_timeout_s", "lookup_timeout_s", "store_timeout_s", "host_bytes",
                     "flush_timeout_s"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"extra_config '{name}' must be > 0, got {value!r}")
        if not isinstance(self.stats_log_s, (int, float)) or self.stats_log_s < 0:
            raise ConfigError(f"extra_config 'stats_log_s' must be >= 0, got {self.stats_log_s}")
        if not isinstance(self.max_pending_writes, int) or self.max_pending_writes < 1:
            raise ConfigError("extra_config 'max_pending_writes' must be an int >= 1")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ConfigError("extra_config 'model_id' must be a non-empty string")
        if self.kv_layout not in _LAYOUTS:
            raise ConfigError(f"extra_config 'kv_layout' must be one of {_LAYOUTS}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> VllmConnectorConfig:
        """From ``kv_connector_extra_config``; ``ConfigError`` for unknown or bad keys."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"extra_config: unknown keys {unknown}; known: {sorted(known)}")
        if "store" not in extra:
            raise ConfigError("extra_config needs 'store': a list of store node endpoints")
        return cls(**extra)

    def client_config(self) -> ClientConfig:
        return ClientConfig(self.store, replicas=self.replicas, timeout_s=self.store_timeout_s)
