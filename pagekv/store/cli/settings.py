"""Command-line settings: each one from a flag, else ``PAGEKV_<NAME>``, else the ``--config``
TOML file, else its default; and the checks a running node needs beyond :class:`NodeConfig`.
Values are parsed by the same typed parsers as the process-wide variables (:mod:`pagekv.env`).

Every :class:`NodeConfig` field is a setting (so a field added there gets a flag, an env var and a
config key without touching this file); commands add their own (``nodes``, ``metrics_port``...).
Values from every source go through the same parser, and an error names where the value came
from (``--capacity``, ``$PAGEKV_CAPACITY`` or ``node.toml: capacity``).

Sizes follow GNU coreutils: ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/``GiB``/``TiB`` are powers
of 1024, ``KB``/``MB``/``GB``/``TB`` powers of 1000, a bare number is bytes (``4G`` = ``4GiB`` =
4,294,967,296; ``4GB`` = 4,000,000,000).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagekv.env import parse_bool, parse_float, parse_int, parse_size
from pagekv.errors import ConfigError

from ..config import NodeConfig
from ..node.memory import memory_limit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 takes the backport (a dependency there)
    import tomli as tomllib

__all__ = [
    "MIN_CAPACITY",
    "Setting",
    "add_settings",
    "format_size",
    "markdown",
    "memory_limit",
    "node_settings",
    "resolve",
]

MIN_CAPACITY = 1 << 20
SIZE_HELP = "K/M/G/T and KiB/MiB/GiB/TiB = 1024^n, KB/MB/GB/TB = 1000^n, plain number = bytes"

# help text and kind of the NodeConfig fields; a field missing here still gets a setting
_NODE_HELP: dict[str, tuple[str, str]] = {
    "host": ("bind address; anything but loopback should use CURVE", "str"),
    "port": ("TCP port (0: any free port, printed when ready)", "int"),
    "endpoint": (
        "endpoint to bind instead of --host/--port: host:port, tcp://host:port or ipc://path",
        "str",
    ),
    "capacity": ("bytes of blocks kept before the least recently used are evicted", "size"),
    "max_block_size": ("largest block accepted", "size"),
    "max_message_size": (
        "largest payload of one request or reply (its blocks; the header is "
        "bounded apart, at 1 MiB)",
        "size",
    ),
    "max_keys": ("most keys in one request", "int"),
    "verify_puts": ("check each PUT block's checksum before storing it", "bool"),
    "high_watermark": ("fraction of capacity at which eviction starts", "float"),
    "low_watermark": (
        "fraction of capacity eviction brings usage down to (with --disk: "
        "unused, each PUT evicts what it needs)",
        "float",
    ),
    "curve_secret_key": ("CurveZMQ: this node's secret certificate (pagekv keygen)", "path"),
    "curve_allow": (
        "CurveZMQ: directory of allowed clients' public certificates (*.key), or '*' to allow "
        "any client key (traffic encrypted, clients not authenticated)",
        "path",
    ),
    "io_threads": ("ZeroMQ I/O threads (0: one per 4 cores, 1 to 4)", "int"),
    "stream_ports": (
        "also listen on one ephemeral TCP port per I/O thread and advertise them (PING), so a "
        "client's streams are served by different threads; off: the one port only",
        "bool",
    ),
    "verify_threads": ("threads checking large PUTs' checksums (0: half the cores, 1 to 8)", "int"),
    "socket_buffer": (
        "every connection's SO_SNDBUF/SO_RCVBUF bytes (ZeroMQ and lane); 0: TCP autotuning, "
        "except 256 KiB for the GET replies of a lane connection within one host",
        "size",
    ),
    "max_frames": ("most payload frames in one request", "int"),
    "window": ("requests a client may have outstanding on one connection", "int"),
    "recv_hwm": ("complete requests queued per connection before TCP pushes back", "int"),
    "max_connections": ("most client connections (kept below the descriptor limit)", "int"),
    "handshake_s": ("seconds a new connection has to complete its handshake", "float"),
    "heartbeat_s": (
        "seconds between ZMTP heartbeats, 0: off (a peer silent 3x as long is dropped)",
        "float",
    ),
    "guard_interval_s": ("seconds between connection and memory checks; 0: no guard", "float"),
    "shm": (
        "keep blocks in a shared-memory file under /dev/shm (mode 0600, its space reserved at "
        "start) that clients of the same user on this host read directly (LOCATE)",
        "bool",
    ),
    "bulk": (
        "take PUTs and GETs on a second, plain TCP port too (the bulk lane: values received "
        "straight into place at both ends; needs the native library; never with CURVE); off: "
        "ZeroMQ only",
        "bool",
    ),
    "bulk_port": ("TCP port of the bulk lane (0: any free port, advertised by PING)", "int"),
    "bulk_connections": ("bulk lane connections served at once; more are closed", "int"),
    "disk": (
        "disk tier: a directory of its own on a local disk (made if missing) where blocks "
        "evicted from memory are kept and found again after a restart; unset: memory only",
        "path",
    ),
    "disk_capacity": ("bytes the disk tier's files may take (needed with --disk)", "size"),
    "disk_segment_size": (
        "size of one disk segment file: the unit of writing and of reclaiming (oldest first)",
        "size",
    ),
    "disk_queue_size": (
        "evicted blocks waiting for the disk writer, in bytes (memory beyond --capacity; more "
        "are not written)",
        "size",
    ),
    "disk_read_threads": ("threads reading the disk tier (reads in flight)", "int"),
    "disk_promote": ("a block served from disk is put back into memory", "bool"),
    "disk_direct": (
        "read sealed disk segments with O_DIRECT (the page cache left alone), where the file "
        "system allows it",
        "bool",
    ),
    "shutdown_save_s": (
        "on SIGTERM/SIGINT, seconds to spend writing memory's blocks to the disk tier, most "
        "recently used first (0: none)",
        "float",
    ),
    "events_endpoint": (
        "KV events: publish the blocks this node stores and removes (vLLM's KV-event format, "
        "ZeroMQ PUB) on this endpoint, e.g. tcp://*:5557; unset: no events",
        "str",
    ),
    "events_replay_endpoint": (
        "KV events: answer replay requests for missed batches (ZeroMQ ROUTER) on this endpoint",
        "str",
    ),
    "events_topic": ("KV events: the topic frame of each event message", "str"),
    "events_buffer": ("KV events: batches kept for replay", "int"),
    "events_queue": (
        "KV events: keys waiting for the publisher thread; past it they are dropped (counted) "
        "and the node resends all it holds",
        "int",
    ),
}


@dataclass(frozen=True)
class Setting:
    """One setting. ``kind``: str, path, int, float, bool or size. ``sourced=False``: a flag
    only, never read from the environment or a config file (supervisor plumbing)."""

    name: str
    default: Any
    help: str
    kind: str = "str"
    sourced: bool = True

    def __post_init__(self) -> None:
        if self.kind not in _PARSERS:
            raise ConfigError(f"Setting {self.name}: unknown kind {self.kind!r}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return "PAGEKV_" + self.name.upper()


def _parse_size(value: Any) -> int:
    return parse_size(value if isinstance(value, int) else str(value))


_PARSERS = {"str": str, "path": str, "int": parse_int, "float": parse_float,
            "bool": parse_bool, "size": _parse_size}  # fmt: skip


def format_size(n: int | float) -> str:
    """``1536`` -> ``1.5KiB``; powers of 1024, no space (table columns stay split-able)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = str(int(value)) if unit == "B" else f"{value:.1f}".removesuffix(".0")
            return text + unit
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _kind_of(field: dataclasses.Field) -> str:
    default = field.default
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "size" if field.name.endswith(("_size", "_bytes", "capacity")) else "int"
    return "float" if isinstance(default, float) else "str"


