"""The attention-backend interface: what the model runner hands every attention layer in a step.

A step is one flattened (varlen) batch of T scheduled tokens from B requests. Request i owns query rows
query_start_loc[i]:query_start_loc[i+1]; its context after this step is seq_lens[i] tokens, of which the
last (query_start_loc[i+1]-query_start_loc[i]) are the new ones (so the first new token sits at position
seq_lens[i] - query_len_i). Keys/values of the new tokens are first written into the paged cache at
slot_mapping, then each query attends causally to the cached context of its request.

Backends: torch_ref.py (the plain-torch reference of kernels/attention_ref.py, runs anywhere) and
triton_backend.py (the Triton kernels).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]: the
# model's dtype, or float8_e4m3fn (EngineConfig.kv_cache_dtype "fp8": entries times AttentionLayer.kv_scales)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32 on device, query_start_loc[0] == 0, [-1] == T
    seq_lens: torch.Tensor  # [B] int32 on device: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32 on device; unused entries are 0
    slot_mapping: torch.Tensor  # [T] int64 on device: block_id * block_size + offset; -1 means "do not write"
    max_query_len: int
    max_seq_len: int
    # Host copies (lists) so that launch decisions need no device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Tree drafts (worker/spec/tree.py), else None. A key at cache index c >= tree_start[i] of request i is seen
    # by a query only if bit c - tree_start[i] of its tree_mask is set (its ancestors-or-self among the tree's
    # nodes), on top of the causal rule; rows of no tree have mask 0 and tree_start = their seq_len.
    tree_mask: torch.Tensor | None = None  # [T] int64 on device
    tree_start: torch.Tensor | None = None  # [B] int32 on device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionLayer:
    """The constants of one attention layer, made once when the model is built (which is on its device:
    models are never moved, so the table below stays the layer's own)."""

    scale: float  # softmax scale, usually head_dim ** -0.5
    sliding_window: int | None  # a query at position p sees keys at positions > p - window; None: all
    cos_sin_cache: torch.Tensor  # [max_position, D] float32: cos | sin per frequency pair (NeoX layout)
    # [2, Hkv] float32 on the layer's device: K's and V's scale per kv head for an fp8 cache (a cached entry
    # stands for entry * scale); set in place by calibration (kv_scales.py); unused by caches of the model dtype
    kv_scales: torch.Tensor | None = None

    def fp8_scales(self, kv_cache: KVCache) -> torch.Tensor | None:
        """kv_scales when kv_cache is float8_e4m3fn (the kernels then need them), else None."""
        if kv_cache[0].dtype != torch.float8_e4m3fn:
            return None
        if self.kv_scales is None:
            raise ValueError("an fp8 KV cache needs AttentionLayer.kv_scales; this layer has none")
        return self.kv_scales


class AttentionSplit(Protocol):
    """Where a piecewise CUDA-graph capture cuts the model: called instead of the attention kernel with
    q [T, Hq, D] (this step's keys and values already in the caches), it returns the tensor [T, Hq, D] that
    will hold the attention output when the graph pieces are replayed."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 sliding_window: int | None, kv_scales: torch.Tensor | None) -> torch.Tensor: ...


class AttentionBackend(ABC):
    """One attention layer of a step: rotate q and k by `positions`, write this step's k and v into the
    layer's paged cache at meta.slot_mapping, then let each query attend causally to its request's cached
    context. q [T, Hq, D], k and v [T, Hkv, D] may be strided views of the fused qkv projection, and q and k
    may be rotated in place; positions [T] int64; kv_cache = (k_cache, v_cache), each
    [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D] in q's dtype.

    With `calibrate_kv_scales` set (the first step of an engine with an fp8 cache, run eagerly), a layer with an
    fp8 cache first sets its kv_scales from this step's keys and values as cached: after rotary (and kv_rotation)
    (kv_scales.calibrate).

    With `kv_rotation` R ([D, D] float32 orthonormal on the model's device; EngineConfig.kv_cache_rotation), q and
    k are multiplied by R after rotary and v before the cache write, and the output by R.T (kv_rotation.py): the
    cache holds rotated keys and values, the output is the unrotated attention's up to rounding."""

    name: ClassVar[str]
    # whether a step through it can be captured in a CUDA graph (no host syncs, no data-dependent shapes)
    graph_safe: ClassVar[bool] = False
    calibrate_kv_scales: bool = False

    def __init__(self, kv_rotation: torch.Tensor | None = None) -> None:
        assert kv_rotation is None or (kv_rotation.dtype == torch.float32 and kv_rotation.dim() == 2
                                       and kv_rotation.shape[0] == kv_rotation.shape[1]), "R is [D, D] float32"
        self.kv_rotation = kv_rotation

    @abstractmethod
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor: ...
