"""Logging (tokenmill.protocol.logs): structlog and stdlib loggers render through one formatter, JSON off a
terminal and console text on one, ids bound in the context appear on every line, secret-looking values are
redacted; a gateway started with an API key and CURVE keys never writes them to its logs; one request's
id can be grepped in the gateway's, the broker's and the worker's logs."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from helpers_net import FAKE, addr, free_port, http_request, procs_ctx, wait_gateway, wait_until

from tokenmill.protocol import logs
from tokenmill.protocol.keys import load_keypair


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = {k: v for k, v in os.environ.items() if k.startswith("TOKENMILL_LOG")}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()
    for k in [k for k in os.environ if k.startswith("TOKENMILL_LOG")]:
        del os.environ[k]
    os.environ.update(saved)


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_structlog_and_stdlib_lines_are_json_off_a_terminal(restore_logging: None) -> None:
    out = io.StringIO()
    assert logs.configure("info", "auto", out) == "json"
    structlog.get_logger("tokenmill.broker").info("job_accepted", job_id="j-1", model="m")
    logging.getLogger("tokenmill.engine").warning("preempted %d requests", 3)
    logging.getLogger("tokenmill.engine").debug("below the level")
    structlog.get_logger("tokenmill.broker").debug("below the level too")
    a, b = _lines(out)
    assert a["event"] == "job_accepted" and a["job_id"] == "j-1" and a["level"] == "info"
    assert a["logger"] == "tokenmill.broker" and a["timestamp"].endswith("Z")
    assert b["event"] == "preempted 3 requests" and b["level"] == "warning" and b["logger"] == "tokenmill.engine"


def test_console_text_on_a_terminal_and_json_onhttp_request(restore_logging: None) -> None:
    tty = _Tty()
    assert logs.configure("debug", "auto", tty) == "console"
    structlog.get_logger("tokenmill.worker").debug("job_admitted", job_id="j-2")
    line = tty.getvalue().strip()
    assert "job_admitted" in line and "job_id=j-2" in line and not line.startswith("{")
    forced = _Tty()
    assert logs.configure("info", "json", forced) == "json"
    structlog.get_logger("x").info("e")
    assert _lines(forced)[0]["event"] == "e"
    with pytest.raises(ValueError, match="log format"):
        logs.configure("info", "xml", io.StringIO())
    with pytest.raises(ValueError, match="log level"):
        logs.configure("loud", "json", io.StringIO())


def test_env_settings_reach_child_processes_and_log_json_means_json(restore_logging: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    logs.configure("warning", "json", out)
    assert os.environ[logs.LEVEL_ENV] == "warning" and os.environ[logs.FORMAT_ENV] == "json"
    monkeypatch.setenv(logs.FORMAT_ENV, "console")
    monkeypatch.setenv(logs.JSON_ENV, "1")
    monkeypatch.setenv(logs.LEVEL_ENV, "error")
    assert logs.configure_from_env() == "json"
    assert logging.getLogger().level == logging.ERROR


def test_bound_ids_on_every_line_inside_the_block_only(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("info", "json", out)
    log = structlog.get_logger("tokenmill.gateway")
    with logs.job_context(request_id="cmpl-1", job_id="cmpl-1-0"):
        log.info("inside")
        logging.getLogger("uvicorn.error").info("stdlib inside")
    log.info("after")
    inside, stdlib_inside, after = _lines(out)
    assert inside["request_id"] == stdlib_inside["request_id"] == "cmpl-1" and inside["job_id"] == "cmpl-1-0"
    assert "request_id" not in after


def test_secret_values_are_redacted(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("info", "json", out)
    structlog.get_logger("x").info("e", api_key="sk-1", Authorization="Bearer sk-2", curve_secret_key="S",
                                   password="p", max_tokens=5, completion_tokens=7)
    line = _lines(out)[0]
    assert {line[k] for k in ("api_key", "Authorization", "curve_secret_key", "password")} == {logs.REDACTED}
    assert (line["max_tokens"], line["completion_tokens"]) == (5, 7)
    assert "sk-1" not in out.getvalue() and "sk-2" not in out.getvalue()


# ---- processes ------------------------------------------------------------------------------------------


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_a_gateway_never_logs_its_api_key_or_curve_secret(tmp_path: Path) -> None:
    """Debug level, access log on, requests with the right key, a wrong one and none; the gateway's CURVE
    secret key file given (no broker answers: it logs its failures). Its whole output holds neither key."""
    from tokenmill.cli.main import main as cli

    keys = tmp_path / "keys"
    assert cli(["keys", "generate", str(keys), "--name", "broker", "--name", "gateway"]) == 0
    secret = load_keypair(keys / "gateway.key_secret")[1].decode()
    api_key, port = "sk-tokenmill-secret-4f9a", free_port()
    with procs_ctx(tmp_path) as ps:
        gw = ps.spawn(["gateway", "--broker", addr(free_port()), "--port", str(port), "--api-key", api_key,
                       "--curve-server-key", str(keys / "broker.key"), "--curve-secret",
                       str(keys / "gateway.key_secret"), "--log-level", "debug", "--log-format", "json",
                       "--access-log", "--model", "m"], "gateway")

        wait_gateway(ps, gw, port, 60, (200, 503))
        assert http_request(port, "GET", "/v1/models", key=api_key)[0] == 200
        assert http_request(port, "GET", "/v1/models", key="wrong")[0] == 401
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        assert http_request(port, "POST", "/v1/completions", body, key=api_key)[0] == 503
        assert http_request(port, "POST", "/v1/completions", body)[0] == 401
        gw.send_signal(signal.SIGTERM)
        gw.wait(30)
        text = ps.logs[0].read_text()
    events = {line["event"] for line in _json_lines(ps.logs[0])}
    assert {"gateway_listening", "request_failed"} <= events, text[-2000:]  # it did log, as JSON
    assert api_key not in text and secret not in text


@pytest.fixture
def debug_pool(tmp_path: Path) -> Iterator[tuple[int, list[Path]]]:
    """broker, a fake-engine worker and a gateway, each logging JSON at debug level to its own file."""
    port, front, back = free_port(), free_port(), free_port()
    flags = ["--log-level", "debug", "--log-format", "json"]
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back, *flags)
        ps.worker(back, *flags, model=FAKE)
        gw = ps.spawn(["gateway", "--broker", addr(front), "--port", str(port), *flags], "gateway")

        wait_gateway(ps, gw, port)
        yield port, ps.logs
        for pr in ps.procs:
            pr.send_signal(signal.SIGTERM)
        for pr in ps.procs:
            pr.wait(30)


def test_one_request_can_be_grepped_across_processes(debug_pool: tuple[int, list[Path]]) -> None:
    port, (broker_log, worker_log, gateway_log) = debug_pool
    status, raw = http_request(port, "POST", "/v1/completions", {"model": "fake", "prompt": "hello", "max_tokens": 3})
    assert status == 200, raw
    rid = json.loads(raw)["id"]
    job = f"{rid}-0"

    def events(path: Path, **match: str) -> set[str]:
        return {line["event"] for line in _json_lines(path) if all(line.get(k) == v for k, v in match.items())}

    def logged() -> bool:
        return ({"job_accepted", "job_dispatched", "job_finished"} <= events(broker_log, job_id=job)
                and {"job_admitted", "job_finished"} <= events(worker_log, job_id=job))

    wait_until(logged, 10, 0.1, f"the broker's and worker's lines about {job}")
    assert {"request_received", "job_finished"} <= events(gateway_log, request_id=rid)
    assert "job_finished" in events(gateway_log, job_id=job)
