"""Each part of the broker alone, without sockets: the worker table, the client table, the job table and
log, the queues, the timers, the dispatcher, the fan-out, the counters, the GC pacer and the observer
hook (a FakeRouter stands in for a ROUTER socket where a part sends)."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import pytest
import zmq
from broker_fakes import FakeRouter, make_job

from tokenmill.broker import Broker, BrokerConfig
from tokenmill.broker.clients import ClientTable, Sent
from tokenmill.broker.counters import Counters
from tokenmill.broker.dispatch import AffinityDispatcher, Dispatcher, PrefixIndex, prefix_hashes
from tokenmill.broker.fanout import Fanout
from tokenmill.broker.gcpacer import GcPacer
from tokenmill.broker.jobs import Job, JobState, JobTable
from tokenmill.broker.observer import BrokerObserver
from tokenmill.broker.queues import JobQueues
from tokenmill.broker.timers import Timer, Timers
from tokenmill.broker.workers import WorkerInfo, WorkerTable
from tokenmill.protocol import wire as p

W = b"w-1"


def _ready(name: str = "w", models: Sequence[str] = ("m",), capacity: int = 4, interval: float = 1.0,
           data_id: str = "", kv_blocks: int = 100) -> p.Ready:
    return p.Ready(name, list(models), capacity, kv_blocks, 16, 1024, interval, data_id=data_id)


# ---- counters ------------------------------------------------------------------------------------


def test_counters_count_terminal_replies_and_job_durations() -> None:
    c = Counters()
    assert c.job_seconds == 1.0 and c.snapshot() == {}
    c.count_terminal(p.Done("j", "length", None, (1, 2, 0), 2), seconds=3.0)
    assert c["completed"] == 1 and c.job_seconds == pytest.approx(0.9 * 1.0 + 0.1 * 3.0)
    c.count_terminal(p.Fail("j", "cancelled"), seconds=100.0)  # failures do not move the mean
    assert c["failed_cancelled"] == 1 and c.job_seconds == pytest.approx(1.2)
    snap = c.snapshot()
    snap["completed"] = 99
    assert type(snap) is dict and c["completed"] == 1


# ---- worker table --------------------------------------------------------------------------------


def test_worker_table_registers_control_and_data_sockets() -> None:
    t = WorkerTable()
    w = t.register(W, _ready(data_id="w-1/data", interval=2.0), now=10.0)
    assert t.get(W) is w and t.sender(W) is w and t.sender(b"w-1/data") is w and t.get(b"w-1/data") is None
    assert t.control_idents() == [W] and t.data_idents() == [b"w-1/data"] and len(t) == 1 and list(t) == [w]
    assert w.last_seen == 10.0 and w.next_heartbeat == 12.0 and w.load.free_blocks == 100
    plain = t.register(b"w-2", _ready(), now=10.0)  # no data socket
    assert t.sender(b"w-2") is plain and t.data_idents() == [b"w-1/data"]


def test_worker_table_refuses_a_ready_that_claims_an_id_in_use() -> None:
    t = WorkerTable()
    w = t.register(W, _ready(data_id="w-1/data"), now=0.0)
    assert t.conflicts(b"w-1/data", _ready())  # a data socket's id as a control socket
    assert t.conflicts(b"w-2", _ready(data_id="w-2"))  # its data id is its own control id
    assert t.conflicts(b"w-2", _ready(data_id="w-1"))  # another worker's control socket
    assert not t.conflicts(b"w-2", _ready(data_id="w-2/data")) and not t.conflicts(b"w-2", _ready())
    # the same worker re-registering (it reset itself) is no conflict: it replaces the old registration
    assert not t.conflicts(W, _ready(data_id="w-1/data2")) and t.replaced_by(W, _ready(data_id="w-1/data2")) == [w]
    assert t.replaced_by(b"w-3", _ready(data_id="w-1/data")) == [w]  # a new control socket, same data id
    assert t.replaced_by(W, _ready(data_id="w-1/data")) == [w]  # both: reported once
    assert t.replaced_by(b"w-3", _ready()) == []


def test_worker_table_removes_each_registration_once() -> None:
    t = WorkerTable()
    old = t.register(W, _ready(data_id="d-1"), now=0.0)
    assert t.remove(old) and not t.remove(old)
    assert t.sender(W) is None and t.sender(b"d-1") is None and len(t) == 0
    new = t.register(W, _ready(data_id="d-2"), now=1.0)
    assert not t.remove(old) and t.get(W) is new  # a stale WorkerInfo never removes its successor


def test_worker_table_liveness_and_heartbeats() -> None:
    t = WorkerTable()
    fast = t.register(b"fast", _ready(interval=1.0), now=0.0)
    slow = t.register(b"slow", _ready(interval=10.0), now=0.0)
    assert t.poll_interval(0.1) == 0.1 and t.poll_interval(1.0) == pytest.approx(0.2)
    assert t.heartbeats_due(0.5) == [] and t.heartbeats_due(1.0) == [fast] and fast.next_heartbeat == 2.0
    assert t.heartbeats_due(1.5) == []  # once per interval
    assert t.silent(3.0, liveness=3) == [] and t.silent(3.01, liveness=3) == [fast]
    slow.last_seen = 5.0
    assert t.silent(35.0, liveness=3) == [fast] and t.silent(35.01, liveness=3) == [fast, slow]


def test_worker_table_serving_and_capacity() -> None:
    t = WorkerTable()
    a = t.register(b"a", _ready(models=("m", "alias"), capacity=4), now=0.0)
    b = t.register(b"b", _ready(models=("n",), capacity=2), now=0.0)
    assert t.serving("m") == [a] and t.serving("alias") == [a] and t.serving("") == [a, b]
    assert t.capacity("m") == 4 and t.capacity("") == 6 and t.capacity("none") == 0


def test_worker_table_asks_unknown_senders_to_reregister_at_most_once_a_second() -> None:
    t = WorkerTable()
    assert t.should_ask_reregister(b"x", 0.0) and not t.should_ask_reregister(b"x", 0.9)
    assert t.should_ask_reregister(b"y", 0.9) and t.should_ask_reregister(b"x", 1.0)
    t._MAX_REREGISTER_MARKS = 3  # the marks are bounded: past the bound they are forgotten
    for ident in (b"p", b"q"):
        assert t.should_ask_reregister(ident, 1.0)
    assert t.should_ask_reregister(b"r", 1.0) and t.should_ask_reregister(b"x", 1.1)  # x was forgotten
    t.register(b"r", _ready(), now=1.2)  # a registration clears its mark
    assert t.should_ask_reregister(b"r", 1.3)


def test_worker_info_load() -> None:
    w = WorkerInfo.from_ready(W, _ready(capacity=4, kv_blocks=100), now=0.0)
    assert w.has_room() and w.load_score() == 0.0
    for j in ("a", "b"):
        w.assign(j)
    assert w.dispatched == 2 and w.load_score() == 0.5
    w.load = p.WorkerHeartbeat(2, 0, free_blocks=10, cached_blocks=30)  # 60% of the KV cache in use
    assert w.load_score() == pytest.approx(0.5 + 0.5 * 0.6)
    w.assign("c")
    w.assign("d")
    assert not w.has_room()


# ---- client table --------------------------------------------------------------------------------


class _Clients:
    def __init__(self, open_jobs: bool = False) -> None:
        self.counters = Counters()
        self.gone: list[tuple[bytes, str]] = []
        self.sends = 0
        self.table = ClientTable(self.counters, lambda cid, why: self.gone.append((cid, why)), open_jobs,
                                 on_send=self._sent)
        self.sock = FakeRouter()
        self.table.sock = self.sock

    def _sent(self) -> None:
        self.sends += 1


def test_client_table_liveness_and_ownership() -> None:
    c = _Clients()
    c.table.heard(b"a", 1.0)
    c.table.heard(b"b", 5.0)
    assert len(c.table) == 2 and c.table.silent(11.5, timeout=10.0) == [b"a"]
    job = make_job("j", owner="alice")
    assert c.table.may_access(job, "alice") and not c.table.may_access(job, "bob")
    assert _Clients(open_jobs=True).table.may_access(job, "bob")


def test_client_table_subscriptions() -> None:
    c = _Clients()
    job = make_job("j", worker=W)
    for seq, ids in ((0, [1, 2, 3]), (3, [4, 5])):
        job.append(seq, ids, "", None)
    c.table.subscribe(job, b"a")
    c.table.subscribe(job, b"b", from_seq=4)  # mid-chunk: that whole chunk is replayed
    assert job.subscribers == {b"a": 0, b"b": 1} and c.table.jobs_of(b"a") == {"j"}
    other = make_job("k")
    c.table.subscribe(other, b"a")
    c.table.unsubscribe(job, b"b")
    assert job.subscribers == {b"a": 0} and c.table.jobs_of(b"b") == set()
    c.table.forget(other)  # retention over
    assert c.table.jobs_of(b"a") == {"j"}
    c.table.subscribe(other, b"a")
    c.table.heard(b"a", 0.0)
    assert c.table.leave(b"a") == ["j", "k"] and len(c.table) == 0 and c.table.jobs_of(b"a") == set()
    assert c.table.leave(b"a") == []


def test_client_table_sends_never_block() -> None:
    c = _Clients()
    assert c.table.send_raw(b"a", [b"x"]) is Sent.SENT and c.sock.sent == [(b"a", [b"x"])]
    c.sock.blocked.add(b"a")
    assert c.table.send_raw(b"a", [b"x"]) is Sent.BLOCKED and c.counters["client_send_blocked"] == 1
    assert not c.table.send(b"a", p.Pong()) and c.gone == []  # a full queue: the caller retries
    c.sock.vanishing.add(b"b")
    assert c.table.send_raw(b"b", [b"x"]) is Sent.GONE and c.gone == []  # send_raw leaves that to its caller
    c.sock.vanishing.add(b"b")
    assert not c.table.send(b"b", p.Pong()) and c.gone == [(b"b", "unreachable")]
    assert c.sends == 5  # the observer's hook, once per send

    class Broken:
        def send_multipart(self, msg_parts: list[Any], flags: int = 0) -> None:
            raise zmq.ZMQError(zmq.EINVAL)

    c.table.sock = Broken()
    with pytest.raises(zmq.ZMQError):  # anything else is a bug: it is not mistaken for a gone client
        c.table.send_raw(b"a", [b"x"])


def test_client_table_lagging_jobs_are_taken_once() -> None:
    c = _Clients()
    c.table.lagging.update({"a", "b"})
    assert c.table.take_lagging() == {"a", "b"} and c.table.take_lagging() == set()


# ---- the job log and the job table ---------------------------------------------------------------


def test_job_log_takes_only_the_next_chunk() -> None:
    job = make_job("j")
    job.append(0, [5, 6], "ab", None)
    for seq in (0, 3):  # a duplicate, a gap
        with pytest.raises(ValueError, match="ends at 2"):
            job.append(seq, [1], "", None)
    job.append(2, [], "", None)  # an empty chunk, then one at the same position
    job.append(2, [7], "c", None)
    assert job.chunks() == [["j", 0, [5, 6], "ab", None], ["j", 2, [], "", None], ["j", 2, [7], "c", None]]
    assert job.tokens == [5, 6, 7] and job.num_tokens == 3 and job.tokens_from(1) == 1
    assert job.store(("j", 3, [8], "d", None)) == msgpack.packb(["j", 3, [8], "d", None])  # a tuple entry
    assert job.num_tokens == 4 and job.num_chunks == 4


def test_job_runs_only_its_current_attempt_on_its_worker() -> None:
    job = make_job("j", worker=W, attempt=2)
    assert job.runs(W, 2) and not job.runs(W, 1) and not job.runs(b"other", 2)
    job.state = JobState.QUEUED
    assert not job.runs(W, 2)


def test_job_table_tracks_live_jobs_and_retention() -> None:
    t = JobTable(retention=10.0, max_retained=2)
    jobs = [make_job(f"j{i}", worker=W) for i in range(4)]
    for j in jobs:
        t.add(j)
    assert len(t) == 4 and t.active == 4 and t["j1"] is jobs[1] and t.get("zz") is None and "j2" in t
    with pytest.raises(AssertionError):
        t.add(make_job("j1"))
    assert t.current(W, "j1", 0) is jobs[1] and t.current(W, "j1", 1) is None and t.current(b"x", "j1", 0) is None
    assert t.current(W, "zz", 0) is None
    t.finish(jobs[0], p.Fail("j0", "cancelled"), now=1.0)
    t.finish(jobs[1], p.Done("j1", "length", None, (0, 0, 0), 0), now=2.0)
    assert t.active == 2 and jobs[0].state is JobState.DONE and jobs[0].finished_at == 1.0
    assert t.current(W, "j1", 0) is None  # a finished job's output is stale
    assert t.expire(5.0) == [] and t.unfinished() == jobs[2:]
    t.finish(jobs[2], p.Fail("j2", "cancelled"), now=3.0)  # 3 retained > max_retained: the oldest goes
    assert t.expire(5.0) == [jobs[0]] and "j0" not in t
    assert t.expire(12.5) == [jobs[1]] and t.expire(13.5) == [jobs[2]] and len(t) == 1 and t.active == 1


# ---- timers --------------------------------------------------------------------------------------


def test_timers_fire_in_time_order_once() -> None:
    t = Timers()
    a, b = make_job("a"), make_job("b", attempt=1)
    t.set(5.0, Timer.QUEUE, a)
    t.set(2.0, Timer.DEADLINE, b)
    t.set(2.0, Timer.QUEUE, a)  # same time: in the order set
    assert t.next_at() == 2.0 and len(t) == 3
    assert list(t.due(1.9)) == []
    fired = []
    for item in t.due(2.0):
        fired.append(item)
        if len(fired) == 1:
            t.set(1.0, Timer.QUEUE, b)  # set meanwhile and already due: fires in this pass
            t.set(9.0, Timer.QUEUE, b)  # not due: stays
    assert fired == [(Timer.DEADLINE, "b", 1), (Timer.QUEUE, "b", 1), (Timer.QUEUE, "a", 0)]
    assert t.next_at() == 5.0 and list(t.due(100.0)) == [(Timer.QUEUE, "a", 0), (Timer.QUEUE, "b", 1)]
    assert t.next_at() is None


# ---- queues --------------------------------------------------------------------------------------


def _queued(*ids: str, model: str = "m") -> list[Job]:
    return [make_job(i, model=model) for i in ids]


def test_queues_are_fifo_per_model_with_migrated_jobs_first() -> None:
    q = JobQueues()
    a, b, c = _queued("a", "b", "c")
    (x,) = _queued("x", model="n")
    for j in (a, b, x):
        q.push(j, now=1.0)
    q.push(c, now=2.0, front=True)
    assert c.state is JobState.QUEUED and c.queued_at == 2.0 and q.waiting("m") == 3 and q.depths() == {"m": 3, "n": 1}
    started: list[tuple[str, str]] = []
    q.dispatch(lambda job: "w", lambda job, w: started.append((job.job_id, w)))
    assert started == [("c", "w"), ("a", "w"), ("b", "w"), ("x", "w")] and q.depths() == {}


def test_queues_drop_finished_jobs_lazily_and_stop_a_model_without_a_worker() -> None:
    q = JobQueues()
    jobs = _queued("a", "b", "c")
    (x,) = _queued("x", model="n")
    for j in (*jobs, x):
        q.push(j, now=0.0)
    q.remove(jobs[0])  # finished while queued
    jobs[0].state = JobState.DONE
    assert q.waiting("m") == 2
    offered: list[str] = []

    def pick(job: Job) -> str | None:
        offered.append(job.job_id)
        return None if job.model == "m" and len(offered) > 1 else "w"

    q.dispatch(pick, lambda job, w: setattr(job, "state", JobState.RUNNING))
    assert offered == ["b", "c", "x"] and q.waiting("m") == 1 and q.waiting("n") == 0  # c stays: no worker
    q.dispatch(lambda job: "w", lambda job, w: None)
    assert q.waiting("m") == 0


def test_queues_offer_a_job_queued_again_during_dispatch_in_the_same_pass() -> None:
    q = JobQueues()
    a, b = _queued("a", "b")
    q.push(a, now=0.0)
    q.push(b, now=0.0)
    started: list[str] = []

    def start(job: Job, w: str) -> None:
        started.append(job.job_id)
        if job is a and len(started) == 1:  # its send failed: the worker's jobs migrate, first in line
            q.push(a, now=0.0, front=True)

    q.dispatch(lambda job: "w", start)
    assert started == ["a", "a", "b"] and q.waiting("m") == 0


def test_queues_compact_when_mostly_finished() -> None:
    q = JobQueues()
    jobs = _queued(*(f"j{i}" for i in range(100)))
    for j in jobs:
        q.push(j, now=0.0)
    for j in jobs[:90]:
        q.remove(j)
        j.state = JobState.DONE
    assert len(q._queues["m"]) < 100 and q.waiting("m") == 10
    started: list[str] = []
    q.dispatch(lambda job: "w", lambda job, w: started.append(job.job_id))
    assert started == [j.job_id for j in jobs[90:]]


# ---- dispatch ------------------------------------------------------------------------------------


def test_prefix_hashes_are_cumulative() -> None:
    a = prefix_hashes("x" * 128 + "y" * 128 + "tail", 128, 32)
    b = prefix_hashes("x" * 128 + "z" * 128, 128, 32)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # equal h_k <=> equal k-chunk prefix
    assert prefix_hashes("x" * 127, 128, 32) == [] and len(prefix_hashes("x" * 10_000, 128, 32)) == 32


def test_prefix_index_remembers_the_longest_prefix_per_worker_lru() -> None:
    index = PrefixIndex(capacity=3)
    h = prefix_hashes("abcd" * 3, 4, 32)
    index.record(h[:1], b"a")
    index.record(h, b"b")  # b now owns every depth
    assert index.match(h) == {b"b": 3}
    index.record(h[:1], b"a")
    assert index.match(h) == {b"b": 3, b"a": 1} and len(index) == 3
    index.record(prefix_hashes("zzzz", 4, 32), b"c")  # the least recently used entries go: h2,
    assert len(index) == 3 and index.match(h) == {b"b": 3, b"a": 1}
    index.record(prefix_hashes("yyyy", 4, 32), b"c")  # then h3
    assert index.match(h) == {b"a": 1}


def _worker(ident: bytes, capacity: int = 4, inflight: int = 0, dispatched: int = 0) -> WorkerInfo:
    w = WorkerInfo.from_ready(ident, _ready(capacity=capacity), now=0.0)
    w.jobs = {f"{ident!r}-{i}" for i in range(inflight)}
    w.dispatched = dispatched
    return w


def test_affinity_dispatcher_prefers_room_then_load_then_round_robin() -> None:
    d = AffinityDispatcher(slack=0.25)
    job = make_job("j")
    full, busy, idle = _worker(b"full", 1, 1), _worker(b"busy", 4, 2), _worker(b"idle", 4, 0, dispatched=5)
    assert d.pick(job, [full]) is None and d.pick(job, []) is None
    assert d.pick(job, [full, busy, idle]) is idle
    twin = _worker(b"twin", 4, 0, dispatched=1)
    assert d.pick(job, [idle, twin]) is twin  # equal load: the one dispatched to least
    assert d.stats() == {"prefix_entries": 0}


def test_affinity_dispatcher_follows_a_prefix_within_slack() -> None:
    d = AffinityDispatcher(slack=0.25)
    text = "s" * 512
    job = make_job("j", prefix_hashes=prefix_hashes(text, 128, 32))
    a, b = _worker(b"a", 4, 0), _worker(b"b", 4, 0, dispatched=1)
    assert d.pick(job, [a, b]) is a and d.stats() == {"prefix_entries": 4}  # the pick is recorded
    a.jobs = {"x"}  # load 0.25: within slack of b's 0
    assert d.pick(job, [a, b]) is a
    a.jobs = {"x", "y"}  # load 0.5: too far; the least loaded learns the prefix
    assert d.pick(job, [a, b]) is b
    assert d.pick(make_job("k", prefix_hashes=job.prefix_hashes[:2]), [a, b]) is b  # b now has it


def test_a_custom_dispatcher_decides_where_jobs_start() -> None:
    """The routing policy is a replaceable object: the broker asks it with the workers that serve the
    job's model and starts the job where it says (or leaves it queued)."""

    class Last(Dispatcher):
        def __init__(self) -> None:
            self.asked: list[tuple[str, list[bytes]]] = []
            self.hold = False

        def pick(self, job: Job, workers: Sequence[WorkerInfo]) -> WorkerInfo | None:
            self.asked.append((job.job_id, [w.ident for w in workers]))
            return None if self.hold else workers[-1]

        def stats(self) -> dict[str, object]:
            return {"policy": "last"}

    policy = Last()
    b = Broker(BrokerConfig(), dispatcher=policy)
    try:
        b.clients.sock = FakeRouter()
        b.backend = FakeRouter()  # type: ignore[assignment]
        for ident, models in ((b"a", ("m",)), (b"b", ("n",)), (b"c", ("m",))):
            b.on_worker_message([ident, *p.encode(_ready(ident.decode(), models))])
        b.on_client_message([b"cl", *p.encode(p.Submit("j1", "m", p.RequestInput(prompt="x"), {"max_tokens": 4}))])
        assert policy.asked == [("j1", [b"a", b"c"])] and b.jobs["j1"].worker == b"c"
        policy.hold = True
        b.on_client_message([b"cl", *p.encode(p.Submit("j2", "m", p.RequestInput(prompt="x"), {"max_tokens": 4}))])
        assert b.jobs["j2"].state is JobState.QUEUED and b.stats()["policy"] == "last"
        assert "prefix_entries" not in b.stats()
    finally:
        b.ctx.term()


