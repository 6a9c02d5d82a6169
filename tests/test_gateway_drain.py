"""A stopping gateway lets its open streams finish (issue 14: "the drain says what it waits for"; a second Ctrl-C
forces the stop). uvicorn's own graceful shutdown waited 5 s and then cut every stream; the gateway's waits
for its drain_timeout (`--drain-timeout`, the same setting as the broker's) and says so on stderr."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers_net import free_port, wait_until

from tokenmill.gateway.config import GatewayConfig
from tokenmill.gateway.server import uvicorn_settings

# A stand-in for a long completion stream: 8 chunks 0.75 s apart (6 s, past uvicorn's old 5 s cut-off).
SLOW_APP = textwrap.dedent('''
    import asyncio, signal, sys
    import uvicorn
    from tokenmill.gateway.server import DrainingServer

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(8):
            await send({"type": "http.response.body", "body": f"{i}\\n".encode(), "more_body": True})
            await asyncio.sleep(0.75)
        await send({"type": "http.response.body", "body": b"end\\n"})

    signal.signal(signal.SIGINT, lambda *_: None)  # uvicorn hands the signal on when it returns (as to serve's)
    DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                                  timeout_graceful_shutdown=float(sys.argv[2]), lifespan="on")).run()
''')


def _start(tmp_path: Path, drain_s: float) -> tuple[subprocess.Popen[str], http.client.HTTPResponse]:
    """The slow app behind DrainingServer, and a stream from it whose first chunk has arrived."""
    script = tmp_path / "slow_app.py"
    script.write_text(SLOW_APP)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(drain_s)], stderr=subprocess.PIPE,
                            text=True)

    def listening() -> bool:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
            return True
        except OSError:
            return False

    wait_until(listening, 60, 0.05, "the slow app listening")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline() == b"0\n"
    return proc, resp


def test_a_stopping_gateway_lets_its_streams_finish_and_says_so(tmp_path: Path) -> None:
    proc, resp = _start(tmp_path, drain_s=20)
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest = resp.read()  # the stream goes on to its end
        assert rest.endswith(b"7\nend\n"), rest
        assert proc.wait(15) == 0
        assert time.monotonic() - t0 > 4.5  # the stream really outlived the signal
        err = proc.communicate()[1]
        assert "draining: waiting for 1 request(s) in flight, at most 20 s" in err, err
    finally:
        proc.kill()


def test_a_second_ctrl_c_cuts_the_streams_at_once(tmp_path: Path) -> None:
    proc, resp = _start(tmp_path, drain_s=20)
    try:
        proc.send_signal(signal.SIGINT)
        assert resp.readline() == b"1\n"  # still streaming while it drains
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(5)
        assert time.monotonic() - t0 < 3
        try:
            rest = resp.read()
        except http.client.IncompleteRead as e:  # cut mid-stream: the chunked body never ends
            rest = e.partial
        assert not rest.endswith(b"end\n"), rest
    finally:
        proc.kill()


def test_the_drain_timeout_reaches_uvicorn() -> None:
    # (the settings, not a uvicorn.Config: building one would set uvicorn's logger levels for later tests)
    assert uvicorn_settings(GatewayConfig(drain_timeout=12.5))["timeout_graceful_shutdown"] == 12.5
    assert uvicorn_settings(GatewayConfig())["timeout_graceful_shutdown"] == 30.0
