"""Where a multi-stream PUT waits: a timeline of each request, client and node, same run.

For each request of one put round: when the client started hashing it (``before_send``),
when it handed it to its socket, when the node's loop had it whole (libzmq delivers a message
only once all of it arrived), when the node had answered it, and when the client read the
reply; all on the host's wall clock (client and node are processes of one host). Then
throughput by request size (the client's ``max_message_bytes``) and path (ZeroMQ or the bulk
lane), against the K-stream TCP ceiling of the same run.

    python scripts/diag_put.py [--streams 1,4] [--blocks 64,256] [--sizes 4,8,16,32]
    python scripts/diag_put.py --serve <pagekv serve args>   (the instrumented node; internal)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time

from _traced_node import TracedNode, serve_with_timeline

from pagekv.store.memory import minor_faults, tune_malloc_for_blocks

MIB = 1 << 20


def serve(argv: list[str]) -> int:
    """``pagekv serve`` with each request's (available, answered, op, id) written at exit to
    ``$PAGEKV_DIAG_TIMELINE``."""
    from pagekv.store import server

    rows: list[tuple] = []
    init, parse = server.StoreNode.__init__, server.StoreNode._parse
    seen: dict[int, float] = {}

    def traced_init(self, *a, **k) -> None:
        init(self, *a, **k)

        def observe(op, rep, seconds) -> None:
            rows.append((seen.pop(rep.id, time.time() - seconds), time.time(),
                         op.value if op else None, rep.id))  # fmt: skip

        self.observe = observe

    def traced_parse(self, header):
        req = parse(self, header)
        if hasattr(req, "id"):
            seen[req.id] = time.time()
        return req

    server.StoreNode.__init__, server.StoreNode._parse = traced_init, traced_parse
    return serve_with_timeline(argv, rows)


def traced_client(address: str, streams: int, request_mib: int, lane: bool):
    """An AsyncStoreClient whose requests' hashing and replies are timed (``lane``: its PUTs
    go over the bulk lane); returns it, the marks per request id and a function that undoes
    the tracing."""
    from pagekv.store import AsyncStoreClient, ClientConfig, async_client, bulk_client

    marks: dict[int, dict] = {}
    modules = (async_client, bulk_client)
    saved = [(m, m.request_header, m.decode_reply) for m in modules]
    header, decode = async_client.request_header, async_client.decode_reply

    def request_header(call):
        t = time.time()
        out = header(call)
        marks.setdefault(call.request.id, {}).update(hash=t, sent=time.time(), n=call.nbytes)
        return out

    def decode_reply(buf):
        rep = decode(buf)
        marks.setdefault(rep.id, {})["reply"] = time.time()
        return rep

    def restore() -> None:
        for module, h, d in saved:
            module.request_header, module.decode_reply = h, d

    for module in modules:
        module.request_header, module.decode_reply = request_header, decode_reply
    cfg = ClientConfig((address,), timeout_s=30, streams=streams, bulk=lane, bulk_puts=lane,
                       max_message_bytes=request_mib * MIB)  # fmt: skip
    return AsyncStoreClient(address, config=cfg), marks, restore


async def one_round(client, blocks, tag: str) -> float:
    keys = [f"{tag}-{i}".encode().ljust(16, b".") for i in range(len(blocks))]
    t = time.perf_counter()
    status = await client.put_many(keys, blocks)
    took = time.perf_counter() - t
    if any(s != 0 for s in status):
        raise RuntimeError(f"put failed: {set(status)}")
    await client.delete_many(keys)
    return took


async def warm_then_timed(client, blocks, marks: dict) -> tuple[float, float]:
    await one_round(client, blocks, "warm")
    marks.clear()
    t0 = time.time()
    return t0, await one_round(client, blocks, "timed")


async def rounds(client, blocks, n: int, pid: int) -> tuple[list[float], float]:
    """Put times of ``n`` rounds after a warm one, and the node's faults per 4 KiB page put."""
    await one_round(client, blocks, "warm")
    faults = minor_faults(pid)
    times = [await one_round(client, blocks, f"r{r}") for r in range(n)]
    return times, (minor_faults(pid) - faults) / (n * len(blocks) * (blocks[0].nbytes // 4096))


def timeline_section(args) -> None:
    size = 2 * MIB
    for k, n, path in itertools.product(args.streams, args.blocks, args.paths):
        blocks = [os.urandom(size) for _ in range(n)]
        node = TracedNode(__file__, "--capacity", "1GiB", "--io-threads", str(k))
        client, marks, restore = traced_client(node.address, k, args.timeline_mib,
                                               path == "lane")  # fmt: skip
        t0, took = asyncio.run(warm_then_timed(client, blocks, marks))
        client.close()
        restore()
        rows = {r[3]: r for r in node.timeline() if r[2] == "PUT"}
        print(f"\ntimeline {path} K={k}, {n} x 2 MiB, {args.timeline_mib} MiB requests: "
              f"{size * n / took / 1e9:.2f} GB/s ({took * 1e3:.1f} ms)")  # fmt: skip
        print("   id    MiB  hash  handed  node-has  node-done  reply   (ms from the start)")
        for rid in sorted(marks):
            m = marks[rid]
            if "hash" not in m or "reply" not in m or rid not in rows:
                continue
            avail, done = rows[rid][0], rows[rid][1]
            ms = [1e3 * (t - t0) for t in (m["hash"], m["sent"], avail, done, m["reply"])]
            print(f"  {rid:4d} {m['n'] / MIB:5.0f} {ms[0]:6.1f} {ms[1]:6.1f} {ms[2]:8.1f} "
                  f"{ms[3]:9.1f} {ms[4]:7.1f}")  # fmt: skip


def sizes_section(args) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _ceilings import tcp_ceiling

    from pagekv.store import AsyncStoreClient, ClientConfig
    from pagekv.store.launch import NodeProcess

    size = 2 * MIB
    for k in args.streams:
        n = max(args.blocks)
        blocks = [memoryview(os.urandom(size)) for _ in range(n)]
        hot = tcp_ceiling(k, size, max(1, n // k), 3)[0]
        cold = tcp_ceiling(k, size, max(1, n // k), 3, cold=True)[0]
        print(f"\nK={k}, {n} x 2 MiB: put ceiling hot {hot:.2f} cold {cold:.2f} GB/s")
        variants = [("zmq", m, p) for m in args.sizes for p in args.top_pads]
        variants += [("lane", m, p) for m in args.lane_sizes for p in args.top_pads]
        for rep in range(args.repeat):
            for path, mib, pad in variants if rep % 2 == 0 else variants[::-1]:
                os.environ["PAGEKV_MALLOC_TOP_PAD"] = str(int(pad * MIB))  # the node's malloc
                node = NodeProcess("--capacity", "1GiB", "--io-threads", str(k)).start()
                lane = path == "lane"
                cfg = ClientConfig((node.address,), timeout_s=30, streams=k, bulk=lane,
                                   bulk_puts=lane, max_message_bytes=mib * MIB)  # fmt: skip
                client = AsyncStoreClient(node.address, config=cfg)
                times, faults = asyncio.run(rounds(client, blocks, args.rounds, node.proc.pid))
                client.close()
                node.stop()
                gbs = size * n / statistics.median(times) / 1e9
                print(f"  {path:4s} {mib:3d} MiB requests, top pad {pad:g} MiB: put {gbs:.2f} GB/s "
                      f"({gbs / hot:.2f} hot, {gbs / cold:.2f} cold), node faults/page "
                      f"{faults:.2f}", flush=True)  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2:]))
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", type=lambda s: s.split(","), default=["timeline", "sizes"])
    ap.add_argument("--streams", type=ints, default=[1, 4])
    ap.add_argument("--blocks", type=ints, default=[64, 256])
    ap.add_argument("--sizes", type=ints, default=[4, 8, 16, 32])
    ap.add_argument("--paths", type=lambda s: s.split(","), default=["zmq", "lane"])
    ap.add_argument("--lane-sizes", type=ints, default=[16])
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--top-pads", type=floats, default=[64], help="node malloc top pad, MiB")
    ap.add_argument("--timeline-mib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    tune_malloc_for_blocks()
    if "timeline" in args.only:
        timeline_section(args)
    if "sizes" in args.only:
        sizes_section(args)


if __name__ == "__main__":
    main()
