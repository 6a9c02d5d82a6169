"""CUDA graphs for decode-only steps (one new token per request).

One graph per bucketed batch size, captured after the KV cache is sized (so capture cannot run out of
memory), all sharing one memory pool. A step of B decodes replays the smallest bucket >= B with its
inputs copied into static buffers; rows past B are padding (slot -1, nothing written; their outputs are
ignored). Attention launch shapes inside a graph are fixed at capture for max_model_len, so the kernels'
context split is sized for the longest request and short ones leave some programs idle."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from tokenmill.worker.attention.backend import AttentionMetadata

log = logging.getLogger("tokenmill.cuda_graphs")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


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
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

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
