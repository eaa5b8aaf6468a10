"""``pagekv serve``: settings, the checks a node must pass before it binds, and the run.

Checks beyond :class:`NodeConfig`: a capacity of at least 1 MiB and within this machine's memory
(``--force`` overrides the latter), CURVE files that exist and hold keys. Warnings, never given
for the default settings: binding beyond loopback without CURVE, ``'*'`` as the allowed client
keys, a ``--disk-capacity`` over the free space of its file system, a ``--max-block-size`` too
large for a disk segment. A disk tier directory that another node serves from (or that cannot
be used) is one error line and exit status 1.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import signal
from typing import Any

import zmq

from pagekv import env
from pagekv.errors import ConfigError

from ..config import CurveClientKeys, NodeConfig
from ..node.auth import ALLOW_ANY, load_allowed_keys, load_secret_cert
from .settings import MIN_CAPACITY, SIZE_HELP, Setting, format_size, memory_limit, node_settings

__all__ = ["LOG_LEVEL", "check_node", "node_config", "run_serve", "serve_extras", "serve_settings"]

log = logging.getLogger("pagekv.store.cli")
LOG_LEVEL = Setting("log_level", "info", "log level: debug, info, warning, error")


def serve_extras() -> list[Setting]:
    """Settings of a serving process that are not NodeConfig fields."""
    return [
        Setting(
            "metrics_port",
            None,
            "serve Prometheus /metrics and /health on this port (0: any free port)",
            "int",
        ),
        Setting("metrics_host", None, "address for --metrics-port (unset: the node's --host)"),
        Setting("force", False, "start even when --capacity exceeds this machine's memory", "bool"),
        LOG_LEVEL,
    ]


def serve_settings() -> list[Setting]:
    parent = Setting("parent_pid", None, "exit when this process dies (set by pagekv cluster)",
                     "int", sourced=False)  # fmt: skip
    return [*node_settings(), *serve_extras(), parent]


def node_config(values: dict[str, Any]) -> NodeConfig:
    """A NodeConfig from resolved settings; its errors name the flag (``--port``), not the field."""
    fields = {k: v for k, v in values.items() if k in NodeConfig.__dataclass_fields__}
    if (fields.get("curve_secret_key") is None) != (fields.get("curve_allow") is None):
        raise ConfigError("--curve-secret-key and --curve-allow go together (CURVE needs both)")
    try:
        return NodeConfig(**fields)
    except ValueError as e:
        text = re.sub(r"NodeConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))
        raise ConfigError(text.replace("NodeConfig: ", "")) from None


def _is_loopback(bind_address: str) -> bool:
    if bind_address.startswith("ipc://"):
        return True
    host = bind_address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: assume reachable from outside


def check_node(config: NodeConfig, *, force: bool, copies: int = 1) -> list[str]:
    """Raise :class:`ConfigError` for a config no node should start with; return warnings.
    ``copies``: nodes sharing this machine (``pagekv cluster``)."""
    if config.capacity < MIN_CAPACITY:
        raise ConfigError(
            f"--capacity {config.capacity} is {config.capacity} bytes, below the 1 MiB minimum; "
            f"give a unit ({SIZE_HELP}): e.g. 10GiB"
        )
    total, limit = config.capacity * copies, memory_limit()
    if total > limit and not force:
        what = f"{copies} nodes x {format_size(config.capacity)}" if copies > 1 else "--capacity"
        raise ConfigError(
            f"{what} = {format_size(total)} is more than this machine's memory "
            f"({format_size(limit)}); lower it, or pass --force to start anyway"
        )
    warnings = _disk_warnings(config, copies)
    if config.curve_secret_key is not None:
        load_secret_cert(config.curve_secret_key)
        if load_allowed_keys(config.curve_allow) is None:
            warnings.append("CURVE with --curve-allow '*': any client key is accepted; traffic "
                            "is encrypted but clients are not authenticated")  # fmt: skip
    elif not _is_loopback(config.bind_address):
        warnings.append(
            f"binding {config.bind_address} beyond loopback without CURVE: anyone who reaches "
            "this port can read and write every block; use --curve-secret-key and --curve-allow "
            "(pagekv keygen) or bind 127.0.0.1"
        )
    return warnings


def _disk_warnings(config: NodeConfig, copies: int) -> list[str]:
    if config.disk is None:
        return []
    out = []
    free, held = disk_space(config.disk)
    total = config.disk_capacity * copies
    if free is not None and total > free + held:
        what = f"{copies} nodes x " if copies > 1 else ""
        out.append(f"--disk-capacity {what}{format_size(config.disk_capacity)} is more than "
                   f"the free space where --disk {config.disk} is ({format_size(free)} free, "
                   f"{format_size(held)} held by its segments): the disk fills first, and the "
                   "tier then reclaims its oldest segments early")  # fmt: skip
    if config.max_block_size + (1 << 16) > config.disk_segment_size:
        out.append(f"--max-block-size {format_size(config.max_block_size)} leaves no room in a "
                   f"--disk-segment-size of {format_size(config.disk_segment_size)}: blocks "
                   "larger than a segment stay in memory only")  # fmt: skip
    return out


def disk_space(directory: str) -> tuple[int | None, int]:
    """Bytes free for this user on the file system ``directory`` is (or would be) on, or None
    when no ancestor exists; and bytes of the disk tier's files already in it."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None, 0
    held = 0
    if os.path.isdir(directory):
        for entry in os.scandir(directory):
            if entry.name.endswith((".seg", ".dir")) and entry.is_file():
                held += entry.stat().st_size
    return st.f_bavail * st.f_frsize, held


