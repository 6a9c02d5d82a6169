"""End to end through real processes on 127.0.0.1: broker + two tiny-llama (dummy weights) workers.

Acceptance items 1 (streaming from Client and AsyncClient, 64 concurrent streams equal to the engine
in-process), 5 (a burst of 1,000 submits against a queue of 256) and 6 (cancel and client disconnect
free the worker's KV blocks), plus the SDK's typed errors, subscribe, idempotent submits and deadlines.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from helpers_net import Procs, addr, free_port, procs_ctx, reference_greedy, wait_until, wait_workers

from tokenmill.client import (
    AsyncClient,
    Cancelled,
    Client,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    StreamEvent,
    UnknownJob,
)
from tokenmill.protocol import wire as p

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 12
PROMPTS = [f"Prompt number {i}: " + "abcdefghij"[: i % 10] * (1 + i % 4) for i in range(64)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Procs]]:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path_factory.mktemp("cluster")) as ps:
        ps.broker(front, back, "--client-timeout", "1.0", "--queue-size", "256")
        ps.worker(back, "--max-num-seqs", "32", name="w0")
        ps.worker(back, "--max-num-seqs", "32", name="w1")
        with Client(addr(front)) as c:
            wait_workers(c, 2)
        yield addr(front), ps


@pytest.fixture(scope="module")
def expected() -> dict[str, tuple[list[int], str]]:
    """The same prompts run greedily by the engine in this process."""
    return dict(zip(PROMPTS, reference_greedy(PROMPTS, MAX_TOKENS)))


def _check_events(events: list[StreamEvent]) -> tuple[list[int], str]:
    """Sequence numbers are gap-free and duplicate-free; exactly the last event is final."""
    seq = 0
    ids: list[int] = []
    for ev in events[:-1]:
        assert not ev.finished and ev.seq == seq
        seq += len(ev.token_ids)
        ids += ev.token_ids
    assert events[-1].finished and events[-1].seq == seq
    return ids, "".join(e.text for e in events)


def test_sync_client_64_concurrent_streams(cluster: tuple[str, Procs],
                                           expected: dict[str, tuple[list[int], str]]) -> None:
    address, _ = cluster
    with Client(address) as c:
        handles = [c.submit(pr, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for pr in PROMPTS]
        for pr, h in zip(PROMPTS, handles):
            events = list(h.stream(timeout=60))
            assert _check_events(events) == expected[pr]
            res = h.result()
            assert (res.token_ids, res.text) == expected[pr]
            assert res.finish_reason == "length" and res.usage is not None
            assert res.usage.completion_tokens == MAX_TOKENS
        st = c.stats()
    assert {w["name"] for w in st["workers"]} == {"w0", "w1"}
    assert all(w["dispatched"] > 0 for w in st["workers"]), "load spread over both workers"


def test_async_client_64_concurrent_streams(cluster: tuple[str, Procs],
                                            expected: dict[str, tuple[list[int], str]]) -> None:
    address, _ = cluster

    async def one(c: AsyncClient, pr: str) -> tuple[list[int], str]:
        events = [ev async for ev in c.stream(pr, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)]
        return _check_events(events)

    async def main() -> list[tuple[list[int], str]]:
        async with AsyncClient(address) as c:
            got = await asyncio.gather(*(one(c, pr) for pr in PROMPTS))
            res = await c.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert (res.token_ids, res.text) == expected[PROMPTS[0]]
            return got

    got = asyncio.run(asyncio.wait_for(main(), 120))
    assert got == [expected[pr] for pr in PROMPTS]


def test_chat_and_token_id_prompts(cluster: tuple[str, Procs]) -> None:
    address, _ = cluster
    with Client(address) as c:
        r = c.chat([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(r.token_ids) == 4
        r2 = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(r2.token_ids) == 3 and r2.usage is not None and r2.usage.prompt_tokens == 3


def test_invalid_requests_get_typed_errors(cluster: tuple[str, Procs]) -> None:
    address, _ = cluster
    with Client(address) as c:
        with pytest.raises(InvalidRequest, match="max_tokens"):
            c.generate("x", max_tokens=0)  # caught by the broker
        with pytest.raises(InvalidRequest, match="vocabulary"):
            c.generate(prompt_token_ids=[10**6], max_tokens=2)  # caught by the worker, job alone
        with pytest.raises(InvalidRequest):
            c.submit()
        assert len(c.generate("still serving", max_tokens=2, ignore_eos=True).token_ids) == 2


def test_subscribe_idempotent_submit_and_ownership(cluster: tuple[str, Procs]) -> None:
    address, _ = cluster
    with Client(address, owner="alice") as a, Client(address, owner="alice") as a2, \
            Client(address, owner="bob") as b:
        h = a.submit("subscribe me", max_tokens=20, temperature=0.0, ignore_eos=True, job_id="sub-job-1")
        full = h.result(timeout=60)
        # Another process of the same owner replays the whole log, late, from any position.
        assert a2.subscribe("sub-job-1").result(timeout=10).token_ids == full.token_ids
        assert a2.subscribe("sub-job-1", from_seq=5).result(timeout=10).token_ids == full.token_ids[5:]
        # The same job id again is the same job (not run twice).
        again = a2.submit("subscribe me", max_tokens=20, temperature=0.0, job_id="sub-job-1").result(timeout=10)
        assert again.token_ids == full.token_ids
        with pytest.raises(Forbidden):
            b.subscribe("sub-job-1").result(timeout=10)
        with pytest.raises(Forbidden):
            b.cancel("sub-job-1")
        with pytest.raises(UnknownJob):
            b.cancel("no-such-job")
        assert a.stats()["counters"]["duplicate_submits"] >= 1


def test_deadline_exceeded(cluster: tuple[str, Procs]) -> None:
    address, _ = cluster
    with Client(address) as c, pytest.raises(DeadlineExceeded):
        c.generate("slow", max_tokens=1500, ignore_eos=True, timeout=0.3)


def _kv_idle(c: Client) -> bool:
    ws = c.stats()["workers"]
    return all(w["running"] == 0 and w["free_blocks"] + w["cached_blocks"] == w["kv_blocks"] for w in ws)


def _kv_held(c: Client) -> bool:
    return any(w["free_blocks"] + w["cached_blocks"] < w["kv_blocks"] for w in c.stats()["workers"])


def test_cancel_frees_kv_blocks(cluster: tuple[str, Procs]) -> None:
    address, _ = cluster
    with Client(address) as c:
        wait_until(lambda: _kv_idle(c), 30, what="idle workers")
        h = c.submit("cancel me " * 20, max_tokens=1800, ignore_eos=True)
        stream = h.stream(timeout=30)
        next(stream)
        wait_until(lambda: _kv_held(c), 10, what="blocks in use")
        h.cancel()
        with pytest.raises(Cancelled):
            list(stream)
        wait_until(lambda: _kv_idle(c), 10, what="blocks freed after cancel")
        assert c.stats()["counters"]["cancels"] >= 1


CLIENT_SCRIPT = """
import sys
from tokenmill.client import Client
c = Client(sys.argv[1])
for i, ev in enumerate(c.stream("disconnect me " * 20, max_tokens=1800, ignore_eos=True)):
    if i == 0:
        print("started", flush=True)
