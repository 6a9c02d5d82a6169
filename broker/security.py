"""CURVE server setup and a ZAP handler that admits only allow-listed public keys, each on the socket its
role names.

The handler runs on its own thread with a REP socket bound to the ZAP endpoint of the broker's context
(libzmq asks it about every CURVE handshake on every server socket of that context). Each server socket
has its own ZAP domain (DOMAIN_CLIENTS, DOMAIN_WORKERS); a key is admitted only on the socket of its role
(protocol.keys: a client key on the frontend, a worker key on the backend), so an admitted client cannot
register as a worker nor a worker pose as a client. A refusal answers status 400, which the peer's libzmq
reports as a failed authentication (HANDSHAKE_FAILED_AUTH; the SDK raises AuthenticationFailed). The user
id it returns is the peer's z85 public key; the broker reads it from each message's "User-Id" property
and uses it as the job owner.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import structlog
import zmq
from zmq.utils import z85

from tokenmill.protocol.keys import ROLE_CLIENT, ROLE_WORKER, load_allow_list

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
DOMAIN_CLIENTS = b"clients"  # the frontend's ZAP domain
DOMAIN_WORKERS = b"workers"  # the backend's
ROLE_OF_DOMAIN = {DOMAIN_CLIENTS: ROLE_CLIENT, DOMAIN_WORKERS: ROLE_WORKER}

log = structlog.get_logger("tokenmill.broker.zap")


class ZapAuthenticator:
    """Allow-list CURVE authenticator (a ZAP handler thread): `allowed_keys` maps each admitted z85 public
    key to its role (protocol.keys.load_allow_list; None: admitted nowhere). Counts who it admitted and
    refused (`refused_role`: known keys refused on the other role's socket)."""

    def __init__(self, ctx: zmq.Context, allowed_keys: Mapping[bytes, str | None]) -> None:
        self._ctx = ctx
        self._allowed = dict(allowed_keys)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-zap", daemon=True)
        self.accepted = 0
        self.refused = 0
        self.refused_role = 0

    def start(self) -> None:
        """Bind the ZAP endpoint (must happen before the server sockets accept handshakes)."""
        self._thread.start()
        self._ready.wait(5.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    req = sock.recv_multipart()
                    try:
                        reply = self._answer(req)
                    except Exception:  # never let a bad request kill the handler: refuse it
                        log.exception("zap_error")
                        self.refused += 1
                        reply = [ZAP_VERSION, req[1] if len(req) > 1 else b"", b"500", b"error", b"", b""]
                    sock.send_multipart(reply)
        finally:
            sock.close()

    def _answer(self, req: list[bytes]) -> list[bytes]:
        """ZAP request: version, request id, domain, address, identity, mechanism, credentials..."""
        if len(req) < 6:
            self.refused += 1
            return [ZAP_VERSION, req[1] if len(req) > 1 else b"", b"400", b"malformed", b"", b""]
        version, request_id, domain, address, _identity, mechanism = req[:6]
        creds = req[6:]
        if version != ZAP_VERSION or mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            self.refused += 1
            log.warning("zap_refused", reason="mechanism", address=address.decode(errors="replace"))
            return [ZAP_VERSION, request_id, b"400", b"CURVE required", b"", b""]
        key = z85.encode(creds[0])
        if key not in self._allowed:
            self.refused += 1
            log.warning("zap_refused", reason="unknown key", address=address.decode(errors="replace"))
            return [ZAP_VERSION, request_id, b"400", b"unknown key", b"", b""]
        role, wanted = self._allowed[key], ROLE_OF_DOMAIN.get(domain)
        if wanted is None or role != wanted:
            self.refused += 1
            self.refused_role += 1
            log.warning("zap_refused", reason="role", key_role=role, socket=domain.decode(errors="replace"),
                        address=address.decode(errors="replace"))
            return [ZAP_VERSION, request_id, b"400", b"key not admitted on this socket", b"", b""]
        self.accepted += 1
        return [ZAP_VERSION, request_id, b"200", b"OK", key, b""]


def load_zap_allow_list(directory: str | None) -> dict[bytes, str | None]:
    """The allow list of the *.key files in `directory` (none: empty), warning about keys without a role."""
    allowed = load_allow_list(directory) if directory else {}
    roleless = sum(role is None for role in allowed.values())
    if roleless:
        log.warning("curve_keys_without_role", count=roleless, directory=directory,
                    hint="admitted nowhere; make keys with `tokenmill keys generate` (roles client, worker)")
    return allowed


def make_curve_server(sock: zmq.Socket, public: bytes, secret: bytes, domain: bytes) -> None:
    """Configure `sock` as a CURVE server (before bind); ZAP then authenticates every client."""
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.zap_domain = domain
    # Refuse every handshake when no ZAP handler answers (libzmq would otherwise admit anyone).
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
