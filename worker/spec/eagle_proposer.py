"""EAGLE-1 drafts in the engine: the head of worker/spec/eagle.py drafts k tokens per request, greedily.

The head at position t reads (embed(x_{t+1}), f_t), f_t the target's final-normed hidden state at t, and
predicts f_{t+1}; the target's LM head turns that into the draft of x_{t+2}. The target's features come
from its steps (`observe`: the model runner keeps them only for requests that speculate). A request with
known tokens x_0..x_m (x_m not yet computed by the target, every earlier one computed) is drafted by
  1. catch-up: one head row per position t in [head_pos, m) with the target's real f_t, writing the head's KV
     at t; the last row (t = m-1) predicts f^_m and so d_1 = argmax lm_head(f^_m);
  2. k-1 single-row steps: position m+j-1 reads (embed(d_j), f^_{m+j-1}) -> f^_{m+j} -> d_{j+1}.
All requests run batched (varlen rows, one forward per step), and the drafts reach the host in one copy.

Draft KV cache: one layer, paged like the target's and indexed by the target's own block ids, plus a few
scratch blocks per request for draft positions past the blocks it holds. Speculative rows (positions >= m,
written with predicted features) are overwritten by the next catch-up with the real ones, so the head's KV
below head_pos is always from real features. A prefix-cache hit (or a recompute after preemption) skips
positions whose features the target never recomputes: the head then reads the head KV those blocks already
hold (written by whichever request computed them; stale if that one did not draft) -- weaker drafts at
worst, never other output.

Greedy drafting (argmax, no sampling): the drafts are a deterministic function of the request's tokens and
the target's features, so q is a point mass and spec/verifier.py's rule (accept iff the draft equals the
target's seeded token of its row) is exactly rejection sampling for every sampling setting; sampling drafts
from the head's distribution would need q(d) at verify time and the residual max(0, p - q) resample, and
it would make the drafts depend on a random stream of their own."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from tokenmill.protocol.sampling import MAX_SPECULATIVE_TOKENS
from tokenmill.worker.model_runner import ModelRunner, attention_metadata
from tokenmill.worker.request import Request
from tokenmill.worker.spec.eagle import EagleHead, load_eagle_head
from tokenmill.worker.spec.proposer import DraftProposer

# Target feature rows one request keeps for the head at most: past that (a long pause of speculation), they
# are dropped and the head goes on from the next ones, reading what its KV holds for the positions between.
MAX_PENDING_FEATURES = 4096


@dataclass(eq=False)
class _HeadState:
    """One request's draft state: the target features not yet read by the head, for positions
    feat_start .. feat_start + rows - 1, and head_pos: the head's KV holds real rows for positions < head_pos."""

    feat_start: int = 0
    head_pos: int = 0
    chunks: list[Tensor] = field(default_factory=list)  # each [n, H] on the device, in position order

    @property
    def feat_end(self) -> int:
        return self.feat_start + sum(c.shape[0] for c in self.chunks)

    def features(self, start: int, end: int) -> Tensor:
        """Target features [end - start, H] of positions start .. end-1 (within the kept ones)."""
        whole = torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = [whole]
        return whole[start - self.feat_start : end - self.feat_start]

    def keep_before(self, pos: int) -> None:
        """Drop the features of positions >= pos (the target recomputes them: rejected drafts, preemption)."""
        if pos <= self.feat_start:
            self.chunks = []
        elif pos < self.feat_end:
            self.chunks = [self.features(self.feat_start, pos)]