"""


def test_client_disconnect_frees_kv_blocks(cluster: tuple[str, Procs], tmp_path: Path) -> None:
    address, _ = cluster
    with Client(address) as c:
        wait_until(lambda: _kv_idle(c), 30, what="idle workers")
        before = c.stats()["counters"].get("disconnect_cancels", 0)
        pr = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, address], stdout=subprocess.PIPE)
        try:
            assert pr.stdout is not None and pr.stdout.readline().strip() == b"started"
            wait_until(lambda: _kv_held(c), 10, what="blocks in use")
            pr.kill()  # no BYE: the broker notices the dead peer (unreachable, or silence)
        finally:
            pr.kill()
            pr.wait()
        wait_until(lambda: _kv_idle(c), 15, what="blocks freed after disconnect")
        assert c.stats()["counters"]["disconnect_cancels"] == before + 1


def test_close_cancels_open_jobs(cluster: tuple[str, Procs]) -> None:
    address, _ = cluster
    with Client(address) as c:
        wait_until(lambda: _kv_idle(c), 30, what="idle workers")
        other = Client(address)
        h = other.submit("bye " * 20, max_tokens=1800, ignore_eos=True)
        next(h.stream(timeout=30))
        other.close()  # BYE
        wait_until(lambda: _kv_idle(c), 10, what="blocks freed after close")


def test_burst_of_1000_submits_each_one_terminal_reply(cluster: tuple[str, Procs]) -> None:
    """Raw protocol: 1,000 SUBMITs in a burst; queue 256 + 64 worker slots; the rest OVERLOADED at
    once with a retry-after; every job id gets exactly one terminal reply (DONE or FAIL)."""
    address, _ = cluster
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(address)
    try:
        ids = [f"burst-{i}" for i in range(1000)]
        for j in ids:
            s.send_multipart(p.encode(p.Submit(j, "", p.RequestInput(prompt="burst " + j),
                                               {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})))
        terminal: Counter[str] = Counter()
        codes: Counter[str] = Counter()
        retry_after: list[float] = []
        deadline = time.monotonic() + 120
        while len(terminal) < 1000 and time.monotonic() < deadline:
            if not s.poll(1000):
                continue
            msg = p.decode(s.recv_multipart(), p.BROKER_TO_CLIENT)
            if isinstance(msg, p.Done | p.Fail):
                terminal[msg.job_id] += 1
                codes[msg.code if isinstance(msg, p.Fail) else "done"] += 1
                if isinstance(msg, p.Fail) and msg.retry_after is not None:
                    retry_after.append(msg.retry_after)
        # A little longer: no job may get a second terminal reply.
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            if s.poll(100):
                msg = p.decode(s.recv_multipart(), p.BROKER_TO_CLIENT)
                if isinstance(msg, p.Done | p.Fail):
                    terminal[msg.job_id] += 1
    finally:
        s.close()
        ctx.term()
    assert set(terminal) == set(ids)
    assert set(terminal.values()) == {1}
    assert set(codes) <= {"done", "overloaded"}
    assert codes["overloaded"] + codes["done"] == 1000
    assert codes["overloaded"] >= 300, codes  # most of the excess over 256 queued + 64 running
    assert codes["done"] >= 256, codes
    assert len(retry_after) == codes["overloaded"] and min(retry_after) > 0


def test_a_model_nobody_serves_is_refused_at_once(cluster: tuple[str, Procs], tmp_path: Path) -> None:
    """(Issue 13: it used to wait for its queue timeout. A model that was served, whose workers are gone, still
    waits and fails with DeadlineExceeded: test_hardening_broker.py.)"""
    address, _ = cluster
    with Client(address) as c:
        time.sleep(c.stats()["unknown_model_grace_left"])  # past the broker's start-up grace
        h = c.submit("x", model="no-such-model", max_tokens=2, timeout=0.5)
        with pytest.raises(InvalidRequest, match="no worker has ever served"):
            h.result(timeout=10)


def _tokenmill(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, check=False)


def test_cli_through_the_broker_prints_what_the_in_process_cli_prints(cluster: tuple[str, Procs]) -> None:
    front, _ = cluster
    flags = ["--model", "tiny-llama", "--max-tokens", "12", "--temperature", "0"]
    local = _tokenmill("generate", "Hello broker", *flags, "--load-format", "dummy")
    remote = _tokenmill("generate", "Hello broker", *flags, "--broker", front)
    assert local.returncode == 0 and remote.returncode == 0, (local.stderr[-2000:], remote.stderr[-2000:])
    assert remote.stdout == local.stdout and remote.stdout.strip()
    chat = _tokenmill("chat", *flags, "--broker", front, stdin="first turn\nsecond turn\n")
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert len(chat.stdout.splitlines()) >= 2  # one streamed reply per turn
