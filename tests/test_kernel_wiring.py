"""The fused kernels the model uses on CUDA compute what its CPU path computes (run here under the Triton
interpreter in float32): rotary on the model's own cos/sin table, RMSNorm with the residual add, SiLU-mul."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.kernels.activation import silu_and_mul
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
    want_q, want_k = rope(positions, q.clone(), k.clone())
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
