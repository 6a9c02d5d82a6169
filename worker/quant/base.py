"""The quantization hook of linear layers: a LinearMethod owns a layer's weights and its matmuls.

A `Linear` (worker/models/layers.py) holds no weights of its own: its method registers them
(`create_weights`) and multiplies by them (`apply`). One method per weight format (worker/quant/).

Few-token decode steps on CUDA (worker/models/llama.py, SKINNY_MAX_TOKENS) call three fused entry points,
each a kernel that reads the weights once and computes its own input on the fly: the plain matmul, the
residual add + RMSNorm before it, or the SwiGLU product before it (kernels/gemv.py for dense weights). A
method without such a kernel for its format keeps the defaults here, which return None; the layer then
runs the same ops unfused through `apply`. So the decode path never reads a weight behind the method's
back: a format without fused kernels loses the fusion, never its weights.

Loading: a checkpoint reaches the model as tensors in the method's canonical layout (`param_shapes`; the
loaders of worker/loader/ convert GPTQ, AWQ, compressed-tensors and FP8 checkpoints to it, and `quantize`
makes it from a dense weight for online quantization). Every canonical tensor but those named in
`shared_params` has the output rows as its first dim, so a fused layer (qkv_proj, gate_up_proj) loads each
part's tensors into a row range (`load_weight`); shared ones (an act-order permutation of the input columns)
must be the same for every part.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

# dtypes whose values a checkpoint must provide exactly (no cast on load)
_EXACT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn,
                 torch.float8_e5m2)


class LinearMethod(ABC):
    """Storage and matmul of one weight format for `Linear` layers (one instance may serve many layers:
    all per-layer state lives on the layer)."""

    name: ClassVar[str] = "none"  # the --quantization name of the format
    shared_params: ClassVar[frozenset[str]] = frozenset()  # canonical tensors without an output-row dim

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

    # -- loading ------------------------------------------------------------------------------------------
    @abstractmethod
    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        """The canonical checkpoint tensors of one input_size -> output_size projection (bias excluded: it is
        always `bias` [output_size] in the activation dtype)."""

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Online quantization: a dense weight [out, in] -> the canonical tensors of `param_shapes`."""
        return {"weight": weight}

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Copy a canonical tensor into the layer's parameter `name` (into output rows [rows[0], rows[1]) of a
        fused layer). Integer and FP8 tensors must come in the parameter's dtype; float ones are cast.
        Raises ValueError naming what does not fit (the caller adds the tensor's name)."""
        param = getattr(layer, name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"the {self.name} format has no tensor {name!r}")
        target = param.data
        exact = target.dtype in _EXACT_DTYPES or tensor.dtype in _EXACT_DTYPES or not tensor.is_floating_point()
        if exact and tensor.dtype != target.dtype:
            raise ValueError(f"dtype {tensor.dtype}, the {self.name} format stores {target.dtype}")
        if name in self.shared_params:
            self._load_shared(layer, name, target, tensor)
            return
        if rows is not None:
            target = target[rows[0]:rows[1]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)

    @staticmethod
    def _load_shared(layer: nn.Module, name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        loaded: set[str] = layer.__dict__.setdefault("_loaded_shared", set())
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        if name in loaded:
            if not torch.equal(target, tensor.to(target.device)):
                raise ValueError(f"{name} differs between the parts of a fused layer (they share one input)")
            return
        target.copy_(tensor)
        loaded.add(name)
