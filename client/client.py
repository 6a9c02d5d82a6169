"""Synchronous client SDK: submit jobs to a tokenmill broker, stream or subscribe to their tokens.

    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Once upon a time", max_tokens=32, temperature=0).text)
        for ev in c.stream("Hello", max_tokens=16):
            print(ev.text, end="", flush=True)

One background IO thread owns the ZeroMQ socket (sockets are not thread-safe); calls from any thread
hand it encoded messages through an inproc pipe, and it routes the broker's replies to per-job queues.
While jobs are open it pings the broker; if the broker stays silent for `broker_timeout` seconds every
open job fails with BrokerUnavailable (nothing waits forever). Every stream is gap-free and duplicate-
free by sequence number: duplicates are dropped, a gap triggers a re-subscribe from the missing token.

Nothing waits without a bound: a request is checked with the broker's own rules before it is sent
(client/requests.py: InvalidRequest at once); a job the broker has not acknowledged within
`broker_timeout` fails with BrokerUnavailable; a PONG or ACK from another broker instance (the broker
restarted) fails the jobs the old instance held; a refused CURVE handshake fails everything with
AuthenticationFailed; and every wait for an event is bounded (the call's timeout, else `idle_timeout`).
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenmill.client.requests import (
    build_params,
    checked_frames,
    make_submit,
    positive_seconds,
    wait_seconds,
)
from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    DeadlineExceeded,
    ProtocolError,
    TokenmillError,
    error_from_fail,
)
from tokenmill.protocol.keys import apply_client_curve, load_keypair, load_public_key

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_IDLE_TIMEOUT = 300.0  # seconds a call waits for a job's next event when no timeout is named

# Socket monitor events the SDK watches: handshake outcomes (a refused CURVE handshake is no outage).
MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# Handshakes the broker cut short in a row (TCP connected, then the peer closed it: what a CURVE server does
# to a client without CURVE, when the client does not see the reason) before that reads as a refusal.
REFUSED_HANDSHAKES = 3
_AUTH_PROTOCOL_ERRORS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "CURVE is on at one end only",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "the CURVE handshake failed (wrong broker public key?)",
    zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE: "the CURVE key exchange failed (wrong broker public key?)",
}


def auth_failure(event: int, value: int, cut_short: int = 0) -> str | None:
    """What a handshake monitor event says went wrong with authentication, or None (not an auth failure).
    `cut_short`: handshakes in a row, this one included, that failed with no detail."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (f"the broker cut {cut_short} handshakes short in a row (CURVE on at one end only?)"
                if cut_short >= REFUSED_HANDSHAKES else None)
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the broker refused this client's CURVE key (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _AUTH_PROTOCOL_ERRORS.get(value)
    return None


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished job (completion_tokens includes tokens of migrated attempts)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class StreamEvent:
    """New output of a job: `token_ids[0]` is output position `seq`. The last event of a stream has
    `finish_reason` set (and usually no tokens).

    With logprobs requested, `logprobs[i]` maps token ids to log-probabilities at output position seq + i
    (sampled token first) and `token_bytes[i]` maps the same ids to the tokens' bytes (when the worker
    sent them). The final event's `queue_time` is the seconds the job waited at the broker for a worker, and
    its `worker_timeline` where the first token came from on the worker that finished it: seconds from the
    worker's receiving the job to the engine's admitting it, first scheduling it, and emitting its first token
    (tokenmill.protocol.wire.WorkerTimeline; None when the worker did not say)."""

    job_id: str
    seq: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    token_bytes: list[dict[int, bytes]] | None = None
    queue_time: float | None = None
    worker_timeline: p.WorkerTimeline | None = None

    @property
    def finished(self) -> bool:
        """True on the final event."""
        return self.finish_reason is not None


@dataclass
class Result:
    """The whole output of a finished job."""

    job_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: list[dict[int, float]] | None = None


class _Gap(Exception):
    """A chunk arrived past the next expected sequence number."""


