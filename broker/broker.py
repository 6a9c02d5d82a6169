"""The tokenmill broker: one thread, one ZeroMQ context, a Majordomo-style loop over small parts.

    clients --DEALER--> [ROUTER frontend]  broker  [ROUTER backend] <--DEALER-- workers

Each loop turn (`run`): poll both sockets (timeout = the next timer, at most a fifth of the shortest
heartbeat interval; 0 within `busy_poll` of the last message) -> handle a bounded batch of messages from
each, workers first -> `tick`: job deadlines and queue timeouts, worker liveness (purge the silent ones,
heartbeat the others), client liveness, retention of finished jobs, resends to lagging subscribers,
dispatch of queued jobs -> a full GC collection if one is due and the sockets are idle.

The parts, each with its own invariants (and tests without sockets):
    workers.WorkerTable    registration, heartbeats, liveness, control and data routing ids
    clients.ClientTable    connected clients, subscriptions, ownership checks, non-blocking sends
    jobs.JobTable / Job    every job by id, its token log, retention
    queues.JobQueues       per-model FIFO of jobs waiting for a worker
    timers.Timers          deadlines and queue timeouts
    dispatch.Dispatcher    the routing policy (replaceable; AffinityDispatcher by default), and the placement of a
                           job on a prefill and a decode worker (disaggregated serving: Dispatcher.place)
    fanout.Fanout          the one path of a TOKENS batch to the logs and the subscribers
    counters.Counters      what STATS counts
    gcpacer.GcPacer        full GC collections at idle moments
    admission.ModelCatalog what workers announced: unknown models and jobs that fit no worker are refused
    blame                  whom a worker's death is charged to (the migration limit)
    budget.Budget          per-client bounds on answers a client may leave unread
    memory.trim_heap       freed heap handed back at idle moments
    observer.BrokerObserver  hooks on the loop's events, for tracing (benchmarks/broker_bench.py)
This module wires them: it decodes messages and carries out a job's life (accept, dispatch, migrate,
finish). Nothing a peer sends can stop the loop: every message is decoded strictly (ProtocolError ->
dropped and counted, a FAIL "protocol" answer to clients), sends never block, and a send that fails
marks the peer gone (workers: their jobs migrate; clients: their jobs are cancelled).
"""

from __future__ import annotations

import contextlib
import operator
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from tokenmill.broker.admission import ModelCatalog, fit_refusal, fits
from tokenmill.broker.blame import charged, migration_refusal
from tokenmill.broker.budget import Budget, BudgetConfig, ReplyKind
from tokenmill.broker.clients import ClientTable
from tokenmill.broker.counters import Counters
from tokenmill.broker.dispatch import AffinityDispatcher, Dispatcher, Placement, prefix_hashes
from tokenmill.broker.fanout import Fanout
from tokenmill.broker.gcpacer import GcPacer
from tokenmill.broker.jobs import Job, JobState, JobTable
from tokenmill.broker.memory import trim_heap
from tokenmill.broker.observer import BrokerObserver
from tokenmill.broker.queues import JobQueues
from tokenmill.broker.security import ZapAuthenticator, load_zap_allow_list, make_curve_server
from tokenmill.broker.timers import Timer, Timers
from tokenmill.broker.workers import WorkerInfo, WorkerTable
from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError
from tokenmill.protocol.keys import load_keypair

log = structlog.get_logger("tokenmill.broker")

_attempt = operator.itemgetter(1)  # of a TokenChunk (a NamedTuple)
_entry = operator.itemgetter(0, 2, 3, 4, 5)  # a TokenChunk's STREAM entry (as TokenChunk.entry(), a tuple)


