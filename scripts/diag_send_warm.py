"""Does reading a GET's next block on another core, while the sender's ``sendmsg`` copies the
current one, raise one loopback TCP stream's rate (a node sending blocks that are in no cache)?

One server process sends ``--mib`` per request in 2 MiB frames, from a 2 GiB buffer walked round
by round (each round's bytes out of every cache); one client process receives each request into
its own touched buffer. Modes, taken in turn each round:

  hot   one 4 MiB buffer sent again and again (the hot ceiling)
  cold  the round's own bytes, sent as they are
  warm  the same, a helper thread reading frame i+1 (xxh3, no GIL) while frame i is sent

    python scripts/diag_send_warm.py [--rounds 9] [--mib 256]
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import xxhash

FRAME = 2 << 20
POOL = 2 << 30


def serve() -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
    conn, _ = lsock.accept()
    data = memoryview(np.ones(POOL, np.uint8)).cast("B")
    hot = data[: 4 << 20]
    at = 0
    todo: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_warmer, args=(todo, done), daemon=True).start()
    while True:
        header = conn.recv(32, socket.MSG_WAITALL)
        if len(header) < 32:
            return
        mode, n = header[:4].decode().strip(), int(header[4:])
        if at + n > POOL:
            at = 0
        src = data[at : at + n]
        at += n
        if mode == "hot":
            for i in range(0, n, FRAME):
                conn.sendall(hot[(i % (4 << 20)) : (i % (4 << 20)) + FRAME])
        elif mode == "cold":
            for i in range(0, n, FRAME):
                conn.sendall(src[i : i + FRAME])
        else:
            pending = 0
            for i in range(0, n, FRAME):
                for _ in range(pending):
                    done.get()
                nxt = src[i + FRAME : i + 2 * FRAME]
                pending = 1 if nxt.nbytes else 0
                if pending:
                    todo.put(nxt)
                conn.sendall(src[i : i + FRAME])
            for _ in range(pending):
                done.get()


def _warmer(todo: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    while True:
        done.put(xxhash.xxh3_64(todo.get()))


def client(port: int, nbytes: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    into = memoryview(np.ones(nbytes, np.uint8)).cast("B")
    for line in sys.stdin:
        mode = line.strip()
        t = time.perf_counter()
        sock.sendall(mode.ljust(4).encode() + str(nbytes).rjust(28).encode())
        got = 0
        while got < nbytes:
            got += sock.recv_into(into[got:])
        print(time.perf_counter() - t, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    nbytes = args.mib << 20
    server = subprocess.Popen([sys.executable, __file__, "serve"], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    port = int(server.stdout.readline())
    cl = subprocess.Popen([sys.executable, __file__, "client", str(port), str(nbytes)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    modes = ("hot", "cold", "warm")
    gbps: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds + 1):
        for mode in modes:
            cl.stdin.write(mode + "\n")
            cl.stdin.flush()
            s = float(cl.stdout.readline())
            if r:  # the first round faults everything in
                gbps[mode].append(nbytes / 1e9 / s)
    cl.stdin.close()
    cl.wait()
    server.wait()
    med = {m: round(statistics.median(v), 3) for m, v in gbps.items()}
    pair = {f"{m}/cold": round(statistics.median(a / b for a, b in zip(gbps[m], gbps["cold"])), 3)
            for m in ("hot", "warm")}  # fmt: skip
    rounds = {m: [round(x, 2) for x in v] for m, v in gbps.items()}
    print(json.dumps({"median_gbps": med, "per_round_ratio": pair, "rounds": rounds}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve()
    elif len(sys.argv) > 1 and sys.argv[1] == "client":
        client(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
