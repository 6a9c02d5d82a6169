"""Turns a ScheduledBatch into one varlen forward over all its tokens, then samples. `launch` only
enqueues the work and returns a PendingStep (the sampled ids stay on the device, where the next step
reads the inputs that are still in flight); `PendingStep.result()` waits for the tokens on the host.

Owns the device state: model weights, the paged KV cache (one [num_blocks, block_size, Hkv, D] key and
value tensor per layer, in the model dtype or float8_e4m3fn with --kv-cache-dtype fp8) and the sampler."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from tokenmill.kernels.config import configure as configure_kernels
from tokenmill.kernels.kv_cache import new_kv_cache
from tokenmill.worker.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.worker.attention.kv_rotation import kv_rotation_matrix
from tokenmill.worker.config import CacheConfig, EngineConfig, ModelArch
from tokenmill.worker.cuda_graphs import (
    DecodeGraphs,
    PiecewiseGraphs,
    WholeStepGraphs,
    graph_batch_sizes,
    mixed_graph_sizes,
)
from tokenmill.worker.loader import ModelLoadError, ModelSource, build_model
from tokenmill.worker.models.layers import SINGLE_DEVICE
from tokenmill.worker.parallel.group import TPGroup
from tokenmill.worker.parallel.layers import TensorParallelLayers
from tokenmill.worker.quant.fp8 import check_kv_cache_dtype
from tokenmill.worker.request import Request
from tokenmill.worker.sampler import HostSampling, Sampler, SamplingMetadata
from tokenmill.worker.scheduler import ScheduledBatch
from tokenmill.worker.spec.tree import (
    TreeDrafts,
    accept_path,
    ancestor_masks,
    depths,
    kv_moves,
    parents_of,
    path_tokens,
)
from tokenmill.worker.spec.verifier import DraftLayout, accept_drafts, tokens_of
from tokenmill.worker.structured.bitmask import StepBitmask
from tokenmill.worker.transfer import HostArray, HostCopy, OutputBuffers, StagingRing, ship

log = logging.getLogger("tokenmill.runner")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def make_backend(name: str, device: torch.device, decode_rope_in_attention: bool = True,
                 kv_rotation: torch.Tensor | None = None) -> AttentionBackend:
    """kv_rotation: [D, D] float32 on `device` (worker/attention/kv_rotation.py), or None."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from tokenmill.worker.attention.triton_backend import TritonBackend

        return TritonBackend(decode_rope_in_attention, kv_rotation)
    from tokenmill.worker.attention.torch_ref import TorchRefBackend

    return TorchRefBackend(kv_rotation)


@dataclass(frozen=True)
class StepResult:
    """Per scheduled request: the sampled token (None if it did not sample; for a request that verified
    drafts, the list of its accepted drafts and the target's next token) and the logprobs of its tokens."""

    sampled: list[int | list[int] | None]
    logprobs: list[list[dict[int, float]] | None]
    # Per scheduled request that verified tree drafts: its accepted nodes, root-first (their KV is moved onto
    # consecutive slots before the tokens are committed: ModelRunner.move_tree_kv); empty without trees.
    tree_paths: dict[int, list[int]] = field(default_factory=dict)


