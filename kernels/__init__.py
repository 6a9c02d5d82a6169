"""Triton kernels of the engine: paged attention, KV-cache writes, rotary embedding, RMSNorm, SwiGLU.

Each launcher checks shapes, dtypes, devices and strides (ValueError) and has a plain-torch `*_ref` twin
that the tests compare it with. Triton is needed to import this package (the optional `gpu` extra).

On a machine without CUDA, Triton kernels can only run under the interpreter, which must be chosen
before any `@triton.jit` function is decorated; so this package turns `TRITON_INTERPRET=1` on (unless the
variable is already set) when CUDA is unavailable.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Re-exported eagerly: several submodules share their launcher's name (kernels.rmsnorm.rmsnorm), and the
# package attribute must end up being the function, not the submodule.
from .activation import silu_and_mul, silu_and_mul_ref
from .kv_cache import write_kv_cache, write_kv_cache_ref
from .paged_attention import (
    PagedAttentionConfig,
    choose_num_splits,
    paged_attention,
    paged_attention_ref,
)
from .rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from .rotary import (
    cos_sin_cache_from_inv_freq,
    rotary_and_cache,
    rotary_and_cache_ref,
    rotary_embedding,
    rotary_embedding_ref,
)

__all__ = [
    "PagedAttentionConfig",
    "add_rmsnorm",
    "add_rmsnorm_ref",
    "choose_num_splits",
    "cos_sin_cache_from_inv_freq",
    "paged_attention",
    "paged_attention_ref",
    "rmsnorm",
    "rmsnorm_ref",
    "rotary_and_cache",
    "rotary_and_cache_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
