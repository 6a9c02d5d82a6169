"""GPTQ (Frantar et al., 2022): INT4 rounding with second-order error feedback, for one weight matrix given the
Hessian of its layer-wise reconstruction loss ||W X - Q X||^2, H = 2 X X^T / n over calibration inputs X.

Columns are quantized one at a time (in descending diag(H) order with act-order); each column's rounding error,
scaled by the inverse Hessian's Cholesky factor, is pushed onto the columns not yet quantized, lazily per
block of `block_size` columns. Group parameters (worker/quant/rtn.py's grid) are fixed when a group's first
column comes up, from the columns as updated so far (with `clip`: the shrunk range of least rounding error,
each column's squared error weighted by its diag(H), worker/quant/rtn.py). Rows are independent given H, so
the parts of a fused projection (q/k/v, gate/up: one input, one H) can be quantized together or apart with
the same result.

The result is in the packed column order of kernels/quant_weight.py: with act-order, packed column k is input
column perm[k] and groups are runs of group_size packed columns (GPTQ's g_idx[perm[k]] = k // group_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    w = w.float().clone()
    h = h.float().clone()
    dead = torch.diag(h) == 0  # inputs never active: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    hdiag = torch.diag(h)  # column weights of the clip search, in the (possibly permuted) column order
    hinv = _inverse_cholesky(h, damp)
    groups = -(-k // group_size)
    q = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, groups, dtype=torch.float32)
    zeros = torch.zeros(n, groups, dtype=torch.float32)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        wb = w[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:  # a group starts: its grid from the columns as updated so far
                g = col // group_size
                s, z = int4_group_params(wb[:, i:i + group_size], symmetric, scale_dtype, clip,
                                         hdiag[col:col + group_size])
                scales[:, g:g + 1], zeros[:, g:g + 1] = s, z
            g = col // group_size
            s, z = scales[:, g:g + 1], zeros[:, g:g + 1]
            qi = int4_round(wb[:, i:i + 1], s, z)
            q[:, col] = qi[:, 0].to(torch.uint8)
            e = (wb[:, i] - ((qi - z) * s)[:, 0]) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return GptqResult(q, scales.to(scale_dtype), zeros.to(torch.uint8), perm)
