"""FP8 W8A8 (e4m3): weights per output channel (w ~ q * s_w), activations quantized per token at run time
(x ~ q_x * s_x, s_x = max|x_row| / 448), on a GPU with FP8 tensor cores (CUDA compute capability >= 8.9:
Ada, Hopper and later): one activation-quantizing kernel (kernels/fp8_quant.py; in few-token decode it also
computes the RMSNorm or SwiGLU before the matmul) and one torch._scaled_mm per matmul, or with
KernelConfig.fp8_skinny (off by default: slower so far) for up to 16 tokens one Triton kernel that
also quantizes the activations and fuses the RMSNorm / SwiGLU before it (kernels/fp8_gemv.py). Canonical tensors:
qweight float8_e4m3fn [out, in], scales float32 [out, 1].

Elsewhere the method refuses to build, with one exception: `emulate=True` (accuracy studies and tests on the
CPU) computes the same quantization in plain torch, x and W rounded to e4m3 and multiplied in fp32. The engine
never asks for it. FP8 KV cache: `check_kv_cache_dtype` (the cache itself: worker/attention/kv_scales.py).
"""

from __future__ import annotations

import functools
from typing import ClassVar, cast

import torch
from torch import nn

from tokenmill.kernels import config as kernel_config
from tokenmill.kernels.quant_weight import FP8, fp8_matmul_ref, quantize_fp8_rows
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.packed import SKINNY_MAX_ROWS, frozen, layer_bias, register_bias

