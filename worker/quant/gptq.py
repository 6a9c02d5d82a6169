"""GPTQ (Frantar et al., 2022): INT4 or FP8 (e4m3) rounding with second-order error feedback, for one weight
matrix given the Hessian of its layer-wise reconstruction loss ||W X - Q X||^2, H = 2 X X^T / n over calibration
inputs X.

Columns are quantized one at a time (in descending diag(H) order with act-order); each column's rounding error,
scaled by the inverse Hessian's Cholesky factor, is pushed onto the columns not yet quantized, lazily per
block of `block_size` columns. Group parameters (worker/quant/rtn.py's grid) are fixed when a group's first
column comes up, from the columns as updated so far (with `clip`: the shrunk range of least rounding error,
each column's squared error weighted by its diag(H), worker/quant/rtn.py). Rows are independent given H, so
the parts of a fused projection (q/k/v, gate/up: one input, one H) can be quantized together or apart with
the same result.

INT4's result is in the packed column order of kernels/quant_weight.py: with act-order, packed column k is input
column perm[k] and groups are runs of group_size packed columns (GPTQ's g_idx[perm[k]] = k // group_size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.kernels.quant_weight import FP8, quantize_fp8_rows, round_fp8
from tokenmill.worker.quant.rtn import MseClip, int4_group_params, int4_round

DAMP = 0.01  # of mean(diag(H)), added to the diagonal


@dataclass(frozen=True)
class GptqOptions:
    """How GPTQ rounds (not what it stores: the grid and layout are QuantConfig's).
    damp: fraction of mean(diag H) added to H's diagonal before inverting.
    clip: the group range's MSE search (None: the full min-max range, GPTQ's default).
    true_sequential: within a decoder layer, each projection's Hessian comes from inputs computed with the
    projections before it already quantized (qkv, then o, then gate_up, then down), not all four from the float
    layer in one pass."""

    damp: float = DAMP
    clip: MseClip | None = None
    true_sequential: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.damp < 1.0:
            raise ValueError(f"GPTQ damp must be in (0, 1), got {self.damp}")


@dataclass(frozen=True)
class GptqResult:
    q: torch.Tensor  # uint8 [N, K] in 0..15, packed column order
    scales: torch.Tensor  # [N, G] scale dtype
    zeros: torch.Tensor  # uint8 [N, G] (8 everywhere when symmetric)
    perm: torch.Tensor | None  # int64 [K] (act-order) or None


class Hessian:
    """Running H = 2 X X^T / n of one projection's inputs (float64 sums; x rows are tokens)."""

    def __init__(self, columns: int) -> None:
        self.sum = torch.zeros(columns, columns, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """x [..., columns]: every row a calibration token's input to the projection."""
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float64).cpu()
        self.sum += x2.T @ x2
        self.count += x2.shape[0]

    def value(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no calibration tokens reached this projection")
        return (2.0 * self.sum / self.count).float()


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1."""
    h = h.clone()
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    lower = torch.linalg.cholesky(h)
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, symmetric: bool, act_order: bool,
                  scale_dtype: torch.dtype, *, damp: float = DAMP, block_size: int = 128,
                  clip: MseClip | None = None) -> GptqResult:
    """GPTQ of w [N, K] (any float dtype; computed in float32) under Hessian h [K, K]."""
    n, k = w.shape
    if block_size % group_size:
        raise ValueError(f"block_size {block_size} must be a multiple of group_size {group_size}")
    w, h, perm = _prepare(w, h, act_order)
    hdiag = torch.diag(h)  # column weights of the clip search, in the (possibly permuted) column order
    groups = -(-k // group_size)
    q = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, groups, dtype=torch.float32)
    zeros = torch.zeros(n, groups, dtype=torch.float32)

    def round_column(col: int, block: torch.Tensor, i: int) -> torch.Tensor:
        g = col // group_size
        if col % group_size == 0:  # a group starts: its grid from the columns as updated so far
            s, z = int4_group_params(block[:, i:i + group_size], symmetric, scale_dtype, clip,
                                     hdiag[col:col + group_size])
            scales[:, g:g + 1], zeros[:, g:g + 1] = s, z
        s, z = scales[:, g:g + 1], zeros[:, g:g + 1]
        qi = int4_round(block[:, i:i + 1], s, z)
        q[:, col] = qi[:, 0].to(torch.uint8)
        return ((qi - z) * s)[:, 0]

    _feedback(w, _inverse_cholesky(h, damp), block_size, round_column)
    return GptqResult(q, scales.to(scale_dtype), zeros.to(torch.uint8), perm)


def gptq_quantize_fp8(w: torch.Tensor, h: torch.Tensor, *, act_order: bool = True, damp: float = DAMP,
                      block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of w [N, K] on the FP8 W8A8 weight grid (e4m3 times one float32 scale per output row, the scale
    max|w_row| / 448 of the unquantized row, as quantize_fp8_rows sets it; columns pushed past it by the error
    feedback saturate at +-448). Returns (qweight float8_e4m3fn [N, K] in the input's column order,
    scales float32 [N, 1]): the canonical tensors of Fp8LinearMethod. act-order changes only the order the
    columns are rounded in (there are no groups, so nothing of it is stored)."""
    _, scales = quantize_fp8_rows(w)
    w, h, perm = _prepare(w, h, act_order)
    q = torch.zeros(w.shape, dtype=FP8)

    def round_column(col: int, block: torch.Tensor, i: int) -> torch.Tensor:
        qi = round_fp8(block[:, i:i + 1], scales)
        q[:, col] = qi[:, 0]
        return (qi.float() * scales)[:, 0]

    _feedback(w, _inverse_cholesky(h, damp), block_size, round_column)
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return q, scales


def _prepare(w: torch.Tensor, h: torch.Tensor, act_order: bool,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """float32 copies of w and h with dead inputs (diag(H) == 0: never active, their weights do not matter)
    zeroed, and with act-order both permuted to descending diag(H) (the permutation, else None)."""
    w = w.float().clone()
    h = h.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    return w, h, perm


RoundColumn = Callable[[int, torch.Tensor, int], torch.Tensor]


def _feedback(w: torch.Tensor, hinv: torch.Tensor, block_size: int, round_column: RoundColumn) -> None:
    """GPTQ's column loop over w [N, K] (float32, updated in place) with hinv the upper Cholesky factor of H^-1:
    `round_column(col, block, i)` rounds column i of the current block (global column col; the block's later
    columns already carry the feedback so far) and returns its dequantized value [N]; its error, scaled by
    hinv, is pushed onto the block's later columns at once and onto the columns after the block lazily."""
    k = w.shape[1]
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        wb = w[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            e = (wb[:, i] - round_column(b0 + i, wb, i)) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
