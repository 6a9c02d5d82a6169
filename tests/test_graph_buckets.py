"""Token buckets of the piecewise CUDA graphs (CPU: the bucket arithmetic only; the graphs need CUDA)."""

from __future__ import annotations

import pytest

from tokenmill.worker.cuda_graphs import mixed_graph_sizes


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 256, 2048, 2100, 8192])
def test_buckets_cover_every_step_with_bounded_padding(max_tokens: int) -> None:
    sizes = mixed_graph_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    for t in range(1, max_tokens + 1):
        b = next(s for s in sizes if s >= t)
        if t > 256 and b != max_tokens:
            assert (b - t) / t <= 0.25, (t, b)


def test_positions_and_slots_match_the_per_token_rule() -> None:
    """The vectorized host inputs against the rule stated per token (position p of request i sits in block
    table[i][p // block_size] at offset p % block_size)."""
    import random

    import numpy as np

    from tokenmill.worker.model_runner import _block_table, _positions_and_slots

    rng = random.Random(0)
    for _ in range(50):
        bs = rng.choice([1, 4, 16])
        q_lens, starts, tables = [], [], []
        for _ in range(rng.randrange(1, 9)):
            n, s = rng.randrange(1, 40), rng.randrange(0, 60)
            q_lens.append(n)
            starts.append(s)
            tables.append(rng.sample(range(1000), -(-(s + n) // bs)))
        want_pos = [p for s, n in zip(starts, q_lens) for p in range(s, s + n)]
        want_slots = [t[p // bs] * bs + p % bs for s, n, t in zip(starts, q_lens, tables) for p in range(s, s + n)]
        pos, slots = _positions_and_slots(np.asarray(q_lens), np.asarray(starts), _block_table(tables), bs)
        assert pos.tolist() == want_pos and slots.tolist() == want_slots
