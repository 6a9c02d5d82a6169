"""`tokenmill serve` (broker + workers + HTTP gateway in one command) and `tokenmill gateway` (an HTTP
gateway alone, in front of a running broker; several gateways may share one broker).

    tokenmill serve --workers 1                       # embedded model, http://127.0.0.1:8000/v1
    tokenmill gateway --broker tcp://10.0.0.5:5555 --port 8000 --api-key-file keys.txt

Their options come from the settings table (cli/settings.py), as `up`'s do; `serve` takes all of `up`'s.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

import structlog

from tokenmill.cli.serve import _spawn, _stop_all, _wait_ready, configure_logging
from tokenmill.cli.settings import BROKER, GATEWAY, SERVE, WORKER, add_settings, to_argv

log = structlog.get_logger("tokenmill.serve")


def register(sub: Any) -> None:
    s = sub.add_parser("serve", help="start a broker, N workers and the OpenAI-compatible HTTP gateway; Ctrl-C "
                                     "stops them all")
    add_settings(s, SERVE)
    _add_repeated_args(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway in front of a running broker")
    add_settings(g, GATEWAY)
    _add_repeated_args(g)
    g.add_argument("--model", action="append", default=None,
                   help="a model this gateway answers for while no worker serves it (503, not 404); repeatable")
    g.set_defaults(func=cmd_gateway)


def _add_repeated_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=None,
                   help="accept only requests with 'Authorization: Bearer KEY' (repeatable; a key on the command "
                        "line is visible to other users of the machine: prefer --api-key-file)")


def _gateway_config(args: argparse.Namespace, broker: str, models: tuple[str, ...]) -> Any:
    from tokenmill.gateway import GatewayConfig, load_api_keys

    keys = list(args.api_key or [])
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
        cfg = _gateway_config(args, args.broker_address, tuple(args.model or ()))
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
    # Every setting `serve` resolved (flags, environment, --config) goes to the children as a flag.
    broker = _spawn(["broker", *to_argv(args, BROKER)])
    workers = [_spawn(["worker", "--broker", args.backend, "--name", f"worker-{i}", *to_argv(args, WORKER)])
               for i in range(args.workers)]
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
