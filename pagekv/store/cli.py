"""``pagekv`` command line: serve one node, launch a local cluster, print node stats, make keys.

pagekv serve --host 127.0.0.1 --port 7400 --capacity 4GiB
pagekv cluster --nodes 3 --base-port 7400 --capacity 1GiB
pagekv stats tcp://127.0.0.1:7400 tcp://127.0.0.1:7401
pagekv keygen DIR NAME                # CURVE certificate pair for --curve-* options
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import zmq

from .config import CurveClientKeys, NodeConfig, parse_size

__all__ = ["main"]

_D = NodeConfig()


def _serve(args: argparse.Namespace) -> int:
    from .server import StoreNode

    config = NodeConfig(
        host=args.host, port=args.port, endpoint=args.endpoint, capacity=args.capacity,
        max_block_size=args.max_block_size, max_message_size=args.max_message_size,
        verify_puts=not args.no_verify_puts, curve_secret_key=args.curve_secret_key,
        curve_allow=args.curve_allow, io_threads=args.io_threads,
    )  # fmt: skip
    node = StoreNode(config)
    node.install_signal_handlers()
    print(f"pagekv node ready {node.address}", file=sys.stderr, flush=True)
    node.serve_forever()
    return 0


def _cluster(args: argparse.Namespace) -> int:
    procs = []
    for i in range(args.nodes):
        cmd = [sys.executable, "-m", "pagekv.store.cli", "serve", "--host", args.host,
               "--port", str(args.base_port + i), "--capacity", str(args.capacity)]  # fmt: skip
        procs.append(subprocess.Popen(cmd))
    endpoints = " ".join(f"tcp://{args.host}:{args.base_port + i}" for i in range(args.nodes))
    print(f"pagekv cluster: {args.nodes} nodes: {endpoints}", file=sys.stderr, flush=True)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while not stopping and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=10) for p in procs]
    return 0 if stopping and all(c == 0 for c in codes) else 1


def _stats(args: argparse.Namespace) -> int:
    from .client import StoreClient
    from .routing import StoreUnavailable

    curve = None
    if args.curve_server_cert:
        curve = CurveClientKeys.from_files(args.curve_server_cert, args.curve_client_cert)
    cols = ("blocks", "bytes", "capacity", "hits", "misses", "evictions", "bytes_in", "bytes_out")
    print(f"{'node':32s} " + " ".join(f"{c:>12s}" for c in cols))
    failed = 0
    for ep in args.addresses:
        with StoreClient(ep, timeout_s=args.timeout, curve=curve) as client:
            try:
                stats = client.stats()[0]
            except StoreUnavailable:
                stats = None
        if stats is None:
            failed += 1
            print(f"{ep:32s} " + "unreachable".rjust(12))
            continue
        print(f"{ep:32s} " + " ".join(f"{stats.get(c, 0):>12}" for c in cols))
    return 1 if failed else 0


def _keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    os.makedirs(args.directory, exist_ok=True)
    public, secret = zmq.auth.create_certificates(args.directory, args.name)
    print(f"wrote {public} and {secret}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagekv", description="pagekv store nodes")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run one store node")
    s.add_argument("--host", default=_D.host, help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=_D.port)
    s.add_argument("--endpoint", default=None, help="tcp:// or ipc:// endpoint (overrides host)")
    s.add_argument("--capacity", type=parse_size, default=_D.capacity, help="e.g. 4GiB")
    s.add_argument("--max-block-size", type=parse_size, default=_D.max_block_size)
    s.add_argument("--max-message-size", type=parse_size, default=_D.max_message_size)
    s.add_argument("--no-verify-puts", action="store_true", help="skip checksums on PUT")
    s.add_argument("--curve-secret-key", default=None, help="server certificate (secret)")
    s.add_argument("--curve-allow", default=None, help="directory of allowed client certs")
    s.add_argument("--io-threads", type=int, default=_D.io_threads)
    s.set_defaults(func=_serve)
    c = sub.add_parser("cluster", help="launch N local nodes for development")
    c.add_argument("--nodes", type=int, default=3)
    c.add_argument("--host", default=_D.host)
    c.add_argument("--base-port", type=int, default=_D.port)
    c.add_argument("--capacity", type=parse_size, default=1 << 30)
    c.set_defaults(func=_cluster)
    t = sub.add_parser("stats", help="print a table of node stats")
    t.add_argument("addresses", nargs="+", help="tcp://host:port ...")
    t.add_argument("--timeout", type=float, default=2.0)
    t.add_argument("--curve-server-cert", default=None)
    t.add_argument("--curve-client-cert", default=None)
    t.set_defaults(func=_stats)
    k = sub.add_parser("keygen", help="create a CURVE certificate pair")
    k.add_argument("directory")
    k.add_argument("name")
    k.set_defaults(func=_keygen)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, zmq.ZMQError) as e:
        print(f"pagekv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
