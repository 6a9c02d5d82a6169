"""The worker process: one engine behind the broker.

Two threads, two DEALER sockets to the broker's backend:
- the IO thread owns the control socket. It forwards broker messages to the engine loop (a queue),
  forwards the engine loop's READY to the broker (an inproc PULL), and sends a HEARTBEAT with the latest
  load every interval, so a long engine step never looks like death. When the broker is silent for
  `liveness` intervals (or tells it to re-register) it asks the engine loop to reset (abort everything),
  sends no heartbeat until the loop hands it a fresh READY, and (when silent) reconnects with a new
  socket (Paranoid Pirate).
- the engine loop (the main thread) drains its queue (SUBMIT -> add_request, CANCEL -> abort_request),
  runs one engine step, and sends one TOKENS message per step (plus FINISHED/ERROR when any) on its own
  data socket, whose routing id its READY names (`Ready.data_id`; a new socket and id at every reset, so
  the output of an aborted generation never arrives under a new registration). Output never goes through
  the IO thread: that hop needs the GIL several times per message (wake, recv, send) while the next
  step's Python holds it (measured: benchmarks/results/cpu/broker_relay_realworker*.md).

A request is `"{job_id}#{attempt}"` inside the engine, so a stale attempt never collides with a new one.
A worker started with a role (`WorkerOptions.role`: disaggregated prefill and decode) hands prefill jobs'
KV blocks to decode workers and takes them in through `KVRoles` (worker/kv_transfer/roles.py), which the
engine loop calls at a few points (submit, add, emit, cancel, reset) and which never blocks it.
A malformed or invalid job is answered with ERROR for that job alone; a prompt that cannot fit the
context is refused from its length before it is tokenized, and a long text prompt is tokenized off the
engine loop (worker/prompt_guard.py), so no prompt stalls the loop or the heartbeats. An exception in
the IO thread is re-raised in the main thread, which exits non-zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import structlog
import zmq

from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError
from tokenmill.protocol.keys import apply_client_curve
from tokenmill.worker.compile_watch import watch_compiles
from tokenmill.worker.generation_defaults import announced_defaults
from tokenmill.worker.kv_transfer.channel import KVArrival
from tokenmill.worker.kv_transfer.roles import KVRoles
from tokenmill.worker.prompt_guard import INLINE_TOKENIZE_CHARS, Tokenized, TokenizerThread

log = structlog.get_logger("tokenmill.worker")


class EngineLike(Protocol):
    """The part of LLMEngine the worker uses (lets tests and benchmarks plug in a fake)."""

    model_name: str
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | None = None, *,
                    prompt_token_ids: Sequence[int] | None = None, messages: list[dict[str, Any]] | None = None,
                    params: SamplingParams | None = None, priority: int = 0,
                    resume_token_ids: Sequence[int] = ()) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def step(self) -> list[Any]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> Any: ...


@dataclass(frozen=True)
class WorkerOptions:
    broker: str = "tcp://127.0.0.1:5556"
    name: str = ""
    aliases: tuple[str, ...] = ()  # extra model names it answers to (e.g. the --model argument)
    capacity: int = 0  # 0: the engine's max_num_seqs (or 64)
    heartbeat_interval: float = 1.0
    liveness: int = 3
    curve_server_key: bytes | None = None
    curve_keypair: tuple[bytes, bytes] | None = None
    idle_wait: float = 0.05  # the loop's longest sleep when it has nothing to run
    role: str = "both"  # p.WORKER_ROLES: disaggregated prefill and decode (worker/kv_transfer/)
    kv_address: str = "tcp://127.0.0.1:*"  # a decode worker receives KV blocks here (*: a free port)
    kv_timeout: float = 30.0  # a decode worker computes the prompt itself if its KV has not come by then

    def __post_init__(self) -> None:
        if not self.heartbeat_interval > 0 or not self.idle_wait > 0 or not self.kv_timeout > 0:
            raise ValueError("heartbeat_interval, idle_wait and kv_timeout must be positive")
        if self.role not in p.WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(p.WORKER_ROLES)}, got {self.role!r}")
        if self.liveness < 1 or self.capacity < 0:
            raise ValueError(f"liveness must be >= 1 and capacity >= 0, got {self.liveness} and {self.capacity}")


def open_dealer(ctx: zmq.Context, opts: WorkerOptions, routing_id: str) -> zmq.Socket:
    """A DEALER to the broker's backend with the worker's socket options (and CURVE keys if set)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    s.setsockopt(zmq.MAXMSGSIZE, 2 * p.MAX_BODY_BYTES)
    if opts.curve_server_key is not None and opts.curve_keypair is not None:
        apply_client_curve(s, opts.curve_server_key, opts.curve_keypair)
    try:
        s.connect(opts.broker)
    except zmq.ZMQError:
        s.close(linger=0)
        raise
    return s