class Assembly:
    """Per-job stream state: accepts chunks in sequence order (dropping duplicates, reporting gaps)
    and accumulates the result."""

    def __init__(self, job_id: str, from_seq: int = 0) -> None:
        self.job_id = job_id
        self.next_seq = from_seq
        self.result = Result(job_id)

    def on_chunk(self, c: p.StreamChunk) -> StreamEvent | None:
        """The event for a new chunk, None for a duplicate; raises _Gap if tokens are missing."""
        ids, text, lps = c.token_ids, c.text, c.logprobs
        if c.seq > self.next_seq:
            raise _Gap(f"expected seq {self.next_seq}, got {c.seq}")
        if c.seq < self.next_seq:
            skip = self.next_seq - c.seq
            if skip >= len(ids):
                return None  # already seen
            ids, text = ids[skip:], ""  # a replay starting mid-chunk: its text cannot be split
            lps = lps[skip:] if lps is not None else None
        logprobs = token_bytes = None
        if lps is not None:
            logprobs = [{int(e[0]): float(e[1]) for e in pairs} for pairs in lps]
            if lps and lps[0] and len(lps[0][0]) == 3:
                token_bytes = [{int(e[0]): bytes(e[2]) for e in pairs if len(e) == 3} for pairs in lps]
        ev = StreamEvent(self.job_id, self.next_seq, list(ids), text, logprobs, token_bytes=token_bytes)
        self.next_seq += len(ids)
        r = self.result
        r.token_ids.extend(ids)
        r.text += text
        if logprobs is not None:
            r.logprobs = (r.logprobs or []) + logprobs
        return ev

    def on_done(self, d: p.Done) -> StreamEvent:
        usage = Usage(*d.usage)
        r = self.result
        r.finish_reason, r.stop_reason, r.usage = d.finish_reason, d.stop_reason, usage
        return StreamEvent(self.job_id, self.next_seq, [], "", None, d.finish_reason, d.stop_reason, usage,
                           queue_time=d.queue_time, worker_timeline=d.worker_timeline)


