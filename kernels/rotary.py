"""Rotary position embedding (NeoX / HF `rotate_half` style), optionally fused with the KV-cache write.

q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]  (token/head strides free, last dim contiguous)
cos_sin_cache [max_pos, D]: row p = [cos(p * inv_freq) (D/2), sin(p * inv_freq) (D/2)]
positions [T] int64/int32

With x1 = x[..., :D/2], x2 = x[..., D/2:] the rotation is
    out1 = x1 * cos - x2 * sin,  out2 = x2 * cos + x1 * sin        (computed in fp32, rounded once)
which is HF's `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`.

The fused `rotary_and_cache` reads q, k, v once and writes q, k (in place) and the rotated k and v into the
cache, saving the separate cache-write pass over k and v. Plain-torch references: kernels/attention_ref.py.
float8_e4m3fn caches (kv_scales [2, Hkv]) get the rotated k rounded to k's dtype first, then quantize_e4m3 as
kernels/kv_cache.py: the reference's rotary_embedding_ref + write_kv_cache_ref, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_cache import check_kv_cache_args, load_kv_scales, quantize_e4m3
from .launch import next_pow2 as _next_pow2
from .launch import pdl_launch_args, pdl_release, pdl_wait

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cos_sin_cache_from_inv_freq(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """[max_position, 2 * len(inv_freq)] fp32 table of [cos | sin] for positions 0..max_position-1."""
    t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())  # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


@triton.jit
def _rotate_heads(
    x_ptr,  # token row of a [T, H, D] tensor (already offset to this token)
    stride_h,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    num_heads,
    half,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate all heads of one token in place; returns the rotated halves (fp32) for a cache write."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half)  # [HEADS_PAD, HALF_PAD]
    p1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    p2 = p1 + half
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(x_ptr.dtype.element_ty), mask=mask)
    return o1, o2


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, Hq, D], rotated in place
    k_ptr,  # [T, Hkv, D], rotated in place
    v_ptr,  # [T, Hkv, D] (WRITE_CACHE only)
    cos_sin_ptr,  # [max_pos, D]
    pos_ptr,  # [T]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] (WRITE_CACHE only)
    v_cache_ptr,
    slot_ptr,  # [T] (WRITE_CACHE only)
    scales_ptr,  # [2, Hkv] float32 (KV_FP8 only)
    num_q_heads,
    num_kv_heads,
    half,  # D // 2
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,  # 1, or block_size for a V cache stored dim-major inside each block
    QHEADS_PAD: tl.constexpr,
    KHEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    KV_FP8: tl.constexpr,  # e4m3 caches
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs_d, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, num_q_heads, half, QHEADS_PAD, HALF_PAD)
    k1, k2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, num_kv_heads, half, KHEADS_PAD, HALF_PAD)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            offs_h = tl.arange(0, KHEADS_PAD)
            mask = (offs_h[:, None] < num_kv_heads) & dmask[None, :]  # [KHEADS_PAD, HALF_PAD]
            kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
            vp = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch
            vc += offs_d[None, :] * stride_vcd
            vc_hi = vc + half * stride_vcd  # the second half of each head's dims
            if KV_FP8:
                k_scale, v_scale = load_kv_scales(scales_ptr, offs_h, num_kv_heads)
                ks, vs = k_scale[:, None], v_scale[:, None]
                kt = k_ptr.dtype.element_ty
                tl.store(kc, quantize_e4m3(k1.to(kt).to(tl.float32), ks), mask=mask)
                tl.store(kc + half, quantize_e4m3(k2.to(kt).to(tl.float32), ks), mask=mask)
                tl.store(vc, quantize_e4m3(tl.load(vp, mask=mask).to(tl.float32), vs), mask=mask)
                tl.store(vc_hi, quantize_e4m3(tl.load(vp + half, mask=mask).to(tl.float32), vs), mask=mask)
            else:
                tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(kc + half, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(vc, tl.load(vp, mask=mask), mask=mask)
                tl.store(vc_hi, tl.load(vp + half, mask=mask), mask=mask)
    pdl_release(PDL)


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on T or D")
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"head dim must be even, got {head_dim}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q/k dtypes {q.dtype}/{k.dtype} must match and be float16, bfloat16 or float32")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, D={head_dim}], got {tuple(cos_sin_cache.shape)}")
    if not cos_sin_cache.is_floating_point():
        raise ValueError(f"cos_sin_cache must be floating point, got {cos_sin_cache.dtype}")
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions must be [T={q.shape[0]}], got {tuple(positions.shape)}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 or int32, got {positions.dtype}")
    for name, t in (("k", k), ("cos_sin_cache", cos_sin_cache), ("positions", positions)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache), ("positions", positions)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    write_cache: bool,
    kv_scales: torch.Tensor | None = None,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    half = head_dim // 2
    qh_pad, kh_pad, half_pad = _next_pow2(num_q_heads), _next_pow2(num_kv_heads), _next_pow2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, q if kv_scales is None else kv_scales,
        num_q_heads, num_kv_heads, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        QHEADS_PAD=qh_pad, KHEADS_PAD=kh_pad, HALF_PAD=half_pad,
        BLOCK_SIZE=k_cache.shape[1] if write_cache else 1, WRITE_CACHE=write_cache,
        KV_FP8=kv_scales is not None, num_warps=4 if qh_pad * half_pad >= 2048 else 2, **pdl_launch_args(q.device),
    )  # fmt: skip


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by positions [T]; returns (q, k)."""
    check_rotary_args(q, k, cos_sin_cache, positions)
    dummy4 = q.new_empty((1, 1, 1, 1))
    _launch(q, k, k, cos_sin_cache, positions, dummy4, dummy4, positions, write_cache=False)
    return q, k


def rotary_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place, then write the rotated k and v into the cache at slot_mapping (-1 skipped).
    Returns (q, k). Equivalent to rotary_embedding(...) followed by write_kv_cache(k, v, ..., kv_scales) (kv_scales
    [2, Hkv] float32 for float8_e4m3fn caches, else None)."""
    check_rotary_args(q, k, cos_sin_cache, positions)
    check_kv_cache_args(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    _launch(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, write_cache=True, kv_scales=kv_scales)
    return q, k
