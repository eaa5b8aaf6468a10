"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang passes the whole JSON object to the backend (``storage_config.extra_config``), minus the
keys its controller consumes itself. Ours are below; every other key is SGLang's or another
tool's and is left alone (a key that looks like a misspelling of ours is logged).

=====================  ========================  ==============================================
key                    default                   meaning
=====================  ========================  ==============================================
``store``              (required)                store node endpoint(s): "tcp://h:7400" or a list;
                                                 or "mooncake://MASTER?metadata=..." (Mooncake)
``replicas``           1                         copies of each page (1 .. number of nodes)
``timeout_s``          5.0                       one store round trip; a backend call waits at
                                                 most about ``(replicas + 2) * timeout_s``
``model_id``           SGLang's model name       the model part of the key namespace
``namespace``          ""                        any further namespace (checkpoint revision,
                                                 deployment); pages never cross namespaces
``skip_existing``      true                      one EXISTS before each PUT; present pages are
                                                 not sent again
``down_backoff_s``     [0.25, 8.0]               after a call finds the store unreachable, calls
                                                 answer "miss" at once for this long (doubling)
``curve_server_cert``  none                      CurveZMQ: the nodes' public certificate and
``curve_client_cert``  none                      this client's secret certificate (both or none)
=====================  ========================  ==============================================
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagekv.errors import ConfigError
from pagekv.store import ClientConfig, CurveClientKeys
from pagekv.store.backend import StoreConfig, store_config
from pagekv.store.mooncake.config import MooncakeConfig

__all__ = ["SGLangBackendConfig"]

log = logging.getLogger(__name__)

_OURS = (
    "store", "replicas", "timeout_s", "model_id", "namespace", "skip_existing",
    "down_backoff_s", "curve_server_cert", "curve_client_cert",
)  # fmt: skip


@dataclass(frozen=True)
class SGLangBackendConfig:
    """Validated backend settings. Raises :class:`ConfigError` naming the bad key."""

    store: tuple[str, ...]
    model_id: str
    replicas: int = 1
    timeout_s: float = 5.0
    namespace: str = ""
    skip_existing: bool = True
    down_backoff_s: tuple[float, float] = (0.25, 8.0)
    curve_server_cert: str | None = None
    curve_client_cert: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.store, str):
            object.__setattr__(self, "store", (self.store,))
        if not isinstance(self.store, (tuple, list)) or not all(
            isinstance(ep, str) for ep in self.store
        ):
            raise ConfigError(f"extra_config 'store' must be an endpoint or a list: {self.store!r}")
        object.__setattr__(self, "store", tuple(self.store))
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError("no model id: SGLang gave no model name and 'model_id' is not set")
        if not isinstance(self.namespace, str):
            raise ConfigError(f"extra_config 'namespace' must be a string: {self.namespace!r}")
        if not isinstance(self.skip_existing, bool):
            raise ConfigError(
                f"extra_config 'skip_existing' must be a bool: {self.skip_existing!r}"
            )
        low, high = _pair(self.down_backoff_s)
        object.__setattr__(self, "down_backoff_s", (low, high))
        if (self.curve_server_cert is None) != (self.curve_client_cert is None):
            raise ConfigError("extra_config: curve_server_cert and curve_client_cert go together")
        self.client_config()  # endpoints, replicas, timeout: the store's own checks

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, model_name: str | None
    ) -> SGLangBackendConfig:
        """Our keys from SGLang's extra config; ``model_name`` is SGLang's (the default id)."""
        extra = dict(extra or {})
        if "store" not in extra:
            raise ConfigError(
                "extra_config needs 'store': the pagekv node endpoint(s), "
                'e.g. "store": ["tcp://kv-store-0:7400"]'
            )
        for key in extra:
            close = difflib.get_close_matches(key, _OURS, n=1, cutoff=0.8)
            if key not in _OURS and close:
                log.warning("pagekv: extra_config key %r ignored (did you mean %r?)", key, close[0])
        values = {k: extra[k] for k in _OURS if k in extra}
        values.setdefault("model_id", model_name or "")
        if "down_backoff_s" in values:
            values["down_backoff_s"] = tuple(values["down_backoff_s"])
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"extra_config: {e}") from None

    def client_config(self) -> StoreConfig:
        """The store backend's settings: a :class:`ClientConfig` (pagekv nodes) or a
        ``MooncakeConfig`` (raises :class:`ConfigError` for bad values)."""
        cfg = store_config(self.store, replicas=self.replicas, timeout_s=self.timeout_s)
        if isinstance(cfg, MooncakeConfig):
            if self.curve_server_cert is not None:
                raise ConfigError("extra_config: CURVE keys apply to pagekv nodes, not to a "
                                  "mooncake:// store")  # fmt: skip
            return cfg
        try:
            curve = None
            if self.curve_server_cert is not None:
                curve = CurveClientKeys.from_files(self.curve_server_cert, self.curve_client_cert)
            return ClientConfig(
                self.store, replicas=self.replicas, timeout_s=self.timeout_s, curve=curve,
                backoff_min_s=self.down_backoff_s[0], backoff_max_s=self.down_backoff_s[1],
            )  # fmt: skip
        except (TypeError, ValueError, OSError) as e:
            raise ConfigError(f"extra_config: {e}") from None


def _pair(value: Any) -> tuple[float, float]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if not ok or not 0 < value[0] <= value[1]:
        raise ConfigError(
            f"extra_config 'down_backoff_s' must be [low, high], 0 < low <= high: {value!r}"
        )
    return float(value[0]), float(value[1])
