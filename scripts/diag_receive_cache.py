"""Does one loopback TCP stream lose to cold memory, and does a helper core win it back?

One sender process and one receiver process move 1 GiB per round over one connection, 2 MiB
per ``sendall``; each variant runs in fresh processes, ``reps`` times, 3 rounds each, and 512 MiB
of other memory is touched before each round so that the cold buffers are not in the cache.

Sender modes: ``hot`` (one 2 MiB buffer sent again and again, as the hot ceiling does),
``cold`` (1 GiB of distinct memory), ``pf<D>`` (cold, and a helper thread reads chunk i + D
while chunk i is sent). Receiver modes: ``hot``, ``cold``, ``pf<D>`` (a helper reads the
destination ahead), ``bounce`` (receive into a 4 MiB ring of 512 KiB slots that stays in the
cache while a helper thread copies each slot into the cold destination: what
``pagekv_recv_verify_staged`` does in C).

    python3 scripts/diag_receive_cache.py run [reps]

Prints GB/s per round and, at the end, each variant's median and its ratio to hot/hot.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

CHUNK = 2 << 20
TOTAL = 1 << 30
SLOT, SLOTS = 512 << 10, 8


def _evict() -> None:
    junk = np.ones(512 << 20, np.uint8)
    junk.sum()


class _Ahead:
    """A helper reading chunk j of ``arr`` once the main thread has reached chunk j - D."""

    def __init__(self, arr: np.ndarray, chunks: int, ahead: int) -> None:
        self.words, self.chunks, self.ahead, self.cur = arr.view(np.uint64), chunks, ahead, -1
        self.cond = threading.Condition()
        self.sink = 0
        threading.Thread(target=self._run, daemon=True).start()

    def at(self, i: int) -> None:
        with self.cond:
            self.cur = i
            self.cond.notify()

    def _run(self) -> None:
        per = CHUNK // 8
        for j in range(self.chunks):
            with self.cond:
                self.cond.wait_for(lambda j=j: self.cur >= j - self.ahead)
            self.sink ^= int(np.bitwise_xor.reduce(self.words[j * per : (j + 1) * per]))


def _helper(mode: str, arr: np.ndarray) -> _Ahead | None:
    return _Ahead(arr, TOTAL // CHUNK, int(mode[2:])) if mode.startswith("pf") else None


def _send(sock: socket.socket, mode: str, rounds: int) -> list[float]:
    data = np.ones(CHUNK if mode == "hot" else TOTAL, np.uint8)
    view, times = memoryview(data), []
    for _ in range(rounds):
        _evict()
        sock.sendall(b"go")
        sock.recv(1)
        helper = _helper(mode, data)
        start = time.perf_counter()
        for i in range(TOTAL // CHUNK):
            if helper:
                helper.at(i)
            at = 0 if mode == "hot" else i * CHUNK
            sock.sendall(view[at : at + CHUNK])
        sock.recv(1)
        times.append(time.perf_counter() - start)
        if helper:
            helper.at(TOTAL)
    return times


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += conn.recv_into(view[got:], len(view) - got)


def _recv_bounce(conn: socket.socket, dest: np.ndarray) -> None:
    ring = [np.ones(SLOT, np.uint8) for _ in range(SLOTS)]
    free, full = threading.Semaphore(SLOTS), threading.Semaphore(0)

    def copier() -> None:
        for k in range(TOTAL // SLOT):
            full.acquire()
            np.copyto(dest[k * SLOT : (k + 1) * SLOT], ring[k % SLOTS])
            free.release()

    thread = threading.Thread(target=copier)
    thread.start()
    for k in range(TOTAL // SLOT):
        free.acquire()
        _recv_exact(conn, memoryview(ring[k % SLOTS]))
        full.release()
    thread.join()


def _receive(conn: socket.socket, mode: str, rounds: int) -> None:
    dest = np.ones(CHUNK if mode == "hot" else TOTAL, np.uint8)
    view = memoryview(dest)
    for _ in range(rounds):
        _evict()
        conn.recv(2, socket.MSG_WAITALL)
        conn.sendall(b"r")
        if mode == "bounce":
            _recv_bounce(conn, dest)
        else:
            helper = _helper(mode, dest)
            for i in range(TOTAL // CHUNK):
                if helper:
                    helper.at(i)
                at = 0 if mode == "hot" else i * CHUNK
                _recv_exact(conn, view[at : at + CHUNK])
            if helper:
                helper.at(TOTAL)
        conn.sendall(b"k")


VARIANTS = [("hot", "hot"), ("cold", "cold"), ("cold", "hot"), ("hot", "cold"),
            ("pf1", "cold"), ("pf2", "cold"), ("pf4", "cold"), ("pf2", "hot"),
            ("cold", "pf2"), ("cold", "bounce"), ("pf2", "pf2"), ("pf2", "bounce")]  # fmt: skip


def _run(reps: int, rounds: int = 3) -> None:
    results: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for sender, receiver in VARIANTS:
            cmd = [sys.executable, __file__]
            server = subprocess.Popen(
                [*cmd, "recv", receiver, str(rounds)], stdout=subprocess.PIPE, text=True
            )
            port = server.stdout.readline().strip()
            out = subprocess.run(
                [*cmd, "send", sender, str(rounds), port], capture_output=True, text=True
            )
            server.wait()
            gbps = [TOTAL / float(t) / 1e9 for t in out.stdout.split()]
            results[(sender, receiver)] += gbps
            print(f"rep{rep} send={sender:5s} recv={receiver:6s} GB/s "
                  + " ".join(f"{g:.2f}" for g in gbps), flush=True)  # fmt: skip
    hot = statistics.median(results[("hot", "hot")])
    print("# summary: median GB/s and ÷ hot")
    for (sender, receiver), gbps in results.items():
        median = statistics.median(gbps)
        print(f"send={sender:5s} recv={receiver:6s} {median:.2f}  {median / hot:.2f}")


def main() -> None:
    role = sys.argv[1]
    if role == "recv":
        listener = socket.create_server(("127.0.0.1", 0))
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
        _receive(conn, sys.argv[2], int(sys.argv[3]))
    elif role == "send":
        sock = socket.create_connection(("127.0.0.1", int(sys.argv[4])))
        print(" ".join(map(str, _send(sock, sys.argv[2], int(sys.argv[3])))), flush=True)
    else:
        _run(int(sys.argv[2]) if len(sys.argv) > 2 else 2)


if __name__ == "__main__":
    main()
