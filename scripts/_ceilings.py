"""Ceilings of the host a store benchmark runs on, measured in the same run as pagekv.

* :func:`tcp_ceiling`: raw loopback TCP with K streams, one server process and one client
  process per stream (so no stream shares a Python interpreter or a core's GIL with another);
  each round moves ``block * blocks`` bytes per stream each way, all streams started together
  (told through their stdin); GB/s is the bytes of all streams over the slowest stream's time.
* :func:`memcpy_ceiling`: numpy copies in K threads (numpy releases the GIL while it copies).

Servers bind port 0 and report the port they got: no fixed ports.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

_HEADER = 16  # b"P" or b"G" then the byte count, space-padded


def _serve() -> None:
    """One connection: ``P n`` reads n bytes then acks; ``G n`` sends n bytes; EOF ends.
    Prints the port it listens on (bound to port 0) first."""
    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
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


def _client(port: int, block: int, blocks: int) -> None:
    """Per line on stdin (``P`` or ``G``): one put or get of ``block * blocks`` bytes, its
    seconds printed; EOF ends."""
    sock = socket.create_connection(("127.0.0.1", port))
    data, buf = os.urandom(block), bytearray(block)
    view, total = memoryview(buf), block * blocks
    for line in sys.stdin:
        t = time.perf_counter()
        sock.sendall(line[:1].encode() + str(total).rjust(_HEADER - 1).encode())
        if line.startswith("P"):
            for _ in range(blocks):
                sock.sendall(data)
            sock.recv(1)
        else:
            got = 0
            while got < total:
                got += sock.recv_into(view[: min(block, total - got)])
        print(time.perf_counter() - t, flush=True)
    sock.close()


def _spawn(*args: object) -> subprocess.Popen:
    # a fresh interpreter (posix_spawn, no fork): the caller's big buffers are not shared
    # copy-on-write with the children, which would slow the caller's next writes into them
    cmd = [sys.executable, __file__, *map(str, args)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def tcp_ceiling(streams: int, block: int, blocks: int, rounds: int) -> tuple[float, float]:
    """Median over rounds of (put, get) GB/s with ``streams`` parallel TCP streams."""
    servers = [_spawn("serve") for _ in range(streams)]
    procs = list(servers)
    try:
        ports = [int(server.stdout.readline()) for server in servers]
        clients = [_spawn("client", port, block, blocks) for port in ports]
        procs += clients
        gb, put, get = streams * block * blocks / 1e9, [], []
        for _ in range(rounds):
            for phase, out in (("P", put), ("G", get)):
                for client in clients:  # started together (a pipe write each)
                    client.stdin.write(phase + "\n")
                    client.stdin.flush()
                out.append(gb / max(float(client.stdout.readline()) for client in clients))
        for client in clients:
            client.stdin.close()
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return statistics.median(put), statistics.median(get)


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


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve()
    else:
        _client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
