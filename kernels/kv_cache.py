"""Write a step's new keys/values into the paged KV cache by slot mapping.

k, v        [T, Hkv, D]       (token/head strides free, last dim contiguous: views of a fused qkv are fine)
k_cache,
v_cache     [num_blocks, block_size, Hkv, D]
slot_mapping [T] int64 (or int32): slot = block_id * block_size + offset; -1 = do not write
Plain-torch reference: kernels/attention_ref.py (write_kv_cache_ref).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2 as _next_pow2
from .launch import pdl_launch_args, pdl_release, pdl_wait

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T]
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
    BLOCK_SIZE: tl.constexpr,  # cache block size
    HEADS_PAD: tl.constexpr,  # next_pow2(Hkv)
    DIM_PAD: tl.constexpr,  # next_pow2(D)
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
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)
    pdl_release(PDL)


def check_kv_cache_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
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
    if v.dtype != k.dtype or k_cache.dtype != k.dtype or v_cache.dtype != k.dtype:
        raise ValueError(f"dtypes differ: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
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
    for name, t in (
        ("k", k),
        ("v", v),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for every t with slot_mapping[t] >= 0
    (slot -1: not written)."""
    check_kv_cache_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    heads_pad, dim_pad = _next_pow2(num_kv_heads), _next_pow2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEADS_PAD=heads_pad, DIM_PAD=dim_pad,
        num_warps=4 if heads_pad * dim_pad >= 2048 else 2, **pdl_launch_args(k.device),
    )  # fmt: skip
