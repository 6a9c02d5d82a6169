"""Whole-step CUDA graphs (worker/cuda_graphs.py WholeStepGraphs) on the CPU: the kernel property they rest on
and the host logic that picks a graph, under the Triton interpreter. Capture and replay need CUDA
(tests/test_gpu_graphs.py).

The property: with one key split, a paged-attention launch planned for more requests (padding ones with no query
tokens) and more tokens (padding rows) than a step has computes the same bits for the step's rows as the step's
own launch with the same tile config and mapping. A whole-step graph is such a launch, fixed at capture."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import SMALL, Batch, make_batch

from tokenmill.kernels.paged_attention import AttentionChoice, PagedAttentionConfig, attention_choice, paged_attention
from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.cuda_graphs import WholeStepGraphs, _AttentionCall

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEV = torch.device("cpu")


def _padded(batch: Batch, tokens: int, seqs: int) -> tuple[torch.Tensor, ...]:
    """The batch's launch arguments as a whole-step graph holds them: q with rows up to `tokens` (random
    padding), `seqs` requests of which those past the batch's have no query tokens and no context."""
    t, n = batch.q.shape[0], len(batch.query_lens)
    q = torch.randn((tokens, *batch.q.shape[1:]), dtype=batch.q.dtype)
    q[:t] = batch.q
    qsl = torch.full((seqs + 1,), t, dtype=torch.int32)
    qsl[: n + 1] = batch.query_start_loc
    seq_lens = torch.zeros(seqs, dtype=torch.int32)
    seq_lens[:n] = batch.seq_lens
    tables = torch.zeros((seqs, batch.block_tables.shape[1] + 2), dtype=torch.int32)
    tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
    return q, batch.k_cache, batch.v_cache, tables, seq_lens, qsl


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("query_lens", "seq_lens", "one_tile"), [
    ([1, 1, 7, 1], [17, 9, 40, 33], False),  # decodes beside a prompt chunk: tiles of BLOCK_Q queries
    ([3, 2, 4], [3, 30, 21], True),  # every request in one tile (verify steps of short drafts)
    ([20, 1], [52, 5], False),  # a long chunk on a cached prefix
], ids=["mixed", "one-tile", "cached-prefix"])
def test_padded_launch_computes_the_same_bits(query_lens: list[int], seq_lens: list[int], one_tile: bool,
                                              dtype: torch.dtype, num_splits: int) -> None:
    batch = make_batch(query_lens, seq_lens, 8, 2, 64, 16, dtype)
    scale = 64**-0.5
    choice = attention_choice(batch.q.shape, dtype, batch.k_cache.shape, DEV, len(query_lens),
                              max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, config=SMALL,
                              num_splits=num_splits)
    assert choice.one_tile is one_tile
    own = paged_attention(*batch.args(), scale, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                          config=SMALL, num_splits=num_splits)
    tokens, seqs = batch.q.shape[0] + 9, len(query_lens) + 5
    block_q = SMALL.block_m // 4  # 8 query heads over 2 kv heads: groups of 4
    out = torch.full((tokens, 8, 64), float("nan"), dtype=dtype)
    paged_attention(*_padded(batch, tokens, seqs), scale, max_query_len=block_q if one_tile else tokens,
                    max_seq_len=4 * batch.max_seq_len, config=SMALL, num_splits=num_splits, out=out)
    assert torch.equal(out[: batch.q.shape[0]], own)
    if num_splits == 1:  # (with splits the reduce also combines the padding rows' unwritten partials)
        assert out[batch.q.shape[0]:].isnan().all(), "padding rows belong to no request: attention skips them"


# ---- which graph a step replays --------------------------------------------------------------------------


def _graphs(max_num_seqs: int = 16, max_model_len: int = 4096, sizes: tuple[int, ...] = (16, 32, 64, 96, 128)
            ) -> WholeStepGraphs:
    """WholeStepGraphs over a stand-in for captured pieces (groups of 4 query heads per kv head as Llama-3-8B's, 2
    kv heads: on the interpreter's 4 "SMs" key splits then range over 1-8), a bf16 cache; no capture."""
    cache = torch.zeros((4, 16, 2, 128), dtype=torch.bfloat16)
    pieces = SimpleNamespace(
        kv_caches=[(cache, cache)], sizes=list(sizes), device=DEV, hidden=torch.zeros((sizes[-1], 64)),
        input_ids=torch.zeros(sizes[-1], dtype=torch.long), positions=torch.zeros(sizes[-1], dtype=torch.long),
        slot_mapping=torch.full((sizes[-1],), -1, dtype=torch.long),
        attn_q=torch.zeros((sizes[-1], 8, 128), dtype=torch.bfloat16), pool=None,
        calls={s: [_AttentionCall(cache, cache, 128**-0.5, None, None)] for s in sizes})
    return WholeStepGraphs(torch.nn.Identity(), SimpleNamespace(), pieces, max_num_seqs,  # type: ignore[arg-type]
                           max_model_len)


