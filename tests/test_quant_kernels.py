"""The weight-only quantized GEMM kernels (kernels/quant_gemv.py skinny + fused prologues, kernels/quant_gemm.py
tiled) against their torch references (kernels/quant_weight.py: the weight dequantized in fp32, rounded once
to the activations' dtype, then F.linear), and the packed layout's helpers.

Without CUDA the kernels run under the Triton interpreter in fp16 / fp32 on small shapes: K with a ragged last
group (K = 96 with groups of 64 / 128) and a K tail past the last full block, N not a multiple of the block,
act-order permutations, zero points. Outputs go to NaN-poisoned buffers, so an element the kernel does not
write fails. Tolerances as tests/test_gemv.py (fp32 2e-5 at O(1) outputs, fp16 2e-3 with an atol of ~2 ulps).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any

import pytest
from helpers_aot import run_sm90_compile

from tokenmill.kernels.gemv import SkinnyConfig
from tokenmill.kernels.quant_gemm import GemmConfig, quant_matmul
from tokenmill.kernels.quant_gemv import (
    k_slices,
    quant_add_rmsnorm_matmul,
    quant_add_rmsnorm_matmul_ref,
    quant_silu_mul_matmul,
    quant_silu_mul_matmul_ref,
    quant_skinny_matmul,
)
from tokenmill.kernels.quant_weight import (
    PackedWeight,
    awq_pack,
    awq_unpack,
    dequantize_packed,
    pack_int4,
    quant_matmul_ref,
    unpack_int4,
)
from tokenmill.kernels.tuned import QuantSkinnyConfig

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DTYPES = [torch.float32, torch.float16]
DOT = SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
FMA = SkinnyConfig(block_n=8, block_k=32, num_warps=4, num_stages=2, use_dot=False)
PLANES = QuantSkinnyConfig(block_n=8, block_k=32, num_warps=4, num_stages=2, use_dot=False, planes=True)
MAGIC_DOT = QuantSkinnyConfig(block_n=16, block_k=128, num_warps=4, num_stages=2, planes=True)  # tensor cores
TILE = GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2)
# (format name, bits, group size, zero points, act-order)
FORMATS = [("int8", 8, None, False, False), ("int4-g32", 4, 32, False, False), ("int4-g64-zp", 4, 64, True, False),
           ("int4-g128-perm", 4, 128, False, True), ("int4-g32-zp-perm", 4, 32, True, True)]
# (format name, bits, group size, zero points, act-order) of magic_dot: INT4 in groups of 128 (GPTQ / AWQ)
MAGIC_DOT_FORMATS = [("int4-g128", 4, 128, False, False), ("int4-g128-zp-perm", 4, 128, True, True),
                     ("int4-g256-zp", 4, 256, True, False)]
K, N = 104, 40  # K: ragged last groups (104 = 3 x 32 + 8 = 64 + 40) and a tail past 3 blocks of 32


def _tol(dtype: torch.dtype) -> dict[str, Any]:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


def packed_weight(fmt: tuple[str, int, int | None, bool, bool], n: int, k: int, dtype: torch.dtype,
                  seed: int = 0) -> PackedWeight:
    """A random weight of `fmt`, scaled so that y = x @ W.T is O(1) for unit-normal x."""
    _, bits, group, zp, perm = fmt
    gen = torch.Generator().manual_seed(seed)
    g = k if group is None else group
    groups = -(-k // g)
    scale_dtype = torch.float32 if bits == 8 else dtype
    scales = (torch.rand(n, groups, generator=gen) + 0.5) / (k**0.5 * (40 if bits == 8 else 4))
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        q = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8) if zp else None
    p = torch.randperm(k, generator=gen).to(torch.int32) if perm else None
    return PackedWeight(q.to(DEV), scales.to(scale_dtype).to(DEV), None if zeros is None else zeros.to(DEV),
                        None if p is None else p.to(DEV), bits, g)


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def _poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


# ---- layout ---------------------------------------------------------------------------------------------------


def test_int4_packing_round_trips_and_puts_element_k_at_nibble_k_mod_8() -> None:
    q = torch.randint(0, 16, (5, 24))
    words = pack_int4(q)
    assert words.dtype == torch.int32 and words.shape == (5, 3)
    assert torch.equal(unpack_int4(words).long(), q)
    assert int(words[0, 1]) & 0xF == int(q[0, 8]) and (int(words[0, 1]) >> 28) & 0xF == int(q[0, 15])
    assert torch.equal(awq_unpack(awq_pack(q)).long(), q)
    assert (int(awq_pack(q)[0, 0]) >> 4) & 0xF == int(q[0, 2])  # AWQ: nibble 1 holds output 2


def test_dequantize_undoes_the_permutation() -> None:
    fmt = FORMATS[3]
    w = packed_weight(fmt, 8, 256, torch.float32)
    assert w.perm is not None
    plain = dequantize_packed(PackedWeight(w.qweight, w.scales, w.zeros, None, 4, w.group_size))
    assert torch.equal(dequantize_packed(w)[:, w.perm.long()], plain)


# ---- skinny kernels -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f[0])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_quant_skinny_matmul(dtype: torch.dtype, fmt: Any, m: int) -> None:
    w = packed_weight(fmt, N, K, dtype)
    x = _x((m, K), dtype, 1)
    bias = _x((N,), dtype, 2)
    ref = quant_matmul_ref(x, w, bias)
    for config in (DOT, None) + ((FMA, PLANES) if m == 1 else ()):
        out = _poisoned(m, N, dtype)
        quant_skinny_matmul(x, w, bias, out=out, config=config)
        torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f[0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_quant_add_rmsnorm_matmul(dtype: torch.dtype, fmt: Any, with_residual: bool) -> None:
    w = packed_weight(fmt, N, K, dtype, seed=3)
    h, res = _x((2, K), dtype, 4), _x((2, K), dtype, 5) if with_residual else None
    nw = (1.0 + 0.1 * _x((K,), torch.float32, 6)).to(dtype)
    want_y, want_r = quant_add_rmsnorm_matmul_ref(h, res, nw, 1e-5, w)
    for config in (DOT, None):
        out = _poisoned(2, N, dtype)
        y, r = quant_add_rmsnorm_matmul(h, res, nw, 1e-5, w, out=out, config=config)
        assert y is out
        torch.testing.assert_close(y, want_y, **_tol(dtype))
        assert torch.equal(r, want_r)  # the new residual: rounded once, bit for bit
    for fma in (FMA, PLANES):
        y1, _ = quant_add_rmsnorm_matmul(h[:1], None if res is None else res[:1], nw, 1e-5, w, config=fma)
        torch.testing.assert_close(y1, want_y[:1], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f[0])
def test_quant_silu_mul_matmul(dtype: torch.dtype, fmt: Any) -> None:
    w = packed_weight(fmt, N, K, dtype, seed=7)
    gu = _x((3, 2 * K), dtype, 8)
    out = _poisoned(3, N, dtype)
    quant_silu_mul_matmul(gu, w, out=out, config=DOT)
    torch.testing.assert_close(out, quant_silu_mul_matmul_ref(gu, w), **_tol(dtype))
    for fma in (FMA, PLANES):
        torch.testing.assert_close(quant_silu_mul_matmul(gu[:1], w, config=fma), quant_silu_mul_matmul_ref(gu[:1], w),
                                   **_tol(dtype))


# ---- tiled kernel ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f[0])
def test_quant_matmul_tiled(dtype: torch.dtype, fmt: Any) -> None:
    w = packed_weight(fmt, N, K, dtype, seed=9)
    x = _x((37, K), dtype, 10)  # 3 row tiles of 16, the last partial; groups of 2 row tiles
    bias = _x((N,), dtype, 11)
    out = _poisoned(37, N, dtype)
    quant_matmul(x, w, bias, out=out, config=TILE)
    torch.testing.assert_close(out, quant_matmul_ref(x, w, bias), **_tol(dtype))
    torch.testing.assert_close(quant_matmul(x[:20], w), quant_matmul_ref(x[:20], w), **_tol(dtype))  # default


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2], FORMATS[4]], ids=lambda f: f[0])
@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_split_k_matches_the_reference(dtype: torch.dtype, fmt: Any, split_k: int) -> None:
    """K = 104 in steps of 32 (4 steps, the last partial): 2 slices of 2 steps, 2 of 2 (split 3), 4 of 1 (split 8);
    the bias is added once, the per-channel scale (INT8) per slice, the new residual stored once."""
    w = packed_weight(fmt, N, K, dtype, seed=12)
    bias = _x((N,), dtype, 13)
    dot = QuantSkinnyConfig(16, 32, 4, 2, split_k=split_k)
    fma = QuantSkinnyConfig(8, 32, 4, 2, use_dot=False, split_k=split_k)
    for m, cfg in ((1, fma), (5, dot), (1, dataclasses.replace(fma, planes=True))):
        x = _x((m, K), dtype, 14)
        out = _poisoned(m, N, dtype)
        quant_skinny_matmul(x, w, bias, out=out, config=cfg)
        torch.testing.assert_close(out, quant_matmul_ref(x, w, bias), **_tol(dtype))
    h, res = _x((3, K), dtype, 15), _x((3, K), dtype, 16)
    nw = (1.0 + 0.1 * _x((K,), torch.float32, 17)).to(dtype)
    want_y, want_r = quant_add_rmsnorm_matmul_ref(h, res, nw, 1e-5, w, bias)
    y, r = quant_add_rmsnorm_matmul(h, res, nw, 1e-5, w, bias, config=dot)
    torch.testing.assert_close(y, want_y, **_tol(dtype))
    assert torch.equal(r, want_r)
    x = _x((37, K), dtype, 18)
    out = _poisoned(37, N, dtype)
    quant_matmul(x, w, bias, out=out, config=GemmConfig(16, 16, 32, group_m=2, split_k=split_k))
    torch.testing.assert_close(out, quant_matmul_ref(x, w, bias), **_tol(dtype))


def test_split_k_slices_are_whole_steps() -> None:
    assert k_slices(104, 32, 2) == (64, 2) and k_slices(104, 32, 3) == (64, 2) and k_slices(104, 32, 8) == (32, 4)
    assert k_slices(4096, 256, 1) == (4096, 1) and k_slices(14336, 512, 8) == (2048, 7)
    with pytest.raises(ValueError, match="split_k"):
        QuantSkinnyConfig(16, 32, 4, 2, split_k=0)
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig(16, 16, 32, split_k=0)


def test_empty_batches() -> None:
    w = packed_weight(FORMATS[1], N, K, torch.float32)
    assert quant_skinny_matmul(torch.empty(0, K, device=DEV), w).shape == (0, N)
    assert quant_matmul(torch.empty(0, K, device=DEV), w).shape == (0, N)


# ---- bad arguments --------------------------------------------------------------------------------------------


def _bad(case: str) -> tuple[torch.Tensor, Any]:
    w = packed_weight(FORMATS[2], N, K, torch.float32)
    x = _x((2, K), torch.float32, 0)
    bad = {
        "qweight_dtype": PackedWeight(w.qweight.to(torch.int64), w.scales, w.zeros, w.perm, 4, w.group_size),
        "scales_shape": PackedWeight(w.qweight, w.scales[:, :1], w.zeros, w.perm, 4, w.group_size),
        "zeros_dtype": PackedWeight(w.qweight, w.scales, w.zeros.to(torch.int32) if w.zeros is not None else None,
                                    w.perm, 4, w.group_size),
        "perm_shape": PackedWeight(w.qweight, w.scales, w.zeros, torch.arange(K - 8, dtype=torch.int32).to(DEV), 4,
                                   w.group_size),
        "group_not_multiple_of_8": PackedWeight(w.qweight, w.scales, w.zeros, w.perm, 4, 12),
        "bits": PackedWeight(w.qweight, w.scales, w.zeros, w.perm, 3, w.group_size),
        "zeros_on_int8": PackedWeight(torch.zeros(N, K, dtype=torch.int8, device=DEV), w.scales[:, :1],
                                      w.zeros[:, :1] if w.zeros is not None else None, None, 8, K),
        "not_contiguous": PackedWeight(w.qweight.t().contiguous().t(), w.scales, w.zeros, w.perm, 4, w.group_size),
        "k_mismatch": w,
        "dense_weight": torch.randn(N, K),
    }
    return (x[:, :-8] if case == "k_mismatch" else x), bad[case]


BAD = ["qweight_dtype", "scales_shape", "zeros_dtype", "perm_shape", "group_not_multiple_of_8", "bits",
       "zeros_on_int8", "not_contiguous", "k_mismatch", "dense_weight"]


def test_planes_is_an_fma_path_over_whole_words() -> None:
    w = packed_weight(FORMATS[0], N, 102, torch.float32)  # int8, K = 102: not whole words of four bytes
    with pytest.raises(ValueError, match="whole int32 words"):
        quant_skinny_matmul(_x((1, 102), torch.float32, 1), w, config=PLANES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MAGIC_DOT_FORMATS, ids=lambda f: f[0])
@pytest.mark.parametrize("split_k", [1, 2])
def test_tiled_magic_matches_the_reference(dtype: torch.dtype, fmt: Any, split_k: int) -> None:
    """GemmConfig(magic=True): the tiled kernel through magic_dot (K = 384 in 256-column steps: a ragged last step)."""
    w = packed_weight(fmt, N, 384, dtype, seed=23)
    x, bias = _x((37, 384), dtype, 24), _x((N,), dtype, 25)
    out = _poisoned(37, N, dtype)
    quant_matmul(x, w, bias, out=out, config=GemmConfig(16, 16, 256, group_m=2, split_k=split_k, magic=True))
    torch.testing.assert_close(out, quant_matmul_ref(x, w, bias), **_tol(dtype))
    with pytest.raises(ValueError, match="GemmConfig\\(magic=True\\) is the tensor-core variant"):
        quant_matmul(x, packed_weight(FORMATS[1], N, 384, dtype), config=GemmConfig(16, 16, 256, magic=True))


def test_magic_dot_takes_int4_in_groups_of_128_only() -> None:
    for fmt in (FORMATS[0], FORMATS[1], FORMATS[2]):  # int8, int4 g32, int4 g64
        w = packed_weight(fmt, N, 256, torch.float32)
        with pytest.raises(ValueError, match="tensor-core variant"):
            quant_skinny_matmul(_x((2, 256), torch.float32, 1), w, config=MAGIC_DOT)
    w = packed_weight(MAGIC_DOT_FORMATS[0], N, 256, torch.float32)
    with pytest.raises(ValueError, match="block_k a multiple of 128"):
        quant_skinny_matmul(_x((2, 256), torch.float32, 1), w, config=dataclasses.replace(MAGIC_DOT, block_k=64))



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MAGIC_DOT_FORMATS, ids=lambda f: f[0])
@pytest.mark.parametrize(("m", "k", "block_k"), [(1, 512, 256), (5, 384, 256), (16, 256, 128)],
                         ids=["m1", "m5-ragged-k", "m16"])
def test_magic_dot_matches_the_reference(dtype: torch.dtype, fmt: Any, m: int, k: int, block_k: int) -> None:
    """The tensor-core variant (magic_dot) through all three entry points (K = 384 with 256-column steps: a last step
    of one segment and one past K)."""
    cfg = dataclasses.replace(MAGIC_DOT, block_k=block_k)
    w = packed_weight(fmt, N, k, dtype, seed=11)
    x, bias = _x((m, k), dtype, 12), _x((N,), dtype, 13)
    out = _poisoned(m, N, dtype)
    quant_skinny_matmul(x, w, bias, out=out, config=cfg)
    torch.testing.assert_close(out, quant_matmul_ref(x, w, bias), **_tol(dtype))
    res, nw = _x((m, k), dtype, 14), (1.0 + 0.1 * _x((k,), torch.float32, 15)).to(dtype)
    want_y, want_r = quant_add_rmsnorm_matmul_ref(x, res, nw, 1e-5, w)
    y, r = quant_add_rmsnorm_matmul(x, res, nw, 1e-5, w, config=cfg)
    torch.testing.assert_close(y, want_y, **_tol(dtype))
    assert torch.equal(r, want_r)
    gu = _x((m, 2 * k), dtype, 16)
    torch.testing.assert_close(quant_silu_mul_matmul(gu, w, config=cfg), quant_silu_mul_matmul_ref(gu, w),
                               **_tol(dtype))
    split = dataclasses.replace(cfg, split_k=2)
    torch.testing.assert_close(quant_skinny_matmul(x, w, bias, config=split), quant_matmul_ref(x, w, bias),
                               **_tol(dtype))


@pytest.mark.parametrize("case", BAD)
def test_launchers_reject_bad_weights(case: str) -> None:
    x, w = _bad(case)
    with pytest.raises(ValueError):
        quant_skinny_matmul(x, w)
    with pytest.raises(ValueError):
        quant_matmul(x, w)


def test_skinny_refuses_more_than_16_rows_and_bad_outputs() -> None:
    w = packed_weight(FORMATS[1], N, K, torch.float32)
    with pytest.raises(ValueError, match="M <= 16"):
        quant_skinny_matmul(_x((17, K), torch.float32, 0), w)
    x = _x((2, K), torch.float32, 0)
    with pytest.raises(ValueError, match="out must be"):
        quant_skinny_matmul(x, w, out=torch.empty(2, N + 1, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        quant_matmul(x, w, out=torch.empty(2, N, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="bias"):
        quant_matmul(x, w, torch.zeros(N - 1, device=DEV))
    with pytest.raises(ValueError, match="M == 1 variant"):
        quant_skinny_matmul(x, w, config=FMA)


# ---- ahead-of-time compile for Hopper: GPU-only compile errors on a CPU-only machine, pipelined K loops ---------


def _sm90_compile_all() -> None:
    """Run in a subprocess with TRITON_INTERPRET=0."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    import tokenmill.kernels.quant_gemm as qm
    import tokenmill.kernels.quant_gemv as qv

    target = GPUTarget("cuda", 90, 32)

    def build(fn: Any, consts: dict[str, Any], ints: tuple[str, ...], warps: int, stages: int) -> str:
        names = list(fn.arg_names)
        words = consts["BITS"] == 4 or consts.get("PLANES")  # PLANES reads INT8 weights as int32 words
        q_type = "*i32" if words else "*i8"  # without zeros or a perm the launchers pass q in their place, as here
        ptr_types = {"q_ptr": q_type, "z_ptr": "*u8" if consts["HAS_ZEROS"] else q_type,
                     "perm_ptr": "*i32" if consts["HAS_PERM"] else q_type, "s_ptr": "*fp16",
                     "m_ptr": "*fp16", "y_ptr": "*fp32" if consts["SPLIT"] else "*bf16"}
        sig = {a: "constexpr" if a in consts else ptr_types.get(a, "*bf16") if a.endswith("_ptr") else
               "fp32" if a == "eps" else "i32" for a in names}
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a.endswith("_ptr") or a in ints}
        kernel = triton_compile(ASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}, attrs),
                                target=target, options={"num_warps": warps, "num_stages": stages})
        return str(kernel.asm["ttgir"]), str(kernel.asm["ptx"])

    formats = ((4, 128, False, False, False), (4, 128, True, True, False), (8, 4096, False, False, False),
               (4, 32, False, False, True), (8, 32, False, False, False))  # the last two: GGUF Q4_1, Q8_0
    for bits, group, zeros, perm, mins in formats:
        fmt = {"BITS": bits, "GROUP": group, "HAS_ZEROS": zeros, "HAS_MINS": mins, "HAS_PERM": perm,
               "SCALE_LATER": bits == 8 and group > 32}
        for prologue, m, use_dot in ((0, 1, False), (1, 1, False), (2, 8, True), (1, 16, True)):
            consts = {**fmt, "PROLOGUE": prologue, "HAS_RESIDUAL": prologue == 1, "HAS_BIAS": False,
                      "BLOCK_M": m if use_dot else 1, "BLOCK_N": 16, "BLOCK_K": 256, "EVEN_K": True,
                      "STATS_BLOCK": 256, "EVEN_KS": True, "USE_DOT": use_dot, "DOT_PRECISION": "tf32",
                      "NUM_STAGES": 3, "PDL": False}
            magic = use_dot and bits == 4 and group % 128 == 0 and not mins  # magic_dot: BLOCK_M >= 16
            planes = (False, True) if not use_dot or magic else (False,)
            for split, plane in itertools.product((False, True), planes):  # split-K: the slice loop is pipelined too
                block_m = max(16, m) if plane and use_dot else consts["BLOCK_M"]
                ttgir, ptx = build(qv._quant_skinny_kernel,
                                   {**consts, "SPLIT": split, "PLANES": plane, "BLOCK_M": block_m},
                                   ("K", "k_split", "stride_qn", "stride_xm", "stride_ym"), 4, 3)
                # the packed rows' alignment is known (stride_qn, the K step's hint): the words move in 16-byte
                # copies (with K // 8 computed inside, Triton knew 8-byte rows only: twice as many 8-byte copies)
                sizes = set(re.findall(r"cp\.async\.c[ag]\.shared\.global [^\n]*, (0x[0-9a-f]+)", ptx))
                if bits == 4 and not perm and not use_dot:  # (act-order gathers and the dots' x tiles: other sizes)
                    assert "0x8" not in sizes, f"{fmt} {prologue=} {split=} {plane=}: 8-byte copies of the words"
                if bits == 4 and plane and not use_dot:  # planes_fma: the exponent ORed in once a word, then one
                    # AND a field with a mask that keeps it ((w & m) | E as (w | E) & (m | E): one LOP3, not two)
                    ors = len(re.findall(r"or\.b32\s+%r\d+, %r\d+, 1258291200;", ptx))  # 0x4B000000
                    fields = sum(int(v) >> 24 == 0x4B for v in re.findall(r"and\.b32\s+%r\d+, %r\d+, (\d+);", ptx))
                    assert ors and 4 * ors <= fields, f"{fmt} {prologue=} {split=}: {ors} ORs for {fields} fields"
                if plane and use_dot:  # tensor cores, and no int-to-float conversion of the weights
                    assert "warp_group_dot" in ttgir or "tt.dot" in ttgir, f"{fmt} {prologue=}: no dot"
                    # (rstd's K is a scalar, a zero point [BLOCK_N, 1] a segment: only weight tiles count)
                    tiles = re.findall(r"arith\.[su]itofp [^\n]*: tensor<\d+x(\d+)x", ttgir)
                    assert all(int(cols) == 1 for cols in tiles), f"{fmt} {prologue=}: converts weights ({tiles})"
                assert "async_copy_global_to_local" in ttgir, f"{fmt} {prologue=} {m=} {split=} {plane=}: not pipelined"
        consts = {**fmt, "HAS_BIAS": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                  "EVEN_K": True, "DOT_PRECISION": "tf32", "MAGIC": False}
        for split in (False, True):
            build(qm._quant_gemm_kernel, {**consts, "SPLIT": split}, ("K", "k_split", "stride_qn", "stride_xm",
                                                                       "stride_ym"), 8, 3)
        if bits == 4 and group % 128 == 0 and not mins:  # the tiled magic variant: no per-weight conversion either
            ttgir, _ = build(qm._quant_gemm_kernel, {**consts, "SPLIT": False, "MAGIC": True, "BLOCK_K": 128},
                             ("K", "k_split", "stride_qn", "stride_xm", "stride_ym"), 8, 3)
            tiles = re.findall(r"arith\.[su]itofp [^\n]*: tensor<\d+x(\d+)x", ttgir)
            assert all(int(cols) == 1 for cols in tiles), f"tiled {fmt}: converts weights ({tiles})"


