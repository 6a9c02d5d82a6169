"""Round-to-nearest quantizers: a dense weight [N, K] -> integer values and scales (and zero points) on the
grids of the weight-only formats. GPTQ (worker/quant/gptq.py) uses the same grids, one group at a time.

Grids (GPTQ's, so RTN and GPTQ checkpoints are comparable and stored alike):
    INT8 per output channel, symmetric: s = max|w| / 127, q = round(w / s) in -127..127, w ~ q * s.
    INT4 per group of `group_size` input columns (the last group may be shorter):
      symmetric:  s = 2 max|w| / 15, z = 8;  asymmetric: s = (max(w, 0) - min(w, 0)) / 15, z = round(-min / s);
      q = clamp(round(w / s) + z, 0, 15), w ~ (q - z) * s.
Scales are rounded to their storage dtype before q is computed, so q is the best value for the stored scale.

Clipping (`MseClip`, an option of both RTN and GPTQ; the stored grid and layout are the same): instead of the
group's full range [min, max], the range shrunk by the factor p in [min_shrink, 1] (`steps` values, 1 included)
that gives each row its least squared rounding error, optionally weighted per column (GPTQ: by diag(H), the
input's mean square, so errors on busy inputs count more). One outlier then no longer sets the step of its 127
(or 15) neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_MAX = 15


def scale_dtype_for(weight_dtype: torch.dtype) -> torch.dtype:
    """INT4 scales: float32 for float32 models, float16 otherwise (what GPTQ / AWQ checkpoints store)."""
    return torch.float32 if weight_dtype == torch.float32 else torch.float16


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales float32 [N, 1])."""
    w32 = w.float()
    scales = (w32.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w32 / scales).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


@dataclass(frozen=True)
class MseClip:
    """Search the INT4 group range shrink p over `steps` values from 1 down to `min_shrink` (each row its own)."""

    min_shrink: float = 0.75
    steps: int = 21

    def __post_init__(self) -> None:
        if not 0.0 < self.min_shrink <= 1.0:
            raise ValueError(f"clip min_shrink must be in (0, 1], got {self.min_shrink}")
        if self.steps < 1:
            raise ValueError(f"clip steps must be >= 1, got {self.steps}")

    def factors(self) -> list[float]:
        if self.steps == 1:
            return [1.0]
        return [1.0 - (1.0 - self.min_shrink) * i / (self.steps - 1) for i in range(self.steps)]


def _range_params(lo: torch.Tensor, hi: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype,
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Scale and zero point [N, 1] of the grid over [lo, hi] (lo <= 0 <= hi, [N, 1] each)."""
    flat = hi == lo  # an all-zero group: any scale works
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
    scale = ((hi - lo) / INT4_MAX).to(scale_dtype).float()
    zero = torch.full_like(scale, 8.0) if symmetric else torch.round(-lo / scale).clamp(0, INT4_MAX)
    return scale, zero


def int4_group_params(w: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype, clip: MseClip | None = None,
                      column_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (float32 [N, 1] each) of one group of columns w [N, g] (the GPTQ grid above); with
    `clip`, of the shrunk range with the least rounding error, squared and weighted by column_weight [g] (>= 0)."""
    w32 = w.float()
    lo = w32.amin(dim=1, keepdim=True).clamp_max(0.0)
    hi = w32.amax(dim=1, keepdim=True).clamp_min(0.0)
    if symmetric:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scale, zero = _range_params(lo, hi, symmetric, scale_dtype)
    if clip is None:
        return scale, zero
    cw = torch.ones(w32.shape[1], device=w32.device) if column_weight is None else column_weight.to(w32)
    best = _group_error(w32, scale, zero, cw)
    for p in clip.factors()[1:]:
        s, z = _range_params(lo * p, hi * p, symmetric, scale_dtype)
        err = _group_error(w32, s, z, cw)
        better = err < best
        scale, zero, best = torch.where(better, s, scale), torch.where(better, z, zero), torch.minimum(err, best)
    return scale, zero


def _group_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, column_weight: torch.Tensor,
                 ) -> torch.Tensor:  # fmt: skip
    """Weighted squared rounding error [N, 1] of w [N, g] on the grid (scale, zero)."""
    d = (int4_round(w, scale, zero) - zero) * scale - w
    return (d * d * column_weight).sum(dim=1, keepdim=True)


def int4_round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q = clamp(round(w / scale) + zero, 0, 15) (float32, like w)."""
    return (torch.round(w.float() / scale) + zero).clamp(0, INT4_MAX)


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype,
                  clip: MseClip | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q uint8 [N, K] in 0..15, scales [N, G] in scale_dtype, zeros uint8 [N, G]); G = ceil(K / g)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    groups = -(-k // group_size)
    scales = torch.empty(n, groups, dtype=torch.float32, device=w.device)
    zeros = torch.empty(n, groups, dtype=torch.float32, device=w.device)
    for g in range(groups):
        cols = slice(g * group_size, min(k, (g + 1) * group_size))
        s, z = int4_group_params(w[:, cols], symmetric, scale_dtype, clip)
        q[:, cols] = int4_round(w[:, cols], s, z).to(torch.uint8)
        scales[:, g:g + 1], zeros[:, g:g + 1] = s, z
    return q, scales.to(scale_dtype), zeros.to(torch.uint8)
