"""Ceilings of the host a store benchmark runs on, measured in the same run as pagekv.

* :class:`TcpCeiling` (:func:`tcp_ceiling`: a median of rounds): raw loopback TCP with K
  streams, one server process and one client process per stream (so no stream shares a Python
  interpreter or a core's GIL with another); each round moves ``block * blocks`` bytes per
  stream each way, all streams started together (told through their stdin); GB/s is the
  bytes of all streams over the slowest stream's time.
* :func:`memcpy_ceiling`: numpy copies in K threads (numpy releases the GIL while it copies).

Servers bind port 0 and report the port they got: no fixed ports.

Sides (:func:`split_cores`): a benchmark may give the sending side (TCP servers, store nodes)
and the receiving side (TCP clients, store clients) CPUs of their own, whole cores each, the
same for the ceilings as for pagekv, so that where the scheduler puts each process (apart, on
one core's siblings, on one CPU) is the same for both; unpinned, a one-stream ratio moved
0.79-1.11 between fresh runs on the GPU host.
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


def split_cores() -> tuple[frozenset[int], frozenset[int]]:
    """This process's CPUs as (send, receive): whole cores (hyperthread siblings together), the
    first half of them for the sending side, the rest for the receiving side; both sides all
    of them where there is only one core."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                core = f.read().strip()
        except OSError:  # no topology: each CPU a core of its own
            core = str(cpu)
        cores.setdefault(core, []).append(cpu)
    groups = list(cores.values())
    if len(groups) < 2:
        every = frozenset(cpu for group in groups for cpu in group)
        return every, every
    half = len(groups) // 2
    return (frozenset(cpu for group in groups[:half] for cpu in group),
            frozenset(cpu for group in groups[half:] for cpu in group))  # fmt: skip


def pin_process(cpus: frozenset[int] | set[int]) -> None:
    """Run every thread of this process, and the threads it starts later, on ``cpus``
    (``sched_setaffinity`` is per thread: each of /proc/self/task)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _cpus_arg(cpus: frozenset[int] | None) -> str:
    return ",".join(map(str, sorted(cpus))) if cpus else "-"


def _pin_from_arg(arg: str) -> None:
    if arg != "-":
        os.sched_setaffinity(0, {int(cpu) for cpu in arg.split(",")})


def _touched(nbytes: int) -> memoryview:
    """``nbytes`` of memory with every page written (faulted in before any clock starts)."""
    return memoryview(np.ones(nbytes, np.uint8)).cast("B")


def _serve(cold: bool = False) -> None:
    """One connection: ``P n`` reads n bytes then acks; ``G n`` sends n bytes; EOF ends.
    Prints the port it listens on (bound to port 0) first. ``cold``: the bytes of a round go
    to / come from distinct memory as large as the round (as a store's blocks do), not one
    4 MiB buffer that stays in the cache."""
    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
    conn, _ = lsock.accept()
    view = data = _touched(4 << 20)
    while True:
        header = conn.recv(_HEADER, socket.MSG_WAITALL)
        if len(header) < _HEADER:
            return
        left = int(header[1:])
        if cold and len(view) < left:
            view = data = _touched(left)
        at = 0
        if header[:1] == b"P":
            while left > 0:
                got = conn.recv_into(view[at : at + min(4 << 20, left)])
                left -= got
                at = at + got if cold else 0
            conn.sendall(b"k")
        else:
            while left > 0:
                step = min(4 << 20, left)
                conn.sendall(data[at : at + step])
                left -= step
                at = at + step if cold else 0


def _client(port: int, block: int, blocks: int, cold: bool = False) -> None:
    """Per line on stdin (``P`` or ``G``): one put or get of ``block * blocks`` bytes, its
    seconds printed; EOF ends. ``cold``: each block from / into its own memory."""
    sock = socket.create_connection(("127.0.0.1", port))
    total = block * blocks
    data = view = _touched(total if cold else block)
    for line in sys.stdin:
        t = time.perf_counter()
        sock.sendall(line[:1].encode() + str(total).rjust(_HEADER - 1).encode())
        if line.startswith("P"):
            for i in range(blocks):
                at = i * block if cold else 0
                sock.sendall(data[at : at + block])
            sock.recv(1)
        else:
            got = 0
            while got < total:
                at = got if cold else got % block
                got += sock.recv_into(view[at : at + min(block - got % block, total - got)])
        print(time.perf_counter() - t, flush=True)
    sock.close()


def _spawn(*args: object) -> subprocess.Popen:
    # a fresh interpreter (posix_spawn, no fork): the caller's big buffers are not shared
    # copy-on-write with the children, which would slow the caller's next writes into them
    cmd = [sys.executable, __file__, *map(str, args)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


class TcpCeiling:
    """``streams`` raw TCP streams kept for several rounds: one server and one client process
    per stream, a first round run at once (connections made, every buffer's pages faulted in
    on both sides), then :meth:`round` as often as wanted, between other work. ``cold``: every
    block sent from and received into its own memory on both sides (as a store moves blocks),
    instead of one buffer per side that stays in the cache. ``sides``: (send, receive) CPUs
    that the servers and the clients run on (:func:`split_cores`); None: anywhere."""

    def __init__(self, streams: int, block: int, blocks: int, cold: bool = False,
                 sides: tuple[frozenset[int], frozenset[int]] | None = None) -> None:  # fmt: skip
        self.gb = streams * block * blocks / 1e9
        send, receive = (_cpus_arg(side) for side in sides) if sides else ("-", "-")
        servers = [_spawn("serve", send, int(cold)) for _ in range(streams)]
        self.procs, self.clients = list(servers), []
        try:
            ports = [int(server.stdout.readline()) for server in servers]
            self.clients = [_spawn("client", receive, port, block, blocks, int(cold))
                            for port in ports]  # fmt: skip
            self.procs += self.clients
            self.round()
        except BaseException:
            self.close()
            raise

    def round(self) -> tuple[float, float]:
        """(put, get) GB/s of one round: all streams started together (a pipe write each),
        the bytes of all streams over the slowest stream's time."""
        out = []
        for phase in ("P", "G"):
            for client in self.clients:
                client.stdin.write(phase + "\n")
                client.stdin.flush()
            out.append(self.gb / max(float(client.stdout.readline()) for client in self.clients))
        return out[0], out[1]

    def close(self) -> None:
        for client in self.clients:
            try:
                client.stdin.close()
            except OSError:
                pass  # it ended already
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> TcpCeiling:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tcp_ceiling(
    streams: int, block: int, blocks: int, rounds: int, cold: bool = False
) -> tuple[float, float]:
    """Median over ``rounds`` (after the first, see :class:`TcpCeiling`) of (put, get) GB/s
    with ``streams`` parallel TCP streams."""
    with TcpCeiling(streams, block, blocks, cold) as ceiling:
        times = [ceiling.round() for _ in range(rounds)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


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
    _pin_from_arg(sys.argv[2])  # first thing: before any thread
    if sys.argv[1] == "serve":
        _serve(bool(int(sys.argv[3])))
    else:
        _client(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), bool(int(sys.argv[6])))
