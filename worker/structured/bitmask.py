"""The packed token bitmask of constrained rows: int32 [M, ceil(V/32)], bit j of word w set iff token
32 w + j is allowed (llguidance's layout). Built on the host, shipped with the step's other inputs and
unpacked on the logits' device."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tokenmill.worker.request import Request

BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


class StepBitmask(NamedTuple):
    """The masks of a step's constrained sampling requests: `bits[m]` is the mask of `requests[m]`."""

    requests: list[Request]
    bits: Tensor  # [M, ceil(V/32)] int32, CPU


def unpack_bitmask(bits: Tensor, vocab_size: int) -> Tensor:
    """[M, W] int32 -> [M, V] bool, True where the token is allowed (bit 31 is the sign bit: the shift is
    arithmetic, and `& 1` reads it all the same)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bits.device)  # [32]
    allowed = (bits[:, :, None] >> shifts) & 1  # [M, W, 32]
    return allowed.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask(x: Tensor, rows: Tensor, bits: Tensor) -> Tensor:
    """[N, V] logits, [M] i64 rows, [M, W] int32 masks -> new [N, V]: the rows' disallowed tokens -inf,
    other rows unchanged. `x` is not modified."""
    banned = torch.zeros(x.shape, dtype=torch.bool, device=x.device)  # [N, V]
    banned[rows] = ~unpack_bitmask(bits, x.shape[1])
    return x.masked_fill(banned, float("-inf"))
