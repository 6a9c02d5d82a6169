"""Tests of the Triton kernels (kernels/*) and the Triton attention backend against plain-torch references.

Without CUDA the kernels run under the Triton interpreter (fp16 / fp32 only: the interpreter's bf16 tl.dot
is wrong); GPU tests (@pytest.mark.gpu) use bf16 and realistic shapes. Every kernel output is poisoned with
NaN before the launch and unused cache slots hold NaN, so unwritten elements and stray reads fail.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import pytest
from helpers_aot import run_sm90_compile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenmill.kernels.attention_ref import (
    paged_attention_ref,
    rotary_embedding_ref,
    write_kv_cache_ref,
)
from tokenmill.kernels.kv_cache import write_kv_cache
from tokenmill.kernels.paged_attention import PagedAttentionConfig, choose_num_splits, paged_attention
from tokenmill.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from tokenmill.kernels.rotary import cos_sin_cache_from_inv_freq, rotary_and_cache, rotary_embedding
from tokenmill.worker.attention.backend import AttentionLayer, AttentionMetadata
from tokenmill.worker.attention.triton_backend import TritonBackend
from tokenmill.worker.model_runner import attention_metadata

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.gpu
# the Triton interpreter converts 1-element arrays to ints (numpy deprecation noise, harmless here)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# Small tiles so that the interpreter walks several query tiles and key iterations on tiny shapes.
SMALL = PagedAttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL32 = PagedAttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)


# ---------------------------------------------------------------------------------------------------
# batch construction
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; slots outside any context hold NaN
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, unused entries 0
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    query_lens: list[int]
    seq_lens_list: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)


def make_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    device: torch.device = DEV,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Batch:
    """Random queries and a cache whose blocks are scattered (random permutation); every slot that is not
    part of some request's context (spare blocks, the tail of last blocks) is NaN."""
    assert all(1 <= ql <= sl for ql, sl in zip(query_lens, seq_lens))
    gen = torch.Generator(device=device).manual_seed(seed)  # data generated where it is used
    n_blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(n_blocks) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    block_tables = torch.zeros((len(seq_lens), max(n_blocks) + 1), dtype=torch.int32)
    used = 0
    for i, (s, nb) in enumerate(zip(seq_lens, n_blocks)):
        blocks = perm[used : used + nb]
        used += nb
        block_tables[i, :nb] = blocks.to(torch.int32)
        flat = torch.arange(s, device=device)
        kv = torch.randn((2, s, num_kv_heads, head_dim), generator=gen, device=device).to(dtype)
        blk = blocks.to(device)[flat // block_size]
        k_cache[blk, flat % block_size] = kv[0]
        v_cache[blk, flat % block_size] = kv[1]
    q = torch.randn((sum(query_lens), num_q_heads, head_dim), generator=gen, device=device).to(dtype)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return Batch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        query_lens=list(query_lens),
        seq_lens_list=list(seq_lens),
    )