def node_settings(exclude: Iterable[str] = ()) -> list[Setting]:
    """A setting per :class:`NodeConfig` field (but ``exclude``), defaults taken from it."""
    out = []
    for field in dataclasses.fields(NodeConfig):
        if field.name in exclude or field.default is dataclasses.MISSING:
            continue
        text, kind = _NODE_HELP.get(field.name, (f"NodeConfig.{field.name}", _kind_of(field)))
        out.append(Setting(field.name, field.default, text, kind))
    return out


def _describe_default(setting: Setting) -> str:
    value = setting.default
    if value is None:
        return "unset"
    if setting.kind == "bool":
        return "on" if value else "off"
    if setting.kind == "size" and value:
        return f"{format_size(value)} = {value:,} bytes"
    return str(value)


def add_settings(parser: argparse.ArgumentParser, settings: Sequence[Setting]) -> None:
    """One flag per setting, parsed later by :func:`resolve` (default None: "not given")."""
    for s in settings:
        where = f"; env {s.env_var}" if s.sourced else ""
        text = f"{s.help} [default: {_describe_default(s)}{where}]".replace("%", "%%")
        if s.kind == "bool":
            parser.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=None,
                                help=text)  # fmt: skip
        else:
            meta = {"size": "SIZE", "path": "PATH", "int": "N", "float": "X"}.get(s.kind, "TEXT")
            parser.add_argument(s.flag, default=None, metavar=meta, help=text)


def markdown(settings: Sequence[Setting]) -> str:
    """A table of ``settings`` (flag, variable, default, meaning) for the README."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for s in settings:
        if s.sourced:
            default = _describe_default(s).split(" = ")[0]
            text = s.help.replace("|", "\\|")
            rows.append(f"| `{s.flag}` | `{s.env_var}` | {default} | {text} |")
    return "\n".join(rows) + "\n"


def load_config_file(path: str) -> dict[str, Any]:
    """The top-level table of a TOML file, keys with ``-`` or ``_`` alike."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    return {key.replace("-", "_"): value for key, value in data.items()}


def resolve(
    args: argparse.Namespace,
    settings: Sequence[Setting],
    config_path: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Each setting's value: its flag, else ``PAGEKV_<NAME>``, else the config file, else the
    default. Raises :class:`ConfigError` naming the source of a bad value or an unknown key."""
    environ = os.environ if environ is None else environ
    file_values = load_config_file(config_path) if config_path else {}
    known = {s.name for s in settings if s.sourced}
    unknown = sorted(set(file_values) - known)
    if unknown:
        names = ", ".join(sorted(known))
        raise ConfigError(f"{config_path}: unknown setting(s) {', '.join(unknown)}; known: {names}")
    out: dict[str, Any] = {}
    for s in settings:
        raw, source = getattr(args, s.name, None), s.flag
        if raw is None and s.sourced and s.env_var in environ:
            raw, source = environ[s.env_var], f"${s.env_var}"
        if raw is None and s.sourced and s.name in file_values:
            raw, source = file_values[s.name], f"{config_path}: {s.name}"
        if raw is None:
            out[s.name] = s.default
            continue
        try:
            out[s.name] = _PARSERS[s.kind](raw)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    return out
