"""Named model shapes with random weights, for benchmarks and tests without a checkpoint.

Weights are normal(0, 0.02) (norm weights 1), each drawn on the target device in the target dtype from a
generator seeded by the tensor's name, so the same shape, device and dtype always give the same model.
Dummy models carry no tokenizer.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from tokenmill.worker.config import ModelArch, RopeScaling
from tokenmill.worker.models.llama import expected_hf_weights

_LLAMA3_EOS = (128001, 128009)
_QWEN_EOS = (151645, 151643)

DUMMY_SHAPES: dict[str, ModelArch] = {
    "llama2-7b": ModelArch(
        arch="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama3-8b": ModelArch(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    "llama3.1-8b": ModelArch(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position=8192),
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "mistral-7b": ModelArch(
        arch="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=32768, sliding_window=4096, bos_token_id=1, eos_token_ids=(2,)),
    "qwen2.5-7b": ModelArch(
        arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, qkv_bias=True, bos_token_id=151643, eos_token_ids=_QWEN_EOS),
    "qwen2.5-0.5b": ModelArch(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=True, bos_token_id=151643,
        eos_token_ids=_QWEN_EOS),
    "qwen3-0.6b": ModelArch(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True, bos_token_id=151643,
        eos_token_ids=_QWEN_EOS),
    "smollm2-135m": ModelArch(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-llama": ModelArch(
        arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-qwen2": ModelArch(
        arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=2048,
        tie_word_embeddings=True, qkv_bias=True, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-qwen3": ModelArch(
        arch="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=2048,
        tie_word_embeddings=True, qk_norm=True, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-mistral": ModelArch(
        arch="mistral", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, sliding_window=16, bos_token_id=1,
        eos_token_ids=(2,)),
}


def dummy_arch(name: str) -> ModelArch | None:
    return DUMMY_SHAPES.get(name)


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def iter_dummy_weights(
    arch: ModelArch, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, random tensor on device in dtype) for every weight `arch` needs."""
    for name, shape in expected_hf_weights(arch).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(_seed(name))
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
