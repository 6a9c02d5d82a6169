"""Verification of draft tokens in the step's one target forward.

A request with k drafts d_1..d_k is scored at k+1 rows: the logits after its last known token and after each
draft. Row j is sampled exactly as plain decoding samples output position n+j (n: outputs so far) given the
drafts before it: same penalties, bans and filters, and the request's seeded race at (seed, n+j). Drafts are
accepted while they equal the target's token of their row; the target's token of the first row that
disagrees (or of row k, when all agree) follows them. So a request yields 1..k+1 tokens per step.

Lossless, and token-identical to plain decoding with the same seed (greedy rows: the argmax):
  q is a point mass at the draft d (proposers are deterministic): accept with min(1, p(d)/q(d)) = p(d), else draw
  from the residual max(0, p - q) normalised, which is p without d renormalised. Drawing t ~ p with the seeded
  race and accepting iff t == d does both at once: P(accept) = p(d), and a rejected t is p given t != d."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

_NO_DRAFT = -1  # pads the draft grid: never equal to a token


class DraftLayout(NamedTuple):
    """Where S sampling requests' rows sit among the R = sum(k_s + 1) sampled rows (host tensors)."""

    starts: list[int]  # [S] first row of each request; its rows are starts[s] .. starts[s] + k_s
    rows: Tensor  # [S, K] i64: the row whose target token draft j of request s must equal (past k_s: any of its rows)
    drafts: Tensor  # [S, K] i64: d_s,1..d_s,k_s, then _NO_DRAFT

    @classmethod
    def build(cls, drafts: Sequence[Sequence[int]]) -> DraftLayout:
        starts = [0] * len(drafts)
        for s in range(1, len(drafts)):
            starts[s] = starts[s - 1] + len(drafts[s - 1]) + 1
        width = max(len(d) for d in drafts)
        index = [[start + min(j, len(d)) for j in range(width)] for start, d in zip(starts, drafts)]
        grid = [list(d) + [_NO_DRAFT] * (width - len(d)) for d in drafts]
        return cls(starts, torch.tensor(index, dtype=torch.int64), torch.tensor(grid, dtype=torch.int64))


def accept_drafts(sampled: Tensor, index: Tensor, drafts: Tensor) -> Tensor:
    """[R] target tokens per row, [S, K] DraftLayout.rows, [S, K] DraftLayout.drafts (all on the device)
    -> [S] i64: the number of leading drafts equal to the target's token of their row."""
    return (sampled[index] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)


def tokens_of(sampled: Sequence[int], start: int, accepted: int) -> list[int]:
    """The tokens a request yields: its accepted drafts (equal to the target's tokens of their rows) and the
    target's token after them."""
    return list(sampled[start : start + accepted + 1])
