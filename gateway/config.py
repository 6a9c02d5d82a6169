"""The gateway's settings (one frozen dataclass, validated at construction) and API-key files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_BROKER = "tcp://127.0.0.1:5555"


@dataclass(frozen=True)
class GatewayConfig:
    """Everything a gateway is built from (the `tokenmill gateway` flags map onto these).

    `models`: model names the gateway answers for even while no worker serves them (a request for one
    gets 503 then; a name neither declared nor ever served by a worker gets 404). `api_keys`: bearer
    tokens accepted on /v1 (none: no authentication); each key's jobs belong to their own broker owner.
    Health: a worker is healthy while the broker heard from it within `heartbeat_stale` s and, when it
    has work, its engine stepped within `progress_stall` s."""

    broker: str = DEFAULT_BROKER
    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    stats_interval: float = 0.5  # seconds between STATS polls of the broker
    heartbeat_stale: float = 2.5
    progress_stall: float = 10.0
    request_timeout: float | None = None  # job deadline in seconds (None: the broker's default)
    max_n: int = 128  # choices per request
    max_body_bytes: int = 8 << 20  # request bodies past this get 413 (the wire's limit is 16 MiB)
    curve_server_key: str | None = None  # the broker's public key (file or z85) when it runs CURVE
    curve_secret_key: str | None = None  # this gateway's NAME.key_secret
    log_requests: bool = False  # one log line per request (uvicorn's access log)
    workers: int = 1  # gateway processes sharing the port (SO_REUSEPORT; gateway/server.py)
    drain_timeout: float = 30.0  # seconds a stopping gateway lets its requests in flight finish before it cuts them

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("stats_interval", "heartbeat_stale", "progress_stall"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("API keys must be non-empty and carry no surrounding whitespace")
        if (self.curve_server_key is None) != (self.curve_secret_key is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key")


def load_api_keys(path: str | Path) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and lines starting with '#' are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    keys = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"{path}: no API keys in the file")
    return keys