# ---- fan-out -------------------------------------------------------------------------------------


class _Fan:
    """A Fanout over a job table of jobs running on W, a client table sending to a FakeRouter that
    records what each client got, in order, and what the job logs held at that moment."""

    def __init__(self, *job_ids: str) -> None:
        self.counters = Counters()
        self.gone: list[bytes] = []
        self.jobs = JobTable(60.0, 100)
        self.clients = ClientTable(self.counters, self._gone)
        self.sock = FakeRouter(self._got)
        self.clients.sock = self.sock
        self.fanout = Fanout(self.jobs, self.clients, self.counters)
        self.got: list[tuple[bytes, p.Message, dict[str, int]]] = []  # (client, message, log lengths then)
        self.bodies: list[bytes] = []
        for j in job_ids:
            self.jobs.add(make_job(j, worker=W))

    def _got(self, cid: bytes, frames: list[bytes]) -> None:
        self.bodies.append(frames[-1])
        self.got.append((cid, p.decode(frames, p.BROKER_TO_CLIENT), {j.job_id: j.num_chunks for j in self.jobs}))

    def _gone(self, cid: bytes, why: str) -> None:
        self.gone.append(cid)
        for job_id in self.clients.leave(cid):
            self.jobs[job_id].subscribers.pop(cid, None)

    def sub(self, cid: bytes, *job_ids: str) -> None:
        for j in job_ids:
            self.clients.subscribe(self.jobs[j], cid)

    def plain(self, chunks: list[tuple[str, int, list[int]]], attempt: int = 0) -> bool:
        """Relay [job_id, seq, ids] chunks as a plain TOKENS body as it came off the wire."""
        body = msgpack.packb([[attempt] * len(chunks), [[j, s, ids, "t", None] for j, s, ids in chunks]])
        attempts, entries, offset = p.split_tokens_body(body)
        return self.fanout.relay(W, attempts, entries, body, offset)

    def streamed(self, cid: bytes) -> list[tuple[str, int, list[int]]]:
        return [(c.job_id, c.seq, c.token_ids) for to, m, _ in self.got if to == cid and isinstance(m, p.Stream)
                for c in m.chunks]


