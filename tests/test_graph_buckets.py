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
