"""Issue 13, the SDK side: a request the broker would refuse as malformed raises InvalidRequest at once
(item 3, against a real broker and worker on 127.0.0.1), every call returns or raises a tokenmill error
within its bound (a property test over arbitrary arguments), and the smaller SDK items (booleans as
integers, out-of-range seed and priority, lone surrogates, unknown chat roles). Plus the two safety nets
that need no broker fault to be seen: a job the broker never acknowledges fails in bounded time, and a
PONG from a new broker instance fails the jobs the old one held (a raw ROUTER plays the broker)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from helpers_net import FAKE, addr, free_port, procs_ctx, wait_workers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.client import AsyncClient, BrokerUnavailable, Client, InvalidRequest, TokenmillError
from tokenmill.protocol import SamplingParams
from tokenmill.protocol import wire as p

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def broker_addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path_factory.mktemp("sdk")) as ps:
        ps.broker(front, back)
        ps.worker(back, model=FAKE, name="fake0")
        with Client(addr(front)) as c:
            wait_workers(c, 1)
        yield addr(front)


def outcome(fn: Callable[[], Any], limit: float) -> tuple[Any, BaseException | None, float]:
    """Run `fn` on a thread: (value, exception, seconds); fails the test if it runs past `limit`."""
    box: dict[str, Any] = {}

    def target() -> None:
        t0 = time.monotonic()
        try:
            box["value"] = fn()
        except BaseException as e:  # the test inspects whatever came out
            box["error"] = e
        box["took"] = time.monotonic() - t0

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(limit)
    if th.is_alive():
        pytest.fail(f"the call did not return within {limit}s (it hangs)")
    return box.get("value"), box.get("error"), box["took"]


def nested(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = {"k": v}
    return v


# Item 3 of the issue: each of these was answered by a FAIL with an empty job id, and the call hung.
MALFORMED: dict[str, Callable[[Client], Any]] = {
    "token_id_minus_1": lambda c: c.generate(prompt_token_ids=[1, -1, 2], max_tokens=2),
    "prompt_not_a_string": lambda c: c.generate(12, max_tokens=2),  # type: ignore[arg-type]
    "list_of_prompts": lambda c: c.generate(["a", "b"], max_tokens=2),  # type: ignore[arg-type]
    "bytes_prompt": lambda c: c.generate(b"bytes", max_tokens=2),  # type: ignore[arg-type]
    "stop_list_over_limit": lambda c: c.generate("x", max_tokens=2, stop=["s"] * 2000),
    "params_nested_too_deep": lambda c: c.generate("x", params={"max_tokens": 2, "extra": nested(20)}),
    "job_id_over_128": lambda c: c.submit("x", job_id="j" * 129, max_tokens=2).result(),
    "job_id_control_chars": lambda c: c.submit("x", job_id="bad\x01id", max_tokens=2).result(),
    "timeout_negative": lambda c: c.generate("x", max_tokens=2, timeout=-1),
    "timeout_nan": lambda c: c.generate("x", max_tokens=2, timeout=float("nan")),
    "empty_messages": lambda c: c.chat([], max_tokens=2),
    "content_an_int": lambda c: c.chat([{"role": "user", "content": 5}], max_tokens=2),  # type: ignore[dict-item]
    "stream_token_id_minus_1": lambda c: list(c.stream(prompt_token_ids=[-1], max_tokens=2)),
    "stream_empty_messages": lambda c: list(c.stream(messages=[], max_tokens=2)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_raises_invalid_request_at_once(broker_addr: str, case: str) -> None:
    with Client(broker_addr) as c:
        _, err, took = outcome(lambda: MALFORMED[case](c), 5.0)
        assert isinstance(err, InvalidRequest), repr(err)
        assert took < 1.0, f"took {took:.2f}s"
        # The broker and its worker are unharmed.
        assert len(c.generate("still serving", max_tokens=2).token_ids) == 2


# The smaller items of the issue, on the SDK side (each raised a raw msgpack / Unicode exception, or
# was accepted as something else).
SMALLER: dict[str, tuple[Callable[[Client], Any], str]] = {
    "max_tokens_true": (lambda c: c.submit("x", max_tokens=True), "max_tokens"),
    "seed_2_70": (lambda c: c.submit("x", max_tokens=2, seed=2**70), "SUBMIT"),
    "priority_2_70": (lambda c: c.submit("x", max_tokens=2, priority=2**70), "SUBMIT"),
    "lone_surrogate_prompt": (lambda c: c.submit("bad \ud800 text", max_tokens=2), "SUBMIT"),
    "lone_surrogate_in_stop": (lambda c: c.submit("x", max_tokens=2, stop=["\udfff"]), "SUBMIT"),
    "role_wizard": (lambda c: c.submit(messages=[{"role": "wizard", "content": "hi"}], max_tokens=2), "role"),
    "params_not_a_mapping": (lambda c: c.submit("x", params=[1, 2]), "mapping"),  # type: ignore[arg-type]
    "token_ids_not_a_list": (lambda c: c.submit(prompt_token_ids=5), "prompt_token_ids"),  # type: ignore[arg-type]
    "cancel_bad_id": (lambda c: c.cancel("x" * 200), "job_id"),
    "subscribe_bad_from_seq": (lambda c: c.subscribe("job", from_seq=-1), "from_seq"),
    "stats_negative_timeout": (lambda c: c.stats(timeout=-1), "timeout"),
}


@pytest.mark.parametrize("case", sorted(SMALLER))
def test_smaller_items_raise_invalid_request_from_the_call(broker_addr: str, case: str) -> None:
    call, match = SMALLER[case]
    with Client(broker_addr) as c:
        _, err, took = outcome(lambda: call(c), 5.0)
        assert isinstance(err, InvalidRequest), repr(err)
        assert match in str(err)
        assert took < 1.0


def test_booleans_are_never_integers_in_sampling_params() -> None:
    for field in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs"):
        with pytest.raises(InvalidRequest, match=field):
            SamplingParams.from_dict({field: True, "max_tokens": 4} if field != "max_tokens" else {field: True})
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(ignore_eos=1)  # type: ignore[arg-type]


def test_the_decoder_refuses_unknown_chat_roles() -> None:
    """The rule lives in the protocol, so the broker applies it to every client, not only this SDK."""
    good = p.Submit("j", "", p.RequestInput(messages=[{"role": "tool", "content": "x"}]), {})
    assert p.decode(p.encode(good), p.CLIENT_TO_BROKER) == good
    bad = p.Submit("j", "", p.RequestInput(messages=[{"role": "wizard", "content": "x"}]), {})
    with pytest.raises(p.ProtocolError, match="role"):
        p.decode(p.encode(bad), p.CLIENT_TO_BROKER)


def test_client_settings_are_checked() -> None:
    for kw in ({"broker_timeout": 0}, {"heartbeat_interval": float("nan")}, {"idle_timeout": -1}):
        with pytest.raises(InvalidRequest):
            Client("tcp://127.0.0.1:9", **kw)  # type: ignore[arg-type]


# ---- the property: every call returns, or raises a tokenmill error, within its bound ----------------

BROKER_TIMEOUT = 2.0
JOB_TIMEOUT = 0.5  # the client's default job deadline (calls may name their own, valid or not)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.binary(max_size=6))
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=6), scalars, max_size=3),
                   st.lists(st.integers(-2, 600), max_size=6))
param_names = st.sampled_from([*SamplingParams.__dataclass_fields__, "temprature", "n", ""])
# Mostly valid arguments (so that calls reach the broker and the worker), each possibly spoiled.
good_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 8), "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(0, 50), "seed": st.integers(0, 2**40), "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2)})
sampling = st.one_of(good_sampling, st.tuples(good_sampling, st.dictionaries(param_names, values, max_size=2))
                     .map(lambda t: {**t[0], **t[1]}))


def maybe(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, good, values)


words = st.characters(codec="utf-8", categories=["L", "N", "P", "Zs"])
prompts = maybe(st.text(words, max_size=40))
token_ids = maybe(st.lists(st.integers(0, 400), min_size=1, max_size=6))
models = maybe(st.sampled_from(["", "fake", "no-such-model"]))
messages = maybe(st.lists(st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "system", "assistant",
                                                                                  "wizard"])),
                                                   "content": maybe(st.text(words, max_size=30))}), max_size=3))
job_timeouts = maybe(st.one_of(st.none(), st.floats(0.01, 0.5)))
job_ids = maybe(st.one_of(st.none(), st.text(words, min_size=1, max_size=20)))
wait_timeouts = maybe(st.floats(0.0, 2.0))

_OWN_ARGS = {"prompt", "messages", "prompt_token_ids", "model", "params", "timeout", "job_id", "priority",
             "cancel_on_disconnect", "from_seq", "owner"}

calls = st.one_of(
    st.tuples(st.just("generate"), st.one_of(
        st.fixed_dictionaries({"prompt": prompts}, optional={"model": models, "params": maybe(sampling),
                                                              "timeout": job_timeouts}),
        st.fixed_dictionaries({"prompt_token_ids": token_ids}, optional={"timeout": job_timeouts}),
        st.fixed_dictionaries({}, optional={"prompt": prompts, "prompt_token_ids": token_ids}))),
    st.tuples(st.just("chat"), st.fixed_dictionaries({"messages": messages}, optional={
        "model": models, "params": maybe(sampling), "timeout": job_timeouts})),
    st.tuples(st.just("stream"), st.fixed_dictionaries({}, optional={
        "prompt": prompts, "messages": messages, "prompt_token_ids": token_ids, "timeout": job_timeouts})),
    st.tuples(st.just("submit"), st.fixed_dictionaries({"prompt": prompts}, optional={
        "job_id": job_ids, "priority": maybe(st.integers(-5, 5)), "cancel_on_disconnect": maybe(st.booleans()),
        "timeout": job_timeouts})),
    st.tuples(st.just("subscribe"), st.fixed_dictionaries({"job_id": job_ids}, optional={
        "from_seq": maybe(st.integers(0, 5)), "owner": values})),
    st.tuples(st.just("cancel"), st.fixed_dictionaries({"job_id": job_ids}, optional={
        "owner": values, "timeout": wait_timeouts})),
    st.tuples(st.just("stats"), st.fixed_dictionaries({}, optional={"timeout": wait_timeouts})),
)


def _bound(kwargs: dict[str, Any]) -> float:
    """The longest a call may take: its own timeout when that is a sane number, plus the broker's."""
    t = kwargs.get("timeout")
    own = t if type(t) in (int, float) and 0 <= t <= 2.0 else JOB_TIMEOUT
    return own + BROKER_TIMEOUT + 3.0