def test_fanout_forwards_a_batch_for_one_caught_up_client_before_storing_it() -> None:
    f = _Fan("a", "b")
    f.sub(b"c", "a", "b")
    body = msgpack.packb([[0, 0], [["a", 0, [1], "x", None], ["b", 0, [2, 3], "y", None]]])
    attempts, entries, offset = p.split_tokens_body(body)
    assert f.fanout.relay(W, attempts, entries, body, offset)
    assert f.bodies == [body[offset:]] and f.got[0][2] == {"a": 0, "b": 0}  # sent as it came, logs after
    assert f.jobs["a"].chunks() == [["a", 0, [1], "x", None]] and f.jobs["b"].num_tokens == 2
    assert f.jobs["a"].subscribers == {b"c": 1} and f.jobs["b"].subscribers == {b"c": 1}
    assert f.counters["batches_forwarded"] == 1 and f.counters["tokens_in"] == f.counters["tokens_out"] == 3


def test_fanout_sends_each_client_its_own_chunks_when_a_batch_has_several() -> None:
    f = _Fan("a", "b", "c")
    f.sub(b"x", "a", "c")
    f.sub(b"y", "b")
    assert f.plain([("a", 0, [1]), ("b", 0, [2]), ("c", 0, [3])])
    assert f.streamed(b"x") == [("a", 0, [1]), ("c", 0, [3])] and f.streamed(b"y") == [("b", 0, [2])]
    assert f.got[0][2] == {"a": 1, "b": 1, "c": 1}  # stored first, then sent (one body per client)
    assert f.counters["batches_forwarded"] == 0 and f.counters["tokens_out"] == 3
    f.sub(b"y", "a")  # a second subscriber, replayed from the start: the general flush
    f.fanout.flush([f.jobs["a"]])
    assert f.plain([("a", 1, [4])])
    assert f.streamed(b"y")[-2:] == [("a", 0, [1]), ("a", 1, [4])] and f.streamed(b"x")[-1] == ("a", 1, [4])


