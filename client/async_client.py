"""asyncio client SDK: the same operations as `Client`, as coroutines and async iterators.

    async with AsyncClient("tcp://127.0.0.1:5555") as c:
        async for ev in c.stream("Hello", max_tokens=16):
            print(ev.text, end="", flush=True)

The socket lives on the running event loop (zmq.asyncio); a reader task routes replies to per-job
asyncio queues, a heartbeat task pings the broker while jobs are open (and fails unacknowledged jobs at
their deadline), and a monitor task watches the handshakes (a refused CURVE key: AuthenticationFailed).
Every wait is bounded as in `Client`. `run()` runs a coroutine on uvloop when it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tokenmill.client.client import (
    DEFAULT_ADDRESS,
    DEFAULT_IDLE_TIMEOUT,
    MONITOR_EVENTS,
    Assembly,
    Result,
    RouterCore,
    StreamEvent,
    _Gap,
    check_settings,
    terminal_error,
)
from tokenmill.client.requests import build_params, checked_frames, make_submit, wait_seconds
from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import BrokerUnavailable, DeadlineExceeded, TokenmillError
from tokenmill.protocol.keys import apply_client_curve, load_keypair, load_public_key

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run `coro` to completion on a new event loop (uvloop's when installed)."""
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)  # type: ignore[arg-type]


