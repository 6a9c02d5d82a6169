"""RMSNorm and fused residual-add + RMSNorm with HF Llama semantics.

x [N, H] or [N, M, H] (last dim contiguous, other strides free), weight [H].
    rmsnorm:      y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)         (fp32 statistics)
    add_rmsnorm:  r = (x + residual).to(x.dtype); y = rmsnorm(r); returns (y, r)
i.e. exactly HF's `hidden = residual + hidden` in the model dtype followed by LlamaRMSNorm, whose
normalised activations are rounded to the input dtype before the weight multiply. Outputs are
contiguous tensors in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2 as _next_pow2
from .launch import pdl_launch_args, pdl_release, pdl_wait

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SINGLE_PASS = 16384  # rows up to this many elements stay in registers (one read of x)
_LOOP_BLOCK = 4096


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [R0, R1, H] (R1 = 1 for 2-D input)
    res_ptr,  # same shape as x (HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [R0, R1, H] contiguous
    res_out_ptr,  # [R0, R1, H] contiguous (HAS_RESIDUAL)
    n_rows1,  # R1
    n_cols,  # H
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK >= H: the whole row lives in registers
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    i0 = tl.program_id(0).to(tl.int64)
    i1 = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + i0 * stride_x0 + i1 * stride_x1
    r_row = res_ptr + i0 * stride_r0 + i1 * stride_r1
    out_row = out_ptr + (i0 * n_rows1 + i1) * n_cols
    ro_row = res_out_ptr + (i0 * n_rows1 + i1) * n_cols
    dtype = x_ptr.dtype.element_ty
    if SINGLE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            xr = (x + r).to(dtype)  # the new residual, rounded to the model dtype
            tl.store(ro_row + offs, xr, mask=mask)
            x = xr.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd).to(dtype).to(tl.float32) * w
        tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # pass 1: sum of squares (writing the new residual); pass 2: normalise (re-reading, mostly from L2)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
                xr = (x + r).to(dtype)
                tl.store(ro_row + offs, xr, mask=mask)
                x = xr.to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, 0) / n_cols + eps)
        tl.debug_barrier()  # pass 2 re-reads the residual pass 1 stored
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_cols
            if HAS_RESIDUAL:
                x = tl.load(ro_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x * rstd).to(dtype).to(tl.float32) * w
            tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    pdl_release(PDL)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} must be [N, H] or [N, M, H], got shape {tuple(x.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} not supported (float16, bfloat16, float32)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [H={x.shape[-1]}], got {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, {name} on {x.device}")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError(f"{name} and weight must be contiguous in the last dim, got {x.stride()}, {weight.stride()}")


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n_cols = x.shape[-1]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [R0, R1, H]
    r3 = None if residual is None else (residual if residual.dim() == 3 else residual.unsqueeze(1))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out, res_out
    block = _next_pow2(n_cols)
    single = block <= _MAX_SINGLE_PASS
    if not single:
        block = _LOOP_BLOCK
    num_warps = min(16, max(1, block // 512))
    r_arg = x3 if r3 is None else r3
    _rmsnorm_kernel[(x3.shape[0], x3.shape[1])](
        x3, r_arg, weight, out, res_out if res_out is not None else out,
        x3.shape[1], n_cols, x3.stride(0), x3.stride(1), r_arg.stride(0), r_arg.stride(1), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, SINGLE_PASS=single, num_warps=num_warps,
        **pdl_launch_args(x.device),
    )  # fmt: skip
    return out, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [N, H] / [N, M, H] with weight [H]; returns a new contiguous tensor in x's dtype."""
    _check("x", x, weight)
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual), the sum rounded to x's dtype (fp32 compute)."""
    _check("x", x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x ({tuple(x.shape)} {x.dtype} {x.device}), got "
            f"{tuple(residual.shape)} {residual.dtype} {residual.device}"
        )
    if residual.stride(-1) != 1:
        raise ValueError(f"residual must be contiguous in the last dim, got strides {residual.stride()}")
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm, output in x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(new_residual, weight, eps), new_residual