def _tol(dtype: torch.dtype, atol_half: float, rtol_half: float) -> dict[str, Any]:
    """assert_close tolerances: tight for fp32, the given ones for 16-bit dtypes."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": atol_half, "rtol": rtol_half}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def run_attention(
    batch: Batch,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    config: PagedAttentionConfig | None = None,
) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # poison
    res = paged_attention(
        *batch.args(),
        scale,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        sliding_window=sliding_window,
        out=out,
        num_splits=num_splits,
        config=config,
    )
    assert res is out
    return out


def check_attention(
    batch: Batch,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    config: PagedAttentionConfig | None = None,
    atol: float | None = None,
) -> None:
    scale = batch.q.shape[-1] ** -0.5
    out = run_attention(batch, scale, sliding_window=sliding_window, num_splits=num_splits, config=config)
    ref = paged_attention_ref(*batch.args(), scale, sliding_window=sliding_window)
    assert not out.isnan().any(), "kernel left unwritten (NaN) outputs or read poisoned slots"
    if atol is None:
        atol = 1e-4 if batch.q.dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=1e-2)


# ---------------------------------------------------------------------------------------------------
# paged attention: interpreter (or GPU) tests on tiny shapes
# ---------------------------------------------------------------------------------------------------

DECODE_LENS = [15, 16, 17, 33]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_block_boundaries_gqa4(dtype: torch.dtype, num_splits: int | None) -> None:
    batch = make_batch([1, 1, 1, 1], DECODE_LENS, 8, 2, 64, 16, dtype)
    check_attention(batch, num_splits=num_splits)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 4, 64, 16), (4, 1, 64, 8), (6, 2, 64, 32), (2, 2, 128, 16)],
    ids=["mha", "mqa-bs8", "gqa3-bs32", "d128"],
)
def test_decode_head_layouts(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    batch = make_batch([1, 1, 1], [16, 17, 33], num_q_heads, num_kv_heads, head_dim, block_size, torch.float16)
    check_attention(batch, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_prefill_chunks_with_prefix(dtype: torch.dtype, num_splits: int) -> None:
    # ragged mix: chunk with prefix, decode, whole prompt, chunk longer than a tile, chunk at a block edge
    batch = make_batch([5, 1, 17, 9, 16], [20, 16, 17, 40, 32], 8, 2, 32, 16, dtype)
    check_attention(batch, num_splits=num_splits, config=SMALL)


def test_prefill_tile_diagonal_alignment() -> None:
    # with BLOCK_Q = 4 tokens and BLOCK_N = 16 keys, tile start positions take every residue mod 16, so the
    # boundary between the unmasked loop and the causally masked loop is hit exactly and off by one
    batch = make_batch([33, 30, 29], [35, 33, 29], 8, 2, 16, 16, torch.float32)
    check_attention(batch, config=SMALL)


@pytest.mark.parametrize("deep", [False, True])
def test_prefill_long_tile_shape(deep: bool) -> None:
    # the long-run tiles (256 rows = 64 tokens x 4 heads, 64 keys per step) on ragged chunks with prefixes,
    # tiles cut by request ends and tokens both sides of a key-block edge (fp16: its dtype class on the GPU)
    from tokenmill.kernels.paged_attention import LONG_PREFILL_CONFIG, LONG_PREFILL_CONFIG_DEEP

    batch = make_batch([70, 1, 130, 64], [90, 40, 130, 200], 8, 2, 32, 16, torch.float16)
    check_attention(batch, config=LONG_PREFILL_CONFIG_DEEP if deep else LONG_PREFILL_CONFIG)


@pytest.mark.parametrize("config", [SMALL, None], ids=["small-tiles", "default"])
def test_prefill_with_tree_drafts(config: PagedAttentionConfig | None) -> None:
    # a request verifying a 7-node tree (root + nodes: 8 queries), a plain chunk, and one verifying a chain-shaped
    # tree; the tree nodes see the context and their ancestors only (kernels/attention_ref.py's rule)
    from tokenmill.worker.spec.tree import ancestor_masks

    trees = {0: [-1, -1, 0, 0, 1, 2, 5], 2: [-1, 0, 1]}
    q_lens, seq_lens = [8, 5, 4], [29, 21, 18]
    batch = make_batch(q_lens, seq_lens, 8, 2, 32, 16, torch.float32)
    masks = torch.zeros(sum(q_lens), dtype=torch.int64)
    start = torch.tensor(seq_lens, dtype=torch.int32)
    first = 0
    for i, (n, s) in enumerate(zip(q_lens, seq_lens)):
        if i in trees:
            nodes = len(trees[i])
            masks[first + n - nodes : first + n] = torch.tensor(ancestor_masks(trees[i]))
            start[i] = s - nodes
        first += n
    tree = dict(tree_mask=masks.to(DEV), tree_start=start.to(DEV))
    scale = 32**-0.5
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(*batch.args(), scale, max_query_len=8, max_seq_len=29, out=out, config=config, **tree)
    ref = paged_attention_ref(*batch.args(), scale, **tree)
    plain = paged_attention_ref(*batch.args(), scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-2)
    assert not torch.allclose(ref[:8], plain[:8]), "the tree mask changed what the nodes see"
    with pytest.raises(ValueError, match="go together"):
        paged_attention(*batch.args(), scale, max_query_len=8, max_seq_len=29, tree_mask=tree["tree_mask"])


def test_prefill_default_config_and_heuristics() -> None:
    batch = make_batch([7, 1, 20], [30, 16, 20], 4, 2, 32, 8, torch.float16)
    check_attention(batch)  # default (prefill) config, heuristic splits


@pytest.mark.parametrize("l2_kib", [1, 40, 1024])
def test_prefill_program_order_head_groups(l2_kib: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 kv heads, 70 keys (8.75 KiB of K/V per head): the L2 size picks 1, 2 or 4 interleaved heads per program
    # group; every (head, tile) must be covered exactly once in each order, splits included
    import tokenmill.kernels.paged_attention as pa

    batch = make_batch([30, 1, 45], [70, 16, 45], 8, 4, 32, 16, torch.float16)
    kv_per_head = 70 * 32 * 2 * 2
    hg = pa.choose_heads_per_group(4, kv_per_head, l2_kib << 10, one_tile=False)
    assert hg == {1: 1, 40: 2, 1024: 4}[l2_kib]
    monkeypatch.setattr(pa, "_l2_bytes", lambda device: l2_kib << 10)
    for num_splits in (1, 2):
        check_attention(batch, num_splits=num_splits, config=SMALL)


def test_choose_heads_per_group() -> None:
    from tokenmill.kernels.paged_attention import choose_heads_per_group

    l2 = 50 << 20  # H200: one 4k-token sequence's K/V (2 MiB per head) fits 8 heads, 16k tokens (8 MiB) 2
    assert choose_heads_per_group(8, 2 << 20, l2, one_tile=False) == 8
    assert choose_heads_per_group(8, 8 << 20, l2, one_tile=False) == 2
    assert choose_heads_per_group(8, 64 << 20, l2, one_tile=False) == 1
    assert choose_heads_per_group(6, 1, l2, one_tile=False) == 2  # a power of two that divides Hkv
    assert choose_heads_per_group(8, 1, l2, one_tile=True) == 1  # decode: head-major


def test_deep_tile_out_of_shared_memory_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # a device that reports room for the deep tiles but whose compile needs more (another Triton version): the
    # launch raises OutOfResources, the call completes with the shallow tile, and later calls skip the deep one
    from triton.runtime.errors import OutOfResources

    import tokenmill.kernels.paged_attention as pa

    real = pa._paged_attn_kernel_dyn  # a batch with prompt tokens: the family without per-step int specialization
    stages: list[int] = []

    class TooDeep:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                stages.append(kwargs["num_stages"])
                if kwargs["num_stages"] >= 5:
                    raise OutOfResources(240_000, 232_448, "shared memory")
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(pa, "_shared_limit", lambda device: 232_448)
    monkeypatch.setattr(pa, "_paged_attn_kernel_dyn", TooDeep())
    monkeypatch.setattr(pa, "_NO_DEEP_TILES", set())
    batch = make_batch([300, 1], [320, 20], 8, 2, 32, 16, torch.float16)
    assert pa.default_config(300, 301, 2, 4, 2, 32, 232_448) is pa.PREFILL_CONFIG_DEEP  # what the call first picks
    check_attention(batch)
    assert stages == [5, 3] and {batch.q.device} == pa._NO_DEEP_TILES
    check_attention(batch)
    assert stages == [5, 3, 3]
    with pytest.raises(OutOfResources):  # an explicit config is the caller's: no fallback
        check_attention(batch, config=pa.PREFILL_CONFIG_DEEP)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window: int) -> None:
    batch = make_batch([1, 6, 12, 1], [17, 40, 12, 50], 4, 2, 32, 8, torch.float32)
    check_attention(batch, sliding_window=window, num_splits=2, config=SMALL)


def test_sliding_window_decode_split() -> None:
    # seq 55: the oldest visible key (55 - 40 = 15) is the last key of a BLOCK_N tile
    batch = make_batch([1, 1, 1], [100, 37, 55], 4, 1, 32, 16, torch.float16)
    check_attention(batch, sliding_window=40, num_splits=3, config=SMALL)


@pytest.mark.parametrize("num_splits", [4, 7])
def test_split_k_decode_many_partitions(num_splits: int) -> None:
    # more splits than key blocks of the short request: empty segments must not disturb the reduction
    batch = make_batch([1, 1, 1], [200, 3, 65], 8, 2, 64, 16, torch.float16)
    check_attention(batch, num_splits=num_splits, config=SMALL)


def test_split_reduce_head_dim_chunks() -> None:
    # one decode row x 2 heads = 2 reduce rows on the interpreter's 4 "SMs": the reduce kernel splits head_dim 64
    # into 4 programs of 16 dims each
    batch = make_batch([1], [150], 2, 1, 64, 16, torch.float16)
    check_attention(batch, num_splits=5, config=SMALL)


def test_decode_with_multi_token_tile() -> None:
    # max_query_len <= BLOCK_Q: one tile per request (speculative-decoding-like 2..4-token queries)
    batch = make_batch([2, 4, 1], [9, 20, 33], 4, 1, 32, 8, torch.float32)
    check_attention(batch, config=SMALL)  # BLOCK_Q = 16 // 4 = 4 >= max_query_len


def test_query_len_equals_context_tiles() -> None:
    # whole prompts (no prefix) of lengths around tile edges, MQA
    batch = make_batch([16, 15, 33], [16, 15, 33], 4, 1, 32, 16, torch.float32)
    check_attention(batch, config=SMALL32)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    layout=st.sampled_from([(4, 4), (4, 2), (8, 2), (6, 2), (4, 1)]),
    head_dim=st.sampled_from([16, 32]),
    block_size=st.sampled_from([8, 16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    num_splits=st.one_of(st.none(), st.integers(1, 5)),
    config=st.sampled_from([None, SMALL, SMALL32]),
)
def test_attention_random_batches(
    data: st.DataObject,
    layout: tuple[int, int],
    head_dim: int,
    block_size: int,
    window: int | None,
    num_splits: int | None,
    config: PagedAttentionConfig | None,
) -> None:
    num_seqs = data.draw(st.integers(1, 4))
    seq_lens = data.draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    query_lens = [data.draw(st.integers(1, min(s, 24))) for s in seq_lens]
    batch = make_batch(query_lens, seq_lens, layout[0], layout[1], head_dim, block_size, torch.float32,
                       seed=data.draw(st.integers(0, 1000)))  # fmt: skip
    check_attention(batch, sliding_window=window, num_splits=num_splits, config=config)


def test_attention_is_sensitive_to_cache_contents() -> None:
    # guards the test harness: changing one visible key changes the output of the querying row
    batch = make_batch([1], [20], 4, 2, 32, 16, torch.float32)
    scale = 32**-0.5
    before = run_attention(batch, scale).clone()
    blk = int(batch.block_tables[0, 0])
    batch.k_cache[blk, 3] += 5.0
    after = run_attention(batch, scale)
    assert (before - after).abs().max() > 1e-3


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_request_without_context(num_splits: int) -> None:
    # a padded decode row (seq_len 0, one query token) must yield finite zeros, not NaN, and leave the
    # real requests alone
    batch = make_batch([1, 1], [20, 33], 4, 2, 32, 16, torch.float32)
    ref = paged_attention_ref(*batch.args(), 32**-0.5)
    q = torch.cat([batch.q, batch.q[:1]])
    seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(1)])
    qsl = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:] + 1])
    bt = torch.cat([batch.block_tables, batch.block_tables[:1]])
    out = torch.full_like(q, float("nan"))
    paged_attention(q, batch.k_cache, batch.v_cache, bt, seq_lens, qsl, 32**-0.5, max_query_len=1,
                    max_seq_len=33, out=out, num_splits=num_splits)  # fmt: skip
    torch.testing.assert_close(out[:2], ref, atol=1e-4, rtol=1e-3)
    assert (out[2] == 0).all()


def test_attention_empty_batch() -> None:
    batch = make_batch([1], [4], 4, 2, 32, 16, torch.float32)
    q = batch.q[:0]
    qsl = torch.zeros(2, dtype=torch.int32, device=DEV)  # one request with no query tokens
    out = paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, qsl, 1.0,
                          max_query_len=1, max_seq_len=4)  # fmt: skip
    assert out.shape == (0, 4, 32)


def test_attention_strided_q() -> None:
    # q as a view of a fused qkv projection: token stride != Hq * D
    batch = make_batch([3, 1], [10, 17], 4, 2, 32, 8, torch.float32)
    qkv = torch.randn(batch.q.shape[0], (4 + 2 * 2) * 32, device=DEV)
    qkv[:, : 4 * 32] = batch.q.reshape(batch.q.shape[0], -1)
    batch.q = qkv[:, : 4 * 32].view(-1, 4, 32)
    assert not batch.q.is_contiguous()
    check_attention(batch, config=SMALL)


def test_heuristic_splits_short_and_long_context() -> None:
    # A CUDA graph launches for max_model_len: max_seq_len far above the real lengths, so the split count
    # is sized for keys most requests do not have; short and long requests must both come out right
    # (segments past a request's keys are empty and must not disturb the reduce).
    batch = make_batch([1, 1, 1], [20, 600, 257], 4, 2, 32, 16, torch.float32)
    scale = 32**-0.5
    assert choose_num_splits(3 * 2, 4096, 4, 64) > 1 or DEV == "cuda"
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(*batch.args(), scale, max_query_len=1, max_seq_len=4096, out=out)
    ref = paged_attention_ref(*batch.args(), scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-3)


def test_choose_num_splits() -> None:
    assert choose_num_splits(8, 32768, 132, 64) > 16  # batch 1 at 32k with 8 kv heads fills the GPU
    assert choose_num_splits(128 * 8, 4096, 132, 64) == 1  # enough programs already
    assert choose_num_splits(8, 100, 132, 64) == 1  # too short to split
    s = choose_num_splits(8, 1024, 132, 64)
    assert 1 <= s <= 1024 // 256


def _good_args() -> tuple[Batch, dict[str, int]]:
    return make_batch([1, 2], [5, 9], 4, 2, 32, 8, torch.float32), {"max_query_len": 2, "max_seq_len": 9}


@pytest.mark.parametrize(
    "mutate",
    [
        "q_dtype",
        "q_2d",
        "cache_dtype",
        "bt_int64",
        "seq_lens_int64",
        "qsl_short",
        "head_dim_mismatch",
        "heads_not_multiple",
        "q_last_dim_strided",
        "out_wrong_shape",
        "window_zero",
        "max_query_len_zero",
    ],
)
def test_attention_launcher_rejects_bad_input(mutate: str) -> None:
    batch, kw = _good_args()
    q, kc, vc, bt, sl, qsl = batch.args()
    extra: dict[str, object] = {}
    if mutate == "q_dtype":
        q = q.half()
    elif mutate == "q_2d":
        q = q.reshape(q.shape[0], -1)
    elif mutate == "cache_dtype":
        kc, vc = kc.half(), vc.half()
    elif mutate == "bt_int64":
        bt = bt.long()
    elif mutate == "seq_lens_int64":
        sl = sl.long()
    elif mutate == "qsl_short":
        qsl = qsl[:-1]
    elif mutate == "head_dim_mismatch":
        q = q[..., :16]
    elif mutate == "heads_not_multiple":
        q = torch.cat([q, q[:, :1]], dim=1)
    elif mutate == "q_last_dim_strided":
        q = torch.randn(q.shape[0], q.shape[1], q.shape[2] * 2, device=DEV)[..., ::2]
    elif mutate == "out_wrong_shape":
        extra["out"] = torch.empty(q.shape[0], q.shape[1], 16, device=DEV)
    elif mutate == "window_zero":
        extra["sliding_window"] = 0
    elif mutate == "max_query_len_zero":
        kw["max_query_len"] = 0
    with pytest.raises(ValueError):
        paged_attention(q, kc, vc, bt, sl, qsl, 1.0, **kw, **extra)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# KV-cache write, rotary
# ---------------------------------------------------------------------------------------------------


def _kv_inputs(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device = DEV
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v as strided views of one fused buffer [T, (Hq + 2 Hkv) * D] with Hq = 2 Hkv."""
    width = 4 * num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, width, device=device).to(dtype)
    kv = qkv[:, 2 * num_kv_heads * head_dim :]
    k = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    return qkv, k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 64, 16), (3, 32, 8), (1, 128, 32)])
