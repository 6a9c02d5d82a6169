"""The tokenmill broker: one thread, one ZeroMQ context, a Majordomo-style loop.

    clients --DEALER--> [ROUTER frontend]  broker  [ROUTER backend] <--DEALER-- workers

Each loop turn: poll both sockets (timeout = the next timer, at most a fraction of the shortest
heartbeat interval; 0 within `busy_poll` of the last message) -> handle a bounded batch of messages
from each, workers first (a TOKENS batch for one caught-up client is checked and forwarded as it came,
see _relay_batch) -> timers: job deadlines and queue timeouts, worker liveness (declared dead after
`liveness` silent intervals) and broker heartbeats, client liveness, retention of finished jobs, resend
to lagging subscribers -> dispatch queued jobs.

Subscriptions are served over the frontend ROUTER rather than a PUB socket: each subscriber gets the
job's token log replayed from the sequence number it asks for (gap-free, per subscriber), ownership is
checked per subscription, and a slow subscriber is detected (ROUTER_MANDATORY + non-blocking send
reports its full queue) and resumed from its cursor instead of silently losing messages as PUB would.

Nothing a peer sends can stop the loop: every message is decoded strictly (ProtocolError -> dropped and
counted, a FAIL "protocol" answer to clients), sends never block, and a send that fails marks the peer
gone (workers: their jobs migrate; clients: their jobs are cancelled).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import os
import secrets
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import structlog
import zmq

from tokenmill.broker.admission import ModelCatalog, fit_refusal, fits
from tokenmill.broker.blame import charged, migration_refusal
from tokenmill.broker.budget import Budget, BudgetConfig, ReplyKind
from tokenmill.broker.jobs import Job, JobState
from tokenmill.broker.memory import trim_heap
from tokenmill.broker.registry import PrefixIndex, WorkerInfo, pick_worker
from tokenmill.broker.security import ZapAuthenticator, load_zap_allow_list, make_curve_server
from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError
from tokenmill.protocol.keys import load_keypair
from tokenmill.protocol.wire import plain_entry

log = structlog.get_logger("tokenmill.broker")

_STREAM_HEAD = [p.HEADER, bytes((p.Cmd.STREAM,))]
_array_header = msgpack.Packer(use_bin_type=True).pack_array_header
_SENT, _BLOCKED, _GONE = "sent", "blocked", "gone"  # outcomes of Broker._send_raw


def _plain_chunks(attempts: Any, entries: Any) -> list[tuple[Any, ...]] | None:
    """The chunks [job_id, attempt, seq, token_ids, text, logprobs] of an unpacked TOKENS body
    [attempts, entries] if every one has the common plain shape (p.plain_entry, a valid attempt), i.e.
    exactly when p.decode would accept the message with no logprobs; else None (the caller then decodes
    strictly, which says what is wrong). Builds no message objects per chunk."""
    if type(attempts) is not list or type(entries) is not list or len(attempts) != len(entries):
        return None
    max_attempt = p.MAX_ATTEMPT
    out = []
    for attempt, e in zip(attempts, entries):
        if not (type(e) is list and len(e) == 5 and type(attempt) is int and 0 <= attempt <= max_attempt
                and p.plain_entry(*e)):
            return None
        out.append((e[0], attempt, e[1], e[2], e[3], None))
    return out


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
    gc_tuning: bool = True  # freeze the start-up heap; full collections at idle moments (see _collect)
    # After a message, keep polling without sleeping for this many seconds (0: off). Saves the wake-up
    # of an idle core per message, at the price of a core at 100% while messages keep coming: only for
    # a broker that owns its core.
    busy_poll: float = 0.0
    # A job for a model no worker has announced is refused at once, except in this many seconds after
    # the first worker registered (the others may still be coming).
    unknown_model_grace: float = 5.0
    reply_budget: BudgetConfig = field(default_factory=BudgetConfig)  # per-client bounds (broker/budget.py)
    trim_interval: float = 1.0  # at idle moments, hand freed heap back at most this often (broker/memory.py)

    def __post_init__(self) -> None:
        if not 0.0 <= self.busy_poll <= 1.0:
            raise ValueError(f"busy_poll must be between 0 and 1 s, got {self.busy_poll}")
        if self.unknown_model_grace < 0 or self.trim_interval <= 0:
            raise ValueError("unknown_model_grace must be >= 0 and trim_interval > 0 (seconds)")


class Broker:
    """The broker. `bind()` then `run()` (blocks until drained or `stop()`); or `serve_forever()`."""

    def __init__(self, config: BrokerConfig | None = None, ctx: zmq.Context | None = None) -> None:
        self.cfg = config or BrokerConfig()
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.counters: Counter[str] = Counter()
        self.jobs: dict[str, Job] = {}
        self.workers: dict[bytes, WorkerInfo] = {}  # control (READY-sending) routing id -> worker
        self.data_sockets: dict[bytes, WorkerInfo] = {}  # a worker's data socket routing id (Ready.data_id) -> it
        self.queues: dict[str, deque[Job]] = defaultdict(deque)
        self.queued: Counter[str] = Counter()  # live QUEUED jobs per model (deques hold lazily-removed ones)
        self.clients: dict[bytes, float] = {}  # routing id -> last time heard
        self.client_jobs: dict[bytes, set[str]] = defaultdict(set)  # jobs submitted or subscribed to
        self.prefix = PrefixIndex(self.cfg.affinity_chunk_chars, self.cfg.affinity_max_chunks)
        self._timers: list[tuple[float, int, str, str, int]] = []  # (when, n, kind, job_id, attempt)
        self._timer_seq = itertools.count()
        self._retired: deque[tuple[float, str]] = deque()
        self._lagging: set[str] = set()
        self._reregister_sent: dict[bytes, float] = {}
        self._next_client_check = 0.0
        self._gc_threshold: tuple[int, int, int] | None = None  # automatic GC's thresholds before run()
        self._gc_due_since: float | None = None
        self._active = 0  # jobs not yet terminal
        self._need_dispatch = False
        self._job_seconds = 1.0  # EWMA of job durations, for retry-after hints
        self._draining = False
        self._drain_deadline: float | None = None
        self._stop = False
        self._curve = self.cfg.curve_secret_file is not None
        self.instance = secrets.token_hex(8)  # new at every start: in PONG, ACK and STATS (clients see restarts)
        self.budget = Budget(self.cfg.reply_budget)
        self.catalog = ModelCatalog(self.cfg.unknown_model_grace)
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
        assert self.frontend is not None and self.backend is not None, "call bind() first"
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        if self.cfg.gc_tuning:
            self._tune_gc()
        spin, spin_until = self.cfg.busy_poll, 0.0
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
                    self._drain_socket(self.backend, self._on_worker_frames)
                if self.frontend in events:
                    self._drain_socket(self.frontend, self._on_client_frames)
                now = time.monotonic()
                if events and spin:
                    spin_until = now + spin
                self._tick(now)
                if self._gc_threshold is not None and gc.get_count()[2] >= max(1, self._gc_threshold[2]):
                    self._collect(now)
        finally:
            if self._gc_threshold is not None:
                gc.set_threshold(*self._gc_threshold)
                self._gc_threshold = None
            self._shutdown()

    # ---- garbage collection -----------------------------------------------------------------------
    #
    # CPython's cyclic GC stops the loop for as long as a collection takes, at whatever allocation
    # happens to trigger it: a full (generation 2) collection walks every tracked object, i.e. pauses in
    # proportion to the heap. Three measures keep those pauses off the relay path (the broker makes
    # almost no reference cycles; refcounting frees nearly everything at once):
    # - token logs hold no Python objects per chunk (jobs.py), so the heap is a few objects per job;
    # - what exists after start-up (modules, ~30k objects) is frozen: never walked again;
    # - young collections (cheap: few survivors) stay automatic, but full ones are taken over: they run
    #   after a loop turn when they are due (as many young collections as CPython waits for) and both
    #   sockets are empty, i.e. between bursts, or at the latest `_GC_MAX_DEFER` s after becoming due.

    _GC_MAX_DEFER = 1.0

    def _tune_gc(self) -> None:
        gc.collect()
        gc.freeze()
        threshold = gc.get_threshold()
        if gc.isenabled() and threshold[0] > 0:  # (the embedding process did not turn automatic GC off)
            self._gc_threshold = threshold
            gc.set_threshold(threshold[0], threshold[1], 1 << 30)  # no automatic full collection; see run()

    def _collect(self, now: float) -> None:
        """Run the due full collection if nothing is waiting on either socket (or it waited too long)."""
        assert self.frontend is not None and self.backend is not None
        if self._gc_due_since is None:
            self._gc_due_since = now
        busy = (int(self.frontend.get(zmq.EVENTS)) | int(self.backend.get(zmq.EVENTS))) & zmq.POLLIN
        if busy and now - self._gc_due_since < self._GC_MAX_DEFER:
            return
        gc.collect(2)
        self._gc_due_since = None
        self.counters["gc_full_collections" if not busy else "gc_full_collections_busy"] += 1

    def _shutdown(self) -> None:
        for w in list(self.workers.values()):
            self._send_worker(w, p.BrokerDisconnect("shutdown"), on_fail_dead=False)
        for s in (self.frontend, self.backend):
            if s is not None:
                s.close(linger=1000)  # let final replies reach their peers
        if self.zap is not None:
            self.zap.stop()
        if self._own_ctx:
            self.ctx.term()
        log.info("broker_stopped", **self._summary())

    def _poll_timeout_ms(self) -> int:
        tick = min([0.1, *(w.interval / 5 for w in self.workers.values())])
        if self._timers:
            tick = min(tick, max(0.0, self._timers[0][0] - time.monotonic()))
        if self._lagging:
            tick = min(tick, 0.005)
        return max(1, int(tick * 1000))

    def _drain_socket(self, sock: zmq.Socket, handle: Any) -> None:
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

    def _tick(self, now: float) -> None:
        self._run_timers(now)
        self._check_workers(now)
        if now >= self._next_client_check:  # O(clients): a few times a second, not every loop turn
            self._next_client_check = now + min(0.1, self.cfg.client_timeout / 10)
            self._check_clients(now)
        if now >= self._next_trim:
            self._next_trim = now + self.cfg.trim_interval
            self._idle_upkeep(now)
        self._gc_retired(now)
        if self._lagging:
            lagging, self._lagging = self._lagging, set()
            self._flush([self.jobs[j] for j in lagging if j in self.jobs])
        if self._need_dispatch:
            self._dispatch()
        if self._draining:
            self._check_drain(now)

    def _push_timer(self, when: float, kind: str, job: Job) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_seq), kind, job.job_id, job.attempt))

    def _run_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, kind, job_id, attempt = heapq.heappop(self._timers)
            job = self.jobs.get(job_id)
            if job is None or job.is_terminal:
                continue
            if kind == "deadline":
                self.counters["deadline_expired"] += 1
                self._finish(job, p.Fail(job_id, "deadline", "deadline exceeded"), cancel_worker=True)
            elif job.state is JobState.QUEUED and job.attempt == attempt:
                self.counters["queue_timeouts"] += 1
                self._finish(job, p.Fail(job_id, "deadline", f"queued {self.cfg.queue_timeout}s without a worker"))

    def _check_workers(self, now: float) -> None:
        for w in list(self.workers.values()):
            if now - w.last_seen > w.interval * self.cfg.liveness:
                self._worker_dead(w, "heartbeat timeout")
            elif now >= w.next_heartbeat:
                w.next_heartbeat = now + w.interval
                self._send_worker(w, p.BrokerHeartbeat())

    def _idle_upkeep(self, now: float) -> None:
        """Forget refilled reply buckets; at an idle moment, hand freed heap back to the system."""
        self.budget.prune(now)
        if not any(int(s.get(zmq.EVENTS)) & zmq.POLLIN for s in (self.frontend, self.backend) if s is not None):
            trim_heap()

    def _check_clients(self, now: float) -> None:
        for cid, seen in list(self.clients.items()):
            if now - seen > self.cfg.client_timeout:
                self._client_gone(cid, "timeout")

    def _gc_retired(self, now: float) -> None:
        horizon = now - self.cfg.retention
        while self._retired and (self._retired[0][0] < horizon or len(self._retired) > self.cfg.max_retained):
            _, job_id = self._retired.popleft()
            job = self.jobs.pop(job_id, None)
            if job is not None:
                for cid in job.subscribers:
                    self.client_jobs.get(cid, set()).discard(job_id)

    def _check_drain(self, now: float) -> None:
        if self._drain_deadline is None:
            self._drain_deadline = now + self.cfg.drain_timeout
            log.info("drain_started", active_jobs=self._active, timeout=self.cfg.drain_timeout)
        if self._active and now < self._drain_deadline:
            return
        for job in [j for j in self.jobs.values() if not j.is_terminal]:
            self._finish(job, p.Fail(job.job_id, "unavailable", "broker shut down"), cancel_worker=True)
        self._stop = True

    # ---- clients ----------------------------------------------------------------------------------

    def _on_client_frames(self, frames: list[Any]) -> None:
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
            self._reject(ident, p.Fail(job_id, "protocol", str(e)[:300]))
            return
        self.clients[ident] = time.monotonic()
        owner = owner_key if owner_key is not None else getattr(msg, "owner", "")
        if isinstance(msg, p.Submit):
            self._on_submit(ident, owner, msg)
        elif isinstance(msg, p.Cancel):
            self._on_cancel(ident, owner, msg)
        elif isinstance(msg, p.Subscribe):
            self._on_subscribe(ident, owner, msg)
        elif isinstance(msg, p.Ping):
            if self._may_answer(ident, ReplyKind.CONTROL):
                self._send_client(ident, p.Pong(self.instance))
        elif isinstance(msg, p.Bye):
            self._client_gone(ident, "bye")
        elif isinstance(msg, p.StatsRequest):
            self.counters["stats_requests"] += 1
            if self._may_answer(ident, ReplyKind.CONTROL):  # (before building the reply: that is the cost)
                self._send_client(ident, p.StatsReply(self.stats()))

    def _may_answer(self, ident: bytes, kind: ReplyKind) -> bool:
        """Whether `ident`'s budget for replies of `kind` has room (broker/budget.py); counts the drops."""
        if self.budget.allow(ident, kind, time.monotonic()):
            return True
        self.counters[f"replies_dropped_{kind.value}"] += 1
        return False

    def _reject(self, ident: bytes, fail: p.Fail) -> None:
        """Send a FAIL that refuses a message or a job outright, within the client's REJECT budget."""
        if self._may_answer(ident, ReplyKind.REJECT):
            self._send_client(ident, fail)

    def _on_submit(self, ident: bytes, owner: str, msg: p.Submit) -> None:
        self.counters["submits"] += 1
        if self._draining:
            self.counters["rejected_draining"] += 1
            self._reject(ident, p.Fail(msg.job_id, "unavailable", "broker is draining"))
            return
        existing = self.jobs.get(msg.job_id)
        if existing is not None:
            self._on_duplicate(ident, owner, msg, existing)
            return
        try:
            max_tokens = SamplingParams.from_dict(msg.params).max_tokens
        except InvalidRequest as e:
            self.counters["rejected_invalid"] += 1
            self._reject(ident, p.Fail(msg.job_id, "invalid", str(e)[:1000]))
            return
        serving = [w for w in self.workers.values() if w.serves(msg.model)]
        why = self.catalog.refusal(msg.model, msg.input, max_tokens, serving, time.monotonic())
        if why is not None:
            self.counters["rejected_unfit"] += 1
            self._reject(ident, p.Fail(msg.job_id, "invalid", why))
            return
        if self.queued[msg.model] >= self.cfg.queue_size:
            self.counters["rejected_overloaded"] += 1
            self._reject(ident, p.Fail(msg.job_id, "overloaded", f"queue for {msg.model!r} is full",
                                       self._retry_after(msg.model)))
            return
        self._accept(ident, owner, msg, max_tokens)

    def _on_duplicate(self, ident: bytes, owner: str, msg: p.Submit, job: Job) -> None:
        """Idempotent submit: the same owner re-sending a job id is re-subscribed, not re-run."""
        if job.owner != owner:
            self.counters["rejected_conflict"] += 1
            self._reject(ident, p.Fail(msg.job_id, "conflict", "job id in use by another owner"))
            return
        self.counters["duplicate_submits"] += 1
        self._send_client(ident, p.Ack(msg.job_id, True, self.instance))
        self._subscribe(job, ident, msg.from_seq)

    def _accept(self, ident: bytes, owner: str, msg: p.Submit, max_tokens: int) -> None:
        now = time.monotonic()
        timeout = msg.timeout if msg.timeout is not None else self.cfg.default_timeout
        job = Job(msg.job_id, owner, msg.model, msg.input, msg.params, max_tokens, msg.priority, ident,
                  msg.cancel_on_disconnect, now, now + timeout if timeout is not None else None,
                  self.prefix.hashes(msg.input.affinity_text()))
        self.jobs[job.job_id] = job
        self._active += 1
        self.counters["accepted"] += 1
        job.subscribers[ident] = 0
        self.client_jobs[ident].add(job.job_id)
        self._send_client(ident, p.Ack(job.job_id, False, self.instance))
        if job.deadline is not None:
            self._push_timer(job.deadline, "deadline", job)
        self._enqueue(job, front=False)
        self._dispatch()

    def _retry_after(self, model: str) -> float:
        cap = sum(w.capacity for w in self.workers.values() if w.serves(model)) or 1
        return round(min(30.0, max(0.05, self.queued[model] * self._job_seconds / cap)), 3)

    def _may_access(self, job: Job, owner: str) -> bool:
        return self.cfg.open_jobs or job.owner == owner

    def _checked_job(self, ident: bytes, owner: str, job_id: str) -> Job | None:
        job = self.jobs.get(job_id)
        if job is None:
            self._reject(ident, p.Fail(job_id, "unknown_job", "no such job (or expired)"))
            return None
        if not self._may_access(job, owner):
            self.counters["forbidden"] += 1
            self._reject(ident, p.Fail(job_id, "forbidden", "job belongs to another client"))
            return None
        return job

    def _on_cancel(self, ident: bytes, owner: str, msg: p.Cancel) -> None:
        job = self._checked_job(ident, owner, msg.job_id)
        if job is None:
            return
        self._send_client(ident, p.Ack(job.job_id, True, self.instance))
        if not job.is_terminal:
            self.counters["cancels"] += 1
            self._finish(job, p.Fail(job.job_id, "cancelled", "cancelled by client"), cancel_worker=True)

    def _on_subscribe(self, ident: bytes, owner: str, msg: p.Subscribe) -> None:
        job = self._checked_job(ident, owner, msg.job_id)
        if job is None:
            return
        self.counters["subscribes"] += 1
        self._send_client(ident, p.Ack(job.job_id, True, self.instance))
        self._subscribe(job, ident, msg.from_seq)

    def _subscribe(self, job: Job, ident: bytes, from_seq: int) -> None:
        job.subscribers[ident] = job.chunk_index(from_seq)
        self.client_jobs[ident].add(job.job_id)
        self._flush([job])

    def _client_gone(self, cid: bytes, reason: str) -> None:
        """The client left (BYE, silence, unreachable): drop its subscriptions, cancel its jobs."""
        self.clients.pop(cid, None)
        self.budget.forget(cid)
        for job_id in sorted(self.client_jobs.pop(cid, set())):
            job = self.jobs.get(job_id)
            if job is None:
                continue
            job.subscribers.pop(cid, None)
            if not job.is_terminal and job.client == cid and job.cancel_on_disconnect:
                self.counters["disconnect_cancels"] += 1
                self._finish(job, p.Fail(job_id, "cancelled", f"client gone ({reason})"), cancel_worker=True)

    def _send_client(self, cid: bytes, msg: p.Message) -> bool:
        return self._send_client_frames(cid, p.encode(msg))

    def _send_client_frames(self, cid: bytes, frames: list[Any]) -> bool:
        """Non-blocking send; False when the client's queue is full (caller retries) or it is gone
        (then its jobs are cancelled before this returns)."""
        status = self._send_raw(cid, frames)
        if status == _GONE:
            self._client_gone(cid, "unreachable")
        return status == _SENT

    def _send_raw(self, cid: bytes, frames: list[Any]) -> str:
        """Non-blocking send with no side effect on jobs: _SENT, _BLOCKED (queue full) or _GONE."""
        assert self.frontend is not None
        try:
            self.frontend.send_multipart([cid, *frames], zmq.NOBLOCK)
            return _SENT
        except zmq.Again:
            self.counters["client_send_blocked"] += 1
            return _BLOCKED
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return _GONE

    def _flush(self, jobs: Iterable[Job]) -> None:
        """Send every subscriber of `jobs` the chunks it lacks (one STREAM per client), then the
        terminal reply to those who have all chunks. Unsent data stays behind the cursors. A STREAM
        body is an array header plus the jobs' already-encoded log entries: nothing is re-encoded."""
        jobs = list(dict.fromkeys(jobs))  # a job touched twice is flushed once
        behind: dict[bytes, list[Job]] = {}  # client -> jobs it lacks chunks of
        for job in jobs:
            n = len(job.ends)
            for cid, cursor in job.subscribers.items():
                if cursor < n:
                    if (js := behind.get(cid)) is None:
                        behind[cid] = [job]
                    else:
                        js.append(job)
        for cid, js in behind.items():
            # Cursors are read here, not above: a send that failed for an earlier client can have
            # flushed some of these jobs already (its jobs cancelled -> terminal -> _flush).
            parts: list[bytes | bytearray] = [b""]
            sent: list[Job] = []
            count = tokens = 0
            for job in js:
                cursor = job.subscribers.get(cid)
                n = len(job.ends)
                if cursor is None or cursor >= n:
                    continue
                parts.append(job.entries(cursor))
                count += n - cursor
                tokens += job.tokens_from(cursor)
                sent.append(job)
            if not sent:
                continue
            parts[0] = _array_header(count)
            if self._send_client_frames(cid, [*_STREAM_HEAD, b"".join(parts)]):
                self.counters["tokens_out"] += tokens
                for job in sent:
                    if cid in job.subscribers:
                        job.subscribers[cid] = len(job.ends)
            else:
                self._lagging.update(j.job_id for j in sent)
        for job in jobs:
            if job.terminal is None:
                continue
            for cid, cursor in list(job.subscribers.items()):
                if cursor < len(job.ends):
                    continue
                if self._send_client(cid, job.terminal):
                    job.subscribers.pop(cid, None)
                    self.client_jobs.get(cid, set()).discard(job.job_id)
                elif cid in job.subscribers:
                    self._lagging.add(job.job_id)

    # ---- workers ----------------------------------------------------------------------------------

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        ident = frames[0]
        if (len(frames) == 4 and frames[2] == p.W_TOKENS_FRAME and frames[1] == p.HEADER
                and (w := self._worker_of(ident)) is not None):
            # The relay hot path: a plain TOKENS batch from a registered worker is checked and relayed
            # without building a message object per chunk; one whose chunks all go to one caught-up
            # subscriber is forwarded as it came (_relay_batch). Anything else takes the strict decode.
            body = frames[3]
            try:
                attempts, entries, offset = p.split_tokens_body(body, self.cfg.max_body_bytes)
            except ProtocolError:
                attempts = entries = None
            if attempts is not None:
                if self._relay_batch(w, attempts, entries, body, offset):
                    return
                chunks = _plain_chunks(attempts, entries)
                if chunks is not None:
                    w.last_seen = time.monotonic()
                    self._on_tokens(w, chunks)
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
        w = self._worker_of(ident)
        if w is None:
            self._on_unknown_worker(ident, msg, now)
            return
        w.last_seen = now
        if isinstance(msg, p.Tokens):
            self._on_tokens(w, msg.chunks)
        elif isinstance(msg, p.Finished):
            self._on_finished(w, msg)
        elif isinstance(msg, p.JobError):
            self._on_job_error(w, msg)
        elif isinstance(msg, p.WorkerHeartbeat):
            w.load = msg
        elif isinstance(msg, p.WorkerDisconnect):
            self._worker_dead(w, "disconnected")

    def _worker_of(self, ident: bytes) -> WorkerInfo | None:
        """The registered worker whose control or data socket has routing id `ident`."""
        return self.workers.get(ident) or self.data_sockets.get(ident)

    def _on_ready(self, ident: bytes, msg: p.Ready, now: float) -> None:
        data_ident = msg.data_id.encode()
        if ident in self.data_sockets or data_ident == ident or data_ident in self.workers:
            self.counters["malformed_worker_messages"] += 1
            log.warning("bad_ready", reason="routing id already in use", data_id=msg.data_id[:64])
            return
        for old in {self.workers.get(ident), self.data_sockets.get(data_ident)}:
            if old is not None:  # the worker reset itself: whatever it ran is gone
                self._worker_dead(old, "re-registered")
        w = WorkerInfo.from_ready(ident, msg, now)
        self.workers[ident] = w
        self.catalog.note_ready(w, now)
        if data_ident:
            self.data_sockets[data_ident] = w
        self._reregister_sent.pop(ident, None)
        self.counters["workers_registered"] += 1
        log.info("worker_ready", worker=w.name, models=sorted(w.models), capacity=w.capacity,
                 kv_blocks=w.kv_blocks, block_size=w.block_size, max_model_len=w.max_model_len)
        w.next_heartbeat = now + w.interval
        self._send_worker(w, p.BrokerHeartbeat())
        self._need_dispatch = True

    def _on_unknown_worker(self, ident: bytes, msg: p.Message, now: float) -> None:
        """A worker we declared dead (or from before a restart): drop its output, ask it to re-register
        (at most once per second per worker, so a stream of stale output is not answered in kind)."""
        self.counters["stale_worker_messages"] += 1
        if isinstance(msg, p.Tokens):
            self.counters["stale_tokens_dropped"] += sum(len(c.token_ids) for c in msg.chunks)
        if isinstance(msg, p.WorkerDisconnect) or now - self._reregister_sent.get(ident, -1e9) < 1.0:
            return
        self._reregister_sent[ident] = now
        if len(self._reregister_sent) > 10_000:
            self._reregister_sent.clear()
        assert self.backend is not None
        with contextlib.suppress(zmq.ZMQError):
            self.backend.send_multipart([ident, *p.encode(p.BrokerDisconnect("reregister"))], zmq.NOBLOCK)

    def _current(self, w: WorkerInfo, job_id: str, attempt: int) -> Job | None:
        """The job if `w` runs its current attempt `attempt`; else None (stale output: dropped)."""
        job = self.jobs.get(job_id)
        if job is None or job.state is not JobState.RUNNING or job.worker != w.ident or job.attempt != attempt:
            self.counters["stale_messages_dropped"] += 1
            return None
        return job

    def _on_tokens(self, w: WorkerInfo, chunks: Iterable[Sequence[Any]]) -> None:
        """Append each chunk ([job_id, attempt, seq, token_ids, text, logprobs], validated) of a TOKENS
        batch to its job's log and relay the new chunks to the jobs' subscribers.

        The common case is served here directly: a job whose one subscriber had every earlier chunk
        needs just the entry appended now, so the entries go straight into that client's STREAM body.
        Other jobs (several or lagging subscribers, or a second chunk of one job in the batch) go
        through _flush, after those sends, which reads the cursors as they are then."""
        fresh: dict[bytes, tuple[list[bytes], list[Job], list[int]]] = {}  # cid -> (parts, jobs, [tokens])
        rest: list[Job] = []
        n_in = 0
        jobs, running, ident = self.jobs, JobState.RUNNING, w.ident
        for job_id, attempt, seq, token_ids, text, logprobs in chunks:
            job = jobs.get(job_id)
            if job is None or job.state is not running or job.worker != ident or job.attempt != attempt:
                self.counters["stale_messages_dropped"] += 1  # an older attempt's (or unknown) output
                self.counters["stale_tokens_dropped"] += len(token_ids)
                continue
            if seq != job.num_tokens:  # never accept a gap or a duplicate into the log
                self.counters["seq_mismatch"] += 1
                log.warning("seq_mismatch", job=job_id, got=seq, expected=job.num_tokens)
                continue
            index = len(job.ends)
            entry = job.append(seq, token_ids, text, logprobs)
            n = len(token_ids)
            n_in += n
            subs = job.subscribers
            if len(subs) == 1:
                [(cid, cursor)] = subs.items()
                if cursor == index:
                    if (b := fresh.get(cid)) is None:
                        fresh[cid] = ([b"", entry], [job], [n])
                    else:
                        b[0].append(entry)
                        b[1].append(job)
                        b[2][0] += n
                    continue
            if subs:
                rest.append(job)
        self.counters["tokens_in"] += n_in
        for cid, (parts, moved, tokens) in fresh.items():
            parts[0] = _array_header(len(moved))
            if self._send_client_frames(cid, [*_STREAM_HEAD, b"".join(parts)]):
                self.counters["tokens_out"] += tokens[0]
                for job in moved:  # each was sent exactly the one entry at its cursor
                    if cid in job.subscribers:
                        job.subscribers[cid] += 1
            else:
                self._lagging.update(j.job_id for j in moved)
        if rest:
            self._flush(rest)

    def _relay_batch(self, w: WorkerInfo, attempts: Any, entries: Any, body: bytes, offset: int) -> bool:
        """The common case of a TOKENS batch, served with the least work before the send: every chunk is
        plain and valid (the decoder's rules), is its job's next one from the attempt running on `w`, and
        goes to its job's one subscriber, the same client for all, who has every earlier chunk. Then
        body[offset:], the batch's entries as the worker encoded them, already is that client's STREAM
        body: it is sent first, and the token log is appended after the send. False (having changed
        nothing) for any other batch, which the caller validates and relays chunk by chunk."""
        if type(attempts) is not list or type(entries) is not list or len(attempts) != len(entries) or not entries:
            return False
        jobs, running, ident = self.jobs, JobState.RUNNING, w.ident
        batch: list[Job] = []
        add = batch.append
        cid: bytes | None = None
        try:
            # An entry that is no 5-item array fails the unpacking (ValueError, TypeError) or, if it is a
            # string or map of 5, the type tests. The type tests keep 1.0 or True from passing the equality
            # tests as 1.
            for attempt, (job_id, seq, ids, text, lps) in zip(attempts, entries):
                if (not plain_entry(job_id, seq, ids, text, lps) or (job := jobs.get(job_id)) is None
                        or job.state is not running or job.worker != ident or type(attempt) is not int
                        or job.attempt != attempt or seq != job.num_tokens or len(subs := job.subscribers) != 1):
                    return False
                if cid is None:
                    cid = next(iter(subs))
                if subs.get(cid) != len(job.ends):  # the one subscriber is cid, and it has every chunk
                    return False
                add(job)
        except (TypeError, ValueError):
            return False
        assert cid is not None
        w.last_seen = time.monotonic()
        error: zmq.ZMQError | None = None
        try:
            status = self._send_raw(cid, [*_STREAM_HEAD, body[offset:]])
        except zmq.ZMQError as e:  # not a full queue nor a gone peer: logged below, re-raised at the end
            status, error = _BLOCKED, e
        # (A job twice in the batch passes the checks above only behind an empty chunk of the same seq:
        # both entries went out, in order, and both are logged, in order.)
        n_in = 0
        for job, entry in zip(batch, entries):
            n_in += job.append_entry(entry)
        counters = self.counters
        counters["tokens_in"] += n_in
        counters["batches_forwarded"] += 1
        if status == _SENT:
            for job in batch:
                job.subscribers[cid] += 1
            counters["tokens_out"] += n_in
        elif status == _BLOCKED:
            self._lagging.update(job.job_id for job in batch)
        else:
            self._client_gone(cid, "unreachable")
        if error is not None:
            raise error
        return True

    def _on_finished(self, w: WorkerInfo, msg: p.Finished) -> None:
        for f in msg.jobs:
            job = self._current(w, f.job_id, f.attempt)
            if job is not None:
                queue_time = job.dispatched_at - job.created if job.dispatched_at is not None else None
                self._finish(job, p.Done(f.job_id, f.finish_reason, f.stop_reason, f.usage, job.num_tokens,
                                         queue_time))

    def _on_job_error(self, w: WorkerInfo, msg: p.JobError) -> None:
        job = self._current(w, msg.job_id, msg.attempt)
        if job is not None:
            self._finish(job, p.Fail(job.job_id, msg.code, msg.message))

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
        if self.workers.get(w.ident, None) is None or self.workers[w.ident] is not w:
            return  # already handled
        del self.workers[w.ident]
        self.data_sockets.pop(w.data_ident, None)  # its (the READY made it its own, see _on_ready)
        self.counters["workers_lost"] += 1
        log.warning("worker_dead", worker=w.name, reason=reason, jobs=len(w.jobs))
        ids, w.jobs = sorted(w.jobs), set()
        jobs = [j for i in ids if (j := self.jobs.get(i)) is not None and not j.is_terminal and j.worker == w.ident]
        blamed = charged(jobs)
        for job in jobs:
            self._migrate(job, job.job_id in blamed)
        self._need_dispatch = True

    def _migrate(self, job: Job, blamed: bool) -> None:
        """Queue `job` again after its worker died (`blamed`: the death is charged to it, broker/blame.py),
        or fail it at the migration bounds."""
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
            log.info("job_migrated", job=job.job_id, attempt=job.attempt, delivered=job.num_tokens)
            self._enqueue(job, front=True)

    # ---- queues and dispatch -----------------------------------------------------------------------

    def _enqueue(self, job: Job, front: bool) -> None:
        job.state = JobState.QUEUED
        job.queued_at = time.monotonic()
        q = self.queues[job.model]
        q.appendleft(job) if front else q.append(job)
        self.queued[job.model] += 1
        self._push_timer(job.queued_at + self.cfg.queue_timeout, "queue", job)

    def _dispatch(self) -> None:
        """Start queued jobs (FIFO per model; migrated ones first) on the best worker with room."""
        self._need_dispatch = False
        for model, q in list(self.queues.items()):
            while q:
                job = q[0]
                if job.state is not JobState.QUEUED:
                    q.popleft()  # lazily removed (cancelled or expired while queued)
                    continue
                serving = [w for w in self.workers.values() if w.serves(model)]
                w = pick_worker((w for w in serving if fits(w, job.input, job.max_tokens)), job.prefix_hashes,
                                self.prefix, self.cfg.affinity_slack)
                if w is None:
                    if (why := fit_refusal(serving, job.input, job.max_tokens)) is not None:
                        q.popleft()  # no registered worker could ever run it (the ones it fitted are gone)
                        self.counters["rejected_unfit"] += 1
                        self._finish(job, p.Fail(job.job_id, "invalid", why))  # (may compact this queue)
                        self._need_dispatch = True  # the rest of the queue: next turn
                    break
                q.popleft()
                self.queued[model] -= 1
                self._start(job, w)

    def _start(self, job: Job, w: WorkerInfo) -> None:
        job.state = JobState.RUNNING
        job.worker = w.ident
        job.dispatched_tokens = job.num_tokens
        if job.dispatched_at is None:
            job.dispatched_at = time.monotonic()
        w.jobs.add(job.job_id)
        w.dispatched += 1
        self.prefix.record(job.prefix_hashes, w.ident)
        self.counters["dispatches"] += 1
        self._send_worker(w, p.WorkerSubmit(job.job_id, job.attempt, job.input, job.params, job.tokens,
                                            job.priority))

    def _finish(self, job: Job, terminal: p.Done | p.Fail, cancel_worker: bool = False) -> None:
        """Make `terminal` the job's one terminal reply; release its queue slot or worker slot."""
        assert job.terminal is None
        if job.state is JobState.QUEUED:
            self.queued[job.model] -= 1
            self._compact_queue(job.model)
        elif job.worker is not None and (w := self.workers.get(job.worker)) is not None:
            w.jobs.discard(job.job_id)
            if cancel_worker:
                self._send_worker(w, p.WorkerCancel(job.job_id, job.attempt), on_fail_dead=False)
            self._need_dispatch = True
        now = time.monotonic()
        job.state, job.terminal, job.finished_at = JobState.DONE, terminal, now
        self._active -= 1
        self._retired.append((now, job.job_id))
        if isinstance(terminal, p.Done):
            self.counters["completed"] += 1
            self._job_seconds = 0.9 * self._job_seconds + 0.1 * (now - job.created)
        else:
            self.counters[f"failed_{terminal.code}"] += 1
        self._flush([job])

    def _compact_queue(self, model: str) -> None:
        q = self.queues[model]
        if len(q) > 2 * self.queued[model] + 64:
            self.queues[model] = deque(j for j in q if j.state is JobState.QUEUED)

    # ---- introspection ----------------------------------------------------------------------------

    def _summary(self) -> dict[str, Any]:
        return {"active_jobs": self._active, "workers": len(self.workers), **dict(self.counters)}

    def stats(self) -> dict[str, Any]:
        """Counters, queue depths and per-worker load (what a STATS request returns)."""
        now = time.monotonic()
        return {
            "counters": dict(self.counters),
            "queues": {m: n for m, n in self.queued.items() if n},
            "workers": [w.describe(now) for w in self.workers.values()],
            "active_jobs": self._active,
            "retained_jobs": len(self.jobs),
            "clients": len(self.clients),
            "draining": self._draining,
            "prefix_entries": len(self.prefix),
            "instance": self.instance,
            "reply_buckets": len(self.budget),
            "unknown_model_grace_left": round(self.catalog.grace_left(now), 3),
            "zap": ({"accepted": self.zap.accepted, "refused": self.zap.refused, "refused_role": self.zap.refused_role}
                    if self.zap else None),
        }
