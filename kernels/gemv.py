"""Skinny matmuls for decode (M <= 16 tokens) that read the weight once and fuse the producer of their input.

    skinny_matmul(x [M, K], w [N, K], bias [N] | None)          y = x @ w.T + bias
    add_rmsnorm_matmul(h, residual | None, norm_weight, eps, w)  r = (h + residual).to(dtype)  (r = h if None)
                                                                 x = rmsnorm(r)  (numerics of kernels/rmsnorm.py)
                                                                 y = x @ w.T (+ bias); returns (y, r)
    silu_mul_matmul(gu [M, 2I], w [N, I])                        x = silu(gu[:, :I]) * gu[:, I:]  (one rounding,
                                                                 numerics of kernels/activation.py); y = x @ w.T

y is an [M, N] tensor in the activations' dtype (fp32 accumulation, one rounding), new or the given `out`;
the new residual goes to a fresh [M, K] buffer (or `residual_out`), never to the inputs. Activations and
outputs may have a free row stride (last dim contiguous); w is a contiguous [N, K] nn.Linear weight of the
activations' dtype. Above M = 16 tokens the weight is no longer the whole cost and callers should use cuBLAS
(the launchers refuse). Launch shapes come from `default_config` (a rule on M, N, K; no autotuning at call
time, which would break CUDA-graph capture) or a per-call `config=SkinnyConfig(...)`.

Why: at batch 1 every projection of a decode step is a weight stream (Llama-3-8B bf16: 436 MB per layer).
cuBLAS stays below the copy bandwidth on these shapes and adds split-K reduce kernels, and the norm and SwiGLU
kernels in between add their own time and launch bubbles. Here one kernel streams the weight and computes its
input on the fly, which beats cuBLAS + the separate kernels at M = 1 on the H200 (bench_gemv); at M = 8 cuBLAS
is faster on three of the four projections, so the model uses these kernels for 1-token steps only (figures:
benchmarks/results/h200/NOTES.md, "Figures behind the code's rules").

Kernel structure (`_skinny_kernel`, one program per BLOCK_N output features, no split-K):
  * The grid is cdiv(N, BLOCK_N) programs; each walks the whole K range, so every weight byte is read exactly
    once and no reduction between programs is needed. BLOCK_N is small (16-64) so that there are several
    programs per SM: the weight tiles they have in flight together (num_stages - 1 prefetched tiles each,
    software pipelining = async copies into shared memory) are what hides the HBM latency.
  * Rows of w past N are wrapped (n % N) instead of masked and rows of x past M likewise (m % M): every load
    in the K loop is unmasked when K % BLOCK_K == 0 (EVEN_K); the duplicates are never stored.
  * The input tile x [BLOCK_M, BLOCK_K] (BLOCK_M = next power of two of M) is produced per K step by the
    PROLOGUE: a plain load, the residual add + RMSNorm, or SiLU * up. Every program recomputes the whole x,
    i.e. the prologue runs BLOCK_M / BLOCK_N times per weight element (SiLU * up is ~10 instructions: ex2,
    div.full, converts; the whole ALU budget is ~14 per weight element at full HBM bandwidth): hence BLOCK_M
    is M rounded up to a power of two (Triton pads tl.dot's M and N itself on NVIDIA), not 16.
  * RMSNorm needs the row statistics before the first tile: each program first runs a pass over K of
    h (+ residual) (M*K elements, from L2; program 0 also stores the new residual there), in wide pipelined
    steps since these round trips sit before the weight stream starts.
  * Products, two variants (SkinnyConfig.use_dot):
      - tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M]) -> [BLOCK_N, BLOCK_M] (any M <= 16). The weight is
        the mma's M operand (>= 16 rows) and the tokens its N operand (8-granular on tensor cores), so little
        padding; the weight goes global -> shared (async copies) -> tensor cores with no per-element ALU work
        (mma.sync; wgmma for BLOCK_N = 64, BLOCK_M = 16).
      - M == 1: acc [BLOCK_N, BLOCK_K] += w * x in fp32 FMAs, summed over K once at the end: no padding and
        no tensor-core operand shuffles, 2 ALU ops per weight element (convert + FMA). Triton pipelines a
        loop without tl.dot only when asked, so the K loops pass num_stages explicitly (num_stages = 1 gives
        plain loads to registers instead).
    Which wins at M == 1 is for the H200 to say (benchmarks/gpu_kernels.py bench_gemv(tune=True)); the
    default rule uses the FMA variant. Compute is not the limit at M <= 16 either way.
  * The epilogue adds the bias in fp32 and rounds once to the output dtype (what F.linear does).

The defaults compile for sm_90 with 40-128 registers, no spills and pipelined K loops for all Llama-3-8B
projections at M in {1, 2, 8, 16} (tests/test_gemv.py checks the pipelining ahead of time on the CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.activation import silu_and_mul_ref
from tokenmill.kernels.launch import next_pow2 as _next_pow2
from tokenmill.kernels.launch import num_sms as _num_sms
from tokenmill.kernels.launch import pdl_launch_args, pdl_release, pdl_wait
from tokenmill.kernels.rmsnorm import add_rmsnorm_ref, rmsnorm_ref

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOKENS = 16  # launchers refuse larger M: use cuBLAS there

# PROLOGUE modes (constexpr): what produces the matmul input x from the kernel's activation operand
_PLAIN, _NORM, _SILU = 0, 1, 2


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape of `_skinny_kernel`. block_n: output features (weight rows) per program; block_k: K
    elements per loop step; use_dot: tensor-core tl.dot (any M) or the fp32 FMA variant (M == 1 only)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = True

    def __post_init__(self) -> None:
        if self.block_n < 8 or self.block_n & (self.block_n - 1):
            raise ValueError(f"SkinnyConfig.block_n must be a power of two >= 8, got {self.block_n}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"SkinnyConfig.block_k must be a power of two >= 16, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")


# Default-rule knobs (to be tuned on the H200 with benchmarks/gpu_kernels.py bench_gemv(tune=True)):
_PROGRAMS_PER_SM = 3  # halve block_n (64 -> 16) while the grid has fewer programs than this per SM
_MAX_BLOCK_N = 64
_MIN_BLOCK_N = 16
# weight bytes per program per K step; block_k = _TILE_BYTES / (block_n * itemsize) within [64, 256]. Wider K
# steps cost registers (block_k = 512 put the fused M = 1 variants at ~180 registers on sm_90, vs 72-96 at
# 256), and num_stages - 1 steps of 8-16 KB in flight per program, several programs per SM, are plenty.
_TILE_BYTES = 16384
_MIN_BLOCK_K = 64
_MAX_BLOCK_K = 256
_NUM_WARPS = 4
_NUM_STAGES = 4
_STATS_PER_THREAD = 8  # statistics-pass step: elements per thread and tensor (see _stats_block)
_FMA_AT_M1 = True  # M == 1 uses the FMA variant (no tensor cores, no padding)


@functools.lru_cache(maxsize=256)
def default_config(m: int, n: int, k: int, itemsize: int, num_sms: int) -> SkinnyConfig:
    """The rule-based launch shape for y [m, n] = x [m, k] @ w [n, k].T with elements of `itemsize` bytes.

    M == 1 (batch-1 decode): the measured best family on the H200 for all four Llama-3-8B projections
    (bench_gemv(tune=True)): 16 weight rows per program, 256-wide K steps (512 for K >= 8192), FMA variant."""
    if m == 1:
        wide = k >= 8192
        return SkinnyConfig(16, max(16, min(512 if wide else 256, _next_pow2(k))), 4, 3 if wide else 4, use_dot=False)
    block_n = _MAX_BLOCK_N
    while block_n > _MIN_BLOCK_N and triton.cdiv(n, block_n) < _PROGRAMS_PER_SM * num_sms:
        block_n //= 2
    block_k = max(_MIN_BLOCK_K, min(_TILE_BYTES // (block_n * itemsize), _MAX_BLOCK_K))
    block_k = max(16, min(block_k, _next_pow2(k)))
    return SkinnyConfig(block_n, block_k, _NUM_WARPS, _NUM_STAGES, use_dot=not (_FMA_AT_M1 and m == 1))


def _stats_block(block_m: int, k: int, config: SkinnyConfig) -> int:
    """K step of the RMSNorm statistics pass: ~_STATS_PER_THREAD elements per thread and tensor, at least
    block_k. Wide, because the pass is latency-bound: at M = 1 the loads of a block_k step can be under 4 bytes
    per thread, which Triton does not turn into pipelined async copies, and every step would cost one
    L2 round trip before the weight stream starts."""
    return max(16, min(_next_pow2(k), max(config.block_k, _STATS_PER_THREAD * 32 * config.num_warps // block_m)))


@triton.jit
def _x_tile(
    x_rows,  # [BLOCK_M, 1] pointers to the activation rows (h / gu / x)
    r_rows,  # [BLOCK_M, 1] pointers to the residual rows (NORM with HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight (NORM)
    rstd,  # [BLOCK_M] fp32 1/rms of each row (NORM)
    offs_k,  # [BLOCK_K] K indices of this step
    k_mask,  # [1, BLOCK_K] offs_k < K (used only when not EVEN_K)
    K,
    dtype: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The matmul input x[:, offs_k] as a [BLOCK_M, BLOCK_K] tile in `dtype`; zero where offs_k >= K."""
    if PROLOGUE == 0:  # plain
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :])
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=k_mask, other=0.0)
    elif PROLOGUE == 1:  # RMSNorm of r = (h + residual).to(dtype): (r * rstd).to(dtype) * weight, rounded
        r = _residual_tile(x_rows, r_rows, offs_k, k_mask, dtype, HAS_RESIDUAL, EVEN_K)
        if EVEN_K:
            nw = tl.load(nw_ptr + offs_k).to(tl.float32)
        else:
            nw = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        x = ((r * rstd[:, None]).to(dtype).to(tl.float32) * nw[None, :]).to(dtype)
    else:  # SiLU(gate) * up with gate = gu[:, k], up = gu[:, K + k]; fp32 compute, one rounding
        if EVEN_K:
            gate = tl.load(x_rows + offs_k[None, :]).to(tl.float32)
            up = tl.load(x_rows + K + offs_k[None, :]).to(tl.float32)
        else:
            gate = tl.load(x_rows + offs_k[None, :], mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + offs_k[None, :], mask=k_mask, other=0.0).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    return x