def test_fanout_drops_stale_and_out_of_place_chunks() -> None:
    f = _Fan("a", "b")
    f.sub(b"c", "a", "b")
    assert f.plain([("a", 0, [1, 2]), ("b", 0, [1])])
    assert f.plain([("a", 0, [9]), ("a", 5, [9]), ("b", 1, [2]), ("zz", 0, [9, 9])])  # dup, gap, ok, unknown
    assert f.plain([("b", 2, [3])], attempt=1)  # an attempt that does not run
    assert f.counters["seq_mismatch"] == 2 and f.counters["stale_messages_dropped"] == 2
    assert f.counters["stale_tokens_dropped"] == 3 and f.counters["batches_forwarded"] == 1
    assert f.streamed(b"c") == [("a", 0, [1, 2]), ("b", 0, [1]), ("b", 1, [2])]
    assert f.jobs["a"].num_tokens == 2 and f.jobs["b"].num_tokens == 2


def test_fanout_judges_a_job_twice_in_a_batch_with_its_first_chunk_in_the_log() -> None:
    """The second chunk of a job in one batch must start where the first ends: a repeat of the first's
    position is a duplicate, dropped (such a batch is never forwarded as it came, though each of its
    chunks may be its job's next one before the batch is stored)."""
    f = _Fan("a", "b")
    f.sub(b"c", "a", "b")
    assert f.plain([("a", 0, [1]), ("b", 0, [9]), ("a", 1, [2])])  # all valid: relayed, each once, in order
    assert f.streamed(b"c") == [("a", 0, [1]), ("b", 0, [9]), ("a", 1, [2])] and f.jobs["a"].tokens == [1, 2]
    assert f.plain([("a", 2, [3]), ("a", 2, [4])])  # a duplicate
    assert f.counters["seq_mismatch"] == 1 and f.counters["batches_forwarded"] == 0
    assert f.streamed(b"c")[3:] == [("a", 2, [3])] and f.jobs["a"].tokens == [1, 2, 3]
    assert f.plain([("a", 3, []), ("a", 3, [5])])  # an empty chunk, then one at the same position
    assert f.jobs["a"].tokens == [1, 2, 3, 5] and f.streamed(b"c")[4:] == [("a", 3, []), ("a", 3, [5])]
    assert f.plain([("a", 4, [6]), ("b", 1, [7])])  # no job twice: forwarded again
    assert f.counters["batches_forwarded"] == 1 and f.counters["tokens_in"] == f.counters["tokens_out"] == 7


