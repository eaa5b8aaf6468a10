"""Tell a dead node from a misconfigured one: one PING on its own socket, watched by a ZeroMQ
socket monitor, for ``pagekv ping``/``stats`` and for anyone who must say why a node is silent.

A refused key, a wrong server certificate or a CURVE/plain mismatch all end in a handshake
failure event; a dead or black-holed node never gets that far. :func:`probe` says which.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..config import CurveClientKeys
from ..wire.protocol import Op, ProtocolError, Request, decode_reply, encode_request

__all__ = ["Outcome", "ProbeResult", "probe"]

_NO_DETAIL = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class Outcome(str, enum.Enum):
    OK = "ok"
    AUTH_FAILED = "authentication failed"
    UNREACHABLE = "unreachable"
    NO_ANSWER = "no answer"


@dataclass(frozen=True)
class ProbeResult:
    endpoint: str
    outcome: Outcome
    detail: str = ""
    rtt_s: float | None = None  # round trip of the PING, when it was answered

    def __bool__(self) -> bool:
        return self.outcome is Outcome.OK

    def __str__(self) -> str:
        if self.outcome is Outcome.OK:
            return f"ok {self.rtt_s * 1e3:.2f} ms"
        return f"{self.outcome.value}: {self.detail}" if self.detail else self.outcome.value


def _auth_detail(event: int, value: int, curve: bool) -> str | None:
    """Why a handshake failed, or None when the event is not a handshake failure."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("the node refused this client's key: is its public NAME.key in the node's "
                "--curve-allow directory?")  # fmt: skip
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return ("security mismatch: the node requires CURVE (give --curve-server-cert and "
                    "--curve-client-cert)" if not curve else
                    "security mismatch: this client uses CURVE, the node does not")  # fmt: skip
        return f"handshake protocol error {value:#x}" + (
            ": is --curve-server-cert this node's public certificate?" if curve else ""
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return ("CURVE handshake failed: is --curve-server-cert this node's public certificate?"
                if curve else "handshake failed: the node closed the connection; it requires "
                "CURVE (give --curve-server-cert and --curve-client-cert), or it is at its "
                "connection limit (see its refused_connections)")  # fmt: skip
    return None


def probe(
    endpoint: str,
    *,
    curve: CurveClientKeys | None = None,
    timeout_s: float = 2.0,
    context: zmq.Context | None = None,
) -> ProbeResult:
    """PING ``endpoint`` once on a fresh socket and classify the outcome within ``timeout_s``.
    Never raises for a node's failure (a bad endpoint string raises ``zmq.ZMQError``)."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        return _watch(endpoint, sock, monitor, curve is not None, timeout_s)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def _watch(endpoint: str, sock, monitor, curve: bool, timeout_s: float) -> ProbeResult:
    start = time.monotonic()
    deadline = start + timeout_s
    try:  # never a blocking send: a handshake refused (a CURVE key not allowed) before this
        # line leaves the socket no pipe to the node and none ever again, so a blocking send
        # would wait forever; the monitor's events then say what happened
        sock.send(encode_request(Request(Op.PING, 1)), zmq.NOBLOCK)
    except zmq.Again:
        pass
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    seen: dict[int, int] = {}  # event -> times seen
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(left * 1000))
        if sock in ready:
            rtt = time.monotonic() - start
            try:
                reply = decode_reply(sock.recv_multipart()[0])
            except ProtocolError as e:
                return ProbeResult(endpoint, Outcome.NO_ANSWER, f"not a pagekv node ({e})")
            if reply.id == 1:
                return ProbeResult(endpoint, Outcome.OK, rtt_s=rtt)
        if monitor in ready:
            event = recv_monitor_message(monitor)
            kind, value = int(event["event"]), int(event["value"])
            seen[kind] = seen.get(kind, 0) + 1
            detail = _auth_detail(kind, value, curve)
            # a failure without detail is final once repeated (a detailed one may follow it)
            if detail is not None and (kind != _NO_DETAIL or seen[kind] >= 3):
                return ProbeResult(endpoint, Outcome.AUTH_FAILED, detail)
            if seen.get(zmq.EVENT_CONNECT_RETRIED, 0) >= 3 and zmq.EVENT_CONNECTED not in seen:
                return ProbeResult(endpoint, Outcome.UNREACHABLE, "connection refused")
    if _NO_DETAIL in seen:
        return ProbeResult(endpoint, Outcome.AUTH_FAILED, _auth_detail(_NO_DETAIL, 0, curve) or "")
    if zmq.EVENT_HANDSHAKE_SUCCEEDED in seen:
        return ProbeResult(endpoint, Outcome.NO_ANSWER, f"connected, no reply in {timeout_s:g} s")
    if zmq.EVENT_CONNECTED in seen:
        return ProbeResult(endpoint, Outcome.NO_ANSWER, "connected, but no ZeroMQ handshake")
    if zmq.EVENT_CONNECT_RETRIED in seen or zmq.EVENT_CLOSED in seen:
        return ProbeResult(endpoint, Outcome.UNREACHABLE, "connection refused")
    return ProbeResult(endpoint, Outcome.UNREACHABLE, f"no connection in {timeout_s:g} s")
