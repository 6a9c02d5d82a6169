"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, linear layers behind a
quantization hook (worker/quant/), and the SwiGLU activation.

Every module here creates its parameters with an explicit dtype and on the current default device, so a
model built inside `with torch.device(dev):` owns its weights on `dev` from the start (no second copy).
Parameters never require grad: this is an inference-only engine. The one exception is an EAGLE head in
training (worker/spec/eagle_train.py), whose decoder layer is built from these modules: the Triton kernels
compute no gradient, so on CUDA a module takes its kernel only when autograd needs nothing of it
(`kernel_path`), and the torch code otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.worker.config import RopeScaling
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.unquantized import UnquantizedLinearMethod


class ModelLoadError(RuntimeError):
    """A model could not be resolved, read or matched to its architecture; the message says why."""


def frozen_param(data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=False)


def kernel_path(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether an op on x (and its other inputs) may run its Triton kernel: x is on CUDA and autograd needs no
    gradient through it. A kernel's output has no grad_fn, so taking it while training would cut the graph
    silently (every parameter before it would get no gradient)."""
    if not x.is_cuda:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others)))


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back to x's dtype.
    x: [..., hidden]; weight: [hidden]."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = frozen_param(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_path(x, self.weight):
            from tokenmill.kernels.rmsnorm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * (x32 * inv_rms).to(x.dtype)  # rounded before the weight, as HF does

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm (one pass on CUDA).
        The sum is rounded to x's dtype before the norm, as HF adds in the model dtype."""
        if kernel_path(x, residual, self.weight):
            from tokenmill.kernels.rmsnorm import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        h = x + residual
        return self.forward(h), h


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] float32, with Llama 3.1 or linear scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return llama3_scaled_inv_freq(inv_freq, scaling)
    return inv_freq


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: wavelengths longer than original_max/low_freq_factor are divided by `factor`,
    shorter than original_max/high_freq_factor are kept, the band between is interpolated smoothly."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    band = s.high_freq_factor - s.low_freq_factor
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / band
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The rotary position table of a model, shared by its attention layers (the attention backend rotates).

    cos_sin_cache: [max_position, head_dim] float32: cos of each frequency pair, then sin (NeoX layout, as
    kernels/rotary.py and kernels/attention_ref.py read it). Positions must lie in [0, max_position)."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inv_freq(head_dim, theta, scaling)  # on the default device, like all tensors here
        positions = torch.arange(max_position, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # [max_position, head_dim // 2]
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)


class Linear(nn.Module):
    """x [..., input_size] -> [..., output_size]; storage and matmul are delegated to `method`.
    Fused layers (qkv_proj, gate_up_proj) are one Linear whose output rows are the concatenated parts."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        method: LinearMethod | None = None,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.method: LinearMethod = method if method is not None else UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, output_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def load_part(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Load a checkpoint tensor (canonical layout, full size) into parameter `name`; `rows`: the output
        rows of the unsharded fused weight it fills (None: all of them)."""
        self.method.load_weight(self, name, tensor, rows)

    # Few-token decode (x [M <= 16, in]): the method's fused kernel, or when its format has none, the same
    # ops unfused through apply(). Either way the weights are only ever touched by the method.
    def forward_skinny(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply_skinny(self, x)
        return self.method.apply(self, x) if y is None else y

    def forward_norm(
        self, norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(r)), r) with r = h + residual (r = h when residual is None): the residual add and
        the norm before this projection, as the unfused decoder layer computes them."""
        fused = self.method.apply_add_rmsnorm(self, h, residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
        x, r = (norm(h), h) if residual is None else norm.add_forward(h, residual)
        return self.method.apply(self, x), r

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up [M, 2 * in] = [gate | up]."""
        y = self.method.apply_silu_mul(self, gate_up)
        return self.method.apply(self, silu_and_mul(gate_up)) if y is None else y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, method={type(self.method).__name__}"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] = [gate | up] -> silu(gate) * up, [..., I] (one Triton kernel on CUDA)."""
    if x.dim() == 2 and kernel_path(x):
        from tokenmill.kernels.activation import silu_and_mul as kernel

        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """x [..., 2 * I] = [gate | up] -> silu(gate) * up, [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class VocabEmbedding(nn.Module):
    """Token ids [T] int64 -> rows of weight [vocab, hidden]. The weight is left uninitialised: it is
    always overwritten by the loader."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = frozen_param(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: hidden [N, hidden] -> logits [N, vocab] float32."""
        return F.linear(hidden, self.weight).float()

    def load_part(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None) -> None:
        assert name == "weight" and rows is None, name
        self.weight.data.copy_(tensor)


class LayerFactory:
    """Makes a model's projections and vocabulary layers from the full model's sizes. This one (one device)
    makes the plain layers; worker/parallel/layers.py's TensorParallelLayers makes one tensor-parallel rank's
    shards, so the model code is the same for both. `shards`: the number of ranks the heads are split over."""

    shards: int = 1

    def column(self, input_size: int, output_sizes: Sequence[int], bias: bool, method: LinearMethod | None,
               dtype: torch.dtype) -> Linear:
        """A layer whose output rows are the concatenated parts `output_sizes` ([q | k | v], [gate | up])."""
        return Linear(input_size, sum(output_sizes), bias, method, dtype=dtype)

    def row(self, input_size: int, output_size: int, bias: bool, method: LinearMethod | None,
            dtype: torch.dtype) -> Linear:
        """A layer that reads what a column layer wrote (o_proj after attention, down_proj after the MLP)."""
        return Linear(input_size, output_size, bias, method, dtype=dtype)

    def embedding(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> VocabEmbedding:
        return VocabEmbedding(vocab_size, hidden_size, dtype=dtype)

    def lm_head(self, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> nn.Module:
        """An untied LM head: hidden [N, hidden] -> logits [N, vocab] in the model dtype."""
        return Linear(hidden_size, vocab_size, False, dtype=dtype)


SINGLE_DEVICE = LayerFactory()  # stateless: one instance serves every model on one device
