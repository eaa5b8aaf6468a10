"""CurveZMQ for store nodes: certificate files, ``pagekv keygen``, and the node's ZAP handler.

Files (``pagekv keygen DIR NAME`` writes ``NAME.key``, public, and ``NAME.key_secret``, mode
0600): a node takes its own ``*.key_secret`` (``--curve-secret-key``) and a directory of the
allowed clients' ``*.key`` (``--curve-allow``); a client takes the node's ``*.key``
(``--curve-server-cert``) and its own ``*.key_secret`` (``--curve-client-cert``).

:class:`ZapAuthenticator` answers libzmq's ZAP requests (RFC 27) for every CURVE socket of a
context: it admits the allowed client keys (or any, for ``'*'``) and logs each rejected
handshake with the client's public key and address, at most once a minute per key. A node
without CURVE in the same context asks it too (:data:`NULL_ZAP_DOMAIN`): admitted.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from pagekv.errors import ConfigError

from ..config import CurveClientKeys

__all__ = [
    "ALLOW_ANY",
    "NULL_ZAP_DOMAIN",
    "ZapAuthenticator",
    "load_allowed_keys",
    "load_client_keys",
    "load_secret_cert",
    "write_keypair",
]

log = logging.getLogger("pagekv.store.node.auth")
ALLOW_ANY = "*"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# the ZAP domain of a node without CURVE: set only to make libzmq refuse pre-ZMTP-3 peers
# (server.StoreNode._make_socket); a handler that its context happens to have admits all of it
NULL_ZAP_DOMAIN = b"pagekv-null"
_REJECT_LOG_EVERY_S = 60.0


def _load(path: str, what: str) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path}: No such file (pagekv keygen DIR NAME makes one)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{what} {path}: not a CURVE certificate ({e})") from None
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise ConfigError(f"{what} {path}: a key is not 40 Z85 characters")
    return public, secret


def load_secret_cert(path: str, what: str = "--curve-secret-key") -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of a ``*.key_secret`` file; ConfigError when it has no secret."""
    public, secret = _load(path, what)
    if secret is None:
        raise ConfigError(f"{what} {path}: has no secret key (give the .key_secret file)")
    return public, secret


def load_client_keys(server_cert: str | None, client_cert: str | None) -> CurveClientKeys | None:
    """A client's keys from ``--curve-server-cert`` and ``--curve-client-cert`` (both or none)."""
    if server_cert is None and client_cert is None:
        return None
    if server_cert is None or client_cert is None:
        given, missing = (
            ("--curve-server-cert", "--curve-client-cert") if client_cert is None
            else ("--curve-client-cert", "--curve-server-cert")
        )  # fmt: skip
        raise ConfigError(f"{given} needs {missing} too (CURVE takes both)")
    server_public, _ = _load(server_cert, "--curve-server-cert")
    public, secret = load_secret_cert(client_cert, "--curve-client-cert")
    return CurveClientKeys(server_public, public, secret)


def load_allowed_keys(location: str) -> dict[bytes, str] | None:
    """Allowed client public keys (Z85 -> certificate name) in directory ``location``, or None
    for ``'*'`` (any key). ConfigError when the directory is missing or holds no key."""
    if location == ALLOW_ANY:
        return None
    if not os.path.isdir(location):
        raise ConfigError(f"--curve-allow {location}: no such directory (use '*' for any key)")
    keys: dict[bytes, str] = {}
    for path in sorted(glob.glob(os.path.join(location, "*.key"))):
        public, _ = _load(path, "--curve-allow")
        keys[public] = Path(path).stem
    if not keys:
        raise ConfigError(
            f"--curve-allow {location}: holds no public certificate (*.key); every client would "
            "be refused. Copy the clients' NAME.key files there (pagekv keygen makes them)"
        )
    return keys


def write_keypair(directory: str, name: str, *, force: bool = False) -> tuple[str, str]:
    """Write ``directory/name.key`` and ``directory/name.key_secret`` (mode 0600). Never
    replaces an existing file unless ``force``. Raises ConfigError (bad name) or FileExistsError."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise ConfigError(f"key name {name!r} must be a plain file name (no path separators)")
    os.makedirs(directory, exist_ok=True)
    targets = [os.path.join(directory, name + ext) for ext in (".key", ".key_secret")]
    if not force:
        present = [t for t in targets if os.path.lexists(t)]
        if present:
            raise FileExistsError(f"{' and '.join(present)} already there; --force replaces")
    with tempfile.TemporaryDirectory(dir=directory, prefix=".keygen-") as tmp:  # mode 0700
        public, secret = zmq.auth.create_certificates(tmp, name)
        os.chmod(secret, 0o600)
        for src, dst in zip((public, secret), targets):
            if force:
                os.replace(src, dst)
            else:
                os.link(src, dst)  # fails if dst appeared meanwhile: never overwrites
    return targets[0], targets[1]


class ZapAuthenticator:
    """ZAP handler thread of one ``zmq.Context``; start before the CURVE socket binds.

    ``allowed``: Z85 public key -> name, or None for any key. ``rejected`` counts refusals."""

    def __init__(self, ctx: zmq.Context, allowed: dict[bytes, str] | None) -> None:
        self.allowed = allowed
        self.accepted = 0
        self.rejected = 0
        self._last_logged: dict[bytes, tuple[float, int]] = {}  # key -> (when, suppressed)
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # raises if another handler owns this context
        self._thread = threading.Thread(target=self._run, name="pagekv-zap", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        return {"auth_accepted": self.accepted, "auth_rejected": self.rejected}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
        finally:
            self._sock.close(linger=0)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: version, request id, status, text, user id, metadata."""
        if len(msg) < 6 or msg[0] != b"1.0":
            log.warning("pagekv node: malformed ZAP request (%d frames) refused", len(msg))
            return [b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"bad ZAP request", b"", b""]
        request_id, domain, mechanism, creds = msg[1], msg[2], msg[5], msg[6:]
        if mechanism == b"NULL" and domain == NULL_ZAP_DOMAIN:  # a node without CURVE
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        address = msg[3].decode(errors="replace")
        if mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            self.rejected += 1
            log.warning("pagekv node: refused a %s handshake from %s (this node needs CURVE)",
                        mechanism.decode(errors="replace"), address)  # fmt: skip
            return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
        key = z85.encode(creds[0])
        name = "any" if self.allowed is None else self.allowed.get(key)
        if name is None:
            self.rejected += 1
            self._log_rejected(key, address)
            return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""]
        self.accepted += 1
        log.debug("pagekv node: CURVE client %s (%s) from %s", key.decode(), name, address)
        return [b"1.0", request_id, b"200", b"OK", name.encode(), b""]

    def _log_rejected(self, key: bytes, address: str) -> None:
        now = time.monotonic()
        last, suppressed = self._last_logged.get(key, (-_REJECT_LOG_EVERY_S, 0))
        if now - last < _REJECT_LOG_EVERY_S:
            self._last_logged[key] = (last, suppressed + 1)
            return
        if len(self._last_logged) >= 4096:
            self._last_logged.clear()  # bounded memory against many distinct keys
        self._last_logged[key] = (now, 0)
        more = f" (+{suppressed} more since the last report)" if suppressed else ""
        log.warning(
            "pagekv node: rejected CURVE client key %s from %s: not in --curve-allow%s",
            key.decode(), address, more,
        )  # fmt: skip
