"""Write a step's new keys/values into the paged KV cache by slot mapping.

k, v        [T, Hkv, D]       (token/head strides free, last dim contiguous: views of a fused qkv are fine)
k_cache,
v_cache     [num_blocks, block_size, Hkv, D]
slot_mapping [T] int64 (or int32): slot = block_id * block_size + offset; -1 = do not write
kv_scales    [2, Hkv] float32 (fp8 caches only): row 0 K's per-head scales, row 1 V's
Plain-torch reference: kernels/attention_ref.py (write_kv_cache_ref).

FP8 caches (float8_e4m3fn) hold x / scale rounded by `quantize_e4m3`: round to nearest even, saturated at +-448,
computed on the bits rather than by Triton's float8 cast, because the interpreter's cast rounds differently
(ties away from zero, wrong saturation and subnormals); so the interpreter tests check the arithmetic the GPU runs,
bit for bit against torch's `.to(torch.float8_e4m3fn)` (kernels/attention_ref.py, quantize_kv_fp8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2 as _next_pow2
from .launch import pdl_launch_args, pdl_release, pdl_wait

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_KV = torch.float8_e4m3fn


@triton.jit
def quantize_e4m3(x, scale):
    """x fp32 -> float8e4nv (e4m3fn) of x / scale: IEEE division, saturated at +-448, rounded to nearest even."""
    y = tl.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # |y| >= 2^-6 (normal in e4m3): drop 20 mantissa bits with ties to even; exponent bias 127 -> 7 (the mantissa's
    # carry moves into the exponent by itself; 448 is the largest value rounding can reach)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # |y| < 2^-6: m * 2^-9, m = round-half-even(|y| * 512) in 0..8 (8 encodes 2^-6, the smallest normal)
    t = tl.abs(y) * 512.0
    m = t.to(tl.int32)
    frac = t - m.to(tl.float32)
    m += ((frac > 0.5) | ((frac == 0.5) & ((m & 1) == 1))).to(tl.int32)
    code = tl.where(a < 0x3C800000, m, normal) | sign  # 0x3C800000: 2^-6 in fp32
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def load_kv_scales(scales_ptr, offs_h, num_kv_heads):
    """(K scales, V scales) [len(offs_h)] fp32 of heads offs_h from kv_scales [2, Hkv] (1.0 past Hkv)."""
    hmask = offs_h < num_kv_heads
    k_scale = tl.load(scales_ptr + offs_h, mask=hmask, other=1.0)
    v_scale = tl.load(scales_ptr + num_kv_heads + offs_h, mask=hmask, other=1.0)
    return k_scale, v_scale


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T]
    scales_ptr,  # [2, Hkv] float32 (KV_FP8)
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,  # 1, or block_size for a V cache stored dim-major inside each block
    BLOCK_SIZE: tl.constexpr,  # cache block size
    HEADS_PAD: tl.constexpr,  # next_pow2(Hkv)
    DIM_PAD: tl.constexpr,  # next_pow2(D)
    KV_FP8: tl.constexpr,  # e4m3 caches: store quantize_e4m3(x, scale of its head)
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [HEADS_PAD, DIM_PAD]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    if KV_FP8:
        k_scale, v_scale = load_kv_scales(scales_ptr, offs_h, num_kv_heads)
        k = quantize_e4m3(k.to(tl.float32), k_scale[:, None])
        v = quantize_e4m3(v.to(tl.float32), v_scale[:, None])
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)
    pdl_release(PDL)



def check_kv_cache_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Shared validation of write_kv_cache / rotary_and_cache arguments (raises ValueError)."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}"
            f" and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} differ from k's {tuple(k.shape[1:])}")
    if k.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype {k.dtype} not supported (float16, bfloat16, float32)")
    if v.dtype != k.dtype or k_cache.dtype not in (k.dtype, FP8_KV) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes differ: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype} (caches: "
                         f"k's dtype or {FP8_KV})")
    check_kv_scales(k_cache, kv_scales)
    block_size = k_cache.shape[1]
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k is on {k.device}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("slot_mapping", slot_mapping)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    check_v_cache_layout(v_cache)


def check_v_cache_layout(v_cache: torch.Tensor) -> None:
    """v_cache [num_blocks, block_size, Hkv, D] is contiguous in D, or in the block's slots (dim-major)."""
    if v_cache.stride(3) != 1 and v_cache.stride(1) != 1:
        raise ValueError(f"v_cache must be contiguous in its head dim or in its block's slots, got strides "
                         f"{v_cache.stride()}")


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed K and V caches, each [num_blocks, block_size, Hkv, D] and contiguous. (The kernels take V's strides,
    so a V cache stored dim-major inside each block also works; for fp8 it measured no faster on the H200:
    benchmarks/results/h200/NOTES.md, thirteenth session.)"""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def check_kv_scales(k_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """kv_scales must be [2, Hkv] float32, contiguous, on the cache's device, exactly when the cache is fp8."""
    if k_cache.dtype != FP8_KV:
        if kv_scales is not None:
            raise ValueError(f"kv_scales are for {FP8_KV} caches; this cache is {k_cache.dtype}")
        return
    want = (2, k_cache.shape[2])
    if kv_scales is None:
        raise ValueError(f"an {FP8_KV} cache needs kv_scales [2, Hkv] float32 (K's and V's scale per kv head)")
    if tuple(kv_scales.shape) != want or kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous():
        raise ValueError(f"kv_scales must be a contiguous {list(want)} float32 tensor, got {tuple(kv_scales.shape)} "
                         f"{kv_scales.dtype}")
    if kv_scales.device != k_cache.device:
        raise ValueError(f"kv_scales is on {kv_scales.device}, the cache on {k_cache.device}")


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for every t with slot_mapping[t] >= 0
    (slot -1: not written). float8_e4m3fn caches store k / kv_scales[0, head] and v / kv_scales[1, head]."""
    check_kv_cache_args(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    heads_pad, dim_pad = _next_pow2(num_kv_heads), _next_pow2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k if kv_scales is None else kv_scales, num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        BLOCK_SIZE=k_cache.shape[1], HEADS_PAD=heads_pad, DIM_PAD=dim_pad, KV_FP8=kv_scales is not None,
        num_warps=4 if heads_pad * dim_pad >= 2048 else 2, **pdl_launch_args(k.device),
    )  # fmt: skip
