"""The matmuls shared by the weight-only formats (INT8, INT4): the layer's tensors form a PackedWeight
(kernels/quant_weight.py); on CUDA the Triton kernels dequantize it in registers (kernels/quant_gemv.py for
M <= 16 rows and the fused decode entry points, kernels/quant_gemm.py above), elsewhere the torch reference
dequantizes it in fp32 and calls F.linear."""

from __future__ import annotations

from abc import abstractmethod
from typing import cast

import torch
from torch import nn

from tokenmill.worker.quant.base import LinearMethod

SKINNY_MAX_ROWS = 16  # kernels/quant_gemv.py takes M <= 16; larger batches go to the tiled kernel


def frozen(data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=False)


def register_bias(layer: nn.Module, bias: bool, output_size: int, dtype: torch.dtype,
                  device: torch.device | None) -> None:
    """layer.bias: [output_size] zeros in the activation dtype, or None."""
    layer.register_parameter("bias", frozen(torch.zeros(output_size, dtype=dtype, device=device)) if bias else None)


def layer_bias(layer: nn.Module) -> torch.Tensor | None:
    return cast(torch.Tensor | None, layer.bias)


class PackedLinearMethod(LinearMethod):
    """Base of the weight-only formats: subclasses register the tensors and say how they form a PackedWeight."""

    @abstractmethod
    def packed(self, layer: nn.Module) -> object:
        """The layer's PackedWeight (views of its parameters, no copy)."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.quant_weight import quant_matmul_ref

        w = self.packed(layer)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if not x.is_cuda:
            y = quant_matmul_ref(x2, w, layer_bias(layer))  # type: ignore[arg-type]
        elif x2.shape[0] <= SKINNY_MAX_ROWS:
            from tokenmill.kernels.quant_gemv import quant_skinny_matmul

            y = quant_skinny_matmul(x2.contiguous(), w, layer_bias(layer))  # type: ignore[arg-type]
        else:
            from tokenmill.kernels.quant_gemm import quant_matmul

            y = quant_matmul(x2.contiguous(), w, layer_bias(layer))  # type: ignore[arg-type]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    # fused decode entry points: always the Triton kernels (the model calls them on CUDA; tests on CPU under
    # the interpreter)
    def apply_skinny(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.quant_gemv import quant_skinny_matmul

        return quant_skinny_matmul(x, self.packed(layer), layer_bias(layer))  # type: ignore[arg-type]

    def apply_add_rmsnorm(
        self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from tokenmill.kernels.quant_gemv import quant_add_rmsnorm_matmul

        return quant_add_rmsnorm_matmul(h, residual, norm_weight, eps, self.packed(layer),  # type: ignore[arg-type]
                                        layer_bias(layer))

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.quant_gemv import quant_silu_mul_matmul

        return quant_silu_mul_matmul(gate_up, self.packed(layer), layer_bias(layer))  # type: ignore[arg-type]
