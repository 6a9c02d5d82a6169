"""Per-row FP8 (e4m3) quantization of activations in one kernel: the input side of W8A8 matmuls through
torch._scaled_mm (worker/quant/fp8.py).

    fp8_quantize_rows(x [R, C]) -> (q e4m3 [R, C], scales float32 [R, 1])
        scale_r = max(max_c |x_rc| * fp32(1 / 448), 1e-12);  q_rc = e4m3(clamp(x_rc / scale_r, -448, 448))

exactly kernels/quant_weight.py `quantize_fp8_rows` (the reference: fp32 arithmetic, the scale a product with
the reciprocal as PyTorch's CUDA division by a scalar computes it, the quotients x / scale IEEE-rounded, the
cast rounding to nearest even). That torch version is ~8 kernels (a float copy, abs, amax, two divisions, two
clamps, the cast) and several passes over x; at batch 1 their launches cost more than the matmul's weight
bytes, 128 matmuls a step for Llama-3-8B. Here one program per row reads it once (rows up to
_MAX_SINGLE_PASS columns stay in registers; longer rows are read twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2, pdl_launch_args, pdl_release, pdl_wait
from .quant_weight import _FP8_MIN_SCALE, FP8, FP8_INV_MAX, FP8_MAX

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SINGLE_PASS = 16384  # columns a program keeps in registers (Llama-3-8B's widest input: 14,336)
_LOOP_BLOCK = 4096


@triton.jit
def _fp8_quantize_rows_kernel(
    x_ptr,  # [R, C], row stride stride_x, columns contiguous
    q_ptr,  # [R, C] e4m3, contiguous
    s_ptr,  # [R] float32 scales
    C, stride_x,
    FP8_MAX_: tl.constexpr, INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK >= C: one read of the row
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * C
    if SINGLE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < C
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) * INV_MAX, MIN_SCALE)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, C, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < C, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) * INV_MAX, MIN_SCALE)
        for start in range(0, C, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < C
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)
    pdl_release(PDL)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (fp16 / bf16 / fp32, columns contiguous) -> (q e4m3 [R, C] contiguous, scales float32 [R, 1]):
    `quantize_fp8_rows` in one kernel (see the module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"fp8_quantize_rows: x must be [rows, cols], got shape {tuple(x.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"fp8_quantize_rows: x dtype {x.dtype} is not one of {_SUPPORTED_DTYPES}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("fp8_quantize_rows: x's columns must be contiguous (x.stride(1) == 1)")
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return q, scales.fill_(_FP8_MIN_SCALE)
    single = cols <= _MAX_SINGLE_PASS
    block = next_pow2(cols) if single else _LOOP_BLOCK
    _fp8_quantize_rows_kernel[(rows,)](
        x, q, scales, cols, x.stride(0), FP8_MAX_=FP8_MAX, INV_MAX=FP8_INV_MAX, MIN_SCALE=_FP8_MIN_SCALE, BLOCK=block,
        SINGLE_PASS=single, num_warps=8 if block >= 4096 else 4, **pdl_launch_args(x.device))
    return q, scales
