"""The scheduler driven by a fake model (no torch): budgets, decode-first order, chunked prefill,
preemption (victim choice, recompute, same output), priority, finish/abort, requests that never fit,
prefix-cache reuse, and a hypothesis test over random workloads.

The fake model keeps a real paged KV store: each step it writes every scheduled token into the
request's blocks, then reads the whole sequence back through the block table and samples the next
token as a hash of (seed, the sequence it read). A wrong prefix hit, a block shared while written,
a stale block or a lost token changes the output, and the read-back check names the request."""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field, replace
from typing import Literal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.block_manager import BlockManager
from tokenmill.worker.config import SchedulerConfig
from tokenmill.worker.request import Request, RequestStatus
from tokenmill.worker.scheduler import ScheduledBatch, Scheduler

VOCAB = 16
EOS = 0
BIG = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64)
Policy = Literal["fcfs", "priority"]


def next_token(seed: int, history: list[int]) -> int:
    return zlib.crc32(array("q", [seed, *history]).tobytes()) % VOCAB


class FakeModel:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.kv: list[list[int | None]] = [[None] * blocks.block_size for _ in range(blocks.num_blocks)]

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        bs = self.blocks.block_size
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            assert n > 0 and start + n <= req.num_tokens, f"{req.request_id}: bad chunk {start}+{n}"
            assert start + n <= len(req.block_ids) * bs, f"{req.request_id}: blocks do not cover the chunk"
            for pos in range(start, start + n):
                b = req.block_ids[pos // bs]
                block = self.blocks._blocks[b]
                assert block.ref_count == 1 and block.hash is None, \
                    f"{req.request_id} writes block {b}, which is shared or in the prefix cache"
                self.kv[b][pos % bs] = req.token_ids[pos]
        sampled: list[int | None] = []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
            end = req.num_computed_tokens + n
            seen = [self.kv[req.block_ids[p // bs]][p % bs] for p in range(end)]
            assert seen == req.token_ids[:end], f"{req.request_id} reads KV that is not its own sequence"
            sampled.append(next_token(req.seed, req.token_ids) if batch.samples(i) else None)
        return sampled


@dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0
    arrival: int = 0  # the step at which it is added
    abort_at: int | None = None  # the step at which it is aborted
    abort_mid: bool = False  # aborted between the launch (begin_step) and commit(), not before schedule()


@dataclass
class Run:
    sched: Scheduler
    requests: list[Request]
    model: FakeModel
    steps: int = 0
    batches: list[list[tuple[str, int]]] = field(default_factory=list)  # (request id, tokens) per step
    samples: list[list[bool]] = field(default_factory=list)  # per step: which requests sampled
    preempted: list[list[str]] = field(default_factory=list)
    first_step: dict[str, int] = field(default_factory=dict)


def make_scheduler(config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int = 10_000,
                   caching: bool = True) -> Scheduler:
    return Scheduler(config, BlockManager(num_blocks, block_size, caching), max_model_len, [EOS])


def check_batch(sched: Scheduler, batch: ScheduledBatch, before_running: list[Request]) -> None:
    """Everything one step must satisfy, whatever the workload."""
    cfg, key = sched.config, (lambda r: r.sort_key(sched.by_priority))
    ids = [r.request_id for r in batch.requests]
    assert len(set(ids)) == len(ids), "a request is scheduled twice"
    assert batch.total_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert len(batch.requests) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    if cfg.long_prefill_token_threshold and cfg.enable_chunked_prefill:
        assert max(batch.num_new_tokens, default=0) <= cfg.long_prefill_token_threshold
    assert all(r.status is RequestStatus.RUNNING and r in sched.running for r in batch.requests)
    old_ids = {r.request_id for r in before_running}
    old = [r for r in batch.requests if r.request_id in old_ids]
    new = [r for r in batch.requests if r.request_id not in old_ids]
    # Running requests (decodes and continuing chunks) come first, in queue order; then admissions.
    assert batch.requests == old + new, "a new prefill was scheduled before a running request"
    assert [key(r) for r in old] == sorted(key(r) for r in old)
    if new:
        assert not batch.preempted, "admitted a waiting request in a step that preempted"
        assert all(r in batch.requests for r in before_running if r.status is RequestStatus.RUNNING), \
            "admitted a waiting request while a running one was left out"
        assert all(key(r) < key(w) for r in new for w in sched.waiting), "admission out of queue order"
    if not cfg.enable_chunked_prefill:
        for r, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            assert r.num_computed_tokens + n == r.num_tokens, "a prompt was chunked with chunking disabled"
    for v in batch.preempted:  # victims are the latest arrived / lowest priority
        assert v.status is RequestStatus.PREEMPTED and not v.block_ids and v.num_computed_tokens == 0
        assert v not in batch.requests
        assert all(key(r) < key(v) for r in sched.running), "preempted a request ahead of a running one"
    for f in batch.failed:
        assert f.is_finished and f.finish_reason == "error" and not f.block_ids


def check_state(sched: Scheduler) -> None:
    blocks = sched.blocks
    live = sched.running + sched.waiting
    blocks.check_integrity(live)
    if not live:
        assert blocks.num_in_use == 0, "blocks leaked with no request left"
    for r in sched.waiting:
        assert not r.block_ids and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for r in sched.running:
        assert r.num_computed_tokens <= len(r.block_ids) * blocks.block_size
        assert r.num_computed_tokens < r.num_tokens, "a running request has nothing to compute"


def drive(sched: Scheduler, specs: list[Spec], max_steps: int = 20_000,
          model: FakeModel | None = None) -> Run:
    """Run `specs` to completion; every step is checked. Request i is `specs[i]`; ids are "r{i}".
    Pass the `model` of an earlier run on the same scheduler: its KV store holds the cached blocks."""
    reqs = [Request(f"r{i}", list(s.prompt), s.params, seed=s.seed, arrival_seq=-1, priority=s.priority)
            for i, s in enumerate(specs)]
    run = Run(sched, reqs, model or FakeModel(sched.blocks))
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    arrived = 0
    while arrived < len(order) or sched.has_unfinished():
        while arrived < len(order) and specs[order[arrived]].arrival <= run.steps:
            reqs[order[arrived]].arrival_seq = arrived
            sched.add(reqs[order[arrived]])
            arrived += 1
        _abort(sched, specs, reqs, run.steps, mid=False)
        before_running = list(sched.running)
        batch = sched.schedule()
        check_batch(sched, batch, before_running)
        if sched.waiting and not (batch.requests or batch.preempted or batch.failed):
            raise AssertionError(f"stalled: {len(sched.waiting)} waiting, nothing scheduled")
        for r in batch.requests:
            run.first_step.setdefault(r.request_id, run.steps)
        run.batches.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
        run.preempted.append([r.request_id for r in batch.preempted])
        run.samples.append([batch.samples(i) for i in range(len(batch.requests))])
        sampled = run.model.execute(batch)
        sched.begin_step(batch)
        _abort(sched, specs, reqs, run.steps, mid=True)
        got = sched.commit(batch, sampled)
        assert all(r in batch.requests for r in got)
        check_state(sched)
        run.steps += 1
        assert run.steps <= max_steps, "no termination: too many steps"
    assert all(r.is_finished for r in reqs)
    return run


def step(sched: Scheduler, model: FakeModel, batch: ScheduledBatch) -> list[Request]:
    """A synchronous step of `batch`: launch (the fake model runs), begin_step, commit."""
    sampled = model.execute(batch)
    sched.begin_step(batch)
    return sched.commit(batch, sampled)


def _abort(sched: Scheduler, specs: list[Spec], reqs: list[Request], step: int, mid: bool) -> None:
    for s, r in zip(specs, reqs):
        if s.abort_at == step and s.abort_mid == mid and r.arrival_seq >= 0 and not r.is_finished:
            in_use = sched.blocks.num_in_use
            own = sum(1 for b in r.block_ids if sched.blocks._blocks[b].ref_count == 1)
            sched.finish(r, "abort")
            assert sched.blocks.num_in_use == in_use - own, "abort did not free the blocks at once"
            assert r not in sched.running and r not in sched.waiting and not r.block_ids


def reference(spec: Spec, max_model_len: int = 10_000) -> tuple[list[int], str]:
    """What the request produces by definition of the fake model and the stop rules."""
    tokens, p = list(spec.prompt), spec.params
    while True:
        t = next_token(spec.seed, tokens)
        tokens.append(t)
        n_out = len(tokens) - len(spec.prompt)
        if n_out >= p.min_tokens and (t in p.stop_token_ids or (not p.ignore_eos and t == EOS)):
            return tokens[len(spec.prompt) :], "stop"
        if n_out >= p.max_tokens or len(tokens) >= max_model_len:
            return tokens[len(spec.prompt) :], "length"


def run_alone(spec: Spec, block_size: int, max_model_len: int = 10_000) -> tuple[list[int], str]:
    alone = replace(spec, arrival=0, abort_at=None)
    blocks = len(spec.prompt) // block_size + spec.params.max_tokens + 2
    run = drive(make_scheduler(BIG, blocks, block_size, max_model_len, caching=False), [alone])
    r = run.requests[0]
    assert r.finish_reason is not None
    return r.output_token_ids, r.finish_reason


def outputs(run: Run) -> list[tuple[list[int], str | None]]:
    return [(r.output_token_ids, r.finish_reason) for r in run.requests]


def spec(prompt_len: int, max_tokens: int, seed: int, priority: int = 0, arrival: int = 0) -> Spec:
    """A request that runs to max_tokens; its prompt is a function of its seed."""
    prompt = [(seed * 31 + 7 * i) % (VOCAB - 1) + 1 for i in range(prompt_len)]
    return Spec(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed, priority, arrival)


# -- deterministic scenarios --------------------------------------------------------------------------


def test_alone_matches_reference_including_stop_rules() -> None:
    stops = SamplingParams(max_tokens=30, min_tokens=5, stop_token_ids=(3, 4))
    cases = [Spec([1, 2, 3], SamplingParams(max_tokens=40), seed=s) for s in range(8)]
    cases += [Spec([5], stops, seed=s) for s in range(8)]
    cases += [Spec([1] * 20, SamplingParams(max_tokens=50, ignore_eos=True), seed=1)]
    reasons = set()
    for c in cases:
        for bs in (1, 16):
            got = run_alone(c, bs, max_model_len=30)
            assert got == reference(c, max_model_len=30)
            reasons.add(got[1])
    assert reasons == {"stop", "length"}


def test_decodes_first_budget_and_chunked_prefill_mixing() -> None:
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3), 64, 4)
    specs = [spec(3, 6, 0), spec(20, 2, 1, arrival=1), spec(2, 2, 2, arrival=1), spec(2, 2, 3, arrival=1)]
    run = drive(sched, specs)
    b = run.batches
    assert b[0] == [("r0", 3)]
    # r0 decodes first; the long prompt is split by what the budget leaves; r2 must wait for room.
    assert b[1] == [("r0", 1), ("r1", 7)]
    assert b[2] == [("r0", 1), ("r1", 7)]
    assert b[3] == [("r0", 1), ("r1", 6), ("r2", 1)]  # r1's last chunk samples; r2 gets 1 of 2 tokens
    assert b[4] == [("r0", 1), ("r1", 1), ("r2", 1)]  # max_num_seqs=3: r3 waits though budget is left
    assert "r3" not in dict(b[4])
    assert max(len(x) for x in b) <= 3 and max(sum(n for _, n in x) for x in b) <= 8
    for s, got in zip(specs, outputs(run)):
        assert got == reference(s)


def test_long_prompt_is_chunked_and_samples_only_at_its_end() -> None:
    run = drive(make_scheduler(SchedulerConfig(max_num_batched_tokens=16), 64, 4), [spec(50, 3, 5)])
    assert [x[0][1] for x in run.batches] == [16, 16, 16, 2, 1, 1]
    assert [x[0] for x in run.samples] == [False, False, False, True, True, True]
    assert outputs(run)[0] == reference(spec(50, 3, 5))


def test_long_prefill_threshold_caps_chunks() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    run = drive(make_scheduler(cfg, 64, 4), [spec(25, 2, 1)])
    assert [x[0][1] for x in run.batches] == [10, 10, 5, 1]


def _preemption_workload() -> list[Spec]:
    return [spec(5 + 3 * i, 24, i, arrival=i // 2) for i in range(6)]


def test_tiny_kv_budget_preempts_and_gives_the_same_tokens() -> None:
    specs = _preemption_workload()
    large = drive(make_scheduler(SchedulerConfig(max_num_batched_tokens=32), 256, 4), specs)
    assert large.sched.counters.preemptions == 0
    tiny = drive(make_scheduler(SchedulerConfig(max_num_batched_tokens=32), 12, 4), specs, max_steps=2000)
    assert tiny.sched.counters.preemptions > 0
    assert outputs(tiny) == outputs(large) == [reference(s) for s in specs]
    assert all(r.finish_reason == "length" for r in tiny.requests)
    assert sum(r.num_preemptions for r in tiny.requests) == tiny.sched.counters.preemptions


def _victim_scenario(policy: Policy, priorities: list[int]) -> Run:
    # Block size 2, 4 blocks; three 2-token prompts fill three blocks, then each decode needs a new one.
    cfg = SchedulerConfig(max_num_batched_tokens=64, policy=policy)
    specs = [spec(2, 3, i, priority=p) for i, p in enumerate(priorities)]
    return drive(make_scheduler(cfg, 4, 2), specs)


def test_fcfs_preempts_the_latest_arrival() -> None:
    run = _victim_scenario("fcfs", [0, 0, 0])
    assert run.preempted[1] == ["r2"], "the latest-arrived running request is the victim"
    assert run.batches[1] == [("r0", 1), ("r1", 1)]
    assert outputs(run) == [reference(s) for s in [spec(2, 3, i) for i in range(3)]]


def test_priority_preempts_the_lowest_priority_not_the_latest() -> None:
    run = _victim_scenario("priority", [2, 0, 1])  # r0 arrived first but has the lowest priority
    assert run.preempted[1] == ["r0"]
    assert run.batches[1] == [("r1", 1), ("r2", 1)]


def test_priority_policy_serves_lower_number_first() -> None:
    priorities = [3, 1, 2, 1, 0]
    cases: list[tuple[Policy, list[str]]] = [("priority", ["r4", "r1", "r3", "r2", "r0"]),
                                             ("fcfs", ["r0", "r1", "r2", "r3", "r4"])]
    for policy, expect in cases:
        cfg = SchedulerConfig(max_num_seqs=1, policy=policy)
        run = drive(make_scheduler(cfg, 64, 4), [spec(3, 2, i, priority=p) for i, p in enumerate(priorities)])
        assert sorted(run.first_step, key=run.first_step.__getitem__) == expect, policy
    # A later, more urgent arrival goes ahead of the running request in every later step.
    cfg = SchedulerConfig(policy="priority")
    run = drive(make_scheduler(cfg, 64, 4), [spec(3, 6, 0, priority=2), spec(3, 4, 1, priority=0, arrival=1)])
    assert run.batches[1] == [("r0", 1), ("r1", 3)]
    assert run.batches[2] == [("r1", 1), ("r0", 1)]


def test_finish_and_abort_free_blocks_at_once() -> None:
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=2), 32, 4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reqs = [Request(f"r{i}", list(range(1 + i, 15 + i)), params, seed=i, arrival_seq=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    model = FakeModel(sched.blocks)
    batch = sched.schedule()  # r0 gets 12 of 14 prompt tokens; r1 nothing yet (no budget left)
    step(sched, model, batch)
    batch = sched.schedule()  # r0 finishes its prompt, r1 starts
    step(sched, model, batch)
    r0, r1, r2 = reqs
    assert r0.status is RequestStatus.RUNNING and r1.status is RequestStatus.RUNNING
    assert r2.status is RequestStatus.WAITING and r1.num_computed_tokens < r1.num_tokens
    in_use = sched.blocks.num_in_use
    assert len(r1.block_ids) > 0
    n1 = len(r1.block_ids)
    sched.finish(r1, "abort")  # mid-prefill
    assert sched.blocks.num_in_use == in_use - n1 and not r1.block_ids and r1.finish_reason == "abort"
    sched.finish(r2, "abort")  # waiting: holds nothing, leaves the queue
    assert r2 not in sched.waiting and sched.blocks.num_in_use == in_use - n1
    check_state(sched)
    # Aborted while its step runs: commit() skips it and appends nothing.
    batch = sched.schedule()
    assert batch.requests == [r0]
    sampled = model.execute(batch)
    n_tokens = r0.num_tokens
    sched.begin_step(batch)
    assert r0.num_tokens == n_tokens + 1 and r0.num_inflight == 1
    sched.finish(r0, "abort")
    assert sched.blocks.num_in_use == 0 and r0.num_inflight == 0
    assert sched.commit(batch, sampled) == [] and r0.num_tokens == n_tokens
    assert not sched.has_unfinished()
    check_state(sched)
    assert sched.blocks.num_cached > 0, "computed full blocks stay reusable after an abort"


def test_request_that_never_fits_fails_and_others_are_unaffected() -> None:
    # 4 blocks of 4 tokens. r0's prompt needs 5 blocks: it fails at admission, with the cache all free,
    # and r1 behind it is admitted in the same step. r3 fits its prompt but not its generation.
    specs = [spec(20, 3, 1), spec(5, 5, 0), spec(3, 4, 2, arrival=1), spec(10, 20, 3, arrival=2)]
    run = drive(make_scheduler(SchedulerConfig(max_num_batched_tokens=32), 4, 4), specs)
    r0, r3 = run.requests[0], run.requests[3]
    assert r0.finish_reason == "error" and "KV cache" in str(r0.stop_reason) and r0.output_token_ids == []
    assert "r0" not in run.first_step and run.batches[0] == [("r1", 5)]
    assert r3.finish_reason == "error" and 0 < r3.num_output_tokens < 20
    assert r3.num_tokens == 17, "fails when its next step needs a 5th block, not before"
    assert r3.output_token_ids == reference(specs[3])[0][: r3.num_output_tokens]
    assert outputs(run)[1:3] == [reference(specs[1]), reference(specs[2])]
    assert run.sched.blocks.num_in_use == 0


def test_chunked_prefill_off_fails_prompts_longer_than_the_budget() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False,
                          long_prefill_token_threshold=4)
    specs = [spec(9, 2, 0), spec(8, 2, 1), spec(8, 2, 2)]
    run = drive(make_scheduler(cfg, 64, 4), specs, max_steps=50)
    assert run.requests[0].finish_reason == "error" and "chunked" in str(run.requests[0].stop_reason)
    assert run.batches[0] == [("r1", 8)], "whole prompts only; the long-prefill cap does not apply"
    assert run.batches[1] == [("r1", 1)], "r2 waits: its whole prompt does not fit the budget left"
    assert run.batches[2] == [("r2", 8)]
    assert outputs(run)[1:] == [reference(specs[1]), reference(specs[2])]


def test_prefix_cache_reuses_full_blocks_of_a_1000_token_prefix() -> None:
    prefix = [(i * 7 + i // 13) % (VOCAB - 1) + 1 for i in range(1000)]
    first = Spec([*prefix, 1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), seed=1)
    second = Spec([*prefix, 4, 5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), seed=2)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=256), 200, 16)
    run1 = drive(sched, [first])
    counters = sched.blocks.counters
    assert run1.requests[0].num_cached_tokens == 0 and counters.prefix_cache_hits == 0
    queries, hits = counters.prefix_cache_queries, counters.prefix_cache_hits
    run2 = drive(sched, [second], model=run1.model)
    r = run2.requests[0]
    assert r.num_cached_tokens == 992
    assert counters.prefix_cache_hits - hits == 62 and counters.prefix_cache_queries - queries == 62
    assert run2.batches[0] == [("r0", 1004 - 992)], "only the uncached tail is computed"
    assert outputs(run2)[0] == run_alone(second, 16) == reference(second)
    # And without the cache, the same tokens the long way.
    cold_sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=256), 200, 16, caching=False)
    cold = drive(cold_sched, [second])
    assert outputs(cold) == outputs(run2) and len(cold.batches) > len(run2.batches)


def test_concurrent_identical_prompts_share_after_first_computes() -> None:
    # Two identical prompts admitted together both compute (nothing cached yet); a third one later hits.
    s = [spec(33, 4, 9), spec(33, 4, 9), spec(33, 4, 9, arrival=20)]
    run = drive(make_scheduler(SchedulerConfig(max_num_batched_tokens=128), 64, 4), s)
    assert [r.num_cached_tokens for r in run.requests] == [0, 0, 32]
    assert outputs(run) == [reference(x) for x in s]


# -- random workloads ---------------------------------------------------------------------------------


@dataclass
class Workload:
    config: SchedulerConfig
    num_blocks: int
    block_size: int
    max_model_len: int
    caching: bool
    specs: list[Spec]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(max(1, 8 // bs), max(2, 96 // bs)))
    max_model_len = draw(st.integers(4, 80))
    config = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(1, 6)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_chunked_prefill=draw(st.sampled_from([True, True, True, False])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 0, 2, 5])),
    )
    base = draw(st.lists(st.integers(0, VOCAB - 1), max_size=40))
    specs = []
    for i in range(draw(st.integers(1, 9))):
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), max_size=10))
        prompt = (base[: draw(st.integers(0, len(base)))] + suffix or [1])[: max_model_len - 1]
        max_tokens = draw(st.integers(1, 20))
        params = SamplingParams(max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
                                ignore_eos=draw(st.booleans()),
                                stop_token_ids=tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=2))))
        abort_at = draw(st.none() | st.none() | st.integers(0, 30))
        specs.append(Spec(prompt, params, seed=draw(st.integers(0, 3)) * 100 + i,
                          priority=draw(st.integers(0, 2)), arrival=draw(st.integers(0, 12)),
                          abort_at=abort_at, abort_mid=draw(st.booleans())))
    return Workload(config, num_blocks, bs, max_model_len, draw(st.booleans()), specs)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_terminate_and_match_running_alone(w: Workload) -> None:
    sched = make_scheduler(w.config, w.num_blocks, w.block_size, w.max_model_len, w.caching)
    run = drive(sched, w.specs, max_steps=5000)
    assert not sched.has_unfinished() and sched.blocks.num_in_use == 0
    cap = w.config.max_num_batched_tokens
    for s, r in zip(w.specs, run.requests):
        alone = run_alone(s, w.block_size, w.max_model_len)
        assert alone == reference(s, w.max_model_len)
        got = (r.output_token_ids, r.finish_reason)
        if r.finish_reason == "error":
            too_big = sched.blocks.blocks_for(r.num_tokens) > w.num_blocks
            too_long = not w.config.enable_chunked_prefill and r.num_tokens > cap
            assert too_big or too_long, f"{r.request_id} failed although it fits"
        if r.finish_reason in ("error", "abort"):
            assert r.output_token_ids == alone[0][: r.num_output_tokens]
        else:
            assert got == alone, f"{r.request_id} differs from its output when run alone"