def test_write_kv_cache(dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    num_tokens, num_blocks = 11, 5
    _, k, v = _kv_inputs(num_tokens, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1
    slot_mapping = slots.to(DEV)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc, vc = (
        torch.full(shape, float("nan"), dtype=dtype, device=DEV),
        torch.full(shape, 7.0, dtype=dtype, device=DEV),
    )
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache(k, v, kc, vc, slot_mapping)
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slot_mapping)
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, rtol=0, atol=0)
    assert int((~kc.isnan()).all(-1).all(-1).sum()) == num_tokens - 2  # skipped slots untouched


def test_write_kv_cache_rejects_bad_input() -> None:
    _, k, v = _kv_inputs(4, 2, 32, torch.float32)
    kc = torch.zeros(3, 16, 2, 32, device=DEV)
    good = torch.arange(4, device=DEV)
    with pytest.raises(ValueError):
        write_kv_cache(k, v, kc.half(), kc.half(), good)
    with pytest.raises(ValueError):
        write_kv_cache(k, v, kc, kc, good[:3])
    with pytest.raises(ValueError):
        write_kv_cache(k, v, kc, kc, good.float())
    with pytest.raises(ValueError):
        write_kv_cache(k, v, kc[:, :, :1], kc[:, :, :1], good)


def _hf_rotate(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF Llama apply_rotary_pos_emb (fp32 here): x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    half = x.shape[-1] // 2
    cos = cos_sin[positions, :half].repeat(1, 2)[:, None, :]
    sin = cos_sin[positions, half:].repeat(1, 2)[:, None, :]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_inputs(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, device=DEV).to(dtype)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 512, (num_tokens,), device=DEV)
    return q, k, v, _rope_table(head_dim, DEV), positions


