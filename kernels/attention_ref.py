"""Plain-torch references of the attention path's kernels: rotary embedding (kernels/rotary.py), the KV-cache
write (kernels/kv_cache.py) and paged attention (kernels/paged_attention.py), all with float32 math. They
import no Triton: the CPU worker's attention backend (worker/attention/torch_ref.py) runs on them, and the
kernels' tests compare against them.

Layouts are the kernels' (the module docstrings of rotary.py and paged_attention.py): q [T, Hq, D]; k, v
[T, Hkv, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, W] int32; seq_lens [B]
int32 (context including this step's tokens); query_start_loc [B+1] int32; slot_mapping [T] (-1: not
written); cos_sin_cache [max_pos, D] (cos | sin per frequency pair, NeoX layout); positions [T].

FP8 KV cache: caches of dtype float8_e4m3fn hold x / scale per kv head, kv_scales [2, Hkv] float32 (row 0: K's
scales, row 1: V's); `quantize_kv_fp8` is the rounding the Triton KV-write kernels reproduce bit for bit
(kernels/kv_cache.py, `quantize_e4m3`), and the attention reference reads the entries back as fp8 * scale.
"""

from __future__ import annotations

import itertools

import torch

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV).max)  # 448


def quantize_kv_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] (any float dtype) -> e4m3 of x / scales[h], saturated at +-448, rounded to nearest even;
    scales [Hkv] float32. The division is in fp32 (IEEE, as the kernels' div_rn)."""
    y = x.float() / scales.float()[:, None]
    return y.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)


def read_kv(flat: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Cache rows flat[slots] ([slots..., Hkv, D] of a [num_slots, Hkv, D] cache) as float32: fp8 entries times
    their head's scale (scales [Hkv]; gathered as bytes, since float8 indexing is not implemented everywhere),
    other dtypes as they are (scales unused)."""
    if flat.dtype != FP8_KV:
        return flat[slots].float()
    assert scales is not None, "an fp8 cache needs its kv_scales"
    return flat.view(torch.uint8)[slots].view(FP8_KV).float() * scales.float()[:, None]


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """New rotated (q, k): x1 * cos - x2 * sin | x2 * cos + x1 * sin in fp32, rounded once."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, D/2]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for every t with slot_mapping[t] >= 0
    (fp8 caches: quantize_kv_fp8 with kv_scales [2, Hkv])."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    if k_cache.dtype == FP8_KV:  # indexed as bytes: float8 indexing is not implemented everywhere
        assert kv_scales is not None, "an fp8 cache needs its kv_scales"
        k_cache.view(torch.uint8)[blocks, offsets] = quantize_kv_fp8(k[keep], kv_scales[0]).view(torch.uint8)
        v_cache.view(torch.uint8)[blocks, offsets] = quantize_kv_fp8(v[keep], kv_scales[1]).view(torch.uint8)
        return
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                        sliding_window: int | None = None, kv_scales: torch.Tensor | None = None,
                        tree_mask: torch.Tensor | None = None, tree_start: torch.Tensor | None = None,
                        ) -> torch.Tensor:
    """What `paged_attention` computes (its launch-tuning arguments aside): [T, Hq, D] in q's dtype. Reads the
    batch layout on the host (a sync on CUDA). Decode rows (one query) of all requests go in one batched
    softmax, longer query runs one request at a time; rows of no request stay zero. fp8 caches are read as
    entry * kv_scales[0 (K) / 1 (V), head]. Tree drafts: tree_mask [T] int64 and tree_start [B] int32 restrict
    what a query sees past tree_start (worker/attention/backend.py's AttentionMetadata)."""
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in itertools.pairwise(starts)]
    lens = seq_lens.tolist()
    block_size = k_cache.shape[1]
    flat_k = k_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, D]: slot s is row s
    flat_v = v_cache.flatten(0, 1)
    k_scales, v_scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    out = torch.zeros_like(q)
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=q.device)
        out[rows] = _decode_attention(
            q[rows], flat_k, flat_v, block_tables[decodes], seq_lens[decodes], max(lens[i] for i in decodes),
            block_size, scale, sliding_window, kv_scales,
        ).to(q.dtype)
    for i, (query_len, seq_len) in enumerate(zip(query_lens, lens)):
        if query_len <= 1:
            continue
        slots = _context_slots(block_tables[i], seq_len, block_size)
        mask = _attention_mask(query_len, seq_len, sliding_window, q.device)
        span = slice(starts[i], starts[i + 1])
        if tree_mask is not None and tree_start is not None:
            mask &= _tree_visible(tree_mask[span], int(tree_start[i]), seq_len)
        k, v = read_kv(flat_k, slots, k_scales), read_kv(flat_v, slots, v_scales)
        out[span] = _dense_attention(q[span], k, v, mask, scale).to(q.dtype)
    return out


def _context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Flat cache slots [seq_len] int64 of positions 0..seq_len-1 of one request."""
    positions = torch.arange(seq_len, device=block_table.device)
    blocks = block_table[positions // block_size].long()
    return blocks * block_size + positions % block_size


def _attention_mask(query_len: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True where the query (at position seq_len - query_len + i) may see key j:
    causal, and within the window (j > position - window) when one is set."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _tree_visible(masks: torch.Tensor, tree_start: int, seq_len: int) -> torch.Tensor:
    """[L, seq_len] bool: key j is before the tree, or bit j - tree_start of the query's mask [L] is set."""
    keys = torch.arange(seq_len, device=masks.device)
    bits = (masks.long().unsqueeze(1) >> (keys - tree_start).clamp(0, 62).unsqueeze(0)) & 1
    return (keys < tree_start).unsqueeze(0) | bits.bool()


def _dense_attention(
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


def _decode_attention(
    q: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:
    """One query per request, all requests at once. q: [B, Hq, D]; flat caches [slots, Hkv, D];
    block_tables [B, W]; seq_lens [B] -> [B, Hq, D] float32. Keys past a request's length are masked."""
    b, hq, d = q.shape
    hkv = flat_k.shape[1]
    pos = torch.arange(max_seq_len, device=q.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [B, S]
    k_scales, v_scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    k = read_kv(flat_k, slots, k_scales).transpose(1, 2)  # [B, Hkv, S, D]
    v = read_kv(flat_v, slots, v_scales).transpose(1, 2)
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
