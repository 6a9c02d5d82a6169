"""CUDA graphs of a chain draft round's single-row head steps (worker/spec/eagle_proposer.py).

After the catch-up forward (eager: its rows per request vary), a round of k drafts runs k - 1 head steps of one
row per request: step j (1..k-1) reads (embed(d_j), f^_{m+j-1}) at position m+j-1 and yields f^_{m+j} and
d_{j+1}. Their shapes depend on the number of requests alone, so they are captured once per batch bucket (the
decode graphs' buckets, worker/cuda_graphs.py), all k - 1 steps in one graph, reading static buffers:
    tokens [B] d_1, hidden [B, H] f^_m, starts [B] m, block_tables [B, W], slots [k-1, B] (host-computed);
and writing drafts [k-1, B] (d_2..d_k). Rows past the batch are padding: start 1, block table row 0, slots -1
(nothing written; their drafts are ignored). The head's attention takes the proposer's fixed launch choices
(one key split), so a launch captured for max_model_len is right for every context."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.cuda_graphs import smallest_bucket

log = logging.getLogger("tokenmill.spec")

# (tokens [b], features [b, H], positions [b], meta) -> (features [b, H] f^ of the next position, tokens [b])
HeadStep = Callable[[Tensor, Tensor, Tensor, AttentionMetadata], tuple[Tensor, Tensor]]


class ChainDraftGraphs:
    """The k - 1 single-row steps of a chain round of k drafts, captured per batch bucket (`capture`), replayed by
    `run`. `body` is the captured function; on a machine without CUDA it runs as is (the same static buffers)."""

    def __init__(self, step: HeadStep, k: int, sizes: Sequence[int], max_blocks: int, max_seq_len: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        assert k >= 2 and sizes and max_blocks >= 1, "a chain of >= 2 drafts, some buckets"
        self.step, self.k, self.sizes = step, k, sorted(sizes)
        self.max_seq_len = max_seq_len
        n = self.sizes[-1]
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.starts = torch.ones(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.slots = torch.full((k - 1, n), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones((k - 1, n), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.drafts = torch.zeros((k - 1, n), dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, b: int) -> int | None:
        return smallest_bucket(self.sizes, b)

    def body(self, b: int) -> None:
        """The k - 1 steps over the first b rows of the static buffers: drafts[:, :b] from tokens, hidden."""
        tokens, hidden = self.tokens[:b], self.hidden[:b]
        for j in range(1, self.k):
            positions = self.starts[:b] + (j - 1)
            self.seq_lens[j - 1, :b].copy_(positions + 1)
            meta = AttentionMetadata(
                query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[j - 1, :b],
                block_tables=self.block_tables[:b], slot_mapping=self.slots[j - 1, :b], max_query_len=1,
                max_seq_len=self.max_seq_len, query_lens_cpu=[1] * b, seq_lens_cpu=[self.max_seq_len] * b)
            hidden, tokens = self.step(tokens, hidden, positions, meta)
            self.drafts[j - 1, :b].copy_(tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its pool memory); each after two eager runs,
        so that every kernel is built outside the capture."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.body(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.body(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured %d draft-step CUDA graphs (k = %d, batch sizes %s)", len(self.graphs), self.k, self.sizes)

    def run(self, tokens: Tensor, hidden: Tensor, starts: Sequence[int], tables: Sequence[Sequence[int]],
            slots: Sequence[Sequence[int]]) -> Tensor:
        """Drafts d_2..d_k [k - 1, n] of n requests (n <= max_batch) from d_1 `tokens` [n] and f^_m `hidden` [n, H]:
        `starts` m per request, `tables` its head block table (covering m-1 .. m+k-2), `slots` [k - 1][n] the cache
        slot of step j's row. A view of graph memory, valid until the next run."""
        n = tokens.shape[0]
        b = self.bucket(n)
        assert b is not None and len(starts) == len(tables) == n and len(slots) == self.k - 1
        width = max(len(t) for t in tables)
        assert width <= self.block_tables.shape[1], "a head block table wider than the graphs' buffer"
        table = np.zeros((n, width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        self.tokens[:n].copy_(tokens)
        self.hidden[:n].copy_(hidden)
        self.starts[:n].copy_(torch.from_numpy(np.asarray(starts, dtype=np.int64)), non_blocking=True)
        self.starts[n:b].fill_(1)
        self.block_tables[:n, :width].copy_(torch.from_numpy(table), non_blocking=True)
        self.block_tables[n:b].zero_()
        self.slots[:, :n].copy_(torch.from_numpy(np.asarray(slots, dtype=np.int64)), non_blocking=True)
        self.slots[:, n:b].fill_(-1)
        graph = self.graphs.get(b)
        if graph is None:  # not captured (no CUDA): the same steps, eagerly
            self.body(b)
        else:
            graph.replay()
        return self.drafts[:, :n]
