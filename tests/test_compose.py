"""docker-compose.yml and the Dockerfile, with no Docker engine here: each service's command, environment and
healthcheck run as local processes (compose's hostnames and ports mapped onto free 127.0.0.1 ports, volumes onto
local folders), one profile at a time:
- `cpu`: broker, gateway and the CPU worker on the embedded model serve a chat through the gateway (the official
  openai client), every healthcheck passes, and stopping in compose's stop order lets the broker drain a job;
- `gpu`: the two GPU workers' commands (the model swapped for tiny-llama on CPU) serve a request.
The broker and gateway run with torch made unimportable, as in their image. Also `tokenmill up`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers_net import REPO, addr, free_port, procs_ctx, wait_until, wait_workers

from tokenmill.client import Client
from tokenmill.worker.registry_fetch import cache_dir

pytestmark = pytest.mark.timeout(300)

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
GPU_WORKERS, CPU_WORKERS = ("worker-0", "worker-1"), ("worker-cpu",)
# `tokenmill ...` with torch unimportable: what the broker/gateway image (no torch) runs
NO_TORCH = [sys.executable, "-c", "import sys; sys.modules['torch'] = None; from tokenmill.cli.main import main; "
                                  "sys.exit(main(sys.argv[1:]))"]


def _interpolate(value: Any, env: dict[str, str]) -> str:
    """Compose's ${VAR} / ${VAR:-default} interpolation."""
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), str(value))


