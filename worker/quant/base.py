"""The quantization hook of linear layers: a LinearMethod owns a layer's weights and its matmuls.

A `Linear` (worker/models/layers.py) holds no weights of its own: its method registers them
(`create_weights`) and multiplies by them (`apply`). One method per weight format (worker/quant/).

Few-token decode steps on CUDA (worker/models/llama.py, SKINNY_MAX_TOKENS) call three fused entry points,
each a kernel that reads the weights once and computes its own input on the fly: the plain matmul, the
residual add + RMSNorm before it, or the SwiGLU product before it (kernels/gemv.py for dense weights). A
method without such a kernel for its format keeps the defaults here, which return None; the layer then
runs the same ops unfused through `apply`. So the decode path never reads a weight behind the method's
back: a format without fused kernels loses the fusion, never its weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    """Storage and matmul of one weight format for `Linear` layers (one instance may serve many layers:
    all per-layer state lives on the layer)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | None) -> None:
        """Register on `layer` the parameters of an input_size -> output_size map (activations in `dtype`)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype (+ bias when the layer has one)."""

    # -- fused few-token decode: x has M <= 16 rows (kernels/gemv.py MAX_TOKENS). None: no kernel ----------
    def apply_skinny(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """apply(x) for x [M, in] in a kernel made for few rows, or None."""
        return None

    def apply_add_rmsnorm(
        self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(apply(rmsnorm(r) * norm_weight), r) in one kernel, with r = (h + residual) rounded to h's dtype
        (r = h when residual is None); h [M, in]. Or None."""
        return None

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        """apply(silu(gate) * up) in one kernel, for gate_up [M, 2 * in] = [gate | up]. Or None."""
        return None
