"""The fused kernels the model uses on CUDA compute what its CPU path computes (run here under the Triton
interpreter in float32): rotary on the model's own cos/sin table, RMSNorm with the residual add, SiLU-mul."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.kernels.activation import silu_and_mul
from tokenmill.kernels.attention_ref import rotary_embedding_ref
from tokenmill.kernels.rmsnorm import add_rmsnorm
from tokenmill.kernels.rotary import rotary_embedding
from tokenmill.worker.config import RopeScaling
from tokenmill.worker.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul


@pytest.mark.parametrize("scaling", [RopeScaling(), RopeScaling("llama3", 8.0, 1.0, 4.0, 64)])
def test_rotary_kernel_on_the_models_table_matches_the_cpu_path(scaling: RopeScaling) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, 256, 10000.0, scaling)
    qkv = torch.randn(7, (4 + 2 + 2) * 32)
    q, k = qkv[:, : 4 * 32].view(7, 4, 32), qkv[:, 4 * 32 : 6 * 32].view(7, 2, 32)  # views, as in the model
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 255])
    want_q, want_k = rotary_embedding_ref(q, k, rope.cos_sin_cache, positions)  # the CPU backend's rotation
    got_q, got_k = rotary_embedding(q, k, rope.cos_sin_cache, positions)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_add_rmsnorm_and_silu_kernels_match_the_cpu_path() -> None:
    torch.manual_seed(1)
    norm = RMSNorm(64, 1e-5, dtype=torch.float32)
    norm.weight.data.normal_()
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    want_out, want_res = norm.add_forward(x, residual)  # CPU tensors take the torch path
    got_out, got_res = add_rmsnorm(x, residual, norm.weight, 1e-5)
    torch.testing.assert_close(got_res, want_res)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(5, 96)
    torch.testing.assert_close(silu_and_mul(gate_up), SiluAndMul()(gate_up), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch_name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("first_layer", [True, False])
def test_skinny_decode_layer_matches_the_unfused_layer(arch_name: str, first_layer: bool) -> None:
    # The decoder layer's fused few-token path (norm -> qkv, o_proj, norm -> gate_up, SwiGLU -> down in
    # kernels/gemv.py) computes what its unfused path computes, KV-cache writes included.
    from tokenmill.kernels.gemv import MAX_TOKENS
    from tokenmill.worker.attention.triton_backend import TritonBackend
    from tokenmill.worker.loader.dummy import dummy_arch
    from tokenmill.worker.model_runner import attention_metadata
    from tokenmill.worker.models.llama import SKINNY_MAX_TOKENS, LlamaDecoderLayer

    assert 1 <= SKINNY_MAX_TOKENS <= MAX_TOKENS
    arch = dummy_arch(arch_name)
    assert arch is not None
    torch.manual_seed(2)
    rope = RotaryEmbedding(arch.head_dim, 256, arch.rope_theta, arch.rope_scaling)
    layer = LlamaDecoderLayer(arch, TritonBackend(), rope, None, torch.float32)
    for p in layer.parameters():
        p.data.normal_(0.0, 0.3)
    assert layer.skinny_decode
    # three decoding requests with 5, 17 and 33 tokens of context (the new one included)
    seq_lens, block = [5, 17, 33], 16
    tables = [[0], [1, 2], [3, 4, 5]]
    slots = [t[(s - 1) // block] * block + (s - 1) % block for t, s in zip(tables, seq_lens)]
    meta = attention_metadata([1, 1, 1], seq_lens, tables, slots, torch.device("cpu"))
    positions = torch.tensor([s - 1 for s in seq_lens])
    h = torch.randn(3, arch.hidden_size)
    residual = None if first_layer else torch.randn(3, arch.hidden_size)
    shape = (6, block, arch.num_kv_heads, arch.head_dim)
    caches_a = (torch.randn(shape), torch.randn(shape))
    caches_b = (caches_a[0].clone(), caches_a[1].clone())
    want_out, want_res = layer(positions, h, residual, caches_a, meta)  # CPU tensors: the unfused path
    got_out, got_res = layer._forward_skinny(positions, h, residual, caches_b, meta)
    torch.testing.assert_close(got_res, want_res)
    torch.testing.assert_close(caches_b, caches_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_out, want_out, atol=1e-4, rtol=1e-4)