class _Plan:
    """Host-side inputs of one draft round over S requests sorted by draft count, descending (so the
    requests still drafting at step j are a prefix)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.ids: list[int] = []  # catch-up rows: x_{t+1}
        self.positions: list[int] = []  # catch-up rows: t
        self.slots: list[int] = []
        self.q_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.starts: list[int] = []  # m per request
        self.ks: list[int] = []
        self.features: list[Tensor] = []

    def add(self, req: Request, state: _HeadState, k: int, scratch: list[int]) -> None:
        m, h, bs = req.num_computed_tokens, state.head_pos, self.block_size
        need = (m + k - 2) // bs + 1  # blocks covering every position the round writes (m-1 .. m+k-2)
        table = list(req.block_ids[:need]) + scratch[: max(0, need - len(req.block_ids))]
        assert len(table) >= need, "scratch blocks cover k drafts"
        pos = np.arange(h, m)
        self.ids += req.token_ids[h + 1 : m + 1]
        self.positions += pos.tolist()
        self.slots += (np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist()
        self.q_lens.append(m - h)
        self.tables.append(table)
        self.starts.append(m)
        self.ks.append(k)
        self.features.append(state.features(h, m))

    def step_slots(self, j: int, n: int) -> tuple[list[int], list[int]]:
        """(positions, slots) of draft step j (1..k-1) for the first n requests: position m + j - 1."""
        bs = self.block_size
        pos = [m + j - 1 for m in self.starts[:n]]
        return pos, [t[p // bs] * bs + p % bs for t, p in zip(self.tables, pos)]


class EagleProposer(DraftProposer):
    name = "eagle"
    wants_features = True

    def __init__(self, runner: ModelRunner, head_dir: Path, max_num_seqs: int) -> None:
        self.runner = runner
        self.head: EagleHead = load_eagle_head(head_dir, runner.arch, runner.backend, dtype=runner.dtype,
                                               device=runner.device)
        self.head.eval()
        a, bs = runner.arch, runner.block_size
        self.scratch_per_request = -(-MAX_SPECULATIVE_TOKENS // bs) + 1
        self.num_scratch = max_num_seqs * self.scratch_per_request
        shape = (runner.num_blocks + self.num_scratch, bs, a.num_kv_heads, a.head_dim)
        # [num_blocks + scratch, block_size, Hkv, D]: block b < num_blocks is the head's rows of target block b
        self.kv_cache = (torch.zeros(shape, dtype=runner.dtype, device=runner.device),
                         torch.zeros(shape, dtype=runner.dtype, device=runner.device))
        self._states: weakref.WeakKeyDictionary[Request, _HeadState] = weakref.WeakKeyDictionary()

    def observe(self, req: Request, start: int, features: Tensor) -> None:
        """The target computed `req`'s positions start .. start + n - 1; features [n, H] are its feature rows."""
        state = self._states.get(req)
        if state is None:
            state = self._states[req] = _HeadState(feat_start=start, head_pos=start)
        state.keep_before(start)  # now feat_end <= start
        if state.chunks and state.feat_end < start:
            state.chunks = []  # a gap: positions the target did not compute for this request
        if state.chunks:  # contiguous: the head catches up from where it is (not before its features)
            state.head_pos = max(min(state.head_pos, start), state.feat_start)
        else:  # positions before `start` have no features (a prefix hit, a recompute): their head KV as is
            state.feat_start = state.head_pos = start
        state.chunks.append(features)
        if state.feat_end - state.head_pos > MAX_PENDING_FEATURES:  # not drafted for long (the switch paused it)
            state.chunks, state.feat_start = [], state.feat_end
            state.head_pos = state.feat_start

    def _ready(self, req: Request) -> bool:
        state = self._states.get(req)
        m = req.num_computed_tokens
        return (state is not None and bool(state.chunks) and state.feat_start <= state.head_pos < m
                and state.feat_end >= m)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        ready = sorted((i for i, r in enumerate(requests) if self._ready(r)), key=lambda i: -num_drafts[i])
        if not ready:
            return out
        assert len(ready) * self.scratch_per_request <= self.num_scratch, "more drafting requests than max_num_seqs"
        plan = _Plan(self.runner.block_size)
        base = self.runner.num_blocks
        for s, i in enumerate(ready):
            req = requests[i]
            assert req.num_computed_tokens == req.num_known_tokens - 1, "drafts follow a decoding request"
            scratch = list(range(base + s * self.scratch_per_request, base + (s + 1) * self.scratch_per_request))
            plan.add(req, self._states[req], num_drafts[i], scratch)
        drafts = self._draft(plan)
        for s, i in enumerate(ready):
            out[i] = drafts[s]
            state, m = self._states[requests[i]], plan.starts[s]
            state.chunks, state.feat_start, state.head_pos = [], m, m
        return out

    def draft_seconds(self, batch: int, k: int, context: int) -> float:
        """Seconds of one draft round of k tokens for `batch` requests after `context` tokens (the switch's
        cost model; run at start-up: the head's KV it writes is overwritten before anything reads it)."""
        from tokenmill.worker.spec.switch import timed

        bs, h = self.runner.block_size, self.runner.arch.hidden_size
        blocks = list(range(min(-(-(context + k) // bs), self.runner.num_blocks)))
        m = max(1, min(context, len(blocks) * bs - k))
        plan = _Plan(bs)
        plan.ids, plan.positions, plan.slots = [0] * batch, [m - 1] * batch, [-1] * batch
        plan.q_lens, plan.tables, plan.starts, plan.ks = [1] * batch, [blocks] * batch, [m] * batch, [k] * batch
        plan.features = [torch.zeros(batch, h, dtype=self.runner.dtype, device=self.runner.device)]
        with torch.inference_mode():
            return timed(lambda: self._draft(plan), self.runner.device, 5)

    def _draft(self, plan: _Plan) -> list[list[int]]:
        """Run the round: catch-up forward, then k-1 single-row steps; drafts per request (plan order)."""
        device, model = self.runner.device, self.runner.model
        seq_lens = plan.starts
        meta = attention_metadata(plan.q_lens, seq_lens, plan.tables, plan.slots, device)
        ids = torch.tensor(plan.ids, dtype=torch.int64, device=device)
        positions = torch.tensor(plan.positions, dtype=torch.int64, device=device)
        feats = torch.cat(plan.features) if len(plan.features) > 1 else plan.features[0]
        hidden = self.head(model.model.embed_tokens(ids), feats.to(self.runner.dtype), positions, self.kv_cache, meta)
        last = torch.tensor(np.cumsum(plan.q_lens) - 1, dtype=torch.int64, device=device)
        hidden = hidden[last]  # [S, H] f^_m
        tokens = model.compute_logits(hidden).argmax(dim=-1)  # [S] d_1
        steps = [tokens]
        for j in range(1, max(plan.ks)):
            n = sum(k > j for k in plan.ks)  # requests still drafting: a prefix (sorted by k)
            pos, slots = plan.step_slots(j, n)
            meta = attention_metadata([1] * n, [p + 1 for p in pos], plan.tables[:n], slots, device)
            positions = torch.tensor(pos, dtype=torch.int64, device=device)
            hidden = self.head(model.model.embed_tokens(tokens[:n]), hidden[:n], positions, self.kv_cache, meta)
            tokens = model.compute_logits(hidden).argmax(dim=-1)
            steps.append(tokens)
        flat = torch.cat(steps).tolist()  # the round's one device-to-host copy
        drafts: list[list[int]] = [[] for _ in plan.ks]
        offset = 0
        for step in steps:
            for s in range(step.shape[0]):
                drafts[s].append(flat[offset + s])
            offset += step.shape[0]
        return drafts
