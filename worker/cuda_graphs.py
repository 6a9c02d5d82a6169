"""CUDA graphs: whole-step graphs for decode-only steps (one new token per request), piecewise graphs for the rest.

One graph per bucketed batch size, captured after the KV cache is sized (so capture cannot run out of
memory), all sharing one memory pool. A step of B decodes replays the smallest bucket >= B with its
inputs copied into static buffers; rows past B are padding (slot -1, nothing written; their outputs are
ignored). Attention launch shapes inside a graph are fixed at capture for max_model_len, so the kernels'
context split is sized for the longest request and short ones leave some programs idle."""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tokenmill.worker.attention.backend import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.kernels.paged_attention import AttentionChoice, AttentionPlan

log = logging.getLogger("tokenmill.cuda_graphs")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def smallest_bucket(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` >= n (the graph a step of n rows replays), or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM buckets the same way)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: KVCaches, sizes: Sequence[int], max_blocks_per_seq: int,
                 max_model_len: int, hidden_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        # Static inputs: the graphs read these addresses on every replay.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden_size = hidden_size

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * b, seq_lens_cpu=[self.max_model_len] * b,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton autotune / compile outside the capture
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model(*args)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def bucket(self, b: int) -> int | None:
        return smallest_bucket(self.sizes, b)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay for a decode-only batch; returns hidden states [B, hidden] (a view of graph memory,
        valid until the next replay)."""
        b = input_ids.shape[0]
        g = self.bucket(b)
        assert g is not None and meta.is_decode_only
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[b:g].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[b:g].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[g].replay()
        return self.outputs[g][:b]


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token buckets of the piecewise graphs: every 32 tokens up to 256, every 64 up to 512, every 128 up to
    1,024, then every 256, and max_tokens itself (a step pads to the next bucket: under 25% padding from 256
    tokens on)."""
    steps = [*range(16, 33, 16), *range(64, 257, 32), *range(320, 513, 64), *range(640, 1025, 128)]
    sizes = [s for s in steps if s < max_tokens] + list(range(1280, max_tokens + 1, 256))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sorted(set(sizes))


class _AttentionCall(NamedTuple):
    """One attention layer between two graph pieces: it reads PiecewiseGraphs.attn_q (the piece before writes
    it) and writes PiecewiseGraphs.attn_out (the piece after reads it)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    kv_scales: torch.Tensor | None  # fp8 caches


class _SplitRecorder:
    """The AttentionSplit of one bucket's capture: at each attention call it ends the graph piece being captured,
    notes the call, and begins the next piece in the same memory pool."""

    def __init__(self, pool: Any, attn_q: torch.Tensor, attn_out: torch.Tensor) -> None:
        self.pool = pool
        self.attn_q = attn_q
        self.attn_out = attn_out
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        assert self._graph is not None
        self._graph.capture_end()
        self.pieces.append(self._graph)
        self._graph = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 sliding_window: int | None, kv_scales: torch.Tensor | None) -> torch.Tensor:
        # q goes to the shared static buffer inside the piece: a recorded q tensor would pin its pool memory
        # for the life of the graphs, every bucket's apart (tens of GB for an 8B model up to 8k tokens).
        self.attn_q[: q.shape[0]].copy_(q)
        self.end()
        self.calls.append(_AttentionCall(k_cache, v_cache, scale, sliding_window, kv_scales))
        self.begin()
        return self.attn_out[: q.shape[0]]


class PiecewiseGraphs:
    """CUDA graphs for steps that carry prompt tokens (or more decodes than DecodeGraphs' largest bucket).

    Per token bucket, the forward is captured in num_layers + 1 pieces cut at each attention kernel: embedding,
    norms, projections, rotary + KV-cache write and the MLP are replayed from graphs (their shapes depend on the
    token count alone), while attention, whose launch depends on the batch's query and context lengths, is
    launched between the pieces with the step's own metadata, planned once for all layers. A step of T tokens
    replays the smallest bucket >= T; rows past T are padding (slot -1: no cache write; outputs ignored)."""

    def __init__(self, model: torch.nn.Module, backend: Any, kv_caches: KVCaches, sizes: Sequence[int],
                 num_heads: int, head_dim: int, hidden_size: int, device: torch.device,
                 dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        n = self.sizes[-1]
        dtype = dtype or kv_caches[0][0].dtype  # the activations' (an fp8 cache's is not)
        # Static inputs: the pieces read these addresses on every replay.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        # Static buffers shared by every bucket and layer (the graphs own no tensor between replays, so all
        # buckets share one pool of activation memory): attention input and output, the final hidden states.
        self.attn_q = torch.zeros((n, num_heads, head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros((n, num_heads, head_dim), dtype=dtype, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[_AttentionCall]] = {}
        self.device = device
        from tokenmill.kernels.paged_attention import plan_paged_attention  # Triton: CUDA machines only

        self._plan = plan_paged_attention
        self._variants: dict[tuple[Any, ...], Any] = {}  # compiled attention variants, shared by the steps' plans
        self.pool: Any = None  # the graphs' memory pool, set by capture (WholeStepGraphs captures into it too)

    def _capture_meta(self, t: int) -> AttentionMetadata:
        """One request of t new tokens: max_query_len > 1 keeps rotary + cache write out of the attention
        kernel (in the pieces); slots -1 write nothing."""
        qsl = torch.tensor([0, t], dtype=torch.int32, device=self.device)
        blocks = -(-t // self.kv_caches[0][0].shape[1])  # the warm-up runs attend over t keys, all in block 0
        return AttentionMetadata(
            query_start_loc=qsl, seq_lens=qsl[1:],
            block_tables=torch.zeros((1, blocks), dtype=torch.int32, device=self.device),
            slot_mapping=self.slot_mapping[:t], max_query_len=t, max_seq_len=t, query_lens_cpu=[t], seq_lens_cpu=[t],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        self.pool = pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for t in reversed(self.sizes):  # largest first: later buckets reuse its pool memory
            args = (self.input_ids[:t], self.positions[:t], self.kv_caches, self._capture_meta(t))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles outside the capture
                    self.model(*args)
                recorder = _SplitRecorder(pool, self.attn_q, self.attn_out)
                self.backend.split = recorder
                try:
                    recorder.begin()
                    self.hidden[:t].copy_(self.model(*args))
                    recorder.end()
                finally:
                    self.backend.split = None
            torch.cuda.current_stream().wait_stream(stream)
            assert len({(c.scale, c.sliding_window) for c in recorder.calls}) == 1, "one attention plan per step"
            self.pieces[t], self.calls[t] = recorder.pieces, recorder.calls
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up forwards' memory, cached for the side stream
        log.info("captured piecewise CUDA graphs for %d token buckets (%s), %d pieces each", len(self.sizes),
                 self.sizes, len(self.pieces[self.sizes[0]]))

    def bucket(self, t: int) -> int | None:
        return smallest_bucket(self.sizes, t)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay for a step of T tokens; returns hidden states [T, hidden] (a view of graph memory, valid
        until the next replay)."""
        t = input_ids.shape[0]
        g = self.bucket(t)
        assert g is not None
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[t:g].fill_(-1)
        calls = self.calls[g]
        first = calls[0]
        q, out = self.attn_q[:t], self.attn_out[:t]
        plan = self._plan(
            q.shape, q.dtype, first.k_cache.shape, self.device, meta.num_seqs, first.scale,
            max_query_len=max(1, meta.max_query_len), max_seq_len=max(1, meta.max_seq_len),
            sliding_window=first.sliding_window, variants=self._variants, kv_dtype=first.k_cache.dtype)
        tree = None if meta.tree_mask is None or meta.tree_start is None else (meta.tree_mask, meta.tree_start)
        for piece, call in zip(self.pieces[g], calls):
            piece.replay()
            plan.launch(q, call.k_cache, call.v_cache, meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, out, kv_scales=call.kv_scales, tree=tree)
        self.pieces[g][-1].replay()
        return self.hidden[:t]

    def _token_counts(self, max_model_len: int) -> list[int]:
        """Step sizes (tokens) for the warm-up's grid: the token buckets, and each count at which the variants of one
        request's step over the longest context change. A replay plans for the step's own tokens, not its bucket's,
        and some choices follow them (the reduce kernel's dims per program, from the step's query rows: a step of
        a few tokens, such as one request verifying a tree, takes other dims than any bucket)."""
        call = self.calls[self.sizes[0]][0]
        shape = self.attn_q.shape[1:]
        counts, last = set(self.sizes), None
        for t in range(2, self.sizes[-1] + 1):
            plan = self._plan((t, *shape), self.attn_q.dtype, call.k_cache.shape, self.device, 1, call.scale,
                              max_query_len=t, max_seq_len=max(t, max_model_len), sliding_window=call.sliding_window,
                              kv_dtype=call.k_cache.dtype)
            if (variants := _variants(plan)) != last:
                counts.add(t)
                last = variants
        return sorted(counts)

    @torch.inference_mode()
    def warm_up_attention(self, max_num_seqs: int, max_model_len: int, trees: bool = False) -> int:
        """Compile every attention and split-reduce kernel variant a replay can launch, so that nothing compiles
        while serving. Within one model and cache, variants differ only in compile-time choices (`_variants`), so
        this plans a grid of batch shapes on the host, one per token bucket x request count x query skew x context
        length, and launches one batch for each variant not met before; with `trees` (tree drafts are verified)
        each such batch also with a tree mask (TREE). Decode-only batches are left out: those steps replay
        DecodeGraphs (captured for every batch size up to max_num_seqs), never these launches. Returns the number
        of kernel variants launched."""
        call = self.calls[self.sizes[0]][0]
        kc, vc = call.k_cache, call.v_cache
        block_size = kc.shape[1]
        seen: set[tuple[Any, ...]] = set()
        batches: list[tuple[int, list[int], int, AttentionPlan]] = []  # a batch and its plan per new variant
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= max_num_seqs]
        for t in self._token_counts(max_model_len):
            for n, q_lens in _prompt_batches(t, counts):
                for ctx in sorted({max(q_lens), min(1024, max_model_len), max_model_len}):
                    ctx = max(ctx, max(q_lens))
                    plan = self._plan(self.attn_q[:t].shape, self.attn_q.dtype, kc.shape, self.device, n,
                                      call.scale, max_query_len=max(q_lens), max_seq_len=ctx,
                                      sliding_window=call.sliding_window, kv_dtype=kc.dtype)
                    new = set(_variants(plan)) - seen
                    if new:
                        seen |= new
                        batches.append((t, q_lens, ctx, plan))
        for t, q_lens, ctx, plan in batches:
            n = len(q_lens)
            qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=self.device)
            seq_lens = torch.tensor([ctx] * n, dtype=torch.int32, device=self.device)
            tables = torch.zeros((n, -(-ctx // block_size)), dtype=torch.int32, device=self.device)
            q = self.attn_q[:t]
            # any mask will do: the outputs are discarded, only the compile matters
            masks = [None, (torch.full((t,), -1, dtype=torch.int64, device=self.device),
                            (seq_lens - (qsl[1:] - qsl[:-1])).to(torch.int32))]
            for tree in masks[: 2 if trees else 1]:  # the plan keeps a compiled variant per tree flag
                plan.launch(q, kc, vc, tables, seq_lens, qsl, self.attn_out[:t], kv_scales=call.kv_scales,
                            tree=tree)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        attention = sum(key[0] == "attention" for key in seen)
        return len(seen) + (attention if trees else 0)


def _variants(plan: AttentionPlan) -> tuple[tuple[Any, ...], ...]:
    """The kernel variants an AttentionPlan's launches use, apart from the per-launch flags (rope, fp8 cache, tree)
    and what is fixed by the model and cache (dtypes, head geometry, strides, alignment): the attention kernel's
    family (decode-only or dynamic), tile config and tile mapping, split or not; with a split, the reduce kernel's
    family, split padding and dims per program (its num_warps follows from those two)."""
    attention = ("attention", plan.dynamic, plan.config, plan.block_m, plan.block_q, plan.one_tile,
                 plan.num_splits > 1)
    if plan.num_splits == 1:
        return (attention,)
    return attention, ("reduce", plan.dynamic, max(8, 1 << (plan.num_splits - 1).bit_length()), plan.reduce_block_d)


def _prompt_batches(t: int, counts: Sequence[int]) -> Iterator[tuple[int, list[int]]]:
    """(n, query lengths) of t tokens over each n of `counts` up to t requests, spread evenly and as n - 1 decodes
    beside one prompt, when a request has more than one token (decode-only batches replay DecodeGraphs)."""
    for n in (c for c in counts if c <= t):
        for q_lens in (_even(t, n), [1] * (n - 1) + [t - n + 1]):
            if max(q_lens) > 1:
                yield n, q_lens


def _powers_of_two(lo: int, hi: int) -> list[int]:
    """The powers of two in [lo, hi]."""
    return [1 << i for i in range(hi.bit_length()) if lo <= 1 << i <= hi]


def _even(t: int, n: int) -> list[int]:
    """t tokens over n requests as evenly as possible."""
    return [t // n + (i < t % n) for i in range(n)]


# Token buckets up to this many replay whole-step graphs when EngineConfig.whole_step_graphs is on: above it a
# step's GPU time (an 8B model: tens of ms) dwarfs the pieces' host launch, which async scheduling overlaps.
WHOLE_STEP_MAX_TOKENS = 2048


class WholeStepGraphs:
    """Whole-step CUDA graphs for steps with prompt tokens, attention captured inside: one replay instead of the
    num_layers + 1 pieces of PiecewiseGraphs with attention launched between them.

    A graph fixes its attention launch: its token bucket T, max_seqs[T] = min(T, max_num_seqs) requests and one
    AttentionChoice (tile config, one tile per request or not, key splits: a power of two). A step of t tokens
    and n requests replays the graph of its bucket and of the choice paged_attention would make for the step
    itself: requests n..max_seqs have no query tokens, rows t..T are padding (no cache write; their outputs are
    ignored), and a launch's real rows do not depend on its grid (AttentionChoice), so the replay computes what
    the pieces compute, bit for bit. Steps whose choice was not captured (a split count that is not a power of
    two), tree drafts, and steps of more tokens than the largest bucket get None from `run`: the caller
    replays the pieces."""

    def __init__(self, model: torch.nn.Module, backend: Any, piecewise: PiecewiseGraphs, max_num_seqs: int,
                 max_model_len: int, max_tokens: int = WHOLE_STEP_MAX_TOKENS) -> None:
        self.model = model
        self.backend = backend
        self.piecewise = piecewise  # its pool (shared: replays never overlap), caches and attention constants
        self.kv_caches = piecewise.kv_caches
        self.sizes = [t for t in piecewise.sizes if t <= max_tokens]
        self.max_model_len = max_model_len
        self.max_seqs = {t: min(t, max_num_seqs) for t in self.sizes}
        device = piecewise.device
        s = max(self.max_seqs.values(), default=1)
        block_size = self.kv_caches[0][0].shape[1]
        # Static inputs the graphs read on every replay (rows and requests past the step's: padding): the pieces'
        # token inputs and hidden states (at least as many rows), and attention metadata of their own.
        self.input_ids, self.positions = piecewise.input_ids, piecewise.positions
        self.slot_mapping, self.hidden = piecewise.slot_mapping, piecewise.hidden
        self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((s, -(-max_model_len // block_size)), dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, AttentionChoice], torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run by a whole-step graph (the rest of the mixed steps: the pieces)
        call = piecewise.calls[piecewise.sizes[0]][0]
        self._attention = (piecewise.attn_q.shape[1:], piecewise.attn_q.dtype, call.k_cache.shape, device,
                           call.sliding_window, call.k_cache.dtype)  # what attention_choice needs besides lengths
        self._group_pad = 1 << (piecewise.attn_q.shape[1] // call.k_cache.shape[2] - 1).bit_length()
        from tokenmill.kernels import launch, paged_attention  # Triton: CUDA machines only

        self._kernels = paged_attention
        self._num_sms = launch.num_sms(device)

    def choice(self, t: int, n: int, max_query_len: int, max_seq_len: int) -> AttentionChoice:
        """The launch choices paged_attention makes for a step of t tokens over n requests."""
        head_shape, dtype, cache_shape, device, window, kv_dtype = self._attention
        return self._kernels.attention_choice((t, *head_shape), dtype, cache_shape, device, n,
                                              max_query_len=max_query_len, max_seq_len=max_seq_len,
                                              sliding_window=window, kv_dtype=kv_dtype)

    def choices_to_capture(self, t: int, lo: int) -> set[AttentionChoice]:
        """Every choice a step of lo < tokens <= t can take with a power-of-two split count. The tile choices
        (config, tile mapping) come from a grid of token counts, request counts and query skews, as
        PiecewiseGraphs.warm_up_attention plans its variants; they do not depend on the context. The split count
        grows with the context and shrinks with the launch's programs (choose_num_splits), so a tile choice's
        largest is the one of its fewest tile slots at max_model_len: every power of two up to it is captured."""
        _, _, cache_shape, _, window, _ = self._attention
        num_kv_heads, group_pad = cache_shape[2], self._group_pad
        s = self.max_seqs[t]
        tiles: set[tuple[Any, bool]] = set()
        counts = sorted({c for c in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512) if c <= s} | {s})
        for tokens in sorted({*range(lo + 1, min(t, lo + 4) + 1), (lo + t + 1) // 2, t}):
            for n, q_lens in _prompt_batches(tokens, counts):
                c = self.choice(tokens, n, max(q_lens), max(q_lens))
                tiles.add((c.config, c.one_tile))
        pa = self._kernels
        found: set[AttentionChoice] = set()
        for config, one_tile in tiles:
            block_q = max(config.block_m, group_pad) // group_pad
            fewest = -(-(lo + 1) // block_q) if one_tile else (lo + 1) // block_q + 1  # tile slots
            most = pa.choose_num_splits(fewest * num_kv_heads, pa.key_span(self.max_model_len, t, window),
                                        self._num_sms, config.block_n)
            found |= {pa.AttentionChoice(config, one_tile, k) for k in _powers_of_two(1, most)}
        return found

    def _capture_meta(self, t: int, c: AttentionChoice) -> AttentionMetadata | None:
        """Metadata of a bucket's capture: max_seqs[t] requests, request 0 holding every token, and a
        max_query_len that makes the plan take c's tile mapping; None when only decode steps take c."""
        s = self.max_seqs[t]
        block_q = max(c.config.block_m, self._group_pad) // self._group_pad
        max_query_len = block_q if c.one_tile else t  # the plan's tile mapping follows max_query_len <= block_q
        if max_query_len < 2:
            return None  # one query token per request: decode-only steps, DecodeGraphs' replays
        self.query_start_loc[:1].fill_(0)
        self.query_start_loc[1 : s + 1].fill_(t)
        self.seq_lens[:s].fill_(0)
        self.seq_lens[:1].fill_(t)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: s + 1], seq_lens=self.seq_lens[:s],
            block_tables=self.block_tables[:s], slot_mapping=self.slot_mapping[:t], max_query_len=max_query_len,
            max_seq_len=self.max_model_len, query_lens_cpu=[t] + [0] * (s - 1), seq_lens_cpu=[t] + [0] * (s - 1))

    @torch.inference_mode()
    def capture(self) -> None:
        assert self.piecewise.pool is not None, "capture the pieces first (their pool is shared)"
        stream = torch.cuda.Stream()
        lo = 0
        for t in self.sizes:
            for c in sorted(self.choices_to_capture(t, lo), key=repr):
                meta = self._capture_meta(t, c)
                if meta is None:
                    continue
                args = (self.input_ids[:t], self.positions[:t], self.kv_caches, meta)
                self.backend.launch_override = (c.config, c.num_splits)
                try:
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        self.model(*args)  # warm up outside the capture (every kernel is compiled by now)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.piecewise.pool, stream=stream):
                        self.hidden[:t].copy_(self.model(*args))
                finally:
                    self.backend.launch_override = None
                self.graphs[(t, c)] = graph
            lo = t
        torch.cuda.synchronize()
        log.info("captured %d whole-step CUDA graphs over %d token buckets (up to %d tokens)", len(self.graphs),
                 len(self.sizes), self.sizes[-1] if self.sizes else 0)

    def bucket(self, t: int) -> int | None:
        return smallest_bucket(self.sizes, t)

    def graph_for(self, t: int, meta: AttentionMetadata) -> tuple[int, AttentionChoice] | None:
        """The key of the graph a step of t tokens replays, or None (the pieces then)."""
        g = self.bucket(t)
        if g is None or meta.tree_mask is not None or meta.num_seqs > self.max_seqs[g] or meta.max_query_len < 2:
            return None
        key = (g, self.choice(t, meta.num_seqs, meta.max_query_len, max(1, meta.max_seq_len)))
        return key if key in self.graphs else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Replay for a step of T tokens: hidden states [T, hidden] (a view of a static buffer, valid until the
        next replay), or None when no graph computes this step as its pieces would."""
        t, n = input_ids.shape[0], meta.num_seqs
        key = self.graph_for(t, meta)
        if key is None:
            return None
        g, s = key[0], self.max_seqs[key[0]]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[t:g].fill_(-1)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[n + 1 : s + 1].fill_(t)  # padding requests: no query tokens
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        self.graphs[key].replay()
        self.replays += 1
        return self.hidden[:t]
