"""One scheduling rule, no prefill/decode phases: every running request's computed tokens catch up to
its total tokens (prompt + output). A step spends a token budget on running requests first (decodes
and unfinished prefill chunks, in queue order), then admits waiting requests, chunking long prompts.

A step's life: `schedule()`, the model runner reads the batch and launches it, `begin_step()` counts
its tokens as computed and one more in-flight token for each request that samples, `commit()` appends
the sampled tokens and applies the stop rules. With async scheduling the next `schedule()` runs between
`begin_step` and `commit`, so it plans with the in-flight tokens (a decode of one reads its input on the
device). Speculative decoding rides on the same rule: a request's draft tokens count among its tokens, so
the step that catches up computes and verifies them, and `commit()` takes the 1..k+1 tokens it yields.
Torch-free."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tokenmill.worker.block_manager import BlockManager, extend_block_hashes
from tokenmill.worker.config import SchedulerConfig
from tokenmill.worker.metrics import EngineCounters
from tokenmill.worker.request import Request, RequestStatus


class ScheduledBatch(NamedTuple):
    """`requests[i]` computes `num_new_tokens[i]` tokens starting at its `num_computed_tokens`."""

    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]
    failed: list[Request]  # could never fit in the cache; finished with an error

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether request i reaches its total in this step and so samples a token."""
        r = self.requests[i]
        return r.num_computed_tokens + self.num_new_tokens[i] == r.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_model_len: int,
                 eos_token_ids: Iterable[int] = (), counters: EngineCounters | None = None) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.by_priority = config.policy == "priority"
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self.counters = counters if counters is not None else EngineCounters()  # preemptions

    # -- queue management -----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        extend_block_hashes(req, self.blocks.block_size)
        req.status = RequestStatus.WAITING
        self._insert(self.waiting, req)

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish `req` wherever it is and release its blocks at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.num_inflight = 0  # a token still being sampled is discarded
        req.draft_token_ids = []
        self.blocks.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _insert(self, queue: list[Request], req: Request) -> None:
        keys = [r.sort_key(self.by_priority) for r in queue]
        queue.insert(bisect.bisect(keys, req.sort_key(self.by_priority)), req)

    def _preempt(self, victim: Request) -> None:
        """Preemption by recompute: drop the victim's blocks, requeue it to start over."""
        self.running.remove(victim)
        self.blocks.free(victim)
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.counters.preemptions += 1
        self._insert(self.waiting, victim)

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [], [])
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or self._ends_in_flight(req):
                continue  # preempted earlier in this loop, or nothing left worth computing
            n = self._chunk(req, budget)
            if self._allocate_or_preempt(req, n, batch):
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
        if not batch.preempted:
            budget = self._admit_waiting(budget, batch)
        return batch

    def _ends_in_flight(self, req: Request) -> bool:
        """Its last uncomputed token is in flight and will finish it by length whatever its value:
        computing it would only produce a token to discard."""
        if not req.num_inflight:
            return False
        return req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len

    def _chunk(self, req: Request, budget: int) -> int:
        limit = self._max_chunk(budget)
        if req.draft_token_ids:
            self._fit_drafts(req, limit)
        n = min(req.num_tokens - req.num_computed_tokens, limit)
        assert n > 0, "a running request always has tokens to compute"
        return n

    def _fit_drafts(self, req: Request, limit: int) -> None:
        """Drafts are optional work: keep those that fit in `limit` tokens after the request's known tokens
        and in the blocks it holds or can take while one block per running request stays available for its
        next token. So a step that computes drafts also reaches the request's end and verifies them, and a
        guess does not make a neighbour's decode preempt."""
        known_left = req.num_tokens - len(req.draft_token_ids) - req.num_computed_tokens
        spare = max(0, self.blocks.num_available - len(self.running))
        room = (len(req.block_ids) + spare) * self.blocks.block_size - req.num_computed_tokens
        keep = max(0, min(len(req.draft_token_ids), limit - known_left, room - known_left))
        del req.draft_token_ids[keep:]

    def _max_chunk(self, budget: int) -> int:
        """Tokens one request may compute this step. The long-prefill cap cuts chunks, so it applies
        only when chunking is on (otherwise a prompt longer than the cap could never start)."""
        cap = self.config.long_prefill_token_threshold
        return min(budget, cap) if cap and self.config.enable_chunked_prefill else budget

    def _allocate_or_preempt(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Allocate for `req`, preempting the latest-arrived (lowest-priority) running requests
        until it fits; those are after `req` in queue order, so never already in this batch."""
        while not self.blocks.allocate(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            if victim is req:
                if len(self.running) == 1 and not batch.requests:
                    # Alone and still too big: it can never fit.
                    self._fail(req, batch, "request does not fit in the KV cache")
                else:
                    self._preempt(req)
                    batch.preempted.append(req)
                return False
            self._preempt(victim)
            batch.preempted.append(victim)
        return True

    def _admit_waiting(self, budget: int, batch: ScheduledBatch) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # A request preempted with a token in flight gets it (commit) before it can be admitted.
            assert not req.num_inflight, f"{req.request_id} is admitted with a token in flight"
            cached = self.blocks.find_cached_prefix(req)
            num_computed = len(cached) * self.blocks.block_size
            remaining = req.num_tokens - num_computed
            n = min(remaining, self._max_chunk(budget))
            if not self.config.enable_chunked_prefill and n < remaining:
                if remaining > self.config.max_num_batched_tokens:  # no step is ever big enough
                    self._fail(req, batch, "prompt exceeds max_num_batched_tokens and chunked prefill is off")
                    continue
                break
            if not self.blocks.allocate(req, num_computed + n, cached):
                if not self.running and not batch.requests and self.blocks.num_in_use == 0:
                    self._fail(req, batch, "request does not fit in the KV cache")
                    continue
                break
            self.waiting.pop(0)
            if req.num_preemptions == 0 and req.num_computed_tokens == 0:
                req.num_cached_tokens = num_computed
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self._insert(self.running, req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return budget

    def _fail(self, req: Request, batch: ScheduledBatch, reason: str) -> None:
        """Finish a request that can never be scheduled (from either queue) with an error."""
        self.finish(req, "error", reason)
        batch.failed.append(req)

    # -- after the launch -----------------------------------------------------------------------
    def begin_step(self, batch: ScheduledBatch) -> None:
        """The batch is launched (the runner has read it): count its tokens as computed and one token in
        flight for each request that samples. Blocks are registered for prefix reuse only at `commit`.

        Counting in-flight tokens as computed is safe: every later step that reads or reuses these
        blocks (a decode, a prefix hit, a block freed and handed to another request) runs after this
        one on the device's stream."""
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            assert not req.is_finished, f"{req.request_id} finished between schedule() and its launch"
            if batch.samples(i):  # before the counts below change
                req.num_inflight += 1
            req.num_computed_tokens += n

    def commit(self, batch: ScheduledBatch, sampled: Iterable[int | Sequence[int] | None]) -> list[Request]:
        """The step's tokens are in (None for a request that did not sample; for one that verified drafts,
        the accepted drafts and the target's next token): append them, register full computed blocks for
        prefix reuse and finish requests on EOS / stop ids / length (tokens after a stop are dropped).
        Returns the requests that got tokens. Steps commit in launch order, so a request's tokens land in
        order. A request finished meanwhile (abort, a stop found one step late) is skipped: `finish`
        dropped its in-flight tokens, so its token is discarded. A preempted one keeps its token."""
        got_token: list[Request] = []
        for req, out in zip(batch.requests, sampled):
            if req.is_finished:
                continue
            tokens = () if out is None else (out,) if isinstance(out, int) else out
            if req.draft_token_ids:
                self._settle_drafts(req, len(tokens) - 1)
            else:
                assert len(tokens) <= 1, f"{req.request_id}: several tokens from a step without drafts"
            stop = None
            if tokens:
                assert req.num_inflight > 0, f"{req.request_id}: a token that no launched step was sampling"
                req.num_inflight -= 1
                for token in tokens:
                    req.token_ids.append(token)
                    stop = self._stop(req, token)
                    if stop is not None:
                        break
                extend_block_hashes(req, self.blocks.block_size)
            self.blocks.cache_computed_blocks(req)
            if tokens:
                got_token.append(req)
                if stop is not None:
                    self.finish(req, *stop)
        return got_token

    def _settle_drafts(self, req: Request, accepted: int) -> None:
        """The step verified `req`'s drafts and accepted the first `accepted`: uncount the KV computed for
        the rejected ones (their slots are overwritten by later writes), give back the blocks only they
        needed (the block table keeps what the accepted tokens and the next one need) and drop the drafts."""
        assert 0 <= accepted <= len(req.draft_token_ids), f"{req.request_id}: {accepted} drafts accepted"
        self.counters.draft_tokens += len(req.draft_token_ids)
        self.counters.accepted_draft_tokens += accepted
        req.num_computed_tokens -= len(req.draft_token_ids) - accepted
        req.draft_token_ids = []
        self.blocks.release_tail(req, req.num_computed_tokens + 1)

    def _stop(self, req: Request, token: int) -> tuple[str, str | int | None] | None:
        """(finish reason, stop reason) if `token`, just appended, ends the request."""
        p = req.params
        n_out = req.num_known_tokens - req.num_prompt_tokens
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
        if n_out >= p.max_tokens or req.num_known_tokens >= self.max_model_len:
            return "length", None
        return None