KV_CACHE_DTYPES = ("auto", "fp8")


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """The unit scale of a tensor-wise torch._scaled_mm operand (float32, one element, on `device`)."""
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores (torch._scaled_mm): CUDA compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return f"the {device.type} device"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def require_fp8(device: torch.device, what: str, instead: str) -> None:
    """ValueError unless `device` has FP8 tensor cores; the message ends with `instead` (what to use)."""
    if not fp8_supported(device):
        raise ValueError(f"{what} needs a GPU with FP8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper "
                         f"or later); {_device_name(device)} has none. {instead}")


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    """ValueError for an FP8 KV cache on a device without FP8 (the CPU engine included: its kernels' e4m3 path is
    the Triton one; the torch reference reads fp8 caches only for tests and accuracy studies)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use {' or '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "fp8":
        require_fp8(device, "--kv-cache-dtype fp8", "Use --kv-cache-dtype auto (the model dtype)")


class Fp8LinearMethod(LinearMethod):
    name: ClassVar[str] = "fp8"

    def __init__(self, device: torch.device, *, emulate: bool = False) -> None:
        if not emulate:
            require_fp8(torch.device(device), "FP8 W8A8 (--quantization fp8)", "Use --quantization int8 or int4")
        self.emulate = emulate

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        return {"qweight": (output_size, input_size), "scales": (output_size, 1)}

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | None) -> None:
        if not self.emulate and (input_size % 16 or output_size % 16):
            raise ValueError(f"FP8 matmuls (torch._scaled_mm) need in and out features divisible by 16, got "
                             f"{input_size} -> {output_size}")
        layer.register_parameter("qweight", frozen(torch.zeros(output_size, input_size, dtype=FP8, device=device)))
        layer.register_parameter("scales", frozen(torch.ones(output_size, 1, dtype=torch.float32, device=device)))
        register_bias(layer, bias, output_size, dtype, device)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_fp8_rows(weight)
        return {"qweight": q, "scales": scales}

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        q, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        x2 = x.reshape(-1, x.shape[-1])
        if self.emulate:
            y = fp8_matmul_ref(x2, q, scales, layer_bias(layer))
        elif x2.shape[0] <= SKINNY_MAX_ROWS and self._skinny():  # one fused kernel instead of ~9
            from tokenmill.kernels.fp8_gemv import fp8_skinny_matmul

            y = fp8_skinny_matmul(x2.contiguous(), q, scales, layer_bias(layer))
        else:
            y = self._scaled_mm(x2, q, scales, layer_bias(layer))
        return y.reshape(*x.shape[:-1], q.shape[0])

    def _skinny(self) -> bool:
        """Whether few-token matmuls take the fused kernel (kernels/fp8_gemv.py): KernelConfig.fp8_skinny, never
        in the emulation."""
        return not self.emulate and kernel_config.current().fp8_skinny

    # fused few-token decode (kernels/fp8_gemv.py) when _skinny(); None: the unfused path
    def apply_skinny(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return self.apply(layer, x) if self._skinny() else None

    # Few-token decode (forward_norm / forward_silu_mul): the op before the matmul fused into the activation
    # quantization (kernels/fp8_quant.py: one kernel instead of two, the same bits), or with fp8_skinny into the
    # whole matmul; None (the unfused path) in the emulation.
    def apply_add_rmsnorm(
        self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.emulate or h.dim() != 2:
            return None
        q, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        if self._skinny():
            from tokenmill.kernels.fp8_gemv import fp8_add_rmsnorm_matmul

            return fp8_add_rmsnorm_matmul(h, residual, norm_weight, eps, q, scales, layer_bias(layer))
        from tokenmill.kernels.fp8_quant import FUSED_MAX_COLS, fp8_add_rmsnorm_quantize  # Triton: on a GPU

        if h.shape[1] > FUSED_MAX_COLS:
            return None
        qx, sx, r = fp8_add_rmsnorm_quantize(h, residual, norm_weight, eps)
        return self._matmul_quantized(qx, sx, q, scales, layer_bias(layer), h.dtype), r

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        if self.emulate or gate_up.dim() != 2:
            return None
        q, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        if self._skinny():
            from tokenmill.kernels.fp8_gemv import fp8_silu_mul_matmul

            return fp8_silu_mul_matmul(gate_up, q, scales, layer_bias(layer))
        from tokenmill.kernels.fp8_quant import FUSED_MAX_COLS, fp8_silu_mul_quantize

        if gate_up.shape[1] > 2 * FUSED_MAX_COLS:
            return None
        qx, sx = fp8_silu_mul_quantize(gate_up)
        return self._matmul_quantized(qx, sx, q, scales, layer_bias(layer), gate_up.dtype)

    @staticmethod
    def _scaled_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """e4m3 GEMM of x quantized per token (one kernel: kernels/fp8_quant.py) with the weight, then the
        bias and the cast to x's dtype. Several tokens: row-wise scaling, scale_a [M, 1] x scale_b [1, N] (bf16
        output, as cuBLASLt's row-wise scaling requires). One token (batch-1 decode): its scale is the whole
        activation's, so the GEMM is cuBLASLt's tensor-wise one (1.4-1.8x bf16's speed at M = 1 on the H200,
        where row-wise runs at 0.86-1.4x: ../shared/GPU.md) with a float32 output, and the channel scales,
        the bias and the one rounding follow it."""
        from tokenmill.kernels.fp8_quant import fp8_quantize_rows  # Triton: imported where a GPU runs it

        qx, sx = fp8_quantize_rows(x)
        return Fp8LinearMethod._matmul_quantized(qx, sx, q, scales, bias, x.dtype)

    @staticmethod
    def _matmul_quantized(qx: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """[M, N] in `dtype` from activations already quantized (qx e4m3 [M, K], sx float32 [M, 1])."""
        if qx.shape[0] == 1:
            y32 = torch._scaled_mm(qx, q.t(), scale_a=sx.reshape(()), scale_b=_one(qx.device),
                                   out_dtype=torch.float32)  # [1, N] = sum q_x q_w * s_x
            y = torch.empty(y32.shape, dtype=dtype, device=qx.device)  # one kernel: * s_w (+ bias), one rounding
            if bias is None:
                return torch.mul(y32, scales.reshape(1, -1), out=y)
            return torch.addcmul(bias, y32, scales.reshape(1, -1), out=y)
        y = torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=scales.reshape(1, -1), out_dtype=torch.bfloat16)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(dtype)
