"""Prompt lookup (n-gram) drafts: no draft model, no training. The request's last n tokens are looked up
earlier in its own tokens (prompt and output), longest n first; the tokens that followed the latest earlier
occurrence are the drafts. Strong where output copies its input (code edits, summaries, quotes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.worker.request import Request
from tokenmill.worker.spec.proposer import DraftProposer


class NgramProposer(DraftProposer):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        assert 1 <= min_n <= max_n, f"n-gram sizes {min_n}..{max_n}"
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        return [lookup(r.token_ids, k, self.min_n, self.max_n) for r, k in zip(requests, num_drafts)]


def lookup(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    min_n..max_n tokens; [] when none occurs earlier. A continuation that runs into the end of `tokens` reads
    on through the drafts themselves (a repeating pattern continues with its period)."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(seq[:-1], n)  # [L - n, n]: window i is seq[i : i + n], i + n < L
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # first token after the occurrence; start < L
            ext = list(tokens[start:start + k])
            while len(ext) < k:  # seq[start + j] for j >= L - start is drafts[j - (L - start)]
                ext.append(ext[len(ext) - (length - start)])
            return ext
    return []
