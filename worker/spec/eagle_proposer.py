"""EAGLE-1 drafts in the engine: the head of worker/spec/eagle.py drafts k tokens per request, greedily.

The head at position t reads (embed(x_{t+1}), f_t), f_t the target's final-normed hidden state at t, and
predicts f_{t+1}; the target's LM head turns that into the draft of x_{t+2}. The target's features come
from its steps (`observe`: the model runner keeps them only for requests that speculate). A request with
known tokens x_0..x_m (x_m not yet computed by the target, every earlier one computed) is drafted by
  1. catch-up: one head row per position t in [head_pos, m) with the target's real f_t, writing the head's KV
     at t; the last row (t = m-1) predicts f^_m and so d_1 = argmax lm_head(f^_m);
  2. k-1 single-row steps: position m+j-1 reads (embed(d_j), f^_{m+j-1}) -> f^_{m+j} -> d_{j+1}.
All requests run batched (varlen rows, one forward per step), and the drafts reach the host in one copy. In
steady decoding (every catch-up at most k + 1 rows) a chain round replays one CUDA graph (spec/draft_graphs.py).
With a tree width W > 1 the steps after the catch-up expand a tree instead (worker/spec/eagle_tree.py: W rows
per request and level, the head's attention under a tree mask); after the target's verify step the features
of an accepted path off the first branch are moved onto the positions its tokens now own (`accept_paths`),
as the target's KV is.

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
it would make the drafts depend on a random stream of their own.

An EAGLE-3 head (fusion layers, worker/spec/eagle.py): the runner keeps the residual streams of its three layers
instead of f_t ([n, 3H] per step and request), `observe` fuses them into g_t [n, H] at once, and everything
above reads g_t where it reads f_t (the head's own outputs still stand in past the first draft). Those steps run
eagerly: the CUDA graphs do not keep the layer states (refused at start-up), nor does tensor parallelism."""

from __future__ import annotations

import itertools
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from tokenmill.kernels.launch import next_pow2
from tokenmill.kernels.paged_attention import fixed_config
from tokenmill.protocol.sampling import MAX_SPECULATIVE_TOKENS
from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.attention.triton_backend import TritonBackend
from tokenmill.worker.cuda_graphs import graph_batch_sizes
from tokenmill.worker.model_runner import ModelRunner, attention_metadata
from tokenmill.worker.request import Request
from tokenmill.worker.spec.draft_graphs import ChainDraftGraphs
from tokenmill.worker.spec.eagle import CONFIG_FILE, EagleHead, EagleHeadError, load_eagle_head
from tokenmill.worker.spec.eagle_tree import head_tree_rows, row_bit, select_tree, tree_levels
from tokenmill.worker.spec.ngram import SuffixIndexes
from tokenmill.worker.spec.proposer import DraftProposer
from tokenmill.worker.spec.tree import MAX_TREE_NODES, kv_moves

# The head's attention launches (eager: its shapes change every round) take fixed choices, so that they meet no
# Triton variant that start-up (`warm_up`) did not build: kernels/paged_attention.fixed_config's tile and one key
# split. Unsplit keys cost a one-layer head little (a few programs per request walking its context once); the
# heuristics' choice would compile a new variant per (tile, split count) a batch size and context first reach,
# ~0.6-1.4 s each on the H200, inside a step (benchmarks/results/h200/NOTES.md, fourteenth session).
HEAD_KEY_SPLITS = 1
# The longest catch-up `warm_up` runs: more rows than one tile of any config holds.
WARM_UP_LONG_CATCH_UP = 256

# Target feature rows one request keeps for the head at most: past that (a long pause of speculation), they
# are dropped and the head goes on from the next ones, reading what its KV holds for the positions between.
MAX_PENDING_FEATURES = 4096
# Chunks of target features one request keeps before they are copied into one tensor of its own: a chunk is a
# view of its step's whole kept tensor (every speculating request's rows), which it keeps alive.
MAX_SHARED_CHUNKS = 8


