"""Turns a ScheduledBatch into one varlen forward over all its tokens, then samples.

Owns the device state: model weights, the paged KV cache (one [num_blocks, block_size, Hkv, D] key and
value tensor per layer) and the sampler."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
from tokenmill.worker.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.worker.config import CacheConfig, EngineConfig, ModelArch
from tokenmill.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tokenmill.worker.loader import ModelSource, build_model
from tokenmill.worker.sampler import Sampler, SamplingMetadata
from tokenmill.worker.scheduler import ScheduledBatch

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


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from tokenmill.worker.attention.triton_backend import TritonBackend

        return TritonBackend()
    from tokenmill.worker.attention.torch_ref import TorchRefBackend

    return TorchRefBackend()


@dataclass(frozen=True)
class StepResult:
    """Per scheduled request: the sampled token (None if it did not sample) and its logprobs."""

    sampled: list[int | None]
    logprobs: list[dict[int, float] | None]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        self.config = config
        self.arch: ModelArch = source.arch
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.backend = make_backend(config.attention_backend, self.device)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.model = build_model(source, self.backend, self.device, self.dtype)
        self.sampler = Sampler()
        self.num_blocks = self._size_kv_cache(config.cache)
        shape = (self.num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # Zeroed so that padding rows of a graph replay read finite values.
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.arch.num_layers)
        ]
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, graph_batch_sizes(config.scheduler.max_num_seqs),
                -(-max_model_len // self.block_size), max_model_len, self.arch.hidden_size, self.device)
            self.graphs.capture()

    # -- KV cache sizing --------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        a = self.arch
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

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
        self._profile_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        other = total - free - torch.cuda.memory_reserved(self.device)  # other processes, CUDA context
        return int(total * utilization - peak - max(other, 0))

    @torch.inference_mode()
    def _profile_step(self) -> None:
        """Worst-case step: max_num_batched_tokens prefill tokens spread over max_num_seqs requests,
        attending into a throwaway cache just big enough for them (slots -1: nothing is written)."""
        n = self.config.scheduler.max_num_batched_tokens
        num_seqs = min(self.config.scheduler.max_num_seqs, n)
        q_lens = [n // num_seqs] * num_seqs
        q_lens[-1] += n - sum(q_lens)
        nb = -(-max(q_lens) // self.block_size)
        shape = (nb, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),) * 2 for _ in range(self.arch.num_layers)]
        meta = self._metadata(q_lens, q_lens, [list(range(nb))] * num_seqs, [-1] * n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, ids, caches, meta)  # type: ignore[arg-type]
        logits = self.model.compute_logits(hidden[:num_seqs])
        del hidden, logits

    # -- the step ---------------------------------------------------------------------------------
    def _metadata(self, q_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                  slots: list[int]) -> AttentionMetadata:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flattened input ids [T], positions [T] and attention metadata for the batch."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            ids.extend(req.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in pos)
        meta = self._metadata(
            list(batch.num_new_tokens),
            [r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens)],
            [r.block_ids for r in batch.requests],
            slots,
        )
        dev = self.device
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def forward_hidden(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata]:
        """Hidden states [T, hidden] of every scheduled token (KV written to the cache)."""
        ids, positions, meta = self.prepare(batch)
        if self.graphs is not None and meta.is_decode_only and self.graphs.bucket(meta.num_seqs) is not None:
            return self.graphs.run(ids, positions, meta), meta
        return self.model(ids, positions, self.kv_caches, meta), meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...]) -> StepResult:
        hidden, meta = self.forward_hidden(batch)
        sampling = [i for i in range(len(batch.requests)) if batch.samples(i)]
        sampled: list[int | None] = [None] * len(batch.requests)
        logprobs: list[dict[int, float] | None] = [None] * len(batch.requests)
        if not sampling:
            return StepResult(sampled, logprobs)
        ends = list(itertools.accumulate(meta.query_lens_cpu))
        rows = torch.tensor([ends[i] - 1 for i in sampling], device=self.device)  # last token of each
        logits = self.model.compute_logits(hidden[rows])
        reqs = [batch.requests[i] for i in sampling]
        smeta = SamplingMetadata.build(
            [r.params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.seed for r in reqs],
            eos_token_ids,
            logits.shape[-1],
            self.device,
        )
        out = self.sampler(logits, smeta)
        tokens = out.sampled_token_ids.tolist()
        lp_ids = out.logprobs_token_ids.tolist() if out.logprobs_token_ids is not None else None
        lp_vals = out.logprobs.tolist() if out.logprobs is not None else None
        for j, i in enumerate(sampling):
            sampled[i] = tokens[j]
            n_lp = reqs[j].params.logprobs
            if n_lp is not None and lp_ids is not None and lp_vals is not None:
                logprobs[i] = {t: v for t, v in zip(lp_ids[j][: n_lp + 1], lp_vals[j][: n_lp + 1])}
        return StepResult(sampled, logprobs)

    @torch.inference_mode()
    def logits_for_all(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [T, vocab] of every scheduled token (tests compare chunked and whole prefill)."""
        hidden, _ = self.forward_hidden(batch)
        return self.model.compute_logits(hidden)