@pytest.mark.slow
def test_quant_kernels_compile_for_hopper(tmp_path: Any) -> None:
    run_sm90_compile("test_quant_kernels", "_sm90_compile_all", tmp_path)


# ---- CUDA, bf16 (the interpreter's bf16 tl.dot is wrong: these run on the GPU only) ---------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", MAGIC_DOT_FORMATS[:2], ids=lambda f: f[0])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_skinny_variants_in_bf16_on_the_gpu(fmt: Any, m: int) -> None:
    """Every skinny variant of INT4 g128 at a Llama-sized K in bf16, the tensor-core magic_dot among them, against
    the reference (norm-wise relative error: the variants round the weights differently, not the sums)."""
    k, n = 4096, 512
    w = packed_weight(fmt, n, k, torch.bfloat16, seed=21)
    x = _x((m, k), torch.bfloat16, 22)
    ref = quant_matmul_ref(x.float(), w).float()
    configs = [DOT, None, dataclasses.replace(MAGIC_DOT, block_n=32, block_k=256),
               dataclasses.replace(MAGIC_DOT, block_n=64, block_k=512, split_k=4)]
    if m == 1:
        configs += [FMA, QuantSkinnyConfig(32, 1024, 4, 3, use_dot=False, planes=True)]
    for config in configs:
        out = quant_skinny_matmul(x, w, config=config).float()
        err = float((out - ref).norm() / ref.norm())
        assert err < 1e-2, f"{config}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", MAGIC_DOT_FORMATS[:2], ids=lambda f: f[0])
def test_tiled_magic_in_bf16_on_the_gpu(fmt: Any) -> None:
    k, n = 4096, 1024
    w = packed_weight(fmt, n, k, torch.bfloat16, seed=26)
    x = _x((96, k), torch.bfloat16, 27)
    ref = quant_matmul_ref(x.float(), w).float()
    for config in (GemmConfig(64, 128, 128, num_warps=4, magic=True),
                   GemmConfig(128, 128, 128, num_warps=8, magic=True), GemmConfig(64, 64, 256, split_k=2, magic=True)):
        err = float((quant_matmul(x, w, config=config).float() - ref).norm() / ref.norm())
        assert err < 1e-2, f"{config}: relative error {err:.2e}"
