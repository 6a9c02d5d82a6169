"""TorchRefBackend (kernels/attention_ref.py) against torch's own scaled_dot_product_attention on dense
per-request tensors, and its rotary embedding against HF's rotate_half formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenmill.worker.attention.backend import AttentionLayer, AttentionMetadata
from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.model_runner import attention_metadata

HQ, HKV, D = 4, 2, 8
NO_ROTATION = torch.cat((torch.ones(64, D // 2), torch.zeros(64, D // 2)), dim=-1)  # cos 1, sin 0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: tuple[torch.Tensor, ...],
           meta: AttentionMetadata, scale: float, window: int | None,
           table: torch.Tensor = NO_ROTATION) -> torch.Tensor:
    """TorchRefBackend.forward with the tokens at their positions (the last query_len of each context)."""
    positions = [p for ql, sl in zip(meta.query_lens_cpu, meta.seq_lens_cpu) for p in range(sl - ql, sl)]
    k_cache, v_cache = caches
    return TorchRefBackend().forward(AttentionLayer(scale, window, table), q, k, v, torch.tensor(positions),
                                     (k_cache, v_cache), meta)


def build_meta(prefix_lens: list[int], query_lens: list[int], block_size: int) -> AttentionMetadata:
    """Requests get consecutive blocks from block 1 on (block 0 stays unused); slots of the new tokens."""
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    max_blocks = max(math.ceil(s / block_size) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)  # rows padded with block 0
    slots: list[int] = []
    next_block = 1
    for i, (p, s) in enumerate(zip(prefix_lens, seq_lens)):
        n = math.ceil(s / block_size)
        tables[i, :n] = torch.arange(next_block, next_block + n)
        next_block += n
        slots += [int(tables[i, pos // block_size]) * block_size + pos % block_size for pos in range(p, s)]
    return attention_metadata(list(query_lens), seq_lens, tables.tolist(), slots, torch.device("cpu"))

def empty_caches(num_blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches poisoned with NaN (one spare block at the end): attention must never let a slot it does
    not own leak into the result, not even as 0 * NaN."""
    shape = (num_blocks + 1, block_size, HKV, D)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


