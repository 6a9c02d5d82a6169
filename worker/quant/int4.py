"""W4A16 INT4, group-wise: one scale (and for asymmetric weights one zero point) per `group_size` input columns,
activations in the model dtype. Canonical tensors (the layout of kernels/quant_weight.py):
    qweight int32 [out, in / 8], scales [out, ceil(in / g)] (float16; float32 in float32 models),
    zeros uint8 [out, ceil(in / g)] (asymmetric only), perm int32 [in] (act-order only, shared by the parts of
    a fused layer: they have one input, hence one Hessian and one GPTQ column order)."""

from __future__ import annotations

from typing import ClassVar, cast

import torch
from torch import nn

from tokenmill.kernels.quant_weight import PACK, PackedWeight, pack_int4
from tokenmill.worker.quant.packed import PackedLinearMethod, frozen, register_bias
from tokenmill.worker.quant.rtn import MseClip, quantize_int4, scale_dtype_for


class Int4LinearMethod(PackedLinearMethod):
    name: ClassVar[str] = "int4"
    shared_params: ClassVar[frozenset[str]] = frozenset({"perm"})

    def __init__(self, group_size: int = 128, symmetric: bool = True, act_order: bool = False) -> None:
        self.group_size = group_size
        self.symmetric = symmetric
        self.act_order = act_order

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        groups = -(-input_size // self.group_size)
        shapes: dict[str, tuple[int, ...]] = {"qweight": (output_size, input_size // PACK),
                                              "scales": (output_size, groups)}
        if not self.symmetric:
            shapes["zeros"] = (output_size, groups)
        if self.act_order:
            shapes["perm"] = (input_size,)
        return shapes

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | None) -> None:
        if input_size % PACK:
            raise ValueError(f"INT4 packs {PACK} input columns per int32: in_features {input_size} is not a "
                             f"multiple of {PACK}")
        shapes = self.param_shapes(input_size, output_size)
        layer.register_parameter("qweight", frozen(torch.zeros(shapes["qweight"], dtype=torch.int32, device=device)))
        layer.register_parameter("scales", frozen(torch.ones(shapes["scales"], dtype=scale_dtype_for(dtype),
                                                             device=device)))
        zeros = torch.full(shapes["scales"], 8, dtype=torch.uint8, device=device) if not self.symmetric else None
        layer.register_parameter("zeros", None if zeros is None else frozen(zeros))
        perm = torch.arange(input_size, dtype=torch.int32, device=device) if self.act_order else None
        layer.register_parameter("perm", None if perm is None else frozen(perm))
        register_bias(layer, bias, output_size, dtype, device)

    def packed(self, layer: nn.Module) -> PackedWeight:
        return PackedWeight(cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales),
                            cast(torch.Tensor | None, layer.zeros), cast(torch.Tensor | None, layer.perm), 4,
                            self.group_size)

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype | None = None,
                 clip: MseClip | None = None) -> dict[str, torch.Tensor]:
        """Round to nearest (no act-order: the permutation comes from GPTQ, worker/quant/gptq.py). Scales in
        `scale_dtype` (default: what this method stores for the weight's dtype; checkpoints: float16); `clip`:
        each group's range by least squared error (worker/quant/rtn.py), else its full range."""
        if self.act_order:
            raise ValueError("act-order INT4 weights come from GPTQ; online quantization rounds to nearest")
        q, scales, zeros = quantize_int4(weight, self.group_size, self.symmetric,
                                         scale_dtype or scale_dtype_for(weight.dtype), clip)
        out = {"qweight": pack_int4(q), "scales": scales}
        if not self.symmetric:
            out["zeros"] = zeros
        return out
