"""Issue 13, item 1 and a smaller item: CURVE keys have roles. A client key is refused on the worker
socket (it could otherwise register as a worker and read other tenants' prompts) and a worker key on the
client socket; a refused key reads as refused authentication (AuthenticationFailed at once), not as an
outage (BrokerUnavailable after the silence timeout). Real broker and workers on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_net import FAKE, addr, free_port, procs_ctx, wait_workers

from tokenmill.client import AuthenticationFailed, Client
from tokenmill.protocol.keys import (
    ROLE_CLIENT,
    ROLE_WORKER,
    generate_keypair,
    install_public_key,
    load_allow_list,
    load_role,
)

pytestmark = pytest.mark.timeout(180)


def _keys(tmp: Path, *args: str) -> Path:
    keys = tmp / "keys"
    subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "keys", "generate", str(keys), *args], check=True,
                   timeout=60, capture_output=True)
    return keys


def test_keys_generate_writes_roles(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "--name", "broker", "--name", "worker-a", "--name", "alice", "--worker", "gpu0")
    roles = {p.name: load_role(p) for p in (keys / "allowed").iterdir()}
    assert roles == {"worker-a.key": ROLE_WORKER, "alice.key": ROLE_CLIENT, "gpu0.key": ROLE_WORKER}
    assert load_role(keys / "broker.key") is None
    assert load_role(keys / "alice.key_secret") == ROLE_CLIENT
    assert set(load_allow_list(keys / "allowed").values()) == {ROLE_CLIENT, ROLE_WORKER}


def test_allow_list_roles(tmp_path: Path) -> None:
    pub, _ = generate_keypair(tmp_path / "k", "w", ROLE_WORKER)
    old, _ = generate_keypair(tmp_path / "k", "old")  # a key file from before roles: admitted nowhere
    install_public_key(pub, tmp_path / "allow")
    install_public_key(old, tmp_path / "allow")
    allow = load_allow_list(tmp_path / "allow")
    assert sorted(allow.values(), key=str) == [None, ROLE_WORKER]
    with pytest.raises(ValueError, match="role"):
        generate_keypair(tmp_path / "k", "x", "admin")
    # The same key listed with two roles is refused outright.
    (tmp_path / "allow" / "twice.key").write_text(pub.read_text().replace('"worker"', '"client"'))
    with pytest.raises(ValueError, match="two roles"):
        load_allow_list(tmp_path / "allow")


def test_keys_cross_no_socket_and_refusal_reads_as_authentication(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "--name", "broker", "--name", "worker", "--name", "alice")
    _, stranger = generate_keypair(tmp_path / "elsewhere", "mallory", ROLE_CLIENT)
    server_key = str(keys / "broker.key")
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back, "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow",
                  str(keys / "allowed"))
        ps.worker(back, "--curve-server-key", server_key, "--curve-secret", str(keys / "worker.key_secret"),
                  model=FAKE, name="wa")
        # A client key on the worker socket: would receive every tenant's prompts if admitted.
        ps.worker(back, "--curve-server-key", server_key, "--curve-secret", str(keys / "alice.key_secret"),
                  model=FAKE, name="impostor")

        def client(secret: Path) -> Client:
            return Client(addr(front), curve_server_key=server_key, curve_secret_key=str(secret),
                          broker_timeout=10.0, heartbeat_interval=0.2)

        with client(keys / "alice.key_secret") as alice:
            wait_workers(alice, 1, timeout=60)
            assert len(alice.generate("hello", max_tokens=3).token_ids) == 3
            time.sleep(2.0)  # the impostor keeps trying meanwhile (its READY never gets through)
            stats = alice.stats()
            assert [w["name"] for w in stats["workers"]] == ["wa"]
            assert stats["zap"]["refused_role"] >= 1

            # A worker key on the client socket, and a key the broker never heard of: refused
            # authentication, said at once, not a 10 s silence.
            for secret in (keys / "worker.key_secret", stranger):
                with client(secret) as other:
                    t0 = time.monotonic()
                    with pytest.raises(AuthenticationFailed, match="refused"):
                        other.generate("let me in", max_tokens=2)
                    assert time.monotonic() - t0 < 3.0
            # No key at all against a CURVE broker: also an authentication failure.
            with Client(addr(front), broker_timeout=10.0) as plain:
                t0 = time.monotonic()
                with pytest.raises(AuthenticationFailed):
                    plain.generate("no key", max_tokens=2)
                assert time.monotonic() - t0 < 3.0
            assert alice.stats()["zap"]["refused"] >= 3
