"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``KVTransferConfig``.

    {"store": ["tcp://kv-store-0:7400"],   # required: store node endpoints, or one
                                           # "mooncake://MASTER?metadata=..." (Mooncake Store)
     "host_bytes": "4GiB",                 # host page pool per worker rank
     "load_async": true,                   # a hit request waits off the step; false: in it
     "load_timeout_s": 2.0,                # bound on fetching one request's (or step's) pages
     "lookup_timeout_s": 0.05,             # bound on the scheduler's EXISTS per request
     "save": true, "load": true,           # turn a direction the role allows off
     "save_decode": false,                 # also save blocks holding generated tokens
     "resave_interval_s": 30.0,            # a block is checked or saved again at most this often
     "model_id": null,                     # key namespace; default: vLLM's model name
     "weights_id": "auto",                 # "auto": fingerprint of the loaded weight files;
                                           # a string: the user's name for these weights;
                                           # "none": no weight identity (unsafe, opt-out)
     "kv_layout": "auto",                  # GPU: ask vLLM for BLHNC; "none" leaves it to vLLM
     "layerwise": false,                   # GPU sync loads: wait per layer (PIECEWISE graphs)
     "flush_timeout_s": 10.0,              # shutdown: bound on writing back what is queued
     "replicas": 1, "store_timeout_s": 2.0,
     "max_pending_writes": 1024, "stats_log_s": 0}

Unknown keys are an error (a typo must not silently turn a feature off). The direction of
transfer comes from vLLM's ``kv_role`` (:func:`directions`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagekv.errors import ConfigError
from pagekv.store.backend import StoreConfig, store_config
from pagekv.store.config import parse_size

__all__ = ["ROLES", "VllmConnectorConfig", "directions"]

_LAYOUTS = ("auto", "none", "LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")
ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class VllmConnectorConfig:
    """Validated connector settings. Raises ``ConfigError`` naming the bad key."""

    store: tuple[str, ...]
    host_bytes: int = 4 << 30
    load_async: bool = True
    load_timeout_s: float = 2.0
    lookup_timeout_s: float = 0.05
    save: bool = True
    load: bool = True
    save_decode: bool = False
    resave_interval_s: float = 30.0
    model_id: str | None = None
    weights_id: str = "auto"
    kv_layout: str = "auto"
    layerwise: bool = False
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
            raise ConfigError("extra_config 'store' must be a list of tcp:// endpoints or a "
                              "mooncake:// address")  # fmt: skip
        object.__setattr__(self, "store", tuple(store))
        try:
            object.__setattr__(self, "host_bytes", parse_size(self.host_bytes))
            self.client_config()
        except ValueError as e:
            raise ConfigError(f"extra_config: {e}") from None
        for name in ("load_async", "save", "load", "layerwise", "save_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"extra_config '{name}' must be true or false")
        for name in ("load_timeout_s", "lookup_timeout_s", "store_timeout_s", "host_bytes",
                     "flush_timeout_s"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"extra_config '{name}' must be > 0, got {value!r}")
        for name in ("stats_log_s", "resave_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"extra_config '{name}' must be >= 0, got {value!r}")
        if not isinstance(self.max_pending_writes, int) or self.max_pending_writes < 1:
            raise ConfigError("extra_config 'max_pending_writes' must be an int >= 1")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ConfigError("extra_config 'model_id' must be a non-empty string")
        if not isinstance(self.weights_id, str) or not self.weights_id:
            raise ConfigError(
                "extra_config 'weights_id' must be \"auto\" (fingerprint the loaded weight "
                'files), "none" (no weight identity in the keys), or a non-empty string '
                "naming the weights"
            )
        if self.kv_layout not in _LAYOUTS:
            raise ConfigError(f"extra_config 'kv_layout' must be one of {_LAYOUTS}")
        if self.layerwise and self.load_async:
            raise ConfigError(
                "extra_config 'layerwise': true applies to loads made inside the step: set "
                "'load_async': false with it (layer-wise waits make vLLM use PIECEWISE CUDA "
                "graphs on every step)"
            )

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

    def client_config(self) -> StoreConfig:
        """The store backend's config: pagekv nodes or Mooncake Store (``ConfigError``)."""
        return store_config(self.store, replicas=self.replicas, timeout_s=self.store_timeout_s)


def directions(kv_role: str | None, cfg: VllmConnectorConfig) -> tuple[bool, bool]:
    """``(save, load)`` of an engine with vLLM's ``kv_role``: ``kv_producer`` saves and never
    loads, ``kv_consumer`` loads and never saves, ``kv_both`` does both; ``save``/``load``
    false turn a direction off further. Raises ``ConfigError`` for another role."""
    if kv_role not in ROLES:
        raise ConfigError(f"kv_role must be one of {ROLES} for pagekv, got {kv_role!r}")
    save = cfg.save and kv_role in ("kv_producer", "kv_both")
    load = cfg.load and kv_role in ("kv_consumer", "kv_both")
    return save, load