class RouterCore:
    """Routing of broker replies to job handles and control waiters, shared by Client and AsyncClient.
    Subclasses provide `_deliver(handle, item)` and `_deliver_waiter(waiter, item)`.

    Handles have `job_id`, `_acked` and `_instance` (the broker instance that acknowledged the job).
    `_unacked` holds (deadline, handle) in submission order: a handle still unacknowledged at its deadline
    fails (the broker acknowledges every SUBMIT and SUBSCRIBE at once, so silence about one means it was
    lost: a broker restart, a connection that never came up)."""

    address: str
    broker_timeout: float
    _handles: dict[str, Any]
    _waiters: dict[str, Any]
    _stats_waiters: list[Any]
    _unacked: deque[tuple[float, Any]]
    _instance: str = ""  # the broker instance last heard from ("" until one names itself)
    _auth_refused: str = ""  # why the last handshake was refused; "" once one succeeds
    _cut_short = 0  # handshakes in a row that failed with no detail

    def _expect_ack(self, handle: Any) -> None:
        self._unacked.append((time.monotonic() + self.broker_timeout, handle))

    def _expire_unacked(self, now: float) -> None:
        q = self._unacked
        while q and q[0][0] <= now:
            _, h = q.popleft()
            job_id = h.job_id
            if not h._acked and self._handles.get(job_id) is h:
                del self._handles[job_id]
                self._deliver(h, self._unsendable(job_id) if self._auth_refused else BrokerUnavailable(
                    f"broker {self.address} did not acknowledge the job within {self.broker_timeout}s",
                    job_id=job_id))

    def _note_instance(self, instance: str) -> None:
        """A message named the broker instance `instance`: if it is a new one, the jobs an earlier instance
        acknowledged are gone with it (a restarted broker knows nothing of them): fail them."""
        if not instance or instance == self._instance:
            return
        old, self._instance = self._instance, instance
        if not old:
            return
        handles = list(self._handles.values())  # one C-level copy: other threads may add handles meanwhile
        lost = [h for h in handles if h._instance and h._instance != instance]
        for h in lost:
            self._handles.pop(h.job_id, None)
            self._deliver(h, BrokerUnavailable(
                f"broker {self.address} restarted (instance {old} -> {instance}); the job was lost with it",
                job_id=h.job_id))

    def _unsendable(self, job_id: str | None) -> BrokerUnavailable:
        """The error for a message the socket refused to queue (no connection, or a full queue)."""
        if self._auth_refused:
            return AuthenticationFailed(f"broker {self.address}: {self._auth_refused}", job_id=job_id)
        return BrokerUnavailable(f"cannot send to the broker {self.address}", job_id=job_id)

    def _on_monitor_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._auth_refused, self._cut_short = "", 0
            return
        self._cut_short = self._cut_short + 1 if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL else 0
        why = auth_failure(event, value, self._cut_short)
        if why is not None:
            self._auth_refused = why
            self._fail_all(f"broker {self.address}: {why}", AuthenticationFailed)

    def _route(self, frames: list[bytes]) -> None:
        try:
            msg = p.decode(frames, p.BROKER_TO_CLIENT)
        except ProtocolError:
            return  # a malformed reply cannot be attributed to a job; the job's own timeout covers it
        if isinstance(msg, p.Stream):
            for c in msg.chunks:
                h = self._handles.get(c.job_id)
                if h is not None:
                    self._deliver(h, c)
        elif isinstance(msg, p.Ack):
            w = self._waiters.pop(msg.job_id, None)
            if w is not None:
                self._deliver_waiter(w, msg)
            elif (h := self._handles.get(msg.job_id)) is not None:
                h._on_ack(msg.instance)
            self._note_instance(msg.instance)
        elif isinstance(msg, p.Pong):
            self._note_instance(msg.instance)
        elif isinstance(msg, p.Done):
            if (h := self._handles.pop(msg.job_id, None)) is not None:
                self._deliver(h, msg)
        elif isinstance(msg, p.Fail):
            self._route_fail(msg)
        elif isinstance(msg, p.StatsReply) and self._stats_waiters:
            self._deliver_waiter(self._stats_waiters.pop(0), msg)

    def _route_fail(self, msg: p.Fail) -> None:
        if msg.code in ("forbidden", "unknown_job") and msg.job_id in self._waiters:
            self._deliver_waiter(self._waiters.pop(msg.job_id), msg)
        elif (h := self._handles.pop(msg.job_id, None)) is not None:
            self._deliver(h, msg)

    def _fail_all(self, err_message: str, error: type[BrokerUnavailable] = BrokerUnavailable) -> None:
        for job_id in list(self._handles):
            h = self._handles.pop(job_id, None)
            if h is not None:
                self._deliver(h, error(err_message, job_id=job_id))
        for job_id in list(self._waiters):
            w = self._waiters.pop(job_id, None)
            if w is not None:
                self._deliver_waiter(w, error(err_message, job_id=job_id))
        while self._stats_waiters:
            self._deliver_waiter(self._stats_waiters.pop(0), error(err_message))

    def _deliver(self, handle: Any, item: Any) -> None:
        raise NotImplementedError

    def _deliver_waiter(self, waiter: Any, item: Any) -> None:
        raise NotImplementedError


def terminal_error(item: p.Fail) -> TokenmillError:
    return error_from_fail(item.code, item.message, item.job_id, item.retry_after)


