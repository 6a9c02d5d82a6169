"""Draft tokens through the scheduler, on the fake model of test_scheduler.py (no torch): before every
schedule() an oracle drafts tokens for the decoding requests, some right and some wrong; the fake model
writes them into the paged KV store like any scheduled token, reads every sequence back and verifies the
drafts against its own next tokens. Outputs, finish reasons and the blocks must be exactly those of
decoding without drafts, whatever the budget, the cache size, chunking, preemption, prefix hits or aborts."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import (
    BIG,
    VOCAB,
    FakeModel,
    Spec,
    Workload,
    check_state,
    drive,
    make_scheduler,
    next_token,
    reference,
    spec,
    workloads,
)

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.block_manager import BlockManager
from tokenmill.worker.config import SchedulerConfig
from tokenmill.worker.request import Request
from tokenmill.worker.scheduler import ScheduledBatch, Scheduler
from tokenmill.worker.spec.proposer import draft_budget


class DraftingScheduler(Scheduler):
    """A Scheduler whose schedule() is preceded by an oracle proposer (as the engine drafts before each
    schedule): each draft is the fake model's true next token with probability `hit_rate`, else random."""

    def __init__(self, inner: Scheduler, k: int, hit_rate: float, seed: int) -> None:
        super().__init__(inner.config, inner.blocks, inner.max_model_len, inner.eos_token_ids)
        self.k, self.hit_rate, self.rng = k, hit_rate, random.Random(seed)
        self.proposed = self.accepted = 0

    def schedule(self) -> ScheduledBatch:
        for req in self.running:
            n = draft_budget(req, self.k, self.max_model_len)
            seq = list(req.token_ids)
            for _ in range(n):
                t = next_token(req.seed, seq) if self.rng.random() < self.hit_rate else self.rng.randrange(VOCAB)
                seq.append(t)
            req.draft_token_ids = seq[req.num_known_tokens :]
            self.proposed += n
        return super().schedule()

    def commit(self, batch: ScheduledBatch, sampled: Sequence[int | Sequence[int] | None]) -> list[Request]:  # type: ignore[override]
        got = super().commit(batch, sampled)
        for r in self.running:  # block tables grow only by what was accepted (and the next token)
            assert len(r.block_ids) <= self.blocks.blocks_for(r.num_computed_tokens + 1), r.request_id
        return got


