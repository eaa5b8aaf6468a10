"""Ceilings of the host a store benchmark runs on, measured in the same run as pagekv.

* :func:`tcp_ceiling`: raw loopback TCP with K streams, one server process and one client
  process per stream (so no stream shares a Python interpreter or a core's GIL with another);
  each round moves ``block * blocks`` bytes per stream each way, all streams started together
  at a barrier; GB/s is the bytes of all streams over the slowest stream's time.
* :func:`memcpy_ceiling`: numpy copies in K threads (numpy releases the GIL while it copies).

Servers bind port 0 and report the port they got: no fixed ports.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import threading
import time

import numpy as np

_HEADER = 16  # b"P" or b"G" then the byte count, space-padded


def _serve(port_out: mp.Queue) -> None:
    """One connection: ``P n`` reads n bytes then acks; ``G n`` sends n bytes; EOF ends."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port_out.put(lsock.getsockname()[1])
    conn, _ = lsock.accept()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    data = os.urandom(4 << 20)
    while True:
        header = conn.recv(_HEADER, socket.MSG_WAITALL)
        if len(header) < _HEADER:
            return
        left = int(header[1:])
        if header[:1] == b"P":
            while left > 0:
                left -= conn.recv_into(view[: min(len(buf), left)])
            conn.sendall(b"k")
        else:
            while left > 0:
                step = min(len(data), left)
                conn.sendall(data[:step])
                left -= step


def _client(port: int, block: int, blocks: int, rounds: int, start, out: mp.Queue) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    data, buf = os.urandom(block), bytearray(block)
    view, total = memoryview(buf), block * blocks
    for _ in range(rounds):
        start.wait()
        t = time.perf_counter()
        sock.sendall(b"P" + str(total).rjust(_HEADER - 1).encode())
        for _ in range(blocks):
            sock.sendall(data)
        sock.recv(1)
        put = time.perf_counter() - t
        start.wait()
        t, got = time.perf_counter(), 0
        sock.sendall(b"G" + str(total).rjust(_HEADER - 1).encode())
        while got < total:
            got += sock.recv_into(view[: min(block, total - got)])
        out.put((put, time.perf_counter() - t))
    sock.close()


def tcp_ceiling(streams: int, block: int, blocks: int, rounds: int) -> tuple[float, float]:
    """Median over rounds of (put, get) GB/s with ``streams`` parallel TCP streams."""
    ctx = mp.get_context("fork")  # children only use sockets; no re-import of the caller
    ports: mp.Queue = ctx.Queue()
    times: mp.Queue = ctx.Queue()
    start = ctx.Barrier(streams)
    servers = [ctx.Process(target=_serve, args=(ports,), daemon=True) for _ in range(streams)]
    for proc in servers:
        proc.start()
    clients = [
        ctx.Process(target=_client, args=(ports.get(timeout=30), block, blocks, rounds, start,
                                          times), daemon=True)
        for _ in range(streams)
    ]  # fmt: skip
    for proc in clients:
        proc.start()
    results = [times.get(timeout=120) for _ in range(streams * rounds)]
    for proc in clients + servers:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    per_round = [results[r * streams : (r + 1) * streams] for r in range(rounds)]
    gb = streams * block * blocks / 1e9
    put = statistics.median(gb / max(t[0] for t in rnd) for rnd in per_round)
    get = statistics.median(gb / max(t[1] for t in rnd) for rnd in per_round)
    return put, get


def memcpy_ceiling(threads: int, nbytes: int = 64 << 20, repeats: int = 8) -> float:
    """GB/s of ``threads`` threads each copying ``nbytes`` ``repeats`` times (numpy, no GIL)."""
    pairs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(threads)]
    start = threading.Barrier(threads + 1)

    def work(src: np.ndarray, dst: np.ndarray) -> None:
        start.wait()
        for _ in range(repeats):
            np.copyto(dst, src)

    workers = [threading.Thread(target=work, args=pair) for pair in pairs]
    for worker in workers:
        worker.start()
    for src, dst in pairs:  # warm: pages faulted in before the clock starts
        np.copyto(dst, src)
    start.wait()
    t = time.perf_counter()
    for worker in workers:
        worker.join()
    return threads * nbytes * repeats / 1e9 / (time.perf_counter() - t)
