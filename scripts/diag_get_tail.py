"""Where an 8-stream GET round's time goes: its start, its tail and the gaps between replies.

A round: ``get_many`` of 256 x 2 MiB (512 MiB) stored on one node with K lane connections (the
``streams`` section of ``bench_store.py``). Each round times the hot and cold K-stream TCP
ceilings, then every variant once, in turns:

* ``Q MiB``: requests of Q MiB (the client's ``max_message_bytes``);
* ``taper F x M``: 16 MiB requests, but the last M of them each cut into F (the requests left
  when the lane's queue empties are what the connections end on: smaller ones end closer
  together);
* ``16 MiB pinned`` (where the host has 2K CPUs): a second node and client whose lane
  connection threads each run on a CPU of their own (the node's on the first K, the client's
  on the next K): whether the threads' wake-ups wait for a CPU.

Every request's times on its client connection are recorded (request sent, reply head in,
payload in), so a round splits into *start* (the call until each connection's first reply
starts), *receive* (a reply's head to its last byte), *between* (a reply's last byte to the
next one's head) and *tail* (a connection's last payload in until the round's end), summed
over connections (where the payload lands in the call that reads the head, the head is seen
once its payload is in: *receive* then shows within *between*); and the first request of each
connection in the round: when the client's loop handed the batch to the lane (``run_us``),
when each connection sent it, when the node's connection thread had read it and began its
reply (a hook loaded into the node's process; ``time.perf_counter_ns`` is CLOCK_MONOTONIC in
both), and when the client read the reply's head.

    python scripts/diag_get_tail.py [--streams 8] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import tempfile
import threading
import time

from _bench_util import engine_heap, parse_args, write_result
from _ceilings import TcpCeiling

from pagekv.store import AsyncStoreClient, ClientConfig
from pagekv.store.client import lane as lane_mod
from pagekv.store.client.routing import Router
from pagekv.store.launch import NodeProcess
from pagekv.store.node.memory import tune_malloc_for_blocks

MIB = 1 << 20
EVENTS: list[tuple] = []  # (thread id, request id, what, ns)


def _record(rid: int, what: str) -> None:
    EVENTS.append((threading.get_ident(), rid, what, time.perf_counter_ns()))


def instrument() -> None:
    send, receive = lane_mod._Conn._send, lane_mod._Conn._receive

    def timed_send(self, call, idle=False):
        _record(call.request.id, "send")
        out = send(self, call, idle)
        _record(call.request.id, "sent")
        return out

    def timed_receive(self, call):
        _record(call.request.id, "recv")
        out = receive(self, call)
        _record(call.request.id, "done")
        return out

    lane_mod._Conn._send, lane_mod._Conn._receive = timed_send, timed_receive
    read_head = lane_mod.read_head

    def timed_head(sock, *args, **kw):
        head = read_head(sock, *args, **kw)
        EVENTS.append((threading.get_ident(), 0, "head", time.perf_counter_ns()))
        return head

    lane_mod.read_head = timed_head
    run = lane_mod.LaneTransport.run

    async def timed_run(self, calls):
        _record(0, "run")
        return await run(self, calls)

    lane_mod.LaneTransport.run = timed_run


# Loaded into the node's process (a sitecustomize on its PYTHONPATH): its lane's events, per
# connection thread, on the same clock as this process's (CLOCK_MONOTONIC), written at its exit.
NODE_HOOK = """
import atexit, json, os, threading, time
from pagekv.store.node import lane as L
EV = []
read_head, send_message = L.read_head, L.send_message
def timed_head(sock, *args, **kw):
    head = read_head(sock, *args, **kw)
    if head is not None:
        EV.append((threading.get_ident(), "head", time.perf_counter_ns()))
    return head
def timed_send(sock, header, frames):
    EV.append((threading.get_ident(), "send", time.perf_counter_ns()))
    n = send_message(sock, header, frames)
    EV.append((threading.get_ident(), "sent", time.perf_counter_ns()))
    return n
L.read_head, L.send_message = timed_head, timed_send
path = os.environ["DIAG_NODE_EVENTS"]
atexit.register(lambda: open(path, "w").write(json.dumps(EV)))
if os.environ.get("DIAG_PIN_CPUS"):  # each lane connection's thread on a CPU of its own
    import itertools
    cpus = [int(c) for c in os.environ["DIAG_PIN_CPUS"].split(",")]
    turn, serve = itertools.count(), L.BulkServer._serve
    def pinned_serve(self, conn):
        os.sched_setaffinity(0, {cpus[next(turn) % len(cpus)]})
        return serve(self, conn)
    L.BulkServer._serve = pinned_serve