class PendingStep:
    """A launched step. Its sampled ids stay on the device, where the next step reads those of them
    that are its inputs (tokens in flight); `result()` waits for them on the host."""

    def __init__(self, num_requests: int, rows: dict[Request, int], batch_index: list[int],
                 num_logprobs: list[int | None], sampled: Tensor | None, copy: HostCopy | None,
                 draft_starts: list[int] | None = None, features: tuple[Tensor, list[int]] | None = None,
                 trees: list[TreeDrafts | None] | None = None) -> None:
        self.num_requests = num_requests
        self.rows = rows  # sampling request without drafts -> its row of `sampled`
        self.sampled = sampled  # [S] i64 on the device ([R] with drafts); None when no request samples
        self._batch_index = batch_index  # sampling request s -> index in the batch
        self._num_logprobs = num_logprobs  # sampling request s -> requested top-n (None: no logprobs)
        self._copy = copy
        # With drafts: sampling request s owns rows draft_starts[s] .. (DraftLayout.starts); the copy then
        # holds the number of drafts each accepted after the sampled ids.
        self._draft_starts = draft_starts
        # With `keep_features`: the target's features [sum n, F] of the kept requests' scheduled tokens, request
        # after request, and n per kept request (`feature_lens`); an empty tensor's place is None.
        self.features = features[0] if features else None
        self.feature_lens = features[1] if features else []
        self._trees = trees or []  # with drafts: sampling request s -> its tree drafts (None: a chain, or none)

    def result(self) -> StepResult:
        sampled: list[int | list[int] | None] = [None] * self.num_requests
        logprobs: list[list[dict[int, float]] | None] = [None] * self.num_requests
        if self._copy is None:
            return StepResult(sampled, logprobs)
        host = self._copy.tolist()
        tokens = host[0]
        n_ids = 1 if self._draft_starts is None else 2  # sampled ids (and accepted counts) first, then logprobs
        lp_ids, lp_vals = (host[n_ids], host[n_ids + 1]) if len(host) > n_ids else ([], [])
        if self._draft_starts is None:
            for s, i in enumerate(self._batch_index):
                sampled[i] = tokens[s]
                n_lp = self._num_logprobs[s]
                if n_lp is not None and lp_ids:
                    logprobs[i] = [_top_logprobs(lp_ids[s], lp_vals[s], n_lp)]
            return StepResult(sampled, logprobs)
        accepted = host[1]
        paths: dict[int, list[int]] = {}
        for s, i in enumerate(self._batch_index):
            start = self._draft_starts[s]
            tree = self._trees[s]
            if tree is None:
                rows: Sequence[int] = range(start, start + accepted[s] + 1)
                sampled[i] = tokens_of(tokens, start, accepted[s])
            else:  # the root's row, then the row of each accepted node (spec/tree.py)
                paths[i] = accept_path(tree, tree.parents, tokens[start : start + len(tree) + 1])
                rows = [start, *(start + 1 + n for n in paths[i])]
                sampled[i] = [tokens[r] for r in rows]
            n_lp = self._num_logprobs[s]
            if n_lp is not None and lp_ids:
                logprobs[i] = [_top_logprobs(lp_ids[r], lp_vals[r], n_lp) for r in rows]
        return StepResult(sampled, logprobs, paths)


