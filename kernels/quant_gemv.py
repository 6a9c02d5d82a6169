"""Skinny matmuls for decode (M <= 16 tokens) over weight-only quantized weights (INT8 / INT4, the layout of
kernels/quant_weight.py), with the input producers of kernels/gemv.py fused in front:

    quant_skinny_matmul(x [M, K], w, bias)                        y = x @ W.T + bias
    quant_add_rmsnorm_matmul(h, residual, norm_weight, eps, w)    (rmsnorm(h + residual) @ W.T (+ bias), h + residual)
    quant_silu_mul_matmul(gu [M, 2I], w [N, I])                   (silu(gu[:, :I]) * gu[:, I:]) @ W.T

Numerics, arguments, outputs and launch shapes as in kernels/gemv.py (its prologue helpers and SkinnyConfig
rule are used as they are); the only change is the weight tile: each program streams BLOCK_N packed rows
once (int8: 1 byte per weight, int4: 4 bits + a scale (+ zero or min) per group) and dequantizes them in
registers to the activations' dtype (`dequant_tile`) before the same tl.dot / FMA products; or, with
QuantSkinnyConfig.planes, makes the fields floats by their bits instead of converting them (M = 1 by FMA,
`planes_fma`; INT4 in groups of 128 on tensor cores, `magic_dot`). Two additions:
QuantSkinnyConfig.split_k > 1 cuts K into slices, one program per (BLOCK_N rows, slice), whose fp32 partial sums
`split_k_sum` adds up in a second kernel (more programs in flight when N / BLOCK_N alone does not fill the
GPU); and without a per-call config the launch shape is the device's tuned table entry (kernels/tuned.py),
else the default rule. Per-channel
symmetric weights sum q * x and scale each output once in the epilogue. Weights with mins (GGUF Q4_1) are
q * s + m. Act-order weights (perm) gather the activation columns through perm; the RMSNorm statistics and
the new residual stay in natural column order.

The references are the unfused sequences with the weight dequantized in fp32 and rounded once to the
activations' dtype (quant_weight.quant_matmul_ref).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import tuned
from tokenmill.kernels.activation import silu_and_mul_ref
from tokenmill.kernels.gemv import (
    SkinnyConfig,
    _check_act,
    _check_norm_args,
    _check_norm_outs,
    _check_out,
    _stats_block,
    _x_tile,
    alloc_outputs,
    check_bias,
    default_config,
    row_rstd,
)
from tokenmill.kernels.launch import next_pow2, num_sms, pdl_launch_args, pdl_release, pdl_wait
from tokenmill.kernels.quant_weight import PackedWeight, check_packed, quant_matmul_ref, scale_later
from tokenmill.kernels.rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from tokenmill.kernels.tuned import QuantSkinnyConfig

_PLAIN, _NORM, _SILU = 0, 1, 2  # PROLOGUE modes, as in kernels/gemv.py


# ---------------------------------------------------------------------------------------------------------
# in-register dequantization of kernels/quant_weight.py's layout (shared with the tiled kernel)
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def activation_cols(perm_ptr, offs_k, K, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    """The activation columns of packed columns offs_k: act-order weights (HAS_PERM) gather them through perm."""
    # One return per constexpr branch: Triton types every return of the function, so an early `return offs_k`
    # beside a load through a dummy perm_ptr (the int8 weight itself when there is no perm) does not compile.
    if HAS_PERM:
        if EVEN_K:
            cols = tl.load(perm_ptr + offs_k)
        else:
            cols = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
    else:
        cols = offs_k
    return cols


@triton.jit
def group_load(rows, g, mask, EVEN_K: tl.constexpr):
    """Per-group values (scales, zeros, mins) at rows + g as fp32; 0 where `mask` is false (not EVEN_K)."""
    if EVEN_K:
        return tl.load(rows + g).to(tl.float32)
    return tl.load(rows + g, mask=mask, other=0).to(tl.float32)


@triton.jit
def dequant_tile(
    q_rows,  # [BLOCK_N, 1] pointers to the packed rows (int8 [K] or int32 [K // 8] per row)
    s_rows,  # [BLOCK_N, 1] pointers to the rows of scales [groups]
    z_rows,  # [BLOCK_N, 1] pointers to the rows of zeros [groups] (HAS_ZEROS)
    m_rows,  # [BLOCK_N, 1] pointers to the rows of mins [groups] (HAS_MINS)
    k0,  # first column of the tile (a multiple of BLOCK_K)
    K,
    dtype: tl.constexpr,  # the activations' dtype: the tile's
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # group size (per-channel: unused, SCALE_LATER)
    HAS_ZEROS: tl.constexpr,
    HAS_MINS: tl.constexpr,  # W = q * s + m (GGUF Q4_1): no zero point
    SCALE_LATER: tl.constexpr,  # per-channel symmetric: return (q - z) unscaled, the caller scales the sums
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks
):
    """The weight tile W[rows, k0 : k0 + BLOCK_K] (packed column order) as [BLOCK_N, BLOCK_K] in `dtype`;
    0 past K. Each packed word is loaded once; scales and zeros once per column (L1-cached repeats)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = (offs_k < K)[None, :]
    if BITS == 4:
        offs_w = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # k0: a multiple of BLOCK_K
        if EVEN_K:
            words = tl.load(q_rows + offs_w[None, :])  # [BLOCK_N, BLOCK_K // 8] int32
        else:
            words = tl.load(q_rows + offs_w[None, :], mask=(offs_w < K // 8)[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K // 8, 8]
        q = tl.reshape(nib, (words.shape[0], BLOCK_K)).to(tl.float32)  # element 8 i + j = nibble j of word i
    else:
        if EVEN_K:
            q = tl.load(q_rows + offs_k[None, :]).to(tl.float32)
        else:
            q = tl.load(q_rows + offs_k[None, :], mask=k_mask, other=0).to(tl.float32)
    if HAS_MINS:
        g = (offs_k // GROUP)[None, :]
        return (q * group_load(s_rows, g, k_mask, EVEN_K) + group_load(m_rows, g, k_mask, EVEN_K)).to(dtype)
    if HAS_ZEROS:
        g = (offs_k // GROUP)[None, :]
        if EVEN_K:
            z = tl.load(z_rows + g).to(tl.float32)
        else:
            z = tl.load(z_rows + g, mask=k_mask, other=0).to(tl.float32)
    elif BITS == 4:
        z = 8.0
    else:
        z = 0.0
    if SCALE_LATER:
        return (q - z).to(dtype)  # integers in -128..127: exact in every float dtype
    g = (offs_k // GROUP)[None, :]
    if EVEN_K:
        s = tl.load(s_rows + g).to(tl.float32)
    else:
        s = tl.load(s_rows + g, mask=k_mask, other=0.0).to(tl.float32)
    return ((q - z) * s).to(dtype)


@triton.jit
def planes_fma(
    q_rows, s_rows, z_rows, m_rows,  # [BLOCK_N, 1] row pointers to int32 words (INT8: four bytes a word)
    x_rows, r_rows, nw_ptr, rstd, perm_ptr,  # the activation row and its prologue's inputs, as _x_tile's (M == 1)
    k0, K,
    dtype: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_PERM: tl.constexpr,
    SCALE_LATER: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Sum over columns k0 .. k0 + BLOCK_K of W[rows, c] * x[c] at M == 1, as [BLOCK_N, BLOCK_K // P] fp32 partials
    (one per int32 word of P = 32 // BITS weights; the caller sums them). The FMA variant of the skinny kernel without
    its [BLOCK_N, BLOCK_K] unpacking and without an int-to-float conversion per weight (the conversions, not the
    bytes, bound the plain variant: a quarter of the SM's FP32 rate): a word's P fields are taken as P planes
    (field j of word i is packed column P i + j: INT4's nibble order, INT8's little-endian bytes), a field becomes a
    float by its bits (0x4B000000 | u is the fp32 2^23 + u; an INT8 byte v is u = v + 128, its top bit flipped), each
    plane is multiplied by the activations of its columns, and a word's scale and zero (or min) apply once to its
    partial sum: s * (sum q x - z * sum x), or s * sum q x + m * sum x, or for symmetric INT4 s * sum (q - 8) x, the 8
    taken off with the 2^23 (GROUP is a multiple of P, so a word never straddles two groups; with SCALE_LATER the
    caller scales).

    Numerics: fp32 throughout, so the weights are not rounded to `dtype` one by one as the reference and the other
    variants round them: the result differs from theirs by that rounding (2^-9 relative per weight in bf16)."""
    P: tl.constexpr = 32 // BITS
    # [W] packed words of this step; k0 is a multiple of BLOCK_K (also in a K slice), which Triton does not know
    # after the division: without the hint it issues 8-byte copies of the words
    offs_w = tl.multiple_of(k0 // P, BLOCK_K // P) + tl.arange(0, BLOCK_K // P)
    w_mask = (offs_w < K // P)[None, :]
    if EVEN_K:
        words = tl.load(q_rows + offs_w[None, :])  # [BLOCK_N, W] int32
    else:
        words = tl.load(q_rows + offs_w[None, :], mask=w_mask, other=0)
    dot = tl.zeros(words.shape, dtype=tl.float32)  # sum over the word's columns of q * x
    xsum = tl.zeros([1, BLOCK_K // P], dtype=tl.float32)  # sum over the word's columns of x
    if BITS == 4:
        # (w & m) | E, E = 0x4B000000 (bits disjoint from m), is (w | E) & (m | E): the OR is done once a word here
        # and each field costs one AND-OR (LOP3) with a single immediate; (w & m) | E needs two LOP3s, as SASS
        # takes one immediate an instruction
        low = words | 0x4B000000  # fields 0..4 in place
        high = (words >> 12) | 0x4B000000  # fields 5..7 at places 2..4 (the sign bits it brings in are masked off)
    for j in tl.static_range(P):
        offs_k = offs_w * P + j  # [W] packed columns of plane j
        cols = activation_cols(perm_ptr, offs_k, K, HAS_PERM, EVEN_K)
        x = _x_tile(x_rows, r_rows, nw_ptr, rstd, cols, (offs_k < K)[None, :], K, dtype, PROLOGUE, HAS_RESIDUAL,
                    EVEN_K).to(tl.float32)  # [1, W]
        if BITS == 8:
            field = (words >> (8 * j)) & 0xFF
            q = ((field ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128: the signed byte
            dot += q * x
        else:
            # INT4 fields are taken where they lie, at place p (bits 4p .. 4p + 3, p <= 4 so they stay inside the
            # 23 mantissa bits): one AND-OR makes 2^23 + q 16^p, the 2^23 is subtracted exactly, and x is scaled by
            # 16^-p instead (exact: a power of two), so each product is the real q x, rounded as the shifted
            # field's product would be: no shift and no bit-field extract per weight
            # symmetric weights (no zeros, no mins): the 8 comes off here too, 2^23 + 8 16^p (exact, < 2^24), so
            # the word needs no sum of x
            place = j if j < 5 else j - 3
            offset = 8388608.0 + (0.0 if HAS_ZEROS or HAS_MINS else 8.0 * (1 << (4 * place)))
            q = ((low if j < 5 else high) & ((0xF << (4 * place)) | 0x4B000000)).to(tl.float32, bitcast=True) - offset
            dot += q * (x * (1.0 / (1 << (4 * place))))
        if HAS_ZEROS or HAS_MINS:  # what the zero point or the min multiplies
            xsum += x
    g = (offs_w * P // GROUP)[None, :]  # [1, W] each word's group
    if HAS_MINS:
        return group_load(s_rows, g, w_mask, EVEN_K) * dot + group_load(m_rows, g, w_mask, EVEN_K) * xsum
    if HAS_ZEROS:
        centred = dot - group_load(z_rows, g, w_mask, EVEN_K) * xsum
    else:  # INT8 bytes are signed; symmetric INT4 fields took their 8 off above
        centred = dot
    if SCALE_LATER:
        return centred
    return group_load(s_rows, g, w_mask, EVEN_K) * centred


# magic_dot: 16 int32 words (128 INT4 columns) per tl.dot, the smallest K a tensor-core dot takes; a segment's
# columns share one group (GROUP a multiple of 128), so its scale and zero apply to the dot's sums
_PLANE_DOT_WORDS = 16
PLANE_DOT_WORDS = tl.constexpr(_PLANE_DOT_WORDS)


@triton.jit
def magic_dot(
    q_rows, s_rows, z_rows,  # [BLOCK_N, 1] row pointers to int32 words (8 INT4 fields a word), scales, zeros
    x_rows, r_rows, nw_ptr, rstd, perm_ptr,  # the activation rows and their prologue's inputs, as _x_tile's
    k0, K,
    dtype: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Sum over columns k0 .. k0 + BLOCK_K of W[rows, c] * x[:, c] as [BLOCK_N, BLOCK_M] fp32, INT4 weights in groups
    of a multiple of 128, on tensor cores (any M <= BLOCK_M, BLOCK_M >= 16), by segments of 16 words (128 columns,
    one group). A 4-bit field becomes a float of the activations' dtype by its bits, OFFSET + q (bf16: 0x4300 | q =
    128 + q; fp16: 0x6400 | q = 1024 + q; both exact): no int-to-float conversion per weight (the conversions, not
    the bytes, bound the dequantizing variants: dequant_tile's). The dot sums (OFFSET + q) x with each product exact
    in fp32, and a segment adds s * (sum - (OFFSET + z) * sum x), z = 8 for symmetric weights. fp32 activations
    subtract 2^23 from their fields (2^23 + q in fp32) before the dot instead.

    Numerics: the weights are not rounded to `dtype` one by one as the reference rounds them (as planes_fma); with
    16-bit activations the offset's products (bf16: 128 x, fp16: 1024 x) pass through the fp32 sums before they are
    subtracted, which costs about 2^-24 * OFFSET * sum |x| per segment."""
    W: tl.constexpr = PLANE_DOT_WORDS
    MAGIC: tl.constexpr = 0x4300 if dtype == tl.bfloat16 else 0x6400 if dtype == tl.float16 else 0x4B000000
    OFFSET: tl.constexpr = 128.0 if dtype == tl.bfloat16 else 1024.0 if dtype == tl.float16 else 0.0  # fp32: before
    acc = tl.zeros([q_rows.shape[0], x_rows.shape[0]], dtype=tl.float32)
    for seg in tl.static_range(BLOCK_K // (8 * W)):
        offs_w = tl.multiple_of(k0 // 8 + seg * W, W) + tl.arange(0, W)  # [W] words of this segment
        w_mask = (offs_w < K // 8)[None, :]
        if EVEN_K:
            words = tl.load(q_rows + offs_w[None, :])  # [BLOCK_N, W] int32
        else:
            words = tl.load(q_rows + offs_w[None, :], mask=w_mask, other=0)
        # [BLOCK_N, 8 W] in packed column order: element 8 i + j = field j of word i
        field = tl.reshape((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF, (words.shape[0], 8 * W))
        if dtype == tl.float32:
            wq = (field | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
        else:
            wq = (field | MAGIC).to(tl.int16).to(dtype, bitcast=True)  # OFFSET + q, exact
        offs_k = k0 + seg * 8 * W + tl.arange(0, 8 * W)
        cols = activation_cols(perm_ptr, offs_k, K, HAS_PERM, EVEN_K)
        x = _x_tile(x_rows, r_rows, nw_ptr, rstd, cols, (offs_k < K)[None, :], K, dtype, PROLOGUE, HAS_RESIDUAL,
                    EVEN_K)  # [BLOCK_M, 8 W]
        part = tl.dot(wq, tl.trans(x), input_precision="ieee" if dtype == tl.float32 else "tf32")  # sum (OFFSET + q) x
        xsum = tl.sum(x.to(tl.float32), 1)  # [BLOCK_M] sum of x over the segment's columns
        g = (k0 + seg * 8 * W) // GROUP  # the segment's group (a scalar: 128 | GROUP)
        if EVEN_K:
            scale = tl.load(s_rows + g).to(tl.float32)  # [BLOCK_N, 1]
        else:
            scale = tl.load(s_rows + g, mask=g * GROUP < K, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_rows + g).to(tl.float32) + OFFSET
        else:
            zero = 8.0 + OFFSET
        acc += scale * (part - zero * xsum[None, :])
    return acc


@triton.jit
def k_slice(pid_k, K, k_split, SPLIT: tl.constexpr):
    """The K columns [lo, hi) of slice pid_k (the whole K range unless SPLIT)."""
    if SPLIT:
        lo = pid_k * k_split
        return lo, tl.minimum(K, lo + k_split)
    return 0, K


@triton.jit
def _quant_skinny_kernel(
    x_ptr,  # [M, K] activations (PLAIN: x, NORM: h, SILU: gu [M, 2K]); row stride stride_xm
    res_ptr,  # [M, K] residual (NORM with HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight (NORM)
    q_ptr,  # packed weight: int8 [N, K] or int32 [N, K // 8]
    s_ptr,  # [N, G] scales
    z_ptr,  # [N, G] uint8 zero points (HAS_ZEROS)
    m_ptr,  # [N, G] mins (HAS_MINS)
    perm_ptr,  # [K] int32 activation column of each packed column (HAS_PERM)
    b_ptr,  # [N] bias (HAS_BIAS)
    y_ptr,  # [M, N] output, row stride stride_ym; SPLIT: fp32 partials [splits, M, N], contiguous
    res_out_ptr,  # [M, K] new residual (NORM with HAS_RESIDUAL), written by program (0, 0)
    M, N, K, G,  # G: groups per row (columns of scales / zeros)
    stride_qn,  # elements of q_ptr's type per packed row: an argument, not K // 8 inside, so that Triton knows the
    # rows' alignment (it specializes an int argument divisible by 16) and loads 16-byte vectors, not 8-byte ones
    k_split,  # SPLIT: K columns per slice (a multiple of BLOCK_K); slice program_id(1) is [k_split * id, + k_split)
    stride_xm, stride_rm, stride_ym, stride_om, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
    HAS_PERM: tl.constexpr, SCALE_LATER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr, EVEN_KS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr, SPLIT: tl.constexpr, PLANES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)  # the K slice (0 unless SPLIT)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_K)
    rn = (offs_n % N).to(tl.int64)  # wrapped rows: unmasked loads, duplicates never stored
    rm = (offs_m % M).to(tl.int64)
    q_rows = q_ptr + rn[:, None] * stride_qn  # [BLOCK_N, 1]
    s_rows = s_ptr + rn[:, None] * G
    z_rows = z_ptr + rn[:, None] * G
    m_rows = m_ptr + rn[:, None] * G
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BLOCK_M, 1]
    r_rows = res_ptr + rm[:, None] * stride_rm
    pdl_wait(PDL)

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:  # statistics first (natural column order; program 0 stores the new residual)
        ro_mask = (offs_m < M)[:, None] & (pid == 0) & (pid_k == 0)
        ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_om
        rstd = row_rstd(x_rows, r_rows, ro_rows, ro_mask, K, eps, dtype, HAS_RESIDUAL, BLOCK_M, STATS_BLOCK,
                        EVEN_KS, NUM_STAGES)

    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif PLANES:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K // (32 // BITS)], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_lo, k_hi = k_slice(pid_k, K, k_split, SPLIT)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if PLANES and USE_DOT:
            acc += magic_dot(q_rows, s_rows, z_rows, x_rows, r_rows, nw_ptr, rstd, perm_ptr, k0, K, dtype, PROLOGUE,
                              HAS_RESIDUAL, GROUP, HAS_ZEROS, HAS_PERM, BLOCK_K, EVEN_K)
        elif PLANES:
            acc2 += planes_fma(q_rows, s_rows, z_rows, m_rows, x_rows, r_rows, nw_ptr, rstd, perm_ptr, k0, K, dtype,
                               PROLOGUE, HAS_RESIDUAL, BITS, GROUP, HAS_ZEROS, HAS_MINS, HAS_PERM, SCALE_LATER,
                               BLOCK_K, EVEN_K)
        else:
            offs_k = k0 + offs_kb
            k_mask = (offs_k < K)[None, :]
            cols = activation_cols(perm_ptr, offs_k, K, HAS_PERM, EVEN_K)  # of this step's packed columns
            x = _x_tile(x_rows, r_rows, nw_ptr, rstd, cols, k_mask, K, dtype, PROLOGUE, HAS_RESIDUAL, EVEN_K)
            w = dequant_tile(q_rows, s_rows, z_rows, m_rows, k0, K, dtype, BITS, GROUP, HAS_ZEROS, HAS_MINS,
                             SCALE_LATER, BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]
            if USE_DOT:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
            else:
                acc2 += w.to(tl.float32) * x.to(tl.float32)
    if not USE_DOT:
        acc = tl.sum(acc2, 1)[:, None]
    if SCALE_LATER:  # linear: each slice's partial sums are scaled alike
        acc *= tl.load(s_ptr + rn * G).to(tl.float32)[:, None]
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn).to(tl.float32)[:, None]
        acc += tl.where(pid_k == 0, bias, 0.0) if SPLIT else bias  # once: by the first slice
    if SPLIT:  # fp32 partials [splits, M, N]
        y_ptrs = y_ptr + (pid_k * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
    else:
        y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])
    pdl_release(PDL)


@triton.jit
def _split_k_sum_kernel(
    ws_ptr,  # [S, M, N] fp32 partial sums, contiguous
    y_ptr,  # [M, N] output, row stride stride_ym
    M, N, S, stride_ym,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y = the sum over the S slices, rounded once to y's dtype (slices added in a fixed order)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat indices into [M, N]
    mask = offs < M * N
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    row, col = offs // N, offs % N
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + col, acc.to(y_ptr.dtype.element_ty), mask=mask)
    pdl_release(PDL)


_SUM_BLOCK = 1024


def k_slices(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(columns per slice, slices) of a split of K into at most split_k slices of whole BLOCK_K steps."""
    steps = triton.cdiv(k, block_k)
    k_split = triton.cdiv(steps, min(split_k, steps)) * block_k
    return k_split, triton.cdiv(k, k_split)


def split_k_sum(ws: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] = ws [S, M, N].sum(0) (fp32, one rounding to out's dtype)."""
    s, m, n = ws.shape
    _split_k_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](ws, out, m, n, s, out.stride(0), BLOCK=_SUM_BLOCK,
                                                          **pdl_launch_args(out.device))


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------


def check_quant_weight(name: str, x: torch.Tensor, w: PackedWeight, k: int, bias: torch.Tensor | None) -> None:
    """`w` a well-formed PackedWeight of K = k columns on x's device; bias None or [N] of x's dtype."""
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w must be a PackedWeight, got {type(w).__name__}")
    check_packed(w, x.device)
    n, wk = w.shape
    if wk != k:
        raise ValueError(f"w is [N={n}, K={wk}], {name} has K = {k}")
    check_bias(bias, n, x)


def skinny_config(x: torch.Tensor, w: PackedWeight, config: SkinnyConfig | None) -> SkinnyConfig:
    """The launch shape of y = x @ W.T: `config` if given, else the device's tuned table entry
    (kernels/tuned.py), else the default rule."""
    m = x.shape[0]
    n, k = w.shape
    if config is None:
        tuned_cfg = tuned.tuned_config("skinny", x, w)
        if isinstance(tuned_cfg, SkinnyConfig):
            return tuned_cfg
        # the rule of kernels/gemv.py, with 1-byte weight elements (int4 streams half that: the tables tune it)
        return default_config(m, n, k, 1, num_sms(x.device))
    if not config.use_dot and m > 1:
        raise ValueError(f"SkinnyConfig(use_dot=False) is the M == 1 variant, got M = {m}")
    return config


def _launch(prologue: int, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor | None,
            res_out: torch.Tensor | None, config: SkinnyConfig | None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    m = x.shape[0]
    n, k = w.shape
    out, res_out = alloc_outputs(x, n, k, residual, out, res_out)
    cfg = skinny_config(x, w, config)
    if m == 0:
        return out, res_out
    k_split, splits = k_slices(k, cfg.block_k, cfg.split_k if isinstance(cfg, QuantSkinnyConfig) else 1)
    y = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    planes = isinstance(cfg, QuantSkinnyConfig) and cfg.planes
    block_m = (max(16, next_pow2(m)) if planes else next_pow2(m)) if cfg.use_dot else 1  # magic_dot: tensor cores
    stats_block = _stats_block(block_m, k, cfg) if prologue == _NORM else 16
    r_arg = residual if residual is not None else x
    ro_arg = res_out if res_out is not None else out
    q = w.qweight
    if planes and cfg.use_dot:
        check_magic_dot(w, cfg.block_k, "QuantSkinnyConfig(planes=True, use_dot=True)")
    elif planes:
        per_word = 32 // w.bits
        if cfg.use_dot or w.group_size % per_word or k % per_word or cfg.block_k % per_word:
            raise ValueError(f"QuantSkinnyConfig(planes=True) is the FMA variant (use_dot=False) for weights whose "
                             f"groups, K and block_k are whole int32 words ({per_word} weights), got "
                             f"use_dot={cfg.use_dot}, {w.bits} bits, groups of {w.group_size}, K = {k}, "
                             f"block_k = {cfg.block_k}")
        if w.bits == 8:
            q = q.view(torch.int32)  # four bytes a word, little-endian: column 4 i + j is byte j of word i
    _quant_skinny_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, r_arg, norm_weight if norm_weight is not None else x, q, w.scales,
        w.zeros if w.zeros is not None else q, w.mins if w.mins is not None else w.scales,
        w.perm if w.perm is not None else q,
        bias if bias is not None else x, y, ro_arg,
        m, n, k, w.num_groups, q.stride(0), k_split,
        x.stride(0), r_arg.stride(0), out.stride(0), ro_arg.stride(0), float(eps),
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BITS=w.bits, GROUP=w.group_size, HAS_ZEROS=w.zeros is not None, HAS_MINS=w.mins is not None,
        HAS_PERM=w.perm is not None, SCALE_LATER=scale_later(w),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        STATS_BLOCK=stats_block, EVEN_KS=k % stats_block == 0, USE_DOT=cfg.use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", NUM_STAGES=cfg.num_stages,
        SPLIT=splits > 1, PLANES=planes, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch_args(x.device),
    )  # fmt: skip
    if splits > 1:
        split_k_sum(y, out)
    return out, res_out


def check_magic_dot(w: PackedWeight, block_k: int, config: str) -> None:
    """magic_dot's weights: INT4 in groups of a multiple of 128 with scales (and zeros) per group, K steps of whole
    128-column segments (`config`: the config's name, for the message)."""
    seg = 8 * _PLANE_DOT_WORDS
    if w.bits != 4 or w.mins is not None or scale_later(w) or w.group_size % seg or block_k % seg:
        raise ValueError(f"{config} is the tensor-core variant for INT4 weights in groups of a multiple of {seg} "
                         f"without mins, with block_k a multiple of {seg}; got {w.bits} bits, groups of "
                         f"{w.group_size}, mins {w.mins is not None}, block_k {block_k}")


def quant_skinny_matmul(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *,
                        out: torch.Tensor | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T (+ bias [N]) for M <= 16, W dequantized in registers; fp32 accumulation,
    output in x's dtype (written to `out` if given)."""
    _check_act("x", x)
    check_quant_weight("x", x, w, x.shape[1], bias)
    if out is not None:
        _check_out("out", out, (x.shape[0], w.shape[0]), x, (x, bias))
    return _launch(_PLAIN, x, None, None, 0.0, w, bias, out, None, config)[0]


def quant_add_rmsnorm_matmul(
    h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w: PackedWeight,
    bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(r) @ W.T (+ bias), r), r = (h + residual) rounded to h's dtype or r = h; as
    kernels/gemv.add_rmsnorm_matmul with a quantized weight."""
    _check_norm_args(h, residual, norm_weight)
    check_quant_weight("h", h, w, h.shape[1], bias)
    _check_norm_outs(h, residual, out, residual_out, w.shape[0], (h, residual, norm_weight, bias))
    y, res_out = _launch(_NORM, h, residual, norm_weight, eps, w, bias, out, residual_out, config)
    return y, (h if res_out is None else res_out)


def quant_silu_mul_matmul(gu: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *,
                          out: torch.Tensor | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """(silu(gu[:, :I]) * gu[:, I:]) @ W [N, I].T (+ bias) for gu [M, 2I], M <= 16."""
    _check_act("gu", gu)
    if gu.shape[1] % 2:
        raise ValueError(f"gu must be [M, 2I], got shape {tuple(gu.shape)}")
    check_quant_weight("gu", gu, w, gu.shape[1] // 2, bias)
    if out is not None:
        _check_out("out", out, (gu.shape[0], w.shape[0]), gu, (gu, bias))
    return _launch(_SILU, gu, None, None, 0.0, w, bias, out, None, config)[0]


# ---------------------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------------------


def quant_add_rmsnorm_matmul_ref(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                 eps: float, w: PackedWeight, bias: torch.Tensor | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if residual is None:
        x, new_residual = rmsnorm_ref(h, norm_weight, eps), h
    else:
        x, new_residual = add_rmsnorm_ref(h, residual, norm_weight, eps)
    return quant_matmul_ref(x, w, bias), new_residual


def quant_silu_mul_matmul_ref(gu: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return quant_matmul_ref(silu_and_mul_ref(gu), w, bias)
