"""Misbehaving store nodes for client tests: a node that answers what a test tells it to (or
nothing), a proxy in front of a real node that tampers with its replies, a bandwidth-limited
TCP proxy. All on loopback, free ports, one thread each, stopped by ``close()``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import msgpack
import zmq


def pack(**head) -> bytes:
    return msgpack.packb({"v": 2, **head}, use_bin_type=True)


class FakeNode:
    """A ROUTER that hands every request (list of frame bytes) to ``answer``, which returns
    the reply frames or None (no reply: a black hole)."""

    def __init__(self, answer: Callable[[list[bytes]], list[bytes] | None]) -> None:
        self.answer = answer
        self.requests = 0
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            self.requests += 1
            reply = self.answer(frames)
            if reply is not None:
                self.sock.send_multipart([ident, *reply])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)


def black_hole() -> FakeNode:
    return FakeNode(lambda frames: None)


class TamperingProxy(FakeNode):
    """Forwards requests to a real node and passes each reply through ``tamper`` (reply
    frames -> frames to send, or None to swallow it) while ``tampering`` is set. The node's
    other ports (stream ports, bulk lane) are taken out of its PING replies: the proxy is the
    client's only way to the node (with them, a node with several I/O threads would be reached
    around the proxy)."""

    def __init__(self, backend: str, tamper: Callable[[list[bytes]], list[bytes] | None]) -> None:
        self.tamper, self.tampering = tamper, False
        self.back = zmq.Context.instance().socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(backend)
        super().__init__(self._forward)

    def _forward(self, frames: list[bytes]) -> list[bytes] | None:
        self.back.send_multipart(frames)
        if not self.back.poll(5000):
            return None
        reply = _only_this_port(self.back.recv_multipart())
        return self.tamper(reply) if self.tampering else reply

    def close(self) -> None:
        super().close()
        self.back.close(linger=0)


def _only_this_port(reply: list[bytes]) -> list[bytes]:
    head = msgpack.unpackb(reply[0], raw=False)
    if not isinstance(head, dict) or not ({"ports", "bulk"} & head.keys()):
        return reply
    head.pop("ports", None)
    head.pop("bulk", None)
    return [msgpack.packb(head, use_bin_type=True), *reply[1:]]


class ThrottledProxy:
    """A TCP proxy to ``backend`` moving at most ``rate`` bytes/s each way (a slow link)."""

    def __init__(self, backend: str, rate: float) -> None:
        host, port = backend.removeprefix("tcp://").rsplit(":", 1)
        self.backend, self.rate = (host, int(port)), rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            server = socket.create_connection(self.backend)
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        start, moved = time.monotonic(), 0
        try:
            while not self._stop.is_set():
                data = src.recv(16384)
                if not data:
                    break
                dst.sendall(data)
                moved += len(data)
                ahead = moved / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    self._stop.wait(ahead)  # paced to the rate
        except OSError:
            pass  # one side closed: the other pump ends too
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for s in self._socks:
            s.close()
