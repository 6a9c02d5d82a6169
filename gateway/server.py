"""Run a gateway: uvicorn on uvloop with the httptools parser (when installed), one process."""

from __future__ import annotations

import importlib.util
from typing import Any

import uvicorn

from tokenmill.gateway.app import create_app
from tokenmill.gateway.config import GatewayConfig


def uvicorn_config(cfg: GatewayConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for the gateway app (uvloop and httptools where they are installed)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    kwargs: dict[str, Any] = {"host": cfg.host, "port": cfg.port, "loop": loop, "http": http,
                              "access_log": cfg.log_requests, "log_level": "warning", "lifespan": "on",
                              "timeout_graceful_shutdown": 5}
    kwargs.update(overrides)
    return uvicorn.Config(create_app(cfg), **kwargs)


def serve(cfg: GatewayConfig, **overrides: Any) -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's handlers)."""
    uvicorn.Server(uvicorn_config(cfg, **overrides)).run()