class _Rows(NamedTuple):
    """Rows first .. first + n - 1 of a step's kept features `base` [T, F]: one request's, in position order."""

    base: Tensor
    first: int
    n: int

    def tensor(self) -> Tensor:
        return self.base[self.first : self.first + self.n]


@dataclass(eq=False)
class _HeadState:
    """One request's draft state: the target features not yet read by the head, for positions
    feat_start .. feat_start + rows - 1, and head_pos: the head's KV holds real rows for positions < head_pos.
    Invariant: rows == the chunks' rows in all (kept as a count: `observe` runs per request and step)."""

    feat_start: int = 0
    head_pos: int = 0
    chunks: list[_Rows] = field(default_factory=list)  # on the device, in position order
    rows: int = 0

    @property
    def feat_end(self) -> int:
        return self.feat_start + self.rows

    def restart(self, pos: int) -> None:
        """No features kept; the next ones start at `pos`, and the head goes on from there."""
        self.chunks, self.rows, self.feat_start, self.head_pos = [], 0, pos, pos

    def append(self, features: _Rows) -> None:
        self.chunks.append(features)
        self.rows += features.n
        if len(self.chunks) > MAX_SHARED_CHUNKS:
            self._join()

    def _join(self) -> _Rows:
        """The chunks as one tensor of this request's own."""
        if len(self.chunks) > 1:
            self.chunks = [_Rows(torch.cat([c.tensor() for c in self.chunks]), 0, self.rows)]
        return self.chunks[0]

    def features(self, start: int, end: int) -> Tensor:
        """Target features [end - start, F] of positions start .. end-1 (within the kept ones)."""
        return self._join().tensor()[start - self.feat_start : end - self.feat_start]

    def move(self, moves: Sequence[tuple[int, int]]) -> None:
        """Feature rows (from position, to position), done at once (every source past every destination); they
        stay within this request's rows of the shared tensor."""
        whole = self.features(self.feat_start, self.feat_end)
        src, dst = (torch.tensor([m[i] - self.feat_start for m in moves], device=whole.device) for i in (0, 1))
        whole[dst] = whole[src]

    def keep_before(self, pos: int) -> None:
        """Drop the features of positions >= pos (the target recomputes them: rejected drafts, preemption)."""
        keep = min(max(0, pos - self.feat_start), self.rows)
        if keep == self.rows:
            return
        chunks, left = [], keep
        for c in self.chunks:
            if left <= 0:
                break
            chunks.append(c if c.n <= left else _Rows(c.base, c.first, left))
            left -= c.n
        self.chunks, self.rows = chunks, keep


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

    def add(self, req: Request, state: _HeadState, k: int, scratch: list[int], span: int) -> None:
        """`span`: the head rows the round writes at cache indices >= m (a chain: k - 1)."""
        m, h, bs = req.num_computed_tokens, state.head_pos, self.block_size
        need = (m + span - 1) // bs + 1  # blocks covering every index the round writes (m-1 .. m+span-1)
        table = list(req.block_ids[:need]) + scratch[: max(0, need - len(req.block_ids))]
        assert len(table) >= need, "scratch blocks cover k drafts"
        self.ids += req.token_ids[h + 1 : m + 1]
        self.positions += range(h, m)
        self.slots += [table[p // bs] * bs + p % bs for p in range(h, m)]
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

    def tree_step(self, level: int, n: int, width: int) -> tuple[list[int], list[int], list[int]]:
        """(positions, slots, seq_lens) of the head rows of tree level `level` (1..) for the first n requests:
        `width` rows each, at rotary position m + level - 1 and cache indices m + (level - 1) * width + w."""
        bs = self.block_size
        pos, slots = [], []
        for m, table in zip(self.starts[:n], self.tables):
            pos += [m + level - 1] * width
            first = m + (level - 1) * width
            slots += [table[c // bs] * bs + c % bs for c in range(first, first + width)]
        return pos, slots, [m + level * width for m in self.starts[:n]]


class EagleProposer(DraftProposer):
    name = "eagle"
    wants_features = True

    def __init__(self, runner: ModelRunner, head_dir: Path, max_num_seqs: int, tree_width: int = 1,
                 lookup: tuple[int, int] | None = None) -> None:
        assert 1 <= tree_width <= MAX_TREE_NODES, f"tree width {tree_width}"
        assert lookup is None or (tree_width == 1 and 1 <= lookup[0] <= lookup[1]), f"lookup {lookup}"
        self.runner, self.tree_width = runner, tree_width
        # (min n, max n): prompt lookup first (worker/spec/ngram.py), the head for the requests it finds nothing for
        self.lookup = None if lookup is None else SuffixIndexes(*lookup)
        self.head: EagleHead = load_eagle_head(head_dir, runner.arch, runner.backend, dtype=runner.dtype,
                                               device=runner.device)
        self.heldout = heldout_tau(head_dir)
        self.head.eval()
        if self.head.fusion_layers is not None:
            _check_fusion_support(runner)
            runner.feature_layers = self.head.fusion_layers
        a, bs = runner.arch, runner.block_size
        self.scratch_per_request = -(-max(MAX_SPECULATIVE_TOKENS, self._span(MAX_SPECULATIVE_TOKENS)) // bs) + 1
        self.num_scratch = max_num_seqs * self.scratch_per_request
        shape = (runner.num_blocks + self.num_scratch, bs, a.num_kv_heads, a.head_dim)
        # [num_blocks + scratch, block_size, Hkv, D]: block b < num_blocks is the head's rows of target block b
        self.kv_cache = (torch.zeros(shape, dtype=runner.dtype, device=runner.device),
                         torch.zeros(shape, dtype=runner.dtype, device=runner.device))
        self._states: weakref.WeakKeyDictionary[Request, _HeadState] = weakref.WeakKeyDictionary()
        self.max_num_seqs = max_num_seqs
        # Chain rounds of up to `chain_graphs.k` drafts, in CUDA graphs (`capture_graphs`)
        self.chain_graphs: ChainDraftGraphs | None = None

    @torch.inference_mode()
    def observe(self, requests: Sequence[Request], starts: Sequence[int], features: Tensor,
                lens: Sequence[int]) -> None:
        """The target computed requests[i]'s positions starts[i] .. starts[i] + lens[i] - 1; features [sum lens, H]
        are their feature rows, request after request (a fusion head: layer states [sum lens, 3H], fused here)."""
        fused, first = self.head.fuse(features), 0
        for req, start, n in zip(requests, starts, lens, strict=True):
            self._observe(req, start, _Rows(fused, first, n))
            first += n

    def _observe(self, req: Request, start: int, features: _Rows) -> None:
        state = self._states.get(req)
        if state is None:
            state = self._states[req] = _HeadState(feat_start=start, head_pos=start)
        state.keep_before(start)  # now feat_end <= start
        if state.rows and state.feat_end < start:
            state.chunks, state.rows = [], 0  # a gap: positions the target did not compute for this request
        if state.rows:  # contiguous: the head catches up from where it is (not before its features)
            state.head_pos = max(min(state.head_pos, start), state.feat_start)
        else:  # positions before `start` have no features (a prefix hit, a recompute): their head KV as is
            state.restart(start)
        state.append(features)
        if state.feat_end - state.head_pos > MAX_PENDING_FEATURES:  # not drafted for long (the switch paused it)
            state.restart(state.feat_end)

    @torch.inference_mode()
    def accept_paths(self, requests: Sequence[Request], paths: dict[int, list[int]]) -> None:
        """After a verify step of tree drafts, before its tokens are committed: the target's feature rows of each
        accepted path move onto the positions its tokens now own (as the target's KV: spec/tree.py's kv_moves;
        node j's row holds position num_known_tokens + j)."""
        for i, path in paths.items():
            state, base = self._states.get(requests[i]), requests[i].num_known_tokens
            moves = [(base + a, base + b) for a, b in kv_moves(path)]
            if state is not None and moves and state.feat_start <= base and base + max(path) < state.feat_end:
                state.move(moves)

    def expected_tau(self, k: int) -> float | None:
        """The head's held-out tau at its training's eval depth d (its config), the accepted drafts scaled by
        min(k, d) / d: an underestimate below d (early drafts are accepted most), none added past it."""
        if self.heldout is None:
            return None
        tau, depth = self.heldout
        return 1.0 + (tau - 1.0) * min(k, depth) / depth

    def _span(self, k: int) -> int:
        """Head rows a round of k drafts writes at cache indices >= m."""
        return k - 1 if self.tree_width == 1 else head_tree_rows(k, self.tree_width)

    def _ready(self, req: Request) -> bool:
        state = self._states.get(req)
        m = req.num_computed_tokens
        return (state is not None and state.rows > 0 and state.feat_start <= state.head_pos < m
                and state.feat_end >= m)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        if self.lookup is not None:  # a request prompt lookup drafts for skips the head this round: its features
            # wait in its state, and its next head round catches up over them
            out = [self.lookup.lookup(r, k) for r, k in zip(requests, num_drafts)]
        ready = sorted((i for i, r in enumerate(requests) if not out[i] and self._ready(r)),
                       key=lambda i: -num_drafts[i])
        if not ready:
            return out
        assert len(ready) * self.scratch_per_request <= self.num_scratch, "more drafting requests than max_num_seqs"
        plan = _Plan(self.runner.block_size)
        base = self.runner.num_blocks
        graphs = self.chain_graphs
        # a round the graphs can run: every request's table covers their k - 1 steps (extra rows are speculative,
        # overwritten by the next catch-up; the extra drafts are dropped)
        steps = graphs.k if graphs is not None and max(num_drafts[i] for i in ready) <= graphs.k else 0
        for s, i in enumerate(ready):
            req = requests[i]
            assert req.num_computed_tokens == req.num_known_tokens - 1, "drafts follow a decoding request"
            scratch = list(range(base + s * self.scratch_per_request, base + (s + 1) * self.scratch_per_request))
            plan.add(req, self._states[req], num_drafts[i], scratch, self._span(max(num_drafts[i], steps)))
        drafts = self._round(plan)
        for s, i in enumerate(ready):
            out[i] = drafts[s]
            state, m = self._states[requests[i]], plan.starts[s]
            state.restart(m)
        return out

    def draft_seconds(self, batch: int, k: int, context: int) -> float:
        """Seconds of one draft round of k tokens for `batch` requests after `context` tokens (the switch's
        cost model; run at start-up: the head's KV it writes is overwritten before anything reads it)."""
        from tokenmill.worker.spec.switch import timed

        bs, h = self.runner.block_size, self.runner.arch.hidden_size
        span = self._span(k)
        blocks = list(range(min(-(-(context + span + 1) // bs), self.runner.num_blocks)))
        m = max(1, min(context, len(blocks) * bs - span - 1))
        plan = _Plan(bs)
        plan.ids, plan.positions, plan.slots = [0] * batch, [m - 1] * batch, [-1] * batch
        plan.q_lens, plan.tables, plan.starts, plan.ks = [1] * batch, [blocks] * batch, [m] * batch, [k] * batch
        plan.features = [torch.zeros(batch, h, dtype=self.runner.dtype, device=self.runner.device)]
        with torch.inference_mode():
            return timed(lambda: self._round(plan), self.runner.device, 5)

    def warm_up(self, k: int) -> None:
        """Build the Triton variants the head's rounds launch (fixed choices, `_head`), so that none compiles inside
        a step: rounds of k drafts for 1 and 2 requests after catch-ups of every row count at which the launch
        changes kind (one row: rotary fused in; a decode tile's rows and one more; a mixed tile's and one more;
        many). Their head KV rows are overwritten before anything reads them (as draft_seconds')."""
        a, bs, h = self.runner.arch, self.runner.block_size, self.runner.arch.hidden_size
        group_pad = next_pow2(a.num_heads // a.num_kv_heads)
        size = self.runner.dtype.itemsize
        configs = (fixed_config(1, group_pad, size), fixed_config(WARM_UP_LONG_CATCH_UP, group_pad, size))
        tiles = {max(c.block_m, group_pad) // group_pad for c in configs}  # a tile's rows of one request
        counts = sorted({1, 2, WARM_UP_LONG_CATCH_UP} | tiles | {t + 1 for t in tiles})
        span = self._span(k)
        for batch, rows in itertools.product((1, 2), counts):
            blocks = list(range(min(-(-(rows + span + 1) // bs), self.runner.num_blocks)))
            m = min(rows, len(blocks) * bs - span - 1)
            if m < 1:
                continue
            plan = _Plan(bs)
            plan.ids, plan.positions, plan.slots = [0] * (m * batch), list(range(m)) * batch, [-1] * (m * batch)
            plan.q_lens, plan.tables, plan.starts, plan.ks = [m] * batch, [blocks] * batch, [m] * batch, [k] * batch
            plan.features = [torch.zeros(m * batch, h, dtype=self.runner.dtype, device=self.runner.device)]
            with torch.inference_mode():
                self._round(plan)

    def capture_graphs(self, k: int, sizes: Sequence[int] | None = None) -> None:
        """Chain rounds of up to k drafts run from CUDA graphs (worker/spec/draft_graphs.py: the catch-up and the
        k - 1 single-row steps), one per batch bucket up to max_num_seqs (`sizes` overrides them); call after
        `warm_up`. Without CUDA the same rounds run eagerly from the graphs' static buffers (what the CPU tests
        check)."""
        assert self.tree_width == 1 and k >= 1, "graphs of chain rounds"
        bs, a = self.runner.block_size, self.runner.arch
        max_len = self.runner.max_model_len + MAX_SPECULATIVE_TOKENS
        graphs = ChainDraftGraphs(self._head_forward, self._greedy, k, sizes or graph_batch_sizes(self.max_num_seqs),
                                  -(-max_len // bs) + 1, max_len, a.hidden_size, self.runner.dtype, self.runner.device)
        if self.runner.device.type == "cuda":
            graphs.capture()
        self.chain_graphs = graphs

    def _head_forward(self, tokens: Tensor, features: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """The head over rows (x_{t+1}, f_t) [T], [T, H] -> f^_{t+1} [T, H]."""
        return self._head(self.runner.model.model.embed_tokens(tokens), features, positions, meta)

    def _greedy(self, hidden: Tensor) -> Tensor:
        """The drafts [T] of predicted features [T, H]: argmax of the target's LM head."""
        return self.runner.model.compute_logits(hidden).argmax(dim=-1)

    def _head(self, embeds: Tensor, features: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """The head's forward over its paged KV cache; on the Triton backend its attention takes the fixed launch
        choices (fixed_config for these rows, HEAD_KEY_SPLITS)."""
        backend = self.runner.backend
        if not isinstance(backend, TritonBackend):
            return self.head(embeds, features, positions, self.kv_cache, meta)
        a = self.runner.arch
        config = fixed_config(max(1, meta.max_query_len), next_pow2(a.num_heads // a.num_kv_heads),
                              self.runner.dtype.itemsize)
        previous, backend.launch_override = backend.launch_override, (config, HEAD_KEY_SPLITS)
        try:
            return self.head(embeds, features, positions, self.kv_cache, meta)
        finally:
            backend.launch_override = previous

    def _round(self, plan: _Plan) -> list[list[int]]:
        """The drafts of a round: chains, or trees when the tree width is above 1."""
        return self._draft(plan) if self.tree_width == 1 else self._draft_tree(plan)

    def _catch_up(self, plan: _Plan) -> Tensor:
        """The catch-up forward: the head's rows from real features; returns f^_m per request [S, H]."""
        device = self.runner.device
        meta = attention_metadata(plan.q_lens, plan.starts, plan.tables, plan.slots, device)
        ids = torch.tensor(plan.ids, dtype=torch.int64, device=device)
        positions = torch.tensor(plan.positions, dtype=torch.int64, device=device)
        hidden = self._head_forward(ids, self._features(plan), positions, meta)
        last = torch.tensor(np.cumsum(plan.q_lens) - 1, dtype=torch.int64, device=device)
        return hidden[last]  # [S, H] f^_m

    def _features(self, plan: _Plan) -> Tensor:
        """The catch-up rows' target features [sum q_lens, H], in the runner's dtype."""
        feats = torch.cat(plan.features) if len(plan.features) > 1 else plan.features[0]
        return feats.to(self.runner.dtype)

    def _draft(self, plan: _Plan) -> list[list[int]]:
        """Run the round (from the chain graphs where they can run it: `ChainDraftGraphs.fits`; else eagerly:
        the catch-up forward, then k-1 single-row steps); drafts per request (plan order)."""
        g = self.chain_graphs
        if g is not None and g.fits(plan.q_lens, plan.starts, plan.ks, plan.tables, self.runner.block_size):
            rounds = g.run(plan.ids, plan.q_lens, plan.slots, self._features(plan), plan.starts, plan.tables,
                           self.runner.block_size)  # [k, S]
            columns = rounds.T.tolist()  # [S][k]: the round's one device-to-host copy
            return [row[:k] for row, k in zip(columns, plan.ks)]
        device = self.runner.device
        hidden = self._catch_up(plan)  # [S, H] f^_m
        tokens = self._greedy(hidden)  # [S] d_1
        steps = [tokens]
        for j in range(1, max(plan.ks)):
            n = sum(k > j for k in plan.ks)  # requests still drafting: a prefix (sorted by k)
            pos, slots = plan.step_slots(j, n)
            meta = attention_metadata([1] * n, [p + 1 for p in pos], plan.tables[:n], slots, device)
            positions = torch.tensor(pos, dtype=torch.int64, device=device)
            hidden = self._head_forward(tokens[:n], hidden[:n], positions, meta)
            tokens = self._greedy(hidden)
            steps.append(tokens)
        flat = torch.cat(steps).tolist()  # the round's one device-to-host copy
        drafts: list[list[int]] = [[] for _ in plan.ks]
        offset = 0
        for step in steps:
            for s in range(step.shape[0]):
                drafts[s].append(flat[offset + s])
            offset += step.shape[0]
        return drafts

    def _draft_tree(self, plan: _Plan) -> list[list[int]]:
        """Run a tree round (worker/spec/eagle_tree.py): catch-up, then one head forward per level with W rows
        per request still expanding; the trees per request (plan order)."""
        width, levels = self.tree_width, [tree_levels(k, self.tree_width) for k in plan.ks]
        hidden = self._catch_up(plan)  # [S, H] f^_m
        score, tokens = self._log_probs(hidden).topk(width, dim=-1)  # [S, W] depth 1, best first
        parent = torch.zeros_like(tokens)
        feats = hidden.repeat_interleave(width, dim=0)  # [S * W, H]: the feature each frontier row reads
        bits = torch.tensor([row_bit(1, w, width) for w in range(width)], device=hidden.device)
        masks = bits.expand(len(plan.ks), width)  # [S, W] int64: the rows each frontier row sees
        frontiers = [(tokens, parent, score)]
        for level in range(1, max(levels)):
            n = sum(d > level for d in levels)  # requests still expanding: a prefix (sorted by k)
            hidden = self._tree_step(plan, level, n, tokens[:n].flatten(), feats[: n * width], masks[:n].flatten())
            score, tokens, parent = self._expand(self._log_probs(hidden), score[:n])
            rows = hidden.view(n, width, -1)  # [n, W, H]
            feats = rows.gather(1, parent[..., None].expand(-1, -1, rows.shape[-1])).flatten(0, 1)
            bits = torch.tensor([row_bit(level + 1, w, width) for w in range(width)], device=hidden.device)
            masks = masks[:n].gather(1, parent) | bits
            frontiers.append((tokens, parent, score))
        # the round's device-to-host copies: tokens and parents, then scores
        flat_ids = torch.cat([torch.cat([t.flatten(), p.flatten()]) for t, p, _ in frontiers]).tolist()
        flat_scores = torch.cat([s.flatten() for _, _, s in frontiers]).tolist()
        per_level: list[list[tuple[list[int], list[int], list[float]]]] = [[] for _ in plan.ks]
        offset = score_offset = 0
        for t, _, _ in frontiers:
            n = t.shape[0]
            for s in range(n):
                ids = slice(offset + s * width, offset + (s + 1) * width)
                par = slice(offset + (n + s) * width, offset + (n + s + 1) * width)
                per_level[s].append((flat_ids[ids], flat_ids[par],
                                     flat_scores[score_offset + s * width : score_offset + (s + 1) * width]))
            offset, score_offset = offset + 2 * n * width, score_offset + n * width
        return [select_tree([t for t, _, _ in lv], [p for _, p, _ in lv], [c for _, _, c in lv], k)
                for lv, k in zip(per_level, plan.ks)]

    def _tree_step(self, plan: _Plan, level: int, n: int, tokens: Tensor, feats: Tensor, masks: Tensor) -> Tensor:
        """One head forward over the W frontier rows of the first n requests at depth `level` under the tree
        mask: each row sees the real prefix (cache indices < m) and its ancestors-or-self. Returns [n * W, H]."""
        device, width = self.runner.device, self.tree_width
        pos, slots, seq_lens = plan.tree_step(level, n, width)
        meta = attention_metadata([width] * n, seq_lens, plan.tables[:n], slots, device)
        meta.tree_mask = masks
        meta.tree_start = torch.tensor(plan.starts[:n], dtype=torch.int32, device=device)
        positions = torch.tensor(pos, dtype=torch.int64, device=device)
        return self._head(self.runner.model.model.embed_tokens(tokens), feats, positions, meta)

    def _expand(self, log_probs: Tensor, score: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The next frontier from the head's log-probs [n * W, V] after each frontier row and the frontier's
        cumulative scores [n, W]: the W best of the W * W top children -> (scores, tokens, parent slots), each
        [n, W]."""
        width, n = self.tree_width, score.shape[0]
        child_score, child = log_probs.topk(width, dim=-1)  # [n * W, W]
        total = (score.reshape(-1, 1) + child_score).view(n, width * width)
        best, pick = total.topk(width, dim=-1)  # [n, W] indices into (parent slot, child rank)
        return best, child.view(n, width * width).gather(1, pick), pick // width

    def _log_probs(self, hidden: Tensor) -> Tensor:
        """The head's next-token log-probs [R, V] (float32) from its predicted features [R, H]."""
        return torch.log_softmax(self.runner.model.compute_logits(hidden).float(), dim=-1)


def heldout_tau(head_dir: Path) -> tuple[float, int] | None:
    """(tau, depth): the held-out chain acceptance train-eagle measured for the head in `head_dir` at the end of its
    training (its eagle_config.json), or None where the config has none."""
    try:
        summary = json.loads((head_dir / CONFIG_FILE).read_text())["training"]["summary"]
        tau, depth = float(summary["heldout_tau_after"]), int(summary["heldout_tau_depth"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (tau, depth) if tau >= 1.0 and depth >= 1 else None


def _check_fusion_support(runner: ModelRunner) -> None:
    """EagleHeadError unless the runner can keep a fusion head's layer states: eager steps on one device."""
    if runner.tp is not None:
        raise EagleHeadError("EAGLE-3 fusion heads are not built for tensor parallelism")
    if runner.graphs is not None or runner.piecewise is not None:
        raise EagleHeadError("EAGLE-3 fusion heads need --no-cuda-graphs for now (the captured steps do not keep "
                             "the fusion layers' states)")
    if runner.kv_dtype == torch.float8_e4m3fn:
        raise EagleHeadError("EAGLE-3 fusion heads are not built with an fp8 KV cache")