class _Reset:
    """Inbound-queue marker: abort every request, then send a fresh READY."""


class _Submitted(NamedTuple):
    """A SUBMIT as the IO thread hands it to the engine loop, with when it arrived (time.monotonic())."""

    msg: p.WorkerSubmit
    at: float


class IOThread(threading.Thread):
    """Owns the control socket to the broker. Talks to the engine loop through `inbound` (a queue) and the
    inproc PUSH/PULL pair at `outbox_addr` (the loop's READY, already encoded)."""

    def __init__(self, ctx: zmq.Context, opts: WorkerOptions, outbox_addr: str) -> None:
        super().__init__(name="tokenmill-worker-io", daemon=True)
        self.ctx, self.opts = ctx, opts
        self.inbound: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.load = p.WorkerHeartbeat()  # replaced (atomically) by the engine loop after each step
        self._stopping = threading.Event()
        self.say_goodbye = True  # send DISCONNECT on the way out (False: the engine loop sent it)
        self._outbox = ctx.socket(zmq.PULL)
        self._outbox.bind(outbox_addr)
        self._dealer: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._awaiting_ready = True  # no heartbeat until the loop's READY goes out
        self._last_heard = time.monotonic()
        self._next_heartbeat = 0.0

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        try:
            self._connect()
            while not self._stopping.is_set():
                self._turn()
        except BaseException as e:  # handed to the main thread, which exits non-zero
            self.error = e
        finally:
            self._close()

    def _close(self) -> None:
        if self._dealer is not None and self.say_goodbye:
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.send_multipart(p.encode(p.WorkerDisconnect()), zmq.NOBLOCK)
            self._dealer.close(linger=500)
        self._outbox.close(linger=0)

    def _connect(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
        s = open_dealer(self.ctx, self.opts, f"{self.opts.name}-{secrets.token_hex(4)}")
        self._dealer = s
        self._poller = zmq.Poller()
        self._poller.register(s, zmq.POLLIN)
        self._poller.register(self._outbox, zmq.POLLIN)
        self._last_heard = time.monotonic()
        self._request_reset()

    def _request_reset(self) -> None:
        self._awaiting_ready = True
        self.inbound.put(_Reset())

    def _turn(self) -> None:
        assert self._dealer is not None
        interval = self.opts.heartbeat_interval
        events = dict(self._poller.poll(max(1, int(interval * 250))))
        if self._outbox in events:
            self._forward_outbox()
        if self._dealer in events:
            self._read_broker()
        now = time.monotonic()
        if now - self._last_heard > interval * self.opts.liveness:
            log.warning("broker_silent", seconds=round(now - self._last_heard, 2))
            self._connect()
        elif now >= self._next_heartbeat and not self._awaiting_ready:
            self._next_heartbeat = now + interval
            self._send(p.encode(self.load))

    def _send(self, frames: list[bytes]) -> None:
        assert self._dealer is not None
        # On Again the broker is unreachable and our queue is full; liveness will reconnect.
        with contextlib.suppress(zmq.Again):
            self._dealer.send_multipart(frames, zmq.NOBLOCK)

    def _forward_outbox(self) -> None:
        for _ in range(1000):
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            assert frames[1] == bytes((p.Cmd.W_READY,)), "only READY goes through the IO thread"
            self._awaiting_ready = False
            self._next_heartbeat = time.monotonic() + self.opts.heartbeat_interval
            self._send(frames)

    def _read_broker(self) -> None:
        assert self._dealer is not None
        for _ in range(1000):
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            self._on_broker_message(frames)

    def _on_broker_message(self, frames: list[bytes]) -> None:
        try:
            msg = p.decode(frames, p.BROKER_TO_WORKER)
        except ProtocolError as e:
            self._answer_malformed(frames, e)
            return
        if isinstance(msg, p.BrokerDisconnect):
            log.info("broker_disconnect", reason=msg.reason)
            if not self._awaiting_ready:
                self._request_reset()
        elif isinstance(msg, p.WorkerSubmit):
            self.inbound.put(_Submitted(msg, time.monotonic()))
        elif isinstance(msg, p.WorkerCancel | p.KvLost):
            self.inbound.put(msg)

    def _answer_malformed(self, frames: list[bytes], err: ProtocolError) -> None:
        """ERROR for the job a malformed SUBMIT names (if its id can be read); otherwise just log."""
        log.warning("malformed_broker_message", error=str(err)[:200])
        if len(frames) != 3 or frames[1] != bytes((p.Cmd.B_SUBMIT,)):
            return
        try:
            body = p.unpack_body(frames[2])
            job_id, attempt = body["job_id"], body["attempt"]
            err_msg = p.JobError(job_id, attempt, "invalid", str(err)[:1000])
            self._send(p.encode(p.JobError.from_wire(err_msg.to_wire())))
        except Exception:
            return


class EngineLoop:
    """Drives the engine on the calling thread; see the module docstring. `outbox` carries its READY to the
    IO thread; its output goes out on the data socket it opens (from `ctx`) at each reset."""

    def __init__(self, engine: EngineLike, io: IOThread, outbox: zmq.Socket, opts: WorkerOptions,
                 ready: p.Ready, ctx: zmq.Context) -> None:
        self.engine, self.io, self.outbox, self.opts = engine, io, outbox, opts
        self.ready = ready
        self.ctx = ctx
        self.data: zmq.Socket | None = None  # the data socket, opened at each reset
        self.active: dict[str, tuple[str, int]] = {}  # engine request id -> (job id, attempt)
        self.stopping = threading.Event()
        self.steps = 0  # engine steps run (the heartbeat's progress counter)
        self._byte_table: Callable[[int], list[int]] | None = None  # token id -> its bytes (_token_bytes)
        # Jobs whose prompt the tokenizer thread is working on (engine request id -> job, params); results
        # for ids not here (cancelled, or from before a reset: `generation` counts resets) are dropped.
        self.tokenizing: dict[str, tuple[p.WorkerSubmit, SamplingParams]] = {}
        self.generation = 0
        # engine request id -> when the IO thread received its SUBMIT (time.monotonic()), for its timeline;
        # dropped when the job finishes, fails, is cancelled or reset
        self.received: dict[str, float] = {}
        tokenize = getattr(engine, "tokenize_prompt", None)
        self.tokenizer = TokenizerThread(tokenize, self.io.inbound.put) if tokenize is not None else None
        self.kv = KVRoles(engine, opts.role, self._push, ctx, lambda arrival: self.io.inbound.put(arrival),
                          opts.kv_address, opts.kv_timeout)
        self.ready = dataclasses.replace(ready, role=opts.role, kv_address=self.kv.address)

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.io.error is not None:
                raise RuntimeError("worker IO thread failed") from self.io.error
            if not self.io.is_alive():
                raise RuntimeError("worker IO thread exited")
            self.kv.check()
            if self.kv.waiting:
                for job in self.kv.due(time.monotonic()):
                    self._submit(job)
            self._drain_inbound(block=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                self._emit(self.engine.step())
                self.steps += 1
            self._publish_load()

    def _drain_inbound(self, block: bool) -> None:
        try:
            item = self.io.inbound.get(timeout=self.opts.idle_wait) if block else self.io.inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.io.inbound.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Reset):
            self._reset()
        elif isinstance(item, _Submitted):
            self.received[f"{item.msg.job_id}#{item.msg.attempt}"] = item.at
            self._submit(item.msg)
        elif isinstance(item, p.WorkerCancel):
            rid = f"{item.job_id}#{item.attempt}"
            self.received.pop(rid, None)
            self.tokenizing.pop(rid, None)
            self.kv.forget(rid)
            if self.active.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                log.debug("job_aborted", job_id=item.job_id, attempt=item.attempt)
        elif isinstance(item, Tokenized):
            self._tokenized(item)
        elif isinstance(item, KVArrival | p.KvLost):
            job = self.kv.arrived(item) if isinstance(item, KVArrival) else self.kv.lost(item)
            if job is not None:
                self._submit(job)

    def _reset(self) -> None:
        for rid in list(self.active):
            self.engine.abort_request(rid)
        n = len(self.active) + len(self.tokenizing)
        self.active.clear()
        self.tokenizing.clear()
        self.received.clear()
        self.kv.reset()
        self.generation += 1
        if n:
            log.info("worker_reset", aborted=n)
        self.close()
        data_id = f"{self.opts.name}-{secrets.token_hex(4)}/data"
        self.data = open_dealer(self.ctx, self.opts, data_id)
        # through the IO thread, on the control socket: the broker learns the data socket from it
        self.outbox.send_multipart(p.encode(dataclasses.replace(self.ready, data_id=data_id)))

    def close(self, goodbye: bool = False) -> bool:
        """Close the data socket, if open: at a reset, dropping unsent output (its requests were aborted);
        with `goodbye` (exit), after sending DISCONNECT behind the output and letting both go out (0.5 s at
        most). Returns whether DISCONNECT was sent."""
        if self.data is None:
            return False
        if goodbye:
            with contextlib.suppress(zmq.ZMQError):
                self.data.send_multipart(p.encode(p.WorkerDisconnect()), zmq.NOBLOCK)
        self.data.close(linger=500 if goodbye else 0)
        self.data = None
        return goodbye

    def _submit(self, msg: p.WorkerSubmit) -> None:
        rid = f"{msg.job_id}#{msg.attempt}"
        if self.kv.park(msg):
            return  # waits for its KV blocks (worker/kv_transfer/roles.py)
        try:
            params = SamplingParams.from_dict(msg.params)
            if msg.kv_send:
                params = self.kv.prefill_params(rid, msg, params)
        except InvalidRequest as e:
            self._job_error(msg.job_id, msg.attempt, "invalid", str(e)[:1000])
            return
        too_long = msg.input.fit_error(self.engine.max_model_len, self.ready.max_prompt_chars)
        if too_long is not None:
            self._job_error(msg.job_id, msg.attempt, "invalid", too_long)
        elif self.tokenizer is not None and msg.input.text_chars() > INLINE_TOKENIZE_CHARS:
            self.tokenizing[rid] = (msg, params)
            self.tokenizer.submit(rid, self.generation, msg.input, params)
        else:
            self._add(rid, msg, params, msg.input.prompt, msg.input.prompt_token_ids, msg.input.messages)

    def _tokenized(self, t: Tokenized) -> None:
        job = self.tokenizing.pop(t.rid, None) if t.generation == self.generation else None
        if job is None:
            return  # cancelled meanwhile, or asked before a reset
        msg, params = job
        if t.error is not None:
            code = "invalid" if isinstance(t.error, InvalidRequest | ValueError | TypeError) else "failed"
            self._job_error(msg.job_id, msg.attempt, code, str(t.error)[:1000])
        else:
            self._add(t.rid, msg, params, None, t.ids, None)

    def _add(self, rid: str, msg: p.WorkerSubmit, params: SamplingParams, prompt: str | None,
             prompt_token_ids: list[int] | None, messages: list[dict[str, str]] | None) -> None:
        try:
            self.engine.add_request(rid, prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                    params=params, priority=msg.priority, resume_token_ids=msg.resume_token_ids)
        except (InvalidRequest, ValueError, TypeError) as e:
            log.info("job_refused", job_id=msg.job_id, attempt=msg.attempt, error=str(e)[:200])
            self._job_error(msg.job_id, msg.attempt, "invalid", str(e)[:1000])
            return
        self.active[rid] = (msg.job_id, msg.attempt)
        log.debug("job_admitted", job_id=msg.job_id, attempt=msg.attempt)
        self.kv.added(rid)

    def _emit(self, outputs: list[Any]) -> None:
        """One TOKENS message for the step, then FINISHED and ERRORs (after the tokens they follow), on the
        data socket."""
        attempts: list[int] = []  # the TOKENS body's two columns (p.Tokens), built without TokenChunks
        entries: list[list[Any]] = []
        finished: list[p.FinishedJob] = []
        errors: list[p.JobError] = []
        active = self.active
        if self.kv.prefills:
            for out in outputs:  # a prefill's end is PREFILLED, not FINISHED: no timeline goes out for it
                if out.finished and out.request_id in self.kv.prefills:
                    self.received.pop(out.request_id, None)
            outputs = self.kv.take_outputs(outputs, active)
        for out in outputs:
            job = active.get(out.request_id)
            if job is None:
                continue  # aborted (cancelled, reset) or not ours
            job_id, attempt = job
            if out.new_token_ids or out.text_delta:
                lps = None
                if out.logprobs is not None:
                    tb = self._token_bytes
                    lps = [[[int(t), float(v), tb(int(t))] for t, v in d.items()] for d in out.logprobs]
                attempts.append(attempt)
                entries.append([job_id, out.first_index, list(out.new_token_ids), out.text_delta, lps])
            if out.finished:
                del active[out.request_id]
                log.debug("job_finished", job_id=job_id, attempt=attempt, finish_reason=out.finish_reason)
                if out.finish_reason == "error":
                    self.received.pop(out.request_id, None)
                    errors.append(p.JobError(job_id, attempt, "failed", str(out.error)[:1000]))
                else:
                    u = out.usage
                    usage = (u.prompt_tokens, u.completion_tokens, u.cached_tokens) if u else (0, 0, 0)
                    finished.append(p.FinishedJob(job_id, attempt, out.finish_reason, out.stop_reason, usage,
                                                  self._timeline(out)))
        if entries:
            self._send(p.encode_tokens(attempts, entries))
        if finished:
            self._push(p.Finished(finished))
        for e in errors:
            self._push(e)

    def _job_error(self, job_id: str, attempt: int, code: str, text: str) -> None:
        self.received.pop(f"{job_id}#{attempt}", None)
        self._push(p.JobError(job_id, attempt, code, text))

    def _timeline(self, out: Any) -> p.WorkerTimeline | None:
        """The finished request's engine timeline in seconds since this worker received its SUBMIT."""
        received = self.received.pop(out.request_id, None)
        tl = out.timeline
        if received is None or tl is None:
            return None
        return p.WorkerTimeline(*(max(0.0, t - received) for t in (tl.added, tl.first_scheduled, tl.first_token)))

    def _publish_load(self) -> None:
        s = self.engine.stats()
        waiting = s.num_waiting + len(self.kv.waiting)  # (jobs waiting for their KV blocks, too)
        self.io.load = p.WorkerHeartbeat(s.num_running, waiting, s.num_free_blocks, s.num_cached_blocks,
                                         self.steps, getattr(s, "prefix_cache_queries", 0),
                                         getattr(s, "prefix_cache_hits", 0), getattr(s, "num_preemptions", 0))

    def _token_bytes(self, token_id: int) -> list[int]:
        """A token's bytes for a logprobs entry (looked up through the engine's tokenizer)."""
        if self._byte_table is None:
            self._byte_table = token_byte_lookup(self.engine)
        return self._byte_table(token_id)

    def _push(self, msg: p.Message) -> None:
        self._send(p.encode(self.kv.converted(msg) if self.kv.prefills else msg))

    def _send(self, frames: list[bytes]) -> None:
        assert self.data is not None, "the IO thread's first reset opens the data socket before any SUBMIT"
        # On Again the broker is unreachable and 100k messages are queued; the IO thread's liveness check
        # will reset this loop (as it drops output on its own socket in that case).
        with contextlib.suppress(zmq.Again):
            self.data.send_multipart(frames, zmq.NOBLOCK)


def token_byte_lookup(engine: Any) -> Callable[[int], list[int]]:
    """token id -> its bytes (at most MAX_TOKEN_BYTES) for logprobs entries: the tokenizer's byte table
    (byte-level BPE), else the UTF-8 of the token decoded alone; [] when the engine has no tokenizer."""
    n = p.MAX_TOKEN_BYTES
    tok = getattr(engine, "tokenizer", None)
    table = getattr(tok, "token_bytes", None)
    if table is not None:
        return lambda i: list(table[i][:n]) if 0 <= i < len(table) else []
    if tok is not None:
        return lambda i: list(tok.decode([i], skip_special_tokens=False).encode()[:n])
    return lambda i: []


def ready_message(engine: EngineLike, opts: WorkerOptions) -> p.Ready:
    s = engine.stats()
    models = [engine.model_name, *(a for a in opts.aliases if a and a != engine.model_name)]
    capacity = opts.capacity or int(getattr(getattr(getattr(engine, "config", None), "scheduler", None),
                                            "max_num_seqs", 64))
    return p.Ready(opts.name, models[:16], capacity, s.num_total_blocks, s.block_size, engine.max_model_len,
                   opts.heartbeat_interval, max_prompt_chars=int(getattr(engine, "max_prompt_chars", 0)),
                   sampling_defaults=announced_defaults(getattr(engine, "sampling_defaults", {})))


def run_worker(engine: EngineLike, opts: WorkerOptions, stop: threading.Event | None = None,
               on_ready: Callable[[], None] | None = None) -> None:
    """Serve `engine` to the broker until `stop` is set (or an exception, which propagates)."""
    if not opts.name:
        opts = dataclasses.replace(opts, name=f"worker-{os.getpid()}")
    ctx = zmq.Context()
    outbox_addr = f"inproc://tokenmill-worker-outbox-{secrets.token_hex(4)}"
    io = IOThread(ctx, opts, outbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block the engine loop; the IO thread drains it
    outbox.connect(outbox_addr)
    loop = EngineLoop(engine, io, outbox, opts, ready_message(engine, opts), ctx)
    if stop is not None:
        def relay_stop() -> None:
            stop.wait()
            loop.stopping.set()

        threading.Thread(target=relay_stop, daemon=True).start()
    with watch_compiles(log):  # start-up has built every kernel: a compile from now on is logged
        io.start()
        log.info("worker_started", broker=opts.broker, name=opts.name, model=engine.model_name)
        if on_ready is not None:
            on_ready()
        try:
            loop.run()
        finally:
            # Output, then DISCONNECT, in order on one socket: the broker must not migrate a job whose FINISHED
            # is still on the way.
            io.say_goodbye = not loop.close(goodbye=True)
            loop.kv.close()
            if loop.tokenizer is not None:
                loop.tokenizer.stop()
            io.stop()
            io.join(2.0)
            outbox.close(linger=0)
            ctx.destroy(linger=0)  # closes whatever a failed IO thread left open
