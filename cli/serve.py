"""`tokenmill broker`, `tokenmill worker`, `tokenmill up` and `tokenmill keys`: the serving processes.

Every flag also reads an environment variable (shown in --help), which is how docker-compose.yml
configures the services. Logs (structlog) go to stderr; `up` prints the client address on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import structlog

DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"
DEFAULT_BACKEND = "tcp://127.0.0.1:5556"

log = structlog.get_logger("tokenmill.serve")


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"TOKENMILL_{name}", default)


def _env_float(name: str, default: float | None) -> float | None:
    v = os.environ.get(f"TOKENMILL_{name}")
    return float(v) if v not in (None, "") else default


def _env_int(name: str, default: int | None) -> int | None:
    v = os.environ.get(f"TOKENMILL_{name}")
    return int(v) if v not in (None, "") else default


def configure_logging(level: str = "info", json: bool = False) -> None:
    """structlog (and the stdlib loggers the engine uses) to stderr at `level`."""
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        lvl = logging.INFO
    # Plain tracebacks: rich's would print local variables, which may hold key material.
    renderer: Any = (structlog.processors.JSONRenderer() if json else
                     structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback))
    processors: list[Any] = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso")]
    if json:
        processors.append(structlog.processors.format_exc_info)
    structlog.configure(processors=[*processors, renderer],
                        wrapper_class=structlog.make_filtering_bound_logger(lvl),
                        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
                        cache_logger_on_first_use=True)
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"), help="env TOKENMILL_LOG_LEVEL")
    p.add_argument("--log-json", action="store_true", default=_env("LOG_JSON", "") not in ("", "0"),
                   help="JSON log lines (env TOKENMILL_LOG_JSON=1)")


def register(sub: Any) -> None:
    _register_broker(sub)
    _register_worker(sub)
    _register_up(sub)
    k = sub.add_parser("keys", help="CURVE key management")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    g = ksub.add_parser("generate", help="write CURVE key pairs (mode 0600) into DIR")
    g.add_argument("dir")
    g.add_argument("--name", action="append", default=None,
                   help="key pair name (repeatable; default: broker, worker, client). 'broker' is the broker's "
                        "own key; a name starting with 'worker' gets the worker role, any other the client role. "
                        "Public keys of all but 'broker' are also copied to DIR/allowed/ (the broker's "
                        "--curve-allow), where each is admitted only on the socket of its role")
    g.add_argument("--worker", action="append", default=[], metavar="NAME",
                   help="a key pair with the worker role, whatever its name (repeatable)")
    g.set_defaults(func=cmd_keys_generate)


# ---- broker -----------------------------------------------------------------------------------------


def _register_broker(sub: Any) -> None:
    b = sub.add_parser("broker", help="run the broker (clients -> frontend, workers -> backend)")
    b.add_argument("--frontend", default=_env("FRONTEND", DEFAULT_FRONTEND), help="env TOKENMILL_FRONTEND")
    b.add_argument("--backend", default=_env("BACKEND", DEFAULT_BACKEND), help="env TOKENMILL_BACKEND")
    b.add_argument("--queue-size", type=int, default=_env_int("QUEUE_SIZE", 256))
    b.add_argument("--queue-timeout", type=float, default=_env_float("QUEUE_TIMEOUT", 60.0))
    b.add_argument("--default-timeout", type=float, default=_env_float("DEFAULT_TIMEOUT", None))
    b.add_argument("--client-timeout", type=float, default=_env_float("CLIENT_TIMEOUT", 10.0))
    b.add_argument("--liveness", type=int, default=_env_int("LIVENESS", 3))
    b.add_argument("--retention", type=float, default=_env_float("RETENTION", 60.0))
    b.add_argument("--migration-limit", type=int, default=_env_int("MIGRATION_LIMIT", 3))
    b.add_argument("--drain-timeout", type=float, default=_env_float("DRAIN_TIMEOUT", 30.0))
    b.add_argument("--busy-poll", type=float, default=_env_float("BUSY_POLL", 0.0),
                   help="seconds to keep polling without sleeping after each message (0: off). Lower relay "
                        "latency for a broker that owns a core, at 100%% of that core while tokens flow "
                        "(env TOKENMILL_BUSY_POLL)")
    b.add_argument("--open-jobs", action="store_true", default=_env("OPEN_JOBS", "") not in ("", "0"),
                   help="let any client cancel or subscribe to any job")
    b.add_argument("--curve-secret", default=_env("CURVE_SECRET", None),
                   help="broker's NAME.key_secret: turns on CURVE for both sockets (env TOKENMILL_CURVE_SECRET)")
    b.add_argument("--curve-allow", default=_env("CURVE_ALLOW", None),
                   help="directory of admitted public *.key files (env TOKENMILL_CURVE_ALLOW)")
    _add_log_args(b)
    b.set_defaults(func=cmd_broker)


def cmd_broker(args: argparse.Namespace) -> int:
    from tokenmill.broker.broker import Broker, BrokerConfig

    configure_logging(args.log_level, args.log_json)
    cfg = BrokerConfig(frontend=args.frontend, backend=args.backend, liveness=args.liveness,
                       client_timeout=args.client_timeout, queue_size=args.queue_size,
                       queue_timeout=args.queue_timeout, default_timeout=args.default_timeout,
                       retention=args.retention, migration_limit=args.migration_limit,
                       drain_timeout=args.drain_timeout, open_jobs=args.open_jobs, busy_poll=args.busy_poll,
                       curve_secret_file=args.curve_secret, curve_allow_dir=args.curve_allow)
    broker = Broker(cfg)
    drains = [0]

    def on_signal(signum: int, _frame: Any) -> None:
        drains[0] += 1
        if drains[0] > 1:  # a second Ctrl-C: stop now
            broker.stop()
        broker.request_drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    broker.serve_forever()
    return 0


# ---- worker -----------------------------------------------------------------------------------------


def _register_worker(sub: Any) -> None:
    w = sub.add_parser("worker", help="run one worker (an engine) connected to a broker's backend")
    w.add_argument("--broker", default=_env("BROKER", DEFAULT_BACKEND),
                   help="the broker's backend address (env TOKENMILL_BROKER)")
    w.add_argument("--model", default=_env("MODEL", "embedded"), help="env TOKENMILL_MODEL")
    w.add_argument("--load-format", default=_env("LOAD_FORMAT", "auto"), choices=["auto", "hf", "gguf", "dummy"])
    w.add_argument("--dtype", default=_env("DTYPE", "auto"))
    w.add_argument("--device", default=_env("DEVICE", "auto"))
    w.add_argument("--max-model-len", type=int, default=_env_int("MAX_MODEL_LEN", None))
    w.add_argument("--max-num-seqs", type=int, default=_env_int("MAX_NUM_SEQS", 128))
    w.add_argument("--num-blocks", type=int, default=_env_int("NUM_BLOCKS", None))
    w.add_argument("--block-size", type=int, default=_env_int("BLOCK_SIZE", 16))
    w.add_argument("--seed", type=int, default=_env_int("SEED", 0))
    w.add_argument("--name", default=_env("WORKER_NAME", ""))
    w.add_argument("--heartbeat-interval", type=float, default=_env_float("HEARTBEAT_INTERVAL", 1.0))
    w.add_argument("--liveness", type=int, default=_env_int("LIVENESS", 3))
    w.add_argument("--curve-server-key", default=_env("CURVE_SERVER_KEY", None),
                   help="the broker's public key (file or z85) (env TOKENMILL_CURVE_SERVER_KEY)")
    w.add_argument("--curve-secret", default=_env("CURVE_SECRET", None),
                   help="this worker's NAME.key_secret (env TOKENMILL_CURVE_SECRET)")
    w.add_argument("--engine-factory", default=_env("ENGINE_FACTORY", None), help=argparse.SUPPRESS)
    _add_log_args(w)
    w.set_defaults(func=cmd_worker)


def _build_engine(args: argparse.Namespace) -> Any:
    if args.engine_factory:  # "module:callable", called with the parsed args (tests, benchmarks)
        module, _, attr = args.engine_factory.partition(":")
        return getattr(importlib.import_module(module), attr)(args)
    from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    cfg = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                       max_model_len=args.max_model_len, seed=args.seed,
                       cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
                       scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs))
    return LLMEngine(cfg)


def cmd_worker(args: argparse.Namespace) -> int:
    from tokenmill.protocol.keys import load_keypair, load_public_key
    from tokenmill.worker.process import WorkerOptions, run_worker

    configure_logging(args.log_level, args.log_json)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    curve = args.curve_server_key is not None and args.curve_secret is not None
    opts = WorkerOptions(
        broker=args.broker, name=args.name, aliases=(args.model,), capacity=args.max_num_seqs,
        heartbeat_interval=args.heartbeat_interval, liveness=args.liveness,
        curve_server_key=load_public_key(args.curve_server_key) if curve else None,
        curve_keypair=load_keypair(args.curve_secret) if curve else None,
    )
    try:
        engine = _build_engine(args)
        run_worker(engine, opts, stop)
    except Exception:
        log.exception("worker_failed")
        return 1
    return 0


# ---- up ---------------------------------------------------------------------------------------------


def _register_up(sub: Any) -> None:
    u = sub.add_parser("up", help="start a broker and N workers on this machine; Ctrl-C stops them all")
    u.add_argument("--workers", type=int, default=_env_int("WORKERS", 1))
    u.add_argument("--model", default=_env("MODEL", "embedded"))
    u.add_argument("--load-format", default=_env("LOAD_FORMAT", "auto"), choices=["auto", "hf", "gguf", "dummy"])
    u.add_argument("--device", default=_env("DEVICE", "auto"))
    u.add_argument("--frontend", default=_env("FRONTEND", DEFAULT_FRONTEND))
    u.add_argument("--backend", default=_env("BACKEND", DEFAULT_BACKEND))
    u.add_argument("--heartbeat-interval", type=float, default=_env_float("HEARTBEAT_INTERVAL", 1.0))
    u.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the workers")
    _add_log_args(u)
    u.set_defaults(func=cmd_up)


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", *argv], start_new_session=True)


def _wait_ready(address: str, n: int, timeout: float, procs: list[subprocess.Popen[bytes]]) -> bool:
    from tokenmill.client import BrokerUnavailable, Client

    deadline = time.monotonic() + timeout
    with Client(address) as c:
        while time.monotonic() < deadline:
            if any(pr.poll() is not None for pr in procs):
                return False
            try:
                if len(c.stats(timeout=2.0)["workers"]) >= n:
                    return True
            except BrokerUnavailable:
                pass
            time.sleep(0.2)
    return False


def _stop_all(broker: subprocess.Popen[bytes], workers: list[subprocess.Popen[bytes]]) -> None:
    """Drain the broker first (its in-flight jobs need the workers), then stop the workers."""
    for group in ([broker], workers):
        for pr in group:
            if pr.poll() is None:
                pr.send_signal(signal.SIGTERM)
        for pr in group:
            try:
                pr.wait(35.0)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()


def cmd_up(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_json)
    common = ["--log-level", args.log_level, *(["--log-json"] if args.log_json else [])]
    broker = _spawn(["broker", "--frontend", args.frontend, "--backend", args.backend, *common])
    workers = [
        _spawn(["worker", "--broker", args.backend, "--model", args.model, "--load-format", args.load_format,
                "--device", args.device, "--heartbeat-interval", str(args.heartbeat_interval),
                "--name", f"worker-{i}", *common])
        for i in range(args.workers)
    ]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if not _wait_ready(args.frontend, args.workers, args.ready_timeout, [broker, *workers]):
            log.error("up_failed", reason="broker or workers did not become ready")
            return 1
        print(args.frontend, flush=True)
        log.info("up_ready", address=args.frontend, workers=args.workers, model=args.model)
        while not stop.wait(0.5):
            if broker.poll() is not None:
                log.error("broker_exited", code=broker.returncode)
                return 1
        return 0
    finally:
        _stop_all(broker, workers)


# ---- keys -------------------------------------------------------------------------------------------


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from tokenmill.protocol.keys import ROLE_CLIENT, ROLE_WORKER, generate_keypair, install_public_key

    names = args.name or ([] if args.worker else ["broker", "worker", "client"])
    roles = {name: None if name == "broker" else ROLE_WORKER if name.startswith("worker") else ROLE_CLIENT
             for name in names}
    roles.update({name: ROLE_WORKER for name in args.worker})
    for name, role in roles.items():
        pub, sec = generate_keypair(args.dir, name, role)
        if role is not None:
            install_public_key(pub, os.path.join(args.dir, "allowed"))
        print(f"{name} ({role or 'broker'}): {pub} {sec}")
    return 0
