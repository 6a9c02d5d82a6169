"""A Linear layer's weights and matmuls belong to its LinearMethod on every path, the fused few-token decode
path included. A method that is not the unquantized one (a toy here: weight stored transposed, so there is
no `.weight` to read behind its back) keeps the decoder layer's fused path on, is called there, has its own
fused kernel used where it provides one and gets the unfused ops where it provides none, with the numbers
of the dense layer. Runs on CPU (attention under the Triton interpreter, float32)."""

from __future__ import annotations

import os
from typing import cast

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.worker.attention.triton_backend import TritonBackend
from tokenmill.worker.loader.dummy import dummy_arch
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.models.layers import Linear, RotaryEmbedding
from tokenmill.worker.models.llama import LlamaDecoderLayer
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.unquantized import UnquantizedLinearMethod


class TransposedLinearMethod(LinearMethod):
    """weight_t [in, out] and bias [out] | None. Its own fused kernel for the norm before a projection (plain
    torch standing in for one), none for the other two entry points. Records (layer, entry point, rows)."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, str, int]] = []

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        return {"weight_t": (input_size, output_size)}

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device | None) -> None:
        weight_t = torch.empty(input_size, output_size, dtype=dtype, device=device)
        layer.register_parameter("weight_t", nn.Parameter(weight_t, requires_grad=False))
        b = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device), requires_grad=False) if bias else None
        layer.register_parameter("bias_t", b)

    @staticmethod
    def _matmul(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight_t, bias_t = cast(torch.Tensor, layer.weight_t), cast(torch.Tensor | None, layer.bias_t)
        y = x @ weight_t
        return y if bias_t is None else y + bias_t

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((layer, "apply", x.shape[0]))
        return self._matmul(layer, x)

    def apply_skinny(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        self.calls.append((layer, "skinny", x.shape[0]))
        return None

    def apply_add_rmsnorm(self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append((layer, "norm", h.shape[0]))
        r = h if residual is None else h + residual
        x = r * torch.rsqrt(r.float().pow(2).mean(dim=-1, keepdim=True) + eps).to(r.dtype)
        return self._matmul(layer, norm_weight * x), r

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        self.calls.append((layer, "silu_mul", gate_up.shape[0]))
        return None


def decoder_layer(method: LinearMethod | None, seed: int) -> LlamaDecoderLayer:
    arch = dummy_arch("tiny-qwen2")  # qkv bias: the bias goes through the method too
    assert arch is not None and arch.qkv_bias
    rope = RotaryEmbedding(arch.head_dim, 256, arch.rope_theta, arch.rope_scaling)
    layer = LlamaDecoderLayer(arch, TritonBackend(), rope, method, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return layer


def dense_twin(layer: LlamaDecoderLayer) -> LlamaDecoderLayer:
    """The same layer with UnquantizedLinearMethod: weight = weight_t.T, the same norms."""
    twin = decoder_layer(None, seed=0)
    ours = dict(layer.named_modules())
    for name, module in twin.named_modules():
        if isinstance(module, Linear):
            module.weight.data.copy_(ours[name].weight_t.T)
            if module.bias is not None:
                module.bias.data.copy_(ours[name].bias_t)
        elif hasattr(module, "weight"):
            module.weight.data.copy_(ours[name].weight)
    return twin


@pytest.mark.parametrize("first_layer", [True, False])
def test_batch1_fused_decode_path_goes_through_a_non_default_method(first_layer: bool) -> None:
    method = TransposedLinearMethod()
    layer = decoder_layer(method, seed=3)
    assert layer.skinny_decode, "a method that is not the unquantized one keeps the fused decode path"
    linears = {m: name for name, m in layer.named_modules() if isinstance(m, Linear)}
    assert linears and not any(hasattr(m, "weight") for m in linears)
    attn = layer.self_attn
    # One request decoding its 21st token (position 20: block 0 of its table [2, 0], offset 4).
    block, seq_len = 16, 21
    meta = attention_metadata([1], [seq_len], [[2, 0]], [0 * block + 4], torch.device("cpu"))
    positions = torch.tensor([seq_len - 1])
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(1, layer.input_layernorm.weight.shape[0], generator=gen)
    residual = None if first_layer else torch.randn(h.shape, generator=gen)
    shape = (3, block, attn.num_kv_heads, attn.head_dim)
    caches = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    ours, dense = (caches[0].clone(), caches[1].clone()), (caches[0].clone(), caches[1].clone())

    got_out, got_res = layer._forward_skinny(positions, h, residual, ours, meta)
    calls = [(linears[m], entry, rows) for m, entry, rows in method.calls]
    assert calls == [
        ("self_attn.qkv_proj", "norm", 1),  # its own fused kernel: no apply() after it
        ("self_attn.o_proj", "skinny", 1), ("self_attn.o_proj", "apply", 1),  # no kernel: unfused
        ("mlp.gate_up_proj", "norm", 1),
        ("mlp.down_proj", "silu_mul", 1), ("mlp.down_proj", "apply", 1),
    ]
    want_out, want_res = dense_twin(layer)(positions, h, residual, dense, meta)  # CPU: the unfused path
    torch.testing.assert_close(got_res, want_res)
    torch.testing.assert_close(ours, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_out, want_out, atol=1e-4, rtol=1e-4)

    method.calls.clear()
    layer(positions, h, residual, (caches[0].clone(), caches[1].clone()), meta)  # CPU tensors: unfused
    assert [(linears[m], e) for m, e, _ in method.calls] == [
        ("self_attn.qkv_proj", "apply"), ("self_attn.o_proj", "apply"),
        ("mlp.gate_up_proj", "apply"), ("mlp.down_proj", "apply"),
    ]


def test_unquantized_method_is_the_default_and_a_linear_method() -> None:
    layer = Linear(8, 4, bias=True, dtype=torch.float32)
    assert isinstance(layer.method, UnquantizedLinearMethod) and isinstance(layer.method, LinearMethod)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
    with pytest.raises(TypeError):
        LinearMethod()  # type: ignore[abstract]