def test_fanout_refuses_a_body_that_is_not_plain_without_changing_anything() -> None:
    f = _Fan("a", "b")
    f.sub(b"c", "a", "b")
    for bad in ([[0, 0], [["a", 0, [1], "x", None], ["b", 0, [-1], "x", None]]],  # a bad token id, last
                [[0, 70_000], [["a", 0, [1], "x", None], ["zz", 0, [1], "x", None]]],  # attempt out of range
                [[0, 0], [["a", 0, [1], "x", None], "abcde"]],  # no array
                [[0], [["a", 0, [1], "x", None], ["b", 0, [1], "x", None]]],  # counts differ
                [[0, 0], [["a", 0, [1], "x", None], ["b", 0, [1], "x", [[[1, -0.5]]]]]]):  # logprobs
        raw = msgpack.packb(bad)
        attempts, entries, offset = p.split_tokens_body(raw)
        assert not f.fanout.relay(W, attempts, entries, raw, offset)
    assert all(j.num_tokens == 0 and not j.ends for j in f.jobs) and not f.got and not f.counters


def test_fanout_relays_strictly_decoded_chunks_with_logprobs() -> None:
    f = _Fan("a")
    f.sub(b"c", "a")
    lps = [[[1, -0.5], [2, -1.5]]]
    assert f.fanout.relay(W, [0], [("a", 0, [1], "x", lps)])  # (a TokenChunk's entry: a tuple)
    assert f.jobs["a"].chunks() == [["a", 0, [1], "x", lps]] and f.counters["batches_forwarded"] == 0
    ((to, msg, _),) = f.got
    assert to == b"c"
    assert isinstance(msg, p.Stream) and msg.chunks[0].logprobs == lps


