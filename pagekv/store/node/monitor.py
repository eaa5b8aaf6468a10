"""What a node's socket sees of its clients: open connections and failed handshakes.

A ZeroMQ socket monitor reports every accepted and closed connection and every handshake that
failed. :class:`ConnectionMonitor` counts them for the metrics and logs the handshake failures
the ZAP handler never sees (a client holding the wrong server key cannot even be identified:
its HELLO does not decrypt), at most once a minute per kind.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["EVENTS", "ConnectionMonitor"]

log = logging.getLogger("pagekv.store.node.monitor")
_LOG_EVERY_S = 60.0
EVENTS = (
    zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)  # fmt: skip


def _failure_kind(event: int, value: int) -> str | None:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "auth"  # the ZAP handler logged the key
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "other"
    if event != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return None
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "mechanism"
    return "crypto" if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC else "protocol"


_EXPLAIN = {
    "mechanism": "a client connected with another security mechanism (CURVE on one side only)",
    "crypto": "a client failed the CURVE handshake: it may hold the wrong server public key "
    "(--curve-server-cert must be this node's NAME.key)",
    "protocol": "a client's handshake broke the ZeroMQ protocol",
    "other": "a client's handshake failed",
}


class ConnectionMonitor:
    """Watches ``sock`` (a node's ROUTER) from its own thread. Create it before the node's loop
    starts; :meth:`stop` (or closing the socket) ends it. Counters are read from any thread.

    libzmq gives a socket one monitor: when something else owns it already, pass ``sock=None``
    and have the owner call :meth:`on_event` for each event (with the handshake events in its
    mask, :data:`EVENTS`)."""

    def __init__(self, sock: zmq.Socket | None) -> None:
        self._open = 0  # ACCEPTED less DISCONNECTED: below 0 for a moment (see on_event)
        self.accepted = 0
        self.handshake_failures: dict[str, int] = dict.fromkeys(
            ("auth", "mechanism", "crypto", "protocol", "other"), 0
        )
        self._logged: dict[str, tuple[float, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if sock is not None:
            self._monitor = sock.get_monitor_socket(EVENTS)
            self._thread = threading.Thread(target=self._run, name="pagekv-monitor", daemon=True)
            self._thread.start()

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet disconnected."""
        return max(0, self._open)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._monitor.poll(100):
                    continue
                event = recv_monitor_message(self._monitor)
                kind = int(event["event"])
                if kind == zmq.EVENT_MONITOR_STOPPED:
                    return
                self.on_event(kind, int(event["value"]))
        except zmq.ZMQError as e:  # the node's socket closed under us: nothing left to watch
            log.debug("connection monitor stopped: %s", e)
        finally:
            self._monitor.close(linger=0)

    def on_event(self, kind: int, value: int) -> None:
        """Count one monitor event (``kind``: ``zmq.EVENT_*``, ``value``: its fd or error)."""
        if kind == zmq.EVENT_ACCEPTED:
            self.accepted += 1
            self._open += 1
        elif kind == zmq.EVENT_DISCONNECTED:
            # may come before its ACCEPTED (:meth:`.guard.ConnectionGuard.on_event`): counted
            # as it comes, so the two cancel in either order
            self._open -= 1
        failure = _failure_kind(kind, value)
        if failure is not None:
            self.handshake_failures[failure] += 1
            if failure != "auth":
                self._log(failure)

    def _log(self, failure: str) -> None:
        now = time.monotonic()
        last, suppressed = self._logged.get(failure, (-_LOG_EVERY_S, 0))
        if now - last < _LOG_EVERY_S:
            self._logged[failure] = (last, suppressed + 1)
            return
        self._logged[failure] = (now, 0)
        more = f" (+{suppressed} more since the last report)" if suppressed else ""
        log.warning("pagekv node: %s%s", _EXPLAIN[failure], more)
