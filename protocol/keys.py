"""CURVE key files (shared by the client SDK, the broker and the worker; torch-free).

A key pair is two files in the ZeroMQ certificate format (readable by `zmq.auth.load_certificate`):
`NAME.key` holds the public key, `NAME.key_secret` both keys. Both are written with mode 0600 in a
directory of mode 0700: no key file is ever world-readable.

Keys have roles, written in the certificate's metadata (`role = "client"` or `role = "worker"`): the
broker admits a client key on its client socket only and a worker key on its worker socket only, so an
admitted client can never register as a worker (and read other tenants' prompts), nor a worker pose as a
client. A public key file without a role is admitted nowhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import zmq

_PUBLIC = re.compile(r'public-key\s*=\s*"([^"]{40})"')
_SECRET = re.compile(r'secret-key\s*=\s*"([^"]{40})"')
_ROLE = re.compile(r'^\s*role\s*=\s*"([a-z]+)"', re.MULTILINE)

ROLE_CLIENT = "client"  # admitted on the broker's frontend (client) socket only
ROLE_WORKER = "worker"  # admitted on the broker's backend (worker) socket only
ROLES = frozenset({ROLE_CLIENT, ROLE_WORKER})


def _write_private(path: Path, text: str) -> None:
    """Create or replace `path` with mode 0600 (set at creation, so the content is never exposed)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # in case the file pre-existed with looser bits
    os.replace(tmp, path)


def _check_role(role: str | None) -> None:
    if role is not None and role not in ROLES:
        raise ValueError(f"key role {role!r} is not one of {sorted(ROLES)}")


def _cert(public: bytes, secret: bytes | None, role: str | None) -> str:
    _check_role(role)
    meta = [f'    role = "{role}"'] if role is not None else []
    lines = ["#   ****  tokenmill CURVE certificate; keep the secret key private  ****", "metadata", *meta, "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def generate_keypair(directory: str | os.PathLike[str], name: str, role: str | None = None) -> tuple[Path, Path]:
    """Write a new key pair as DIR/NAME.key and DIR/NAME.key_secret with `role` (ROLE_CLIENT, ROLE_WORKER, or
    None for the broker's own key); returns (public, secret) paths."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"key name {name!r} may only hold letters, digits, '_', '.', '-'")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    _check_role(role)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = d / f"{name}.key", d / f"{name}.key_secret"
    _write_private(pub_path, _cert(public, None, role))
    _write_private(sec_path, _cert(public, secret, role))
    return pub_path, sec_path


def install_public_key(public_file: str | os.PathLike[str], allow_dir: str | os.PathLike[str]) -> Path:
    """Copy a public key file (its key and role) into an allow directory (what the broker's --curve-allow
    reads)."""
    d = Path(allow_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    dest = d / Path(public_file).name
    _write_private(dest, _cert(load_public_key(public_file), None, load_role(public_file)))
    return dest


def load_public_key(path_or_key: str | os.PathLike[str]) -> bytes:
    """A z85 public key: given directly (40 characters) or read from a key file."""
    s = os.fspath(path_or_key)
    if len(s) == 40 and not os.path.exists(s):
        return s.encode()
    m = _PUBLIC.search(Path(s).read_text())
    if m is None:
        raise ValueError(f"{s}: no public-key found")
    return m.group(1).encode()


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a NAME.key_secret file."""
    text = Path(path).read_text()
    pub, sec = _PUBLIC.search(text), _SECRET.search(text)
    if pub is None or sec is None:
        raise ValueError(f"{os.fspath(path)}: not a secret key file (needs public-key and secret-key)")
    return pub.group(1).encode(), sec.group(1).encode()


def load_role(path: str | os.PathLike[str]) -> str | None:
    """The role a key file's metadata names (ROLE_CLIENT or ROLE_WORKER), None if it names none."""
    m = _ROLE.search(Path(path).read_text())
    if m is None:
        return None
    _check_role(m.group(1))
    return m.group(1)


def load_allowed_keys(directory: str | os.PathLike[str]) -> set[bytes]:
    """All public keys of the *.key files in a directory, whatever their roles."""
    return {load_public_key(p) for p in sorted(Path(directory).glob("*.key"))}


def load_allow_list(directory: str | os.PathLike[str]) -> dict[bytes, str | None]:
    """The broker's allow list: public key -> its role (None: the file names no role, admitted nowhere),
    from the *.key files in a directory. A key listed twice with two roles is refused (ValueError)."""
    roles: dict[bytes, str | None] = {}
    for path in sorted(Path(directory).glob("*.key")):
        key, role = load_public_key(path), load_role(path)
        if key in roles and roles[key] != role:
            raise ValueError(f"{path}: this public key is listed with two roles ({roles[key]}, {role})")
        roles[key] = role
    return roles


def apply_client_curve(sock: zmq.Socket, server_key: bytes, keypair: tuple[bytes, bytes]) -> None:
    """Make `sock` a CURVE client of the server with public key `server_key` (before connect)."""
    sock.curve_serverkey = server_key
    sock.curve_publickey, sock.curve_secretkey = keypair
