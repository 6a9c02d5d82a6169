"""Which weight format a model's decoder-layer projections use, and the LinearMethod that implements it.

The embeddings, the final norm and lm_head stay in the model dtype in every format (as GPTQ, AWQ and
compressed-tensors checkpoints leave them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tokenmill.worker.quant.base import LinearMethod

QuantMethod = Literal["none", "int8", "int4", "fp8"]
METHODS: tuple[str, ...] = ("none", "int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128  # online INT4 (--quantization int4)


@dataclass(frozen=True)
class QuantConfig:
    """method: none | int8 (W8A16, per-output-channel symmetric) | int4 (W4A16, group-wise) | fp8 (W8A8 e4m3,
    per-channel weight scales, dynamic per-token activation scales).
    INT4 only: group_size (input columns per scale), symmetric (False: a zero point per group), act_order
    (the checkpoint's columns are permuted, GPTQ desc_act: the layers keep the permutation)."""

    method: QuantMethod = "none"
    group_size: int = DEFAULT_GROUP_SIZE
    symmetric: bool = True
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; supported: {', '.join(METHODS)}")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"INT4 group size {self.group_size} is not supported; use one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        if self.method != "int4" and (not self.symmetric or self.act_order):
            raise ValueError(f"zero points and act-order are INT4 options, not {self.method}'s")

    def describe(self) -> str:
        if self.method != "int4":
            return self.method
        return (f"int4 g{self.group_size} {'sym' if self.symmetric else 'asym'}"
                + (" act-order" if self.act_order else ""))


def make_linear_method(config: QuantConfig, device: torch.device, *, fp8_emulation: bool = False,
                       ) -> LinearMethod | None:  # fmt: skip
    """The LinearMethod of `config` (None: the dense default). FP8 needs a GPU with FP8 tensor cores
    (`fp8_emulation`: the CPU reference instead, for accuracy studies and tests; never the engine's)."""
    if config.method == "none":
        return None
    if config.method == "int8":
        from tokenmill.worker.quant.int8 import Int8LinearMethod

        return Int8LinearMethod()
    if config.method == "int4":
        from tokenmill.worker.quant.int4 import Int4LinearMethod

        return Int4LinearMethod(config.group_size, config.symmetric, config.act_order)
    from tokenmill.worker.quant.fp8 import Fp8LinearMethod

    return Fp8LinearMethod(device, emulate=fp8_emulation)
