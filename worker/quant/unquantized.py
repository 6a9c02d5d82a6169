"""Dense weights in the model dtype: y = x @ W^T + b (cuBLAS), fused decode in kernels/gemv.py."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.worker.quant.base import LinearMethod


def _weight(layer: nn.Module) -> torch.Tensor:
    return cast(torch.Tensor, layer.weight)  # [out, in]


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return cast(torch.Tensor | None, layer.bias)  # [out] or None


class UnquantizedLinearMethod(LinearMethod):
    """weight [out, in] (nn.Linear layout, as checkpoints store it) and optionally bias [out]."""

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        return {"weight": (output_size, input_size)}

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | None) -> None:
        weight = torch.empty(output_size, input_size, dtype=dtype, device=device)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        bias_param = None
        if bias:
            bias_param = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device), requires_grad=False)
        layer.register_parameter("bias", bias_param)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _weight(layer), _bias(layer))

    # The fused entry points always use the Triton kernels (the model calls them on CUDA only; tests call
    # them on CPU under the Triton interpreter).
    def apply_skinny(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.gemv import skinny_matmul

        return skinny_matmul(x, _weight(layer), _bias(layer))

    def apply_add_rmsnorm(
        self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from tokenmill.kernels.gemv import add_rmsnorm_matmul

        return add_rmsnorm_matmul(h, residual, norm_weight, eps, _weight(layer), _bias(layer))

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.gemv import silu_mul_matmul

        return silu_mul_matmul(gate_up, _weight(layer), _bias(layer))
