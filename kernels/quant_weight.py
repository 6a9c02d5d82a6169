"""The packed layout of weight-only quantized matrices (W8A16 INT8, W4A16 INT4) that the quantized GEMM kernels
read (kernels/quant_gemv.py, kernels/quant_gemm.py), its argument checks, its in-register dequantization and
the plain-torch references.

A `PackedWeight` stands for a [N, K] matrix (nn.Linear layout: N outputs, K inputs) stored output-major, so
that the rows of fused projections (qkv, gate_up) are row ranges of every tensor:

    W[n, perm[k]] = (q[n, k] - z[n, k // group_size]) * s[n, k // group_size]     (perm = identity if None)
    W[n, k] = q[n, k] * s[n, k // group_size] + m[n, k // group_size]                 (with mins: GGUF Q4_1)

    qweight  bits 8: int8 [N, K], q = the value itself (symmetric: z = 0)
             bits 4: int32 [N, K // 8]; element k is bits 4j..4j+3 of word k // 8 with j = k % 8, q in 0..15
    scales   [N, ceil(K / group_size)] float16 / bfloat16 / float32 (per-channel: group_size = K, one column)
    zeros    bits 4 only: uint8 [N, ceil(K / group_size)] in 0..15 (asymmetric), or None: z = 8 (symmetric)
    mins     bits 4 only: [N, ceil(K / group_size)] in a scale dtype, or None: the additive offset of each group
             (llama.cpp's Q4_1 min; exclusive with zeros and perm)
    perm     int32 [K] or None: act-order (GPTQ desc_act) checkpoints store the columns sorted by group, so that
             each group is a contiguous run of packed columns; y = x[:, perm] @ Wp^T, the kernels gather the
             activation columns through perm (the weight stream itself stays sequential)

The last group may be shorter than group_size (K = 576 with groups of 128: four of 128 and one of 64), as
GPTQ checkpoints allow. This module is plain torch (the loaders use it without Triton); the kernels'
in-register dequantization is `dequant_tile` in kernels/quant_gemv.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PACK = 8  # 4-bit values per int32 word


@dataclass(frozen=True)
class PackedWeight:
    """A weight-only quantized [N, K] matrix in the layout above (no copy: views of the layer's tensors)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    bits: int
    group_size: int
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K)."""
        n, cols = self.qweight.shape
        return n, cols * (PACK if self.bits == 4 else 1)

    @property
    def num_groups(self) -> int:
        return -(-self.shape[1] // self.group_size)


def packed_shapes(n: int, k: int, bits: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """Shapes of qweight, scales (and zeros for bits 4) of an [N, K] matrix."""
    groups = -(-k // group_size)
    if bits == 8:
        return {"qweight": (n, k), "scales": (n, groups)}
    return {"qweight": (n, k // PACK), "scales": (n, groups), "zeros": (n, groups)}


def check_packed(w: PackedWeight, device: torch.device) -> None:
    """ValueError unless `w` is a well-formed PackedWeight on `device` (contiguous tensors, consistent shapes)."""
    if w.bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {w.bits}")
    q = w.qweight
    want_q = torch.int32 if w.bits == 4 else torch.int8
    if q.dim() != 2 or q.dtype != want_q or q.numel() == 0:
        raise ValueError(f"qweight of a {w.bits}-bit weight must be a non-empty 2-D {want_q} tensor, got "
                         f"{tuple(q.shape)} {q.dtype}")
    n, k = w.shape
    if w.group_size < 1 or (w.bits == 4 and w.group_size % PACK):
        raise ValueError(f"group_size must be >= 1 (a multiple of {PACK} for 4 bits), got {w.group_size}")
    shapes = packed_shapes(n, k, w.bits, w.group_size)
    if tuple(w.scales.shape) != shapes["scales"] or w.scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"scales must be {shapes['scales']} float16/bfloat16/float32, got "
                         f"{tuple(w.scales.shape)} {w.scales.dtype}")
    if w.zeros is not None:
        if w.bits != 4:
            raise ValueError("zero points are only supported for 4-bit weights")
        if tuple(w.zeros.shape) != shapes["zeros"] or w.zeros.dtype != torch.uint8:
            raise ValueError(f"zeros must be {shapes['zeros']} uint8, got {tuple(w.zeros.shape)} {w.zeros.dtype}")
    if w.perm is not None and (tuple(w.perm.shape) != (k,) or w.perm.dtype != torch.int32):
        raise ValueError(f"perm must be [{k}] int32, got {tuple(w.perm.shape)} {w.perm.dtype}")
    if w.mins is not None:
        if w.bits != 4 or w.zeros is not None or w.perm is not None:
            raise ValueError("mins are only supported for 4-bit weights without zeros or perm")
        if tuple(w.mins.shape) != shapes["scales"] or w.mins.dtype not in SCALE_DTYPES:
            raise ValueError(f"mins must be {shapes['scales']} float16/bfloat16/float32, got "
                             f"{tuple(w.mins.shape)} {w.mins.dtype}")
    for name, t in (("qweight", q), ("scales", w.scales), ("zeros", w.zeros), ("perm", w.perm), ("mins", w.mins)):
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the activations on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


# ---------------------------------------------------------------------------------------------------------
# packing and the torch references
# ---------------------------------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 (K % 8 == 0) -> int32 [N, K // 8], element k at bits 4 (k % 8) of word k // 8."""
    n, k = q.shape
    if k % PACK:
        raise ValueError(f"4-bit packing needs K % {PACK} == 0, got K = {k}")
    nibbles = q.to(torch.int64).reshape(n, k // PACK, PACK)
    shifts = torch.arange(0, 4 * PACK, 4, device=q.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(-1)  # < 2**32: no carries between nibbles
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> uint8 [N, K] (inverse of pack_int4)."""
    shifts = torch.arange(0, 4 * PACK, 4, device=words.device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 0xF).reshape(*words.shape[:-1], -1).to(torch.uint8)


# AutoAWQ's GEMM layout packs 8 outputs per word in an interleaved order: nibble j holds output 8c + _AWQ_ORDER[j]
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq_columns(n: int, order: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(n) // PACK) * PACK + torch.tensor(order)[torch.arange(n) % PACK]


def awq_pack(v: torch.Tensor) -> torch.Tensor:
    """v [R, N] in 0..15 -> int32 [R, N // 8] in AWQ's interleaved order."""
    return pack_int4(v[:, _awq_columns(v.shape[1], _AWQ_ORDER).to(v.device)])


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N // 8] in AWQ's order -> uint8 [R, N] (inverse of awq_pack)."""
    inverse = [0] * PACK
    for j, m in enumerate(_AWQ_ORDER):
        inverse[m] = j  # output 8c + m sits at nibble inverse[m]
    nib = unpack_int4(words)
    return nib[:, _awq_columns(nib.shape[1], tuple(inverse)).to(nib.device)]


def unpacked_q(w: PackedWeight) -> torch.Tensor:
    """The integer values q [N, K] (int16) in packed column order."""
    return (unpack_int4(w.qweight) if w.bits == 4 else w.qweight).to(torch.int16)


def _per_column(t: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """[N, groups] -> [N, K]: each group's value repeated over its columns."""
    return t.repeat_interleave(group_size, dim=1)[:, :k]


def dequantize_packed(w: PackedWeight) -> torch.Tensor:
    """The float32 matrix W [N, K] in input column order (perm undone)."""
    k = w.shape[1]
    q = unpacked_q(w).float()
    if w.mins is not None:
        return q * _per_column(w.scales.float(), w.group_size, k) + _per_column(w.mins.float(), w.group_size, k)
    if w.zeros is not None:
        z = _per_column(w.zeros.float(), w.group_size, k)
    else:
        z = torch.full((1, 1), 8.0 if w.bits == 4 else 0.0, device=q.device)
    wp = (q - z) * _per_column(w.scales.float(), w.group_size, k)
    if w.perm is None:
        return wp
    out = torch.empty_like(wp)
    out[:, w.perm.long()] = wp
    return out


def quant_matmul_ref(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias): W dequantized in fp32, rounded once to x's dtype (as the kernels
    dequantize in registers), then F.linear."""
    return F.linear(x, dequantize_packed(w).to(x.dtype), bias)


def scale_later(w: PackedWeight) -> bool:
    """Per-channel symmetric weights (one scale per row): the kernels sum q * x and scale the sums once."""
    return w.zeros is None and w.mins is None and w.num_groups == 1


# ---- FP8 W8A8 (e4m3): the quantization and the emulated product (worker/quant/fp8.py, kernels/fp8_gemv.py) ------

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FP8_INV_MAX = 1.0 / FP8_MAX  # the scales' factor (quantize_fp8_rows); 448 * fp32(1 / 448) == 1 exactly
_FP8_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q e4m3 [R, C], scales float32 [R, 1]) with x ~ q * scale, scale = max|x_row| / 448.

    The scale is max|x_row| times fp32(1 / 448): what PyTorch's CUDA division by a Python scalar computes
    (a * reciprocal(b)), where its CPU division rounds the quotient itself and may differ in the last bit.
    Written as the product, the scales are the same on every device, and the Triton kernel
    (kernels/fp8_quant.py) computes the same bits."""
    x32 = x.float()
    scales = (x32.abs().amax(dim=-1, keepdim=True) * FP8_INV_MAX).clamp_min(_FP8_MIN_SCALE)
    return round_fp8(x32, scales), scales


def round_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x / scales rounded to e4m3, saturating at +-448 (x float32 [R, C], scales float32 [R, 1])."""
    return (x / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The emulated W8A8 product: x [M, K] quantized per token, both operands dequantized to fp32, F.linear,
    one rounding to x's dtype (scales [N, 1] per output channel)."""
    qx, sx = quantize_fp8_rows(x)
    y = F.linear(qx.float() * sx, qweight.float() * scales.reshape(-1, 1))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
