"""The attention-backend interface: what the model runner hands every attention layer in a step.

A step is one flattened (varlen) batch of T scheduled tokens from B requests. Request i owns query rows
query_start_loc[i]:query_start_loc[i+1]; its context after this step is seq_lens[i] tokens, of which the
last (query_start_loc[i+1]-query_start_loc[i]) are the new ones (so the first new token sits at position
seq_lens[i] - query_len_i). Keys/values of the new tokens are first written into the paged cache at
slot_mapping, then each query attends causally to the cached context of its request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32 on device, query_start_loc[0] == 0, [-1] == T
    seq_lens: torch.Tensor  # [B] int32 on device: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32 on device; unused entries are 0
    slot_mapping: torch.Tensor  # [T] int64 on device: block_id * block_size + offset; -1 means "do not write"
    max_query_len: int
    max_seq_len: int
    # Host copies (lists) so CPU backends and launch heuristics need no device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionSplit(Protocol):
    """Where a piecewise CUDA-graph capture cuts the model: called instead of the attention kernel with
    q [T, Hq, D] (this step's keys and values already in the caches), it returns the tensor [T, Hq, D] that
    will hold the attention output when the graph pieces are replayed."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 sliding_window: int | None) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D].
    Returns [T, Hq, D] in q's dtype. Must write k, v into the caches at meta.slot_mapping first."""

    name: str
    fuses_rope: bool  # forward_rope does rotary + cache write + attention in fewer passes than the model would

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...

    def forward_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        cos_sin_cache: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """forward() of q and k rotated by positions [T] (cos_sin_cache [max_pos, D] = [cos | sin] per
        frequency pair, NeoX layout); q and k may be rotated in place."""
        ...
