"""The FastAPI application: OpenAI-compatible routes over the broker, plus /health, /metrics, /version.

Each request becomes one broker job per choice (runner.RequestRun); streamed answers are server-sent
events. A client that disconnects cancels its jobs, streamed or not, through a watcher of the ASGI receive
channel (`http.disconnect`). Errors come in OpenAI's JSON error shape (errors.APIError)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

import structlog
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.client import StreamEvent, Usage
from tokenmill.gateway.config import GatewayConfig
from tokenmill.gateway.errors import APIError
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.pool import PoolView
from tokenmill.gateway.responses import (
    DONE_LINE,
    ChoiceResult,
    ChunkWriter,
    chat_json,
    chat_logprobs,
    completion_json,
    completion_logprobs,
    event_logprobs,
    usage_json,
)
from tokenmill.gateway.runner import ChoiceSpec, RequestRun, unless_disconnected, until_disconnect
from tokenmill.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tokenmill.gateway.tenants import Tenants
from tokenmill.protocol.logs import bind_job
from tokenmill.protocol.wire import SAMPLING_DEFAULT_FIELDS

log = structlog.get_logger("tokenmill.gateway")


def _version() -> str:
    try:
        return metadata.version("tokenmill")
    except metadata.PackageNotFoundError:
        return "unknown"


class Gateway:
    """The state behind the routes: tenants (clients per API key), the pool view, the metrics."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.tenants = Tenants(cfg)
        self.pool = PoolView(self.tenants.client(self.tenants.default_owner), cfg)
        self.metrics = GatewayMetrics(self.pool)

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.stop()
        await self.tenants.close()

    def error(self, model: str, err: APIError) -> JSONResponse:
        self.metrics.request_errors.labels(model, str(err.status)).inc()
        # the request id, where there is one, is in the log context (bound by _open_run)
        log.info("request_failed", model=model, status=err.status, code=err.code, error=err.message[:200])
        return err.response()

    def max_tokens(self, requested: int | None, worker: dict[str, Any]) -> int:
        """max_tokens, defaulting to the model's generation config (max_new_tokens), else to as many as the
        serving worker's context leaves past a one-token prompt (the worker stops at its context; the broker
        refuses max_tokens >= max_model_len as never reachable)."""
        if requested is not None:
            return requested
        room = max(1, int(worker.get("max_model_len", 2048)) - 1)
        return min(int((worker.get("sampling_defaults") or {}).get("max_tokens", room)), room)

    @staticmethod
    def with_model_defaults(params: dict[str, Any], given: set[str], worker: dict[str, Any]) -> dict[str, Any]:
        """The model's own sampling defaults (its generation config, announced by the worker) for the fields
        the request did not give, as vLLM applies them; OpenAI's defaults for the rest."""
        for name, value in (worker.get("sampling_defaults") or {}).items():
            if name in SAMPLING_DEFAULT_FIELDS and name != "max_tokens" and name not in given:
                params[name] = value
        return params


