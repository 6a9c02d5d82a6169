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

Two fused variants take the op before the matmul into the same program, as kernels/rmsnorm.py and
kernels/activation.py compute it (the same roundings to the activation dtype), so their q and scales equal the
unfused pair's bit for bit and one kernel a matmul disappears:
    fp8_add_rmsnorm_quantize(h, residual, weight, eps) -> (q, scales, r)   r = h + residual (or h)
    fp8_silu_mul_quantize(gate_up [R, 2I]) -> (q, scales)                 of silu(gate) * up
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
FUSED_MAX_COLS = _MAX_SINGLE_PASS  # the fused variants keep their row in registers


@triton.jit
def _quantize_row(x, q_row, offs, mask, FP8_MAX_: tl.constexpr, INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Store e4m3(x / scale) of one row held in registers (x [BLOCK] float32, zeros where masked); returns the
    scale max|x| * INV_MAX (at least MIN_SCALE)."""
    scale = tl.maximum(tl.max(tl.abs(x), 0) * INV_MAX, MIN_SCALE)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_)
    tl.store(q_row + offs, q.to(q_row.dtype.element_ty), mask=mask)
    return scale


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
        scale = _quantize_row(x, q_row, offs, mask, FP8_MAX_, INV_MAX, MIN_SCALE)
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


@triton.jit
def _fp8_prologue_quantize_kernel(
    x_ptr,  # [R, C] (NORM: h; else [R, 2C] gate | up), row stride stride_x, columns contiguous
    res_ptr,  # [R, C] residual, row stride stride_r (NORM and HAS_RESIDUAL)
    w_ptr,  # [C] norm weight (NORM)
    r_out_ptr,  # [R, C] contiguous: h + residual in x's dtype (NORM)
    q_ptr,  # [R, C] e4m3, contiguous
    s_ptr,  # [R] float32 scales
    C, stride_x, stride_r, eps,
    FP8_MAX_: tl.constexpr, INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,  # >= C: one read of the row
    NORM: tl.constexpr,  # True: (residual add +) RMSNorm (kernels/rmsnorm.py); False: SwiGLU (kernels/activation.py)
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < C
    x_row = x_ptr + row * stride_x
    dtype = x_ptr.dtype.element_ty
    if NORM:
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            xr = (x + r).to(dtype)  # the new residual, rounded to the model dtype
            tl.store(r_out_ptr + row * C + offs, xr, mask=mask)
            x = xr.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / C + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype)
    else:
        gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + C + offs, mask=mask, other=0.0).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    scale = _quantize_row(y.to(tl.float32), q_ptr + row * C, offs, mask, FP8_MAX_, INV_MAX, MIN_SCALE)
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


def _check_rows(name: str, x: torch.Tensor, cols: int) -> None:
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"{name} must be [rows, {cols}], got shape {tuple(x.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} is not one of {_SUPPORTED_DTYPES}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}'s columns must be contiguous (stride(1) == 1)")


def _launch_prologue(x: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor | None, cols: int, eps: float,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if cols > FUSED_MAX_COLS:
        raise ValueError(f"fused fp8 quantization keeps a row in registers: at most {FUSED_MAX_COLS} columns, "
                         f"got {cols}")
    rows = x.shape[0]
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    r_out = torch.empty((rows, cols), dtype=x.dtype, device=x.device) if res is not None else None
    if rows == 0:
        return q, scales, r_out
    block = next_pow2(cols)
    _fp8_prologue_quantize_kernel[(rows,)](
        x, x if res is None else res, x if w is None else w, x if r_out is None else r_out, q, scales, cols,
        x.stride(0), 0 if res is None else res.stride(0), float(eps), FP8_MAX_=FP8_MAX, INV_MAX=FP8_INV_MAX,
        MIN_SCALE=_FP8_MIN_SCALE, BLOCK=block, NORM=w is not None, HAS_RESIDUAL=res is not None,
        num_warps=8 if block >= 4096 else 4, **pdl_launch_args(x.device))  # fmt: skip
    return q, scales, r_out


def fp8_add_rmsnorm_quantize(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scales, r): r = h + residual rounded to h's dtype (r is h when residual is None), and the e4m3 rows
    and float32 [R, 1] scales of rmsnorm(r) * weight (kernels/rmsnorm.py's numerics), as fp8_quantize_rows
    quantizes them; h, residual [R, C] with C <= 16384, weight [C]."""
    cols = h.shape[-1]
    _check_rows("h", h, cols)
    if residual is not None:
        _check_rows("residual", residual, cols)
        if residual.shape != h.shape or residual.dtype != h.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match h {tuple(h.shape)} "
                             f"{h.dtype}")
    if weight.shape != (cols,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{cols}] tensor, got {tuple(weight.shape)}")
    q, scales, r_out = _launch_prologue(h, residual, weight, cols, eps)
    return q, scales, h if r_out is None else r_out


def fp8_silu_mul_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of silu(gate) * up (kernels/activation.py's numerics, rounded to gate_up's dtype) for
    gate_up [R, 2I] = [gate | up], I <= 16384, as fp8_quantize_rows quantizes it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * I], got shape {tuple(gate_up.shape)}")
    cols = gate_up.shape[1] // 2
    _check_rows("gate_up", gate_up, 2 * cols)
    q, scales, _ = _launch_prologue(gate_up, None, None, cols, 0.0)
    return q, scales
