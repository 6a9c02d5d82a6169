"""Reference attention backend in plain PyTorch: one dense softmax per request, float32 math.

Slow but obviously correct; it defines what the Triton backend must reproduce and runs on CPU.
"""

from __future__ import annotations

import torch
from tokenmill.worker.attention.backend import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D] go to flat slots slot_mapping [T] of caches [num_blocks, block_size, Hkv, D];
    rows whose slot is -1 are dropped. The caches must be contiguous (flattened as views)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v[keep].to(v_cache.dtype))


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Flat cache slots [seq_len] int64 of positions 0..seq_len-1 of one request."""
    positions = torch.arange(seq_len, device=block_table.device)
    blocks = block_table[positions // block_size].long()
    return blocks * block_size + positions % block_size


def attention_mask(
    query_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[query_len, seq_len] bool, True where the query (at position seq_len - query_len + i) may see
    key j: causal, and within the window (j > position - window) when one is set."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [L, Hq, D]; k, v: [S, Hkv, D]; mask: [L, S] bool -> [L, Hq, D] float32.
    GQA: query head h reads kv head h // (Hq // Hkv), as HF's repeat_kv."""
    group = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k32) * scale  # [Hq, L, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hls,shd->lhd", probs, v32)


class TorchRefBackend:
    """AttentionBackend over the paged cache, looping over the requests of the batch."""

    name = "torch"

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
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D]."""
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        out = torch.zeros_like(q)  # rows not owned by any request (padding) stay zero
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if query_len == 0:
                continue
            slots = context_slots(meta.block_tables[i], seq_len, block_size)
            mask = attention_mask(query_len, seq_len, sliding_window, q.device)
            rows = slice(start, start + query_len)
            out[rows] = dense_attention(q[rows], flat_k[slots], flat_v[slots], mask, scale).to(q.dtype)
            start += query_len
        return out
