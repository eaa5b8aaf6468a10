"""A raw ZMTP 3.0 peer (NULL mechanism) over a plain TCP socket, for what a libzmq peer would
never send: never-terminated multipart messages, frames declared larger than what follows."""

from __future__ import annotations

import socket
import struct


def greeting() -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def ready_command(socket_type: bytes = b"DEALER") -> bytes:
    name = b"Socket-Type"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type))
    body += socket_type
    return bytes([0x04, len(body)]) + body


def frame_header(size: int, more: bool) -> bytes:
    """The header of a data frame of ``size`` bytes (long form)."""
    return bytes([0x02 | (0x01 if more else 0)]) + struct.pack(">Q", size)


class RawPeer:
    """A TCP connection that has done the ZMTP handshake and writes frames by hand."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.sendall(greeting() + ready_command())
        self._read_exactly(64)  # the node's greeting
        flags, size = self._read_exactly(2)
        if flags & 0x02:
            size = struct.unpack(">Q", bytes([size]) + self._read_exactly(7))[0]
        self._read_exactly(size)  # the node's READY

    def _read_exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("node closed the connection during the handshake")
            data += chunk
        return data

    def send_frame(self, data: bytes, more: bool) -> None:
        self.sock.sendall(frame_header(len(data), more) + data)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self, timeout: float) -> bool:
        """Whether the node has closed (or reset) this connection within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()