def _invoke(c: Client, name: str, kwargs: dict[str, Any], extra: dict[str, Any]) -> Any:
    if name == "generate":
        return c.generate(**kwargs, **extra)
    if name == "chat":
        return c.chat(**kwargs, **extra)
    if name == "stream":
        return list(c.stream(**kwargs, **extra))
    if name == "submit":
        return c.submit(**kwargs, **extra).result()
    if name == "subscribe":
        return c.subscribe(**kwargs).result()
    if name == "cancel":
        return c.cancel(**kwargs)
    return c.stats(**kwargs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(call=calls, extra=st.one_of(good_sampling, good_sampling, sampling))
def test_every_sdk_call_returns_or_raises_a_tokenmill_error_in_bounded_time(
        sdk_client: Client, call: tuple[str, dict[str, Any]], extra: dict[str, Any]) -> None:
    name, kwargs = call
    extra = {k: v for k, v in extra.items() if k not in _OWN_ARGS} if name in ("generate", "chat", "stream",
                                                                                 "submit") else {}
    _, err, _took = outcome(lambda: _invoke(sdk_client, name, kwargs, extra), _bound(kwargs))
    assert err is None or isinstance(err, TokenmillError), f"{type(err).__name__}: {err}"


@pytest.fixture(scope="module")
def sdk_client(broker_addr: str) -> Iterator[Client]:
    with Client(broker_addr, timeout=JOB_TIMEOUT, broker_timeout=BROKER_TIMEOUT, heartbeat_interval=0.2) as c:
        yield c


@pytest.fixture(scope="module")
def async_sdk(broker_addr: str) -> Iterator[tuple[Any, AsyncClient]]:
    """An AsyncClient living on an event loop of its own thread (the property test submits to it)."""
    import asyncio

    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    c = AsyncClient(broker_addr, timeout=JOB_TIMEOUT, broker_timeout=BROKER_TIMEOUT, heartbeat_interval=0.2)
    yield loop, c
    asyncio.run_coroutine_threadsafe(c.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    th.join(10)


async def _ainvoke(c: AsyncClient, name: str, kwargs: dict[str, Any], extra: dict[str, Any]) -> Any:
    if name == "generate":
        return await c.generate(**kwargs, **extra)
    if name == "chat":
        return await c.chat(**kwargs, **extra)
    if name == "stream":
        return [ev async for ev in c.stream(**kwargs, **extra)]
    if name == "submit":
        return await (await c.submit(**kwargs, **extra)).result()
    if name == "subscribe":
        return await (await c.subscribe(**kwargs)).result()
    if name == "cancel":
        return await c.cancel(**kwargs)
    return await c.stats(**kwargs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(call=calls, extra=st.one_of(good_sampling, good_sampling, sampling))
def test_every_async_sdk_call_returns_or_raises_a_tokenmill_error_in_bounded_time(
        async_sdk: tuple[Any, AsyncClient], call: tuple[str, dict[str, Any]], extra: dict[str, Any]) -> None:
    import asyncio

    loop, c = async_sdk
    name, kwargs = call
    extra = {k: v for k, v in extra.items() if k not in _OWN_ARGS} if name in ("generate", "chat", "stream",
                                                                                 "submit") else {}
    fut = asyncio.run_coroutine_threadsafe(_ainvoke(c, name, kwargs, extra), loop)
    _, err, _took = outcome(lambda: fut.result(), _bound(kwargs))
    assert err is None or isinstance(err, TokenmillError), f"{type(err).__name__}: {err}"


def test_async_client_checks_requests_too(broker_addr: str) -> None:
    import asyncio

    async def main() -> list[str]:
        out = []
        async with AsyncClient(broker_addr) as c:
            for bad in ({"prompt_token_ids": [-1]}, {"messages": []}, {"prompt": "x", "seed": 2**70},
                        {"prompt": "x", "timeout": float("nan")}):
                try:
                    await asyncio.wait_for(c.generate(**bad, max_tokens=2), 2.0)  # type: ignore[arg-type]
                except InvalidRequest as e:
                    out.append(type(e).__name__)
            r = await c.generate("fine", max_tokens=2)
            out.append(str(len(r.token_ids)))
        return out

    assert asyncio.run(asyncio.wait_for(main(), 30)) == ["InvalidRequest"] * 4 + ["2"]


# ---- safety nets, against a raw ROUTER playing the broker ---------------------------------------------


class FakeBroker:
    """A ROUTER on 127.0.0.1 answering as told; `serve(seconds, on)` handles what arrives."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def serve(self, seconds: float, on: Callable[[bytes, p.Message], list[p.Message]]) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.sock.poll(20):
                ident, *frames = self.sock.recv_multipart()
                for reply in on(ident, p.decode(frames, p.CLIENT_TO_BROKER)):
                    self.sock.send_multipart([ident, *p.encode(reply)])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def test_a_job_the_broker_never_acknowledges_fails_in_bounded_time() -> None:
    fb = FakeBroker()
    try:
        with Client(addr(fb.port), broker_timeout=1.0, heartbeat_interval=0.1) as c:
            h = c.submit("x", max_tokens=2)
            # Alive (PONGs), but the SUBMIT gets no answer: the FAIL that names no job, for instance.
            th = threading.Thread(target=fb.serve, args=(3.0, lambda _i, m: [p.Pong()] if isinstance(m, p.Ping)
                                                         else [p.Fail("", "protocol", "malformed")]))
            th.start()
            t0 = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="did not acknowledge"):
                h.result(timeout=10)
            assert time.monotonic() - t0 < 2.0
            th.join()
    finally:
        fb.close()


def test_a_new_broker_instance_fails_the_jobs_the_old_one_held() -> None:
    fb = FakeBroker()
    state = {"instance": "aaaa"}

    def on(_ident: bytes, m: p.Message) -> list[p.Message]:
        if isinstance(m, p.Submit):
            return [p.Ack(m.job_id, instance=state["instance"]),
                    p.Stream([p.StreamChunk(m.job_id, 0, [5], "a")])]
        if isinstance(m, p.Ping):
            return [p.Pong(state["instance"])]
        return []

    try:
        with Client(addr(fb.port), broker_timeout=5.0, heartbeat_interval=0.1) as c:
            th = threading.Thread(target=fb.serve, args=(3.0, on))
            th.start()
            h = c.submit("x", max_tokens=50)
            events = h.stream(timeout=10)
            assert next(events).token_ids == [5]
            state["instance"] = "bbbb"  # the broker restarted: its PONGs name a new instance
            t0 = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="restarted"):
                next(events)
            assert time.monotonic() - t0 < 1.5
            th.join()
    finally:
        fb.close()



def test_async_client_closed_before_its_tasks_ran_does_not_hang() -> None:
    """close() right after the socket opened, before the reader / heartbeat / monitor tasks took a first step: a
    task cancelled then never runs its finally, so the monitor socket stays open; closing must not wait for it
    (zmq's Context.term() would, forever)."""
    import asyncio

    async def open_and_close() -> None:
        c = AsyncClient(f"tcp://127.0.0.1:{free_port()}")
        c._start()  # what the first submit does; no await in between
        await c.close()

    done = threading.Event()

    def run() -> None:
        asyncio.run(open_and_close())
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10.0)
    assert done.is_set(), "AsyncClient.close() hung"