def fill_prefix(cache: torch.Tensor, table: torch.Tensor, values: torch.Tensor) -> None:
    """values: [P, HKV, D] for positions 0..P-1 of one request."""
    bs = cache.shape[1]
    for pos in range(values.shape[0]):
        cache[int(table[pos // bs]), pos % bs] = values[pos]


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                   scale: float) -> torch.Tensor:
    """q: [L, HQ, D] (the last L positions); k, v: [S, HKV, D] (all positions) -> [L, HQ, D]."""
    L, S = q.shape[0], k.shape[0]
    q_pos = torch.arange(S - L, S)[:, None]
    k_pos = torch.arange(S)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [4, 16])
def test_ragged_batch_with_cached_prefix(window: int | None, block_size: int) -> None:
    torch.manual_seed(0)
    prefix_lens, query_lens = [0, 7, 13, 9, 30], [6, 1, 5, 1, 1]  # decodes of different lengths
    meta = build_meta(prefix_lens, query_lens, block_size)
    k_cache, v_cache = empty_caches(int(meta.block_tables.max()) + 1, block_size)
    full_k = [torch.randn(p + q, HKV, D) for p, q in zip(prefix_lens, query_lens)]
    full_v = [torch.randn(p + q, HKV, D) for p, q in zip(prefix_lens, query_lens)]
    for i, p in enumerate(prefix_lens):
        fill_prefix(k_cache, meta.block_tables[i], full_k[i][:p])
        fill_prefix(v_cache, meta.block_tables[i], full_v[i][:p])
    q = torch.randn(sum(query_lens), HQ, D)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens)])

    out = attend(q, new_k, new_v, (k_cache, v_cache), meta, 0.3, window)

    start = 0
    for i, ql in enumerate(query_lens):
        expected = sdpa_reference(q[start:start + ql], full_k[i], full_v[i], window, 0.3)
        torch.testing.assert_close(out[start:start + ql], expected, atol=1e-5, rtol=1e-5)
        start += ql
    for i, (p, ql) in enumerate(zip(prefix_lens, query_lens)):  # new k/v landed in the cache
        bs, table = block_size, meta.block_tables[i]
        pos = p + ql - 1
        torch.testing.assert_close(k_cache[int(table[pos // bs]), pos % bs], full_k[i][pos])


def test_sliding_window_changes_result() -> None:
    torch.manual_seed(1)
    meta = build_meta([0], [12], 4)
    q, k, v = torch.randn(12, HQ, D), torch.randn(12, HKV, D), torch.randn(12, HKV, D)
    full = attend(q, k, v, empty_caches(5, 4), meta, 0.35, None)
    windowed = attend(q, k, v, empty_caches(5, 4), meta, 0.35, 4)
    torch.testing.assert_close(full[:4], windowed[:4])  # inside the window nothing is cut
    assert not torch.allclose(full[4:], windowed[4:])


def test_slot_minus_one_is_not_written() -> None:
    """A token whose k/v are cached already (slot -1) leaves the cache alone and reads the cached values."""
    torch.manual_seed(2)
    meta = build_meta([0], [6], 4)
    k_cache, v_cache = empty_caches(3, 4)
    k, v = torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    table = meta.block_tables[0]
    fill_prefix(k_cache, table, k[:3])  # positions 0..2 cached already
    fill_prefix(v_cache, table, v[:3])
    meta.slot_mapping[:3] = -1
    garbage_k, garbage_v = k.clone(), v.clone()
    garbage_k[:3] = 100.0
    garbage_v[:3] = -100.0
    q = torch.randn(6, HQ, D)

    out = attend(q, garbage_k, garbage_v, (k_cache, v_cache), meta, 0.35, None)

    torch.testing.assert_close(out, sdpa_reference(q, k, v, None, 0.35), atol=1e-5, rtol=1e-5)
    assert k_cache.nan_to_num().abs().max() < 50 and v_cache.nan_to_num().abs().max() < 50
    assert k_cache[0].isnan().all()  # block 0 is not in the table and must stay untouched


def test_output_keeps_query_dtype() -> None:
    meta = build_meta([0], [3], 4)
    q = torch.randn(3, HQ, D, dtype=torch.bfloat16)
    k = torch.randn(3, HKV, D, dtype=torch.bfloat16)
    caches = tuple(torch.zeros(2, 4, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    out = attend(q, k, k, caches, meta, 0.35, None)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = sdpa_reference(q.float(), k.float(), k.float(), None, 0.35)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def rotate_half_reference(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF Llama's apply_rotary_pos_emb: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_forward_rotates_q_and_k_by_their_positions() -> None:
    # a real rotary table (the model's layout); keys land in the cache rotated, queries attend rotated
    from tokenmill.worker.config import RopeScaling
    from tokenmill.worker.models.layers import RotaryEmbedding

    torch.manual_seed(3)
    table = RotaryEmbedding(D, 64, 10000.0, RopeScaling()).cos_sin_cache
    meta = build_meta([0], [8], 4)
    q, k, v = torch.randn(8, HQ, D), torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    positions = torch.arange(8)
    caches = empty_caches(2, 4)
    out = attend(q, k, v, caches, meta, 0.3, None, table)
    q_rot, k_rot = rotate_half_reference(q, table, positions), rotate_half_reference(k, table, positions)
    torch.testing.assert_close(out, sdpa_reference(q_rot, k_rot, v, None, 0.3), atol=1e-5, rtol=1e-5)
    table_ids = meta.block_tables[0]
    torch.testing.assert_close(caches[0][int(table_ids[1]), 3], k_rot[7], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out, attend(q, k, v, empty_caches(2, 4), meta, 0.3, None))
