"""`tokenmill gateway` alone in front of a broker, with a fake engine (processes on 127.0.0.1): 404 vs 503
before any worker, /health 503 while the only worker's engine hangs in a step (its IO thread still beats)
and 200 again once it steps."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers_net import FAKE, Procs, addr, free_port, procs_ctx, wait_until

from tokenmill.client import Client


def _request(port: int, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


@pytest.fixture
def gateway(tmp_path: Any) -> Iterator[tuple[Procs, int, int, int]]:
    http_port, front, back = free_port(), free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back)
        ps.spawn(["gateway", "--broker", addr(front), "--port", str(http_port), "--model", "fake",
                  "--progress-stall", "1.0"], "gateway")

        def up() -> bool:
            try:
                return _request(http_port, "GET", "/version")[0] == 200
            except OSError:
                return False

        wait_until(up, 30, 0.1, "gateway up")
        yield ps, http_port, front, back


def test_404_and_503_before_a_worker_then_503_while_the_engine_hangs(gateway: tuple[Procs, int, int, int]) -> None:
    ps, port, front, back = gateway
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, body = _request(port, "GET", "/health")
    assert status == 503 and body["status"] == "unavailable"
    status, body = _request(port, "POST", "/v1/chat/completions", {"model": "fake", **chat})
    assert status == 503 and body["error"]["code"] == "no_worker"  # declared (--model), not served yet
    status, body = _request(port, "POST", "/v1/chat/completions", {"model": "other", **chat})
    assert status == 404 and body["error"]["type"] == "not_found_error"

    ps.spawn(["worker", "--broker", addr(back), *FAKE, "--heartbeat-interval", "0.2", "--name", "slow"], "worker",
             env={"TOKENMILL_FAKE_STEP_S": "4"})  # every engine step takes 4 s
    wait_until(lambda: _request(port, "GET", "/health")[0] == 200, 60, 0.1, "healthy idle worker")
    with Client(addr(front)) as c:
        h = c.submit("hang", model="fake", max_tokens=1)
        t0 = time.monotonic()
        wait_until(lambda: _request(port, "GET", "/health")[0] == 503, 3.0, 0.1, "503 while the step hangs")
        status, body = _request(port, "GET", "/health")
        assert "no engine step" in body["workers"][0]["reason"]
        assert h.result(timeout=30).finish_reason == "length"
        assert time.monotonic() - t0 > 3.0  # the step did take its 4 s
    wait_until(lambda: _request(port, "GET", "/health")[0] == 200, 5, 0.1, "200 after the step")