def test_fanout_keeps_what_a_full_queue_refused_and_resends_it_from_the_cursor() -> None:
    f = _Fan("a")
    f.sub(b"c", "a")
    f.sock.blocked.add(b"c")
    assert f.plain([("a", 0, [1])]) and f.plain([("a", 1, [2])])
    assert f.clients.lagging == {"a"} and f.jobs["a"].subscribers == {b"c": 0} and f.counters["tokens_out"] == 0
    assert f.counters["batches_forwarded"] == 1  # the second: not caught up (its client lacks the first)
    f.sock.blocked.clear()
    f.fanout.flush([f.jobs[j] for j in f.clients.take_lagging()])
    assert f.streamed(b"c") == [("a", 0, [1]), ("a", 1, [2])] and f.jobs["a"].subscribers == {b"c": 2}
    assert f.plain([("a", 2, [3])]) and f.counters["batches_forwarded"] == 2  # caught up: forwarded again


def test_fanout_lets_a_gone_client_go_once_the_batch_is_stored() -> None:
    f = _Fan("a")
    f.sub(b"c", "a")
    logged: list[int] = []
    f.clients.on_gone = lambda cid, why: logged.append(f.jobs["a"].num_chunks)
    f.sock.vanishing.add(b"c")
    assert f.plain([("a", 0, [1])])
    assert logged == [1] and f.counters["batches_forwarded"] == 1 and f.counters["tokens_out"] == 0


