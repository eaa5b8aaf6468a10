"""``mooncake://`` addresses and the frozen config of the Mooncake Store backend.

    mooncake://MASTER?metadata=META[&protocol=tcp|rdma][&device=mlx5_0,mlx5_1][&hostname=H]
                     [&segment=0][&local_buffer=16MiB][&replicas=1][&timeout_s=5]
                     [&prefix=pagekv][&master=...]

* ``MASTER``: the master's RPC address ``host:port`` (``mooncake_master --rpc_port``, default
  50051). With a highly available master (etcd), give the master address Mooncake takes as
  ``master=`` instead (e.g. ``master=etcd://10.0.0.1:2379``) and any name as ``MASTER``.
* ``metadata`` (required): the transfer engine's metadata server, as Mooncake takes it:
  ``http://host:8080/metadata`` (the master's ``--enable_http_metadata_server`` or
  ``mooncake_http_metadata_server``), ``etcd://host:2379``, ``redis://...`` or ``P2PHANDSHAKE``.
* ``protocol``: ``tcp`` (default) or ``rdma``; ``device``: the RDMA NICs (comma separated;
  several are aggregated), empty for TCP.
* ``hostname``: this client's address as others reach it (default: the local address of the
  route to the master).
* ``segment``: bytes of this process's memory it contributes to the store (default 0: a pure
  client; data lives in store processes such as ``mooncake_client``); ``local_buffer``: the
  client's own transfer buffer for copied (non-zero-copy) reads (default 16 MiB).
* ``replicas``: copies of each value (Mooncake's ``replica_num``); ``timeout_s``: bound on one
  master RPC and on a stalled transfer (sets Mooncake's ``MC_RPC_TIMEOUT_MS``,
  ``MC_TCP_PROGRESS_TIMEOUT_SEC`` and ``MC_TCP_STATUS_TIMEOUT_SEC`` where they are unset).
* ``prefix``: the first part of every object key (``PREFIX/<hex of pagekv's key>``), so that
  pagekv's objects never mix with other users of the same Mooncake Store.

Nothing here imports Mooncake: a bad address is a ``ConfigError`` on any machine.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, fields
from typing import Any

from pagekv.env import parse_float, parse_int, parse_size
from pagekv.errors import ConfigError

__all__ = ["MooncakeConfig"]

SCHEME = "mooncake://"
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeConfig:
    """A Mooncake Store and how this client uses it (see the module docstring)."""

    master: str
    metadata: str
    protocol: str = "tcp"
    device: str = ""
    hostname: str | None = None
    segment: int = 0
    local_buffer: int = 16 << 20
    replicas: int = 1
    timeout_s: float = 5.0
    prefix: str = "pagekv"
    workers: int = 4  # threads running data calls (gets, puts, deletes)
    lookup_workers: int = 2  # threads running EXISTS (lookups never queue behind transfers)
    max_call_bytes: int = 64 << 20  # a get or put is cut into Mooncake calls of at most this
    backoff_min_s: float = 0.25  # after the master failed a call, calls are misses at once
    backoff_max_s: float = 8.0  # ... for this long, doubling up to this

    def __post_init__(self) -> None:
        for name in ("master", "metadata", "prefix"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"mooncake store: '{name}' must be a non-empty string")
        if "/" in self.prefix or any(c.isspace() for c in self.prefix):
            raise ConfigError(f"mooncake store: 'prefix' has a '/' or a space: {self.prefix!r}")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"mooncake store: protocol must be one of {PROTOCOLS}, "
                              f"got {self.protocol!r}")  # fmt: skip
        if self.protocol == "rdma" and not self.device:
            raise ConfigError("mooncake store: protocol=rdma needs device=NIC[,NIC...]")
        for name in ("segment", "local_buffer", "max_call_bytes"):
            try:
                object.__setattr__(self, name, parse_size(getattr(self, name)))
            except ValueError as e:
                raise ConfigError(f"mooncake store: '{name}': {e}") from None
        for name in ("replicas", "workers", "lookup_workers"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= 64:
                raise ConfigError(f"mooncake store: '{name}' must be an int in [1, 64], "
                                  f"got {value!r}")  # fmt: skip
        for name in ("timeout_s", "backoff_min_s", "backoff_max_s", "max_call_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"mooncake store: '{name}' must be > 0, got {value!r}")
        if self.backoff_min_s > self.backoff_max_s:
            raise ConfigError("mooncake store: backoff_min_s must be <= backoff_max_s")

    @classmethod
    def parse(
        cls, address: str, *, replicas: int | None = None, timeout_s: float | None = None
    ) -> MooncakeConfig:
        """From a ``mooncake://`` address; ``replicas``/``timeout_s`` are defaults that the
        address's own parameters override. ``ConfigError`` names what is wrong."""
        if not isinstance(address, str) or not address.startswith(SCHEME):
            raise ConfigError(f"not a mooncake:// address: {address!r}")
        parts = urllib.parse.urlsplit(address)
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
        repeated = sorted(k for k, v in query.items() if len(v) > 1)
        if repeated:
            raise ConfigError(f"{address!r}: parameter(s) {repeated} given more than once")
        values: dict[str, Any] = {k: v[0] for k, v in query.items()}
        known = {f.name for f in fields(cls)} - {"master"}
        unknown = sorted(set(values) - known - {"master"})
        if unknown:
            raise ConfigError(f"{address!r}: unknown parameter(s) {unknown}; known: "
                              f"{sorted(known | {'master'})}")  # fmt: skip
        master = values.pop("master", None) or parts.netloc
        if not master:
            raise ConfigError(f"{address!r}: no master (mooncake://HOST:PORT?metadata=...)")
        if "metadata" not in values:
            raise ConfigError(f"{address!r}: needs metadata=... (the transfer engine's metadata "
                              "server, e.g. http://HOST:8080/metadata, etcd://HOST:2379 or "
                              "P2PHANDSHAKE)")  # fmt: skip
        parsers = {"replicas": parse_int, "workers": parse_int, "lookup_workers": parse_int,
                   "timeout_s": parse_float, "backoff_min_s": parse_float,
                   "backoff_max_s": parse_float}  # fmt: skip
        for name, parse in parsers.items():
            if name in values:
                try:
                    values[name] = parse(values[name])
                except ValueError as e:
                    raise ConfigError(f"{address!r}: '{name}': {e}") from None
        if replicas is not None:
            values.setdefault("replicas", replicas)
        if timeout_s is not None:
            values.setdefault("timeout_s", timeout_s)
        if values.get("hostname") == "":
            values["hostname"] = None
        return cls(master=master, **values)

    @property
    def name(self) -> str:
        """How logs name this store."""
        return f"mooncake://{self.master}"
