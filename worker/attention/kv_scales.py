"""Scales of an FP8 (e4m3) KV cache: one per kv head for K and one for V, per layer (AttentionLayer.kv_scales,
[2, Hkv] float32; a cached entry stands for entry * scale).

Per head rather than per tensor: Llama-like keys carry outlier heads/channels whose magnitude is many times the
others'; a per-head scale keeps the quiet heads' values in e4m3's normal range, and in the kernels it costs
nothing (each attention program reads one kv head: one scale folded into the scores' scale, one into the output).

Calibration: the engine's first step runs eagerly with `AttentionBackend.calibrate_kv_scales` set; every layer then
sets its scales from that step's (rotated) keys and values before writing them: scale = the power of two at or
above amax * HEADROOM / 448 per head. Powers of two make quantization (x / s) and dequantization (q * s) exact
scalings, so the kernels and the torch reference agree bit for bit; in a floating-point format a scale between
powers of two would buy nothing but the top half-octave of range. HEADROOM leaves 2-4x of range above the
calibration step's largest value for later prompts (larger values saturate at +-448 * scale); below it, e4m3 keeps
3 mantissa bits down to amax / 2**13 or so. The scales stay fixed afterwards (cached entries were written with them).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.attention_ref import FP8_KV_MAX

HEADROOM = 2.0


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """amax [Hkv] (>= 0) -> float32 [Hkv]: the smallest power of two s with amax * HEADROOM / s <= 448."""
    want = (amax.float() * HEADROOM / FP8_KV_MAX).clamp_min(2.0**-100)
    return torch.exp2(torch.ceil(torch.log2(want)))


def calibrate(k: torch.Tensor, v: torch.Tensor, kv_scales: torch.Tensor) -> None:
    """Set kv_scales [2, Hkv] in place from this step's rotated keys k and values v [T, Hkv, D]."""
    for row, x in enumerate((k, v)):
        kv_scales[row].copy_(pow2_scales(x.detach().abs().amax(dim=(0, 2))))
