"""The worker process against a scripted broker (a ROUTER socket in the test): READY contents, a
malformed job answered with ERROR for that job alone, heartbeats from the IO thread during long engine
steps, re-registration, clean exit on SIGTERM, non-zero exit when the IO thread fails."""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from helpers_net import FAKE, TINY, Procs, addr, fake_text, free_port, procs_ctx

from tokenmill.protocol import wire as p

pytestmark = pytest.mark.timeout(120)


class ScriptedBroker:
    """A ROUTER that answers heartbeats and records what workers send."""

    def __init__(self) -> None:
        self.port = free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr(self.port))
        self.log: list[tuple[float, bytes, p.Message]] = []

    def recv(self, timeout: float = 10.0, want: type[p.Message] | None = None,
             heartbeat: bool = True) -> tuple[bytes, p.Message]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = p.decode(frames, p.WORKER_TO_BROKER)
            self.log.append((time.monotonic(), ident, msg))
            if heartbeat:
                self.send(ident, p.BrokerHeartbeat())
            if want is None or isinstance(msg, want):
                return ident, msg
        raise TimeoutError(f"no {want.__name__ if want else 'message'} within {timeout}s")

    def send(self, ident: bytes, msg: p.Message) -> None:
        self.sock.send_multipart([ident, *p.encode(msg)])

    def send_raw(self, ident: bytes, frames: list[bytes]) -> None:
        self.sock.send_multipart([ident, *frames])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[ScriptedBroker, Procs]]:
    b = ScriptedBroker()
    try:
        with procs_ctx(tmp_path) as ps:
            yield b, ps
    finally:
        b.close()


