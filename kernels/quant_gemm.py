"""Tiled matmul over weight-only quantized weights (INT8 / INT4, kernels/quant_weight.py) for batches of more
tokens than the skinny decode kernels take (prefill, large decode batches):

    quant_matmul(x [M, K], w, bias [N] | None) -> y [M, N] = x @ W.T (+ bias)

One program computes a BLOCK_M x BLOCK_N tile of y over the whole K range: per K step it loads an x tile
(columns gathered through perm for act-order weights), the packed weight tile (dequantized in registers to
x's dtype by `dequant_tile`) and accumulates tl.dot in fp32; per-channel symmetric weights are scaled once in
the epilogue, then the bias, one rounding to x's dtype. Programs are ordered in groups of GROUP_M row tiles
(the weight tiles of a group stay in L2 while its row tiles pass). With GemmConfig.split_k > 1 the K range is cut
into slices, one program per (tile, slice), and a second kernel adds the slices' fp32 partial sums (small M,
where the tiles alone do not fill the GPU). Launch shapes come from a per-call `config=GemmConfig(...)`, else the
device's tuned table (kernels/tuned.py, filled by `benchmarks/gpu_quant.py --sweep`), else `default_gemm_config`
(a rule on M).

Reference: quant_weight.quant_matmul_ref (the weight dequantized in fp32, rounded once, then F.linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import tuned
from tokenmill.kernels.gemv import _check_out
from tokenmill.kernels.launch import next_pow2
from tokenmill.kernels.quant_gemv import (
    activation_cols,
    check_magic_dot,
    check_quant_weight,
    dequant_tile,
    k_slice,
    k_slices,
    magic_dot,
    split_k_sum,
)
from tokenmill.kernels.quant_weight import PackedWeight, scale_later
from tokenmill.kernels.tuned import GemmConfig

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def default_gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """128 x 128 x 64 tiles from M = 128 on, smaller row tiles below (fewer padded rows)."""
    block_m = max(16, min(128, next_pow2(m)))
    block_n = 128 if block_m >= 64 else 64
    return GemmConfig(block_m, min(block_n, max(16, next_pow2(n))), min(64, max(16, next_pow2(k))),
                      num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3)


def gemm_config(x: torch.Tensor, w: PackedWeight, config: GemmConfig | None) -> GemmConfig:
    """The launch shape of y = x @ W.T: `config` if given, else the device's tuned table entry
    (kernels/tuned.py), else `default_gemm_config`."""
    if config is not None:
        return config
    tuned_cfg = tuned.tuned_config("tiled", x, w)
    if isinstance(tuned_cfg, GemmConfig):
        return tuned_cfg
    n, k = w.shape
    return default_gemm_config(x.shape[0], n, k)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K], row stride stride_xm
    q_ptr, s_ptr, z_ptr, m_ptr, perm_ptr,  # the PackedWeight's tensors (z / m / perm: HAS_ZEROS / HAS_MINS / HAS_PERM)
    b_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N], row stride stride_ym; SPLIT: fp32 partials [splits, M, N], contiguous
    M, N, K, G,
    stride_qn,  # elements of q_ptr's type per packed row (an argument for its alignment: quant_gemv's stride_qn)
    k_split,  # SPLIT: K columns per slice (a multiple of BLOCK_K); slice program_id(1) is [k_split * id, + k_split)
    stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_MINS: tl.constexpr, HAS_PERM: tl.constexpr, SCALE_LATER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, MAGIC: tl.constexpr,
):  # fmt: skip
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)  # the K slice (0 unless SPLIT)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)  # wrapped: unmasked loads, duplicates never stored
    rn = (offs_n % N).to(tl.int64)
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BLOCK_M, 1]
    q_rows = q_ptr + rn[:, None] * stride_qn  # [BLOCK_N, 1]
    s_rows = s_ptr + rn[:, None] * G
    z_rows = z_ptr + rn[:, None] * G
    m_rows = m_ptr + rn[:, None] * G
    if MAGIC:  # magic_dot's [BLOCK_N, BLOCK_M] sums, transposed once at the end
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo, k_hi = k_slice(pid_k, K, k_split, SPLIT)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if MAGIC:
            acc_t += magic_dot(q_rows, s_rows, z_rows, x_rows, x_rows, x_ptr, tl.zeros([BLOCK_M], dtype=tl.float32),
                               perm_ptr, k0, K, dtype, 0, False, GROUP, HAS_ZEROS, HAS_PERM, BLOCK_K, EVEN_K)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            cols = activation_cols(perm_ptr, offs_k, K, HAS_PERM, EVEN_K)
            if EVEN_K:
                x = tl.load(x_rows + cols[None, :])
            else:
                x = tl.load(x_rows + cols[None, :], mask=(offs_k < K)[None, :], other=0.0)
            w = dequant_tile(q_rows, s_rows, z_rows, m_rows, k0, K, dtype, BITS, GROUP, HAS_ZEROS, HAS_MINS,
                             SCALE_LATER, BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if MAGIC:
        acc = tl.trans(acc_t)
    if SCALE_LATER:  # linear: each slice's partial sums are scaled alike
        acc *= tl.load(s_ptr + rn * G).to(tl.float32)[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :]
        acc += tl.where(pid_k == 0, bias, 0.0) if SPLIT else bias  # once: by the first slice
    if SPLIT:  # fp32 partials [splits, M, N]
        y_ptrs = y_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
    else:
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def quant_matmul(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T (+ bias) for any M, W dequantized in registers; fp32 accumulation, output in
    x's dtype (to `out` if given: [M, N], last dim contiguous, not overlapping x)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported (float16, bfloat16, float32)")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
    check_quant_weight("x", x, w, x.shape[1], bias)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        _check_out("out", out, (m, n), x, (x, bias))
    if m == 0:
        return out
    cfg = gemm_config(x, w, config)
    k_split, splits = k_slices(k, cfg.block_k, cfg.split_k)
    y = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    q = w.qweight
    if cfg.magic:
        check_magic_dot(w, cfg.block_k, "GemmConfig(magic=True)")
    _quant_gemm_kernel[grid](
        x, q, w.scales, w.zeros if w.zeros is not None else q, w.mins if w.mins is not None else w.scales,
        w.perm if w.perm is not None else q,
        bias if bias is not None else x, y, m, n, k, w.num_groups, q.stride(0), k_split, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BITS=w.bits, GROUP=w.group_size, HAS_ZEROS=w.zeros is not None,
        HAS_MINS=w.mins is not None, HAS_PERM=w.perm is not None, SCALE_LATER=scale_later(w),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT=splits > 1, MAGIC=cfg.magic,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        split_k_sum(y, out)
    return out
