"""`tokenmill broker`, `tokenmill worker`, `tokenmill up` and `tokenmill keys`: the serving processes.

Their options come from the settings table (cli/settings.py): every flag also reads an environment variable
(shown in --help), which is how docker-compose.yml configures the services, and a --config TOML file.
Logs (structlog) go to stderr; `up` prints the client address on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import structlog

from tokenmill.cli.errors import CommandFailed, UserError, check_device, check_model, check_ports_free, flag_hints
from tokenmill.cli.settings import BROKER, UP, WORKER, add_settings, build_config, to_argv

log = structlog.get_logger("tokenmill.serve")


def configure_logging(level: str = "info", json: bool = False, fmt: str = "auto") -> None:
    """Every logger of this process (structlog's and the stdlib's) to stderr at `level`, as JSON lines
    (`json`, or `fmt` 'json', or 'auto' off a terminal) or console text (tokenmill.protocol.logs)."""
    from tokenmill.protocol.logs import configure

    configure(level, "json" if json else fmt)


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
                   help="a key pair with the worker role, whatever its name (repeatable; default: none)")
    g.set_defaults(func=cmd_keys_generate)


# ---- broker -----------------------------------------------------------------------------------------


def _register_broker(sub: Any) -> None:
    b = sub.add_parser("broker", help="run the broker (clients -> frontend, workers -> backend)")
    add_settings(b, BROKER)
    b.set_defaults(func=cmd_broker)


def cmd_broker(args: argparse.Namespace) -> int:
    import zmq

    from tokenmill.broker import Broker, BrokerConfig

    cfg = build_config(BrokerConfig, args, BROKER)
    configure_logging(args.log_level, args.log_json, args.log_format)
    check_ports_free(cfg.frontend, cfg.backend)
    broker = Broker(cfg)
    drains = [0]

    def on_signal(signum: int, _frame: Any) -> None:
        drains[0] += 1
        if drains[0] > 1:  # a second Ctrl-C: stop now
            print("tokenmill broker: stopping now", file=sys.stderr, flush=True)
            broker.stop()
            return
        stats = broker.stats()
        queued = sum(stats["queues"].values())
        print(f"tokenmill broker: draining: waiting for {stats['active_jobs']} job(s) in flight ({queued} queued) "
              f"on {len(stats['workers'])} worker(s), at most {cfg.drain_timeout:g} s; new jobs are refused "
              "(Ctrl-C again: stop now)", file=sys.stderr, flush=True)
        broker.request_drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        broker.bind()
    except zmq.ZMQError as e:  # e.g. the address is taken between the check and the bind
        raise CommandFailed(f"the broker cannot bind {cfg.frontend} / {cfg.backend}: {e}") from None
    broker.run()
    return 0


# ---- worker -----------------------------------------------------------------------------------------


def _register_worker(sub: Any) -> None:
    w = sub.add_parser("worker", help="run one worker (an engine) connected to a broker's backend")
    add_settings(w, WORKER)
    w.set_defaults(func=cmd_worker)


def _build_engine(args: argparse.Namespace, config: Any) -> Any:
    if args.engine_factory:  # "module:callable", called with the parsed args (tests, benchmarks)
        module, _, attr = args.engine_factory.partition(":")
        return getattr(importlib.import_module(module), attr)(args)
    from tokenmill.worker.engine import LLMEngine

    return LLMEngine(config)


def cmd_worker(args: argparse.Namespace) -> int:
    from tokenmill.protocol.keys import load_keypair, load_public_key
    from tokenmill.worker.config import EngineConfig
    from tokenmill.worker.loader import ModelLoadError
    from tokenmill.worker.process import WorkerOptions, run_worker

    config = build_config(EngineConfig, args, WORKER)  # a bad setting fails here, in one line, before loading
    if not args.engine_factory:
        check_device(config.device)
        check_model(config.model, config.load_format)
    curve = args.curve_server_key is not None and args.curve_secret is not None
    opts = build_config(WorkerOptions, args, WORKER, aliases=(args.model,), capacity=args.max_num_seqs,
                        curve_server_key=load_public_key(args.curve_server_key) if curve else None,
                        curve_keypair=load_keypair(args.curve_secret) if curve else None)
    configure_logging(args.log_level, args.log_json, args.log_format)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        engine = _build_engine(args, config)
    except ModelLoadError as e:
        raise UserError(flag_hints(str(e))) from None
    try:
        run_worker(engine, opts, stop)
    except Exception:
        log.exception("worker_failed")
        return 1
    return 0


# ---- up ---------------------------------------------------------------------------------------------


def _register_up(sub: Any) -> None:
    u = sub.add_parser("up", help="start a broker and N workers on this machine; Ctrl-C stops them all")
    add_settings(u, UP)
    u.set_defaults(func=cmd_up)


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", *argv], start_new_session=True)


def _wait_ready(address: str, n: int, timeout: float, procs: list[subprocess.Popen[bytes]],
                stop: threading.Event | None = None) -> bool:
    from tokenmill.client import BrokerUnavailable, Client

    deadline = time.monotonic() + timeout
    with Client(address) as c:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if any(pr.poll() is not None for pr in procs):
                return False
            try:
                if len(c.stats(timeout=2.0)["workers"]) >= n:
                    return True
            except BrokerUnavailable:
                pass
            time.sleep(0.2)
    return False


class Stopper:
    """The signal handler of a command that runs children: the first Ctrl-C (or SIGTERM) asks for a graceful
    stop (`requested`), a second one forces it (`forced`)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.forced = threading.Event()

    def __call__(self, _signum: int, _frame: Any) -> None:
        if self.requested.is_set():
            self.forced.set()
        self.requested.set()

    def install(self) -> Stopper:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
        return self


