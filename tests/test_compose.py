"""Acceptance item 9: the docker-compose.yml services, started as local processes (no Docker engine
here): each service's command with its environment, hosts and ports mapped onto 127.0.0.1, the model
swapped for tiny-llama on CPU; then a client round trip through them. Also `tokenmill up`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers_net import REPO, addr, free_port, procs_ctx, wait_workers

from tokenmill.client import Client

pytestmark = pytest.mark.timeout(180)

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> str:
    """Compose's ${VAR} / ${VAR:-default} interpolation."""
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), str(value))


def _compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_file_shape() -> None:
    services = _compose()["services"]
    assert set(services) == {"broker", "worker-0", "worker-1"}
    devices = []
    for name in ("worker-0", "worker-1"):
        res = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert res[0]["driver"] == "nvidia" and "gpu" in res[0]["capabilities"]
        devices += res[0]["device_ids"]
        assert services[name]["environment"]["TOKENMILL_BROKER"] == "tcp://broker:5556"
    assert sorted(devices) == ["0", "1"]
    assert "5555:5555" in services["broker"]["ports"]
    assert (REPO / "Dockerfile").read_text().count("pip install") >= 2


def test_compose_services_as_local_processes_serve_a_request(tmp_path: Path) -> None:
    front, back = free_port(), free_port()
    # What a .env file would set for this machine: the tiny model on CPU, short heartbeats.
    overrides = {"TOKENMILL_MODEL": "tiny-llama", "TOKENMILL_LOAD_FORMAT": "dummy", "TOKENMILL_DEVICE": "cpu",
                 "TOKENMILL_HEARTBEAT_INTERVAL": "0.2"}
    hosts = {"tcp://0.0.0.0:5555": addr(front), "tcp://0.0.0.0:5556": addr(back), "tcp://broker:5556": addr(back)}
    services = _compose()["services"]
    with procs_ctx(tmp_path) as ps:
        for name in ("broker", "worker-0", "worker-1"):
            svc = services[name]
            env = {k: _interpolate(v, overrides) for k, v in svc["environment"].items()}
            env = {k: hosts.get(v, v) for k, v in env.items()}
            cmd = list(svc["command"])
            assert cmd[0] == "tokenmill"
            ps.spawn(cmd[1:], name, env={**env, "OMP_NUM_THREADS": "1"})
        with Client(addr(front)) as c:
            stats = wait_workers(c, 2)
            assert {w["name"] for w in stats["workers"]} == {"worker-0", "worker-1"}
            r = c.generate("compose round trip", model="tiny-llama", max_tokens=5, ignore_eos=True, timeout=30)
            assert len(r.token_ids) == 5 and r.finish_reason == "length"


@pytest.mark.slow
def test_up_starts_broker_and_workers_and_stops_them(tmp_path: Path) -> None:
    front, back = free_port(), free_port()
    up_log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 (closed in finally)
    up = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli.main", "up", "--workers", "2", "--model", "tiny-llama",
         "--load-format", "dummy", "--device", "cpu", "--frontend", addr(front), "--backend", addr(back),
         "--heartbeat-interval", "0.2"],
        stdout=subprocess.PIPE, stderr=up_log, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    children: list[int] = []
    try:
        assert up.stdout is not None
        assert up.stdout.readline().decode().strip() == addr(front)  # printed once the workers are ready
        children = [int(x) for x in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 3
        with Client(addr(front)) as c:
            assert len(c.stats()["workers"]) == 2
            assert len(c.generate("up", model="tiny-llama", max_tokens=3, ignore_eos=True).token_ids) == 3
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        for pid in [*children, up.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        up.wait(10)
        up_log.close()
        print((tmp_path / "up.log").read_text()[-3000:])
