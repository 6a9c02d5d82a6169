"""`tokenmill serve` (broker + workers + HTTP gateway in one command) and `tokenmill gateway` (an HTTP
gateway alone, in front of a running broker; several gateways may share one broker).

    tokenmill serve --workers 1                       # embedded model, http://127.0.0.1:8000/v1
    tokenmill gateway --broker tcp://10.0.0.5:5555 --port 8000 --api-key-file keys.txt
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

import structlog

from tokenmill.cli.serve import (
    DEFAULT_BACKEND,
    DEFAULT_FRONTEND,
    _add_log_args,
    _env,
    _env_float,
    _env_int,
    _spawn,
    _stop_all,
    _wait_ready,
    configure_logging,
)

log = structlog.get_logger("tokenmill.serve")


def register(sub: Any) -> None:
    s = sub.add_parser("serve", help="start a broker, N workers and the OpenAI-compatible HTTP gateway; Ctrl-C "
                                     "stops them all")
    s.add_argument("--model", default=_env("MODEL", "embedded"), help="model to serve (env TOKENMILL_MODEL)")
    s.add_argument("--workers", type=int, default=_env_int("WORKERS", 1))
    s.add_argument("--load-format", default=_env("LOAD_FORMAT", "auto"), choices=["auto", "hf", "gguf", "dummy"])
    s.add_argument("--device", default=_env("DEVICE", "auto"))
    s.add_argument("--max-num-seqs", type=int, default=_env_int("MAX_NUM_SEQS", 128),
                   help="sequences each worker runs at once")
    s.add_argument("--queue-size", type=int, default=_env_int("QUEUE_SIZE", 256),
                   help="jobs the broker queues per model before answering 429")
    s.add_argument("--frontend", default=_env("FRONTEND", DEFAULT_FRONTEND), help="the broker's client address")
    s.add_argument("--backend", default=_env("BACKEND", DEFAULT_BACKEND), help="the broker's worker address")
    s.add_argument("--heartbeat-interval", type=float, default=_env_float("HEARTBEAT_INTERVAL", 1.0))
    s.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the workers")
    _add_http_args(s)
    _add_log_args(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway in front of a running broker")
    g.add_argument("--broker", default=_env("BROKER_ADDRESS", DEFAULT_FRONTEND),
                   help="the broker's client (frontend) address (env TOKENMILL_BROKER_ADDRESS)")
    g.add_argument("--model", action="append", default=None,
                   help="a model this gateway answers for while no worker serves it (503, not 404); repeatable")
    g.add_argument("--curve-server-key", default=_env("CURVE_SERVER_KEY", None),
                   help="the broker's public key (file or z85), when it runs CURVE")
    g.add_argument("--curve-secret", default=_env("CURVE_SECRET", None), help="this gateway's NAME.key_secret")
    _add_http_args(g)
    _add_log_args(g)
    g.set_defaults(func=cmd_gateway)


def _add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="HTTP address to bind (env TOKENMILL_HOST)")
    p.add_argument("--port", type=int, default=_env_int("PORT", 8000), help="HTTP port (env TOKENMILL_PORT)")
    p.add_argument("--api-key", action="append", default=None,
                   help="accept only requests with 'Authorization: Bearer KEY' (repeatable; env TOKENMILL_API_KEY)")
    p.add_argument("--api-key-file", default=_env("API_KEY_FILE", None),
                   help="a file of API keys, one per line (env TOKENMILL_API_KEY_FILE)")
    p.add_argument("--request-timeout", type=float, default=_env_float("REQUEST_TIMEOUT", None),
                   help="deadline of each job in seconds (default: the broker's)")
    p.add_argument("--health-stale", type=float, default=_env_float("HEALTH_STALE", 2.5),
                   help="/health: seconds without a worker heartbeat before the worker counts as down")
    p.add_argument("--progress-stall", type=float, default=_env_float("PROGRESS_STALL", 10.0),
                   help="/health: seconds a worker with work may go without an engine step")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def _gateway_config(args: argparse.Namespace, broker: str, models: tuple[str, ...]) -> Any:
    from tokenmill.gateway import GatewayConfig, load_api_keys

    keys = list(args.api_key or [])
    env_key = _env("API_KEY", "")
    if env_key:
        keys.append(env_key)
    if args.api_key_file:
        keys.extend(load_api_keys(args.api_key_file))
    return GatewayConfig(broker=broker, host=args.host, port=args.port, models=models, api_keys=tuple(keys),
                         request_timeout=args.request_timeout, heartbeat_stale=args.health_stale,
                         progress_stall=args.progress_stall, log_requests=args.access_log,
                         curve_server_key=getattr(args, "curve_server_key", None),
                         curve_secret_key=getattr(args, "curve_secret", None))


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _run_gateway(cfg: Any) -> int:
    from tokenmill.gateway.server import serve

    if not _port_free(cfg.host, cfg.port):
        print(f"tokenmill: port {cfg.port} on {cfg.host} is already in use", file=sys.stderr)
        return 1
    print(f"http://{cfg.host}:{cfg.port}/v1", flush=True)
    log.info("gateway_listening", url=f"http://{cfg.host}:{cfg.port}/v1", broker=cfg.broker,
             api_keys=len(cfg.api_keys))
    serve(cfg)
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_json)
    try:
        cfg = _gateway_config(args, args.broker, tuple(args.model or ()))
    except (OSError, ValueError) as e:
        print(f"tokenmill: {e}", file=sys.stderr)
        return 2
    return _run_gateway(cfg)


def cmd_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_json)
    try:
        cfg = _gateway_config(args, args.frontend, (args.model,))
    except (OSError, ValueError) as e:
        print(f"tokenmill: {e}", file=sys.stderr)
        return 2
    if not _port_free(cfg.host, cfg.port):
        print(f"tokenmill: port {cfg.port} on {cfg.host} is already in use", file=sys.stderr)
        return 1
    common = ["--log-level", args.log_level, *(["--log-json"] if args.log_json else [])]
    broker = _spawn(["broker", "--frontend", args.frontend, "--backend", args.backend,
                     "--queue-size", str(args.queue_size), *common])
    workers = [
        _spawn(["worker", "--broker", args.backend, "--model", args.model, "--load-format", args.load_format,
                "--device", args.device, "--heartbeat-interval", str(args.heartbeat_interval),
                "--max-num-seqs", str(args.max_num_seqs), "--name", f"worker-{i}", *common])
        for i in range(args.workers)
    ]
    try:
        if not _wait_ready(args.frontend, args.workers, args.ready_timeout, [broker, *workers]):
            log.error("serve_failed", reason="broker or workers did not become ready")
            return 1
        log.info("serve_ready", broker=args.frontend, workers=args.workers, model=args.model)
        return _run_gateway(cfg)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_all(broker, workers)
