"""``pagekv`` command line (also ``python -m pagekv``).

pagekv serve --host 127.0.0.1 --port 7400 --capacity 4GiB [--metrics-port 9400]
pagekv cluster --nodes 3 --base-port 7400 --capacity 1GiB
pagekv stats [--json] 127.0.0.1:7400 127.0.0.1:7401
pagekv ping 127.0.0.1:7400
pagekv keygen DIR NAME [--force]      # CURVE certificate pair for the --curve-* options

``serve`` and ``cluster`` take every setting from a flag, else ``PAGEKV_<NAME>``, else the
``--config`` TOML file, else the default (:mod:`.settings`). Exit status: 0 success, 1 a node
failed or could not start, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import zmq

import pagekv
from pagekv import env
from pagekv.errors import ConfigError

from ..config import normalize_endpoint
from .nodes import client_settings
from .serve import LOG_LEVEL, add_config_flag, serve_settings
from .settings import SIZE_HELP, Setting, add_settings, resolve

__all__ = ["build_parser", "main"]

log = logging.getLogger("pagekv.store.cli")
_LEVELS = ("debug", "info", "warning", "error", "critical")
_EPILOG = (
    f"Sizes: {SIZE_HELP}. Settings of serve/cluster also come from PAGEKV_<NAME> and --config."
)


def _setup_logging(level: str) -> None:
    if level.lower() not in _LEVELS:
        raise ConfigError(f"--log-level {level!r}: one of {', '.join(_LEVELS)}")
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip


def _settings_of(command: str) -> list[Setting]:
    if command == "serve":
        return serve_settings()
    if command == "cluster":
        from .cluster import cluster_settings

        return cluster_settings()
    if command in ("stats", "ping"):
        return [*client_settings(), LOG_LEVEL]
    return [LOG_LEVEL]


def _run(args: argparse.Namespace) -> int:
    settings = _settings_of(args.command)
    config_path = getattr(args, "config", None) or (
        env.CONFIG.get() if args.command in ("serve", "cluster") else None
    )
    values = resolve(args, settings, config_path)
    _setup_logging(values["log_level"])
    if args.command == "serve":
        from .serve import run_serve

        return run_serve(values)
    if args.command == "cluster":
        from .cluster import Supervisor

        return Supervisor(values).run()
    if args.command in ("stats", "ping"):
        from .nodes import run_ping, run_stats

        try:
            addresses = [normalize_endpoint(endpoint) for endpoint in args.addresses]
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if args.command == "stats":
            return run_stats(values, addresses, args.json)
        if args.count < 1:
            raise ConfigError(f"--count must be >= 1, got {args.count}")
        return run_ping(values, addresses, args.count)
    return _keygen(args)


def _keygen(args: argparse.Namespace) -> int:
    from ..node.auth import write_keypair

    try:
        public, secret = write_keypair(args.directory, args.name, force=args.force)
    except FileExistsError as e:
        print(f"pagekv: {e}", file=sys.stderr)
        return 1
    print(f"wrote {public} (public: give it to peers) and {secret} (secret, mode 0600: keep it)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagekv", description="pagekv store nodes and tools",
                                 epilog=_EPILOG)  # fmt: skip
    ap.add_argument("--version", action="version", version=f"pagekv {pagekv.__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="run one store node", epilog=_EPILOG)
    add_config_flag(s)
    add_settings(s, serve_settings())
    c = sub.add_parser("cluster", help="run N local nodes under a supervisor", epilog=_EPILOG)
    add_config_flag(c)
    from .cluster import cluster_settings

    add_settings(c, cluster_settings())
    for name, text in (("stats", "print each node's stats"), ("ping", "check nodes answer")):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "addresses",
            nargs="+",
            metavar="ENDPOINT",
            help="host:port (or tcp://host:port, ipc://path) ...",
        )
        add_settings(p, [*client_settings(), LOG_LEVEL])
        if name == "stats":
            p.add_argument("--json", action="store_true", help="one JSON document on stdout")
        else:
            p.add_argument("--count", type=int, default=3, help="PINGs per node [default: 3]")
    k = sub.add_parser("keygen", help="create a CURVE certificate pair: NAME.key (public) and "
                       "NAME.key_secret (mode 0600)")  # fmt: skip
    k.add_argument("directory", help="where to write (created if missing)")
    k.add_argument("name", help="file name stem, no path separators")
    k.add_argument("--force", action="store_true", help="replace an existing pair")
    add_settings(k, [LOG_LEVEL])
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ValueError as e:  # ConfigError and the configs' own checks
        print(f"pagekv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, zmq.ZMQError) as e:
        print(f"pagekv {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before a command installed its own handler
        return 0 if args.command in ("serve", "cluster") else 130


if __name__ == "__main__":
    sys.exit(main())
