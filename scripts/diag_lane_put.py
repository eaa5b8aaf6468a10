"""Where one lane PUT stream spends its time: client and node timelines of the same round.

A node (child process) and one client with ``bulk_puts`` exchange rounds of 2 MiB values over
one lane connection. Both sides record, per request, on the host's wall clock:

* client: the hash wait (``request_header``: waits for a hash started ahead, or hashes), the
  send (``send_message``), the reply's head arriving;
* node: the request's head read, the payload received (``recv_values``: with staging, the
  whole ring pipeline), the reply sent.

Printed per variant: GB/s of the timed rounds, then the shares of the node's wall time spent
receiving payload, answering (store + reply) and idle (waiting for the next head), and the
rate while receiving; the client's shares hashing and sending. Against the hot and cold 1-stream
TCP ceilings of the same run. Variants: the node staging its receives or not, the client
hashing ahead (a copy pool) or inline (``copy_threads=1``).

    python scripts/diag_lane_put.py [--blocks 256] [--request-mib 16] [--rounds 5]
    python scripts/diag_lane_put.py --serve <pagekv serve args>   (the traced node; internal)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from _traced_node import TracedNode, serve_with_timeline

MIB = 1 << 20


def _trace(module, name: str, rows: list, tag: str) -> None:
    """Replace ``module.name`` by a wrapper appending (tag, start, end, thread) to ``rows``."""
    real = getattr(module, name)

    def traced(*args, **kwargs):
        t = time.time()
        try:
            return real(*args, **kwargs)
        finally:
            rows.append((tag, t, time.time()))

    setattr(module, name, traced)


def serve(argv: list[str]) -> int:
    """``pagekv serve`` with its lane's head reads, payload receives and reply sends traced,
    written at exit to ``$PAGEKV_DIAG_TIMELINE``."""
    from pagekv.store import bulk_server

    rows: list[tuple] = []
    for name, tag in (("read_head", "head"), ("recv_values", "recv"), ("send_message", "reply")):
        _trace(bulk_server, name, rows, tag)
    return serve_with_timeline(argv, rows)


def busy(rows: list, tag: str, start: float, end: float) -> float:
    """Seconds of [start, end] covered by the ``tag`` spans of ``rows``."""
    return sum(max(0.0, min(e, end) - max(s, start)) for t, s, e in rows if t == tag)


async def timed_rounds(client, blocks: list, rounds: int) -> list[tuple[float, float]]:
    spans = []
    for r in range(rounds + 1):
        keys = [f"r{r}-{i}".encode().ljust(16, b".") for i in range(len(blocks))]
        t = time.time()
        status = await client.put_many(keys, blocks)
        spans.append((t, time.time()))
        if any(s != 0 for s in status):
            raise RuntimeError(f"put failed: {set(status)}")
        await client.delete_many(keys)
    return spans[1:]  # the first round warms the connection and the node's heap


def variant(blocks: list, args, staged: bool, ahead: bool) -> dict:
    from pagekv.store import AsyncStoreClient, ClientConfig, bulk_client

    client_rows: list[tuple] = []
    saved = {n: getattr(bulk_client, n) for n in ("request_header", "send_message", "read_head")}
    for name, tag in (("request_header", "hash"), ("send_message", "send"),
                      ("read_head", "reply")):  # fmt: skip
        _trace(bulk_client, name, client_rows, tag)
    env = {"PAGEKV_STAGED_RECEIVE": "1" if staged else "0"}
    node = TracedNode(__file__, "--capacity", "1GiB", env=env)
    try:
        cfg = ClientConfig((node.address,), timeout_s=30, streams=1, bulk_puts=True,
                           copy_threads=8 if ahead else 1,
                           max_message_bytes=args.request_mib * MIB)  # fmt: skip
        client = AsyncStoreClient(node.address, config=cfg)
        spans = asyncio.run(timed_rounds(client, blocks, args.rounds))
        client.close()
    finally:
        for name, fn in saved.items():
            setattr(bulk_client, name, fn)
        node_rows = node.timeline()
    nbytes = sum(b.nbytes for b in blocks)
    walls = [e - s for s, e in spans]
    share = {}
    for side, rows, tags in (("node", node_rows, ("head", "recv", "reply")),
                             ("client", client_rows, ("hash", "send", "reply"))):  # fmt: skip
        for tag in tags:
            share[f"{side}_{tag}"] = round(sum(busy(rows, tag, s, e) for s, e in spans)
                                           / sum(walls), 3)  # fmt: skip
    recv_s = sum(busy(node_rows, "recv", s, e) for s, e in spans)
    put = nbytes / statistics.median(walls) / 1e9
    recv_rate = nbytes * len(spans) / recv_s / 1e9
    return dict(staged=staged, ahead=ahead, put_gbps=round(put, 3),
                recv_rate_gbps=round(recv_rate, 3), **share)  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--request-mib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _ceilings import tcp_ceiling

    from pagekv.store.memory import tune_malloc_for_blocks

    tune_malloc_for_blocks()
    size = 2 * MIB
    blocks = [memoryview(os.urandom(size)) for _ in range(args.blocks)]
    variants = [(True, True), (False, True), (True, False), (False, False)]
    for rep in range(args.repeat):
        hot = tcp_ceiling(1, size, args.blocks, 3)[0]
        cold = tcp_ceiling(1, size, args.blocks, 3, cold=True)[0]
        print(f"# repeat {rep}: 1-stream put ceiling hot {hot:.2f} cold {cold:.2f} GB/s",
              flush=True)  # fmt: skip
        for staged, ahead in variants if rep % 2 == 0 else variants[::-1]:
            row = variant(blocks, args, staged, ahead)
            put = row["put_gbps"]
            row.update(put_hot=round(put / hot, 3), put_cold=round(put / cold, 3))
            print(f"lane_put {row}", flush=True)


if __name__ == "__main__":
    main()
