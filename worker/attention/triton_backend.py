"""Attention backend on the Triton kernels: rotary and the step's k/v written into the paged cache, then paged
attention.

No host sync: launch decisions use the host ints meta.max_query_len / meta.max_seq_len only.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_cache import write_kv_cache
from tokenmill.kernels.paged_attention import DecodeRope, PagedAttentionConfig, paged_attention
from tokenmill.kernels.rotary import rotary_and_cache, rotary_embedding
from tokenmill.worker.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionSplit,
    KVCache,
)
from tokenmill.worker.attention.kv_rotation import rotate, rotate_back
from tokenmill.worker.attention.kv_scales import calibrate


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    def __init__(self, decode_rope_in_attention: bool = True, kv_rotation: torch.Tensor | None = None) -> None:
        super().__init__(kv_rotation)
        # Decode-only steps fold rotary + cache write into the attention kernel; False keeps the separate
        # rotary kernel (EngineConfig.decode_rope_in_attention: A/B measurements). A kv_rotation turns it off.
        self.decode_rope_in_attention = decode_rope_in_attention
        # Set only while worker/cuda_graphs.py captures piecewise graphs: attention calls go to it instead of
        # launching (the capture ends a graph piece there and launches attention between the pieces).
        self.split: AttentionSplit | None = None
        # Set only while worker/cuda_graphs.py captures whole-step graphs: the (tile config, key splits) every
        # attention launch of the captured step takes instead of the heuristics' choice for its lengths.
        self.launch_override: tuple[PagedAttentionConfig, int] | None = None

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Decode-only steps: one kernel rotates q and k, writes k and v into the cache and attends. Other
        steps: one kernel rotates q and k in place and writes the cache, then attention. A calibrating step (fp8
        cache) or a kv_rotation: rotary in place, then (R) q, k and v rotated, the scales set (calibrating), then
        the write, attention and (R) the output rotated back."""
        k_cache, v_cache = kv_cache
        kv_scales = layer.fp8_scales(kv_cache)
        r = self.kv_rotation
        calibrating = kv_scales is not None and self.calibrate_kv_scales
        rope = None
        if r is not None or calibrating:
            rotary_embedding(q, k, layer.cos_sin_cache, positions)
            if r is not None:
                q, k, v = rotate(q, r), rotate(k, r), rotate(v, r)
            if calibrating:
                assert kv_scales is not None
                calibrate(k, v, kv_scales)
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        elif meta.max_query_len == 1 and self.decode_rope_in_attention:
            rope = DecodeRope(k, v, layer.cos_sin_cache, positions, meta.slot_mapping)
        else:
            rotary_and_cache(q, k, v, layer.cos_sin_cache, positions, k_cache, v_cache, meta.slot_mapping, kv_scales)
        out = self._attend(layer, q, kv_cache, meta, rope, kv_scales)
        return out if r is None else rotate_back(out, r)

    def _attend(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                rope: DecodeRope | None, kv_scales: torch.Tensor | None) -> torch.Tensor:
        """Paged attention of q [T, Hq, D] (rotated, or rotated inside with `rope`) -> [T, Hq, D]; while piecewise
        graphs are captured (and the step's keys are already cached), the split's output tensor instead."""
        k_cache, v_cache = kv_cache
        if self.split is not None and rope is None:
            return self.split(q, k_cache, v_cache, layer.scale, layer.sliding_window, kv_scales)
        config, num_splits = self.launch_override or (None, None)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            layer.scale,
            max_query_len=max(1, meta.max_query_len),
            max_seq_len=max(1, meta.max_seq_len),
            sliding_window=layer.sliding_window,
            rope=rope,
            kv_scales=kv_scales,
            tree_mask=meta.tree_mask,
            tree_start=meta.tree_start,
            config=config,
            num_splits=num_splits,
        )
