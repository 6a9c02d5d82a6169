"""Paged attention over block tables for a flattened varlen batch (decode, prefill chunks, mixed).

Layout (see worker/attention/backend.py; plain-torch reference: kernels/attention_ref.py):
    q            [T, Hq, D]                       the step's queries, rows of request i are
                                                  query_start_loc[i]:query_start_loc[i+1]
    k_cache,
    v_cache      [num_blocks, block_size, Hkv, D] paged cache; key at position p of request i lives in
                                                  block block_tables[i, p // block_size], slot p % block_size
    block_tables [B, max_blocks] int32
    seq_lens     [B] int32                        context length incl. this step's tokens
    query_start_loc [B+1] int32

Query j of request i sits at position seq_len_i - query_len_i + j and attends causally to keys at
positions <= its own (and, with a sliding window W, > its own - W).

Kernel structure (one kernel + an optional reduce kernel):
  * A program owns one *tile*: BLOCK_Q consecutive query tokens of one request times the GROUP query heads
    that share one kv head, flattened to BLOCK_M = BLOCK_Q * GROUP_PAD rows (row r = token r // GROUP_PAD,
    head r % GROUP_PAD). K/V blocks are therefore loaded once per kv-head group and both products are
    tl.dot's of [BLOCK_M, D] x [D, BLOCK_N] and [BLOCK_M, BLOCK_N] x [BLOCK_N, D] with fp32 accumulation
    and an online (exp2-based) softmax.
  * Tiles are numbered without a host sync: request i's tiles start at query_start_loc[i] // BLOCK_Q + i,
    so the grid has T // BLOCK_Q + B tile slots (a few are empty) and a program finds its request by a
    binary search over query_start_loc. When every request fits one tile (decode: max_query_len <=
    BLOCK_Q) slot i simply is request i.
  * Program order: prefill runs the heaviest (longest-context) tiles of every kv head first, so the causal tail
    of the last wave is short, interleaving only as many kv heads as keep their K/V within half the L2
    (`choose_heads_per_group`); decode is head-major.
  * Flash-decoding split: grid axis 2 cuts each tile's key range into num_splits segments (aligned to
    BLOCK_N). With num_splits > 1 every program writes its unnormalised partial (acc, running max m,
    running sum l) to fp32 workspaces and `_reduce_splits_kernel` combines them. The host picks
    num_splits from the number of programs vs. the number of SMs (`choose_num_splits`), using only host
    ints (max_query_len, max_seq_len), so no device sync is needed.
  * Each key segment is walked in two loops: keys every row of the tile may see (no masks at all) and the
    rest (the causal diagonal / tail / sliding window), where loads and scores are masked.
  * Decode batches may fold the step's rotary embedding and KV-cache write in (FUSE_ROPE, `rope=DecodeRope`):
    every program rotates its q rows on load; the one program per (request, kv head) whose segment holds the
    token's own key rotates k and stores k and v into the cache before walking its keys (a CTA barrier makes
    the stores visible to its loads). This replaces the rotary kernel of a decode step (one launch fewer per
    layer; the H200 figure is in benchmarks/results/h200/NOTES.md, "Figures behind the code's rules").
  * FP8 KV cache (float8_e4m3fn caches, KV_FP8, kv_scales [2, Hkv] float32): K/V tiles are loaded as e4m3 and
    converted to fp16 in registers (exact; q is converted once, the products run in fp16 with fp32 sums); each
    program's kv head has one K and one V scale, folded into the scores' scale and into the output (or the split
    partials), so the inner loops gain only the conversions. Decode over fp8 caches is latency-bound at half
    the bytes per tile: FP8_DECODE_CONFIG caps registers so that four programs share an SM, as bf16's do.
    The fused decode write rounds as kernels/kv_cache.py (`quantize_e4m3`).
  * Programmatic dependent launch on Hopper (kernels/launch.py): both kernels wait on the previous kernel
    before their first load and release the next one after their last store.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .direct_launch import direct_launcher
from .kv_cache import FP8_KV, check_kv_cache_args, check_kv_scales, check_v_cache_layout, quantize_e4m3
from .launch import l2_bytes as _l2_bytes
from .launch import next_pow2 as _next_pow2
from .launch import num_sms as _num_sms
from .launch import pdl_launch_args, pdl_release, pdl_wait
from .launch import shared_memory_per_program as _shared_limit
from .rotary import check_rotary_args

_LOG2E = 1.4426950408889634
_log = logging.getLogger(__name__)
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class DecodeRope(NamedTuple):
    """Rotary embedding + KV-cache write folded into a decode attention call (`paged_attention(rope=...)`):
    this step's un-rotated k and v [T, Hkv, D], the rotary table [max_pos, D] (cos | sin halves, as
    kernels/rotary.py), positions [T] and the cache slots [T] of k/v (-1: not written). q is rotated on the fly
    and left as it was in memory."""

    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class PagedAttentionConfig:
    """Launch shape of the attention kernel. `block_m` counts rows = query tokens x heads of one kv group
    (it is raised to the padded group size when smaller); block_n counts keys per inner iteration."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # registers per thread at most (ptxas spills beyond): more programs per SM

    def __post_init__(self) -> None:
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"maxnreg must be in 24..255 or None, got {self.maxnreg}")
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"PagedAttentionConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")