def test_fanout_sends_the_terminal_reply_after_every_chunk() -> None:
    f = _Fan("a")
    f.sub(b"c", "a")
    job = f.jobs["a"]
    f.sock.blocked.add(b"c")
    assert f.plain([("a", 0, [1])])
    f.jobs.finish(job, p.Done("a", "length", None, (1, 1, 0), 1), now=0.0)
    f.fanout.flush([job])  # data and terminal reply wait behind the full queue
    assert f.got == [] and f.clients.lagging == {"a"} and job.subscribers == {b"c": 0}
    f.sock.blocked.clear()
    f.fanout.flush([job])
    assert [type(m).__name__ for _, m, _ in f.got] == ["Stream", "Done"] and job.subscribers == {}
    f.sub(b"late", "a")  # a late subscriber replays the log, then gets the terminal reply
    f.fanout.flush([job])
    assert [type(m).__name__ for to, m, _ in f.got if to == b"late"] == ["Stream", "Done"]


# ---- GC pacing -----------------------------------------------------------------------------------


@pytest.fixture
def gc_state() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@pytest.mark.usefixtures("gc_state")
def test_gc_pacer_takes_full_collections_to_idle_moments() -> None:
    busy = [False]
    counters = Counters()
    pacer = GcPacer(counters, lambda: busy[0])
    before = gc.get_threshold()
    pacer.start()
    assert pacer.active and gc.get_threshold()[2] > 1 << 20 and gc.get_freeze_count() > 0
    pacer.after_turn(0.0)  # none due yet (fewer young collections than CPython waits for)
    assert not counters
    busy[0] = True
    pacer.collect(10.0)
    pacer.collect(10.0 + pacer.MAX_DEFER / 2)
    assert not counters  # deferred while messages wait...
    pacer.collect(10.0 + pacer.MAX_DEFER + 0.01)
    assert counters == {"gc_full_collections_busy": 1}  # ... but not for longer than MAX_DEFER
    busy[0] = False
    pacer.collect(20.0)
    assert counters["gc_full_collections"] == 1
    pacer.stop()
    assert not pacer.active and gc.get_threshold() == before