def create_app(cfg: GatewayConfig | None = None) -> FastAPI:
    """The gateway's ASGI app for `cfg` (run it with uvicorn, or `tokenmill gateway`)."""
    gw = Gateway(cfg or GatewayConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="tokenmill gateway", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible HTTP API in front of a tokenmill broker.")
    app.state.gateway = gw
    _install_error_handlers(app, gw)
    _add_openai_routes(app, gw)
    _add_ops_routes(app, gw)
    return app


def _install_error_handlers(app: FastAPI, gw: Gateway) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return gw.error("", exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid"))
        return gw.error("", APIError(400, msg, param=where or None, code="invalid"))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("gateway_internal_error", error=type(exc).__name__)
        return gw.error("", APIError(500, f"internal error: {type(exc).__name__}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    app.add_middleware(BodyLimit, max_bytes=gw.cfg.max_body_bytes)


class BodyLimit:
    """413 for a request whose Content-Length exceeds `max_bytes`. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would relay every streamed chunk through a memory stream and an extra task."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for name, value in scope.get("headers", ()):
                if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                    await APIError(413, f"request body over {self.max_bytes} bytes").response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _add_ops_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some worker is healthy (heard from recently, and idle or making engine progress);
        503 otherwise (no broker, no worker, a stopped or hung worker). The body says why."""
        h = gw.pool.health()
        return JSONResponse(h.body(), status_code=200 if h.ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format): `tokenmill:` + vLLM's metric names."""
        return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The tokenmill version serving this gateway."""
        return {"version": _version()}

    @app.get("/ping", include_in_schema=False)
    async def ping() -> PlainTextResponse:
        return PlainTextResponse("pong")


def _add_openai_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/v1/models")
    async def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        """The models the registered workers serve (OpenAI's list shape), with each one's context length."""
        gw.tenants.owner_for(authorization)
        created = int(time.time())
        lens: dict[str, int] = {}
        for w in gw.pool.workers():
            for m in w.get("models", ()):
                lens[m] = min(lens.get(m, 1 << 62), int(w.get("max_model_len", 0)))
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "tokenmill", "max_model_len": n}
            for m, n in lens.items()]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request,
                          authorization: str | None = Header(None)) -> Response:
        """Complete each prompt (text, token ids, or a list of either); `n` choices per prompt, choice
        index = prompt index * n + i. Streams server-sent events with `stream: true`. Sampling
        parameters as vLLM accepts them; `usage` counts each prompt once."""
        try:
            return await _completions(gw, body, request, authorization)
        except APIError as e:
            return gw.error(body.model, e)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               authorization: str | None = Header(None)) -> Response:
        """Answer a conversation: the worker renders `messages` (system / user / assistant / tool roles;
        string or text-part content) with the model's chat template (`chat_template_kwargs` are passed to
        it). `n` choices; `logprobs` / `top_logprobs`; streams with `stream: true`."""
        try:
            return await _chat(gw, body, request, authorization)
        except APIError as e:
            return gw.error(body.model, e)


def _seeded(params: dict[str, Any], seed: int | None, i: int) -> dict[str, Any]:
    return {**params, "seed": (seed + i) % (1 << 63)} if seed is not None else params


async def _completions(gw: Gateway, body: CompletionRequest, request: Request, authorization: str | None) -> Response:
    owner = gw.tenants.owner_for(authorization)
    body.check(gw.cfg.max_n)
    worker = await gw.pool.require_model(body.model)
    params = gw.with_model_defaults(body.sampling_params(gw.max_tokens(body.max_tokens, worker), body.logprobs),
                                    body.model_fields_set, worker)
    prompts = body.prompts()
    specs = []
    for p_idx, prompt in enumerate(prompts):
        for i in range(body.n):
            index = p_idx * body.n + i
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            specs.append(ChoiceSpec(index, _seeded(params, body.seed, i), prompt=text, prompt_token_ids=ids))
    echo = {s.index: s.prompt or "" for s in specs} if body.echo else {}
    run = await _open_run(gw, owner, body.model, f"cmpl-{uuid.uuid4().hex}", specs, body.stream)
    rid = run.request_id
    created = int(time.time())
    if body.stream:
        writer = ChunkWriter(False, rid, created, body.model, body.include_usage)
        return _completion_stream(run, writer, body, echo)
    results = await unless_disconnected(request.receive, _collect(run, body.logprobs))
    return JSONResponse(completion_json(rid, created, body.model, list(results.values()),
                                        _usage(results, body.n), body.logprobs is not None, echo))


async def _chat(gw: Gateway, body: ChatCompletionRequest, request: Request, authorization: str | None) -> Response:
    owner = gw.tenants.owner_for(authorization)
    body.check(gw.cfg.max_n)
    worker = await gw.pool.require_model(body.model)
    params = gw.with_model_defaults(
        body.sampling_params(gw.max_tokens(body.requested_max_tokens(), worker), body.logprobs_k()),
        body.model_fields_set, worker)
    if body.chat_template_kwargs:
        params["extra"] = {"chat_template_kwargs": body.chat_template_kwargs}
    messages = body.wire_messages()
    specs = [ChoiceSpec(i, _seeded(params, body.seed, i), messages=messages) for i in range(body.n)]
    run = await _open_run(gw, owner, body.model, f"chatcmpl-{uuid.uuid4().hex}", specs, body.stream)
    rid = run.request_id
    created = int(time.time())
    k = body.logprobs_k()
    if body.stream:
        writer = ChunkWriter(True, rid, created, body.model, body.include_usage)
        return _chat_stream(run, writer, body, k)
    results = await unless_disconnected(request.receive, _collect(run, k))
    return JSONResponse(chat_json(rid, created, body.model, list(results.values()), _usage(results, body.n),
                                  k is not None))


async def _open_run(gw: Gateway, owner: str, model: str, rid: str, specs: list[ChoiceSpec],
                    stream: bool) -> RequestRun:
    """Submit a request's jobs (job ids: the request id, '-', the choice index), its id bound into this
    request's log context (the task serving it; the stream's task inherits it)."""
    bind_job(request_id=rid)
    run = RequestRun(gw.tenants.client(owner), model, rid, specs, gw.metrics, gw.cfg.request_timeout)
    log.debug("request_received", model=model, choices=len(specs), stream=stream,
              job_ids=[run.job_id(s) for s in specs])
    await run.open()
    return run


async def _collect(run: RequestRun, k: int | None) -> dict[int, ChoiceResult]:
    results = {c.index: ChoiceResult(c.index) for c in run.choices}
    try:
        async for index, ev in run.events():
            results[index].add(ev, k)
    finally:
        run.cancel()  # nothing to do unless it was interrupted
    return results


def _usage(results: dict[int, ChoiceResult], n: int) -> dict[str, Any]:
    per_prompt: dict[int, list[Usage]] = {}
    for c in results.values():
        per_prompt.setdefault(c.index // n, []).append(c.usage or Usage(0, 0, 0))
    return usage_json(per_prompt)


_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class _JobStream(Response):
    """A streamed answer (server-sent events), written straight to the ASGI `send`: one write per batch of
    events (what had arrived when the previous write was done), each event its own `data:` chunk as OpenAI
    clients expect; the batch that finishes the last choice goes out with the tail (usage, `[DONE]`) and
    the end of the body. A client that disconnects stops the stream; however it ends, the request's
    unfinished jobs are cancelled at once (not at GC)."""

    def __init__(self, run: RequestRun, writer: ChunkWriter, n: int, head: list[str],
                 delta: Callable[[int, StreamEvent], str | None]) -> None:
        super().__init__(status_code=200)
        self.run, self.writer, self.n, self.head, self.delta = run, writer, n, head, delta

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # The stream runs in a task of its own: each token's wake-up then resumes its few frames, not the
        # whole ASGI stack of middlewares above this call (measured: benchmarks/results/cpu/NOTES.md).
        streamer = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait((streamer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not streamer.done():  # the client left (or this call was cancelled): stop writing
                streamer.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await streamer
            self.run.cancel()
        if not streamer.cancelled():
            with contextlib.suppress(OSError):  # the connection broke while writing: nobody to answer
                streamer.result()

    async def _stream(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        run, writer, delta = self.run, self.writer, self.delta
        usages: dict[int, Usage] = {}
        out = list(self.head)
        try:
            while batch := await run.next_batch():
                for index, ev in batch:
                    if ev.finish_reason is not None:
                        usages[index] = ev.usage or Usage(0, 0, 0)
                        out.append(writer.finish(index, ev.finish_reason, ev.stop_reason))
                    elif (line := delta(index, ev)) is not None:
                        out.append(line)
                if out and len(usages) < len(run.choices):
                    await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": True})
                    out = []
        except APIError as e:
            out.append(writer.error(e.body()))
        else:
            if writer.include_usage:
                per_prompt: dict[int, list[Usage]] = {}
                for index, u in usages.items():
                    per_prompt.setdefault(index // self.n, []).append(u)
                out.append(writer.usage(usage_json(per_prompt)))
        out.append(DONE_LINE)
        await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": False})


def _completion_stream(run: RequestRun, writer: ChunkWriter, body: CompletionRequest,
                       echo: dict[int, str]) -> _JobStream:
    k = body.logprobs
    offsets = {index: len(prefix) for index, prefix in echo.items()}  # text before each choice's next token

    def delta(index: int, ev: StreamEvent) -> str | None:
        if k is not None and ev.token_ids:
            lp = completion_logprobs(event_logprobs(ev, k), offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
            return writer.text(index, ev.text, lp)
        return writer.text(index, ev.text) if ev.text else None

    return _JobStream(run, writer, body.n, [writer.text(index, prefix) for index, prefix in echo.items()], delta)


def _chat_stream(run: RequestRun, writer: ChunkWriter, body: ChatCompletionRequest,
                 k: int | None) -> _JobStream:
    def delta(index: int, ev: StreamEvent) -> str | None:
        if k is not None and ev.token_ids:
            return writer.text(index, ev.text, chat_logprobs(event_logprobs(ev, k)))
        return writer.text(index, ev.text) if ev.text else None

    return _JobStream(run, writer, body.n, [writer.start(c.index) for c in run.choices], delta)