class DraftModel(FakeModel):
    """FakeModel over known + draft tokens; a request that verifies drafts gets the accepted ones and the
    model's next token after them."""

    def __init__(self, blocks: BlockManager, sched: DraftingScheduler) -> None:
        super().__init__(blocks)
        self.sched = sched
        self.yields: list[int] = []  # tokens yielded by each sampling request, in order

    def execute(self, batch: ScheduledBatch) -> list[int | Sequence[int] | None]:  # type: ignore[override]
        bs = self.blocks.block_size
        out: list[int | Sequence[int] | None] = []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
            seq = req.token_ids + req.draft_token_ids
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            assert end <= len(seq) == req.num_tokens and end <= len(req.block_ids) * bs
            for pos in range(start, end):
                b = req.block_ids[pos // bs]
                assert self.blocks._blocks[b].ref_count == 1 and self.blocks._blocks[b].hash is None, \
                    f"{req.request_id} writes block {b}, which is shared or in the prefix cache"
                self.kv[b][pos % bs] = seq[pos]
            seen = [self.kv[req.block_ids[p // bs]][p % bs] for p in range(end)]
            assert seen == seq[:end], f"{req.request_id} reads KV that is not its own sequence"
            if not batch.samples(i):
                out.append(None)
            elif not req.draft_token_ids:
                out.append(next_token(req.seed, seq))
                self.yields.append(1)
            else:
                out.append(self._verify(req))
        return out

    def _verify(self, req: Request) -> list[int]:
        known, drafts = req.token_ids, req.draft_token_ids
        tokens: list[int] = []
        for j in range(len(drafts) + 1):
            tokens.append(next_token(req.seed, known + drafts[:j]))
            if j == len(drafts) or drafts[j] != tokens[-1]:
                break
        self.sched.accepted += len(tokens) - 1
        self.yields.append(len(tokens))
        return tokens


def drafting(config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int = 10_000,
             caching: bool = True, k: int = 4, hit_rate: float = 0.7, seed: int = 0,
             ) -> tuple[DraftingScheduler, DraftModel]:
    sched = DraftingScheduler(make_scheduler(config, num_blocks, block_size, max_model_len, caching), k, hit_rate, seed)
    return sched, DraftModel(sched.blocks, sched)


def test_drafts_are_verified_in_one_step_and_give_the_reference_tokens() -> None:
    sched, model = drafting(BIG, 64, 4, k=3, hit_rate=1.0)
    run = drive(sched, [spec(5, 13, 1)], model=model)
    # Prefill samples one token; then every step verifies 3 correct drafts and yields 4 tokens.
    assert [n for b in run.batches for _, n in b] == [5, 4, 4, 4]
    assert run.requests[0].output_token_ids == reference(spec(5, 13, 1))[0]
    assert sched.accepted == sched.proposed == 9


def test_rejected_drafts_roll_back_and_blocks_only_hold_what_was_accepted() -> None:
    sched, model = drafting(BIG, 64, 4, k=4, hit_rate=0.0)
    run = drive(sched, [spec(6, 8, 2)], model=model)
    assert sched.proposed > 0 and sched.accepted <= sched.proposed
    assert run.requests[0].output_token_ids == reference(spec(6, 8, 2))[0]
    produced = 1  # by the prefill step
    for (_, n), got in zip((b[0] for b in run.batches[1:]), model.yields[1:], strict=True):
        assert n == 1 + min(4, 8 - produced - 1), "each step scores 1 + 4 drafts while max_tokens leaves room"
        produced += got


def test_drafts_are_cut_to_the_budget_and_never_preempt() -> None:
    # Budget 6: two decoding requests cannot both take 1 + 4; the second one's drafts are cut to fit.
    sched, model = drafting(SchedulerConfig(max_num_batched_tokens=6), 64, 4, k=4, hit_rate=1.0)
    specs = [spec(3, 12, 0), spec(3, 12, 1)]
    run = drive(sched, specs, model=model)
    assert all(sum(n for _, n in b) <= 6 for b in run.batches)
    assert any(len(b) == 2 and b[1][1] == 1 for b in run.batches), "the second request decoded without drafts"
    assert [r.output_token_ids for r in run.requests] == [reference(s)[0] for s in specs]
    # A cache with no block to spare: drafts shrink instead of preempting the neighbour.
    sched, model = drafting(SchedulerConfig(max_num_batched_tokens=64), 8, 2, k=4, hit_rate=1.0)
    specs = [spec(3, 5, 0), spec(3, 5, 1)]
    run = drive(sched, specs, model=model)
    assert sched.counters.preemptions == 0 and not any(run.preempted)
    assert [r.output_token_ids for r in run.requests] == [reference(s)[0] for s in specs]


def test_stop_inside_accepted_drafts_drops_the_tokens_after_it() -> None:
    prompt = [3, 1, 4, 1, 5]
    free = reference(Spec(prompt, SamplingParams(max_tokens=12, ignore_eos=True), seed=7))[0]
    stop_id = free[3]
    s = Spec(prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)), seed=7)
    sched, model = drafting(BIG, 64, 4, k=6, hit_rate=1.0)
    run = drive(sched, [s], model=model)
    r = run.requests[0]
    assert (r.output_token_ids, r.finish_reason) == reference(s)
    assert r.output_token_ids[-1] == stop_id and r.stop_reason == stop_id


def test_prefix_cache_after_drafts_holds_only_verified_tokens() -> None:
    """A second request hits blocks the first one filled while verifying drafts (rejected ones included):
    the fake model's read-back finds any block whose KV is not its tokens."""
    first = spec(9, 23, 3)
    sched, model = drafting(SchedulerConfig(max_num_batched_tokens=64), 64, 4, k=3, hit_rate=0.5)
    run = drive(sched, [first], model=model)
    out = run.requests[0].output_token_ids
    second = Spec(first.prompt + out, SamplingParams(max_tokens=6, ignore_eos=True), seed=4)
    run2 = drive(sched, [second], model=model)
    assert run2.requests[0].num_cached_tokens == (len(second.prompt) - 1) // 4 * 4
    assert run2.requests[0].output_token_ids == reference(second)[0]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 6), st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.integers(0, 99))
def test_random_workloads_with_drafts_match_the_reference(w: Workload, k: int, hit_rate: float, seed: int) -> None:
    sched, model = drafting(w.config, w.num_blocks, w.block_size, w.max_model_len, w.caching, k, hit_rate, seed)
    run = drive(sched, w.specs, max_steps=5000, model=model)
    check_state(sched)
    assert not sched.has_unfinished() and sched.blocks.num_in_use == 0
    for s, r in zip(w.specs, run.requests):
        expect = reference(s, w.max_model_len)
        if r.finish_reason in ("error", "abort"):
            assert r.output_token_ids == expect[0][: r.num_output_tokens]
        else:
            assert (r.output_token_ids, r.finish_reason) == expect, r.request_id
        assert not r.draft_token_ids and not r.num_inflight