def _signal_alive(procs: list[subprocess.Popen[bytes]], sig: int) -> None:
    for pr in procs:
        if pr.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                pr.send_signal(sig)


def _wait_procs(procs: list[subprocess.Popen[bytes]], timeout: float, interrupt: threading.Event) -> bool:
    """Wait until `procs` have exited (True), `timeout` passes or `interrupt` is set (False)."""
    deadline = time.monotonic() + timeout
    while any(pr.poll() is None for pr in procs):
        if interrupt.is_set() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stop_all(broker: subprocess.Popen[bytes], workers: list[subprocess.Popen[bytes]],
              stopper: Stopper | None = None, drain_timeout: float = 30.0) -> None:
    """Drain the broker first (its in-flight jobs need the workers; it says what it waits for), then stop
    the workers. A second Ctrl-C during the drain (`stopper.forced`) stops everything at once."""
    forced = stopper.forced if stopper is not None else threading.Event()
    for group, grace in (([broker], drain_timeout + 5.0), (workers, 30.0)):
        _signal_alive(group, signal.SIGTERM)
        if _wait_procs(group, grace, forced):
            continue
        if forced.is_set():
            _signal_alive(group, signal.SIGTERM)  # the broker's second signal: stop without draining
            _wait_procs(group, 5.0, threading.Event())
        for pr in group:
            if pr.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pr.pid, signal.SIGKILL)
                pr.wait()
    if forced.is_set():
        _signal_alive(workers, signal.SIGKILL)


def preflight(args: argparse.Namespace, *addresses: str) -> None:
    """What `up` / `serve` check before they start anything: a free port for each address, a model that
    exists and a device this machine has (raises UserError or CommandFailed, one line)."""
    check_model(args.model, args.load_format)
    check_device(args.device)
    check_ports_free(*addresses)


def start_pool(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], list[subprocess.Popen[bytes]]]:
    # Every setting `up` resolved (flags, environment, --config) goes to the children as a flag.
    broker = _spawn(["broker", *to_argv(args, BROKER)])
    workers = [_spawn(["worker", "--broker", args.backend, "--name", f"worker-{i}", *to_argv(args, WORKER)])
               for i in range(args.workers)]
    return broker, workers


def cmd_up(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_json, args.log_format)
    preflight(args, args.frontend, args.backend)
    stopper = Stopper().install()
    broker, workers = start_pool(args)
    try:
        if not _wait_ready(args.frontend, args.workers, args.ready_timeout, [broker, *workers], stopper.requested):
            if stopper.requested.is_set():
                return 0
            log.error("up_failed", reason="broker or workers did not become ready")
            return 1
        print(args.frontend, flush=True)
        log.info("up_ready", address=args.frontend, workers=args.workers, model=args.model)
        while not stopper.requested.wait(0.5):
            if broker.poll() is not None:
                log.error("broker_exited", code=broker.returncode)
                return 1
        print("tokenmill: stopping (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        return 0
    finally:
        _stop_all(broker, workers, stopper, args.drain_timeout)


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
