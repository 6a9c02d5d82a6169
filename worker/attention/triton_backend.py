"""Attention backend on the Triton kernels: write the step's k/v into the paged cache, then paged attention.

No host sync: launch decisions use the host ints meta.max_query_len / meta.max_seq_len only.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_cache import write_kv_cache
from tokenmill.kernels.paged_attention import DecodeRope, paged_attention
from tokenmill.kernels.rotary import rotary_and_cache
from tokenmill.worker.attention.backend import AttentionMetadata


class TritonBackend:
    """AttentionBackend: q [T, Hq, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]."""

    name = "triton"
    fuses_rope = True

    def __init__(self, decode_rope_in_attention: bool = True) -> None:
        # Decode-only steps fold rotary + cache write into the attention kernel; False keeps the separate
        # rotary kernel (EngineConfig.decode_rope_in_attention: A/B measurements).
        self.decode_rope_in_attention = decode_rope_in_attention

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
    ) -> torch.Tensor:
        """Returns [T, Hq, D] in q's dtype (a new contiguous tensor)."""
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale, sliding_window)

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
        """Decode-only steps: one kernel rotates q and k, writes k and v into the cache and attends. Other
        steps: one kernel rotates q and k in place and writes the cache, then attention."""
        if meta.max_query_len == 1 and self.decode_rope_in_attention:
            rope = DecodeRope(k, v, cos_sin_cache, positions, meta.slot_mapping)
            return self._attend(q, k_cache, v_cache, meta, scale, sliding_window, rope)
        rotary_and_cache(q, k, v, cos_sin_cache, positions, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale, sliding_window)

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rope: DecodeRope | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            max_query_len=max(1, meta.max_query_len),
            max_seq_len=max(1, meta.max_seq_len),
            sliding_window=sliding_window,
            rope=rope,
        )
