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
    fuses_rope = False  # the model rotates q and k itself and calls forward()

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
        starts = [0]
        for query_len in meta.query_lens_cpu:
            starts.append(starts[-1] + query_len)
        decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decodes:
            rows = torch.tensor([starts[i] for i in decodes], device=q.device)
            out[rows] = decode_attention(
                q[rows], flat_k, flat_v, meta.block_tables[decodes], meta.seq_lens[decodes],
                max(meta.seq_lens_cpu[i] for i in decodes), block_size, scale, sliding_window,
            ).to(q.dtype)
        for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if query_len <= 1:
                continue
            slots = context_slots(meta.block_tables[i], seq_len, block_size)
            mask = attention_mask(query_len, seq_len, sliding_window, q.device)
            span = slice(starts[i], starts[i + 1])
            out[span] = dense_attention(q[span], flat_k[slots], flat_v[slots], mask, scale).to(q.dtype)
        return out

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
        """forward() after rotating q and k out of place (HF rotate_half layout, fp32 math)."""
        from tokenmill.kernels.rotary import rotary_embedding_ref

        q, k = rotary_embedding_ref(q, k, cos_sin_cache, positions)
        return self.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)

def decode_attention(
    q: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query per request, all requests at once. q: [B, Hq, D]; flat caches [slots, Hkv, D];
    block_tables [B, W]; seq_lens [B] -> [B, Hq, D] float32. Keys past a request's length are masked."""
    b, hq, d = q.shape
    hkv = flat_k.shape[1]
    pos = torch.arange(max_seq_len, device=q.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [B, S]
    k = flat_k[slots].float().transpose(1, 2)  # [B, Hkv, S, D]
    v = flat_v[slots].float().transpose(1, 2)
    last = seq_lens.long().unsqueeze(1) - 1  # position of each query
    mask = pos.unsqueeze(0) <= last  # [B, S]
    if sliding_window is not None:
        mask &= pos.unsqueeze(0) > last - sliding_window
    qg = q.float().reshape(b, hkv, hq // hkv, d)  # query head h reads kv head h // group
    # Masked slots may hold garbage (even NaN) from other requests or never-written memory. A NaN key is
    # harmless (its score is overwritten with -inf below), but a NaN value would poison the weighted sum
    # as 0 * NaN, so masked values are zeroed.
    v = v.masked_fill(~mask[:, None, :, None], 0.0)
    scores = torch.einsum("bhgd,bhsd->bhgs", qg, k) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhgs,bhsd->bhgd", torch.softmax(scores, dim=-1), v).reshape(b, hq, d)