def _rope_table(head_dim: int, device: torch.device, max_position: int = 512) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    return cos_sin_cache_from_inv_freq(inv_freq, max_position)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 32), (2, 2, 128)])
def test_rotary_embedding(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    q, k, _, cos_sin, positions = _rope_inputs(9, num_q_heads, num_kv_heads, head_dim, dtype)
    q_ref, k_ref = rotary_embedding_ref(q, k, cos_sin, positions)
    q_hf = _hf_rotate(q.float(), cos_sin, positions)
    torch.testing.assert_close(q_ref.float(), q_hf, atol=2e-3 if dtype != torch.float32 else 1e-5, rtol=1e-2)
    q_out, k_out = rotary_embedding(q, k, cos_sin, positions)  # in place
    assert q_out is q and k_out is k
    tol = _tol(dtype, 2e-3, 1e-3)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotary_and_cache(dtype: torch.dtype) -> None:
    num_tokens, num_blocks, block_size = 10, 4, 8
    q, k, v, cos_sin, positions = _rope_inputs(num_tokens, 4, 2, 64, dtype)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEV)
    slot_mapping[3] = -1
    shape = (num_blocks, block_size, 2, 64)
    kc = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    vc = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref, k_ref = rotary_embedding_ref(q, k, cos_sin, positions)
    write_kv_cache_ref(k_ref, v, kc_ref, vc_ref, slot_mapping)
    rotary_and_cache(q, k, v, cos_sin, positions, kc, vc, slot_mapping)
    tol = _tol(dtype, 2e-3, 1e-3)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, **tol)
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, rtol=0, atol=0)
    assert int((~kc.isnan()).all(-1).all(-1).sum()) == num_tokens - 1


# ---------------------------------------------------------------------------------------------------
# RMSNorm, SwiGLU
# ---------------------------------------------------------------------------------------------------