def _health_keys(node: Any) -> CurveClientKeys | None:
    """Keys for the node's own health PING: an ephemeral pair its authenticator admits."""
    if node.auth is None:
        return None
    public, secret = zmq.curve_keypair()
    if node.auth.allowed is not None:
        node.auth.allowed[public] = "pagekv-health-check"
    server_public, _ = load_secret_cert(node.config.curve_secret_key)
    return CurveClientKeys(server_public, public, secret)


def _describe_curve(config: NodeConfig) -> str:
    if config.curve_secret_key is None:
        return "CURVE off"
    if config.curve_allow == ALLOW_ANY:
        return "CURVE on, any client key"
    count = len(load_allowed_keys(config.curve_allow) or {})
    return f"CURVE on, {count} allowed client key{'s' if count != 1 else ''}"


def run_serve(values: dict[str, Any]) -> int:
    """Run one node until SIGINT/SIGTERM. ``values``: resolved :func:`serve_settings`."""
    from ..client.probe import probe
    from ..node.disk import DiskTierError
    from ..node.event_publisher import EventsBindError
    from ..node.memory import tune_malloc_for_blocks
    from ..node.metrics import node_metrics, ping_health
    from ..node.server import StoreNode
    from .lifecycle import announce, die_with_parent
    from .stacks import dump_stacks_on

    # first: a thread keeps the malloc arena it first allocated in (node/memory.py's rules)
    tuned = env.TUNE_MALLOC.get() and tune_malloc_for_blocks(arena_max=1)
    if values["parent_pid"] is not None:
        die_with_parent(values["parent_pid"])
    dump_stacks_on(signal.SIGUSR1)  # `kill -USR1`: where it is stuck (stacks.py's rules)
    config = node_config(values)
    for warning in check_node(config, force=values["force"]):
        log.warning("pagekv node: %s", warning)
    try:
        node = StoreNode(config)
    except zmq.ZMQError as e:
        where = e.endpoint if isinstance(e, EventsBindError) else config.bind_address
        log.error("pagekv node: cannot bind %s: %s", where, e)
        return 1
    except DiskTierError as e:
        log.error("pagekv node: %s", e)
        return 1
    node.install_signal_handlers()
    monitor = node.connections  # the node's guard owns the socket's one monitor and feeds it
    metrics = None
    if values["metrics_port"] is not None:
        keys = _health_keys(node)
        health = ping_health(
            lambda: probe(node.address, curve=keys, timeout_s=1.0),
            extra=lambda: {"disk_on": node.disk is not None and node.disk.on},
        )
        host = values["metrics_host"] or (config.host if config.endpoint is None else "127.0.0.1")
        try:
            metrics = node_metrics(node, monitor, host, values["metrics_port"], health)
        except OSError as e:
            log.error("pagekv node: cannot serve metrics on %s:%s: %s", host,
                      values["metrics_port"], e.strerror or e)  # fmt: skip
            node.close()
            monitor.stop()
            return 1
    disk = ""
    if config.disk is not None:
        disk = f", disk {config.disk} {format_size(config.disk_capacity)}"
        disk += "" if node.disk.on else f" (off: {node.disk.error})"
    log.info("pagekv node: %s, capacity %s%s, pid %d", _describe_curve(config),
             format_size(config.capacity), disk, os.getpid())  # fmt: skip
    extra = f" metrics {metrics.url}" if metrics else ""
    announce(f"pagekv node ready {node.address}{extra}")
    if tuned:  # after the ready line: the warmer's log line must not split it
        node.warm_heap()
    try:
        node.serve_forever()
    finally:
        if metrics is not None:
            metrics.close()
        monitor.stop()
    return 0


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="TOML file of settings (keys as the flags: capacity = \"4GiB\"); "
                        "flags and PAGEKV_* variables override it [env PAGEKV_CONFIG]")  # fmt: skip
