"""Tiled matmul over weight-only quantized weights (INT8 / INT4, kernels/quant_weight.py) for batches of more
tokens than the skinny decode kernels take (prefill, large decode batches):

    quant_matmul(x [M, K], w, bias [N] | None) -> y [M, N] = x @ W.T (+ bias)

One program computes a BLOCK_M x BLOCK_N tile of y over the whole K range: per K step it loads an x tile
(columns gathered through perm for act-order weights), the packed weight tile (dequantized in registers to
x's dtype by `dequant_tile`) and accumulates tl.dot in fp32; per-channel symmetric weights are scaled once in
the epilogue, then the bias, one rounding to x's dtype. Programs are ordered in groups of GROUP_M row tiles
(the weight tiles of a group stay in L2 while its row tiles pass). Launch shapes come from `default_gemm_config`
(a rule on M; tuning on the GPU: benchmarks/gpu_quant.py) or a per-call `config=GemmConfig(...)`.

Reference: quant_weight.quant_matmul_ref (the weight dequantized in fp32, rounded once, then F.linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gemv import _check_out
from tokenmill.kernels.launch import next_pow2
from tokenmill.kernels.quant_gemv import check_quant_weight, dequant_tile
from tokenmill.kernels.quant_weight import PackedWeight, scale_later

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of `_quant_gemm_kernel`: output tile block_m x block_n, K step block_k (a multiple of 8),
    group_m row tiles per L2 group."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError("num_stages and group_m must be >= 1")


def default_gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """128 x 128 x 64 tiles from M = 128 on, smaller row tiles below (fewer padded rows)."""
    block_m = max(16, min(128, next_pow2(m)))
    block_n = 128 if block_m >= 64 else 64
    return GemmConfig(block_m, min(block_n, max(16, next_pow2(n))), min(64, max(16, next_pow2(k))),
                      num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K], row stride stride_xm
    q_ptr, s_ptr, z_ptr, m_ptr, perm_ptr,  # the PackedWeight's tensors (z / m / perm: HAS_ZEROS / HAS_MINS / HAS_PERM)
    b_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N], row stride stride_ym
    M, N, K, G, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_MINS: tl.constexpr, HAS_PERM: tl.constexpr, SCALE_LATER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
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
    q_rows = q_ptr + rn[:, None] * (K // 8 if BITS == 4 else K)  # [BLOCK_N, 1]
    s_rows = s_ptr + rn[:, None] * G
    z_rows = z_ptr + rn[:, None] * G
    m_rows = m_ptr + rn[:, None] * G
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        cols = offs_k
        if HAS_PERM:
            if EVEN_K:
                cols = tl.load(perm_ptr + offs_k)
            else:
                cols = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :])
        else:
            x = tl.load(x_rows + cols[None, :], mask=(offs_k < K)[None, :], other=0.0)
        w = dequant_tile(q_rows, s_rows, z_rows, m_rows, k0, K, dtype, BITS, GROUP, HAS_ZEROS, HAS_MINS,
                         SCALE_LATER, BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if SCALE_LATER:
        acc *= tl.load(s_ptr + rn * G).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
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
    cfg = config or default_gemm_config(m, n, k)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    q = w.qweight
    _quant_gemm_kernel[grid](
        x, q, w.scales, w.zeros if w.zeros is not None else q, w.mins if w.mins is not None else w.scales,
        w.perm if w.perm is not None else q,
        bias if bias is not None else x, out, m, n, k, w.num_groups, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BITS=w.bits, GROUP=w.group_size, HAS_ZEROS=w.zeros is not None,
        HAS_MINS=w.mins is not None, HAS_PERM=w.perm is not None, SCALE_LATER=scale_later(w),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
