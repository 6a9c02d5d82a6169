"""tokenmill HTTP gateway (torch-free): an OpenAI-compatible API in front of a tokenmill broker.

    tokenmill gateway --broker tcp://127.0.0.1:5555 --port 8000

FastAPI routes (`app.py`) turn OpenAI requests into broker jobs through the asyncio client SDK
(`AsyncClient`), one job per choice; tokens stream back as server-sent events. `/metrics` exposes
Prometheus metrics under vLLM's names with the `tokenmill:` prefix; `/health` reports whether a worker is
making progress. The gateway holds no model and no tokenizer: the worker renders chat templates and
counts tokens (usage comes with each job's DONE).
"""

from typing import Any

from tokenmill.gateway.config import GatewayConfig, load_api_keys

__all__ = ["GatewayConfig", "create_app", "load_api_keys"]


def __getattr__(name: str) -> Any:
    # create_app needs FastAPI (the gateway extra); the config alone does not, so the settings table and
    # the CLI load on a worker-only install.
    if name == "create_app":
        from tokenmill.gateway.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
