"""The broker's part of disaggregated prefill and decode, in-process (FakeRouter sockets): where a job is
placed by the workers' roles, what each side is told, and how every failure on the prefill side ends in
KV_LOST to the decode worker (which then computes the prompt) while a decode worker's death migrates the
job as before, its old prefill cancelled."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import structlog
from broker_fakes import FakeRouter

from tokenmill.broker import Broker, BrokerConfig
from tokenmill.broker.jobs import JobState
from tokenmill.protocol import wire as p

P, D, D2, B = b"pf", b"dc", b"dc2", b"both"


@pytest.fixture(autouse=True)
def _fresh_logging() -> None:
    """structlog as it is by default: an earlier in-process CLI test may have pointed it at a stream that is
    closed now (cli/serve.py configure_logging), and these tests log from this process."""
    structlog.reset_defaults()


class Harness:
    def __init__(self) -> None:
        self.b = Broker(BrokerConfig(gc_tuning=False))
        self.b.clients.sock = FakeRouter()
        self.backend = FakeRouter()
        self.b.backend = self.backend  # type: ignore[assignment]

    def ready(self, ident: bytes, role: str, capacity: int = 4) -> None:
        kv = f"tcp://127.0.0.1:9{len(ident)}" if role == "decode" else ""
        self.b.on_worker_message([ident, *p.encode(p.Ready(ident.decode(), ["m"], capacity, 100, 16, 2048, 1.0,
                                                           role=role, kv_address=kv))])

    def submit(self, job_id: str, **inp: object) -> None:
        inp = inp or {"prompt": "a prompt"}
        self.b.on_client_message([b"cl", *p.encode(p.Submit(job_id, "m", p.RequestInput(**inp),  # type: ignore[arg-type]
                                                            {"max_tokens": 8}))])

    def sent(self, ident: bytes, kind: type[p.Message] | None = None) -> list[p.Message]:
        """The messages sent to `ident` since the last call (heartbeats left out), of `kind` if given."""
        out = [p.decode(f) for i, f in self.backend.sent if i == ident]
        self.backend.sent = [(i, f) for i, f in self.backend.sent if i != ident]
        return [m for m in out if not isinstance(m, p.BrokerHeartbeat) and (kind is None or isinstance(m, kind))]

    def from_worker(self, ident: bytes, msg: p.Message) -> None:
        self.b.on_worker_message([ident, *p.encode(msg)])


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    try:
        yield harness
    finally:
        harness.b.ctx.term()


def test_a_job_goes_to_a_prefill_and_a_decode_worker(h: Harness) -> None:
    h.ready(P, "prefill")
    h.ready(D, "decode")
    h.ready(B, "both")
    h.submit("j1")
    to_d, to_p = h.sent(D, p.WorkerSubmit), h.sent(P, p.WorkerSubmit)
    assert len(to_d) == 1 and len(to_p) == 1 and not h.sent(B, p.WorkerSubmit)
    d, pf = to_d[0], to_p[0]
    assert isinstance(d, p.WorkerSubmit) and isinstance(pf, p.WorkerSubmit)
    assert d.kv_wait and not d.kv_send and pf.kv_send == "tcp://127.0.0.1:92" and not pf.kv_wait
    assert (d.job_id, d.attempt, d.input) == (pf.job_id, pf.attempt, pf.input)
    job = h.b.jobs["j1"]
    assert job.worker == D and job.prefill == P
    workers = {w["name"]: w for w in h.b.stats()["workers"]}
    assert workers["pf"]["prefilling"] == 1 and workers["dc"]["inflight"] == 1 and workers["pf"]["inflight"] == 0
    # PREFILLED frees the prefill slot; the job stays on the decode worker; nothing more is said to it.
    h.from_worker(P, p.Prefilled("j1", 0, 3))
    assert h.b.workers.get(P).prefills == set() and h.b.counters["prefills"] == 1  # type: ignore[union-attr]
    assert not h.sent(D) and job.state is JobState.RUNNING


def test_without_both_roles_jobs_run_whole(h: Harness) -> None:
    h.ready(D, "decode")
    h.ready(B, "both")
    h.submit("j1")  # no prefill worker: a "both" worker runs it
    assert [m.kv_wait for m in h.sent(B, p.WorkerSubmit)] == [False] and not h.sent(D, p.WorkerSubmit)
    h.b._worker_dead(h.b.workers.get(B), "test")  # type: ignore[arg-type]
    h.sent(D)
    h.submit("j2")  # only a decode worker left: it runs the job itself
    assert [(m.job_id, m.kv_wait) for m in h.sent(D, p.WorkerSubmit)] == [("j1", False), ("j2", False)]


def test_a_token_prompt_that_fills_no_block_runs_whole_on_the_decode_worker(h: Harness) -> None:
    h.ready(P, "prefill")
    h.ready(D, "decode")
    h.submit("short", prompt_token_ids=list(range(16)))
    h.submit("long", prompt_token_ids=list(range(17)))
    assert [(m.job_id, m.kv_wait) for m in h.sent(D, p.WorkerSubmit)] == [("short", False), ("long", True)]
    assert [m.job_id for m in h.sent(P, p.WorkerSubmit)] == ["long"]


def test_full_decode_workers_hold_jobs_rather_than_prefill_workers_running_them(h: Harness) -> None:
    h.ready(P, "prefill")
    h.ready(D, "decode", capacity=1)
    h.submit("j1")
    h.submit("j2")
    assert h.b.jobs["j2"].state is JobState.QUEUED and len(h.sent(P, p.WorkerSubmit)) == 1


def test_prefilled_without_blocks_and_prefill_death_send_kv_lost(h: Harness) -> None:
    h.ready(P, "prefill")
    h.ready(D, "decode")
    h.submit("j1")
    h.submit("j2")
    h.sent(D)
    h.from_worker(P, p.Prefilled("j1", 0, 0))  # nothing could be sent
    assert [(m.job_id, m.attempt) for m in h.sent(D, p.KvLost)] == [("j1", 0)]
    h.from_worker(P, p.WorkerDisconnect())  # dies with j2's prefill running
    assert [(m.job_id, m.attempt) for m in h.sent(D, p.KvLost)] == [("j2", 0)]
    assert h.b.jobs["j2"].worker == D and h.b.jobs["j2"].state is JobState.RUNNING  # no migration
    assert h.b.counters["kv_lost"] == 2 and h.b.counters.get("migrations", 0) == 0
    # A late PREFILLED (from a worker that re-registered since) changes nothing.
    h.ready(P, "prefill")
    h.from_worker(P, p.Prefilled("j2", 0, 0))
    assert not h.sent(D, p.KvLost) and h.b.jobs["j2"].state is JobState.RUNNING


def test_decode_death_migrates_and_cancels_the_old_prefill(h: Harness) -> None:
    h.ready(P, "prefill")
    h.ready(D, "decode")
    h.ready(D2, "decode")
    h.submit("j1")
    first = h.b.jobs["j1"].worker
    assert first in (D, D2)
    h.sent(P)
    h.b._worker_dead(h.b.workers.get(first), "test")  # type: ignore[arg-type]
    h.b.tick(time.monotonic())  # the migrated job is dispatched again
    job = h.b.jobs["j1"]
    assert job.attempt == 1 and job.worker not in (None, first) and job.prefill == P
    to_p = h.sent(P)
    assert isinstance(to_p[0], p.WorkerCancel) and (to_p[0].job_id, to_p[0].attempt) == ("j1", 0)
    assert isinstance(to_p[1], p.WorkerSubmit) and to_p[1].attempt == 1 and to_p[1].kv_send
    assert h.b.workers.get(P).prefills == {"j1"}  # type: ignore[union-attr]


def test_finishing_a_job_cancels_its_prefill(h: Harness) -> None:
    h.ready(P, "prefill")
    h.ready(D, "decode")
    h.submit("j1")
    h.sent(P)
    h.b.on_client_message([b"cl", *p.encode(p.Cancel("j1"))])
    assert [type(m) for m in h.sent(P)] == [p.WorkerCancel]
    assert h.b.workers.get(P).prefills == set() and h.b.jobs["j1"].prefill is None  # type: ignore[union-attr]