def _compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def services_of(profile: str) -> dict[str, Any]:
    """The services `docker compose --profile PROFILE up` starts: those without a profile, and the profile's."""
    return {n: s for n, s in _compose()["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def stop_order(services: dict[str, Any]) -> list[str]:
    """The order `docker compose down` stops services in: every service before the ones it depends on
    (dependencies on services outside the profile, `required: false`, are left out)."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in services[name].get("depends_on", {}):
            if dep in services:
                visit(dep)
        order.append(name)  # start order: dependencies first

    for name in services:
        visit(name)
    return order[::-1]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_file_shape(profile: str) -> None:
    compose = _compose()
    all_services = compose["services"]
    assert set(all_services) == {"broker", "gateway", *GPU_WORKERS, *CPU_WORKERS}
    services = services_of(profile)
    workers = GPU_WORKERS if profile == "gpu" else CPU_WORKERS
    assert set(services) == {"broker", "gateway", *workers}
    order = stop_order(services)
    assert order[:2] == ["gateway", "broker"] and set(order[2:]) == set(workers)  # the broker drains first
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped" and svc["command"][0] == "tokenmill", name
        assert svc["healthcheck"]["test"][:2] == ["CMD", "tokenmill"], name
        assert svc["image"].split(":")[0] in {"tokenmill-gateway", "tokenmill-cpu", "tokenmill-cuda"}
    for name in GPU_WORKERS:
        res = all_services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert res[0]["driver"] == "nvidia" and "gpu" in res[0]["capabilities"]
        assert all_services[name]["environment"]["TOKENMILL_BROKER"] == "tcp://broker:5556"
        assert all_services[name]["image"] == "tokenmill-cuda:latest"
    assert sorted(d for n in GPU_WORKERS for d in
                  all_services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]) == ["0", "1"]
    for name in (*GPU_WORKERS, *CPU_WORKERS):
        assert {"models:/models:ro", "cache:/cache"} <= set(all_services[name]["volumes"])
    assert set(compose["volumes"]) == {"models", "cache"}
    for name in ("broker", "gateway"):  # the broker finishes its jobs, the gateway its open streams
        assert all_services[name]["stop_grace_period"] == "40s", name  # > TOKENMILL_DRAIN_TIMEOUT's 30
    assert "5555:5555" in all_services["broker"]["ports"] and "8000:8000" in all_services["gateway"]["ports"]


def test_dockerfile_targets() -> None:
    """Three images: gateway (no torch), cpu, cuda (a CUDA base image, gcc and Python headers for Triton,
    torch pinned); each copies every package that pyproject.toml maps."""
    import tomllib

    text = (REPO / "Dockerfile").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    stages = {m.group(2): m.group(1) for m in re.finditer(r"^FROM (\S+) AS (\w+)$", code, re.M)}
    assert set(stages) == {"source", "gateway", "cpu", "cuda"}
    body = dict(zip(stages, re.split(r"^FROM .*$", code, flags=re.M)[1:]))
    assert "torch" not in body["gateway"].replace("find_spec('torch') is not None", "")
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:\S+", text) and stages["cuda"] == "${CUDA_IMAGE}"
    assert "gcc" in body["cuda"] and "python3-dev" in body["cuda"]
    assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+", text) and '"torch==${TORCH_VERSION}"' in body["cuda"]
    assert '"torch==${TORCH_VERSION}"' in body["cpu"] and "[worker" in body["cpu"] and "[worker" in body["cuda"]
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", body["source"], re.M))
    assert copied == set(packages)
    for svc in _compose()["services"].values():
        assert svc["image"].split(":")[0].removeprefix("tokenmill-") in stages
        if "build" in svc:
            assert svc["build"]["target"] == svc["image"].split(":")[0].removeprefix("tokenmill-")


# ---- the services as processes -----------------------------------------------------------------------


class Local:
    """Compose's names, ports and volumes mapped onto this machine."""

    def __init__(self) -> None:
        self.front, self.back, self.http = free_port(), free_port(), free_port()
        self.cache = str(cache_dir())
        self.map = {"tcp://0.0.0.0:5555": addr(self.front), "tcp://0.0.0.0:5556": addr(self.back),
                    "tcp://broker:5555": addr(self.front), "tcp://broker:5556": addr(self.back),
                    "tcp://127.0.0.1:5555": addr(self.front), "http://127.0.0.1:8000": f"http://127.0.0.1:{self.http}"}

    def text(self, value: str) -> str:
        for k, v in self.map.items():
            value = value.replace(k, v)
        return value

    def env(self, svc: dict[str, Any], overrides: dict[str, str]) -> dict[str, str]:
        env = {k: self.text(_interpolate(v, overrides)) for k, v in svc["environment"].items()}
        if "TOKENMILL_HOST" in env:
            env["TOKENMILL_HOST"] = "127.0.0.1"  # tests listen on 127.0.0.1 only
        if "TOKENMILL_PORT" in env:
            env["TOKENMILL_PORT"] = str(self.http)
        if "cache:/cache" in svc.get("volumes", []):
            env["TOKENMILL_CACHE"] = self.cache  # the images set TOKENMILL_CACHE=/cache, the volume
        return env

    def healthcheck(self, svc: dict[str, Any]) -> list[str]:
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "tokenmill"
        return [self.text(t) for t in test[2:]]


def _health_ok(argv: list[str]) -> bool:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", *argv], cwd=REPO, capture_output=True,
                          timeout=60).returncode == 0


@contextlib.contextmanager
def _profile(tmp: Path, profile: str, overrides: dict[str, str]) -> Iterator[tuple[Local, dict[str, Any], Any]]:
    """Start the profile's services (in compose's start order) as processes; yield (ports, services, procs)."""
    local = Local()
    services = services_of(profile)
    with procs_ctx(tmp) as ps:
        for name in stop_order(services)[::-1]:
            svc = services[name]
            no_torch = svc["image"].startswith("tokenmill-gateway")
            ps.spawn(svc["command"][1:], name, env=local.env(svc, overrides), argv0=NO_TORCH if no_torch else None)
        yield local, services, ps


def test_cpu_profile_serves_a_chat_through_the_gateway(tmp_path: Path) -> None:
    import openai

    with _profile(tmp_path, "cpu", {"TOKENMILL_MAX_NUM_SEQS": "4"}) as (local, services, ps):
        names = stop_order(services)
        with Client(addr(local.front)) as c:
            wait_workers(c, 1, timeout=240)
        for name in names:  # every healthcheck passes once the pool is up
            wait_until(lambda n=name: _health_ok(local.healthcheck(services[n])), 60, 0.5, f"{name} healthy")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{local.http}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        r = client.chat.completions.create(model="embedded", messages=[
            {"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0.0)
        assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens > 0
        assert "paris" in r.choices[0].message.content.lower()
        # compose's stop order: gateway, then broker (it drains the job in flight while the worker runs), workers
        with Client(addr(local.front)) as c:
            job = c.submit("Once upon a time", model="embedded", max_tokens=40, ignore_eos=True, temperature=0.0)
            wait_until(lambda: c.stats()["active_jobs"] == 1, 10, 0.05, "the job running")
            by_name = {log.name.rsplit("-", 1)[0]: pr for log, pr in zip(ps.logs, ps.procs)}
            for name in names:
                by_name[name].send_signal(signal.SIGTERM)
                assert by_name[name].wait(45) == 0, ps.dump_logs()
            result = job.result(timeout=10)
        assert result.finish_reason == "length" and len(result.token_ids) == 40


def test_gpu_profile_services_as_local_processes_serve_a_request(tmp_path: Path) -> None:
    # What a .env file would set for this machine: the tiny model on CPU, short heartbeats.
    overrides = {"TOKENMILL_MODEL": "tiny-llama", "TOKENMILL_LOAD_FORMAT": "dummy", "TOKENMILL_DEVICE": "cpu",
                 "TOKENMILL_HEARTBEAT_INTERVAL": "0.2"}
    with _profile(tmp_path, "gpu", overrides) as (local, services, _):
        with Client(addr(local.front)) as c:
            stats = wait_workers(c, 2)
            assert {w["name"] for w in stats["workers"]} == set(GPU_WORKERS)
            r = c.generate("compose round trip", model="tiny-llama", max_tokens=5, ignore_eos=True, timeout=30)
            assert len(r.token_ids) == 5 and r.finish_reason == "length"
        for name in GPU_WORKERS:
            assert _health_ok(local.healthcheck(services[name]))


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


def test_up_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    """The first Ctrl-C drains (the broker says what it waits for); the second stops everything now."""
    front, back = free_port(), free_port()
    log = tmp_path / "up.log"
    with open(log, "wb") as f:
        up = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli.main", "up", "--model", "tiny-llama", "--load-format", "dummy",
             "--device", "cpu", "--frontend", addr(front), "--backend", addr(back), "--heartbeat-interval", "0.2",
             "--drain-timeout", "120", "--max-num-seqs", "1"], stdout=subprocess.PIPE, stderr=f, cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        assert up.stdout is not None and up.stdout.readline().decode().strip() == addr(front)
        with Client(addr(front)) as c:
            for _ in range(4):  # one at a time (--max-num-seqs 1), ~6 s each at 3 ms a token
                c.submit("x", model="tiny-llama", max_tokens=2000, ignore_eos=True)
            wait_until(lambda: c.stats()["active_jobs"] == 4, 10, 0.05, "the jobs in")
            up.send_signal(signal.SIGINT)
            wait_until(lambda: "job(s) in flight" in log.read_text(), 15, 0.1, "the drain message")
            assert "Ctrl-C again" in log.read_text() and up.poll() is None
            t0 = time.monotonic()
            up.send_signal(signal.SIGINT)
            up.wait(20)
            assert time.monotonic() - t0 < 15
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)
        up.wait(10)
    assert subprocess.run(["pgrep", "-s", str(up.pid)], capture_output=True).stdout == b""  # no child left
