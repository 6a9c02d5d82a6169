"""What the gateway knows about the pool behind its broker: a STATS poll every `stats_interval` seconds,
the models the workers serve, and whether the pool is healthy.

Health (GET /health): the broker answered the last poll, and some worker is healthy. A worker is healthy
while the broker heard from it within `heartbeat_stale` s and either it is idle with nothing queued for
its models, or its engine's step counter (from its heartbeat) advanced within `progress_stall` s. A
stopped worker process stops beating (stale within a few seconds); a hung engine loop keeps beating from
its IO thread but stops stepping."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from tokenmill.gateway.config import GatewayConfig
from tokenmill.gateway.errors import APIError
from tokenmill.protocol.errors import TokenmillError

log = structlog.get_logger("tokenmill.gateway")


@dataclass(frozen=True)
class Health:
    """The answer of /health: `ok` and why (`reason`), with per-worker detail."""

    ok: bool
    reason: str
    workers: list[dict[str, Any]] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"status": "ok" if self.ok else "unavailable", "reason": self.reason, "workers": self.workers}


def worker_health(w: dict[str, Any], queues: dict[str, int], progress_age: float,
                  cfg: GatewayConfig) -> tuple[bool, str]:
    """Whether one worker (a STATS `workers` entry) is healthy, and why; `progress_age`: seconds since its
    step counter last changed (as the gateway saw it)."""
    if float(w.get("last_seen_ago", 0.0)) > cfg.heartbeat_stale:
        return False, f"silent for {w.get('last_seen_ago')}s"
    busy = bool(w.get("inflight") or w.get("running") or w.get("waiting"))
    queued = any(queues.get(m) for m in w.get("models", ()))
    if not (busy or queued):
        return True, "idle"
    if progress_age <= cfg.progress_stall:
        return True, "progressing"
    return False, f"no engine step for {progress_age:.1f}s with work to do"


def evaluate_health(stats: dict[str, Any] | None, stats_age: float, progress_ages: dict[str, float],
                    cfg: GatewayConfig) -> Health:
    """Pool health from the last STATS reply (`stats_age` seconds old; None: never answered)."""
    if stats is None or stats_age > max(3 * cfg.stats_interval, cfg.heartbeat_stale):
        return Health(False, "broker not answering")
    workers = stats.get("workers") or []
    if not workers:
        return Health(False, "no worker registered")
    queues = stats.get("queues") or {}
    detail = []
    for w in workers:
        ok, why = worker_health(w, queues, progress_ages.get(str(w.get("name")), 0.0), cfg)
        detail.append({"name": w.get("name"), "healthy": ok, "reason": why})
    healthy = sum(d["healthy"] for d in detail)
    return Health(healthy > 0, f"{healthy} of {len(detail)} workers healthy", detail)


class PoolView:
    """The latest STATS reply of the broker, polled in the background through `client` (an AsyncClient)."""

    def __init__(self, client: Any, cfg: GatewayConfig) -> None:
        self.client = client
        self.cfg = cfg
        self.stats: dict[str, Any] | None = None
        self.stats_at = 0.0  # monotonic time of the last reply
        self.seen_models: set[str] = set(cfg.models)  # every model a worker ever served, and the declared ones
        self._progress: dict[str, tuple[int, float]] = {}  # worker name -> (step counter, when it last changed)
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever(), name="tokenmill-gateway-stats")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_first(self, timeout: float) -> bool:
        """Wait until the broker answered once (False on timeout)."""
        try:
            await asyncio.wait_for(self._first.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.cfg.stats_interval)

    async def poll_once(self) -> None:
        try:
            stats = await self.client.stats(timeout=max(1.0, 2 * self.cfg.stats_interval))
        except TokenmillError as e:
            log.debug("stats_failed", error=str(e))
            return
        self.update(stats, time.monotonic())
        self._first.set()

    def update(self, stats: dict[str, Any], now: float) -> None:
        self.stats, self.stats_at = stats, now
        progress = {}
        for w in stats.get("workers") or []:
            name, steps = str(w.get("name")), int(w.get("steps", 0))
            self.seen_models.update(w.get("models", ()))
            old = self._progress.get(name)
            progress[name] = old if old is not None and old[0] == steps else (steps, now)
        self._progress = progress

    # ---- queries ---------------------------------------------------------------------------------

    def workers(self) -> list[dict[str, Any]]:
        return list((self.stats or {}).get("workers") or [])

    def served_models(self) -> list[str]:
        """Models some registered worker serves now, in first-seen order of the workers."""
        out: dict[str, None] = {}
        for w in self.workers():
            out.update(dict.fromkeys(w.get("models", ())))
        return list(out)

    def health(self, now: float | None = None) -> Health:
        now = time.monotonic() if now is None else now
        ages = {name: now - changed for name, (_, changed) in self._progress.items()}
        return evaluate_health(self.stats, now - self.stats_at if self.stats else float("inf"), ages, self.cfg)

    async def require_model(self, model: str) -> dict[str, Any]:
        """check_model, but a model no worker serves in the view is looked up once more in a fresh STATS
        reply before the error: the view is up to `stats_interval` old, and a worker that registered since
        (or a gateway process that started a moment ago) must not answer 404 for a model being served."""
        try:
            return self.check_model(model)
        except APIError as e:
            if e.code not in ("model_not_found", "no_worker", "unavailable"):
                raise
        await self.poll_once()
        return self.check_model(model)

    def check_model(self, model: str) -> dict[str, Any]:
        """The STATS entry of a worker serving `model` with the smallest context; 404 for a model no worker
        ever served (and not declared), 503 while none serves it (or the broker does not answer)."""
        if self.stats is None or time.monotonic() - self.stats_at > max(3 * self.cfg.stats_interval, 5.0):
            raise APIError(503, "the broker is not answering", code="unavailable", headers={"Retry-After": "1"})
        serving = [w for w in self.workers() if model in w.get("models", ())]
        if serving:
            return min(serving, key=lambda w: int(w.get("max_model_len", 0)))
        if model in self.seen_models:
            raise APIError(503, f"no worker serves model {model!r} right now", code="no_worker",
                           headers={"Retry-After": "2"})
        raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