@triton.jit
def _residual_tile(
    x_rows,
    r_rows,
    offs_k,
    k_mask,
    dtype: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """r[:, offs_k] = (h + residual) rounded to dtype (or h), as fp32 [BLOCK_M, BLOCK_K]; 0 past K."""
    if EVEN_K:
        r = tl.load(x_rows + offs_k[None, :]).to(tl.float32)
    else:
        r = tl.load(x_rows + offs_k[None, :], mask=k_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        if EVEN_K:
            res = tl.load(r_rows + offs_k[None, :]).to(tl.float32)
        else:
            res = tl.load(r_rows + offs_k[None, :], mask=k_mask, other=0.0).to(tl.float32)
        r = (r + res).to(dtype).to(tl.float32)  # the new residual, rounded to the model dtype
    return r


@triton.jit
def row_rstd(
    x_rows, r_rows, ro_rows, ro_mask, K, eps,
    dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, STATS_BLOCK: tl.constexpr,
    EVEN_KS: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """1/rms [BLOCK_M] fp32 of r = h (+ residual) rounded to dtype, in one pass over K (the RMSNorm statistics
    pass; the new residual is stored through ro_rows [BLOCK_M, 1] where ro_mask holds)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum of r^2 per row
    offs_ks = tl.arange(0, STATS_BLOCK)
    for k0 in tl.range(0, K, STATS_BLOCK, num_stages=NUM_STAGES):
        offs_k = k0 + offs_ks
        k_mask = (offs_k < K)[None, :]
        r = _residual_tile(x_rows, r_rows, offs_k, k_mask, dtype, HAS_RESIDUAL, EVEN_KS)
        if HAS_RESIDUAL:
            tl.store(ro_rows + offs_k[None, :], r.to(dtype), mask=ro_mask & k_mask)
        ss += tl.sum(r * r, 1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K] activations (PLAIN: x, NORM: h, SILU: gu [M, 2K]); row stride stride_xm, last dim contiguous
    res_ptr,  # [M, K] residual, row stride stride_rm (NORM with HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight (NORM)
    w_ptr,  # [N, K] contiguous weight
    b_ptr,  # [N] bias (HAS_BIAS)
    y_ptr,  # [M, N] output, row stride stride_ym
    res_out_ptr,  # [M, K] new residual, row stride stride_om (NORM with HAS_RESIDUAL); written by program 0 only
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_ym,
    stride_om,
    eps,
    PROLOGUE: tl.constexpr,  # 0 plain, 1 (add +) RMSNorm, 2 SiLU * up
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # next power of two >= M (1 for the FMA variant, which needs M == 1)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the main loop
    STATS_BLOCK: tl.constexpr,  # K elements per step of the RMSNorm statistics pass
    EVEN_KS: tl.constexpr,  # K % STATS_BLOCK == 0
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of both K loops (explicit: Triton pipelines a
    # loop without tl.dot, i.e. the statistics pass and the FMA variant, only when asked)
    PDL: tl.constexpr,  # programmatic dependent launch protocol (kernels/launch.py)
):
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features of this program
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    offs_kb = tl.arange(0, BLOCK_K)
    # wrapped row indices: loads never need an N / M mask, the duplicate rows are not stored
    rn = offs_n % N
    rm = offs_m % M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    r_rows = res_ptr + rm.to(tl.int64)[:, None] * stride_rm  # [BLOCK_M, 1]
    pdl_wait(PDL)

    # ---- RMSNorm statistics: a first pass over K of r = h (+ residual), from L2 -------------------------
    # It runs before the weight stream starts, so its L2 round trips are on every program's critical path:
    # wide steps (STATS_BLOCK, see _stats_block), pipelined like the main loop.
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:
        # program 0 stores the new residual; masked for the others (no branch in the loop)
        ro_mask = (offs_m < M)[:, None] & (pid == 0)  # [BLOCK_M, 1]
        ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_om  # [BLOCK_M, 1]
        rstd = row_rstd(x_rows, r_rows, ro_rows, ro_mask, K, eps, dtype, HAS_RESIDUAL, BLOCK_M, STATS_BLOCK,
                        EVEN_KS, NUM_STAGES)

    # ---- main loop: stream BLOCK_N rows of w over K, x tile produced on the fly ----------------------
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # per-lane partial sums, reduced once at the end
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + offs_kb
        k_mask = (offs_k < K)[None, :]
        x = _x_tile(x_rows, r_rows, nw_ptr, rstd, offs_k, k_mask, K, dtype, PROLOGUE, HAS_RESIDUAL, EVEN_K)
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :])  # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=k_mask, other=0.0)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        else:
            acc2 += w.to(tl.float32) * x.to(tl.float32)  # x [1, BLOCK_K] broadcast over the rows of w
    if not USE_DOT:
        acc = tl.sum(acc2, 1)[:, None]  # [BLOCK_N, 1]

    # ---- epilogue: bias in fp32, one rounding, y[m, n] for valid (m, n) -------------------------------
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])
    pdl_release(PDL)


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------


def _check_act(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} not supported (float16, bfloat16, float32)")
    if x.shape[0] > MAX_TOKENS:
        raise ValueError(f"{name} has {x.shape[0]} rows; skinny matmuls take M <= {MAX_TOKENS} (use F.linear)")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.stride()}")


def _check_weight(name: str, x: torch.Tensor, w: torch.Tensor, k: int, bias: torch.Tensor | None) -> None:
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"w must be [N, K={k}] (nn.Linear layout), got shape {tuple(w.shape)}")
    if w.shape[0] == 0 or k == 0:
        raise ValueError(f"empty matmul dims: w {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"w dtype {w.dtype} must match {name} dtype {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device}, {name} on {x.device}")
    if not w.is_contiguous():
        raise ValueError(f"w must be a contiguous [N, K] tensor, got strides {w.stride()}")
    check_bias(bias, w.shape[0], x)


def _check_norm_args(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> None:
    """The activation operands of a fused add + RMSNorm + matmul: h [M, K], residual like h, norm_weight [K]."""
    _check_act("h", h)
    k = h.shape[1]
    if residual is not None:
        if residual.shape != h.shape or residual.dtype != h.dtype or residual.device != h.device:
            raise ValueError(
                f"residual must match h ({tuple(h.shape)} {h.dtype} {h.device}), got "
                f"{tuple(residual.shape)} {residual.dtype} {residual.device}"
            )
        if residual.stride(-1) != 1 and k > 1:
            raise ValueError(f"residual must be contiguous in its last dim, got strides {residual.stride()}")
    if norm_weight.dim() != 1 or norm_weight.shape[0] != k:
        raise ValueError(f"norm_weight must be [K={k}], got {tuple(norm_weight.shape)}")
    if not norm_weight.is_floating_point():
        raise ValueError(f"norm_weight must be floating point, got {norm_weight.dtype}")
    if norm_weight.device != h.device:
        raise ValueError(f"norm_weight is on {norm_weight.device}, h on {h.device}")
    if norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous, got stride {norm_weight.stride()}")


def _check_norm_outs(h: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None,
                     residual_out: torch.Tensor | None, n: int, inputs: tuple[torch.Tensor | None, ...]) -> None:
    """The optional outputs of a fused add + RMSNorm + matmul: out [M, N], residual_out [M, K] (with residual)."""
    m, k = h.shape
    if out is not None:
        _check_out("out", out, (m, n), h, inputs)
    if residual_out is not None:
        if residual is None:
            raise ValueError("residual_out is only written when residual is given (else the new residual is h)")
        _check_out("residual_out", residual_out, (m, k), h, inputs)
        if out is not None:
            _check_out("residual_out", residual_out, (m, k), h, (out,))


def check_bias(bias: torch.Tensor | None, n: int, x: torch.Tensor) -> None:
    """bias: None or a contiguous [N] tensor of x's dtype on x's device."""
    if bias is None:
        return
    if bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device:
        raise ValueError(
            f"bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    if bias.stride(0) != 1:
        raise ValueError(f"bias must be contiguous, got stride {bias.stride()}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return start, start + extent * t.element_size()


def _check_out(
    name: str, out: torch.Tensor, shape: tuple[int, int], x: torch.Tensor, inputs: tuple[torch.Tensor | None, ...]
) -> None:
    """`out` must be `shape` in x's dtype on x's device, last dim contiguous, and share no memory with
    `inputs`: every program reads all of x (and residual) while others are writing their outputs."""
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"{name} must be {shape} {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1 and shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {out.stride()}")
    o0, o1 = _byte_span(out)
    for t in inputs:
        if t is not None and t.numel() and out.numel():
            t0, t1 = _byte_span(t)
            if o0 < t1 and t0 < o1:
                raise ValueError(f"{name} overlaps an input of the kernel; pass a separate buffer")


def alloc_outputs(x: torch.Tensor, n: int, k: int, residual: torch.Tensor | None, out: torch.Tensor | None,
                  res_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs a launch writes: `out` or a new [M, N]; with a residual, `res_out` or a new [M, K]."""
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if residual is not None and res_out is None:
        res_out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    return out, res_out


def _launch(
    prologue: int,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    res_out: torch.Tensor | None,
    config: SkinnyConfig | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks config vs M, allocates missing outputs (out [M, N]; res_out [M, K] when residual is given) and
    launches. Operands are already validated."""
    m = x.shape[0]
    n, k = w.shape
    out, res_out = alloc_outputs(x, n, k, residual, out, res_out)
    if config is None:
        config = default_config(m, n, k, x.element_size(), _num_sms(x.device))
    elif not config.use_dot and m > 1:
        raise ValueError(f"SkinnyConfig(use_dot=False) is the M == 1 variant, got M = {m}")
    if m == 0:
        return out, res_out
    block_m = _next_pow2(m) if config.use_dot else 1
    stats_block = _stats_block(block_m, k, config) if prologue == _NORM else 16
    r_arg = residual if residual is not None else x
    ro_arg = res_out if res_out is not None else out
    _skinny_kernel[(triton.cdiv(n, config.block_n),)](
        x, r_arg, norm_weight if norm_weight is not None else w, w, bias if bias is not None else w, out, ro_arg,
        m, n, k, x.stride(0), r_arg.stride(0), out.stride(0), ro_arg.stride(0), float(eps),
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        STATS_BLOCK=stats_block, EVEN_KS=k % stats_block == 0, USE_DOT=config.use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_args(x.device),
    )  # fmt: skip
    return out, res_out


def skinny_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ w [N, K].T (+ bias [N]) for M <= 16; fp32 accumulation, output in x's dtype
    (written to `out` if given). `config` overrides the rule-based launch shape (tuning, tests)."""
    _check_act("x", x)
    _check_weight("x", x, w, x.shape[1], bias)
    if out is not None:
        _check_out("out", out, (x.shape[0], w.shape[0]), x, (x, w, bias))
    y, _ = _launch(_PLAIN, x, None, None, 0.0, w, bias, out, None, config)
    return y


def add_rmsnorm_matmul(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(r) @ w.T (+ bias), r) for M <= 16, with r = (h + residual) rounded to h's dtype, or r = h
    (returned as is) when residual is None. Numerics of kernels/rmsnorm.py followed by F.linear. The new
    residual goes to a fresh buffer (`residual_out` if given, which must not overlap h or residual)."""
    _check_norm_args(h, residual, norm_weight)
    _check_weight("h", h, w, h.shape[1], bias)
    _check_norm_outs(h, residual, out, residual_out, w.shape[0], (h, residual, norm_weight, w, bias))
    y, res_out = _launch(_NORM, h, residual, norm_weight, eps, w, bias, out, residual_out, config)
    return y, (h if res_out is None else res_out)


def silu_mul_matmul(
    gu: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """(silu(gu[:, :I]) * gu[:, I:]) @ w [N, I].T (+ bias) for gu [M, 2I], M <= 16 (the SwiGLU product is
    computed in fp32 and rounded once to gu's dtype, as kernels/activation.py does)."""
    _check_act("gu", gu)
    if gu.shape[1] % 2:
        raise ValueError(f"gu must be [M, 2I], got shape {tuple(gu.shape)}")
    _check_weight("gu", gu, w, gu.shape[1] // 2, bias)
    if out is not None:
        _check_out("out", out, (gu.shape[0], w.shape[0]), gu, (gu, w, bias))
    y, _ = _launch(_SILU, gu, None, None, 0.0, w, bias, out, None, config)
    return y


# ---------------------------------------------------------------------------------------------------------
# references: the unfused sequences they replace
# ---------------------------------------------------------------------------------------------------------


def skinny_matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def add_rmsnorm_matmul_ref(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_ref / add_rmsnorm_ref, then F.linear."""
    if residual is None:
        x, new_residual = rmsnorm_ref(h, norm_weight, eps), h
    else:
        x, new_residual = add_rmsnorm_ref(h, residual, norm_weight, eps)
    return F.linear(x, w, bias), new_residual


def silu_mul_matmul_ref(gu: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul_ref, then F.linear."""
    return F.linear(silu_and_mul_ref(gu), w, bias)