class ModelRunner:
    """`tp`: this process's rank of a tensor-parallel group (worker/parallel/): the model, the KV cache (its
    KV heads) and the collectives are that rank's. None: one device, no collective anywhere."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 tp: TPGroup | None = None) -> None:
        self.config = config
        self.arch: ModelArch = source.arch
        self.tp = tp
        self.device = resolve_device(config.device) if tp is None else tp.device
        shards = 1 if tp is None else tp.size
        self.num_heads = self.arch.num_heads // shards  # this rank's query and KV heads
        self.num_kv_heads = self.arch.num_kv_heads // shards
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        configure_kernels(config.kernels)  # before the first kernel launch (and its per-device decisions)
        try:
            check_kv_cache_dtype(config.kv_cache_dtype, self.device)
            kv_rotation = kv_rotation_matrix(config.kv_cache_rotation, self.arch.head_dim, self.device)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        self.backend = make_backend(config.attention_backend, self.device, config.decode_rope_in_attention,
                                    kv_rotation)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        layers = SINGLE_DEVICE if tp is None else TensorParallelLayers(tp)
        # GGUF blocks are not split across ranks: tensor-parallel ranks dequantize them (EngineConfig refuses "on")
        gguf_native = config.gguf_native if tp is None else "off"
        self.model = build_model(source, self.backend, self.device, self.dtype, config.quantization,
                                 gguf_native=gguf_native, layers=layers)
        self.sampler = Sampler()
        # Pinned buffers of the step's one host-to-device copy and of its outputs' copy back, allocated once
        # (transfer.py); None on the CPU.
        cuda = self.device.type == "cuda"
        self.staging: StagingRing | None = StagingRing() if cuda else None
        self.output_buffers: OutputBuffers | None = OutputBuffers() if cuda else None
        # The decoder layers whose residual streams are a kept request's features instead of the final-normed
        # hidden states (an EAGLE-3 head's fusion layers, set by its proposer; such steps run eagerly).
        self.feature_layers: tuple[int, ...] = ()
        self.sampler.warm_up(self.arch.vocab_size, self.device)
        # The torch reference attention indexes by masks (host syncs): its steps run eagerly, without graphs.
        graphs = self.device.type == "cuda" and config.cuda_graphs and self.backend.graph_safe
        if self.device.type == "cuda" and config.cuda_graphs and not graphs:
            log.info("CUDA graphs off: the %s attention backend cannot be captured", self.backend.name)
        self._wants_piecewise = graphs and config.piecewise_graphs and hasattr(self.backend, "split")
        self.num_blocks = self._size_kv_cache(config.cache)
        # Zeroed so that padding rows of a graph replay read finite values.
        self.kv_caches = [
            new_kv_cache(self.num_blocks, self.block_size, self.num_kv_heads, self.arch.head_dim, self.kv_dtype,
                         self.device)
            for _ in range(self.arch.num_layers)
        ]
        # fp8 caches: the first step sets every layer's K/V scales (worker/attention/kv_scales.py)
        self._calibrate_kv = self.kv_dtype == torch.float8_e4m3fn
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, graph_batch_sizes(config.scheduler.max_num_seqs),
                -(-max_model_len // self.block_size), max_model_len, self.arch.hidden_size, self.device)
            self.graphs.capture()
        self.piecewise: PiecewiseGraphs | None = None
        self.whole_step: WholeStepGraphs | None = None
        if self._wants_piecewise:
            self._capture_piecewise(config)

    def _capture_piecewise(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        sched = config.scheduler
        self.piecewise = PiecewiseGraphs(self.model, self.backend, self.kv_caches,
                                         mixed_graph_sizes(sched.max_num_batched_tokens), self.num_heads,
                                         self.arch.head_dim, self.arch.hidden_size, self.device, self.dtype)
        self.piecewise.capture()
        trees = config.speculative.method != "off" and config.speculative.tree_width > 1
        variants = self.piecewise.warm_up_attention(sched.max_num_seqs, self.max_model_len, trees)
        log.info("piecewise CUDA graphs and %d attention variants ready in %.1f s", variants,
                 time.perf_counter() - t0)
        if config.whole_step_graphs:
            t0 = time.perf_counter()
            self.whole_step = WholeStepGraphs(self.model, self.backend, self.piecewise, sched.max_num_seqs,
                                              self.max_model_len)
            self.whole_step.capture()
            log.info("whole-step CUDA graphs ready in %.1f s", time.perf_counter() - t0)

    # -- KV cache sizing --------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in all layers, in the cache's dtype (fp8: half of bf16's, so twice the blocks)."""
        a = self.arch
        return 2 * a.num_layers * self.block_size * self.num_kv_heads * a.head_dim * self.kv_dtype.itemsize

    def _size_kv_cache(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget(cache.gpu_memory_utilization)
        else:
            budget = cache.cpu_kv_bytes
        # More blocks than max_num_seqs full-length requests can use is memory for nothing.
        useful = self.config.scheduler.max_num_seqs * -(-self.max_model_len // self.block_size)
        num_blocks = min(budget // self.bytes_per_block, useful)
        if self.tp is not None:  # every rank's cache holds the same blocks (its KV heads of them)
            num_blocks = self.tp.host_min(int(num_blocks))
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache (budget {budget} bytes, one block needs "
                f"{self.bytes_per_block}); raise gpu_memory_utilization / cpu_kv_bytes or use a smaller model")
        return int(num_blocks)

    def _profile_cuda_budget(self, utilization: float) -> int:
        """Run a worst-case step without a cache to learn peak activation memory, then give the KV
        cache what is left of `utilization * total`."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        other = total - free - torch.cuda.memory_reserved(self.device)  # other processes, CUDA context
        # The piecewise graphs' pool holds the activations of their largest bucket (max_num_batched_tokens
        # tokens): as much again as the worst-case step, kept apart from the caching allocator's memory.
        graph_pool = peak - before if self._wants_piecewise else 0
        return int(total * utilization - peak - graph_pool - max(other, 0))

    @torch.inference_mode()
    def _profile_step(self) -> None:
        """Worst-case step: max_num_batched_tokens prefill tokens spread over max_num_seqs requests,
        attending into a throwaway cache just big enough for them (slots -1: nothing is written)."""
        n = self.config.scheduler.max_num_batched_tokens
        num_seqs = min(self.config.scheduler.max_num_seqs, n)
        q_lens = [n // num_seqs] * num_seqs
        q_lens[-1] += n - sum(q_lens)
        nb = -(-max(q_lens) // self.block_size)
        shape = (nb, self.block_size, self.num_kv_heads, self.arch.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),) * 2 for _ in range(self.arch.num_layers)]
        meta = attention_metadata(q_lens, q_lens, [list(range(nb))] * num_seqs, [-1] * n, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, ids, caches, meta)  # type: ignore[arg-type]
        logits = self.model.compute_logits(hidden[:num_seqs])
        del hidden, logits

    # -- the step ---------------------------------------------------------------------------------
    # Per-step inputs are built as CPU tensors and shipped in one pinned, non_blocking copy (`ship`), and
    # sampled ids come back through `HostCopy`: the host never waits for the stream while it prepares
    # a step, so it can prepare step N+1 while step N runs.
    def _host_inputs(self, batch: ScheduledBatch, prev: PendingStep | None) -> _HostInputs:
        """Token ids, positions and attention metadata of `batch` as CPU tensors. An input still in flight
        (only ever the last token of a chunk: in-flight tokens trail the known ones; a request with drafts has
        none) is left 0 and noted,
        with the row of `prev`'s sampled ids that holds its value. Positions and slots are computed for all
        tokens at once (numpy), so a step's host cost does not grow with its prompt tokens."""
        ids: list[int] = []
        fix_index: list[int] = []
        fix_source: list[int] = []
        starts: list[int] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            starts.append(start)
            chunk = req.token_ids[start : start + n]
            if len(chunk) < n and req.draft_token_ids:  # drafts trail the known tokens (none in flight then)
                chunk += req.draft_token_ids[: n - len(chunk)]
            if len(chunk) < n:
                fix_index.append(len(ids) + n - 1)
                fix_source.append(_source_row(prev, req))
                chunk.append(0)
            ids.extend(chunk)
        q_lens = list(batch.num_new_tokens)
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        tables = _block_table(r.block_ids for r in batch.requests)
        positions, slots = _positions_and_slots(np.asarray(q_lens), np.asarray(starts), tables, self.block_size)
        arrays = _attention_host(q_lens, seq_lens, tables, slots) | _tree_inputs(batch.requests, q_lens, seq_lens,
                                                                                 positions)
        arrays |= {"input_ids": _i64(ids), "positions": positions, "fix_index": _i64(fix_index),
                   "fix_source": _i64(fix_source)}
        return _HostInputs(arrays, q_lens, seq_lens)

    def _device_inputs(self, dev: dict[str, Tensor], host: _HostInputs, prev: PendingStep | None,
                       ) -> tuple[Tensor, Tensor, AttentionMetadata]:
        ids = dev["input_ids"]
        inflight = len(host.tensors["fix_index"])
        if inflight:
            assert prev is not None and prev.sampled is not None
            # on the device, after prev's sampler (index_copy_/index_select: the same as ids[i] = sampled[j] with
            # distinct i, at less host cost than advanced indexing)
            if inflight < len(ids):
                ids.index_copy_(0, dev["fix_index"], prev.sampled.index_select(0, dev["fix_source"]))
            elif _is_arange(host.tensors["fix_source"], len(prev.sampled)):  # every token in flight (one per
                ids = prev.sampled  # request, fix_index = 0..T-1), in the rows of prev's sampled ids: those ids
            else:
                ids = prev.sampled.index_select(0, dev["fix_source"])
        return ids, dev["positions"], _attention_meta(dev, host.q_lens, host.seq_lens)

    def _forward_keeping(self, inputs: tuple[Tensor, Tensor, AttentionMetadata], dev: dict[str, Tensor],
                         lens: list[int]) -> tuple[Tensor, tuple[Tensor, list[int]] | None]:
        """The step's hidden states [T, H] and the kept requests' features [sum lens, F] with `lens` (their
        scheduled tokens; None without any): the hidden rows `dev["feature_rows"]` (F = H), or with
        `feature_layers` the residual streams of those layers at those rows, concatenated in order
        (F = len(feature_layers) * H; eager)."""
        if not (lens and self.feature_layers):
            hidden = self._forward(*inputs)
            return hidden, _kept_features(hidden, dev, lens)
        ids, positions, meta = inputs
        assert self.graphs is None and self.piecewise is None and not self._calibrate_kv, "fusion heads run eagerly"
        hidden, states = self.model.forward_recording(ids, positions, self.kv_caches, meta, self.feature_layers,
                                                      dev["feature_rows"])
        return hidden, (torch.cat(states, dim=-1), lens)

    def _forward(self, ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        if self._calibrate_kv:
            return self._calibrating_forward(ids, positions, meta)
        if self.graphs is not None and meta.is_decode_only and self.graphs.bucket(meta.num_seqs) is not None:
            return self.graphs.run(ids, positions, meta)
        if self.whole_step is not None and (hidden := self.whole_step.run(ids, positions, meta)) is not None:
            return hidden
        if self.piecewise is not None and self.piecewise.bucket(ids.shape[0]) is not None:
            return self.piecewise.run(ids, positions, meta)
        return self.model(ids, positions, self.kv_caches, meta)

    def _calibrating_forward(self, ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """The first step with an fp8 cache, eager: every layer sets its kv_scales from this step's keys and values
        before writing them; the graphs read the scales in place from then on."""
        self.backend.calibrate_kv_scales = True
        try:
            return self.model(ids, positions, self.kv_caches, meta)
        finally:
            self.backend.calibrate_kv_scales = False
            self._calibrate_kv = False
            log.info("fp8 KV cache: K/V scales calibrated on the first step (%d tokens)", ids.shape[0])

    def _host_sampling(self, reqs: list[Request], eos_token_ids: tuple[int, ...], prev: PendingStep | None,
                       bitmask: StepBitmask | None = None) -> tuple[HostSampling, dict[str, HostArray]]:
        """The sampling metadata's host arrays plus, for penalties, where in-flight outputs go: one is padded (pad
        id V counts for nothing) and filled on the device from `prev`'s sampled ids. `bitmask`: the masks of
        the constrained requests among `reqs` (row r = request r). The output ids are gathered only when a
        request has a penalty."""
        vocab = self.arch.vocab_size
        fix: list[tuple[int, int, int]] = []  # (row, column, row of prev.sampled)

        def outputs() -> list[list[int]]:
            rows = []
            for row, r in enumerate(reqs):
                out = r.output_token_ids
                if r.num_inflight:
                    fix.append((row, len(out), _source_row(prev, r)))
                    out.append(vocab)
                rows.append(out)
            return rows

        num_outputs = [len(r.token_ids) - len(r.prompt_token_ids) + r.num_inflight for r in reqs]
        meta = HostSampling.build([r.params for r in reqs], [r.seed for r in reqs], num_outputs, eos_token_ids, vocab,
                                  lambda: [r.prompt_token_ids for r in reqs], outputs,
                                  _bitmask_rows(bitmask, reqs, range(len(reqs))))
        arrays = _sampling_arrays(meta)
        if fix and meta.arrays["output_ids"].shape[1]:
            rows, cols, src = zip(*fix)
            arrays |= {"pen.rows": _i64(rows), "pen.cols": _i64(cols), "pen.src": _i64(src)}
        return meta, arrays

    def _host_draft_sampling(self, reqs: list[Request], eos_token_ids: tuple[int, ...], starts: Sequence[int],
                             bitmask: StepBitmask | None = None) -> tuple[HostSampling, dict[str, HostArray]]:
        """SamplingMetadata of the rows of requests verifying drafts: request r with drafts d_1..d_k has k+1 rows,
        row j sampled as plain decoding samples output position n+j after d_1..d_j (its outputs, penalties,
        min_tokens bans and seeded position). No token is in flight in such a step. A constrained request
        (`bitmask`) has no drafts: its one row starts[r] is masked."""
        params, seeds, num_outputs, paths = [], [], [], []
        for r in reqs:
            drafts, n = r.draft_token_ids, r.num_known_tokens - r.num_prompt_tokens  # no token is in flight
            parents = parents_of(drafts)
            path = [path_tokens(drafts, parents, j - 1) for j in range(len(drafts) + 1)]
            paths.append(path)  # row j follows node j - 1 (the root for j = 0): its drafted tokens
            params += [r.params] * len(path)
            seeds += [r.seed] * len(path)
            num_outputs += [n + len(p) for p in path]

        def prompts() -> list[Sequence[int]]:  # asked for only when a row has a penalty: built then
            return [r.prompt_token_ids for r, path in zip(reqs, paths) for _ in path]

        def outputs() -> list[Sequence[int]]:
            return [r.output_token_ids + p for r, path in zip(reqs, paths) for p in path]

        meta = HostSampling.build(params, seeds, num_outputs, eos_token_ids, self.arch.vocab_size,
                                  prompts, outputs, _bitmask_rows(bitmask, reqs, starts))
        return meta, _sampling_arrays(meta)

    def _device_sampling(self, host: HostSampling, dev: dict[str, Tensor], prev: PendingStep | None,
                         ) -> SamplingMetadata:
        meta = host.metadata({k: dev["s." + k] for k in host.arrays}, self.device)
        if "pen.rows" in dev:
            assert prev is not None and prev.sampled is not None
            meta.output_ids[dev["pen.rows"], dev["pen.cols"]] = prev.sampled[dev["pen.src"]]
        return meta

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...],
               prev: PendingStep | None = None, keep_features: Sequence[int] = (),
               bitmask: StepBitmask | None = None) -> PendingStep:
        """Enqueue the forward and sampling of `batch` without waiting for the device. Inputs still in
        flight are read on the device from `prev`, which must be the step launched just before (it
        samples them). Call before the scheduler marks the batch launched (`begin_step`). `keep_features`:
        indices of the batch's requests whose features (final-normed hidden states of all their scheduled
        tokens) the PendingStep keeps (EAGLE drafts read them); nothing is kept or copied without them.
        `bitmask`: structured outputs' token masks of sampling requests (shipped with the step's inputs)."""
        sampling = [i for i in range(len(batch.requests)) if batch.samples(i)]
        reqs = [batch.requests[i] for i in sampling]
        host = self._host_inputs(batch, prev)
        ends = list(itertools.accumulate(host.q_lens))
        if keep_features:
            rows = [t for i in keep_features for t in range(ends[i] - host.q_lens[i], ends[i])]
            host.tensors["feature_rows"] = _i64(rows)
        if any(r.draft_token_ids for r in reqs):
            return self._launch_verify(batch, sampling, reqs, host, ends, eos_token_ids, keep_features, bitmask)
        tensors = host.tensors | {"logits_rows": _i64([ends[i] - 1 for i in sampling])}  # last token of each
        smeta, stensors = self._host_sampling(reqs, eos_token_ids, prev, bitmask) if reqs else (None, {})
        dev = self._ship(tensors | stensors)  # the step's one host-to-device copy
        hidden, features = self._forward_keeping(self._device_inputs(dev, host, prev), dev,
                                                 [host.q_lens[i] for i in keep_features])
        if smeta is None:
            return PendingStep(len(batch.requests), {}, [], [], None, None, features=features)
        # Every token samples (one per request: decode-only): the logits rows are all of them, in order.
        last = hidden if len(sampling) == len(hidden) else hidden.index_select(0, dev["logits_rows"])
        logits = self.model.compute_logits(last)
        out = self.sampler(logits, self._device_sampling(smeta, dev, prev))
        copies = [out.sampled_token_ids]
        if out.logprobs_token_ids is not None and out.logprobs is not None:
            copies += [out.logprobs_token_ids, out.logprobs]
        return PendingStep(len(batch.requests), dict(zip(reqs, range(len(reqs)))), sampling,
                           [r.params.logprobs for r in reqs], out.sampled_token_ids,
                           HostCopy(copies, self.output_buffers), features=features)

    def _launch_verify(self, batch: ScheduledBatch, sampling: list[int], reqs: list[Request], host: _HostInputs,
                       ends: list[int], eos_token_ids: tuple[int, ...], keep_features: Sequence[int],
                       bitmask: StepBitmask | None = None) -> PendingStep:
        """`launch` of a step that verifies drafts (spec/verifier.py): the same forward, then every sampling
        request's k+1 last rows are sampled and compared with its drafts on the device."""
        assert not any(r.num_inflight for r in batch.requests), "drafts are verified with no token in flight"
        layout = DraftLayout.build([r.draft_token_ids for r in reqs])
        rows = [ends[i] - 1 - len(r.draft_token_ids) + j
                for i, r in zip(sampling, reqs) for j in range(len(r.draft_token_ids) + 1)]
        smeta, stensors = self._host_draft_sampling(reqs, eos_token_ids, layout.starts, bitmask)
        tensors = host.tensors | stensors | {"logits_rows": _i64(rows), "spec.rows": layout.rows,
                                             "spec.drafts": layout.drafts}
        dev = self._ship(tensors)  # the step's one host-to-device copy
        hidden, features = self._forward_keeping(self._device_inputs(dev, host, None), dev,
                                                 [host.q_lens[i] for i in keep_features])
        logits = self.model.compute_logits(hidden.index_select(0, dev["logits_rows"]))  # [R, V]
        out = self.sampler(logits, self._device_sampling(smeta, dev, None))
        accepted = accept_drafts(out.sampled_token_ids, dev["spec.rows"], dev["spec.drafts"])  # [S]
        copies = [out.sampled_token_ids, accepted]
        if out.logprobs_token_ids is not None and out.logprobs is not None:
            copies += [out.logprobs_token_ids, out.logprobs]
        plain = {r: layout.starts[s] for s, r in enumerate(reqs) if not r.draft_token_ids}
        trees = [r.draft_token_ids if isinstance(r.draft_token_ids, TreeDrafts) and r.draft_token_ids else None
                 for r in reqs]
        return PendingStep(len(batch.requests), plain, sampling, [r.params.logprobs for r in reqs],
                           out.sampled_token_ids, HostCopy(copies, self.output_buffers), layout.starts, features,
                           trees)

    @torch.inference_mode()
    def move_tree_kv(self, requests: Sequence[Request], paths: dict[int, list[int]]) -> None:
        """After a step that verified tree drafts, before its tokens are committed: the KV of each accepted path
        (`paths`: batch index -> nodes) moves onto the consecutive slots its tokens now own (spec/tree.py)."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for i, path in paths.items():
            req = requests[i]
            base = req.num_known_tokens  # the tree's first cache index
            for a, b in kv_moves(path):
                for pos, out in ((base + a, src), (base + b, dst)):
                    out.append(req.block_ids[pos // bs] * bs + pos % bs)
        if not src:
            return
        s, d = (torch.from_numpy(_i64(ix)).to(self.device) for ix in (src, dst))
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
                flat = flat.flatten(0, 1)  # [slots, Hkv, D]
                flat[d] = flat[s]

    @torch.inference_mode()
    def logits_for_all(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [T, vocab] of every scheduled token of a batch without tokens in flight (tests compare
        chunked and whole prefill). KV is written to the cache; nothing is sampled."""
        host = self._host_inputs(batch, None)
        hidden = self._forward(*self._device_inputs(self._ship(host.tensors), host, None))
        return self.model.compute_logits(hidden)

    def _ship(self, tensors: dict[str, HostArray]) -> dict[str, Tensor]:
        """A step's host inputs to the device (a tensor-parallel rank 0 also hands them to the other ranks)."""
        return ship(tensors, self.device, self.staging)

    def close(self) -> None:
        """Release what outlives the object (a tensor-parallel runner's other ranks); nothing here."""


class _HostInputs(NamedTuple):
    tensors: dict[str, HostArray]  # numpy arrays or CPU tensors, shipped with the step's other inputs
    q_lens: list[int]
    seq_lens: list[int]


def _kept_features(hidden: Tensor, dev: dict[str, Tensor], lens: list[int]) -> tuple[Tensor, list[int]] | None:
    """The rows `dev["feature_rows"]` of the step's hidden states [sum lens, H] (a copy: a graph's output buffer
    is reused), with `lens`; None without kept requests."""
    if not lens:
        return None
    return hidden[dev["feature_rows"]], lens


def _top_logprobs(ids: list[int], vals: list[float], n: int) -> dict[int, float]:
    """The sampled token's logprob and the top-n (one row of SamplerOutput's logprobs)."""
    return dict(zip(ids[: n + 1], vals[: n + 1]))


def _sampling_arrays(meta: HostSampling) -> dict[str, HostArray]:
    """The metadata's host arrays, keyed "s.<field>" for the step's one shipped copy."""
    return {"s." + k: a for k, a in meta.arrays.items()}


def _bitmask_rows(bitmask: StepBitmask | None, reqs: list[Request], rows: Sequence[int],
                  ) -> tuple[list[int], Tensor] | None:
    """(sampling rows, masks) of a step's constrained requests, request r's row being rows[r]."""
    if bitmask is None:
        return None
    row_of = {r: row for r, row in zip(reqs, rows)}
    assert all(not r.draft_token_ids for r in bitmask.requests), "a constrained request never verifies drafts"
    return [row_of[r] for r in bitmask.requests], bitmask.bits


def _i64(vals: Sequence[int]) -> np.ndarray:
    return np.array(vals, dtype=np.int64)


def _is_arange(a: HostArray, n: int) -> bool:
    """Whether 1-D `a` is 0, 1, .., n - 1."""
    return len(a) == n and bool((np.asarray(a) == np.arange(n)).all())


def _source_row(prev: PendingStep | None, req: Request) -> int:
    """Row of `prev`'s sampled ids that holds `req`'s token in flight."""
    assert prev is not None and req in prev.rows and req.num_inflight == 1, \
        f"{req.request_id}: an input in flight whose sampling step is not the previous one"
    return prev.rows[req]


def attention_metadata(q_lens: list[int], seq_lens: list[int], tables: list[list[int]], slots: list[int],
                       device: torch.device) -> AttentionMetadata:
    """AttentionMetadata on `device` from host lists (one shipped copy): query and context lengths per
    request, each request's block ids, and the cache slot of every new token."""
    host = _attention_host(q_lens, seq_lens, _block_table(tables), np.asarray(slots, dtype=np.int64))
    return _attention_meta(ship(host, device), q_lens, seq_lens)


def _block_table(tables: Iterable[list[int]]) -> np.ndarray:
    """[B, max blocks] int32, rows padded with block 0."""
    rows = list(tables)
    out = np.zeros((len(rows), max(len(t) for t in rows)), dtype=np.int32)
    for i, t in enumerate(rows):
        out[i, : len(t)] = t
    return out


def _positions_and_slots(q_lens: np.ndarray, starts: np.ndarray, tables: np.ndarray,
                         block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token of the flattened batch: its position (request i's tokens are starts[i] .. starts[i] + q_lens[i]
    - 1) and its cache slot (block of that position in the request's table row * block_size + offset). int64."""
    if q_lens.sum() == len(q_lens):  # one token per request (decode): token i is request i's
        req, positions = np.arange(len(q_lens)), starts.astype(np.int64)
    else:
        req = np.repeat(np.arange(len(q_lens)), q_lens)  # [T] request of each token
        first = np.cumsum(q_lens) - q_lens  # [B] row of each request's first token
        positions = (np.arange(len(req)) - first[req] + starts[req]).astype(np.int64)
    slots = tables[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return positions, slots


def _attention_host(q_lens: list[int], seq_lens: list[int], tables: np.ndarray,
                    slots: np.ndarray) -> dict[str, HostArray]:
    query_start_loc = np.zeros(len(q_lens) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start_loc[1:])
    return {
        "query_start_loc": query_start_loc,
        "seq_lens": np.array(seq_lens, dtype=np.int32),
        "block_tables": tables,
        "slot_mapping": slots,
    }


def _attention_meta(dev: dict[str, Tensor], q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"], block_tables=dev["block_tables"],
        slot_mapping=dev["slot_mapping"], max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, tree_mask=dev.get("tree_mask"), tree_start=dev.get("tree_start"),
    )


def _tree_inputs(requests: Sequence[Request], q_lens: list[int], seq_lens: list[int],
                 positions: np.ndarray) -> dict[str, HostArray]:
    """Tree drafts (spec/tree.py): each node's rotary position set to the root's + its depth (in `positions`),
    and the attention's tree_mask / tree_start; {} when no request of the step verifies a tree."""
    trees = [(i, r) for i, r in enumerate(requests) if isinstance(r.draft_token_ids, TreeDrafts) and r.draft_token_ids]
    if not trees:
        return {}
    mask = np.zeros(len(positions), dtype=np.int64)
    start = np.asarray(seq_lens, dtype=np.int32)
    first = np.cumsum(q_lens) - np.asarray(q_lens)
    for i, req in trees:
        tree = req.draft_token_ids
        assert isinstance(tree, TreeDrafts) and q_lens[i] > len(tree), "a verify step computes the root and every node"
        rows = first[i] + q_lens[i] - len(tree) + np.arange(len(tree))
        start[i] = req.num_known_tokens  # node j sits at cache index start + j
        positions[rows] = req.num_known_tokens - 1 + np.asarray(depths(tree.parents))
        mask[rows] = ancestor_masks(tree.parents)
    return {"tree_mask": mask, "tree_start": start}
