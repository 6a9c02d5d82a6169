"""SwiGLU gate: silu_and_mul(x [..., 2I]) = silu(x[..., :I]) * x[..., I:]  -> [..., I] (fp32 compute).

x is [T, 2I] (row stride free, last dim contiguous), i.e. the output of a fused gate_up projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import pdl_launch_args, pdl_release, pdl_wait

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    inter,  # I
    stride_xt,
    stride_ot,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_ot + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    pdl_release(PDL)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I] in x's dtype (written to `out` if given)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I], got shape {tuple(x.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported (float16, bfloat16, float32)")
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (num_tokens, inter) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {(num_tokens, inter)} {x.dtype} on {x.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    elif out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dim, got strides {out.stride()}")
    if out.numel() == 0:
        return out
    grid = (num_tokens, triton.cdiv(inter, _BLOCK))
    _silu_and_mul_kernel[grid](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4, **pdl_launch_args(x.device)
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference (fp32 compute, one rounding)."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)
