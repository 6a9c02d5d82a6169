"""The broker's relay hot path (issue 3, item 10): the token log kept as encoded STREAM entries, the
TOKENS fast path (accepts exactly what the strict decoder accepts), the direct relay to caught-up
subscribers next to the general flush (no chunk lost or duplicated, whatever sends fail), and the GC
tuning. In-process: a Broker whose sends are recorded instead of going to sockets."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from broker_fakes import FakeRouter, make_job
from helpers_net import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.broker.broker import Broker, BrokerConfig
from tokenmill.broker.clients import ClientTable
from tokenmill.broker.counters import Counters
from tokenmill.broker.fanout import Fanout
from tokenmill.broker.jobs import Job, JobTable
from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError

W = b"worker-1"


# ---- the token log --------------------------------------------------------------------------------


def _job() -> Job:
    return Job("j", "", "m", p.RequestInput(prompt="x"), {}, 100, 0, b"c", True, 0.0, None, [])


def _old_chunk_index(chunks: list[list[Any]], from_seq: int) -> int:
    """The list-based implementation the log replaced (the reference)."""
    for i, c in enumerate(chunks):
        if c[1] + len(c[2]) > from_seq or (c[1] >= from_seq):
            return i
    return len(chunks)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 4), max_size=12), lps=st.booleans())
def test_log_holds_the_stream_entries(sizes: list[int], lps: bool) -> None:
    job, ref, seq = _job(), [], 0
    for k, n in enumerate(sizes):
        ids = list(range(seq, seq + n))
        logprobs = [[[t, -0.5]] for t in ids] if lps else None
        entry = job.append(seq, ids, f"t{k}", logprobs)
        ref.append(["j", seq, ids, f"t{k}", logprobs])
        assert msgpack.unpackb(entry) == ref[-1]
        seq += n
    assert job.chunks() == ref and job.num_chunks == len(ref) and job.num_tokens == seq
    assert job.tokens == list(range(seq))
    for start in range(len(ref)):
        body = msgpack.Packer().pack_array_header(len(ref) - start) + bytes(job.entries(start))
        assert msgpack.unpackb(body) == ref[start:]
        assert job.tokens_from(start) == seq - ref[start][1]
    for from_seq in range(seq + 3):
        assert job.chunk_index(from_seq) == _old_chunk_index(ref, from_seq)


# ---- the TOKENS fast path accepts exactly what the decoder accepts ----------------------------------

_field = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64 - 1), st.floats(allow_nan=False),
                   st.text(max_size=3), st.binary(max_size=2), st.lists(st.integers(-2, 3), max_size=3))
_good_chunk = st.tuples(st.sampled_from(["j", "a", "b"]) | st.text(min_size=1, max_size=8),
                        st.just(0) | st.integers(0, p.MAX_ATTEMPT), st.integers(0, 2) | st.integers(0, 2**63 - 1),
                        st.lists(st.integers(0, p.MAX_TOKEN_ID), max_size=4), st.text(max_size=5),
                        st.none()).map(list)


def _mutate(chunk: list[Any], i: int, v: Any) -> list[Any]:
    return [*chunk[:i], v, *chunk[i + 1:]]


_chunk = st.one_of(
    _good_chunk,
    st.builds(_mutate, _good_chunk, st.integers(0, 5), _field),  # one field of any type or value
    st.lists(_field, max_size=7),  # wrong arity
    st.just(["a" * (p.MAX_ID_LEN + 1), 0, 0, [1], "", None]),
    st.just(["j", p.MAX_ATTEMPT + 1, 0, [1], "", None]),
    st.just(["j", 0, 0, [p.MAX_TOKEN_ID + 1], "", None]),
    st.just(["j", 0, 0, [1, -1], "", None]),
    st.just(["j", 0, 0, [1], "", [[[1, -0.1]]]]),  # logprobs: valid, but not the plain shape
)


def _tokens_body(chunks: list[Any]) -> Any:
    """[job_id, attempt, seq, ids, text, lps] rows as a TOKENS body [attempts, entries] (a row of
    another arity keeps its items but the attempt, which makes a malformed entry)."""
    return [[c[1] if isinstance(c, list) and len(c) > 1 else 0 for c in chunks],
            [[c[0], *c[2:]] if isinstance(c, list) and len(c) > 1 else c for c in chunks]]


_body = st.one_of(
    st.lists(_chunk, max_size=4).map(_tokens_body),
    st.tuples(st.lists(_field, max_size=3), st.lists(_good_chunk, max_size=3).map(lambda cs: _tokens_body(cs)[1]))
    .map(list),  # attempts of any type, or a count that differs from the entries'
    _field, st.lists(_field, max_size=3),  # not a two-array at all
)


def _kept(chunks: list[p.TokenChunk], jobs: tuple[str, ...]) -> tuple[list[tuple[str, int, list[int]]], int, int]:
    """What a correct relay makes of decoded chunks at jobs that all run attempt 0 with empty logs: the
    (job, seq, ids) it keeps, in order; how many chunks are stale; how many leave a gap or repeat."""
    kept, stale, mismatched, seq = [], 0, 0, dict.fromkeys(jobs, 0)
    for c in chunks:
        if c.job_id not in seq or c.attempt != 0:
            stale += 1
        elif c.seq != seq[c.job_id]:
            mismatched += 1
        else:
            kept.append((c.job_id, c.seq, c.token_ids))
            seq[c.job_id] += len(c.token_ids)
    return kept, stale, mismatched


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_body)
def test_plain_check_accepts_only_what_decode_accepts(body: Any) -> None:
    """The relay's check of a TOKENS body as it came (Fanout.relay given the body: no message objects)
    accepts exactly the valid bodies without logprobs, reads each chunk as the strict decoder does, and
    changes nothing when it refuses one (the broker then decodes strictly)."""
    raw = msgpack.packb(body)
    try:
        decoded: list[p.TokenChunk] | None = p.Tokens.from_wire(p.unpack_body(raw)).chunks
    except ProtocolError:
        decoded = None
    try:
        attempts, entries, offset = p.split_tokens_body(raw)
    except ProtocolError:
        assert decoded is None
        return
    assert msgpack.unpackb(raw[offset:]) == entries  # the entries' own bytes: a STREAM body
    counters = Counters()
    jobs = JobTable(60.0, 100)
    for j in ("j", "a", "b"):
        jobs.add(make_job(j, worker=W))
    fanout = Fanout(jobs, ClientTable(counters, lambda cid, why: None), counters)
    accepted = fanout.relay(W, attempts, entries, raw, offset)
    assert accepted == (decoded is not None and all(c.logprobs is None for c in decoded))
    if accepted:
        assert decoded is not None
        kept, stale, mismatched = _kept(decoded, ("j", "a", "b"))
        assert sorted((c[0], c[1], c[2]) for job in jobs for c in job.chunks()) == sorted(kept)
        assert counters["stale_messages_dropped"] == stale and counters["seq_mismatch"] == mismatched
    else:
        assert all(job.num_tokens == 0 and not job.ends for job in jobs) and not counters


def test_split_tokens_body_rejects_bad_framing() -> None:
    good = msgpack.packb([[0], [["j", 0, [1], "", None]]])
    assert p.split_tokens_body(good)[2] == 3  # 0x92, then [0] (0x91 0x00)
    for bad in (good[:-1], good + b"\x00", msgpack.packb([[0]]), msgpack.packb([[0], [], []]), b"\xc1",
                msgpack.packb({"a": 1}), msgpack.packb([[0], [[b"j", 0, [1], "", None]]], use_bin_type=True)):
        with pytest.raises(ProtocolError):
            p.split_tokens_body(bad)
    with pytest.raises(ProtocolError):
        p.split_tokens_body(good, max_bytes=len(good) - 1)


# ---- relaying through an in-process broker -----------------------------------------------------------


class Harness:
    """A Broker with one registered worker whose sends go to fake sockets: those to clients are recorded
    (and can be made to fail), those to the worker dropped."""

    def __init__(self) -> None:
        self.b = Broker(BrokerConfig())
        self.front = FakeRouter(self._record)
        self.b.clients.sock = self.front
        self.b.backend = FakeRouter()  # type: ignore[assignment]
        self.failing = self.front.blocked  # the sends to these find their queue full
        self.vanishing = self.front.vanishing  # the next send to these finds the client gone
        self.got: dict[tuple[bytes, str], list[tuple[int, list[int]]]] = {}  # (client, job) -> (seq, ids)
        self.terminal: dict[tuple[bytes, str], list[str]] = {}
        self.raw: list[bytes] = []  # the body of every message sent to a client
        self.b.workers.register(W, p.Ready("w", ["m"], 1 << 20, 1, 16, 1 << 20, 60.0), time.monotonic())
        self.seq: dict[str, int] = {}
        self.sends = 0

    def _record(self, cid: bytes, frames: list[bytes]) -> None:
        self.sends += 1
        self.raw.append(frames[-1])
        msg = p.decode(frames, p.BROKER_TO_CLIENT)
        if isinstance(msg, p.Stream):
            for c in msg.chunks:
                self.got.setdefault((cid, c.job_id), []).append((c.seq, c.token_ids))
        elif isinstance(msg, p.Done | p.Fail) and msg.job_id:
            self.terminal.setdefault((cid, msg.job_id), []).append(type(msg).__name__)

    def client(self, cid: bytes, msg: p.Message) -> None:
        self.b.on_client_message([cid, *p.encode(msg)])

    def submit(self, cid: bytes, job_id: str) -> None:
        self.client(cid, p.Submit(job_id, "m", p.RequestInput(prompt="x"), {"max_tokens": 1000}))
        assert self.b.jobs[job_id].worker == W
        self.seq[job_id] = 0

    def subscribe(self, cid: bytes, job_id: str, from_seq: int) -> None:
        self.client(cid, p.Subscribe(job_id, "", from_seq))

    def tokens(self, job_ids: list[str], n: int = 1, logprobs: bool = False) -> None:
        chunks = []
        for j in job_ids:
            ids = list(range(self.seq[j], self.seq[j] + n))
            chunks.append(p.TokenChunk(j, 0, self.seq[j], ids, "x", [[[t, -1.0]] for t in ids] if logprobs else None))
            self.seq[j] += n
        self.b.on_worker_message([W, *p.encode(p.Tokens(chunks))])

    def finish(self, job_id: str) -> None:
        body = msgpack.packb([[job_id, 0, "length", None, [1, self.seq[job_id], 0]]])
        self.b.on_worker_message([W, p.HEADER, bytes((p.Cmd.W_FINISHED,)), body])

    def settle(self) -> None:
        self.failing.clear()
        for _ in range(3):
            self.b.tick(time.monotonic())
        assert not self.b.clients.lagging


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.b.ctx.term()


def test_caught_up_and_lagging_subscribers_get_every_chunk_once(h: Harness) -> None:
    h.submit(b"a", "j1")
    h.submit(b"a", "j2")
    h.submit(b"b", "j3")
    h.tokens(["j1", "j2", "j3"])
    assert h.got[(b"a", "j1")] == [(0, [0])] and h.got[(b"b", "j3")] == [(0, [0])]
    h.failing.add(b"a")  # a's queue is full: its chunks wait behind its cursors
    h.tokens(["j1", "j2", "j3"], n=2)
    assert h.b.clients.lagging == {"j1", "j2"} and h.got[(b"b", "j3")] == [(0, [0]), (1, [1, 2])]
    h.failing.clear()
    h.tokens(["j1", "j1", "j2"])  # j1 twice in one batch; a is resumed from its cursors
    h.settle()
    assert h.got[(b"a", "j1")] == [(0, [0]), (1, [1, 2]), (3, [3]), (4, [4])]
    assert h.got[(b"a", "j2")] == [(0, [0]), (1, [1, 2]), (3, [3])]
    assert h.b.counters["tokens_out"] == 5 + 4 + 3 and h.b.counters["tokens_in"] == 12


def test_second_subscriber_replays_then_follows(h: Harness) -> None:
    h.submit(b"a", "j1")
    h.tokens(["j1"], n=3)
    h.tokens(["j1"], n=2)
    h.subscribe(b"b", "j1", from_seq=4)  # mid-chunk: that whole chunk
    h.tokens(["j1"], logprobs=True)  # two subscribers + logprobs: the strict decode and the general flush
    h.finish("j1")
    assert h.got[(b"a", "j1")] == [(0, [0, 1, 2]), (3, [3, 4]), (5, [5])]
    assert h.got[(b"b", "j1")] == [(3, [3, 4]), (5, [5])]
    assert h.terminal == {(b"a", "j1"): ["Done"], (b"b", "j1"): ["Done"]}


def test_a_batch_with_one_bad_chunk_is_dropped_whole(h: Harness) -> None:
    h.submit(b"a", "j1")
    body = msgpack.packb([[0, 0], [["j1", 0, [1], "x", None], ["j1", 1, [-1], "x", None]]])
    h.b.on_worker_message([W, p.HEADER, bytes((p.Cmd.W_TOKENS,)), body])
    assert h.b.counters["malformed_worker_messages"] == 1 and h.b.jobs["j1"].num_tokens == 0
    assert not h.got


def test_owner_gone_mid_relay_other_subscriber_gets_each_chunk_once(h: Harness) -> None:
    h.submit(b"a", "j1")
    h.subscribe(b"b", "j1", 0)
    h.tokens(["j1"])
    h.vanishing.add(b"a")  # the relay's send to a finds it gone: j1 is cancelled and flushed to b
    h.tokens(["j1"], n=2)  # ... inside the relay that was about to send b the same chunk
    h.settle()
    assert h.got[(b"b", "j1")] == [(0, [0]), (1, [1, 2])] and h.terminal[(b"b", "j1")] == ["Fail"]
    assert h.got[(b"a", "j1")] == [(0, [0])] and (b"a", "j1") not in h.terminal


def test_batch_for_one_caught_up_client_is_forwarded_as_it_came(h: Harness) -> None:
    for j in ("j1", "j2", "j3"):
        h.submit(b"a", j)
    h.raw.clear()
    chunks = [p.TokenChunk("j1", 0, 0, [5], "a"), p.TokenChunk("j2", 0, 0, [6, 7], "b"),
              p.TokenChunk("j3", 0, 0, [], "c")]
    frames = p.encode(p.Tokens(chunks))
    h.b.on_worker_message([W, *frames])
    _, _, offset = p.split_tokens_body(frames[2])
    assert h.raw == [frames[2][offset:]] and h.b.counters["batches_forwarded"] == 1
    assert h.got == {(b"a", "j1"): [(0, [5])], (b"a", "j2"): [(0, [6, 7])], (b"a", "j3"): [(0, [])]}
    for c in chunks:  # the log holds the same entries, and the cursors moved past them
        job = h.b.jobs[c.job_id]
        assert job.chunks() == [c.entry()] and job.subscribers == {b"a": 1} and job.num_tokens == len(c.token_ids)
    assert h.b.counters["tokens_in"] == h.b.counters["tokens_out"] == 3
    h.seq.update(j1=1, j2=2, j3=0)
    h.failing.add(b"a")  # a full queue: nothing lost, resumed from the cursors
    h.tokens(["j1", "j2", "j3"])
    assert h.b.counters["batches_forwarded"] == 2 and h.b.clients.lagging == {"j1", "j2", "j3"}
    assert h.b.counters["tokens_out"] == 3 and h.b.jobs["j1"].num_tokens == 2
    h.settle()
    assert h.got[(b"a", "j1")] == [(0, [5]), (1, [1])] and h.got[(b"a", "j3")] == [(0, []), (0, [0])]
    h.tokens(["j1"])
    assert h.got[(b"a", "j1")][-1] == (2, [2]) and h.b.counters["batches_forwarded"] == 3


def test_forwarded_batch_to_a_gone_client_is_logged_then_cancelled(h: Harness) -> None:
    h.submit(b"a", "j1")
    h.submit(b"a", "j2")
    h.tokens(["j1", "j2"])
    h.vanishing.add(b"a")
    h.tokens(["j1", "j2"], n=2)
    assert h.b.counters["batches_forwarded"] == 2 and h.b.counters["disconnect_cancels"] == 2
    for j in ("j1", "j2"):
        job = h.b.jobs[j]
        assert job.num_tokens == 3 and [c[1] for c in job.chunks()] == [0, 1] and isinstance(job.terminal, p.Fail)
    h.subscribe(b"b", "j1", 0)  # a late subscriber replays the whole log
    assert h.got[(b"b", "j1")] == [(0, [0]), (1, [1, 2])] and h.terminal[(b"b", "j1")] == ["Fail"]


def test_stale_or_out_of_order_chunks_leave_the_forward_path(h: Harness) -> None:
    h.submit(b"a", "j1")
    h.submit(b"a", "j2")
    h.tokens(["j1", "j2"])
    cases = [
        [p.TokenChunk("j1", 1, 1, [1], "x"), p.TokenChunk("j2", 0, 1, [1], "x")],  # a stale attempt
        [p.TokenChunk("j1", 0, 5, [1], "x"), p.TokenChunk("j2", 0, 1, [1], "x")],  # a gap
        [p.TokenChunk("j1", 0, 0, [0], "x"), p.TokenChunk("j2", 0, 1, [1], "x")],  # a duplicate
        [p.TokenChunk("zz", 0, 0, [1], "x"), p.TokenChunk("j2", 0, 1, [1], "x")],  # an unknown job
    ]
    for chunks in cases:
        h.b.on_worker_message([W, *p.encode(p.Tokens(chunks))])
        h.seq["j2"] = 1
    assert h.b.counters["batches_forwarded"] == 1  # only the first batch
    assert h.got[(b"a", "j2")] == [(0, [0]), (1, [1])]  # the valid chunk of the first case, once
    assert h.got[(b"a", "j1")] == [(0, [0])] and h.b.jobs["j1"].num_tokens == 1
    assert h.b.counters["seq_mismatch"] == 5 and h.b.counters["stale_messages_dropped"] == 2


_zero = st.one_of(st.just(0), st.just(0), st.just(0), st.integers(0, 2))
_near_chunk = st.tuples(st.sampled_from(["j", "a", "b", "j", "a", "b", "zz"]), _zero, _zero,
                        st.lists(st.integers(0, 9), max_size=3) | st.lists(st.integers(-2, p.MAX_TOKEN_ID + 2),
                                                                           max_size=3),
                        st.text(max_size=3), st.none()).map(list)  # chunks that are often the jobs' next ones
_near_body = st.lists(st.one_of(_near_chunk, _near_chunk, _near_chunk,
                                st.builds(_mutate, _near_chunk, st.integers(0, 5), _field)),
                      min_size=1, max_size=3, unique_by=lambda c: str(c[0])).map(_tokens_body)
_next_body = st.lists(st.tuples(st.sampled_from(["j", "a", "b"]), st.just(0), st.just(0),
                                st.lists(st.integers(0, p.MAX_TOKEN_ID), max_size=3), st.text(max_size=3),
                                st.none()).map(list),
                      min_size=1, max_size=3, unique_by=lambda c: c[0]).map(_tokens_body)  # all valid, all next
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(_next_body, _near_body, _body))
def test_forward_path_relays_only_what_decode_accepts(body: Any) -> None:
    """Fuzzed TOKENS bodies at a broker whose jobs j, a, b (the fuzzer's likely ids) run on the worker
    with one caught-up subscriber: whatever reaches the client is exactly what the strict decoder makes
    of the body, and a body it rejects changes nothing but the malformed counter."""
    h = Harness()
    try:
        for j in ("j", "a", "b"):
            h.submit(b"c", j)
        raw = msgpack.packb(body)
        try:
            decoded: list[p.TokenChunk] | None = p.Tokens.from_wire(p.unpack_body(raw)).chunks
        except ProtocolError:
            decoded = None
        h.b.on_worker_message([W, p.HEADER, bytes((p.Cmd.W_TOKENS,)), raw])
        got = sorted((j, s, ids) for (_, j), cs in h.got.items() for s, ids in cs)
        if decoded is None:
            assert h.b.counters["malformed_worker_messages"] == 1 and not h.got
            assert all(job.num_tokens == 0 and not job.ends for job in h.b.jobs)
        else:
            want = []
            seq = dict.fromkeys(("j", "a", "b"), 0)
            for c in decoded:  # what a correct relay keeps: each job's next chunk of attempt 0
                if c.job_id in seq and c.attempt == 0 and c.seq == seq[c.job_id]:
                    want.append((c.job_id, c.seq, c.token_ids))
                    seq[c.job_id] += len(c.token_ids)
            assert got == sorted(want)
            assert h.b.counters["tokens_out"] == sum(len(w[2]) for w in want)
    finally:
        h.b.ctx.term()


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_next_body)
def test_every_valid_batch_of_next_chunks_is_forwarded(body: Any) -> None:
    h = Harness()
    try:
        for j in ("j", "a", "b"):
            h.submit(b"c", j)
        h.sends = 0  # (the ACKs)
        h.b.on_worker_message([W, p.HEADER, bytes((p.Cmd.W_TOKENS,)), msgpack.packb(body)])
        assert h.b.counters["batches_forwarded"] == 1 and h.sends == 1
        assert {j: cs for (_, j), cs in h.got.items()} == {e[0]: [(0, e[2])] for e in body[1]}
    finally:
        h.b.ctx.term()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("tokens"), st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(0, 3),
              st.frozensets(st.sampled_from([b"a", b"b", b"c"]))),
    st.tuples(st.just("subscribe"), st.sampled_from([b"b", b"c"]), st.integers(0, 3), st.integers(0, 9)),
    st.tuples(st.just("finish"), st.integers(0, 3)),
    st.tuples(st.just("vanish"), st.sampled_from([b"a", b"b", b"c"])),
    st.just(("tick",)),
), max_size=25))
def test_no_chunk_lost_or_duplicated(ops: list[tuple[Any, ...]]) -> None:
    """Random batches (a job may appear twice in one), subscriptions mid-stream, sends that fail (full
    queue) or find the client gone (its jobs are cancelled: terminal replies flushed to the others in
    the middle of a relay): every subscriber still present gets each chunk of its jobs exactly once,
    in order, then one terminal reply; one that left got a prefix."""
    h = Harness()
    try:
        jobs = [f"j{i}" for i in range(4)]
        subs = {(b"a", j): 0 for j in jobs}  # (client, job) -> first chunk index it is owed
        for j in jobs:
            h.submit(b"a", j)
        done: set[str] = set()
        gone: set[bytes] = set()
        for op in ops:
            if op[0] == "tokens":
                h.failing = set(op[3])
                live = [jobs[i] for i in op[1] if jobs[i] not in done]
                if live:
                    h.tokens(live, n=op[2])
            elif op[0] == "subscribe":
                job = h.b.jobs[jobs[op[2]]]
                if (op[1], job.job_id) not in subs and op[1] not in gone | h.vanishing:
                    subs[(op[1], job.job_id)] = job.chunk_index(op[3])
                    h.subscribe(op[1], job.job_id, op[3])
            elif op[0] == "finish" and jobs[op[1]] not in done:
                done.add(jobs[op[1]])
                h.finish(jobs[op[1]])
            elif op[0] == "vanish":
                h.vanishing.add(op[1])
                gone.add(op[1])
            else:
                h.b.tick(time.monotonic())
        h.vanishing.clear()
        h.settle()
        for (cid, j), first in subs.items():
            job = h.b.jobs[j]
            want = [(c[1], c[2]) for c in job.chunks()[first:]]
            got = h.got.get((cid, j), [])
            terminal = h.terminal.get((cid, j), [])
            if cid in gone:
                assert got == want[:len(got)] and len(terminal) <= 1, (cid, j)
            else:
                assert got == want, (cid, j)
                assert terminal == ([type(job.terminal).__name__] if job.terminal else []), (cid, j)
    finally:
        h.b.ctx.term()


# ---- GC tuning -------------------------------------------------------------------------------------------


def test_full_collections_wait_for_empty_sockets() -> None:
    threshold = gc.get_threshold()
    full: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(1)

    b = Broker(BrokerConfig(frontend="tcp://127.0.0.1:0", backend="tcp://127.0.0.1:0"))
    b.bind()
    ctx = zmq.Context()
    worker = ctx.socket(zmq.DEALER)
    try:
        b.gc.start()
        assert gc.get_threshold()[2] > 1 << 20 and gc.get_freeze_count() > 1000
        gc.callbacks.append(on_gc)
        now = time.monotonic()
        b.gc.collect(now)  # nothing waiting: collects at once
        assert full == [1] and b.counters["gc_full_collections"] == 1
        worker.connect(b.endpoint("backend"))
        worker.send_multipart(p.encode(p.WorkerHeartbeat()))
        deadline = time.monotonic() + 10
        while not int(b.backend.get(zmq.EVENTS)) & zmq.POLLIN:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b.gc.collect(now)  # a message is waiting: deferred
        b.gc.collect(now + b.gc.MAX_DEFER / 2)
        assert full == [1]
        b.gc.collect(now + b.gc.MAX_DEFER + 0.1)  # ... but not for longer than that
        assert full == [1, 1] and b.counters["gc_full_collections_busy"] == 1
    finally:
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
        gc.unfreeze()
        gc.set_threshold(*threshold)
        worker.close(linger=0)
        ctx.term()
        for s in (b.frontend, b.backend):
            assert s is not None
            s.close(linger=0)
        b.ctx.term()


@pytest.mark.parametrize("busy_poll", [0.0, 0.05])
def test_relay_through_the_run_loop(busy_poll: float) -> None:
    """A worker and clients on real sockets, with and without busy polling: the batch that goes to one
    caught-up client is forwarded as it came; with a second subscriber (replayed from the log) the next
    one takes the general path; then DONE to both."""
    b = Broker(BrokerConfig(frontend="tcp://127.0.0.1:0", backend="tcp://127.0.0.1:0", busy_poll=busy_poll,
                            gc_tuning=False))
    b.bind()
    ctx = zmq.Context()
    worker, client, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    try:
        for s in (worker, client, other):
            s.setsockopt(zmq.LINGER, 0)
        worker.connect(b.endpoint("backend"))
        client.connect(b.endpoint("frontend"))
        other.connect(b.endpoint("frontend"))

        def recv(sock: zmq.Socket, want: type[p.Message]) -> p.Message:
            while True:
                assert sock.poll(10_000), f"no {want.__name__}"
                frames = sock.recv_multipart()
                msg = p.decode(frames, p.BROKER_TO_WORKER if sock is worker else p.BROKER_TO_CLIENT)
                if isinstance(msg, want):
                    return msg

        worker.send_multipart(p.encode(p.Ready("w", ["m"], 8, 100, 16, 1024, 5.0)))
        recv(worker, p.BrokerHeartbeat)
        client.send_multipart(p.encode(p.Submit("j1", "m", p.RequestInput(prompt="x"), {"max_tokens": 3})))
        sub = recv(worker, p.WorkerSubmit)
        assert isinstance(sub, p.WorkerSubmit) and sub.job_id == "j1"
        worker.send_multipart(p.encode(p.Tokens([p.TokenChunk("j1", 0, 0, [4, 5], "ab")])))
        got = recv(client, p.Stream)
        assert isinstance(got, p.Stream) and got.chunks == [p.StreamChunk("j1", 0, [4, 5], "ab")]
        other.send_multipart(p.encode(p.Subscribe("j1", "", 0)))  # the same owner token: allowed
        got = recv(other, p.Stream)  # the replay from the log
        assert isinstance(got, p.Stream) and got.chunks == [p.StreamChunk("j1", 0, [4, 5], "ab")]
        worker.send_multipart(p.encode(p.Tokens([p.TokenChunk("j1", 0, 2, [6], "c")])))
        worker.send_multipart(p.encode(p.Finished([p.FinishedJob("j1", 0, "length", None, (1, 3, 0))])))
        for sock in (client, other):
            got = recv(sock, p.Stream)
            assert isinstance(got, p.Stream) and got.chunks == [p.StreamChunk("j1", 2, [6], "c")]
            done = recv(sock, p.Done)
            assert isinstance(done, p.Done) and done.num_tokens == 3
        assert b.counters["batches_forwarded"] == 1 and b.counters["tokens_out"] == 2 + 2 + 2 * 1  # + the replay
    finally:
        b.stop()
        thread.join(10)
        for s in (worker, client, other):
            s.close(linger=0)
        ctx.term()


def test_busy_poll_option_reaches_the_broker_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenmill broker --busy-poll` / TOKENMILL_BUSY_POLL set BrokerConfig.busy_poll (off by default), and
    the config refuses values outside [0, 1] s."""
    from tokenmill.cli.main import build_parser

    assert build_parser().parse_args(["broker"]).busy_poll == 0.0
    assert build_parser().parse_args(["broker", "--busy-poll", "0.02"]).busy_poll == 0.02
    monkeypatch.setenv("TOKENMILL_BUSY_POLL", "0.01")
    assert build_parser().parse_args(["broker"]).busy_poll == 0.01
    for bad in (-0.1, 2.0):
        with pytest.raises(ValueError, match="busy_poll"):
            BrokerConfig(busy_poll=bad)


def test_worker_output_on_its_data_socket() -> None:
    """A worker whose READY names a data socket (Ready.data_id: its engine loop's own DEALER) may send its
    output there; a READY claiming a routing id in use is refused; DISCONNECT on the data socket ends the
    worker and its later output is dropped as stale."""
    b = Broker(BrokerConfig(frontend="tcp://127.0.0.1:0", backend="tcp://127.0.0.1:0", gc_tuning=False))
    b.bind()
    ctx = zmq.Context()
    socks = {name: ctx.socket(zmq.DEALER) for name in ("ctl", "data", "evil", "client")}
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    try:
        for name, s in socks.items():
            s.setsockopt(zmq.LINGER, 0)
            if name != "client":
                s.setsockopt(zmq.ROUTING_ID, {"ctl": b"w-1", "data": b"w-1/data", "evil": b"w-2"}[name])
            s.connect(b.endpoint("frontend" if name == "client" else "backend"))
        ctl, data, evil, client = socks["ctl"], socks["data"], socks["evil"], socks["client"]

        def recv(sock: zmq.Socket, want: type[p.Message]) -> p.Message:
            while True:
                assert sock.poll(10_000), f"no {want.__name__}"
                msg = p.decode(sock.recv_multipart(), p.BROKER_TO_CLIENT if sock is client else p.BROKER_TO_WORKER)
                if isinstance(msg, want):
                    return msg

        ctl.send_multipart(p.encode(p.Ready("w", ["m"], 8, 100, 16, 1024, 5.0, data_id="w-1/data")))
        recv(ctl, p.BrokerHeartbeat)
        evil.send_multipart(p.encode(p.Ready("e", ["m"], 8, 100, 16, 1024, 5.0, data_id="w-1")))
        wait_until(lambda: b.counters["malformed_worker_messages"] == 1, 10, what="the bad READY refused")
        assert b.workers.control_idents() == [b"w-1"] and b.workers.data_idents() == [b"w-1/data"]

        client.send_multipart(p.encode(p.Submit("j1", "m", p.RequestInput(prompt="x"), {"max_tokens": 3})))
        sub = recv(ctl, p.WorkerSubmit)
        assert isinstance(sub, p.WorkerSubmit) and sub.job_id == "j1"
        data.send_multipart(p.encode(p.Tokens([p.TokenChunk("j1", 0, 0, [4, 5, 6], "abc")])))
        data.send_multipart(p.encode(p.Finished([p.FinishedJob("j1", 0, "length", None, (1, 3, 0))])))
        got = recv(client, p.Stream)
        assert isinstance(got, p.Stream) and got.chunks == [p.StreamChunk("j1", 0, [4, 5, 6], "abc")]
        done = recv(client, p.Done)
        assert isinstance(done, p.Done) and done.num_tokens == 3

        data.send_multipart(p.encode(p.WorkerDisconnect()))
        wait_until(lambda: not b.workers, 10, what="the worker gone")
        assert b.workers.data_idents() == [] and b.counters["workers_lost"] == 1
        data.send_multipart(p.encode(p.Tokens([p.TokenChunk("j1", 0, 3, [7], "d")])))
        wait_until(lambda: b.counters["stale_tokens_dropped"] == 1, 10, what="stale output dropped")
    finally:
        b.stop()
        thread.join(10)
        for s in socks.values():
            s.close(linger=0)
        ctx.term()