class AsyncJobHandle:
    """A submitted (or subscribed) job on an AsyncClient: `stream()`, `result()`, `cancel()`."""

    def __init__(self, client: AsyncClient, job_id: str, from_seq: int = 0) -> None:
        self._client = client
        self.job_id = job_id
        # Delivered items (chunks, DONE, FAIL, errors) and the consumer's wake-up future while it waits for
        # one: a deque and one future, not an asyncio.Queue under wait_for (a task per token on Python 3.11).
        self._items: deque[Any] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        # The waiter's deadline, and one timer that fires at or before it; a wait that ends before the timer
        # leaves it armed for the next one (a steady stream re-arms it once per timeout, not per token).
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._asm = Assembly(job_id, from_seq)
        self._accepted = asyncio.Event()
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

    async def wait_accepted(self, timeout: float | None = None) -> bool:
        """Wait until the broker acknowledged the job (None: the client's `broker_timeout`); False on timeout."""
        try:
            await asyncio.wait_for(self._accepted.wait(), wait_seconds(timeout, self._client.broker_timeout))
            return True
        except TimeoutError:
            return False

    async def stream(self, timeout: float | None = None) -> AsyncIterator[StreamEvent]:
        """Yield the job's events in order (the last has `finish_reason`); raises the job's typed error,
        or DeadlineExceeded when no event arrives for `timeout` seconds (None: the client's `idle_timeout`)."""
        timeout = wait_seconds(timeout, self._client.idle_timeout)
        if self._error is not None:
            raise self._error
        while not self._finished:
            if not self._items:
                await self._wait_item(timeout)
            ev = await self._consume(self._items.popleft())
            if ev is not None:
                yield ev

    async def next_events(self, timeout: float | None = None) -> list[StreamEvent]:
        """Every event delivered since the last call, in order, waiting up to `timeout` seconds (None: the
        client's `idle_timeout`) for the first; [] once the stream has ended. Raises as `stream()` does (an
        error after some events: on the next call). A consumer that fell behind catches up in one call (the
        gateway writes such a list as one HTTP write)."""
        if self._error is not None:
            raise self._error
        batch: list[StreamEvent] = []
        while not batch and not self._finished:
            if not self._items:
                await self._wait_item(wait_seconds(timeout, self._client.idle_timeout))
            while self._items and not self._finished:
                item = self._items[0]
                if isinstance(item, p.StreamChunk):  # the common case, without a coroutine per chunk
                    self._items.popleft()
                    try:
                        ev = self._asm.on_chunk(item)
                    except _Gap:
                        await self._resubscribe()
                        continue
                elif isinstance(item, p.Done) or not batch:
                    ev = await self._consume(self._items.popleft())  # the final event, or raises the error
                else:
                    break  # an error: raised on the next call, after the events before it
                if ev is not None:
                    batch.append(ev)
        return batch

    async def stream_batches(self, timeout: float | None = None) -> AsyncIterator[list[StreamEvent]]:
        """As `stream()`, in lists: each one every event delivered when asked for (see `next_events`)."""
        while batch := await self.next_events(timeout):
            yield batch

    def _put(self, item: Any) -> None:
        self._items.append(item)
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait_item(self, timeout: float) -> None:
        """Wait until an item is delivered; DeadlineExceeded after `timeout` seconds without one."""
        loop = asyncio.get_running_loop()
        w = self._wakeup = loop.create_future()
        self._deadline = loop.time() + timeout
        if self._timer is not None and self._timer.when() > self._deadline:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._on_timer)
        try:
            await w
        finally:
            if self._wakeup is w:
                self._wakeup = None
        if not self._items:
            raise DeadlineExceeded(f"no event for {timeout}s", job_id=self.job_id)

    def _on_timer(self) -> None:
        self._timer = None
        w = self._wakeup
        if w is None or w.done():
            return  # nobody waits: the next wait arms a timer of its own
        loop = asyncio.get_running_loop()
        if loop.time() >= self._deadline - 0.001:  # (a loop's timers may fire up to a tick early)
            w.set_result(None)  # the waiter finds no item: its deadline passed
        else:
            self._timer = loop.call_at(self._deadline, self._on_timer)

    async def _consume(self, item: Any) -> StreamEvent | None:
        if isinstance(item, p.StreamChunk):
            try:
                return self._asm.on_chunk(item)
            except _Gap:
                await self._resubscribe()
                return None
        if self._timer is not None:  # the stream ends here: no more waits
            self._timer.cancel()
            self._timer = None
        if isinstance(item, p.Done):
            self._finished = True
            return self._asm.on_done(item)
        self._error = terminal_error(item) if isinstance(item, p.Fail) else item
        assert self._error is not None
        raise self._error

    async def _resubscribe(self) -> None:
        """Tokens are missing: ask the broker to replay from the first one not seen."""
        await self._client._send(p.Subscribe(self.job_id, self._client.owner, self._asm.next_seq))

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the whole output; `timeout` bounds each wait for the next event."""
        async for _ in self.stream(timeout):
            pass
        return self._asm.result

    async def cancel(self) -> None:
        """Ask the broker to cancel the job; the stream then ends with Cancelled."""
        await self._client._send(p.Cancel(self.job_id, self._client.owner))


class AsyncClient(RouterCore):
    """asyncio client of a tokenmill broker; arguments as for `Client`. Use it from one event loop."""

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
        self._curve = (curve_server_key, curve_secret_key)
        self._handles: dict[str, AsyncJobHandle] = {}
        self._waiters: dict[str, asyncio.Future[Any]] = {}
        self._stats_waiters: list[asyncio.Future[Any]] = []
        self._unacked: deque[tuple[float, AsyncJobHandle]] = deque()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = 0.0
        self._closed = False

    # ---- public API -------------------------------------------------------------------------------

    async def submit(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None, model: str = "",
                     params: Mapping[str, Any] | None = None, timeout: float | None = None,
                     job_id: str | None = None, priority: int = 0, cancel_on_disconnect: bool = True,
                     **sampling: Any) -> AsyncJobHandle:
        """Submit a job and return its handle at once; see `Client.submit`."""
        msg, frames = make_submit(job_id, model, prompt, messages, prompt_token_ids, build_params(params, sampling),
                                  timeout if timeout is not None else self.timeout, priority, self.owner,
                                  cancel_on_disconnect)
        return await self._open(AsyncJobHandle(self, msg.job_id), frames)

    async def _open(self, handle: AsyncJobHandle, frames: list[bytes]) -> AsyncJobHandle:
        """Register `handle`, send `frames` (its SUBMIT or SUBSCRIBE) and start its acknowledgement clock."""
        self._handles[handle.job_id] = handle
        try:
            await self._send_frames(frames)
        except BaseException:
            self._handles.pop(handle.job_id, None)
            raise
        self._expect_ack(handle)
        return handle

    async def generate(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       model: str = "", params: Mapping[str, Any] | None = None, timeout: float | None = None,
                       **sampling: Any) -> Result:
        """Run a prompt to completion and return the whole Result."""
        h = await self.submit(prompt, prompt_token_ids=prompt_token_ids, model=model, params=params,
                              timeout=timeout, **sampling)
        return await self._run(h, timeout)

    async def chat(self, messages: list[dict[str, str]], *, model: str = "",
                   params: Mapping[str, Any] | None = None, timeout: float | None = None,
                   **sampling: Any) -> Result:
        """Run a chat (a list of {"role", "content"} messages) to completion."""
        h = await self.submit(messages=messages, model=model, params=params, timeout=timeout, **sampling)
        return await self._run(h, timeout)

    async def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None, model: str = "",
                     params: Mapping[str, Any] | None = None, timeout: float | None = None,
                     **sampling: Any) -> AsyncIterator[StreamEvent]:
        """Submit and yield events as they arrive; leaving early cancels the job."""
        h = await self.submit(prompt, messages=messages, prompt_token_ids=prompt_token_ids, model=model,
                              params=params, timeout=timeout, **sampling)
        try:
            async for ev in h.stream(self._wait_bound(timeout)):
                yield ev
        finally:
            if not h.done:
                await h.cancel()

    async def subscribe(self, job_id: str, *, from_seq: int = 0, owner: str | None = None) -> AsyncJobHandle:
        """Follow a job submitted elsewhere from output position `from_seq`; see `Client.subscribe`."""
        frames = checked_frames(p.Subscribe(job_id, owner if owner is not None else self.owner, from_seq))
        return await self._open(AsyncJobHandle(self, job_id, from_seq), frames)

    async def cancel(self, job_id: str, *, owner: str | None = None, timeout: float = 5.0) -> None:
        """Cancel any job this client may access; raises Forbidden, UnknownJob or BrokerUnavailable."""
        frames = checked_frames(p.Cancel(job_id, owner if owner is not None else self.owner))
        timeout = wait_seconds(timeout, 5.0)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters[job_id] = fut
        await self._send_frames(frames)
        await self._wait_reply(fut, timeout)

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The broker's counters, queue depths and workers."""
        timeout = wait_seconds(timeout, 5.0)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        await self._send(p.StatsRequest())
        reply = await self._wait_reply(fut, timeout)
        assert isinstance(reply, p.StatsReply)
        return reply.stats

    async def close(self) -> None:
        """Say goodbye (the broker cancels this client's cancel-on-disconnect jobs) and stop the tasks."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart(p.encode(p.Bye()), zmq.NOBLOCK)
            self._sock.close(linger=200)
        if self._ctx is not None:
            # destroy, not term: a task cancelled before its first step never ran its finally, so the monitor
            # socket it owns is still open, and term() would wait for it forever
            self._ctx.destroy(linger=200)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- internals --------------------------------------------------------------------------------

    def _wait_bound(self, timeout: float | None) -> float:
        t = timeout if timeout is not None else self.timeout
        return self.idle_timeout if t is None else t + self.broker_timeout

    async def _run(self, h: AsyncJobHandle, timeout: float | None) -> Result:
        try:
            return await h.result(self._wait_bound(timeout))
        finally:
            if not h.done:
                await h.cancel()

    async def _wait_reply(self, fut: asyncio.Future[Any], timeout: float) -> Any:
        try:
            item = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise BrokerUnavailable(f"no reply within {timeout}s") from None
        if isinstance(item, p.Fail):
            raise terminal_error(item)
        if isinstance(item, TokenmillError):
            raise item
        return item

    def _start(self) -> zmq.asyncio.Socket:
        if self._sock is not None:
            return self._sock
        self._ctx = zmq.asyncio.Context()
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.MAXMSGSIZE, 2 * p.MAX_BODY_BYTES)
        server_key, secret_file = self._curve
        if server_key is not None and secret_file is not None:
            apply_client_curve(s, load_public_key(server_key), load_keypair(secret_file))
        monitor = s.get_monitor_socket(MONITOR_EVENTS)
        s.connect(self.address)
        self._sock = s
        # Empty contexts: the tasks outlive the call that started them (and the log ids bound in its context).
        self._tasks = [asyncio.create_task(coro, name=name, context=contextvars.Context()) for coro, name in (
            (self._reader(), f"tokenmill-reader-{uuid.uuid4().hex[:6]}"), (self._heartbeat(), "tokenmill-heartbeat"),
            (self._watch(monitor), "tokenmill-monitor"))]
        return s

    async def _send(self, msg: p.Message) -> None:
        await self._send_frames(p.encode(msg))

    async def _send_frames(self, frames: list[bytes]) -> None:
        if self._closed:
            raise BrokerUnavailable("client is closed")
        if self._auth_refused:
            raise self._unsendable(None)
        sock = self._start()
        if not self._is_open_besides():
            self._last_heard = time.monotonic()  # the silence clock starts when we start expecting
        try:
            await sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            raise self._unsendable(None) from None

    def _is_open_besides(self) -> bool:
        n = len(self._handles) + len(self._waiters) + len(self._stats_waiters)
        return n > 1

    def _deliver(self, handle: Any, item: Any) -> None:
        handle._put(item)

    def _deliver_waiter(self, waiter: Any, item: Any) -> None:
        if not waiter.done():
            waiter.set_result(item)

    async def _reader(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            self._last_heard = time.monotonic()
            self._route(frames)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Handshake outcomes from the socket's monitor (a refused key fails everything open)."""
        assert self._sock is not None
        try:
            while True:
                ev = parse_monitor_message(await monitor.recv_multipart())
                self._on_monitor_event(int(ev["event"]), int(ev["value"]))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            monitor.close(linger=0)

    async def _heartbeat(self) -> None:
        assert self._sock is not None
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._expire_unacked(time.monotonic())
            if not (self._handles or self._waiters or self._stats_waiters):
                continue
            if time.monotonic() - self._last_heard > self.broker_timeout:
                self._fail_all(f"broker {self.address} silent for {self.broker_timeout}s")
                self._last_heard = time.monotonic()
                continue
            with contextlib.suppress(zmq.Again):
                await self._sock.send_multipart(p.encode(p.Ping()), zmq.NOBLOCK)