"""


def node_starts(events: list, windows: list[tuple[int, int]]) -> dict:
    """Per round (``windows``: t0, t1), each node connection thread's first request read,
    reply started and reply handed to the kernel, after t0 (µs; sorted), medians over rounds."""
    out: dict[str, list] = {"head": [], "send": [], "sent": []}
    for t0, t1 in windows:
        firsts: dict[str, dict[int, int]] = {what: {} for what in out}
        for tid, what, ns in events:
            if t0 <= ns <= t1 and tid not in firsts[what]:
                firsts[what][tid] = ns
        for what in out:
            out[what].append(sorted((ns - t0) / 1e3 for ns in firsts[what].values()))
    n = min((len(r) for rows in out.values() for r in rows), default=0)
    return {
        f"node_first_{what}_us": [round(statistics.median(r[i] for r in rows)) for i in range(n)]
        for what, rows in out.items()
    }


def pin_connections(cpus: list[int]) -> None:
    """Lane connection threads started from now on each run on one of ``cpus``, in turn."""
    turn, run = iter(range(1 << 30)), lane_mod._Conn._run

    def pinned_run(self):
        os.sched_setaffinity(0, {cpus[next(turn) % len(cpus)]})
        return run(self)

    lane_mod._Conn._run = pinned_run


TAPER: list[tuple[int, int]] = [(1, 0)]  # (F, M) of the variant being run
_cut = Router.cut


def tapered_cut(self, keys, idxs, limits, **kw):
    parts = _cut(self, keys, idxs, limits, **kw)
    f, m = TAPER[0]
    if f <= 1 or not m:
        return parts
    head, tail = parts[:-m], parts[-m:]
    for part in tail:
        step = max(1, len(part) // f)
        head.extend(part[i : i + step] for i in range(0, len(part), step))
    return head


def split(t0: int, t1: int) -> dict:
    """The round's time per connection thread: start, receive and tail, summed (ms)."""
    by_thread: dict[int, list] = collections.defaultdict(list)
    for tid, _, what, ns in EVENTS:
        by_thread[tid].append((what, ns))
    loop_ident = threading.get_ident()  # the caller's thread: the client's loop
    loop_evs = by_thread.pop(loop_ident, [])
    start = tail = recv = between = 0.0
    requests = collections.Counter()
    for evs in by_thread.values():
        heads = [ns for what, ns in evs if what == "head"]
        dones = [ns for what, ns in evs if what == "done"]
        recvs = [ns for what, ns in evs if what == "recv"]
        if not heads:
            continue
        start += (heads[0] - t0) / 1e6
        tail += (t1 - dones[-1]) / 1e6
        recv += sum(d - h for h, d in zip(heads, dones)) / 1e6
        between += sum(h - d for d, h in zip(dones, heads[1:])) / 1e6
        requests[len(recvs)] += 1
    conns = len(by_thread)
    wall = (t1 - t0) / 1e6
    runs = [ns for what, ns in loop_evs if what == "run"]
    first_sent = sorted(
        (min(ns for what, ns in evs if what == "sent") - t0) / 1e3 for evs in by_thread.values()
    )
    first_send = sorted(
        (min(ns for what, ns in evs if what == "send") - t0) / 1e3 for evs in by_thread.values()
    )
    first_head = sorted(
        (min(ns for what, ns in evs if what == "head") - t0) / 1e3 for evs in by_thread.values()
    )
    return dict(wall_ms=round(wall, 2), conns=conns,
                start_share=round(start / (conns * wall), 3),
                tail_share=round(tail / (conns * wall), 3),
                receive_share=round(recv / (conns * wall), 3),
                between_share=round(between / (conns * wall), 3),
                run_us=round((runs[0] - t0) / 1e3),
                first_send_us=[round(x) for x in first_send],
                first_sent_us=[round(x) for x in first_sent],
                first_head_us=[round(x) for x in first_head],
                requests_per_conn=dict(requests))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=256)
    args = parse_args(ap)
    tune_malloc_for_blocks()
    k, size, n = args.streams, 2 * MIB, args.blocks
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2 * k
    # name: (request MiB, taper, pinned: the node's and the client's connection threads each on
    # a CPU of their own, the node's on the first K CPUs, the client's on the next K)
    variants = {
        "16 MiB": (16, (1, 0), False),
        "32 MiB": (32, (1, 0), False),
        "taper 2x8": (16, (2, k), False),
    }
    if pin:
        variants["16 MiB pinned"] = (16, (1, 0), True)
    blocks = [os.urandom(size) for _ in range(n)]
    into = [bytearray(size) for _ in range(n)]
    keys = [f"t{i}".encode().ljust(16, b".") for i in range(n)]
    Router.cut = tapered_cut
    instrument()
    loop = asyncio.new_event_loop()
    hook = tempfile.mkdtemp()
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
        f.write(NODE_HOOK)
    before = os.environ.get("PYTHONPATH", "")
    nodes, clients, node_events = {}, {}, {}
    windows: dict[bool, list[tuple[int, int]]] = {False: [], True: []}  # the 16 MiB rounds'
    for pinned in (False, True) if pin else (False,):
        node_events[pinned] = os.path.join(hook, f"events{int(pinned)}.json")
        os.environ.update(
            PYTHONPATH=hook + (":" + before if before else ""),
            DIAG_NODE_EVENTS=node_events[pinned],
            DIAG_PIN_CPUS=",".join(map(str, cpus[:k])) if pinned else "",
        )
        try:
            nodes[pinned] = NodeProcess("--capacity", "1GiB", "--io-threads",
                                        str(k)).start(warm=True)  # fmt: skip
        finally:
            os.environ["PYTHONPATH"] = before
        if pinned:
            pin_connections(cpus[k : 2 * k])
        cfg = ClientConfig((nodes[pinned].address,), timeout_s=30, streams=k)
        clients[pinned] = AsyncStoreClient(nodes[pinned].address, config=cfg)
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    gb = n * size / 1e9
    try:
        for client in clients.values():
            loop.run_until_complete(client.put_many(keys, blocks))

        def one(name: str) -> dict:
            most, taper, pinned = variants[name]
            client = clients[pinned]
            client.router.max_message_bytes, TAPER[0] = most * MIB, taper
            EVENTS.clear()
            for b in into:
                b[:64] = bytes(64)
            t0 = time.perf_counter_ns()
            ok = loop.run_until_complete(client.get_many(keys, into=into))
            t1 = time.perf_counter_ns()
            if most == 16 and taper == (1, 0):
                windows[pinned].append((t0, t1))
            if not all(ok) or into[-1][:64] != blocks[-1][:64]:
                raise RuntimeError(f"{name}: {ok.count(False)} misses or wrong bytes")
            return dict(get_gbps=gb / ((t1 - t0) / 1e9), **split(t0, t1))

        for name in variants:  # warm each
            one(name)
        with TcpCeiling(k, size, n // k) as hot, TcpCeiling(k, size, n // k, cold=True) as cold:
            engine_heap()
            for r in range(args.rounds):
                (_, tcp_get), (_, cold_get) = hot.round(), cold.round()
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for name in order:
                    row = one(name)
                    row.update(
                        ratio=row["get_gbps"] / tcp_get,
                        ratio_cold=row["get_gbps"] / cold_get,
                        hot=tcp_get,
                        cold=cold_get,
                    )
                    rows[name].append(row)
                print(
                    f"round {r}: hot {tcp_get:.1f} cold {cold_get:.1f} "
                    + ", ".join(f"{name} {rows[name][-1]['ratio']:.3f}" for name in variants),
                    flush=True,
                )
    finally:
        for client in clients.values():
            client.close()
        for node in nodes.values():
            node.stop()
        loop.close()
    summary = {}
    events = {}
    for pinned, path in node_events.items():
        try:
            with open(path) as f:
                events[pinned] = json.load(f)
        except (OSError, ValueError):
            events[pinned] = []
    for name, rs in rows.items():
        med = {key: round(statistics.median(r[key] for r in rs), 3)
               for key in ("get_gbps", "ratio", "ratio_cold", "wall_ms", "start_share",
                           "tail_share", "receive_share", "between_share")}  # fmt: skip
        med["ratio_rounds"] = [round(r["ratio"], 3) for r in rs]
        med["requests_per_conn"] = rs[-1]["requests_per_conn"]
        med["run_us"] = round(statistics.median(r["run_us"] for r in rs))
        for key in ("first_send_us", "first_sent_us", "first_head_us"):  # per rank, over rounds
            med[key] = [
                round(statistics.median(r[key][i] for r in rs))
                for i in range(min(len(r[key]) for r in rs))
            ]
        most, taper, pinned = variants[name]
        if most == 16 and taper == (1, 0) and events.get(pinned):
            med.update(node_starts(events[pinned], windows[pinned]))
        summary[name] = med
        print(name, med, flush=True)
    write_result("diag_get_tail", dict(streams=k, blocks=n,
                                       summary=summary, rounds=rows))  # fmt: skip


if __name__ == "__main__":
    main()