@dataclass(frozen=True)
class BrokerConfig:
    """Everything a broker is built from (the `tokenmill broker` flags map 1:1 onto these)."""

    frontend: str = "tcp://127.0.0.1:5555"  # clients connect here
    backend: str = "tcp://127.0.0.1:5556"  # workers connect here
    liveness: int = 3  # a worker silent for liveness x its heartbeat interval is dead
    client_timeout: float = 10.0  # a client with open jobs silent this long is gone (its jobs cancelled)
    queue_size: int = 256  # per model: queued (not yet dispatched) jobs past this get OVERLOADED
    queue_timeout: float = 60.0  # a job queued this long without a worker fails with "deadline"
    default_timeout: float | None = None  # deadline of a job that names none
    retention: float = 60.0  # finished jobs (and their token logs) are kept this long for subscribers
    max_retained: int = 10_000
    migration_limit: int = 3  # a job that was running on this many dying workers fails
    drain_timeout: float = 30.0
    open_jobs: bool = False  # True: anyone may cancel/subscribe any job
    affinity_chunk_chars: int = 128
    affinity_max_chunks: int = 32
    affinity_slack: float = 0.25
    max_body_bytes: int = p.MAX_BODY_BYTES
    hwm: int = 100_000
    curve_secret_file: str | None = None  # broker's NAME.key_secret: enables CURVE on both sockets
    curve_allow_dir: str | None = None  # *.key public keys of the clients and workers admitted
    max_batch: int = 2000  # messages handled per socket per loop turn (fairness between sockets)
    gc_tuning: bool = True  # freeze the start-up heap; full collections at idle moments (gcpacer.py)
    # After a message, keep polling without sleeping for this many seconds (0: off). Saves the wake-up
    # of an idle core per message, at the price of a core at 100% while messages keep coming: only for
    # a broker that owns its core.
    busy_poll: float = 0.0
    # A job for a model no worker has announced is refused at once, except in this many seconds after
    # the first worker registered (the others may still be coming).
    unknown_model_grace: float = 5.0
    reply_budget: BudgetConfig = field(default_factory=BudgetConfig)  # per-client bounds (budget.py)
    trim_interval: float = 1.0  # at idle moments, hand freed heap back at most this often (memory.py)

    def __post_init__(self) -> None:
        if not 0.0 <= self.busy_poll <= 1.0:
            raise ValueError(f"busy_poll must be between 0 and 1 s, got {self.busy_poll}")
        if self.unknown_model_grace < 0 or self.trim_interval <= 0:
            raise ValueError("unknown_model_grace must be >= 0 and trim_interval > 0 (seconds)")


