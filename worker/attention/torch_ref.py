"""The reference attention backend: kernels/attention_ref.py in plain PyTorch (float32 math, one dense softmax
per request, the decodes of a step batched). Slow but obviously correct; it defines what the Triton backend
must reproduce, and it is the CPU worker's backend (no Triton needed)."""

from __future__ import annotations

import torch

from tokenmill.kernels.attention_ref import paged_attention_ref, rotary_embedding_ref, write_kv_cache_ref
from tokenmill.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata, KVCache
from tokenmill.worker.attention.kv_rotation import rotate, rotate_back
from tokenmill.worker.attention.kv_scales import calibrate


class TorchRefBackend(AttentionBackend):
    name = "torch"

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        kv_scales = layer.fp8_scales(kv_cache)
        q, k = rotary_embedding_ref(q, k, layer.cos_sin_cache, positions)  # out of place
        r = self.kv_rotation
        if r is not None:
            q, k, v = rotate(q, r), rotate(k, r), rotate(v, r)
        if kv_scales is not None and self.calibrate_kv_scales:
            calibrate(k, v, kv_scales)
        write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        out = paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  layer.scale, sliding_window=layer.sliding_window, kv_scales=kv_scales,
                                  tree_mask=meta.tree_mask, tree_start=meta.tree_start)
        return out if r is None else rotate_back(out, r)