def _hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, verbatim semantics."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 100, 20000])  # 20000 > single-pass limit: two-pass loop
def test_rmsnorm(dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(5, hidden, device=DEV).to(dtype) * 3
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    out = rmsnorm(x, w, 1e-6)
    ref = rmsnorm_ref(x, w, 1e-6)
    tol = _tol(dtype, 2e-3, 2e-3)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(ref, _hf_rmsnorm(x, w, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [96, 20000])
def test_add_rmsnorm(dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(4, hidden, device=DEV).to(dtype)
    r = torch.randn(4, hidden, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    out, new_r = add_rmsnorm(x, r, w, 1e-5)
    out_ref, r_ref = add_rmsnorm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(new_r, (x + r), rtol=0, atol=0)  # HF: residual + hidden in model dtype
    torch.testing.assert_close(new_r, r_ref, rtol=0, atol=0)
    tol = _tol(dtype, 2e-3, 2e-3)
    torch.testing.assert_close(out, out_ref, **tol)


def test_rmsnorm_3d_strided() -> None:
    # per-head q-norm (Qwen3): [T, H, D] view of a fused qkv buffer
    qkv = torch.randn(6, 10 * 32, device=DEV)
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    w = torch.randn(32, device=DEV)
    torch.testing.assert_close(rmsnorm(q, w, 1e-6), rmsnorm_ref(q, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_rmsnorm_rejects_bad_input() -> None:
    x = torch.randn(4, 64, device=DEV)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(32, device=DEV), 1e-6)
    with pytest.raises(ValueError):
        rmsnorm(x.t(), torch.ones(4, device=DEV), 1e-6)
    with pytest.raises(ValueError):
        add_rmsnorm(x, x.half(), torch.ones(64, device=DEV), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("inter", [64, 1500])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    x = (torch.randn(7, 2 * inter, device=DEV) * 4).to(dtype)
    out = torch.full((7, inter), float("nan"), dtype=dtype, device=DEV)
    silu_and_mul(x, out=out)
    tol = _tol(dtype, 2e-3, 2e-3)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **tol)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), gate * torch.sigmoid(gate) * up, **tol)
    with pytest.raises(ValueError):
        silu_and_mul(x[:, :-1])


# ---------------------------------------------------------------------------------------------------
# Triton backend vs torch reference backend
# ---------------------------------------------------------------------------------------------------


def _backend_case(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device = DEV,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step: the context before it is already cached; the step's k/v come separately (slot_mapping points
    at their positions). One extra token has slot -1 (a padded token must not be written)."""
    batch = make_batch(query_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                       device=device)  # fmt: skip
    num_tokens = sum(query_lens)
    gen = torch.Generator(device=device).manual_seed(1)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen, device=device).to(dtype)
    v = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen, device=device).to(dtype)
    slots = []
    bt = batch.block_tables.cpu()
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(sl - ql, sl):
            slots.append(int(bt[i, pos // block_size]) * block_size + pos % block_size)
    # new tokens' slots are poisoned before the step, so a missing write shows up as NaN
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    batch.k_cache.view(-1, num_kv_heads, head_dim)[slot_t] = float("nan")
    batch.v_cache.view(-1, num_kv_heads, head_dim)[slot_t] = float("nan")
    meta = attention_metadata(list(query_lens), list(seq_lens), bt.tolist(), slots, device)
    return batch.q, k, v, batch.k_cache, batch.v_cache, meta


def _layer_and_positions(
    q: torch.Tensor, meta: AttentionMetadata, window: int | None
) -> tuple[AttentionLayer, torch.Tensor]:
    """A layer with a real rotary table, and the positions [T] of the step's tokens (from the host lists)."""
    positions = [p for ql, sl in zip(meta.query_lens_cpu, meta.seq_lens_cpu) for p in range(sl - ql, sl)]
    table = _rope_table(q.shape[-1], q.device, max(meta.seq_lens_cpu))
    return AttentionLayer(q.shape[-1] ** -0.5, window, table), torch.tensor(positions, device=q.device)


def _compare_backends(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata],
    window: int | None,
    tol: float,
) -> None:
    torch_ref = pytest.importorskip("tokenmill.worker.attention.torch_ref")
    q, k, v, kc, vc, meta = case
    kc2, vc2 = kc.clone(), vc.clone()
    layer, positions = _layer_and_positions(q, meta, window)
    out = TritonBackend().forward(layer, q.clone(), k.clone(), v, positions, (kc, vc), meta)  # may rotate in place
    ref = torch_ref.TorchRefBackend().forward(layer, q, k, v, positions, (kc2, vc2), meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    # rotated k: one rounding each, so at most one unit in the last place apart (bf16: 2**-7 relative)
    ulp = 2e-3 if kc.dtype != torch.bfloat16 else 8e-3
    torch.testing.assert_close(kc, kc2, equal_nan=True, rtol=ulp, atol=ulp)
    torch.testing.assert_close(vc, vc2, equal_nan=True, rtol=0, atol=0)
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("query_lens", [[3, 1, 12], [1, 1, 1]])  # mixed, and decode-only (rotary in attention)
def test_triton_backend_matches_torch_ref(window: int | None, query_lens: list[int]) -> None:
    case = _backend_case(query_lens, [10, 17, 12], 4, 2, 32, 8, torch.float16)
    _compare_backends(case, window, 2e-3)


def test_triton_backend_does_not_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # .item() / .tolist() on a device tensor would be a host sync; the backend must not call them
    q, k, v, kc, vc, meta = _backend_case([1, 1], [9, 17], 4, 2, 32, 8, torch.float32)
    layer, positions = _layer_and_positions(q, meta, None)
    q_rot, _ = rotary_embedding_ref(q, k, layer.cos_sin_cache, positions)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in TritonBackend.forward")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    out = TritonBackend().forward(layer, q, k, v, positions, (kc, vc), meta)
    monkeypatch.undo()
    ref = paged_attention_ref(q_rot, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, layer.scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------
# ahead-of-time compile for Hopper (sm_90) on a CPU-only machine: catches GPU-only compile errors and
# checks the prefill path uses wgmma and the attention loops are software-pipelined (async copies)
# ---------------------------------------------------------------------------------------------------


def _sm90_compile_all() -> None:
    """Run in a subprocess with TRITON_INTERPRET=0 (kernels must be decorated as real JIT functions)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    import tokenmill.kernels.activation as act
    import tokenmill.kernels.kv_cache as kvc
    import tokenmill.kernels.paged_attention as pa
    import tokenmill.kernels.rmsnorm as rn
    import tokenmill.kernels.rotary as rot

    target = GPUTarget("cuda", 90, 32)
    built_shared: list[int] = []  # shared memory of each kernel built, in order

    def build(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], num_warps: int, num_stages: int) -> str:
        names = list(fn.arg_names)
        consts = {"PDL": True, **consts}  # the PDL protocol (kernels/launch.py) is checked in the PTX below
        signature = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
        for n in ("qk_scale", "eps"):
            if n in signature:
                signature[n] = "fp32"
        constexprs = {(names.index(k),): v for k, v in consts.items()}
        aligned = [n for n in names if (n.endswith("_ptr") or n.startswith("stride_")) and n not in consts]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        kernel = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                options={"num_warps": num_warps, "num_stages": num_stages,
                                         "launch_pdl": True})  # fmt: skip
        built_shared.append(int(kernel.metadata.shared))
        ptx = str(kernel.asm["ptx"])
        wait, release = ptx.find("griddepcontrol.wait"), ptx.rfind("griddepcontrol.launch_dependents")
        first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i > -1)
        assert -1 < wait < first_load and ptx.rfind("st.global") < release, (fn.__name__, consts)
        return str(kernel.asm["ttgir"])

    def attention(dt: str, group: int, head_dim: int, block_m: int, split: bool, one_tile: bool, window: bool,
                  num_warps: int, num_stages: int, rope: bool = False, block_n: int = 64, fp8: bool = False,
                  tree: bool = False) -> str:  # fmt: skip
        gpad = 1 << (group - 1).bit_length()
        ptrs = {n: f"*{dt}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "kn_ptr", "vn_ptr")}
        ptrs |= {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "kvs_ptr": "*fp32"} if fp8 else {}
        ptrs |= {n: "*i32" for n in ("bt_ptr", "seq_lens_ptr", "qsl_ptr")}
        ptrs |= {"cs_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"}
        ptrs |= {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}
        ptrs |= {"tree_mask_ptr": "*i64", "tree_start_ptr": "*i32"}
        consts = {"GROUP": group, "GROUP_PAD": gpad, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "BLOCK_M": block_m,
                  "BLOCK_Q": block_m // gpad, "BLOCK_N": block_n, "SPLIT": split, "ONE_TILE_PER_SEQ": one_tile,
                  "USE_WINDOW": window, "DOT_PRECISION": "tf32", "FUSE_ROPE": rope, "KV_FP8": fp8,
                  "TREE": tree}  # fmt: skip
        consts |= {"stride_vd": 1}  # the JIT makes a stride of 1 a constant (new_kv_cache: V contiguous in D)
        return build(pa._paged_attn_kernel, ptrs, consts, num_warps, num_stages)

    cfg_d, cfg_p = pa.DECODE_CONFIG, pa.PREFILL_CONFIG
    for rope in (False, True):
        decode = attention("bf16", 4, 128, cfg_d.block_m, True, True, False, cfg_d.num_warps, cfg_d.num_stages, rope)
        # (the decode config's two stages compile without async copies; measured faster on the H200 than three)
        assert "async_copy_global_to_local" in decode or cfg_d.num_stages <= 2, "decode loop is not pipelined"
    prefill = attention("bf16", 4, 128, cfg_p.block_m, False, False, False, cfg_p.num_warps, cfg_p.num_stages)
    assert "warp_group_dot" in prefill, "prefill does not use wgmma"
    assert "async_copy_global_to_local" in prefill, "prefill loop is not pipelined"
    for deep in (pa.PREFILL_CONFIG_DEEP, pa.LONG_PREFILL_CONFIG_DEEP):
        ttgir = attention("bf16", 4, 128, deep.block_m, False, False, False, deep.num_warps, deep.num_stages,
                          block_n=deep.block_n)
        # K/V kept two iterations ahead: three buffers, and the wait at the top of the loop leaves copies in flight
        assert f"memdesc<3x{deep.block_n}x128xbf16" in ttgir and "{num = 3 : i32}" in ttgir, deep
        shared = built_shared[-1]
        assert shared <= pa.shared_bytes(deep, 128, 2) + pa._SHARED_MARGIN <= 232_448, (deep, shared)
    attention("fp16", 3, 64, cfg_p.block_m, True, False, True, cfg_p.num_warps, cfg_p.num_stages)
    for rope in (False, True):  # FP8 KV cache (e4m3 loads, scales): decode split with and without rope, prefill
        attention("bf16", 4, 128, cfg_d.block_m, True, True, False, cfg_d.num_warps, cfg_d.num_stages, rope, fp8=True)
    ttgir = attention("bf16", 4, 128, cfg_p.block_m, False, False, False, cfg_p.num_warps, cfg_p.num_stages, fp8=True)
    assert "warp_group_dot" in ttgir and "async_copy_global_to_local" in ttgir, "fp8 prefill: wgmma, pipelined"
    attention("bf16", 1, 64, cfg_d.block_m, False, True, True, cfg_d.num_warps, cfg_d.num_stages)
    ttgir = attention("bf16", 4, 128, cfg_p.block_m, True, False, False, cfg_p.num_warps, cfg_p.num_stages, tree=True)
    assert "warp_group_dot" in ttgir, "tree drafts' prefill (split): wgmma"
    f32 = {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*bf16"}
    build(pa._reduce_splits_kernel, f32, {"SPLITS_PAD": 64, "HEAD_DIM": 128, "BLOCK_D": 16}, 4, 1)
    bf = dict.fromkeys(("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "q_ptr", "x_ptr", "res_ptr", "w_ptr",
                        "out_ptr", "res_out_ptr"), "*bf16")  # fmt: skip
    bf |= {"slot_ptr": "*i64", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32"}
    fp8 = bf | {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}
    for kv_fp8 in (False, True):
        ptrs = fp8 if kv_fp8 else bf
        kv_consts = {"BLOCK_SIZE": 16, "HEADS_PAD": 8, "DIM_PAD": 128, "KV_FP8": kv_fp8}
        build(kvc._write_kv_cache_kernel, ptrs, kv_consts, 4, 1)
        rot_consts = {"QHEADS_PAD": 32, "KHEADS_PAD": 8, "HALF_PAD": 64, "BLOCK_SIZE": 16, "WRITE_CACHE": True,
                      "KV_FP8": kv_fp8}
        build(rot._rotary_kernel, ptrs, rot_consts, 4, 1)
    for single in (True, False):
        for residual in (True, False):
            consts = {"HAS_RESIDUAL": residual, "BLOCK": 4096, "SINGLE_PASS": single}
            build(rn._rmsnorm_kernel, bf, consts, 8, 1)
    build(act._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, {"BLOCK": 1024}, 4, 1)


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path: Any) -> None:
    run_sm90_compile("test_kernels", "_sm90_compile_all", tmp_path)


# ---------------------------------------------------------------------------------------------------
# GPU tests (bf16, realistic shapes)
# ---------------------------------------------------------------------------------------------------

GPU_TOL = 1e-2


def _gpu_check(batch: Batch, window: int | None = None, num_splits: int | None = None) -> None:
    scale = batch.q.shape[-1] ** -0.5
    out = run_attention(batch, scale, sliding_window=window, num_splits=num_splits)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten (NaN) outputs"
    ref = paged_attention_ref(*batch.args(), scale, sliding_window=window)
    err = rel_err(out, ref)
    assert err < GPU_TOL, f"relative error {err:.3e}"


@gpu
@needs_cuda
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (32, 8, 64), (16, 16, 128)])
def test_gpu_decode_batch64(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1024, 8193, (64,), generator=gen).tolist()
    seq_lens[:4] = [1024, 8192, 1025, 4095]
    batch = make_batch([1] * 64, seq_lens, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16)
    _gpu_check(batch)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_gpu_decode_long_context_split(num_splits: int | None) -> None:
    batch = make_batch([1, 1], [32768, 20001], 32, 8, 128, 16, torch.bfloat16)
    _gpu_check(batch, num_splits=num_splits)


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_prefill_chunk_with_prefix(head_dim: int) -> None:
    # a 512-token chunk after a 2k prefix, batched with decodes and a fresh prompt
    batch = make_batch([512, 1, 1, 300], [2560, 3000, 17, 300], 32, 8, head_dim, 16, torch.bfloat16)
    _gpu_check(batch)


@gpu
@needs_cuda
def test_gpu_prefill_long_single_sequence() -> None:
    batch = make_batch([4096], [4096], 32, 8, 128, 16, torch.bfloat16)
    _gpu_check(batch)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [8, 32])
def test_gpu_sliding_window_and_block_sizes(block_size: int) -> None:
    batch = make_batch([1, 700, 1], [5000, 1500, 100], 32, 8, 128, block_size, torch.bfloat16)
    _gpu_check(batch, window=1024)


@gpu
@needs_cuda
def test_gpu_fp16_and_fp32() -> None:
    for dtype in (torch.float16, torch.float32):
        batch = make_batch([1, 200, 1], [3000, 1200, 513], 32, 8, 128, 16, dtype)
        _gpu_check(batch)


@gpu
@needs_cuda
def test_gpu_small_kernels_bf16() -> None:
    dtype = torch.bfloat16
    x = torch.randn(333, 4096, device=DEV, dtype=dtype)
    r = torch.randn(333, 4096, device=DEV, dtype=dtype)
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(dtype)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), atol=2e-2, rtol=1e-2)
    out, new_r = add_rmsnorm(x, r, w, 1e-5)
    out_ref, r_ref = add_rmsnorm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(new_r, r_ref, rtol=0, atol=0)
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=1e-2)
    g = torch.randn(333, 2 * 14336, device=DEV, dtype=dtype)
    torch.testing.assert_close(silu_and_mul(g), silu_and_mul_ref(g), atol=2e-2, rtol=1e-2)
    q, k, v, cos_sin, positions = _rope_inputs(77, 32, 8, 128, dtype)
    kc = torch.full((20, 16, 8, 128), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.randperm(320, device=DEV)[:77]
    q_ref, k_ref = rotary_embedding_ref(q, k, cos_sin, positions)
    write_kv_cache_ref(k_ref, v, kc_ref, vc_ref, slots)
    rotary_and_cache(q, k, v, cos_sin, positions, kc, vc, slots)
    torch.testing.assert_close(q, q_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(kc, kc_ref, atol=2e-2, rtol=1e-2, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)
    kc2, vc2 = kc.clone().fill_(float("nan")), vc.clone().fill_(float("nan"))
    write_kv_cache(k, v, kc2, vc2, slots)
    kc3, vc3 = kc2.clone().fill_(float("nan")), vc2.clone().fill_(float("nan"))
    write_kv_cache_ref(k, v, kc3, vc3, slots)
    torch.testing.assert_close(kc2, kc3, atol=0, rtol=0, equal_nan=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 256])
def test_gpu_triton_backend_matches_torch_ref(window: int | None) -> None:
    case = _backend_case([1] * 30 + [512, 100], [1500] * 30 + [2560, 100], 32, 8, 128, 16, torch.bfloat16)
    _compare_backends(case, window, GPU_TOL)


def test_default_config_by_batch_shape() -> None:
    import tokenmill.kernels.paged_attention as pa
    from tokenmill.kernels.paged_attention import (
        DECODE_CONFIG,
        FP32_PREFILL_CONFIG,
        LONG_PREFILL_CONFIG,
        LONG_PREFILL_CONFIG_DEEP,
        MIXED_CONFIG,
        PREFILL_CONFIG,
        PREFILL_CONFIG_DEEP,
        default_config,
    )

    assert default_config(1, 64, 64, 4, 2) is DECODE_CONFIG  # decode-only
    assert default_config(1, 64, 64, 4, 2, kv_fp8=True) is pa.FP8_DECODE_CONFIG  # over fp8 caches: registers capped
    assert default_config(2048, 2048, 1, 4, 2, kv_fp8=True) is PREFILL_CONFIG
    fp8 = pa.attention_choice((8, 32, 128), torch.bfloat16, (64, 16, 8, 128), torch.device("cpu"), 8, max_query_len=1,
                              max_seq_len=100, kv_dtype=torch.float8_e4m3fn)
    assert fp8.config is pa.FP8_DECODE_CONFIG and fp8.config.maxnreg == 128
    with pytest.raises(ValueError, match="maxnreg"):
        pa.PagedAttentionConfig(16, 64, 4, 2, maxnreg=300)
    assert default_config(2048, 2048, 1, 4, 2) is PREFILL_CONFIG  # one long prompt
    assert default_config(4096, 4096, 1, 4, 2) is LONG_PREFILL_CONFIG  # one very long prompt (GQA group 4)
    assert default_config(8192, 16384, 2, 4, 2) is LONG_PREFILL_CONFIG
    assert default_config(4096, 6144, 2, 4, 2) is PREFILL_CONFIG  # mean query run below 4k
    assert default_config(8192, 8192, 1, 8, 2) is PREFILL_CONFIG  # unmeasured group shape: the 128-row tile
    assert default_config(1000, 1500, 501, 4, 2) is MIXED_CONFIG  # 500 decodes beside one prompt
    # fixed_config (the draft head's eager launches): the same tile however long the rows, whatever the batch
    assert pa.fixed_config(1, 4, 2) is pa.fixed_config(4, 4, 2) is DECODE_CONFIG  # 4 rows x group 4 fill 16
    assert pa.fixed_config(5, 4, 2) is pa.fixed_config(8192, 4, 2) is MIXED_CONFIG
    assert pa.fixed_config(8192, 4, 4) is FP32_PREFILL_CONFIG
    assert default_config(8192, 8192, 1, 4, 4) is FP32_PREFILL_CONFIG  # the large tile does not fit in fp32
    # deep pipelines where the shared memory allows: Hopper (227 KB) takes both, A100 (163 KB) only the 256-row
    # tile, head_dim 64 halves the need; the interpreter / unknown devices (0) keep the shallow ones
    hopper, a100 = 232_448, 166_912
    assert default_config(2048, 2048, 1, 4, 2, 128, hopper) is PREFILL_CONFIG_DEEP
    assert default_config(4096, 4096, 1, 4, 2, 128, hopper) is LONG_PREFILL_CONFIG_DEEP
    assert default_config(2048, 2048, 1, 4, 2, 128, a100) is PREFILL_CONFIG
    assert default_config(4096, 4096, 1, 4, 2, 128, a100) is LONG_PREFILL_CONFIG_DEEP
    assert default_config(2048, 2048, 1, 4, 2, 64, a100) is PREFILL_CONFIG_DEEP
    assert default_config(1, 64, 64, 4, 2, 128, hopper) is DECODE_CONFIG
    assert default_config(1000, 1500, 501, 4, 2, 128, hopper) is MIXED_CONFIG


def test_pdl_only_on_hopper_cuda() -> None:
    """Programmatic dependent launch is never asked for off CUDA (the interpreter has no griddepcontrol) and
    KernelConfig(pdl=False) turns it off (configure drops the per-device decision); the kernels' PDL constexpr
    is then False."""
    from tokenmill.kernels.config import KernelConfig, configure, current
    from tokenmill.kernels.launch import pdl_launch_args

    assert current() == KernelConfig() and current().pdl  # the default, as before the config existed
    assert pdl_launch_args(torch.device("cpu")) == {"PDL": False}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        want = torch.cuda.get_device_capability(dev) >= (9, 0)
        assert pdl_launch_args(dev) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})
        try:
            configure(KernelConfig(pdl=False))
            assert pdl_launch_args(dev) == {"PDL": False}
        finally:
            configure(KernelConfig())
        assert pdl_launch_args(dev) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})


def _decode_rope_case(
    seq_lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, num_splits: int | None
) -> None:
    """paged_attention(rope=...) == rotary_and_cache + paged_attention: output, both caches (incl. the slot
    -1 request, whose cache is left alone), and q / k left un-rotated in memory."""
    from tokenmill.kernels.paged_attention import DecodeRope

    batch = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs, dtype)
    gen = torch.Generator(device=DEV).manual_seed(5)
    n = len(seq_lens)
    k = torch.randn((n, hkv, d), generator=gen, device=DEV).to(dtype)
    v = torch.randn((n, hkv, d), generator=gen, device=DEV).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=DEV) / d))
    cos_sin = cos_sin_cache_from_inv_freq(inv_freq, max(seq_lens) + 1)
    positions = torch.tensor([s - 1 for s in seq_lens], device=DEV)
    bt = batch.block_tables.cpu()
    slots = torch.tensor([int(bt[i, (s - 1) // bs]) * bs + (s - 1) % bs for i, s in enumerate(seq_lens)])
    slots[n // 2] = -1  # not written (e.g. a CUDA-graph padding row)
    slots = slots.to(DEV)
    q0, k0 = batch.q.clone(), k.clone()
    kc_ref, vc_ref = batch.k_cache.clone(), batch.v_cache.clone()
    q_ref = batch.q.clone()
    rotary_and_cache(q_ref, k.clone(), v, cos_sin, positions, kc_ref, vc_ref, slots)
    kw = {"max_query_len": 1, "max_seq_len": max(seq_lens), "num_splits": num_splits}
    scale = d**-0.5
    ref = paged_attention(q_ref, kc_ref, vc_ref, *batch.args()[3:], scale, **kw)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(*batch.args(), scale, out=out, rope=DecodeRope(k, v, cos_sin, positions, slots), **kw)
    tol = _tol(dtype, 2e-3, 1e-3)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(batch.k_cache, kc_ref, equal_nan=True, **tol)
    torch.testing.assert_close(batch.v_cache, vc_ref, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(batch.q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_paged_attention_decode_rope(dtype: torch.dtype, num_splits: int | None) -> None:
    _decode_rope_case([1, 17, 40, 130, 16], 4, 2, 64, 16, dtype, num_splits)


@gpu
@needs_cuda
def test_gpu_paged_attention_decode_rope() -> None:
    _decode_rope_case([1, 17, 4097, 300, 2048, 16, 9000], 32, 8, 128, 16, torch.bfloat16, None)


def test_paged_attention_rope_needs_decode() -> None:
    from tokenmill.kernels.paged_attention import DecodeRope

    batch = make_batch([2, 1], [5, 9], 4, 2, 32, 8, torch.float32)
    k = torch.zeros((3, 2, 32), device=DEV)
    rope = DecodeRope(k, k, torch.zeros((16, 32), device=DEV), torch.zeros(3, dtype=torch.long, device=DEV),
                      torch.zeros(3, dtype=torch.long, device=DEV))  # fmt: skip
    with pytest.raises(ValueError, match="decode"):
        paged_attention(*batch.args(), 1.0, max_query_len=2, max_seq_len=9, rope=rope)