# Defaults (tunable with benchmarks/gpu_kernels.py). Decode tiles are small (one token x its group);
# prefill tiles are FlashAttention-sized.
# Measured figures behind these choices: benchmarks/results/h200/NOTES.md ("Figures behind the code's rules").
# decode: the best geo-mean of the configs measured on the H200 over batch 1-128 (gpu_kernels.md); three stages
# lose bandwidth at batch 8-32. (On sm_90 two stages compile without async copies: 22 KB of shared memory per
# program, so registers, not shared memory, bound the programs per SM.)
DECODE_CONFIG = PagedAttentionConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
# decode over fp8 caches: with the conversions the kernel takes 150 registers a thread (3 programs per SM, 1.1x bf16's
# speed at batch 128-256); capped at 128 (4 programs, 16 B of spills) it ran 1.37-1.39x (NOTES.md, thirteenth session)
FP8_DECODE_CONFIG = PagedAttentionConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, maxnreg=128)
# prefill: best of 9 configs on the H200 at 4k tokens (benchmarks/results/h200/gpu_kernels.md)
PREFILL_CONFIG = PagedAttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
# long query runs: 64 tokens x 4 heads per tile halves the K/V reads per FLOP; faster than PREFILL_CONFIG from 4k
# tokens per sequence (with the heaviest tiles of all heads first: in head-major order its last wave is long).
LONG_PREFILL_CONFIG = PagedAttentionConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
# Deeper pipelines where the shared memory allows (Hopper: 227 KB per program). With the block-table load in front
# of each K/V load, Triton 3.6 keeps K/V two iterations ahead (three buffers) only from num_stages 5; at 3 or 4 it
# waits for every outstanding copy at the top of each iteration, so each step's load latency is exposed. Both deep
# variants beat their shallow tiles on the H200 from 2k-token chunks to 16k-token sequences.
PREFILL_CONFIG_DEEP = PagedAttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=5)
LONG_PREFILL_CONFIG_DEEP = PagedAttentionConfig(block_m=256, block_n=64, num_warps=16, num_stages=5)

# Mixed batches (many short query runs, e.g. decodes beside a few prefill chunks) waste most of a 128-row
# tile per short request; fp32 cannot fit the large tile's shared memory (262 KB > 227 KB on the H200).
MIXED_CONFIG = PagedAttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
FP32_PREFILL_CONFIG = PagedAttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
_LONG_QUERY = 128  # mean query tokens per request from which the large prefill tile pays
_VERY_LONG_QUERY = 4096  # ... and from which LONG_PREFILL_CONFIG does (measured at 4k, 8k, 16k)
_SHARED_MARGIN = 2 << 10  # block-table buffers and barriers beside q and the K/V buffers (sm_90: 512-1,024 B)


# The shallow tile of each deep one, and the devices on which a deep tile ran out of shared memory (the estimate
# below was short for that device or Triton version): their launches keep to the shallow tiles from then on.
_SHALLOW_OF = {PREFILL_CONFIG_DEEP: PREFILL_CONFIG, LONG_PREFILL_CONFIG_DEEP: LONG_PREFILL_CONFIG}
_NO_DEEP_TILES: set[torch.device] = set()


