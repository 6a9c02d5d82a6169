"""Run a gateway: uvicorn on uvloop with the httptools parser (when installed).

One process by default. With `workers` > 1 (`--gateway-workers N`), N gateway processes share the port
through SO_REUSEPORT (the kernel spreads new connections over them), each with its own event loop and its
own broker connection, as several gateways on one broker are; the parent only starts them, forwards
SIGINT / SIGTERM and stops them all when one exits. Their Prometheus counters and histograms are summed
through prometheus-client's multiprocess mode (a shared folder of value files), so /metrics on any of them
reports the whole gateway. The children read their settings from a JSON file (mode 0600: it may hold API
keys), never from the command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvicorn

from tokenmill.gateway.config import GatewayConfig
from tokenmill.protocol.logs import configure_from_env

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's multiprocess mode reads it at import


def uvicorn_settings(cfg: GatewayConfig) -> dict[str, Any]:
    """uvicorn.Config's keyword arguments for the gateway (uvloop and httptools where they are installed)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return {"host": cfg.host, "port": cfg.port, "loop": loop, "http": http, "access_log": cfg.log_requests,
            "log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": cfg.drain_timeout,
            "log_config": None}


def uvicorn_config(cfg: GatewayConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's Config for the gateway app (`uvicorn_settings` and `overrides`). Building one sets the levels
    of uvicorn's loggers in this process."""
    from tokenmill.gateway.app import create_app

    return uvicorn.Config(create_app(cfg), **(uvicorn_settings(cfg) | overrides))


class DrainingServer(uvicorn.Server):
    """uvicorn's server, saying on stderr what its graceful shutdown waits for: the first SIGINT / SIGTERM stops
    new connections and lets the requests in flight (open streams) finish for up to the config's
    timeout_graceful_shutdown seconds (the gateway's drain_timeout); a second one cuts them at once."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        running = len(self.server_state.tasks)
        if running and not self.force_exit:
            print(f"tokenmill gateway: draining: waiting for {running} request(s) in flight, at most "
                  f"{self.config.timeout_graceful_shutdown:g} s; new connections are refused (Ctrl-C again to "
                  "stop at once)", file=sys.stderr, flush=True)
        await super().shutdown(sockets)


def serve(cfg: GatewayConfig, **overrides: Any) -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's handlers; with several workers, the parent's); then drain
    (`DrainingServer`)."""
    if cfg.workers == 1:
        DrainingServer(uvicorn_config(cfg, **overrides)).run()
        return
    Workers(cfg).run()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) with SO_REUSEPORT: other processes may bind the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Workers:
    """`cfg.workers` gateway processes on one port (SO_REUSEPORT). `run()` returns when they have stopped."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stop = False
        self._previous: dict[int, Any] = {}  # the handlers replaced while serving (called on as well)

    def run(self) -> None:
        with tempfile.TemporaryDirectory(prefix="tokenmill-gateway-") as tmp:
            # Each child binds its own SO_REUSEPORT socket; this one holds the port (a free one for port 0)
            # until they do, and is closed before any request could reach it (it never accepts).
            hold = reuse_port_socket(self.cfg.host, self.cfg.port)
            cfg = dataclasses.replace(self.cfg, port=int(hold.getsockname()[1]))
            config_file = Path(tmp) / "config.json"
            config_file.touch(mode=0o600)
            config_file.write_text(json.dumps(dataclasses.asdict(cfg)))
            metrics_dir = Path(tmp) / "metrics"
            metrics_dir.mkdir()
            env = {**os.environ, MULTIPROC_ENV: str(metrics_dir)}
            self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                for _ in range(cfg.workers):
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "tokenmill.gateway.server", "--config-file", str(config_file)], env=env))
                self._wait_bound(cfg.port, hold)
                self._supervise()
            finally:
                for s, handler in self._previous.items():
                    signal.signal(s, handler)
                self._stop_all()

    def _wait_bound(self, port: int, hold: socket.socket, timeout: float = 60.0) -> None:
        """Close `hold` once every child listens on `port` (or one has exited, or `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop and all(p.poll() is None for p in self.procs):
            if _listeners(port) > len(self.procs):  # the children's sockets and `hold`
                break
            time.sleep(0.05)
        hold.close()

    def _supervise(self) -> None:
        while not self._stop and all(p.poll() is None for p in self.procs):
            time.sleep(0.2)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)
        previous = self._previous.get(signum)
        if callable(previous) and previous not in (signal.default_int_handler,):
            previous(signum, frame)  # e.g. `serve`'s Stopper, which then drains the pool

    def _stop_all(self) -> None:
        """After a forwarded signal the children drain on their own (up to drain_timeout): wait that long, then
        SIGTERM them (a second signal: uvicorn stops at once), then SIGKILL. When a child exited by itself,
        the others are stopped at once."""
        _wait_all(self.procs, self.cfg.drain_timeout + 5.0 if self._stop else 0.0)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        _wait_all(self.procs, 10.0)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))


def _listeners(port: int) -> int:
    """Listening TCP sockets on `port` on this host (from /proc/net/tcp{,6}; 0 where unreadable)."""
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        n += sum(1 for line in lines if (f := line.split()) and f[1].endswith(f":{port:04X}") and f[3] == "0A")
    return n


def config_from_file(path: str | Path) -> GatewayConfig:
    """The GatewayConfig a parent wrote for its worker processes."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return GatewayConfig(**data)


def worker_main(argv: list[str] | None = None) -> int:
    """One worker process of a multi-process gateway: serve on the shared port until signalled."""
    ap = argparse.ArgumentParser(description="one process of a multi-process tokenmill gateway")
    ap.add_argument("--config-file", required=True)
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(config_from_file(args.config_file), workers=1)
    configure_from_env()
    sock = reuse_port_socket(cfg.host, cfg.port)
    DrainingServer(uvicorn_config(cfg)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
