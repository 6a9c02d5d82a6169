"""CUDA graphs of whole chain draft rounds (worker/spec/eagle_proposer.py), one per batch bucket.

A round of k drafts is a catch-up forward and k - 1 single-row head steps. In steady decoding the catch-up of a
request covers the a + 1 positions its last verify step committed (a <= k accepted drafts and the bonus token), so
every request of a round fits R = k + 1 rows: the graph gives each request exactly R catch-up rows, at positions
m - R .. m - 1 (m its computed tokens), the real ones last and the padding first. A padding row writes nothing
(slot -1) and its output is dropped; the real rows attend through the head's paged KV cache, which holds the real
rows of every position before them (the padding rows' positions included), so the padding changes no real row.
Then row m - 1 gives f^_m and d_1 = argmax lm_head(f^_m), and step j (1..k-1) reads (embed(d_j), f^_{m+j-1}) at
position m + j - 1 and yields f^_{m+j} and d_{j+1}. Static buffers, per request s of the bucket:
    ids, positions, slots [B * R] (the catch-up rows), starts [B] m, block_tables [B, W],
    step_slots [k - 1, B] (draft step j's cache slot), features [B * R, H] (the target's f_t of the real rows);
and the output drafts [k, B] (d_1..d_k). Requests past the batch are padding: start R, block table row 0, every
slot -1 (nothing written; their drafts are ignored). The head's attention takes the proposer's fixed launch
choices (one key split), so a launch captured for max_model_len is right for every context.
A round the graphs cannot run (a catch-up of more than R rows: a request's first round after its prompt, or after
speculation paused; m < R; more drafts or requests than captured) runs eagerly in the proposer."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.cuda_graphs import smallest_bucket
from tokenmill.worker.transfer import ship

log = logging.getLogger("tokenmill.spec")

# (tokens [T], features [T, H], positions [T], meta) -> the head's predicted features [T, H] (row t: f^_{t+1})
HeadForward = Callable[[Tensor, Tensor, Tensor, AttentionMetadata], Tensor]
# predicted features [T, H] -> their greedy drafts [T] (argmax of the target's LM head)
Greedy = Callable[[Tensor], Tensor]


class ChainDraftGraphs:
    """Chain rounds of up to k drafts, captured per batch bucket (`capture`), replayed by `run`. `body` is the
    captured function; on a machine without CUDA it runs as is (the same static buffers)."""

    def __init__(self, forward: HeadForward, greedy: Greedy, k: int, sizes: Sequence[int], max_blocks: int,
                 max_seq_len: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        assert k >= 1 and sizes and max_blocks >= 1, "a chain of >= 1 draft, some buckets"
        self.forward, self.greedy, self.k, self.sizes = forward, greedy, k, sorted(sizes)
        self.rows = r = k + 1  # R: catch-up rows per request
        self.max_seq_len, self.device = max_seq_len, device
        n = self.sizes[-1]
        # One int64 buffer, one copy per round: ids, positions, slots (B * R each: the catch-up rows), starts (B),
        # step slots ((k - 1) * B), feature rows (B * R: the row of `features` each real catch-up row's feature
        # goes to; `run` fills them eagerly before the replay)
        self.parts = {"ids": n * r, "positions": n * r, "slots": n * r, "starts": n, "step_slots": (k - 1) * n}
        self.ints = torch.zeros(sum(self.parts.values()), dtype=torch.int64, device=device)
        views = dict(zip(self.parts, self.ints.split(list(self.parts.values()))))
        self.ids, self.positions, self.slots = views["ids"], views["positions"], views["slots"]
        self.starts, self.step_slots = views["starts"], views["step_slots"].view(k - 1, n)
        self.features = torch.zeros((n * r, hidden_size), dtype=dtype, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.catch_up_seq_lens = torch.full((n,), r, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones((max(1, k - 1), n), dtype=torch.int32, device=device)
        self.catch_up_start_loc = torch.arange(0, (n + 1) * r, r, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.drafts = torch.zeros((k, n), dtype=torch.int64, device=device)
        self._padding = self._padding_ints()
        self._offsets = np.cumsum(list(self.parts.values()))[:-1]
        self.ints.copy_(torch.from_numpy(self._padding))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, b: int) -> int | None:
        return smallest_bucket(self.sizes, b)

    def fits(self, q_lens: Sequence[int], starts: Sequence[int], ks: Sequence[int],
             tables: Sequence[Sequence[int]], block_size: int) -> bool:
        """Whether a round can run from the graphs: at most their k drafts and R catch-up rows a request, m >= R,
        at most their largest bucket of requests, every block table covering the k - 1 steps and the buffer."""
        r = self.rows
        if len(ks) > self.max_batch or max(ks) > self.k or max(q_lens) > r or min(starts) < r:
            return False
        width = self.block_tables.shape[1]
        return all(len(t) * block_size > m + self.k - 2 and len(t) <= width for t, m in zip(tables, starts))

    def body(self, b: int) -> None:
        """The round over the first b requests of the static buffers: drafts[:, :b]."""
        r = self.rows
        self.catch_up_seq_lens[:b].copy_(self.starts[:b])
        meta = AttentionMetadata(
            query_start_loc=self.catch_up_start_loc[: b + 1], seq_lens=self.catch_up_seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slots[: b * r], max_query_len=r,
            max_seq_len=self.max_seq_len, query_lens_cpu=[r] * b, seq_lens_cpu=[self.max_seq_len] * b)
        hidden = self.forward(self.ids[: b * r], self.features[: b * r], self.positions[: b * r], meta)[r - 1 :: r]
        tokens = self.greedy(hidden)  # [b] d_1 from f^_m [b, H]
        self.drafts[0, :b].copy_(tokens)
        for j in range(1, self.k):
            positions = self.starts[:b] + (j - 1)
            self.seq_lens[j - 1, :b].copy_(positions + 1)
            meta = AttentionMetadata(
                query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[j - 1, :b],
                block_tables=self.block_tables[:b], slot_mapping=self.step_slots[j - 1, :b], max_query_len=1,
                max_seq_len=self.max_seq_len, query_lens_cpu=[1] * b, seq_lens_cpu=[self.max_seq_len] * b)
            hidden = self.forward(tokens, hidden, positions, meta)
            tokens = self.greedy(hidden)
            self.drafts[j, :b].copy_(tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its pool memory); each after two eager runs,
        so that every kernel is built outside the capture. The buffers hold padding (nothing written)."""
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
        log.info("captured %d draft-round CUDA graphs (k = %d, batch sizes %s)", len(self.graphs), self.k, self.sizes)

    def _padding_ints(self) -> np.ndarray:
        """The int64 buffer with every request padding: catch-up positions 0..R-1, start R, every slot -1."""
        n, r = self.max_batch, self.rows
        out = np.full(sum(self.parts.values()), -1, dtype=np.int64)
        ids, positions, _, starts, _ = np.split(out, np.cumsum(list(self.parts.values()))[:-1])
        ids[:] = 0
        positions[:] = np.tile(np.arange(r), n)
        starts[:] = r
        return out

    def run(self, ids: Sequence[int], q_lens: Sequence[int], slots: Sequence[int], features: Tensor,
            starts: Sequence[int], tables: Sequence[Sequence[int]], block_size: int) -> Tensor:
        """Drafts d_1..d_k [k, n] of a round of n requests (`fits`): request s has q_lens[s] catch-up rows (the
        flattened `ids`, `slots` and `features` [sum q_lens, H], in request order) ending at position starts[s] - 1,
        and block table tables[s]. A view of graph memory, valid until the next run."""
        n, r = len(starts), self.rows
        b = self.bucket(n)
        assert b is not None and len(q_lens) == len(tables) == n and features.shape[0] == len(ids) == sum(q_lens)
        host = self._padding.copy()
        h_ids, h_pos, h_slots, h_starts, h_steps = np.split(host, self._offsets)
        q, m = np.asarray(q_lens, dtype=np.int64), np.asarray(starts, dtype=np.int64)
        req = np.repeat(np.arange(n), q)  # [T] request of each real row
        rows = req * r + (r - q[req]) + (np.arange(len(req)) - np.repeat(np.cumsum(q) - q, q))  # [T] its graph row
        h_ids[rows], h_slots[rows] = ids, slots
        h_pos[: n * r] = (m[:, None] - r + np.arange(r)).reshape(-1)
        h_starts[:n] = m
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        width = int(lens.max())
        table = np.zeros((b, width), dtype=np.int32)  # row s: tables[s], zero-padded
        table[:n][np.arange(width) < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(tables),
                                                                  dtype=np.int32, count=int(lens.sum()))
        steps = h_steps.reshape(self.k - 1, self.max_batch)
        p = m[None, :] + np.arange(self.k - 1)[:, None]  # [k - 1, n]: draft step j's row, position m + j - 1
        steps[:, :n] = table[np.arange(n)[None, :], p // block_size].astype(np.int64) * block_size + p % block_size
        dev = ship({"ints": host, "table": table, "rows": rows}, self.device)
        self.ints.copy_(dev["ints"])
        self.block_tables[:b, :width].copy_(dev["table"])
        self.features.index_copy_(0, dev["rows"], features.to(self.features.dtype))
        graph = self.graphs.get(b)
        if graph is None:  # not captured (no CUDA): the same round, eagerly
            self.body(b)
        else:
            graph.replay()
        return self.drafts[:, :n]
