"""The command line against a running pool (one per module: a broker, a worker on the fake engine serving
`embedded`, a gateway; all on free 127.0.0.1 ports): `tokenmill ps`, `tokenmill health`, `tokenmill bench
serving --base-url`, the README's Client snippet, `tokenmill up` / `serve` / `broker` on ports already in use
(one line, exit 1, nothing found of the other pool), and the broker's drain (it says what it waits for; a
second Ctrl-C stops it at once)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers_net import FAKE, REPO, addr, free_port, procs_ctx, wait_until, wait_workers

from tokenmill.client import Client

pytestmark = pytest.mark.timeout(240)
MODEL = "embedded"  # the name the fake worker serves: what the README's snippets and `bench` ask for


@dataclass
class Pool:
    frontend: str
    backend: str
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except OSError:
        return 0


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("cli-pool")
    front, back, http = free_port(), free_port(), free_port()
    with procs_ctx(tmp) as ps:
        ps.broker(front, back)
        ps.worker(back, "--max-num-seqs", "8", model=["--model", MODEL, *FAKE[2:]], name="worker-a")
        ps.spawn(["gateway", "--broker", addr(front), "--port", str(http)], "gateway")
        p = Pool(addr(front), addr(back), http)
        with Client(p.frontend) as c:
            wait_workers(c, 1)
        wait_until(lambda: _health(f"{p.base_url}/health") == 200, 60, 0.2, "gateway /health 200")
        yield p


def _cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_CACHE"}
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**base, "OMP_NUM_THREADS": "1", **(env or {})})


def _one_line(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tokenmill: ") and "Traceback" not in proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


# ---- ps and health ----------------------------------------------------------------------------------


def test_ps_shows_the_models_workers_and_load(pool: Pool) -> None:
    proc = _cli("ps", "--broker", pool.frontend)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"broker {pool.frontend}: 1 worker(s)")
    model_row = next(line for line in lines if line.startswith(MODEL))
    assert model_row.split()[:3] == [MODEL, "1", "0"]  # one worker, nothing queued
    worker_row = next(line for line in lines if line.startswith("worker-a"))
    assert "0/8" in worker_row and "blocks" in worker_row and "s ago" in worker_row
    as_json = json.loads(_cli("ps", "--broker", pool.frontend, "--json").stdout)
    assert [w["name"] for w in as_json["workers"]] == ["worker-a"]


def test_ps_without_a_broker_is_one_line() -> None:
    _one_line(_cli("ps", "--broker", addr(free_port())), 1, "no broker answers at")


def test_health_checks_for_compose_and_kubernetes(pool: Pool) -> None:
    assert _cli("health", "--url", f"{pool.base_url}/health").returncode == 0
    assert _cli("health", "--broker", pool.frontend).returncode == 0
    assert _cli("health", "--broker", pool.frontend, "--worker", "worker-a").returncode == 0
    _one_line(_cli("health", "--broker", pool.frontend, "--worker", "worker-z"), 1, "'worker-z' is not registered")
    _one_line(_cli("health", "--url", f"http://127.0.0.1:{free_port()}/health", "--timeout", "1"), 1, "no answer")
    _one_line(_cli("health", "--broker", addr(free_port()), "--timeout", "1"), 1, "no broker answers")
    # a worker's liveness through the gateway's /health: its own entry decides; no answer cannot blame it
    health = f"{pool.base_url}/health"
    assert _cli("health", "--url", health, "--worker", "worker-a").returncode == 0
    _one_line(_cli("health", "--url", health, "--worker", "worker-z"), 1, "'worker-z' is not in the pool")
    assert _cli("health", "--url", f"http://127.0.0.1:{free_port()}/health", "--worker", "worker-a",
                "--timeout", "1").returncode == 0


# ---- through a running pool ---------------------------------------------------------------------------


def test_readme_client_snippet_prints_two_lines(pool: Pool) -> None:
    text = (REPO / "README.md").read_text()
    block = next(b.split("```", 1)[0] for b in text.split("```python\n")[1:] if "from tokenmill.client import" in b)
    assert 'Client("tcp://127.0.0.1:5555")' in block
    proc = subprocess.run([sys.executable, "-c", block.replace("tcp://127.0.0.1:5555", pool.frontend)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(len(line) == 32 for line in lines), proc.stdout  # fake engine: a char a token


def test_readme_http_snippets_work_as_written(pool: Pool) -> None:
    """The README's curl and `openai` snippets of the HTTP API, only their address replaced by the gateway's."""
    text = (REPO / "README.md").read_text().split("## The OpenAI-compatible HTTP API", 1)[1]
    readme_url = "http://127.0.0.1:8000"
    curl = next(b.split("```", 1)[0] for b in text.split("```bash\n")[1:] if b.startswith("curl "))
    assert readme_url in curl
    proc = subprocess.run(["bash", "-c", curl.replace(readme_url, pool.base_url)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] == 32, answer
    block = next(b.split("```", 1)[0] for b in text.split("```python\n")[1:] if "from openai import OpenAI" in b)
    assert readme_url in block
    proc = subprocess.run([sys.executable, "-c", block.replace(readme_url, pool.base_url)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [len(line) for line in lines] == [32, 16], proc.stdout  # fake engine: a char a token


def test_generate_through_the_broker(pool: Pool) -> None:
    proc = _cli("generate", "hello", "--broker", pool.frontend, "--max-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) == 6 and proc.stdout.endswith("\n")


def test_bench_serving_against_a_running_gateway(pool: Pool, tmp_path: Path) -> None:
    proc = _cli("bench", "serving", "--base-url", pool.base_url, "--model", MODEL, "--rates", "inf",
                "--num-prompts", "6", "--max-output-len", "12", "--time-limit-s", "60", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"bench serving: requests to {pool.base_url} for model '{MODEL}'" in proc.stdout
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["base_url"] == pool.base_url
    (rate,) = result["rates"]
    assert rate["completed"] == rate["requests_sent"] == 6, rate
    assert rate["output_tokens"] > 0 and rate["latency"]["ttft_ms"]["p50"] > 0


# ---- ports already in use, and the drain --------------------------------------------------------------


def test_up_on_the_port_of_a_running_broker_fails_in_one_line(pool: Pool) -> None:
    """Before, `up` found the other broker, printed its address as its own and let its worker join that pool."""
    proc = _cli("up", "--frontend", pool.frontend, "--backend", addr(free_port()), "--model", "tiny-llama",
                "--load-format", "dummy", "--device", "cpu", "--ready-timeout", "30")
    _one_line(proc, 1, f"{pool.frontend}: port", "already in use")
    assert proc.stdout == ""
    with Client(pool.frontend) as c:
        assert [w["name"] for w in c.stats()["workers"]] == ["worker-a"]  # nobody joined


def test_serve_and_broker_on_ports_in_use_fail_in_one_line(pool: Pool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        _one_line(_cli("serve", "--port", str(taken), "--frontend", addr(free_port()), "--backend",
                       addr(free_port()), "--model", "tiny-llama", "--load-format", "dummy"), 1,
                  f"http://127.0.0.1:{taken}: port {taken} is already in use")
        _one_line(_cli("gateway", "--port", str(taken), "--broker", pool.frontend), 1, "already in use")
        _one_line(_cli("broker", "--frontend", addr(taken), "--backend", addr(free_port())), 1,
                  f"port {taken} is already in use")


def test_broker_drain_says_what_it_waits_for_and_a_second_ctrl_c_stops_it(tmp_path: Path) -> None:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        broker = ps.broker(front, back, "--drain-timeout", "60")
        ps.spawn(["worker", "--broker", addr(back), *FAKE, "--heartbeat-interval", "0.2", "--name", "slow"], "slow",
                 env={"TOKENMILL_FAKE_STEP_S": "0.05"})
        with Client(addr(front)) as c:
            wait_workers(c, 1)
            job = c.submit("a long one", model="fake", max_tokens=3000)  # 150 s at 20 tok/s; < max_model_len 4096
            wait_until(lambda: c.stats()["active_jobs"] == 1, 10, 0.05, "the job running")
            broker.send_signal(signal.SIGINT)
            wait_until(lambda: "draining" in ps.logs[0].read_text(), 10, 0.05, "the drain message")
            time.sleep(1.0)
            assert broker.poll() is None  # still draining: the job is in flight
            line = next(x for x in ps.logs[0].read_text().splitlines() if "draining" in x)
            assert "waiting for 1 job(s) in flight (0 queued) on 1 worker(s), at most 60 s" in line, line
            assert "Ctrl-C again" in line
            t0 = time.monotonic()
            broker.send_signal(signal.SIGINT)
            assert broker.wait(10) == 0 and time.monotonic() - t0 < 5
            del job
