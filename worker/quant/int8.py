"""W8A16 INT8: weights per output channel, symmetric (w ~ q * s, q in -127..127), activations in the model
dtype. Canonical tensors: qweight int8 [out, in], scales float32 [out, 1] (compressed-tensors' int-quantized
channel layout)."""

from __future__ import annotations

from typing import ClassVar, cast

import torch
from torch import nn

from tokenmill.kernels.quant_weight import PackedWeight
from tokenmill.worker.quant.packed import PackedLinearMethod, frozen, register_bias
from tokenmill.worker.quant.rtn import quantize_int8


class Int8LinearMethod(PackedLinearMethod):
    name: ClassVar[str] = "int8"

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        return {"qweight": (output_size, input_size), "scales": (output_size, 1)}

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | None) -> None:
        layer.register_parameter("qweight", frozen(torch.zeros(output_size, input_size, dtype=torch.int8,
                                                               device=device)))
        layer.register_parameter("scales", frozen(torch.ones(output_size, 1, dtype=torch.float32, device=device)))
        register_bias(layer, bias, output_size, dtype, device)

    def packed(self, layer: nn.Module) -> PackedWeight:
        q = cast(torch.Tensor, layer.qweight)
        return PackedWeight(q, cast(torch.Tensor, layer.scales), None, None, 8, q.shape[1])

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_int8(weight)
        return {"qweight": q, "scales": scales}
