"""One HTTP request's broker jobs: one per choice (prompt x n), submitted together, their first events
awaited before any answer starts (so a refused job still gets its HTTP status), then their events merged
in arrival order, in batches: every event already delivered when the consumer asks (a stream that fell
behind catches up in one HTTP write). Records the per-request metrics as events pass."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from tokenmill.client import AsyncClient, AsyncJobHandle, StreamEvent
from tokenmill.gateway.errors import APIError, from_tokenmill
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.protocol.errors import TokenmillError

log = structlog.get_logger("tokenmill.gateway")
_background: set[asyncio.Task[Any]] = set()  # cancels in flight (kept referenced until done)


@dataclass(frozen=True)
class ChoiceSpec:
    """What one choice generates from: exactly one of prompt / prompt_token_ids / messages."""

    index: int
    params: dict[str, Any]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


Batch = list[tuple[int, StreamEvent]]  # (choice index, event) pairs, in arrival order


class _Choice:
    """A submitted choice: its handle, event batches, first batch and latency bookkeeping."""

    __slots__ = ("first", "first_token_at", "handle", "index", "last_token_at")

    def __init__(self, index: int, handle: AsyncJobHandle) -> None:
        self.index = index
        self.handle = handle
        self.first: list[StreamEvent] | None = None  # the first events, until they are taken
        self.first_token_at: float | None = None
        self.last_token_at = 0.0


class RequestRun:
    """The jobs of one request. `await open()` submits them and waits for each one's first event (raising
    APIError if any job is refused); `events()` then yields (choice index, event) until every job ended."""

    def __init__(self, client: AsyncClient, model: str, request_id: str, specs: list[ChoiceSpec],
                 metrics: GatewayMetrics, timeout: float | None = None) -> None:
        self.client, self.model, self.request_id = client, model, request_id
        self.specs = specs
        self.timeout = timeout
        self.arrival = time.monotonic()
        self.choices: list[_Choice] = []
        self._merge: AsyncIterator[Batch] | None = None
        self.metrics = metrics
        m = metrics
        self._ttft, self._itl = m.ttft.labels(model), m.itl.labels(model)

    def job_id(self, spec: ChoiceSpec) -> str:
        """The broker job id of a choice: the request id and the choice index (grep either in any log)."""
        return f"{self.request_id}-{spec.index}"

    async def open(self) -> None:
        try:
            for spec in self.specs:
                handle = await self.client.submit(
                    spec.prompt, messages=spec.messages, prompt_token_ids=spec.prompt_token_ids, model=self.model,
                    params=spec.params, timeout=self.timeout, job_id=self.job_id(spec))
                self.choices.append(_Choice(spec.index, handle))
            firsts = await asyncio.gather(*(c.handle.next_events(None) for c in self.choices), return_exceptions=True)
        except TokenmillError as e:
            self.cancel()
            raise from_tokenmill(e) from None
        except BaseException:
            self.cancel()
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            self.cancel()
            err = errors[0]
            if isinstance(err, TokenmillError):
                raise from_tokenmill(err) from None
            raise err
        for c, first in zip(self.choices, firsts):
            assert isinstance(first, list)
            c.first = first

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """(choice index, event) in arrival order; the last event of each choice has finish_reason.
        Raises APIError for a job that fails midway."""
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[Batch]:
        """The events as `events()` yields them, grouped: each batch is what had arrived when asked for."""
        while batch := await self.next_batch():
            yield batch

    async def next_batch(self) -> Batch:
        """The (choice index, event) pairs that arrived since the last call, waiting for one; [] once every
        job ended. Raises APIError for a job that fails midway."""
        try:
            if len(self.choices) == 1:  # the common case: no task, no queue between the handle and here
                c = self.choices[0]
                if c.first is not None:
                    evs, c.first = c.first, None
                else:
                    evs = await c.handle.next_events(None)
                return [(c.index, self._observe(c, ev)) for ev in evs]
            if self._merge is None:
                self._merge = self._merged()
            return await anext(self._merge, [])
        except TokenmillError as e:
            raise from_tokenmill(e) from None

    async def _merged(self) -> AsyncIterator[Batch]:
        q: asyncio.Queue[tuple[_Choice, list[StreamEvent] | BaseException | None]] = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                assert c.first is not None
                evs, c.first = c.first, None
                while evs:
                    q.put_nowait((c, evs))
                    evs = await c.handle.next_events(None)
                q.put_nowait((c, None))
            except Exception as e:  # handed to the consumer, which raises it
                q.put_nowait((c, e))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            remaining = len(tasks)
            while remaining:
                batch: Batch = []
                c, item = await q.get()
                while True:
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        batch.extend((c.index, self._observe(c, ev)) for ev in item)
                    if q.empty():
                        break
                    c, item = q.get_nowait()
                if batch:
                    yield batch
        finally:
            for t in tasks:
                t.cancel()

    def _observe(self, c: _Choice, ev: StreamEvent) -> StreamEvent:
        now = time.monotonic()
        if ev.token_ids:
            if c.first_token_at is None:
                c.first_token_at = now
                self._ttft.observe(now - self.arrival)
            else:
                self.metrics.observe_soon(self._itl, now - c.last_token_at)
            c.last_token_at = now
        if ev.finish_reason is not None:
            self._finished(c, ev, now)
        return ev

    def _finished(self, c: _Choice, ev: StreamEvent, now: float) -> None:
        m, model = self.metrics, self.model
        log.debug("job_finished", job_id=c.handle.job_id, finish_reason=ev.finish_reason,
                  completion_tokens=ev.usage.completion_tokens if ev.usage else None,
                  seconds=round(now - self.arrival, 4))
        m.request_success.labels(model, ev.finish_reason).inc()
        m.e2e.labels(model).observe(now - self.arrival)
        if ev.queue_time is not None:
            m.queue_time.labels(model).observe(ev.queue_time)
        u = ev.usage
        if u is None:
            return
        m.prompt_tokens.labels(model).inc(u.prompt_tokens)
        m.generation_tokens.labels(model).inc(u.completion_tokens)
        m.prefix_queries.labels(model).inc(u.prompt_tokens)
        m.prefix_hits.labels(model).inc(u.cached_tokens)
        m.request_prompt_tokens.labels(model).observe(u.prompt_tokens)
        m.request_generation_tokens.labels(model).observe(u.completion_tokens)
        if c.first_token_at is not None and u.completion_tokens > 1:
            m.tpot.labels(model).observe((c.last_token_at - c.first_token_at) / (u.completion_tokens - 1))

    def cancel(self) -> None:
        """Cancel every job that has not ended (in the background: safe from a cancelled task)."""
        open_handles = [c.handle for c in self.choices if not c.handle.done]
        if not open_handles:
            return
        log.info("jobs_cancelled", job_ids=[h.job_id for h in open_handles])
        task = asyncio.get_running_loop().create_task(_cancel_all(open_handles))
        _background.add(task)
        task.add_done_callback(_background.discard)


async def _cancel_all(handles: list[AsyncJobHandle]) -> None:
    for h in handles:
        with contextlib.suppress(TokenmillError):
            await h.cancel()


async def until_disconnect(receive: Any) -> None:
    """Return when the HTTP client has gone (an ASGI `http.disconnect` message)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Any, work: Any) -> Any:
    """Await the coroutine `work`, cancelling it if the HTTP client disconnects first (then 499-like:
    raises APIError 499, which nobody will read)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, APIError):
        await task
    raise APIError(499, "client closed the connection")