@pytest.mark.usefixtures("gc_state")
def test_gc_pacer_leaves_a_process_without_automatic_gc_alone() -> None:
    gc.disable()
    try:
        pacer = GcPacer(Counters(), lambda: False)
        pacer.start()
        assert not pacer.active
    finally:
        gc.enable()


# ---- the observer hook ---------------------------------------------------------------------------


def test_observer_sees_each_worker_message_its_sends_and_the_ticks() -> None:
    events: list[str] = []

    class Recorder(BrokerObserver):
        def worker_message(self, frames: list[Any]) -> None:
            events.append("message")

        def worker_message_handled(self, frames: list[Any]) -> None:
            events.append("handled")

        def client_send(self) -> None:
            events.append("send")

        def tick_started(self) -> None:
            events.append("tick")

        def tick_finished(self) -> None:
            events.append("ticked")

        def stats(self) -> dict[str, Any]:
            return {"recorder": len(events)}

    b = Broker(BrokerConfig(), observer=Recorder())
    try:
        b.clients.sock = FakeRouter()
        b.backend = FakeRouter()  # type: ignore[assignment]
        b.on_worker_message([W, *p.encode(_ready())])
        b.on_client_message([b"c", *p.encode(p.Submit("j", "m", p.RequestInput(prompt="x"), {"max_tokens": 9}))])
        events.clear()
        b.on_worker_message([W, *p.encode(p.Tokens([p.TokenChunk("j", 0, 0, [1], "x")]))])
        b.tick(0.0)
        assert events == ["message", "send", "handled", "tick", "ticked"]
        assert b.stats()["recorder"] == 5
    finally:
        b.ctx.term()
