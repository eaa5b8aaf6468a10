"""Where one stream's GET loses against the hot TCP ceiling: the sender's side or the receiver's?

One server process sends ``--mib`` per request in 2 MiB frames (``sendall`` per frame, as the
ceilings do), from

  hot     one 4 MiB buffer, again and again (the hot ceiling's sender)
  cold    the round's own bytes of a 2 GiB pool (a store's blocks, in no cache)
  warm    the same, a helper thread reading frame i+1 (xxh3, no GIL) while frame i is sent

and one client process receives each request

  hot     into one 2 MiB buffer, again and again (the hot ceiling's receiver)
  cold    into its own touched memory as large as the request (the cold ceiling's)
  native  pagekv's lane receive (``NativeCopy.recv_verify``: a cached bounce, each 256 KiB
          hashed there and streamed into place, a helper thread) into 2 MiB frames of their own,
          one digest per frame (a store client's GET)

All nine pairs are taken in turn each round; GB/s medians and per-round ratios to hot/hot.

    python scripts/diag_get_path.py [--rounds 9] [--mib 256]
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
    todo: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_reader, args=(todo, done), daemon=True).start()
    at = 0
    while True:
        header = conn.recv(32, socket.MSG_WAITALL)
        if len(header) < 32:
            return
        mode, n = header[:4].decode().strip(), int(header[4:])
        if at + n > POOL:
            at = 0
        src = data[at : at + n] if mode != "hot" else None
        at += n
        ahead = 0  # frames handed to the reader and not yet read
        for i in range(0, n, FRAME):
            if mode == "warm":
                for _ in range(ahead):
                    done.get()
                nxt = src[i + FRAME : i + 2 * FRAME]
                ahead = 1 if nxt.nbytes else 0
                if ahead:
                    todo.put(nxt)
            conn.sendall(src[i : i + FRAME] if src is not None else hot[i % (2 << 20) :][:FRAME])
        for _ in range(ahead):
            done.get()


def _reader(todo: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    """Reads each frame it is given (xxh3 releases the GIL), so the sender finds it cached."""
    while True:
        done.put(xxhash.xxh3_64(todo.get()))


def client(port: int, nbytes: int) -> None:
    from pagekv.store.wire import native
    from pagekv.store.wire.lane import new_buffer

    lib = native.load()
    if lib is None:
        raise SystemExit(f"no native library: {native.unavailable_reason()}")
    bounce = new_buffer(native.BLOCK_BYTES * native.RECV_SLOTS)
    sock = socket.create_connection(("127.0.0.1", port))
    hot = memoryview(np.ones(FRAME, np.uint8)).cast("B")
    cold = memoryview(np.ones(nbytes, np.uint8)).cast("B")
    frames = [np.ones(FRAME, np.uint8) for _ in range(nbytes // FRAME)]
    for line in sys.stdin:
        sender, receiver = line.split()
        t = time.perf_counter()
        sock.sendall(sender.ljust(4).encode() + str(nbytes).rjust(28).encode())
        if receiver == "native":
            lib.recv_verify(sock.fileno(), frames, [1] * len(frames), bounce=bounce)
        else:
            got = 0
            while got < nbytes:
                at = got if receiver == "cold" else got % FRAME
                got += sock.recv_into((cold if receiver == "cold" else hot)[at:][:FRAME])
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
    pairs = [f"{s}/{r}" for s in ("hot", "cold", "warm") for r in ("hot", "cold", "native")]
    gbps: dict[str, list[float]] = {p: [] for p in pairs}
    for r in range(args.rounds + 1):
        for pair in pairs:
            cl.stdin.write(pair.replace("/", " ") + "\n")
            cl.stdin.flush()
            s = float(cl.stdout.readline())
            if r:  # the first round faults everything in
                gbps[pair].append(nbytes / 1e9 / s)
    cl.stdin.close()
    cl.wait()
    server.wait()
    med = {p: round(statistics.median(v), 3) for p, v in gbps.items()}
    ratio = {p: round(statistics.median(a / b for a, b in zip(v, gbps["hot/hot"])), 3)
             for p, v in gbps.items()}  # fmt: skip
    print(json.dumps({"sender/receiver median_gbps": med, "per_round_ratio_to_hot/hot": ratio}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve()
    elif len(sys.argv) > 1 and sys.argv[1] == "client":
        client(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