def shared_bytes(config: PagedAttentionConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory of a prefill config, estimated as Triton 3.6 lays it out: the q tile plus K and V buffers
    (two below 5 pipeline stages, three from 5), without _SHARED_MARGIN. Sizes on sm_90 for head_dim 128 in bf16:
    (128, 128, 8, 5) 230,400 B, (256, 64, 16, 5) 164,352 B."""
    buffers = 3 if config.num_stages >= 5 else 2
    return (config.block_m + 2 * buffers * config.block_n) * head_dim * itemsize


def default_config(
    max_query_len: int,
    num_tokens: int,
    num_seqs: int,
    group_pad: int,
    itemsize: int,
    head_dim: int = 128,
    shared_limit: int = 0,
    kv_fp8: bool = False,
) -> PagedAttentionConfig:
    """The launch shape for a batch, from host ints only: decode tiles when every request fits one
    (max_query_len x group rows <= decode block_m), else the large prefill tiles for long query runs (the
    largest for runs of 4k tokens and more), the medium tile for mixed batches, and a small-footprint tile
    in fp32. The deep-pipeline variants of the large tiles are taken when they fit `shared_limit` (the device's
    shared memory per program)."""
    if max_query_len * group_pad <= max(DECODE_CONFIG.block_m, group_pad):
        return FP8_DECODE_CONFIG if kv_fp8 else DECODE_CONFIG
    if itemsize >= 4:
        return FP32_PREFILL_CONFIG
    if num_tokens >= _VERY_LONG_QUERY * num_seqs and group_pad == 4:  # the measured shape (Llama-3-8B)
        shallow, deep = LONG_PREFILL_CONFIG, LONG_PREFILL_CONFIG_DEEP
    elif num_tokens >= _LONG_QUERY * num_seqs:
        shallow, deep = PREFILL_CONFIG, PREFILL_CONFIG_DEEP
    else:
        return MIXED_CONFIG
    return deep if shared_bytes(deep, head_dim, itemsize) + _SHARED_MARGIN <= shared_limit else shallow


def fixed_config(max_query_len: int, group_pad: int, itemsize: int) -> PagedAttentionConfig:
    """A tile config that depends on nothing but whether a request's rows fit one decode tile: the decode tiles,
    else the mixed tile (fp32: its small-footprint tile). For eager launches whose shapes change every call and
    that must not meet a new compiled variant at run time (the draft head's, worker/spec/eagle_proposer.py)."""
    if max_query_len * group_pad <= max(DECODE_CONFIG.block_m, group_pad):
        return DECODE_CONFIG
    return FP32_PREFILL_CONFIG if itemsize >= 4 else MIXED_CONFIG


# Split heuristic knobs: at most this many programs per SM (the most decode programs that ran in one wave on the
# H200), never give a split fewer keys than _MIN_KEYS_PER_SPLIT, never more than _MAX_SPLITS splits.
# One wave, rounded down: a second wave of long programs costs a large share of the bandwidth; batch 1 at 32k keys
# was best at 64 splits (NOTES.md, "Figures behind the code's rules").
_PROGRAMS_PER_SM = 4
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
# The reduce kernel splits head_dim into chunks while it has fewer programs than _REDUCE_PROGRAMS_PER_SM per SM
# (batch 1: 32 heads -> 256 programs of 16 dims); slightly faster than unchunked at batch 1 on the H200.
_REDUCE_PROGRAMS_PER_SM = 2


def choose_num_splits(base_programs: int, max_kv_span: int, num_sms: int, block_n: int) -> int:
    """How many key segments to split each tile into so that `base_programs * splits` fills the GPU in one wave.

    base_programs: programs without splitting (tile slots x kv heads); max_kv_span: the longest key range
    one tile walks (max_seq_len, or sliding_window + max_query_len). Returns >= 1."""
    target = _PROGRAMS_PER_SM * num_sms
    if 2 * base_programs > target or max_kv_span <= max(_MIN_KEYS_PER_SPLIT, block_n):
        return 1
    splits = min(target // base_programs, max_kv_span // max(_MIN_KEYS_PER_SPLIT, block_n), _MAX_SPLITS)
    return max(1, splits)


@triton.jit
def _attn_segment(
    acc,  # [BLOCK_M, HEAD_DIM] fp32 running (unnormalised) output
    m_i,  # [BLOCK_M] fp32 running max of scores (log2 domain)
    l_i,  # [BLOCK_M] fp32 running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM] queries in cache dtype
    qpos,  # [BLOCK_M] int32 position of each row's query token
    k_base,  # k_cache pointer already offset to this kv head (fp8 caches: converted to q's dtype on load)
    v_base,  # v_cache pointer already offset to this kv head
    bt_row,  # block_tables row of this request
    lo,  # first key position (multiple of BLOCK_N relative to the segment start)
    hi,  # end of keys (exclusive); loads beyond hi are masked only when MASKED
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (used only when USE_WINDOW)
    tree_lo,  # TREE: first cache index of the request's draft tree
    tree_bits,  # TREE: [BLOCK_M] int64, the tree nodes each row sees (bit j: index tree_lo + j)
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_vd,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TREE: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        if MASKED:
            kmask = offs_n < hi
            blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=kmask, other=0)
        else:
            blk = tl.load(bt_row + offs_n // BLOCK_SIZE)
        slot = offs_n % BLOCK_SIZE
        k_off = blk.to(tl.int64) * stride_kb + slot * stride_ks  # [BLOCK_N]
        v_off = blk.to(tl.int64) * stride_vb + slot * stride_vs
        k_ptrs = k_base + k_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        v_ptrs = v_base + v_off[:, None] + offs_d[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0).to(q.dtype)
        else:
            k = tl.load(k_ptrs).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (offs_n[None, :] <= qpos[:, None]) & kmask[None, :]
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > qpos[:, None] - window)
            if TREE:  # keys of the tree: only the row's ancestors-or-self
                rel = offs_n - tree_lo  # [BLOCK_N]
                bit = (tree_bits[:, None] >> tl.maximum(rel, 0).to(tl.int64)[None, :]) & 1
                visible = visible & ((rel[None, :] < 0) | (bit != 0))
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # V must be masked too: p == 0 times a NaN in an unused slot would still be NaN.
        if MASKED:
            v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0).to(q.dtype)
        else:
            v = tl.load(v_ptrs).to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def choose_heads_per_group(num_kv_heads: int, kv_bytes_per_head: int, l2_bytes: int, one_tile: bool) -> int:
    """Program order of the attention grid: how many kv heads' tiles interleave (see _paged_attn_kernel).

    Prefill: all heads interleaved (heaviest tiles of every head first) while their K/V fit in half the L2,
    else the largest power-of-two divisor of num_kv_heads whose K/V does. Decode tiles keep head-major order."""
    if one_tile:
        return 1
    hg = num_kv_heads & -num_kv_heads  # largest power of two dividing num_kv_heads
    while hg > 1 and hg * kv_bytes_per_head > l2_bytes // 2:
        hg //= 2
    return hg


def _paged_attn_fn(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    bt_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    qsl_ptr,  # [B+1] int32
    out_ptr,  # [T, Hq, D] (not SPLIT)
    part_acc_ptr,  # [T, Hq, num_splits, D] fp32 (SPLIT)
    part_m_ptr,  # [T, Hq, num_splits] fp32
    part_l_ptr,  # [T, Hq, num_splits] fp32
    kn_ptr,  # [T, Hkv, D] this step's k before rotation (FUSE_ROPE)
    vn_ptr,  # [T, Hkv, D] this step's v (FUSE_ROPE)
    cs_ptr,  # [max_pos, D] rotary table: cos | sin halves (FUSE_ROPE)
    pos_ptr,  # [T] positions (FUSE_ROPE)
    slot_ptr,  # [T] cache slots of this step's k/v, -1: not written (FUSE_ROPE)
    kvs_ptr,  # [2, Hkv] float32 K and V scales per kv head (KV_FP8)
    tree_mask_ptr,  # [T] int64 tree nodes each query sees (TREE; worker/attention/backend.py)
    tree_start_ptr,  # [B] int32 first cache index of each request's tree (TREE)
    num_seqs,
    heads_per_group,  # kv heads per program-order group (divides Hkv; see choose_heads_per_group)
    num_splits,  # runtime, so that a changing split count does not recompile
    num_q_heads,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,  # 1, or block_size for a V cache stored dim-major inside each block
    stride_bt,
    stride_ot,
    stride_oh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_cs,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # next power of two of GROUP
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_M: tl.constexpr,  # rows per tile = BLOCK_Q * GROUP_PAD
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for _reduce_splits_kernel
    ONE_TILE_PER_SEQ: tl.constexpr,  # every request has <= BLOCK_Q query tokens: program i -> request i
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSE_ROPE: tl.constexpr,  # decode only (one query token per request): rotate q, write the rotated k and v
    KV_FP8: tl.constexpr,  # e4m3 caches: entries times kv_scales (K's folded into qk_scale, V's into the output)
    TREE: tl.constexpr,  # tree drafts: keys past tree_start seen only by their descendants (spec/tree.py)
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    # ---- which kv head, tile slot and split -------------------------------------------------------
    # Prefill: axis 0 enumerates (kv head, tile slot) in groups of `heads_per_group` kv heads, group-major and
    # inside a group slot-major with the head fastest; slots run in reverse, heaviest (longest-context) tiles
    # first, so the causal tail of the last wave is short; the group bounds how many heads' K/V the programs in
    # flight share in L2 (much faster than head-major at 4k on the H200: NOTES.md).
    if ONE_TILE_PER_SEQ:  # grid (slots, kv heads, splits), head-major: with a flat axis 0 decode takes more
        # registers on sm_90 (3 programs per SM instead of 4: slower at batch 128)
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
    else:  # grid (slots x kv heads, 1, splits)
        num_kv_heads = num_q_heads // GROUP
        n_slots = tl.num_programs(0) // num_kv_heads
        group_size = n_slots * heads_per_group
        in_group = tl.program_id(0) % group_size
        kvh = (tl.program_id(0) // group_size) * heads_per_group + in_group % heads_per_group
        pid = n_slots - 1 - in_group // heads_per_group
    split = tl.program_id(2)

    # ---- which request / which query tile of it -------------------------------------------------
    if ONE_TILE_PER_SEQ:
        b = pid
        tile_j = 0
    else:
        # largest b with query_start_loc[b] // BLOCK_Q + b <= pid  (tile slot start of request b)
        lo = pid * 0
        hi = pid * 0 + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            ok = start <= pid
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        b = lo
        tile_j = pid - (tl.load(qsl_ptr + b) // BLOCK_Q + b)
    q_start = tl.load(qsl_ptr + b)
    q_end = tl.load(qsl_ptr + b + 1)
    tok_start = q_start + tile_j * BLOCK_Q
    if tok_start >= q_end:
        return  # empty tile slot (or a request with no query tokens)
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - (q_end - q_start)  # position of the request's first query token
    n_tok = tl.minimum(q_end - tok_start, BLOCK_Q)
    first_pos = ctx + (tok_start - q_start)
    last_pos = first_pos + n_tok - 1

    # ---- key range of this tile, and of this split ---------------------------------------------
    kv_hi = last_pos + 1
    if USE_WINDOW:
        kv_lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        kv_lo = first_pos * 0
    if not SPLIT:
        seg_lo = kv_lo
        seg_hi = kv_hi
    else:
        # Segments are whole BLOCK_N multiples and no longer: a floor of 256 keys per segment (so that a
        # short context in a graph sized for max_model_len used fewer splits) made batch-1 decode of short
        # contexts slower, since one program then walks all keys.
        seg = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        seg_lo = kv_lo + split * seg
        seg_hi = tl.minimum(kv_hi, seg_lo + seg)
    # [seg_lo, full_hi): keys every row of the tile sees (key <= first_pos; no window; before the tree) ->
    # unmasked loop
    if USE_WINDOW:
        full_hi = seg_lo
    else:
        full_end = tl.minimum(seg_hi, first_pos + 1)
        if TREE:
            full_end = tl.minimum(full_end, tl.load(tree_start_ptr + b))
        full_hi = seg_lo + (tl.maximum(full_end - seg_lo, 0) // BLOCK_N) * BLOCK_N

    # ---- rows: (token, head) pairs of this tile ------------------------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tok_start + offs_m // GROUP_PAD  # [BLOCK_M]
    hg = offs_m % GROUP_PAD
    head = kvh * GROUP + hg  # [BLOCK_M] query head
    row_valid = (tok < q_end) & (hg < GROUP)
    qpos = ctx + (tok - q_start)  # [BLOCK_M]
    if TREE:
        tree_lo = tl.load(tree_start_ptr + b)
        tree_bits = tl.load(tree_mask_ptr + tok, mask=tok < q_end, other=0)  # [BLOCK_M] int64
    else:  # unused
        tree_lo = seq_len
        tree_bits = tok.to(tl.int64)
    q_rows = q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
    k_base = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    if KV_FP8:
        k_scale = tl.load(kvs_ptr + kvh)
        v_scale = tl.load(kvs_ptr + num_q_heads // GROUP + kvh)
        qk_scale = qk_scale * k_scale
    if FUSE_ROPE:
        # Rotary (numerics of kernels/rotary.py: fp32, one rounding) on the fly: x[d] * cos + sign * x[d +- D/2]
        # * sin with sign -1 on the first half. Only the tile's first token is real (decode).
        pos = tl.load(pos_ptr + tok_start).to(tl.int64)
        cs_row = cs_ptr + pos * stride_cs + offs_d % (HEAD_DIM // 2)  # [HEAD_DIM]
        cos = tl.load(cs_row).to(tl.float32)
        sin = tl.load(cs_row + HEAD_DIM // 2).to(tl.float32) * tl.where(offs_d < HEAD_DIM // 2, -1.0, 1.0)
        offs_sw = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # the partner of each dim
        qm = row_valid[:, None]
        x = tl.load(q_rows + offs_d[None, :], mask=qm, other=0.0).to(tl.float32)
        x_sw = tl.load(q_rows + offs_sw[None, :], mask=qm, other=0.0).to(tl.float32)
        q = (x * cos[None, :] + x_sw * sin[None, :]).to(q_ptr.dtype.element_ty)  # [BLOCK_M, HEAD_DIM]
        # The program whose key segment holds the token's own key writes this step's k (rotated) and v into
        # the cache, then reads them back with the rest of its segment (after a CTA barrier).
        slot = tl.load(slot_ptr + tok_start).to(tl.int64)
        if (slot >= 0) & (seg_lo <= last_pos) & (last_pos < seg_hi):
            kn = kn_ptr + tok_start.to(tl.int64) * stride_knt + kvh * stride_knh
            kx = tl.load(kn + offs_d).to(tl.float32)
            k_rot = kx * cos + tl.load(kn + offs_sw).to(tl.float32) * sin
            vx = tl.load(vn_ptr + tok_start.to(tl.int64) * stride_vnt + kvh * stride_vnh + offs_d)
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            if KV_FP8:  # k rounded to its dtype first, as rotary_and_cache
                k_new = quantize_e4m3(k_rot.to(kn_ptr.dtype.element_ty).to(tl.float32), k_scale)
                v_new = quantize_e4m3(vx.to(tl.float32), v_scale)
            else:
                k_new = k_rot.to(k_cache_ptr.dtype.element_ty)
                v_new = vx.to(v_cache_ptr.dtype.element_ty)
            tl.store(k_base + blk * stride_kb + off * stride_ks + offs_d, k_new)
            tl.store(v_base + blk * stride_vb + off * stride_vs + offs_d * stride_vd, v_new)
            tl.debug_barrier()  # the stores above are visible to every thread of this program below
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    if KV_FP8 and q_ptr.dtype.element_ty != tl.float32:
        # e4m3 converts to fp16 in one instruction per pair (bf16 takes three) and every e4m3 value is exact in
        # fp16: the products run in fp16 (q clamped to its range; p in [0, 1] gains mantissa over bf16)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # finite "minus infinity": a row that sees no key of this segment keeps m == -1e30 and l == 0 and never
    # computes exp2(-inf - -inf) = NaN; masked scores are -inf and give p == 0
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attn_segment(
        acc, m_i, l_i, q, qpos, k_base, v_base, bt_row, seg_lo, full_hi, qk_scale, window, tree_lo, tree_bits,
        stride_kb, stride_ks, stride_vb, stride_vs, stride_vd,
        HEAD_DIM, BLOCK_N, BLOCK_SIZE, False, USE_WINDOW, DOT_PRECISION, TREE,
    )  # fmt: skip
    acc, m_i, l_i = _attn_segment(
        acc, m_i, l_i, q, qpos, k_base, v_base, bt_row, full_hi, seg_hi, qk_scale, window, tree_lo, tree_bits,
        stride_kb, stride_ks, stride_vb, stride_vs, stride_vd,
        HEAD_DIM, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, DOT_PRECISION, TREE,
    )  # fmt: skip

    if KV_FP8:
        acc = acc * v_scale
    if not SPLIT:
        # every valid row saw at least its own key, so l_i >= 1 there; guard only the padded rows
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # partial results: row (tok, head, split); empty segments store m = -1e30, l = 0, acc = 0
        prow = (tok.to(tl.int64) * num_q_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_acc_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_m_ptr + prow, m_i, mask=row_valid)
        tl.store(part_l_ptr + prow, l_i, mask=row_valid)
    pdl_release(PDL)


def _reduce_splits_fn(
    part_acc_ptr,  # [T, Hq, num_splits, D] fp32
    part_m_ptr,  # [T, Hq, num_splits] fp32
    part_l_ptr,  # [T, Hq, num_splits] fp32
    out_ptr,  # [T, Hq, D]
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,  # power of two >= num_splits (bucketed: few compiled variants)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # dims per program (grid axis 2 covers HEAD_DIM // BLOCK_D chunks)
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    row = (t.to(tl.int64) * num_q_heads + h) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + row, mask=smask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=smask, other=0.0)
    m_max = tl.max(m, 0)  # finite: every query sees its own key in some split
    w = tl.exp2(m - m_max)  # [SPLITS_PAD]; 0 for padding and empty splits
    # denom > 0 for every real query (it sees its own key); 0 only for padding requests with seq_len 0
    # (e.g. CUDA-graph padding rows), which get zeros instead of 0/0
    denom = tl.sum(w * l_s, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / denom  # [BLOCK_D]
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))
    pdl_release(PDL)


# Two compiled families of each kernel. Decode-only batches (one query token per request: CUDA-graph captured, every
# shape fixed at capture) keep Triton's specialization on integer values (== 1, divisible by 16). Batches with
# prompt tokens launch eagerly between graph pieces with per-step ints (batch size, head grouping, split count,
# block-table width) that would otherwise pick a new variant per value class, compiled while serving: those ints
# are not specialized on.
_PER_STEP_INTS = ["num_seqs", "heads_per_group", "num_splits", "window", "stride_bt"]
_paged_attn_kernel = triton.jit(_paged_attn_fn)
_paged_attn_kernel_dyn = triton.jit(do_not_specialize=_PER_STEP_INTS)(_paged_attn_fn)
_reduce_splits_kernel = triton.jit(_reduce_splits_fn)
_reduce_splits_kernel_dyn = triton.jit(do_not_specialize=["num_splits"])(_reduce_splits_fn)


def _check_int_tensor(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: PagedAttentionConfig | None = None,
    rope: DecodeRope | None = None,
    kv_scales: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    tree_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of q [T, Hq, D] against the cache; returns [T, Hq, D] in q's dtype.

    max_query_len / max_seq_len are host upper bounds of the batch's query lengths / seq_lens (launch
    decisions only; they must not be smaller than the true values). `num_splits` / `config` override the
    heuristics (tests, tuning). q and out may be strided views (last dim contiguous).

    With `rope` (decode batches only: max_query_len == 1), q and this step's k are rotated and k, v written
    into the cache inside the attention kernel: the same result as rotary_and_cache(...) followed by this
    call, in one kernel instead of two (q and k stay un-rotated in memory).

    float8_e4m3fn caches need `kv_scales` [2, Hkv] float32 (K's and V's scale per kv head: an entry means
    entry * scale); other caches have q's dtype and no scales. Tree drafts: `tree_mask` [T] int64 and
    `tree_start` [B] int32 (both or neither; worker/attention/backend.py's AttentionMetadata)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}"
            f" and {tuple(v_cache.shape)}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported (float16, bfloat16, float32)")
    if k_cache.dtype not in (q.dtype, FP8_KV) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype} must both be q's dtype {q.dtype} or {FP8_KV}")
    check_kv_scales(k_cache, kv_scales)
    if cache_head_dim != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) and cache ({cache_head_dim}) differ")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head dim must be a power of two >= 16, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    device = q.device
    if k_cache.device != device or v_cache.device != device:
        raise ValueError(f"caches on {k_cache.device}/{v_cache.device}, q on {device}")
    for name, t in (("q", q), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    check_v_cache_layout(v_cache)
    _check_int_tensor("block_tables", block_tables, 2, device)
    _check_int_tensor("seq_lens", seq_lens, 1, device)
    _check_int_tensor("query_start_loc", query_start_loc, 1, device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"batch mismatch: seq_lens [{num_seqs}], query_start_loc [{query_start_loc.shape[0]}] "
            f"(want B+1), block_tables {tuple(block_tables.shape)}"
        )
    if seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1:
        raise ValueError("seq_lens and query_start_loc must be contiguous")
    if max_query_len < 1 or max_seq_len < 1:
        raise ValueError(f"max_query_len={max_query_len} and max_seq_len={max_seq_len} must be >= 1")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if rope is not None:
        if max_query_len != 1:
            raise ValueError(f"rope fusion is for decode batches (max_query_len == 1), got {max_query_len}")
        check_rotary_args(q, rope.k, rope.cos_sin_cache, rope.positions)
        check_kv_cache_args(rope.k, rope.v, k_cache, v_cache, rope.slot_mapping, kv_scales)
    tree = _check_tree(tree_mask, tree_start, num_tokens, num_seqs, device)
    if tree is not None and (rope is not None or sliding_window is not None):
        raise ValueError("tree drafts take neither rope fusion nor a sliding window")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    else:
        _check_out(out, q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    defaulted = config is None
    plan = plan_paged_attention(q.shape, q.dtype, k_cache.shape, device, num_seqs, scale, max_query_len=max_query_len,
                                max_seq_len=max_seq_len, sliding_window=sliding_window, num_splits=num_splits,
                                config=config, kv_dtype=k_cache.dtype)  # fmt: skip
    try:
        plan.launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, rope, kv_scales, tree)
    except OutOfResources as exc:
        if not defaulted or plan.config not in _SHALLOW_OF:
            raise
        _NO_DEEP_TILES.add(device)
        _log.warning("paged_attention: %s does not fit %s (%s); using %s from now on", plan.config, device, exc,
                     _SHALLOW_OF[plan.config])  # fmt: skip
        return paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len=max_query_len,
            max_seq_len=max_seq_len, sliding_window=sliding_window, out=out, num_splits=num_splits, rope=rope,
            kv_scales=kv_scales, tree_mask=tree_mask, tree_start=tree_start,
        )  # fmt: skip
    return out


def _check_tree(tree_mask: torch.Tensor | None, tree_start: torch.Tensor | None, num_tokens: int, num_seqs: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    if tree_mask is None and tree_start is None:
        return None
    if tree_mask is None or tree_start is None:
        raise ValueError("tree_mask and tree_start go together")
    if tree_mask.dtype != torch.int64 or tree_mask.shape != (num_tokens,) or tree_mask.device != device:
        raise ValueError(f"tree_mask must be int64 [{num_tokens}] on {device}, got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)} on {tree_mask.device}")
    _check_int_tensor("tree_start", tree_start, 1, device)
    if tree_start.shape[0] != num_seqs or tree_mask.stride(0) != 1:
        raise ValueError(f"tree_start must be [{num_seqs}] and tree_mask contiguous")
    return tree_mask, tree_start


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dim, got strides {out.stride()}")


@dataclass(frozen=True)
class AttentionPlan:
    """The launch decisions of one paged_attention call, made from host ints only (shapes, the batch's
    upper bounds), so that the layers of one step can share them: `launch` per layer then does no more
    host work than the kernel launches. Built by plan_paged_attention."""

    config: PagedAttentionConfig
    block_m: int
    block_q: int
    one_tile: bool
    num_splits: int
    heads_per_group: int
    grid: tuple[int, int, int]
    num_seqs: int
    qk_scale: float  # scale * log2(e)
    window: int  # 0: none
    part: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # split partials acc, m, l (or 1-element dummies)
    pdl: dict[str, Any]
    reduce_grid: tuple[int, int, int]
    reduce_block_d: int
    dynamic: bool  # batches with prompt tokens: the kernels without per-step int specialization
    # the compiled attention and reduce variants per launch flags (rope, fp8 scales, tree: constexprs of the kernel),
    # each pair set by the first launch with those flags (see launch)
    _compiled: dict[tuple[bool, bool, bool], list[Any]] = field(default_factory=dict, repr=False, compare=False)
    # the last compiled launch's arguments, reused by the next layer of the same step (see _LayerLaunch)
    _last: list[_LayerLaunch | None] = field(default_factory=lambda: [None], repr=False, compare=False)

    def launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
               rope: DecodeRope | None = None, kv_scales: torch.Tensor | None = None,
               tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Attention of q [T, Hq, D] into out [T, Hq, D], T and the caches' shapes as planned (callers of a
        shared plan guarantee it; paged_attention checks every argument before it plans); kv_scales [2, Hkv]
        float32 with float8_e4m3fn caches; tree: (tree_mask [T] int64, tree_start [B] int32) of tree drafts.

        The first launch goes through Triton's JIT, which picks the compiled variant for the arguments' types and
        alignments; later launches of the same plan (or of plans sharing its `variants` store entry) with the same
        flags (rope, kv_scales, tree given or not) reuse that variant directly, which is what makes one plan per
        step cheap for all layers. So every launch of one plan must pass tensors of the same dtypes and 16-byte
        alignment as the first (one step's layers do: the same buffers, caches of one shape). A launch with
        the same step tensors as the one before (the same objects: q, out, metadata, rope, tree) and caches of the
        same strides only swaps the caches and scales into the arguments that launch built."""
        last = self._last[0]
        if last is not None and last.reusable(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                                              rope, kv_scales, tree):
            last.launch(k_cache, v_cache, kv_scales)
            return
        _, num_q_heads, head_dim = q.shape
        group = num_q_heads // k_cache.shape[2]
        part_acc, part_m, part_l = self.part
        kn, vn, cs, pos, slots = rope if rope is not None else (q, q, q[0], seq_lens, seq_lens)  # unused if no rope
        cfg = self.config
        args: tuple[Any, ...] = (
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_m, part_l,
            kn, vn, cs, pos, slots, part_m if kv_scales is None else kv_scales,
            *((part_m, seq_lens) if tree is None else tree),
            self.num_seqs, self.heads_per_group, self.num_splits, num_q_heads, self.qk_scale, self.window,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            block_tables.stride(0), out.stride(0), out.stride(1),
            kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cs.stride(0),
        )  # fmt: skip
        constexprs = dict(
            GROUP=group, GROUP_PAD=_next_pow2(group), HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=self.block_m, BLOCK_Q=self.block_q, BLOCK_N=cfg.block_n, SPLIT=self.num_splits > 1,
            ONE_TILE_PER_SEQ=self.one_tile, USE_WINDOW=self.window > 0,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FUSE_ROPE=rope is not None,
            KV_FP8=kv_scales is not None, TREE=tree is not None, PDL=self.pdl["PDL"],
        )  # fmt: skip
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                   **({"maxnreg": cfg.maxnreg} if cfg.maxnreg is not None else {}),
                   **{k: v for k, v in self.pdl.items() if k != "PDL"}}
        kernels = (_paged_attn_kernel_dyn, _reduce_splits_kernel_dyn) if self.dynamic else \
            (_paged_attn_kernel, _reduce_splits_kernel)
        compiled = self._compiled.setdefault((rope is not None, kv_scales is not None, tree is not None), [None, None])
        second = compiled[0] is not None  # a plan launched once only (paged_attention's) keeps nothing
        compiled[0] = _run(kernels[0], compiled[0], self.grid, args, constexprs, options)
        attn_args = [*args, *constexprs.values()]
        reduce_args: tuple[Any, ...] = ()
        if self.num_splits > 1:
            splits_pad = max(8, _next_pow2(self.num_splits))
            args = (part_acc, part_m, part_l, out, num_q_heads, self.num_splits, out.stride(0), out.stride(1))
            constexprs = dict(SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, BLOCK_D=self.reduce_block_d,
                              PDL=self.pdl["PDL"])
            options["num_warps"] = 4 if self.reduce_block_d * splits_pad >= 4096 else 2
            options.pop("num_stages")
            options.pop("maxnreg", None)
            compiled[1] = _run(kernels[1], compiled[1], self.reduce_grid, args, constexprs, options)
            reduce_args = (*args, *constexprs.values())
        attn, red = compiled
        self._last[0] = None
        if second and (red is not None or not reduce_args):  # (under the interpreter no variant is ever set)
            self._last[0] = _LayerLaunch(
                (q, block_tables, seq_lens, query_start_loc, out, rope, tree), kv_scales is None,
                (k_cache.stride(), v_cache.stride()), attn_args, direct_launcher(attn, self.grid, q.device.index),
                (direct_launcher(red, self.reduce_grid, q.device.index), reduce_args) if reduce_args else None)


class _LayerLaunch:
    """One compiled launch of a plan, kept for the step's next layers: the same attention over another layer's
    caches differs only in the caches and their fp8 scales, so `launch` puts those into the arguments built for
    the first layer (positions _K, _V, _KV_SCALES of the kernel's signature) and calls the compiled variants'
    C launchers again (kernels/direct_launch.py: one call with the current stream instead of Triton's runner,
    and no rebuilding of 40 arguments and three dicts per layer)."""

    _K, _V, _KV_SCALES = 1, 2, 15  # k_cache_ptr, v_cache_ptr, kvs_ptr in _paged_attn_fn's parameters

    def __init__(self, step: tuple[Any, ...], no_scales: bool, strides: tuple[tuple[int, ...], tuple[int, ...]],
                 attn_args: list[Any], attn: Any, reduce: tuple[Any, tuple[Any, ...]] | None) -> None:
        self.step = step  # q, block_tables, seq_lens, query_start_loc, out, rope, tree: compared by identity
        self.no_scales = no_scales
        self.strides = strides
        self.args = attn_args  # every parameter in signature order, constexprs included
        self.attn = attn
        self.reduce = reduce  # (launcher, arguments) of the split reduce, or None

    def reusable(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor, rope: DecodeRope | None,
                 kv_scales: torch.Tensor | None, tree: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        s = self.step
        return (s[0] is q and s[1] is block_tables and s[2] is seq_lens and s[3] is query_start_loc
                and s[4] is out and s[5] is rope and s[6] is tree and self.no_scales == (kv_scales is None)
                and self.strides == (k_cache.stride(), v_cache.stride()))

    def launch(self, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
        args = self.args
        args[self._K], args[self._V] = k_cache, v_cache
        if kv_scales is not None:
            args[self._KV_SCALES] = kv_scales
        self.attn(*args)
        if self.reduce is not None:
            launcher, reduce_args = self.reduce
            launcher(*reduce_args)


def _run(kernel: Any, compiled: Any, grid: tuple[int, int, int], args: tuple[Any, ...], constexprs: dict[str, Any],
         options: dict[str, Any]) -> Any:
    """Launch `kernel` through the JIT (compiled is None) or `compiled`, the variant an earlier launch of the same
    plan returned (its launcher takes every parameter in signature order, constexprs included). Returns the
    compiled variant for the next launch."""
    if compiled is None:
        return kernel[grid](*args, **constexprs, **options)
    compiled[grid](*args, *constexprs.values())
    return compiled


class AttentionChoice(NamedTuple):
    """The launch choices of one paged-attention step, from host ints: the tile config, whether every request
    fits one tile (program i -> request i), and the key splits. A step's rows do not depend on the rest of the
    grid: a launch with these choices planned for more requests (padding ones with no query tokens) and more rows
    computes the same bits for the step's rows (what worker/cuda_graphs.py's whole-step graphs rely on)."""

    config: PagedAttentionConfig
    one_tile: bool
    num_splits: int


def key_span(max_seq_len: int, max_query_len: int, sliding_window: int | None) -> int:
    """The longest key range one tile walks (choose_num_splits' max_kv_span)."""
    return max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + max_query_len)


def attention_choice(
    q_shape: Sequence[int],
    dtype: torch.dtype,
    cache_shape: Sequence[int],
    device: torch.device,
    num_seqs: int,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    config: PagedAttentionConfig | None = None,
    kv_dtype: torch.dtype | None = None,
) -> AttentionChoice:
    """The launch choices plan_paged_attention makes for these arguments (its own), without building a plan."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads = cache_shape[2]
    itemsize = dtype.itemsize
    group_pad = _next_pow2(num_q_heads // num_kv_heads)
    if config is None:
        shared_limit = 0 if device in _NO_DEEP_TILES else _shared_limit(device)
        config = default_config(max_query_len, num_tokens, num_seqs, group_pad, itemsize, head_dim, shared_limit,
                                kv_fp8=kv_dtype == FP8_KV)
    block_q = max(config.block_m, group_pad) // group_pad
    one_tile = max_query_len <= block_q
    num_tile_slots = num_seqs if one_tile else num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = choose_num_splits(num_tile_slots * num_kv_heads,
                                       key_span(max_seq_len, max_query_len, sliding_window), _num_sms(device),
                                       config.block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return AttentionChoice(config, one_tile, num_splits)


def plan_paged_attention(
    q_shape: Sequence[int],
    dtype: torch.dtype,
    cache_shape: Sequence[int],
    device: torch.device,
    num_seqs: int,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    config: PagedAttentionConfig | None = None,
    variants: dict[tuple[Any, ...], dict[tuple[bool, bool, bool], list[Any]]] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> AttentionPlan:
    """Launch decisions for q of `q_shape` [T, Hq, D] against caches of `cache_shape` [blocks, block_size,
    Hkv, D] over `num_seqs` requests (T, num_seqs >= 1); kv_dtype: the caches' (None: `dtype`). Arguments as
    paged_attention's, unchecked.

    `variants`: compiled variants kept across the plans of many steps (PiecewiseGraphs keeps one store). A dynamic
    plan's kernels specialize on no per-step value (_PER_STEP_INTS), so two dynamic plans of the same compile-time
    choices over the same model, caches and buffers launch the same variants: the plan shares the store's entry for
    its choices, and even its first launch skips Triton's JIT. The callers' tensors must keep the dtypes and the
    16-byte alignment of the launches that filled the store (one model's static buffers and shipped inputs do)."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads = cache_shape[2]
    itemsize = dtype.itemsize
    config, one_tile, num_splits = attention_choice(
        q_shape, dtype, cache_shape, device, num_seqs, max_query_len=max_query_len, max_seq_len=max_seq_len,
        sliding_window=sliding_window, num_splits=num_splits, config=config, kv_dtype=kv_dtype)
    group_pad = _next_pow2(num_q_heads // num_kv_heads)
    block_m = max(config.block_m, group_pad)
    block_q = block_m // group_pad
    num_tile_slots = num_seqs if one_tile else num_tokens // block_q + num_seqs
    kv_span = key_span(max_seq_len, max_query_len, sliding_window)

    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
        part_m = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel; any fp32 tensor keeps the signature uniform
        part_acc = part_m = part_l = torch.empty((1,), dtype=torch.float32, device=device)

    kv_bytes_per_head = kv_span * head_dim * 2 * itemsize  # K + V of the longest request
    heads_per_group = choose_heads_per_group(num_kv_heads, kv_bytes_per_head, _l2_bytes(device), one_tile)
    grid = (num_tile_slots, num_kv_heads, num_splits) if one_tile else (num_tile_slots * num_kv_heads, 1, num_splits)
    rows = num_tokens * num_q_heads
    d_chunks = min(head_dim // 16, _next_pow2(_REDUCE_PROGRAMS_PER_SM * _num_sms(device) // rows + 1) // 2)
    d_chunks = max(1, d_chunks)  # a power of two dividing head_dim
    dynamic = max_query_len > 1
    compiled: dict[tuple[bool, bool, bool], list[Any]] = {}
    if variants is not None and dynamic:
        choices = (dtype, tuple(q_shape[1:]), tuple(cache_shape[1:]), sliding_window is not None, config, block_m,
                   block_q, one_tile, num_splits > 1, head_dim // d_chunks,
                   max(8, _next_pow2(num_splits)) if num_splits > 1 else 0)
        compiled = variants.setdefault(choices, {})
    return AttentionPlan(
        config=config, block_m=block_m, block_q=block_q, one_tile=one_tile, num_splits=num_splits,
        heads_per_group=heads_per_group, grid=grid, num_seqs=num_seqs, qk_scale=float(scale) * _LOG2E,
        window=int(sliding_window or 0), part=(part_acc, part_m, part_l), pdl=pdl_launch_args(device),
        reduce_grid=(num_tokens, num_q_heads, d_chunks), reduce_block_d=head_dim // d_chunks,
        dynamic=dynamic, _compiled=compiled,
    )