def _submit(job_id: str, prompt: str, max_tokens: int, attempt: int = 0, resume: list[int] | None = None
            ) -> p.WorkerSubmit:
    return p.WorkerSubmit(job_id, attempt, p.RequestInput(prompt=prompt),
                          {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, resume or [])


def _run_job(b: ScriptedBroker, ident: bytes, job_id: str, timeout: float = 30, start: int = 0
             ) -> tuple[list[int], str, Any]:
    ids: list[int] = [0] * start
    text = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, msg = b.recv(timeout)
        if isinstance(msg, p.Tokens):
            for c in msg.chunks:
                if c.job_id == job_id:
                    assert c.seq == len(ids)
                    ids += c.token_ids
                    text += c.text
        elif isinstance(msg, p.Finished):
            for f in msg.jobs:
                if f.job_id == job_id:
                    return ids, text, f
        elif isinstance(msg, p.JobError) and msg.job_id == job_id:
            return ids, text, msg
    raise TimeoutError(job_id)


def test_ready_and_a_real_job(scripted: tuple[ScriptedBroker, Procs]) -> None:
    b, ps = scripted
    # A 1 s interval: this test answers heartbeats only while it reads, which can lag on a busy machine.
    ps.worker(b.port, "--max-num-seqs", "7", model=TINY, name="w-real", hb=1.0)
    ident, ready = b.recv(60, p.Ready)
    assert isinstance(ready, p.Ready)
    assert ready.name == "w-real" and ready.models[0] == "tiny-llama" and ready.capacity == 7
    assert ready.kv_blocks > 0 and ready.block_size == 16 and ready.max_model_len == 2048
    assert ready.heartbeat_interval == 1.0
    b.send(ident, _submit("j1", "hello", 6))
    ids, _, fin = _run_job(b, ident, "j1")
    assert len(ids) == 6 and isinstance(fin, p.FinishedJob) and fin.finish_reason == "length"
    assert fin.usage[1] == 6
    tl = fin.timeline  # seconds since the worker received the SUBMIT, each step after the one before
    assert tl is not None and 0.0 <= tl.admitted <= tl.first_scheduled <= tl.first_token < 60.0


def test_malformed_job_gets_error_for_that_job_alone(scripted: tuple[ScriptedBroker, Procs]) -> None:
    b, ps = scripted
    ps.worker(b.port, model=FAKE, name="w-fake")
    ident, _ = b.recv(30, p.Ready)
    # Structurally malformed (params is not a map): the IO thread answers ERROR naming the job.
    b.send_raw(ident, [p.HEADER, bytes((p.Cmd.B_SUBMIT,)), msgpack.packb(
        {"job_id": "bad-1", "attempt": 0, "prompt": "x", "params": "oops"})])
    # Semantically invalid (max_tokens 0): the engine loop answers ERROR.
    b.send(ident, p.WorkerSubmit("bad-2", 0, p.RequestInput(prompt="x"), {"max_tokens": 0}))
    # Garbage with no job id: logged and ignored.
    b.send_raw(ident, [p.HEADER, bytes((p.Cmd.B_SUBMIT,)), b"\xc1"])
    b.send(ident, _submit("good", "hello", 5))
    errors: dict[str, p.JobError] = {}
    while len(errors) < 2:
        _, msg = b.recv(10)
        if isinstance(msg, p.JobError):
            errors[msg.job_id] = msg
    assert set(errors) == {"bad-1", "bad-2"} and all(e.code == "invalid" for e in errors.values())
    _ids, text, fin = _run_job(b, ident, "good")
    assert text == fake_text("hello", 5) and isinstance(fin, p.FinishedJob)


def test_resume_and_cancel(scripted: tuple[ScriptedBroker, Procs]) -> None:
    b, ps = scripted
    ps.worker(b.port, model=FAKE, name="w-fake")
    ident, _ = b.recv(30, p.Ready)
    full = fake_text("resume", 8)
    b.send(ident, _submit("r", "resume", 8, attempt=3, resume=[ord(ch) for ch in full[:3]]))
    _ids, text, fin = _run_job(b, ident, "r", start=3)
    assert text == full[3:] and isinstance(fin, p.FinishedJob) and fin.attempt == 3
    b.send(ident, _submit("c", "cancel", 10_000))
    b.recv(10, p.Tokens)
    b.send(ident, p.WorkerCancel("c", 0))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # heartbeats soon report nothing running
        _, hb = b.recv(5, p.WorkerHeartbeat)
        assert isinstance(hb, p.WorkerHeartbeat)
        if hb.running == 0:
            break
    else:
        pytest.fail("the cancelled request kept running")


def test_heartbeats_continue_during_long_engine_steps(scripted: tuple[ScriptedBroker, Procs]) -> None:
    b, ps = scripted
    ps.spawn(["worker", "--broker", addr(b.port), *FAKE, "--heartbeat-interval", "0.1", "--name", "slow"],
             "slow", env={"TOKENMILL_FAKE_STEP_S": "1.5"})
    ident, _ = b.recv(30, p.Ready)
    b.send(ident, _submit("slow-job", "x", 3))
    t0 = time.monotonic()
    _run_job(b, ident, "slow-job", timeout=20)
    assert time.monotonic() - t0 >= 3.0  # three 1.5 s steps (after the first)
    beats = [t for t, _, m in b.log if isinstance(m, p.WorkerHeartbeat) and t >= t0]
    gaps = [y - x for x, y in itertools.pairwise(beats)]
    assert len(beats) >= 15 and max(gaps) < 0.3, gaps


def test_reregisters_on_disconnect_and_on_broker_silence(scripted: tuple[ScriptedBroker, Procs]) -> None:
    b, ps = scripted
    ps.worker(b.port, model=FAKE, name="w-fake", hb=0.1)
    ident, _ = b.recv(30, p.Ready)
    b.send(ident, p.BrokerDisconnect("reregister"))
    ident2, _ = b.recv(5, p.Ready)
    assert ident2 == ident  # same connection, fresh registration
    # Stay silent (no heartbeats): after 3 intervals it reconnects with a new socket and READY.
    t0 = time.monotonic()
    ident3, _ = b.recv(5, p.Ready, heartbeat=False)
    assert ident3 != ident and time.monotonic() - t0 < 2.0


def test_sigterm_disconnects_and_exits_zero(scripted: tuple[ScriptedBroker, Procs]) -> None:
    b, ps = scripted
    w = ps.worker(b.port, model=FAKE, name="w-fake")
    b.recv(30, p.Ready)
    w.send_signal(signal.SIGTERM)
    b.recv(10, p.WorkerDisconnect)
    assert w.wait(10) == 0


def test_io_thread_failure_exits_nonzero(tmp_path: Path) -> None:
    with procs_ctx(tmp_path) as ps:
        w = ps.spawn(["worker", "--broker", "tcp://not a valid address", *FAKE], "bad")
        assert w.wait(30) != 0
        assert "worker_failed" in ps.logs[0].read_text()
