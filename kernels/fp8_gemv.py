"""Skinny FP8 W8A8 matmuls for decode (M <= 16 tokens), one kernel each, the input producers of kernels/gemv.py
fused in front:

    fp8_skinny_matmul(x [M, K], qweight [N, K] e4m3, scales [N, 1], bias)   y = W8A8(x) @ W.T + bias
    fp8_add_rmsnorm_matmul(h, residual, norm_weight, eps, qweight, scales)  (W8A8(rmsnorm(h + residual)) @ W.T, r)
    fp8_silu_mul_matmul(gu [M, 2I], qweight [N, I], scales)                 W8A8(silu(gate) * up) @ W.T

W8A8 as kernels/quant_weight.py fp8_matmul_ref defines it (worker/quant/fp8.py's method): the activations
quantized per token at run time (x ~ q_x * s_x, s_x = max|x_row| / 448, the row as rounded to the activations'
dtype), the weight per output channel (w ~ q * s_w), e4m3 products summed in fp32 on tensor cores, then
y = sum * s_w * s_x (+ bias), one rounding. The unfused path (quantize_fp8_rows + torch._scaled_mm) is ~9
kernels per matmul: at batch 1 their launches, not the weight bytes, set the decode step's time. Here each
program first walks K once for its rows' max |x| (after the prologue: RMSNorm statistics first, as
kernels/gemv.py), then streams BLOCK_N weight rows once, quantizing each x tile in registers. Launch shapes:
kernels/gemv.py's default rule for 1-byte weights, always the tl.dot variant (BLOCK_M >= 16, K steps >= 32:
the fp8 mma's).

The reference is fp8_matmul_ref after the unfused prologue (rmsnorm_ref / silu_and_mul_ref): the same
quantization; the sums differ by their order and by where the scales are applied (after the sum here, before
it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.activation import silu_and_mul_ref
from tokenmill.kernels.gemv import (
    SkinnyConfig,
    _check_act,
    _check_norm_args,
    _check_norm_outs,
    _check_out,
    _stats_block,
    _x_tile,
    alloc_outputs,
    check_bias,
    default_config,
    row_rstd,
)
from tokenmill.kernels.launch import next_pow2, num_sms, pdl_launch_args, pdl_release, pdl_wait
from tokenmill.kernels.quant_weight import FP8, fp8_matmul_ref
from tokenmill.kernels.rmsnorm import add_rmsnorm_ref, rmsnorm_ref

_PLAIN, _NORM, _SILU = 0, 1, 2  # PROLOGUE modes, as in kernels/gemv.py


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,  # [M, K] activations (PLAIN: x, NORM: h, SILU: gu [M, 2K]); row stride stride_xm
    res_ptr,  # [M, K] residual (NORM with HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight (NORM)
    q_ptr,  # [N, K] e4m3 weight, contiguous
    ws_ptr,  # [N] float32 weight scales
    b_ptr,  # [N] bias (HAS_BIAS)
    y_ptr,  # [M, N] output, row stride stride_ym
    res_out_ptr,  # [M, K] new residual (NORM with HAS_RESIDUAL), written by program 0
    M, N, K, stride_xm, stride_rm, stride_ym, stride_om, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr, EVEN_KS: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_K)
    rn = (offs_n % N).to(tl.int64)  # wrapped rows: unmasked loads, duplicates never stored
    rm = (offs_m % M).to(tl.int64)
    q_rows = q_ptr + rn[:, None] * K  # [BLOCK_N, 1]
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BLOCK_M, 1]
    r_rows = res_ptr + rm[:, None] * stride_rm
    pdl_wait(PDL)

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:  # RMSNorm statistics first (program 0 stores the new residual)
        ro_mask = (offs_m < M)[:, None] & (pid == 0)
        ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_om
        rstd = row_rstd(x_rows, r_rows, ro_rows, ro_mask, K, eps, dtype, HAS_RESIDUAL, BLOCK_M, STATS_BLOCK,
                        EVEN_KS, NUM_STAGES)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)  # max |x| per token, x as rounded to dtype
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + offs_kb
        x = _x_tile(x_rows, r_rows, nw_ptr, rstd, offs_k, (offs_k < K)[None, :], K, dtype, PROLOGUE, HAS_RESIDUAL,
                    EVEN_K)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
    x_scale = tl.maximum(amax / 448.0, 1e-12)  # [BLOCK_M]

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + offs_kb
        x = _x_tile(x_rows, r_rows, nw_ptr, rstd, offs_k, (offs_k < K)[None, :], K, dtype, PROLOGUE, HAS_RESIDUAL,
                    EVEN_K)
        xq = tl.clamp(x.to(tl.float32) / x_scale[:, None], -448.0, 448.0).to(tl.float8e4nv)  # [BLOCK_M, BLOCK_K]
        if EVEN_K:
            w = tl.load(q_rows + offs_k[None, :])
        else:
            w = tl.load(q_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(xq), acc)  # [BLOCK_N, BLOCK_M]
    acc = acc * tl.load(ws_ptr + rn).to(tl.float32)[:, None] * x_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])
    pdl_release(PDL)


def _check_fp8_weight(name: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, k: int,
                      bias: torch.Tensor | None) -> None:
    if qweight.dtype != FP8 or qweight.dim() != 2 or qweight.shape[1] != k or qweight.shape[0] == 0:
        raise ValueError(f"qweight must be a float8_e4m3fn [N, K={k}] tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous, got strides {qweight.stride()}")
    n = qweight.shape[0]
    if scales.dtype != torch.float32 or scales.numel() != n or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float32 [N={n}, 1], got {scales.dtype} {tuple(scales.shape)}")
    for what, t in (("qweight", qweight), ("scales", scales)):
        if t.device != x.device:
            raise ValueError(f"{what} is on {t.device}, {name} on {x.device}")
    check_bias(bias, n, x)


def _config(m: int, n: int, k: int, device: torch.device, config: SkinnyConfig | None) -> SkinnyConfig:
    """The launch shape: `config` or kernels/gemv.py's rule for 1-byte weights at M >= 2 (its M = 1 rule is the
    FMA kernel's: 16 rows per program, so each program's fixed cost, the RMSNorm and max |x| passes over K, is
    spread over 16 weight rows only), as the tl.dot variant with K steps of at least 32 (the fp8 mma's K)."""
    cfg = config or default_config(max(m, 2), n, k, 1, num_sms(device))
    if not cfg.use_dot or cfg.block_k < 32 or cfg.block_n < 16:
        cfg = SkinnyConfig(max(16, cfg.block_n), max(32, cfg.block_k), cfg.num_warps, cfg.num_stages)
    return cfg


def _launch(prologue: int, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None, res_out: torch.Tensor | None, config: SkinnyConfig | None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    m = x.shape[0]
    n, k = qweight.shape
    out, res_out = alloc_outputs(x, n, k, residual, out, res_out)
    if m == 0:
        return out, res_out
    cfg = _config(m, n, k, x.device, config)
    block_m = max(16, next_pow2(m))
    stats_block = _stats_block(block_m, k, cfg) if prologue == _NORM else 16
    r_arg = residual if residual is not None else x
    ro_arg = res_out if res_out is not None else out
    _fp8_skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, r_arg, norm_weight if norm_weight is not None else x, qweight, scales, bias if bias is not None else x,
        out, ro_arg, m, n, k, x.stride(0), r_arg.stride(0), out.stride(0), ro_arg.stride(0), float(eps),
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        STATS_BLOCK=stats_block, EVEN_KS=k % stats_block == 0, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_args(x.device),
    )  # fmt: skip
    return out, res_out


def fp8_skinny_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                      *, out: torch.Tensor | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """y [M, N] = W8A8(x [M, K]) @ W.T (+ bias [N]) for M <= 16: x quantized per token to e4m3 in the kernel,
    qweight float8_e4m3fn [N, K] with float32 scales [N, 1] per output channel; output in x's dtype."""
    _check_act("x", x)
    _check_fp8_weight("x", x, qweight, scales, x.shape[1], bias)
    if out is not None:
        _check_out("out", out, (x.shape[0], qweight.shape[0]), x, (x, bias))
    return _launch(_PLAIN, x, None, None, 0.0, qweight, scales, bias, out, None, config)[0]


def fp8_add_rmsnorm_matmul(
    h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, qweight: torch.Tensor,
    scales: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None, config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8A8(rmsnorm(r)) @ W.T (+ bias), r), r = (h + residual) rounded to h's dtype or r = h; as
    kernels/gemv.add_rmsnorm_matmul with an FP8 weight."""
    _check_norm_args(h, residual, norm_weight)
    _check_fp8_weight("h", h, qweight, scales, h.shape[1], bias)
    _check_norm_outs(h, residual, out, residual_out, qweight.shape[0], (h, residual, norm_weight, bias))
    y, res_out = _launch(_NORM, h, residual, norm_weight, eps, qweight, scales, bias, out, residual_out, config)
    return y, (h if res_out is None else res_out)


def fp8_silu_mul_matmul(gu: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                        config: SkinnyConfig | None = None) -> torch.Tensor:
    """W8A8(silu(gu[:, :I]) * gu[:, I:]) @ W [N, I].T (+ bias) for gu [M, 2I], M <= 16."""
    _check_act("gu", gu)
    if gu.shape[1] % 2:
        raise ValueError(f"gu must be [M, 2I], got shape {tuple(gu.shape)}")
    _check_fp8_weight("gu", gu, qweight, scales, gu.shape[1] // 2, bias)
    if out is not None:
        _check_out("out", out, (gu.shape[0], qweight.shape[0]), gu, (gu, bias))
    return _launch(_SILU, gu, None, None, 0.0, qweight, scales, bias, out, None, config)[0]


# ---------------------------------------------------------------------------------------------------------
# references: the unfused sequences, W8A8 as kernels/quant_weight.py fp8_matmul_ref emulates it
# ---------------------------------------------------------------------------------------------------------


def fp8_add_rmsnorm_matmul_ref(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                               qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if residual is None:
        x, new_residual = rmsnorm_ref(h, norm_weight, eps), h
    else:
        x, new_residual = add_rmsnorm_ref(h, residual, norm_weight, eps)
    return fp8_matmul_ref(x, qweight, scales, bias), new_residual


def fp8_silu_mul_matmul_ref(gu: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    return fp8_matmul_ref(silu_and_mul_ref(gu), qweight, scales, bias)
