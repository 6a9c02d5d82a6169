"""Greedy decoding with Hugging Face transformers as the reference, and the float-tie check used when a
token differs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

TIE_TOL = 1e-3  # logit gap under which two implementations may legitimately pick different argmaxes


@torch.no_grad()
def hf_greedy(
    model: Any, prompt: Sequence[int], n: int, eos: Sequence[int] = ()
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was chosen from (HF forward with its KV cache)."""
    ids = torch.tensor([list(prompt)])
    out = model(ids, use_cache=True)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(n):
        step_logits = out.logits[0, -1].float()
        tok = int(step_logits.argmax())
        tokens.append(tok)
        logits.append(step_logits)
        if tok in eos:
            break
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


@dataclass
class Comparison:
    equal: bool
    tie_at: int | None = None  # first position where the tokens differ by a float tie
    gap: float = 0.0


def compare_greedy(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> Comparison:
    """Equal, or the first difference is a float tie in the reference's own logits (after which the
    sequences may legitimately diverge). Anything else fails the assertion here."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = float(ref_logits[i][b] - ref_logits[i][a])
            assert gap < TIE_TOL, f"token {i}: ours {a}, reference {b}, logit gap {gap:.3g} is not a tie"
            return Comparison(False, i, gap)
    assert len(ours) == len(ref), f"lengths differ: ours {len(ours)}, reference {len(ref)}\n{ours}\n{ref}"
    return Comparison(True)
