"""An orthonormal rotation of keys and values for an FP8 (e4m3) KV cache (EngineConfig.kv_cache_rotation).

e4m3 keeps 3 mantissa bits: each cached element is off by up to 1/16 of itself. Llama-like queries and keys have
their outliers in the same few channels, so a score q.k is carried by a few products and its error is theirs, with
no averaging. R = H_D / sqrt(D) (Sylvester Hadamard, D = head_dim, a power of two) spreads every channel over all
D, so each carries an equal share of the score and the D independent rounding errors average out (and fewer quiet
channels fall into e4m3's subnormals). It is orthonormal (R @ R.T = I), hence exact in real arithmetic:

    keys     k' = rope(k) @ R, after rotary (rotary and R do not commute), queries alike: q' = rope(q) @ R, so
             q' . k' = rope(q) . rope(k);
    values   v' = v @ R is cached, and the attention output (a convex combination of cached values) is rotated
             back: out = out' @ R.T.

Both attention backends apply it around their own rotary / cache write / attention (the fused decode kernel of the
Triton backend cannot rotate: with a rotation that backend takes its unfused path). The math is float32, each
result rounded once to its input's dtype; with a float cache the outputs equal the unrotated ones up to that
rounding. The matrix is made once per model, a persistent tensor on its device (CUDA-graph safe).
"""

from __future__ import annotations

import torch


def hadamard_rotation(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """R = H / sqrt(head_dim), [head_dim, head_dim] float32, symmetric and orthonormal. ValueError (naming the
    flag) unless head_dim is a power of two."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"--kv-cache-rotation hadamard needs a power-of-two head dim; this model's is {head_dim} "
                         "(use --kv-cache-rotation none)")
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < head_dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return (h / head_dim**0.5).to(torch.float32).to(device)


def kv_rotation_matrix(rotation: str, head_dim: int, device: torch.device) -> torch.Tensor | None:
    """The backends' kv_rotation for EngineConfig.kv_cache_rotation: None for "none"."""
    if rotation == "none":
        return None
    assert rotation == "hadamard", rotation  # EngineConfig validated it
    return hadamard_rotation(head_dim, device)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ r [D, D] in float32, rounded once to x's dtype (a new contiguous tensor)."""
    return torch.matmul(x.float(), r).to(x.dtype)


def rotate_back(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ r.T: undoes `rotate` for an orthonormal r."""
    return torch.matmul(x.float(), r.mT).to(x.dtype)
