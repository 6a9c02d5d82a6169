"""Triton kernels of the engine: paged attention, KV-cache writes, rotary embedding, RMSNorm, SwiGLU.

Importing this package is cheap and does not import Triton; the launchers are re-exported lazily
(`from tokenmill.kernels import paged_attention` imports `kernels/paged_attention.py` on first use),
so CPU-only installs without the optional `triton` dependency can still import `tokenmill.kernels`.

On a machine without CUDA, Triton kernels can only run under the interpreter, which must be chosen
before any `@triton.jit` function is decorated; so this package turns `TRITON_INTERPRET=1` on
(unless the variable is already set) when CUDA is unavailable.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    "paged_attention": "paged_attention",
    "paged_attention_ref": "paged_attention",
    "PagedAttentionConfig": "paged_attention",
    "choose_num_splits": "paged_attention",
    "write_kv_cache": "kv_cache",
    "write_kv_cache_ref": "kv_cache",
    "rotary_embedding": "rotary",
    "cos_sin_cache_from_inv_freq": "rotary",
    "rotary_embedding_ref": "rotary",
    "rotary_and_cache": "rotary",
    "rotary_and_cache_ref": "rotary",
    "rmsnorm": "rmsnorm",
    "rmsnorm_ref": "rmsnorm",
    "add_rmsnorm": "rmsnorm",
    "add_rmsnorm_ref": "rmsnorm",
    "silu_and_mul": "activation",
    "silu_and_mul_ref": "activation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