def _captured(ws: WholeStepGraphs) -> WholeStepGraphs:
    """As if capture() had run: a placeholder graph for every choice it would capture."""
    lo = 0
    for t in ws.sizes:
        for c in ws.choices_to_capture(t, lo):
            ws.graphs[(t, c)] = object()  # type: ignore[assignment]
        lo = t
    return ws


def _meta(q_lens: list[int], ctx: list[int], tree: bool = False) -> AttentionMetadata:
    z = torch.zeros(1)
    return AttentionMetadata(query_start_loc=z, seq_lens=z, block_tables=z, slot_mapping=z,
                             max_query_len=max(q_lens), max_seq_len=max(ctx), query_lens_cpu=q_lens,
                             seq_lens_cpu=ctx, tree_mask=z if tree else None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=16), st.integers(0, 4000), st.data())
def test_every_step_of_a_captured_choice_finds_its_graph(q_lens: list[int], prefix: int, data: Any) -> None:
    """Whatever paged_attention would choose for a step within the buckets, a graph of that choice was captured
    for the step's bucket, unless its split count is not a power of two (those steps replay the pieces)."""
    ws = _WS
    t = sum(q_lens)
    if t > ws.sizes[-1] or max(q_lens) < 2:
        return
    ctx = [q + data.draw(st.integers(0, prefix)) for q in q_lens]
    choice = ws.choice(t, len(q_lens), max(q_lens), max(ctx))
    key = ws.graph_for(t, _meta(q_lens, ctx))
    if choice.num_splits & (choice.num_splits - 1) == 0:
        assert key == (ws.bucket(t), choice)
    else:
        assert key is None


_WS = _captured(_graphs())


def test_steps_that_replay_the_pieces() -> None:
    ws = _WS
    assert ws.graph_for(20, _meta([10, 10], [30, 40], tree=True)) is None  # tree drafts: TREE is a constexpr
    assert ws.graph_for(200, _meta([100, 100], [100, 100])) is None  # past the largest bucket
    assert ws.graph_for(4, _meta([1, 1, 1, 1], [9, 9, 9, 9])) is None  # decode-only: DecodeGraphs
    odd = next(n for n in range(2, 4096) if ws.choice(2, 1, 2, n).num_splits == 3)  # 3 key splits: not captured
    assert ws.graph_for(2, _meta([2], [odd])) is None
    long = ws.graph_for(2, _meta([2], [4096]))  # one request verifying a draft at a long context: split keys
    assert long is not None and long[1].num_splits == ws.choice(2, 1, 2, 4096).num_splits > 1
    key = ws.graph_for(20, _meta([1] * 4 + [16], [500] * 4 + [16]))  # four decodes and a prompt
    assert key is not None and key[0] == 32 and key[1].num_splits == 1


def test_capture_metadata_reproduces_each_choice() -> None:
    """The capture's metadata (max_seqs requests, request 0 holding every token) plans the launch of the choice
    it captures: the same tile config and split count (forced) and tile mapping (from max_query_len)."""
    ws = _WS
    for (t, c), _ in ws.graphs.items():
        meta = ws._capture_meta(t, c)
        assert meta is not None and meta.num_seqs == ws.max_seqs[t] == min(t, 16)
        got = attention_choice((t, 8, 128), torch.bfloat16, (4, 16, 2, 128), DEV, meta.num_seqs,
                               max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, config=c.config,
                               num_splits=c.num_splits)
        assert got == c
    configs = {c.config for _, c in ws.graphs}
    assert all(isinstance(c, PagedAttentionConfig) for c in configs) and len(configs) >= 2
    assert any(c.one_tile for _, c in ws.graphs) and any(not c.one_tile for _, c in ws.graphs)
    assert any(c.num_splits > 1 for _, c in ws.graphs)
    assert all(isinstance(c, AttentionChoice) for _, c in itertools.islice(ws.graphs, 3))