class Broker:
    """The broker. `bind()` then `run()` (blocks until drained or `stop()`); or `serve_forever()`.

    `dispatcher` replaces the routing policy; `observer` receives the loop's events (observer.py)."""

    def __init__(self, config: BrokerConfig | None = None, ctx: zmq.Context | None = None, *,
                 dispatcher: Dispatcher | None = None, observer: BrokerObserver | None = None) -> None:
        self.cfg = cfg = config or BrokerConfig()
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.observer = observer
        self.counters = Counters()
        self.jobs = JobTable(cfg.retention, cfg.max_retained)
        self.workers = WorkerTable()
        self.clients = ClientTable(self.counters, self._client_gone, cfg.open_jobs,
                                   observer.client_send if observer is not None else None)
        self.queues = JobQueues()
        self.timers = Timers()
        self.dispatcher = dispatcher if dispatcher is not None else AffinityDispatcher(cfg.affinity_slack)
        self.fanout = Fanout(self.jobs, self.clients, self.counters)
        self.gc = GcPacer(self.counters, self._sockets_busy)
        self._next_client_check = 0.0
        self._need_dispatch = False
        self._draining = False
        self._drain_deadline: float | None = None
        self._stop = False
        self._curve = cfg.curve_secret_file is not None
        self.instance = secrets.token_hex(8)  # new at every start: in PONG, ACK and STATS (clients see restarts)
        self.budget = Budget(cfg.reply_budget)
        self.catalog = ModelCatalog(cfg.unknown_model_grace)
        self._next_trim = 0.0
        self.zap: ZapAuthenticator | None = None
        self.frontend: zmq.Socket | None = None
        self.backend: zmq.Socket | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def bind(self) -> None:
        """Create and bind the sockets (and start ZAP when CURVE is on)."""
        keys = None
        if self._curve:
            assert self.cfg.curve_secret_file is not None
            keys = load_keypair(self.cfg.curve_secret_file)
            allowed = load_zap_allow_list(self.cfg.curve_allow_dir)
            self.zap = ZapAuthenticator(self.ctx, allowed)
            self.zap.start()
            log.info("curve_enabled", allowed_keys=len(allowed))
        self.frontend = self._router(self.cfg.frontend, keys, b"clients")
        self.backend = self._router(self.cfg.backend, keys, b"workers")
        self.clients.sock = self.frontend
        log.info("broker_bound", frontend=self.endpoint("frontend"), backend=self.endpoint("backend"))

    def _router(self, addr: str, keys: tuple[bytes, bytes] | None, domain: bytes) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises instead of vanishing
        s.setsockopt(zmq.MAXMSGSIZE, 2 * self.cfg.max_body_bytes)  # past this libzmq drops the peer
        s.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        s.setsockopt(zmq.RCVHWM, self.cfg.hwm)
        s.setsockopt(zmq.TCP_KEEPALIVE, 1)
        s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        if keys is not None:
            make_curve_server(s, keys[0], keys[1], domain)
        s.bind(addr)
        return s

    def endpoint(self, which: str) -> str:
        sock = self.frontend if which == "frontend" else self.backend
        assert sock is not None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def request_drain(self) -> None:
        """Stop accepting, finish in-flight and queued jobs, then exit (signal-handler safe)."""
        self._draining = True

    def stop(self) -> None:
        """Exit the loop at the next turn without draining (thread-safe)."""
        self._stop = True

    def serve_forever(self) -> None:
        self.bind()
        self.run()

    def run(self) -> None:
        """The loop (module docstring), until stop() or the end of a drain; then the shutdown."""
        assert self.frontend is not None and self.backend is not None, "call bind() first"
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        if self.cfg.gc_tuning:
            self.gc.start()
        spin, spin_until = self.cfg.busy_poll, 0.0
        on_worker = self.on_worker_message if self.observer is not None else self._on_worker_frames
        try:
            while not self._stop:
                if spin_until and time.monotonic() < spin_until:
                    events = dict(poller.poll(0))
                    if not events:
                        os.sched_yield()  # lets this core's other threads (e.g. ZeroMQ's IO thread) run
                else:
                    events = dict(poller.poll(self._poll_timeout_ms()))
                # Workers first: a TOKENS batch is relayed before whatever clients sent meanwhile.
                if self.backend in events:
                    self._drain_socket(self.backend, on_worker)
                if self.frontend in events:
                    self._drain_socket(self.frontend, self.on_client_message)
                now = time.monotonic()
                if events and spin:
                    spin_until = now + spin
                self.tick(now)
                self.gc.after_turn(now)
                if now >= self._next_trim:
                    self._next_trim = now + self.cfg.trim_interval
                    if not self._sockets_busy():  # an idle moment: hand freed heap back (memory.py)
                        trim_heap()
        finally:
            self.gc.stop()
            self._shutdown()

    def _shutdown(self) -> None:
        for w in self.workers:
            self._send_worker(w, p.BrokerDisconnect("shutdown"), on_fail_dead=False)
        for s in (self.frontend, self.backend):
            if s is not None:
                s.close(linger=1000)  # let final replies reach their peers
        if self.zap is not None:
            self.zap.stop()
        if self._own_ctx:
            self.ctx.term()
        log.info("broker_stopped", active_jobs=self.jobs.active, workers=len(self.workers),
                 **self.counters.snapshot())

    def _sockets_busy(self) -> bool:
        """Whether a message waits on either socket."""
        assert self.frontend is not None and self.backend is not None
        return bool((int(self.frontend.get(zmq.EVENTS)) | int(self.backend.get(zmq.EVENTS))) & zmq.POLLIN)

    def _poll_timeout_ms(self) -> int:
        tick = self.workers.poll_interval(0.1)
        if (at := self.timers.next_at()) is not None:
            tick = min(tick, max(0.0, at - time.monotonic()))
        if self.clients.lagging:
            tick = min(tick, 0.005)
        return max(1, int(tick * 1000))

    def _drain_socket(self, sock: zmq.Socket, handle: Callable[[list[Any]], None]) -> None:
        copy = not (self._curve and sock is self.frontend)  # frames carry "User-Id" only uncopied
        for _ in range(self.cfg.max_batch):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # a handler bug must not take the broker down; it is logged and counted
                self.counters["handler_errors"] += 1
                log.exception("handler_error")

    # ---- timers -----------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """The loop's timer work, after each turn's messages."""
        if self.observer is not None:
            self.observer.tick_started()
        self._run_timers(now)
        for w in self.workers.silent(now, self.cfg.liveness):
            self._worker_dead(w, "heartbeat timeout")
        for w in self.workers.heartbeats_due(now):
            self._send_worker(w, p.BrokerHeartbeat())
        if now >= self._next_client_check:  # O(clients): a few times a second, not every loop turn
            self._next_client_check = now + min(0.1, self.cfg.client_timeout / 10)
            for cid in self.clients.silent(now, self.cfg.client_timeout):
                self._client_gone(cid, "timeout")
        if now >= self._next_trim:  # (the loop hands freed heap back at the same pace: run())
            self.budget.prune(now)
        for job in self.jobs.expire(now):
            self.clients.forget(job)
        if self.clients.lagging:
            self.fanout.flush([j for j in map(self.jobs.get, self.clients.take_lagging()) if j is not None])
        if self._need_dispatch:
            self._dispatch()
        if self._draining:
            self._check_drain(now)
        if self.observer is not None:
            self.observer.tick_finished()

    def _run_timers(self, now: float) -> None:
        for kind, job_id, attempt in self.timers.due(now):
            job = self.jobs.get(job_id)
            if job is None or job.is_terminal:
                continue
            if kind is Timer.DEADLINE:
                self.counters["deadline_expired"] += 1
                self._finish(job, p.Fail(job_id, "deadline", "deadline exceeded"), cancel_worker=True)
            elif job.state is JobState.QUEUED and job.attempt == attempt:
                self.counters["queue_timeouts"] += 1
                self._finish(job, p.Fail(job_id, "deadline", f"queued {self.cfg.queue_timeout}s without a worker"))

    def _check_drain(self, now: float) -> None:
        if self._drain_deadline is None:
            self._drain_deadline = now + self.cfg.drain_timeout
            log.info("drain_started", active_jobs=self.jobs.active, timeout=self.cfg.drain_timeout)
        if self.jobs.active and now < self._drain_deadline:
            return
        for job in self.jobs.unfinished():
            self._finish(job, p.Fail(job.job_id, "unavailable", "broker shut down"), cancel_worker=True)
        self._stop = True

    # ---- clients ----------------------------------------------------------------------------------

    def on_client_message(self, frames: list[Any]) -> None:
        """Handle one message from the frontend socket (routing id + frames; uncopied with CURVE)."""
        owner_key: str | None = None
        if not isinstance(frames[0], bytes):  # CURVE: uncopied frames carrying the ZAP user id
            try:
                owner_key = frames[-1].get("User-Id")
            except zmq.ZMQError:  # no user id: cannot own anything (ZAP always sets one)
                owner_key = ""
            frames = [f.bytes for f in frames]
        ident = frames[0]
        try:
            msg = p.decode(frames[1:], p.CLIENT_TO_BROKER, self.cfg.max_body_bytes)
        except ProtocolError as e:
            oversized = len(frames) == 4 and len(frames[3]) > self.cfg.max_body_bytes
            self.counters["oversized_frames" if oversized else "malformed_client_messages"] += 1
            job_id = "" if oversized else p.readable_job_id(frames[1:], self.cfg.max_body_bytes)
            self._refuse(ident, None, p.Fail(job_id, "protocol", str(e)[:300]))
            return
        self.clients.heard(ident, time.monotonic())
        owner = owner_key if owner_key is not None else getattr(msg, "owner", "")
        if isinstance(msg, p.Submit):
            self._on_submit(ident, owner, msg)
        elif isinstance(msg, p.Cancel):
            self._on_cancel(ident, owner, msg)
        elif isinstance(msg, p.Subscribe):
            self._on_subscribe(ident, owner, msg)
        elif isinstance(msg, p.Ping):
            if self._may_answer(ident, ReplyKind.CONTROL):
                self.clients.send(ident, p.Pong(self.instance))
        elif isinstance(msg, p.Bye):
            self._client_gone(ident, "bye")
        elif isinstance(msg, p.StatsRequest):
            self.counters["stats_requests"] += 1
            if self._may_answer(ident, ReplyKind.CONTROL):  # (before building the reply: that is the cost)
                self.clients.send(ident, p.StatsReply(self.stats()))

    def _may_answer(self, ident: bytes, kind: ReplyKind) -> bool:
        """Whether `ident`'s budget for replies of `kind` has room (budget.py); counts the drops."""
        if self.budget.allow(ident, kind, time.monotonic()):
            return True
        self.counters[f"replies_dropped_{kind.value}"] += 1
        return False

    def _on_submit(self, ident: bytes, owner: str, msg: p.Submit) -> None:
        self.counters["submits"] += 1
        if self._draining:
            self._refuse(ident, "rejected_draining", p.Fail(msg.job_id, "unavailable", "broker is draining"))
            return
        existing = self.jobs.get(msg.job_id)
        if existing is not None:
            self._on_duplicate(ident, owner, msg, existing)
            return
        try:
            max_tokens = SamplingParams.from_dict(msg.params).max_tokens
        except InvalidRequest as e:
            self._refuse(ident, "rejected_invalid", p.Fail(msg.job_id, "invalid", str(e)[:1000]))
            return
        why = self.catalog.refusal(msg.model, msg.input, max_tokens, self.workers.serving(msg.model),
                                   time.monotonic())
        if why is not None:
            self._refuse(ident, "rejected_unfit", p.Fail(msg.job_id, "invalid", why))
            return
        if self.queues.waiting(msg.model) >= self.cfg.queue_size:
            self._refuse(ident, "rejected_overloaded", p.Fail(msg.job_id, "overloaded",
                                                               f"queue for {msg.model!r} is full",
                                                               self._retry_after(msg.model)))
            return
        self._accept(ident, owner, msg, max_tokens)

    def _refuse(self, ident: bytes, counter: str | None, reply: p.Fail) -> None:
        """Send a FAIL that refuses a message or a job outright (counted as `counter`), within the client's
        REJECT budget (budget.py)."""
        if counter is not None:
            self.counters[counter] += 1
        if self._may_answer(ident, ReplyKind.REJECT):
            self.clients.send(ident, reply)

    def _on_duplicate(self, ident: bytes, owner: str, msg: p.Submit, job: Job) -> None:
        """Idempotent submit: the same owner re-sending a job id is re-subscribed, not re-run."""
        if job.owner != owner:
            self._refuse(ident, "rejected_conflict", p.Fail(msg.job_id, "conflict", "job id in use by another owner"))
            return
        self.counters["duplicate_submits"] += 1
        self.clients.send(ident, p.Ack(msg.job_id, True, self.instance))
        self._subscribe(job, ident, msg.from_seq)

    def _accept(self, ident: bytes, owner: str, msg: p.Submit, max_tokens: int) -> None:
        now = time.monotonic()
        timeout = msg.timeout if msg.timeout is not None else self.cfg.default_timeout
        job = Job(msg.job_id, owner, msg.model, msg.input, msg.params, max_tokens, msg.priority, ident,
                  msg.cancel_on_disconnect, now, now + timeout if timeout is not None else None,
                  prefix_hashes(msg.input.affinity_text(), self.cfg.affinity_chunk_chars,
                                self.cfg.affinity_max_chunks))
        self.jobs.add(job)
        self.counters["accepted"] += 1
        self.clients.subscribe(job, ident)
        self.clients.send(ident, p.Ack(job.job_id, False, self.instance))
        if job.deadline is not None:
            self.timers.set(job.deadline, Timer.DEADLINE, job)
        log.debug("job_accepted", job_id=job.job_id, model=job.model)
        self._enqueue(job, front=False)
        self._dispatch()

    def _retry_after(self, model: str) -> float:
        cap = self.workers.capacity(model) or 1
        return round(min(30.0, max(0.05, self.queues.waiting(model) * self.counters.job_seconds / cap)), 3)

    def _checked_job(self, ident: bytes, owner: str, job_id: str) -> Job | None:
        job = self.jobs.get(job_id)
        if job is None:
            self._refuse(ident, None, p.Fail(job_id, "unknown_job", "no such job (or expired)"))
            return None
        if not self.clients.may_access(job, owner):
            self._refuse(ident, "forbidden", p.Fail(job_id, "forbidden", "job belongs to another client"))
            return None
        return job

    def _on_cancel(self, ident: bytes, owner: str, msg: p.Cancel) -> None:
        job = self._checked_job(ident, owner, msg.job_id)
        if job is None:
            return
        self.clients.send(ident, p.Ack(job.job_id, True, self.instance))
        if not job.is_terminal:
            self.counters["cancels"] += 1
            self._finish(job, p.Fail(job.job_id, "cancelled", "cancelled by client"), cancel_worker=True)

    def _on_subscribe(self, ident: bytes, owner: str, msg: p.Subscribe) -> None:
        job = self._checked_job(ident, owner, msg.job_id)
        if job is None:
            return
        self.counters["subscribes"] += 1
        self.clients.send(ident, p.Ack(job.job_id, True, self.instance))
        self._subscribe(job, ident, msg.from_seq)

    def _subscribe(self, job: Job, ident: bytes, from_seq: int) -> None:
        self.clients.subscribe(job, ident, from_seq)
        self.fanout.flush([job])

    def _client_gone(self, cid: bytes, reason: str) -> None:
        """The client left (BYE, silence, unreachable): drop its subscriptions, cancel its jobs."""
        self.budget.forget(cid)
        for job_id in self.clients.leave(cid):
            job = self.jobs.get(job_id)
            if job is None:
                continue
            job.subscribers.pop(cid, None)
            if not job.is_terminal and job.client == cid and job.cancel_on_disconnect:
                self.counters["disconnect_cancels"] += 1
                self._finish(job, p.Fail(job_id, "cancelled", f"client gone ({reason})"), cancel_worker=True)

    # ---- workers ----------------------------------------------------------------------------------

    def on_worker_message(self, frames: list[Any]) -> None:
        """Handle one message from the backend socket (routing id + frames), between the observer's
        hooks (run() calls the handler itself when there is no observer)."""
        obs = self.observer
        if obs is None:
            self._on_worker_frames(frames)
            return
        obs.worker_message(frames)
        try:
            self._on_worker_frames(frames)
        finally:
            obs.worker_message_handled(frames)

    def _on_worker_frames(self, frames: list[Any]) -> None:
        ident = frames[0]
        if (len(frames) == 4 and frames[2] == p.W_TOKENS_FRAME and frames[1] == p.HEADER
                and (w := self.workers.sender(ident)) is not None):
            # The relay's hot path: a TOKENS body whose chunks all have the plain shape goes to the fan-out
            # as it came, without a message object per chunk. Any other body is decoded strictly below,
            # which says what is wrong, and relayed if it is valid.
            body = frames[3]
            try:
                attempts, entries, offset = p.split_tokens_body(body, self.cfg.max_body_bytes)
            except ProtocolError:
                attempts = None
            if attempts is not None and self.fanout.relay(w.ident, attempts, entries, body, offset):
                w.last_seen = time.monotonic()
                return
        try:
            msg = p.decode(frames[1:], p.WORKER_TO_BROKER, self.cfg.max_body_bytes)
        except ProtocolError as e:
            self.counters["malformed_worker_messages"] += 1
            log.warning("malformed_worker_message", error=str(e)[:200])
            return
        now = time.monotonic()
        if isinstance(msg, p.Ready):
            self._on_ready(ident, msg, now)
            return
        w = self.workers.sender(ident)
        if w is None:
            self._on_unknown_worker(ident, msg, now)
            return
        w.last_seen = now
        if isinstance(msg, p.Tokens):
            self.fanout.relay(w.ident, list(map(_attempt, msg.chunks)), list(map(_entry, msg.chunks)))
        elif isinstance(msg, p.Finished):
            for f in msg.jobs:
                if (job := self._current(w, f.job_id, f.attempt)) is not None:
                    queue_time = job.dispatched_at - job.created if job.dispatched_at is not None else None
                    self._finish(job, p.Done(f.job_id, f.finish_reason, f.stop_reason, f.usage, job.num_tokens,
                                             queue_time, f.timeline))
        elif isinstance(msg, p.JobError):
            if (job := self._current(w, msg.job_id, msg.attempt)) is not None:
                self._finish(job, p.Fail(job.job_id, msg.code, msg.message))
        elif isinstance(msg, p.WorkerHeartbeat):
            w.load = msg
        elif isinstance(msg, p.WorkerDisconnect):
            self._worker_dead(w, "disconnected")
        elif isinstance(msg, p.Prefilled):
            self._on_prefilled(w, msg)

    def _current(self, w: WorkerInfo, job_id: str, attempt: int) -> Job | None:
        """The job if `w` runs its current attempt `attempt`; else None (stale output: dropped)."""
        job = self.jobs.current(w.ident, job_id, attempt)
        if job is None:
            self.counters["stale_messages_dropped"] += 1
        return job

    def _on_ready(self, ident: bytes, msg: p.Ready, now: float) -> None:
        if self.workers.conflicts(ident, msg):
            self.counters["malformed_worker_messages"] += 1
            log.warning("bad_ready", reason="routing id already in use", data_id=msg.data_id[:64])
            return
        for old in self.workers.replaced_by(ident, msg):
            self._worker_dead(old, "re-registered")
        w = self.workers.register(ident, msg, now)
        self.catalog.note_ready(w, now)
        self.counters["workers_registered"] += 1
        log.info("worker_ready", worker=w.name, models=sorted(w.models), capacity=w.capacity,
                 kv_blocks=w.kv_blocks, block_size=w.block_size, max_model_len=w.max_model_len)
        self._send_worker(w, p.BrokerHeartbeat())
        self._need_dispatch = True

    def _on_unknown_worker(self, ident: bytes, msg: p.Message, now: float) -> None:
        """A worker we declared dead (or from before a restart): drop its output, ask it to re-register
        (rate-limited, see WorkerTable.should_ask_reregister)."""
        self.counters["stale_worker_messages"] += 1
        if isinstance(msg, p.Tokens):
            self.counters["stale_tokens_dropped"] += sum(len(c.token_ids) for c in msg.chunks)
        if isinstance(msg, p.WorkerDisconnect) or not self.workers.should_ask_reregister(ident, now):
            return
        assert self.backend is not None
        with contextlib.suppress(zmq.ZMQError):
            self.backend.send_multipart([ident, *p.encode(p.BrokerDisconnect("reregister"))], zmq.NOBLOCK)

    def _send_worker(self, w: WorkerInfo, msg: p.Message, on_fail_dead: bool = True) -> bool:
        assert self.backend is not None
        try:
            self.backend.send_multipart([w.ident, *p.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # Again (its queue is full: it stopped reading) or EHOSTUNREACH
            if on_fail_dead:
                self._worker_dead(w, f"send failed: {e}")
            return False

    def _worker_dead(self, w: WorkerInfo, reason: str) -> None:
        """Forget the worker and migrate each of its unfinished jobs (or fail it at the limit)."""
        if not self.workers.remove(w):
            return  # already handled
        self.counters["workers_lost"] += 1
        log.warning("worker_dead", worker=w.name, reason=reason, jobs=len(w.jobs))
        ids, w.jobs = sorted(w.jobs), set()
        jobs = [j for i in ids if (j := self.jobs.get(i)) is not None and not j.is_terminal and j.worker == w.ident]
        blamed = charged(jobs)
        for job in jobs:
            self._migrate(job, job.job_id in blamed)
        self._prefill_lost(w)
        self._need_dispatch = True

    # ---- a job's life: queue, dispatch, migrate, finish ---------------------------------------------

    def _migrate(self, job: Job, blamed: bool) -> None:
        """Queue `job` again after its worker died (`blamed`: the death is charged to it, blame.py), or
        fail it at the migration bounds."""
        self._drop_prefill(job)
        job.worker = None
        job.failures += blamed
        self.counters["migrations_uncharged"] += not blamed
        why = migration_refusal(job, self.cfg.migration_limit)
        if why is not None:
            self.counters["migration_limit_failures"] += 1
            self._finish(job, p.Fail(job.job_id, "failed", why))
        elif job.num_tokens >= job.max_tokens:  # everything was delivered; only FINISHED was lost
            self._finish(job, p.Done(job.job_id, "length", None, (0, job.num_tokens, 0), job.num_tokens))
        else:
            job.attempt += 1
            self.counters["migrations"] += 1
            log.info("job_migrated", job_id=job.job_id, attempt=job.attempt, delivered=job.num_tokens)
            self._enqueue(job, front=True)

    def _enqueue(self, job: Job, front: bool) -> None:
        now = time.monotonic()
        self.queues.push(job, now, front)
        self.timers.set(now + self.cfg.queue_timeout, Timer.QUEUE, job)

    def _dispatch(self) -> None:
        """Start queued jobs (FIFO per model; migrated ones first) where the dispatcher puts them."""
        self._need_dispatch = False
        self.queues.dispatch(self._pick, self._start)

    def _pick(self, job: Job) -> Placement | None:
        """The dispatcher's placement among the workers that serve the job's model and that it fits; a job
        that fits none of them (those it fitted are gone) fails here, invalid (the rest of its queue: next
        turn)."""
        serving = self.workers.serving(job.model)
        placed = self.dispatcher.place(job, [w for w in serving if fits(w, job.input, job.max_tokens)])
        if placed is None and (why := fit_refusal(serving, job.input, job.max_tokens)) is not None:
            self.counters["rejected_unfit"] += 1
            self._finish(job, p.Fail(job.job_id, "invalid", why))
            self._need_dispatch = True
        return placed

    def _start(self, job: Job, placed: Placement) -> None:
        w = placed.worker
        job.state = JobState.RUNNING
        job.worker = w.ident
        job.dispatched_tokens = job.num_tokens
        if job.dispatched_at is None:
            job.dispatched_at = time.monotonic()
        w.assign(job.job_id)
        self.counters["dispatches"] += 1
        log.debug("job_dispatched", job_id=job.job_id, attempt=job.attempt, worker=w.name)
        if placed.prefill is not None:
            self._start_disaggregated(job, w, placed.prefill)
            return
        self._send_worker(w, p.WorkerSubmit(job.job_id, job.attempt, job.input, job.params, job.tokens,
                                            job.priority))

    # ---- disaggregated prefill and decode (worker/kv_transfer/) -----------------------------------------
    # The decode worker runs the job (job.worker: its tokens, FINISHED, migration as for any job) and first
    # waits for the KV blocks the prefill worker (job.prefill) computes and sends it directly. Whatever goes
    # wrong on the prefill side ends in KV_LOST to the decode worker, which then computes the prompt itself.

    def _start_disaggregated(self, job: Job, w: WorkerInfo, pw: WorkerInfo) -> None:
        """Send the started job to its decode worker `w` (to wait for its KV) and its prefill worker `pw`."""
        job.prefill = pw.ident
        pw.prefills.add(job.job_id)
        self.counters["disaggregated_dispatches"] += 1
        tokens = job.tokens
        # The decode worker hears first, so it waits for the KV before any can come; a failed send to the
        # prefill worker declares it dead, which sends KV_LOST.
        if self._send_worker(w, p.WorkerSubmit(job.job_id, job.attempt, job.input, job.params, tokens,
                                               job.priority, kv_wait=True)):
            self._send_worker(pw, p.WorkerSubmit(job.job_id, job.attempt, job.input, job.params, tokens,
                                                 job.priority, kv_send=w.kv_address))

    def _on_prefilled(self, pw: WorkerInfo, msg: p.Prefilled) -> None:
        """A prefill is over (its slot is free); without blocks, the decode worker computes the prompt."""
        pw.prefills.discard(msg.job_id)
        self._need_dispatch = True
        self.counters["prefills" if msg.blocks else "prefills_without_kv"] += 1
        job = self.jobs.get(msg.job_id)
        if (not msg.blocks and job is not None and job.prefill == pw.ident and job.attempt == msg.attempt
                and not job.is_terminal):
            self._kv_lost(job)

    def _prefill_lost(self, pw: WorkerInfo) -> None:
        """A prefill worker is gone: the decode workers of the jobs it prefilled compute their prompts (a
        decode worker that already has the KV ignores KV_LOST; ZeroMQ delivers a KV message whole or not at
        all, so one cut off by the death never arrives)."""
        pw.prefills.clear()
        for job in self.jobs.unfinished():
            if job.prefill == pw.ident and job.state is JobState.RUNNING:
                self._kv_lost(job)

    def _kv_lost(self, job: Job) -> None:
        job.prefill = None
        if job.worker is not None and (w := self.workers.get(job.worker)) is not None:
            self.counters["kv_lost"] += 1
            self._send_worker(w, p.KvLost(job.job_id, job.attempt))

    def _drop_prefill(self, job: Job) -> None:
        """The job's attempt ends: its prefill, if one still runs, is cancelled."""
        pw = self.workers.get(job.prefill) if job.prefill is not None else None
        if pw is not None and job.job_id in pw.prefills:
            pw.prefills.discard(job.job_id)
            self._send_worker(pw, p.WorkerCancel(job.job_id, job.attempt), on_fail_dead=False)
            self._need_dispatch = True
        job.prefill = None

    def _finish(self, job: Job, terminal: p.Done | p.Fail, cancel_worker: bool = False) -> None:
        """Make `terminal` the job's one terminal reply; release its queue slot or worker slot."""
        if job.state is JobState.QUEUED:
            self.queues.remove(job)
        elif job.worker is not None and (w := self.workers.get(job.worker)) is not None:
            w.jobs.discard(job.job_id)
            if cancel_worker:
                self._send_worker(w, p.WorkerCancel(job.job_id, job.attempt), on_fail_dead=False)
            self._need_dispatch = True
        self._drop_prefill(job)
        now = time.monotonic()
        if isinstance(terminal, p.Done):
            log.debug("job_finished", job_id=job.job_id, finish_reason=terminal.finish_reason, tokens=job.num_tokens)
        else:
            log.info("job_failed", job_id=job.job_id, code=terminal.code, error=terminal.message[:200])
        self.jobs.finish(job, terminal, now)
        self.counters.count_terminal(terminal, now - job.created)
        self.fanout.flush([job])

    # ---- introspection ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, queue depths and per-worker load (what a STATS request returns)."""
        now = time.monotonic()
        return {
            "counters": self.counters.snapshot(),
            "queues": self.queues.depths(),
            "workers": [w.describe(now) for w in self.workers],
            "active_jobs": self.jobs.active,
            "retained_jobs": len(self.jobs),
            "clients": len(self.clients),
            "draining": self._draining,
            **self.dispatcher.stats(),
            "instance": self.instance,
            "reply_buckets": len(self.budget),
            "unknown_model_grace_left": round(self.catalog.grace_left(now), 3),
            "zap": ({"accepted": self.zap.accepted, "refused": self.zap.refused, "refused_role": self.zap.refused_role}
                    if self.zap else None),
            **(self.observer.stats() if self.observer is not None else {}),
        }
