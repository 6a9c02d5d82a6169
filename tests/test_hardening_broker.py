"""Issue 13, the broker side, with real processes on 127.0.0.1: a restarted broker ends every open stream
in bounded time (item 4), unread STATS requests do not grow the broker (item 5) and a garbage run leaves
no lasting growth, the job id of a malformed request is echoed, a prompt that cannot fit is refused before
dispatch, a job that kills its worker is not charged to the job that shared it, and a model no worker
ever served is answered at once."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from helpers_net import FAKE, Procs, addr, fake_text, free_port, procs_ctx, wait_until, wait_workers

from tokenmill.broker.budget import Budget, BudgetConfig, ReplyKind
from tokenmill.client import BrokerUnavailable, Client, DeadlineExceeded, InvalidRequest, JobFailed
from tokenmill.protocol import wire as p

pytestmark = pytest.mark.timeout(300)

HB = 0.2
POISON = ["--model", "fake", "--engine-factory", "tests.hardening_engines:poison_engine"]
BOUNDED = ["--model", "fake", "--engine-factory", "tests.hardening_engines:bounded_engine"]


def _fake_worker(ps: Procs, back: int, name: str, *extra: str, model: list[str] = FAKE,
                 step_s: float = 0.002) -> Any:
    return ps.spawn(["worker", "--broker", addr(back), *model, "--heartbeat-interval", str(HB), "--name", name,
                     *extra], name, env={"TOKENMILL_FAKE_STEP_S": str(step_s)})


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _dealer(ctx: zmq.Context, port: int) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr(port))
    return s


# ---- item 4: a broker restart -----------------------------------------------------------------------


def test_a_restarted_broker_ends_every_open_stream_within_15s(tmp_path: Path) -> None:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        broker = ps.broker(front, back)
        _fake_worker(ps, back, "wa", step_s=0.01)
        # A silence timeout far past the bound: what ends the streams is the new instance, not silence.
        with Client(addr(front), broker_timeout=60.0, heartbeat_interval=0.5) as c:
            wait_workers(c, 1)
            streams = [c.submit(f"restart {i}", max_tokens=3000).stream(timeout=60) for i in range(8)]
            for s in streams:
                next(s)
            broker.send_signal(signal.SIGKILL)
            broker.wait(10)
            ps.broker(front, back)  # a new broker on the same ports: it answers PINGs at once
            t0 = time.monotonic()
            for s in streams:
                with pytest.raises(BrokerUnavailable, match="restarted"):
                    for _ in s:
                        pass
            took = time.monotonic() - t0
            assert took < 15.0, f"took {took:.1f}s"
            wait_workers(c, 1, timeout=30)  # the worker re-registers with the new broker, which serves
            assert len(c.generate("after the restart", max_tokens=3).token_ids) == 3


# ---- item 5 and the garbage run: memory -----------------------------------------------------------------


@pytest.fixture
def lone_broker(tmp_path: Path) -> Iterator[tuple[int, int, Any]]:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        broker = ps.broker(front, back)
        _fake_worker(ps, back, "w0")
        with Client(addr(front)) as c:
            wait_workers(c, 1)
            for _ in range(50):  # warm up: the first STATS replies allocate what every later one reuses
                c.stats()
        yield front, back, broker


def _flood_stats(ctx: zmq.Context, front: int, n: int) -> zmq.Socket:
    """n STATS requests on a connection that never reads an answer."""
    s = _dealer(ctx, front)
    s.setsockopt(zmq.SNDHWM, 0)
    frames = p.encode(p.StatsRequest())
    for _ in range(n):
        s.send_multipart(frames)
    return s


def _settled(c: Client, counter: str, target: int, timeout: float) -> None:
    """Wait until the broker counted `target` of `counter` (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and c.stats()["counters"].get(counter, 0) < target:
        time.sleep(0.2)


def test_100k_unread_stats_requests_grow_the_broker_by_under_20mb(lone_broker: tuple[int, int, Any]) -> None:
    front, _, broker = lone_broker
    before = rss_mb(broker.pid)
    ctx = zmq.Context()
    try:
        flood = _flood_stats(ctx, front, 100_000)
        with Client(addr(front)) as c:
            _settled(c, "stats_requests", 100_050, 30.0)
            time.sleep(1.0)
            grown = rss_mb(broker.pid) - before
            counters = c.stats()["counters"]
        flood.close()
    finally:
        ctx.term()
    print(f"100,000 unread STATS: the broker grew by {grown:.1f} MB")
    assert grown < 20.0, f"broker grew by {grown:.1f} MB"
    assert counters.get("stats_requests", 0) >= 100_050  # every request was read
    assert counters.get("replies_dropped_control", 0) >= 90_000  # and nearly every answer dropped


def test_a_garbage_run_leaves_no_lasting_growth(lone_broker: tuple[int, int, Any]) -> None:
    front, _, broker = lone_broker
    before = rss_mb(broker.pid)
    ctx = zmq.Context()
    try:
        socks = [_flood_stats(ctx, front, 30_000) for _ in range(3)]
        junk = _dealer(ctx, front)
        for i in range(20_000):  # malformed messages: each answered by a FAIL nobody reads
            junk.send_multipart([p.HEADER, bytes((p.Cmd.SUBMIT,)), msgpack.packb({"job_id": f"g{i}", "x": i})])
        for _ in range(20):
            junk.send_multipart([p.HEADER, bytes((p.Cmd.SUBMIT,)), b"\x00" * (1 << 20)])
        with Client(addr(front)) as c:
            _settled(c, "malformed_client_messages", 20_020, 30.0)
            for s in [*socks, junk]:
                s.close()
            time.sleep(3.0)  # the broker drops the closed connections' queues, then idles
            assert len(c.generate("still serving", max_tokens=2).token_ids) == 2
            time.sleep(1.0)
        after = rss_mb(broker.pid)
    finally:
        ctx.term()
    print(f"garbage run: the broker stayed {after - before:.1f} MB higher")
    assert after - before < 10.0, f"broker stayed {after - before:.1f} MB higher after the garbage run"


def test_reply_budget_buckets() -> None:
    b = Budget(BudgetConfig(control_burst=3, control_rate=10.0))
    assert [b.allow(b"c", ReplyKind.CONTROL, 0.0) for _ in range(4)] == [True, True, True, False]
    assert b.allow(b"other", ReplyKind.CONTROL, 0.0)  # per client
    assert b.allow(b"c", ReplyKind.REJECT, 0.0)  # per kind
    assert b.allow(b"c", ReplyKind.CONTROL, 0.1)  # refilled at 10/s
    assert not b.allow(b"c", ReplyKind.CONTROL, 0.1)
    b.prune(100.0)  # every bucket refilled long ago: forgotten, as if new
    assert len(b) == 0 and b.allow(b"c", ReplyKind.CONTROL, 100.0)


# ---- malformed requests: the job id comes back ------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, Procs]]:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path_factory.mktemp("broker")) as ps:
        ps.broker(front, back)
        _fake_worker(ps, back, "w0", model=BOUNDED)
        with Client(addr(front)) as c:
            wait_workers(c, 1)
        yield front, back, ps


def _ask(sock: zmq.Socket, cmd: p.Cmd, body: Any) -> p.Message:
    sock.send_multipart([p.HEADER, bytes((cmd,)), msgpack.packb(body)])
    assert sock.poll(5000), "no answer"
    return p.decode(sock.recv_multipart(), p.BROKER_TO_CLIENT)


def test_the_broker_echoes_the_job_id_of_a_malformed_request(cluster: tuple[int, int, Procs]) -> None:
    front = cluster[0]
    ctx = zmq.Context()
    try:
        s = _dealer(ctx, front)
        cases = [
            (p.Cmd.SUBMIT, {"job_id": "echo-1", "model": "", "params": {}, "prompt_token_ids": [1, -1]}, "echo-1"),
            (p.Cmd.SUBMIT, {"job_id": "echo-2", "model": "", "params": {}, "messages": []}, "echo-2"),
            (p.Cmd.SUBMIT, {"job_id": "echo-3", "model": "", "params": {}, "prompt": "x", "timeout": -1}, "echo-3"),
            (p.Cmd.CANCEL, {"job_id": "echo-4", "owner": 5}, "echo-4"),
            (p.Cmd.SUBSCRIBE, {"job_id": "echo-5", "from_seq": -1}, "echo-5"),
            (p.Cmd.SUBMIT, {"job_id": "x" * 200, "model": "", "params": {}, "prompt": "x"}, ""),  # unreadable id
            (p.Cmd.SUBMIT, [1, 2, 3], ""),
        ]
        for cmd, body, echoed in cases:
            reply = _ask(s, cmd, body)
            assert isinstance(reply, p.Fail) and reply.code == "protocol", reply
            assert reply.job_id == echoed, (body, reply)
        s.close()
    finally:
        ctx.term()


# ---- what cannot fit is refused before dispatch -----------------------------------------------------------


def test_a_prompt_that_cannot_fit_is_refused_before_dispatch(cluster: tuple[int, int, Procs]) -> None:
    front = cluster[0]
    with Client(addr(front)) as c:
        dispatched = c.stats()["workers"][0]["dispatched"]
        for kwargs, match in (
            ({"prompt": "y" * 10_001}, "characters"),  # the worker announced max_prompt_chars 10,000
            ({"prompt_token_ids": [7] * 4096}, "tokens"),  # its max_model_len is 4096
            ({"prompt": "short", "max_tokens": 4096}, "max_tokens"),
            ({"messages": [{"role": "user", "content": "z" * 6000}] * 2}, "characters"),
        ):
            t0 = time.monotonic()
            with pytest.raises(InvalidRequest, match=match):
                c.generate(**{"max_tokens": 2, **kwargs})
            assert time.monotonic() - t0 < 1.0
        assert c.stats()["workers"][0]["dispatched"] == dispatched  # none of them reached the worker
        assert c.generate("y" * 10_000, max_tokens=2).text == fake_text("y" * 10_000, 2)


# ---- a model no worker ever served ---------------------------------------------------------------------


def test_an_unknown_model_is_answered_at_once(cluster: tuple[int, int, Procs]) -> None:
    front, back, ps = cluster
    gone = _fake_worker(ps, back, "gone", "--model", "m-gone")
    with Client(addr(front)) as c:
        wait_workers(c, 2)
        time.sleep(c.stats()["unknown_model_grace_left"])  # past the start-up grace (workers registering)
        t0 = time.monotonic()
        with pytest.raises(InvalidRequest, match="no-such-model"):
            c.generate("x", model="no-such-model", max_tokens=2)
        assert time.monotonic() - t0 < 1.0
        # A model that was served, whose worker is gone: queued as before (a worker may come back).
        gone.send_signal(signal.SIGKILL)
        wait_until(lambda: len(c.stats()["workers"]) == 1, 10, what="worker declared dead")
        with pytest.raises(DeadlineExceeded):
            c.generate("x", model="m-gone", max_tokens=2, timeout=0.5)


# ---- a job's own fault ----------------------------------------------------------------------------------


def test_a_job_that_kills_its_worker_is_not_charged_to_its_neighbour(tmp_path: Path) -> None:
    """Migration limit 1: on main the neighbour, which was streaming on the same worker, failed with the
    poison job. Now only the job that produced nothing there is charged; the neighbour migrates."""
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back, "--migration-limit", "1")
        _fake_worker(ps, back, "w0", "--model", "m0", model=POISON, step_s=0.01)
        with Client(addr(front)) as c:
            wait_workers(c, 1)
            neighbour = c.submit("neighbour", max_tokens=400)  # on w0, the only worker
            events = neighbour.stream(timeout=30)
            first = [next(events)]
            _fake_worker(ps, back, "w1", model=POISON, step_s=0.01)
            wait_workers(c, 2)
            poison = c.submit("POISON pill", model="m0", max_tokens=5)  # only w0 serves m0
            with pytest.raises(JobFailed, match="migration limit"):
                poison.result(timeout=30)
            rest = list(events)
            text = "".join(ev.text for ev in first + rest)
            assert text == fake_text("neighbour", 400)
            assert rest[-1].finish_reason == "length"
            counters = c.stats()["counters"]
            assert counters["migrations"] >= 1 and counters["workers_lost"] == 1
