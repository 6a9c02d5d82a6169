"""`tokenmill gateway --gateway-workers 2`: two gateway processes on one port (SO_REUSEPORT) in front of a
fake-engine worker; streamed and whole answers through both; /metrics on any of them counts every request
(prometheus-client's multiprocess mode); SIGTERM stops them all."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

try:
    import fastapi  # noqa: F401
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    pytest.skip("needs the gateway extra (pip install 'tokenmill[gateway]')", allow_module_level=True)
from helpers_net import FAKE, addr, free_port, http_request, procs_ctx, wait_gateway, wait_until

from tokenmill.gateway.server import _listeners


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _finished_requests(text: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "tokenmill:request_success_total")


def test_two_gateway_processes_share_a_port_and_their_metrics(tmp_path: Path) -> None:
    port, front, back = free_port(), free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back)
        ps.worker(back, model=FAKE)
        gw = ps.spawn(["gateway", "--broker", addr(front), "--port", str(port), "--gateway-workers", "2"], "gateway")

        wait_gateway(ps, gw, port)
        assert _listeners(port) == 2  # the two children's sockets; the parent's placeholder is closed
        n = 8
        for i in range(n):  # a new connection each: the kernel spreads them over both processes
            status, raw = http_request(port, "POST", "/v1/completions",
                                       {"model": "fake", "prompt": f"p{i}", "max_tokens": 4, "stream": i % 2 == 1})
            assert status == 200, raw
            if i % 2:
                assert raw.rstrip().endswith(b"data: [DONE]")
            else:
                assert json.loads(raw)["usage"]["completion_tokens"] == 4
        scrapes = [_finished_requests(http_request(port, "GET", "/metrics")[1].decode()) for _ in range(6)]
        assert scrapes == [n] * 6, scrapes
        assert len(_children(gw.pid)) == 2
        gw.send_signal(signal.SIGTERM)
        assert gw.wait(30) == 0
        wait_until(lambda: _listeners(port) == 0, 10, 0.1, "the children to exit")
