"""Acceptance item 8: CURVE with ZAP. Keys from `tokenmill keys generate` are not world-readable; an
unknown key (or no key) is refused; a known key streams; another known client cannot cancel or
subscribe to a job that is not its own (with CURVE the owner is the client key, whatever token it sends)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_net import addr, free_port, procs_ctx, wait_until, wait_workers

from tokenmill.client import BrokerUnavailable, Cancelled, Client, Forbidden
from tokenmill.protocol.keys import generate_keypair

pytestmark = pytest.mark.timeout(180)


def test_keys_generate_writes_private_files(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "keys", "generate", str(keys)], check=True,
                   timeout=60, capture_output=True)
    files = sorted(keys.rglob("*.key*"))
    assert {f.name for f in files} >= {"broker.key", "broker.key_secret", "client.key", "worker.key_secret"}
    assert {f.name for f in (keys / "allowed").iterdir()} == {"client.key", "worker.key"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert "secret-key" in (keys / "client.key_secret").read_text()
    assert "secret-key" not in (keys / "allowed" / "client.key").read_text()


def test_curve_refuses_unknown_keys_and_enforces_ownership(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "keys", "generate", str(keys), "--name", "broker",
                    "--name", "worker", "--name", "alice", "--name", "bob"], check=True, timeout=60,
                   capture_output=True)
    _, stranger = generate_keypair(tmp_path / "elsewhere", "mallory")
    server_key = str(keys / "broker.key")
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back, "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow",
                  str(keys / "allowed"))
        ps.worker(back, "--curve-server-key", server_key, "--curve-secret", str(keys / "worker.key_secret"))

        def client(secret: Path, **kw: object) -> Client:
            return Client(addr(front), curve_server_key=server_key, curve_secret_key=str(secret),
                          broker_timeout=1.5, heartbeat_interval=0.2, **kw)  # type: ignore[arg-type]

        with client(keys / "alice.key_secret", owner="shared-token") as alice, \
                client(keys / "bob.key_secret", owner="shared-token") as bob:
            wait_workers(alice, 1, timeout=60)
            # A known key streams.
            events = list(alice.stream("hello curve", max_tokens=5, ignore_eos=True, timeout=30))
            assert sum(len(e.token_ids) for e in events) == 5 and events[-1].finished

            # Bob may not touch Alice's job, even with the same owner token.
            h = alice.submit("alice's long job", max_tokens=1800, ignore_eos=True)
            next(iter(h.stream(timeout=30)))
            with pytest.raises(Forbidden):
                bob.cancel(h.job_id)
            with pytest.raises(Forbidden):
                bob.subscribe(h.job_id).result(timeout=10)
            alice.cancel(h.job_id)
            with pytest.raises(Cancelled):
                h.result(timeout=10)

            # An unknown key, and no key at all, are refused at the handshake: nothing gets through.
            with client(stranger) as mallory, pytest.raises(BrokerUnavailable):
                mallory.generate("let me in", max_tokens=2)
            with Client(addr(front), broker_timeout=1.5) as plain, pytest.raises(BrokerUnavailable):
                plain.generate("no key", max_tokens=2)
            stats = alice.stats()
            assert stats["zap"]["refused"] >= 1
            assert stats["counters"]["forbidden"] >= 2
            wait_until(lambda: alice.stats()["workers"][0]["running"] == 0, 10, what="worker idle")