class JobHandle:
    """A submitted (or subscribed) job: `stream()` its events, wait for its `result()`, `cancel()` it.
    Events are buffered from the moment of submission, so nothing is missed by starting late."""

    def __init__(self, client: Client, job_id: str, from_seq: int = 0) -> None:
        self._client = client
        self.job_id = job_id
        self._q: queue.Queue[Any] = queue.Queue()
        self._asm = Assembly(job_id, from_seq)
        self._accepted = threading.Event()
        self._acked = False
        self._instance = ""
        self._error: TokenmillError | None = None
        self._finished = False

    @property
    def done(self) -> bool:
        """True once the job's terminal reply (or an error) was consumed."""
        return self._finished or self._error is not None

    def _on_ack(self, instance: str) -> None:
        self._acked, self._instance = True, instance or self._instance
        self._accepted.set()

    def wait_accepted(self, timeout: float | None = None) -> bool:
        """Block until the broker acknowledged the job, at most `timeout` seconds (None: the client's
        `broker_timeout`, after which an unacknowledged job fails). False on timeout."""
        return self._accepted.wait(wait_seconds(timeout, self._client.broker_timeout))

    def stream(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Yield the job's events in order; the last has `finish_reason`. Raises the job's typed error,
        or DeadlineExceeded when no event arrives for `timeout` seconds (None: the client's `idle_timeout`;
        the job keeps running)."""
        timeout = wait_seconds(timeout, self._client.idle_timeout)
        if self._error is not None:
            raise self._error
        while not self._finished:
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                raise DeadlineExceeded(f"no event for {timeout}s", job_id=self.job_id) from None
            ev = self._consume(item)
            if ev is not None:
                yield ev

    def _consume(self, item: Any) -> StreamEvent | None:
        if isinstance(item, p.StreamChunk):
            try:
                return self._asm.on_chunk(item)
            except _Gap:
                self._client._send(p.Subscribe(self.job_id, self._client.owner, self._asm.next_seq))
                return None
        if isinstance(item, p.Done):
            self._finished = True
            return self._asm.on_done(item)
        self._error = terminal_error(item) if isinstance(item, p.Fail) else item
        assert self._error is not None
        raise self._error

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the whole output. `timeout` bounds each wait for the next event."""
        for _ in self.stream(timeout):
            pass
        return self._asm.result

    def cancel(self) -> None:
        """Ask the broker to cancel the job (its KV blocks are freed); the stream then ends with Cancelled."""
        self._client._send(p.Cancel(self.job_id, self._client.owner))


def check_settings(heartbeat_interval: float, broker_timeout: float, idle_timeout: float) -> None:
    """InvalidRequest unless each client setting is a finite number of seconds > 0."""
    for value, name in ((heartbeat_interval, "heartbeat_interval"), (broker_timeout, "broker_timeout"),
                        (idle_timeout, "idle_timeout")):
        positive_seconds(value, name)


class Client(RouterCore):
    """Synchronous client of a tokenmill broker (thread-safe).

    `owner` identifies this client's jobs for cancel/subscribe from other processes when CURVE is off
    (default: a random token); with CURVE the client key does. `timeout`: default job deadline in
    seconds (None: the broker's). `broker_timeout`: how long the broker may stay silent while jobs are
    open (or leave a submit unacknowledged) before they fail with BrokerUnavailable. `idle_timeout`: how
    long a call waits for a job's next event when neither it nor `timeout` names a bound (then
    DeadlineExceeded). CURVE: `curve_server_key` (the broker's public key or key file) and
    `curve_secret_key` (this client's NAME.key_secret file); a refused key raises AuthenticationFailed."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, owner: str | None = None, timeout: float | None = None,
                 heartbeat_interval: float = 1.0, broker_timeout: float = 10.0,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 curve_server_key: str | None = None, curve_secret_key: str | None = None) -> None:
        check_settings(heartbeat_interval, broker_timeout, idle_timeout)
        self.address = address
        self.owner = owner if owner is not None else secrets.token_hex(16)
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.broker_timeout = broker_timeout
        self.idle_timeout = idle_timeout
        self._handles: dict[str, JobHandle] = {}
        self._waiters: dict[str, queue.Queue[Any]] = {}
        self._stats_waiters: list[queue.Queue[Any]] = []
        self._unacked = deque()
        self._ctx = zmq.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.SNDHWM, 100_000)
        self._dealer.setsockopt(zmq.RCVHWM, 100_000)
        self._dealer.setsockopt(zmq.MAXMSGSIZE, 2 * p.MAX_BODY_BYTES)
        if curve_server_key is not None and curve_secret_key is not None:
            apply_client_curve(self._dealer, load_public_key(curve_server_key), load_keypair(curve_secret_key))
        self._monitor = self._dealer.get_monitor_socket(MONITOR_EVENTS)
        self._dealer.connect(address)
        pipe = f"inproc://tokenmill-client-{uuid.uuid4().hex}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(pipe)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(pipe)
        self._push_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._io_main, name="tokenmill-client-io", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------------

    def submit(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_token_ids: list[int] | None = None, model: str = "",
               params: Mapping[str, Any] | None = None, timeout: float | None = None, job_id: str | None = None,
               priority: int = 0, cancel_on_disconnect: bool = True, **sampling: Any) -> JobHandle:
        """Submit a job and return its handle at once (errors such as Overloaded surface from the
        handle). Exactly one of prompt / messages / prompt_token_ids. `model` "" = any worker's model.
        Sampling parameters come as `params` and/or keywords (max_tokens=, temperature=, seed=, ...).
        A client-chosen `job_id` makes the submit idempotent (a repeat re-attaches to the same job).
        Raises InvalidRequest at once for anything the broker would refuse as malformed."""
        msg, frames = make_submit(job_id, model, prompt, messages, prompt_token_ids, build_params(params, sampling),
                                  timeout if timeout is not None else self.timeout, priority, self.owner,
                                  cancel_on_disconnect)
        return self._open(JobHandle(self, msg.job_id), frames)

    def _open(self, handle: JobHandle, frames: list[bytes]) -> JobHandle:
        """Register `handle`, send `frames` (its SUBMIT or SUBSCRIBE) and start its acknowledgement clock."""
        self._handles[handle.job_id] = handle
        try:
            self._send_frames(handle.job_id, frames)
        except BaseException:
            self._handles.pop(handle.job_id, None)
            raise
        self._expect_ack(handle)
        return handle

    def generate(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None, model: str = "",
                 params: Mapping[str, Any] | None = None, timeout: float | None = None,
                 **sampling: Any) -> Result:
        """Run a prompt (text or token ids) to completion and return the whole Result."""
        return self._run(self.submit(prompt, prompt_token_ids=prompt_token_ids, model=model, params=params,
                                     timeout=timeout, **sampling), timeout)

    def chat(self, messages: list[dict[str, str]], *, model: str = "", params: Mapping[str, Any] | None = None,
             timeout: float | None = None, **sampling: Any) -> Result:
        """Run a chat (a list of {"role", "content"} messages; the worker applies the chat template)."""
        return self._run(self.submit(messages=messages, model=model, params=params, timeout=timeout, **sampling),
                         timeout)

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_token_ids: list[int] | None = None, model: str = "",
               params: Mapping[str, Any] | None = None, timeout: float | None = None,
               **sampling: Any) -> Iterator[StreamEvent]:
        """Submit and yield events as they arrive; leaving the loop early cancels the job."""
        h = self.submit(prompt, messages=messages, prompt_token_ids=prompt_token_ids, model=model, params=params,
                        timeout=timeout, **sampling)
        try:
            yield from h.stream(self._wait_bound(timeout))
        finally:
            if not h.done:
                h.cancel()

    def subscribe(self, job_id: str, *, from_seq: int = 0, owner: str | None = None) -> JobHandle:
        """Follow a job submitted elsewhere (same owner, or any job on an open broker), replayed from
        output position `from_seq`. Raises Forbidden / UnknownJob from the handle."""
        frames = checked_frames(p.Subscribe(job_id, owner if owner is not None else self.owner, from_seq))
        return self._open(JobHandle(self, job_id, from_seq), frames)

    def cancel(self, job_id: str, *, owner: str | None = None, timeout: float = 5.0) -> None:
        """Cancel any job this client may access; raises Forbidden, UnknownJob or BrokerUnavailable."""
        frames = checked_frames(p.Cancel(job_id, owner if owner is not None else self.owner))
        timeout = wait_seconds(timeout, 5.0)
        w: queue.Queue[Any] = queue.Queue()
        self._waiters[job_id] = w
        self._send_frames(job_id, frames)
        self._wait_reply(w, timeout)

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The broker's counters, queue depths and workers."""
        timeout = wait_seconds(timeout, 5.0)
        w: queue.Queue[Any] = queue.Queue()
        self._stats_waiters.append(w)
        self._send(p.StatsRequest())
        reply = self._wait_reply(w, timeout)
        assert isinstance(reply, p.StatsReply)
        return reply.stats

    def close(self) -> None:
        """Say goodbye (the broker cancels this client's cancel-on-disconnect jobs) and stop the IO thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with self._push_lock, contextlib.suppress(zmq.ZMQError):
                self._push.send_multipart([b"", *p.encode(p.Bye())], zmq.NOBLOCK)
                self._push.send_multipart([b"__close__"], zmq.NOBLOCK)
            self._thread.join(5.0)
        self._push.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------------

    def _wait_bound(self, timeout: float | None) -> float:
        t = timeout if timeout is not None else self.timeout
        return self.idle_timeout if t is None else t + self.broker_timeout

    def _run(self, h: JobHandle, timeout: float | None) -> Result:
        try:
            return h.result(self._wait_bound(timeout))
        finally:
            if not h.done:
                h.cancel()

    def _wait_reply(self, w: queue.Queue[Any], timeout: float) -> Any:
        try:
            item = w.get(timeout=timeout)
        except queue.Empty:
            raise BrokerUnavailable(f"no reply within {timeout}s") from None
        if isinstance(item, p.Fail):
            raise terminal_error(item)
        if isinstance(item, TokenmillError):
            raise item
        return item

    def _send(self, msg: p.Message) -> None:
        self._send_frames(getattr(msg, "job_id", ""), p.encode(msg))

    def _send_frames(self, job_id: str, frames: list[bytes]) -> None:
        if self._closed or not self._thread.is_alive():
            raise BrokerUnavailable("client is closed")
        with self._push_lock:
            self._push.send_multipart([job_id.encode(), *frames])

    def _deliver(self, handle: Any, item: Any) -> None:
        handle._q.put(item)

    def _deliver_waiter(self, waiter: Any, item: Any) -> None:
        waiter.put(item)

    def _io_main(self) -> None:
        """The IO thread: forward commands, route replies, ping, detect a silent broker."""
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        last_heard = next_ping = time.monotonic()
        was_open = False
        try:
            while True:
                events = dict(poller.poll(max(1, int(self.heartbeat_interval * 250))))
                if self._monitor in events:
                    self._read_monitor()
                if self._pull in events and not self._forward_commands():
                    return
                if self._dealer in events:
                    last_heard = self._read_replies(last_heard)
                now = time.monotonic()
                self._expire_unacked(now)
                is_open = bool(self._handles or self._waiters or self._stats_waiters)
                if is_open and not was_open:
                    last_heard = now  # the silence clock starts when we start expecting something
                was_open = is_open
                if not is_open:
                    continue
                if now - last_heard > self.broker_timeout:
                    self._fail_all(f"broker {self.address} silent for {self.broker_timeout}s")
                    last_heard = now
                elif now >= next_ping:
                    next_ping = now + self.heartbeat_interval
                    with contextlib.suppress(zmq.Again):  # no connected broker: silence will tell
                        self._dealer.send_multipart(p.encode(p.Ping()), zmq.NOBLOCK)
        except zmq.ZMQError:
            self._fail_all("client socket failed")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.disable_monitor()
            self._monitor.close(linger=0)
            self._dealer.close(linger=200)
            self._pull.close(linger=0)

    def _read_monitor(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_monitor_event(int(ev["event"]), int(ev["value"]))

    def _forward_commands(self) -> bool:
        """Send queued commands to the broker; False when asked to close."""
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames == [b"__close__"]:
                return False
            job_id = frames[0].decode()
            try:
                if self._auth_refused and job_id:
                    raise zmq.Again  # the broker refused this client: nothing it sends can be answered
                self._dealer.send_multipart(frames[1:], zmq.NOBLOCK)
            except zmq.Again:
                h = self._handles.pop(job_id, None)
                if h is not None:  # no connection (refused handshake, ...) or a full queue
                    self._deliver(h, self._unsendable(job_id))

    def _read_replies(self, last_heard: float) -> float:
        for _ in range(10_000):
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            last_heard = time.monotonic()
            self._route(frames)
        return last_heard
