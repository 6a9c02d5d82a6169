"""`tokenmill serve` (broker + workers + HTTP gateway in one command) and `tokenmill gateway` (an HTTP
gateway alone, in front of a running broker; several gateways may share one broker).

    tokenmill serve --workers 1                       # embedded model, http://127.0.0.1:8000/v1
    tokenmill gateway --broker tcp://10.0.0.5:5555 --port 8000 --api-key-file keys.txt

Their options come from the settings table (cli/settings.py), as `up`'s do; `serve` takes all of `up`'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import structlog

from tokenmill.cli.errors import UserError, check_ports_free
from tokenmill.cli.serve import Stopper, _stop_all, _wait_ready, configure_logging, preflight, start_pool
from tokenmill.cli.settings import GATEWAY, SERVE, add_settings

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
                   help="a model this gateway answers for while no worker serves it (503, not 404); repeatable "
                        "(default: none)")
    g.set_defaults(func=cmd_gateway)


def _add_repeated_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=None,
                   help="accept only requests with 'Authorization: Bearer KEY' (repeatable; a key on the command "
                        "line is visible to other users of the machine: prefer --api-key-file; default: none, no "
                        "key needed)")


def _gateway_config(args: argparse.Namespace, broker: str, models: tuple[str, ...]) -> Any:
    from tokenmill.gateway import GatewayConfig, load_api_keys

    keys = list(args.api_key or [])
    if args.api_key_file:
        try:
            keys.extend(load_api_keys(args.api_key_file))
        except OSError as e:
            raise UserError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
        except ValueError as e:
            raise UserError(f"--api-key-file {e}") from None
    return GatewayConfig(broker=broker, host=args.host, port=args.port, models=models, api_keys=tuple(keys),
                         request_timeout=args.request_timeout, heartbeat_stale=args.health_stale,
                         progress_stall=args.progress_stall, log_requests=args.access_log,
                         workers=args.gateway_workers, drain_timeout=args.drain_timeout,
                         curve_server_key=getattr(args, "curve_server_key", None),
                         curve_secret_key=getattr(args, "curve_secret", None))


def _run_gateway(cfg: Any) -> int:
    from tokenmill.gateway.server import serve

    check_ports_free(f"http://{cfg.host}:{cfg.port}")
    print(f"http://{cfg.host}:{cfg.port}/v1", flush=True)
    log.info("gateway_listening", url=f"http://{cfg.host}:{cfg.port}/v1", broker=cfg.broker,
             api_key_count=len(cfg.api_keys), workers=cfg.workers)
    serve(cfg)
    return 0


def _config_or_exit(args: argparse.Namespace, broker: str, models: tuple[str, ...]) -> Any:
    try:
        return _gateway_config(args, broker, models)
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from None


def cmd_gateway(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_json, args.log_format)
    cfg = _config_or_exit(args, args.broker_address, tuple(args.model or ()))
    # uvicorn takes SIGINT / SIGTERM while it serves and hands them on when it returns: to this handler, so the
    # gateway then exits with status 0 instead of dying of the signal.
    stopper = Stopper().install()
    return 0 if stopper.requested.is_set() else _run_gateway(cfg)


def cmd_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_json, args.log_format)
    cfg = _config_or_exit(args, args.frontend, (args.model,))
    preflight(args, args.frontend, args.backend, f"http://{cfg.host}:{cfg.port}")
    # uvicorn takes Ctrl-C while it serves (a second one stops its wait for open streams) and hands the
    # signals it caught on to this handler when it returns: the pool then drains, or stops at once.
    stopper = Stopper().install()
    broker, workers = start_pool(args)
    try:
        if not _wait_ready(args.frontend, args.workers, args.ready_timeout, [broker, *workers], stopper.requested):
            if stopper.requested.is_set():
                return 0
            log.error("serve_failed", reason="broker or workers did not become ready")
            return 1
        log.info("serve_ready", broker=args.frontend, workers=args.workers, model=args.model)
        code = _run_gateway(cfg)
        print("tokenmill: stopping (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        return code
    finally:
        _stop_all(broker, workers, stopper, args.drain_timeout)
