"""Tests of the skinny decode matmuls (kernels/gemv.py) against their unfused plain-torch references.

Without CUDA the kernels run under the Triton interpreter in fp16 / fp32 on small shapes (the interpreter's
bf16 tl.dot is wrong); @pytest.mark.gpu tests use bf16 at Llama-3-8B shapes. Outputs are NaN-poisoned `out=`
buffers, so an element the kernel does not write fails.

Tolerances (weights scaled by 1/sqrt(K), so outputs are O(1)):
  fp32: atol = rtol = 2e-5 (fp32 accumulation in a different order than the reference's F.linear; the
        RMSNorm statistics too).
  fp16: atol = rtol = 2e-3, i.e. ~2 fp16 ulps at |y| ~ 1: one output rounding on each side, plus the rare
        1-ulp flip of a normalised input element whose fp32 value sits on a rounding boundary (the kernel's
        sum of squares runs in another order than torch's mean).
  bf16 (GPU): vs the fp32 product of the same rounded input: atol = 3e-2, rtol = 2e-2 elementwise (~2-3 bf16
        ulps) and norm-wise relative error < 3e-3 (one bf16 rounding is ~1.6e-3 rms); vs the bf16 unfused
        reference (cuBLAS): norm-wise < 1e-2.
  The new residual (h + residual rounded once) must match bit for bit.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any

import pytest
from helpers_aot import run_sm90_compile

from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenmill.kernels.gemv import (
    SkinnyConfig,
    add_rmsnorm_matmul,
    add_rmsnorm_matmul_ref,
    default_config,
    silu_mul_matmul,
    silu_mul_matmul_ref,
    skinny_matmul,
    skinny_matmul_ref,
)
from tokenmill.kernels.rmsnorm import add_rmsnorm, rmsnorm_ref

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.gpu
# the Triton interpreter converts 1-element arrays to ints (numpy deprecation noise, harmless here)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# Small tiles so that the interpreter walks several programs and K steps on tiny shapes.
DOT = SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
FMA = SkinnyConfig(block_n=8, block_k=32, num_warps=4, num_stages=2, use_dot=False)
# (K, N): multiples of the DOT/FMA blocks, neither, and K below one block
SHAPES = [(64, 48), (100, 50), (20, 7)]
EPS = 1e-5


def _tol(dtype: torch.dtype) -> dict[str, Any]:
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 3e-2, "rtol": 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=DEV) * scale).to(dtype)


def _weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return _randn((n, k), dtype, gen, k**-0.5)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _configs(m: int) -> list[SkinnyConfig | None]:
    """The tiny explicit configs that apply to M rows, and the default rule (None)."""
    return [DOT, FMA, None] if m == 1 else [DOT, None]


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype
    assert not out.isnan().any(), "kernel left unwritten (NaN) outputs"
    torch.testing.assert_close(out, ref, **_tol(dtype))


# ---------------------------------------------------------------------------------------------------------
# skinny_matmul
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_matmul(dtype: torch.dtype, m: int, k: int, n: int, with_bias: bool) -> None:
    gen = _gen(0)
    x = _randn((m, k), dtype, gen)
    w = _weight(n, k, dtype, gen)
    bias = _randn((n,), dtype, gen) if with_bias else None
    ref = skinny_matmul_ref(x, w, bias)
    for config in _configs(m):
        out = _poisoned((m, n), dtype)
        res = skinny_matmul(x, w, bias, out=out, config=config)
        assert res is out
        _check(out, ref, dtype)
    _check(skinny_matmul(x, w, bias), ref, dtype)  # allocated output


def test_skinny_matmul_strided_x_and_out() -> None:
    # x: rows of a wider buffer (row stride 100, e.g. a slice of a fused projection); out: a column slice
    gen = _gen(1)
    buf = _randn((5, 100), torch.float32, gen)
    x = buf[:, 10:74]  # [5, 64], stride (100, 1)
    w = _weight(40, 64, torch.float32, gen)
    big_out = _poisoned((5, 60), torch.float32)
    out = big_out[:, 3:43]
    skinny_matmul(x, w, out=out, config=DOT)
    _check(out, skinny_matmul_ref(x, w), torch.float32)
    assert big_out[:, :3].isnan().all() and big_out[:, 43:].isnan().all(), "wrote outside out"
    x1 = buf[2:3, 7:71]  # M = 1 through the FMA variant
    out1 = _poisoned((1, 40), torch.float32)
    skinny_matmul(x1, w, out=out1, config=FMA)
    _check(out1, skinny_matmul_ref(x1, w), torch.float32)


# ---------------------------------------------------------------------------------------------------------
# add_rmsnorm_matmul
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matmul(dtype: torch.dtype, m: int, k: int, n: int, with_residual: bool) -> None:
    gen = _gen(2)
    h = _randn((m, k), dtype, gen, 3.0)
    residual = _randn((m, k), dtype, gen) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=DEV)).to(dtype)
    w = _weight(n, k, dtype, gen)
    bias = _randn((n,), dtype, gen) if k == 100 else None  # one shape with a bias
    ref, ref_res = add_rmsnorm_matmul_ref(h, residual, norm_w, EPS, w, bias)
    for config in _configs(m):
        out = _poisoned((m, n), dtype)
        res_out = _poisoned((m, k), dtype) if with_residual else None
        y, new_res = add_rmsnorm_matmul(h, residual, norm_w, EPS, w, bias, out=out, residual_out=res_out,
                                        config=config)  # fmt: skip
        assert y is out
        _check(out, ref, dtype)
        if residual is None:
            assert new_res is h  # no copy: the new residual is h itself
        else:
            assert new_res is res_out
            torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
            torch.testing.assert_close(new_res, h + residual, rtol=0, atol=0)  # HF: residual + hidden in dtype
    y, new_res = add_rmsnorm_matmul(h, residual, norm_w, EPS, w, bias)  # allocated outputs
    _check(y, ref, dtype)
    if residual is not None:
        torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
        assert new_res.data_ptr() not in (h.data_ptr(), residual.data_ptr())


def test_add_rmsnorm_matmul_matches_unfused_triton_sequence() -> None:
    # the fused kernel vs. the two Triton kernels it replaces (add_rmsnorm, then skinny_matmul)
    gen = _gen(3)
    dtype = torch.float16
    h, r = _randn((4, 96), dtype, gen, 2.0), _randn((4, 96), dtype, gen)
    norm_w = (1 + 0.1 * torch.randn(96, generator=gen, device=DEV)).to(dtype)
    w = _weight(40, 96, dtype, gen)
    x, r_new = add_rmsnorm(h, r, norm_w, EPS)
    y, r_fused = add_rmsnorm_matmul(h, r, norm_w, EPS, w, config=DOT)
    torch.testing.assert_close(r_fused, r_new, rtol=0, atol=0)
    torch.testing.assert_close(y, skinny_matmul(x, w, config=DOT), **_tol(dtype))


def test_add_rmsnorm_matmul_strided_inputs() -> None:
    gen = _gen(4)
    dtype = torch.float32
    hbuf, rbuf = _randn((6, 80), dtype, gen), _randn((6, 90), dtype, gen)
    h, residual = hbuf[:3, 8:72], rbuf[1:4, 20:84]  # [3, 64], row strides 80 and 90
    norm_w = torch.ones(128, device=DEV)[::2]  # stride 2: rejected
    with pytest.raises(ValueError, match="norm_weight"):
        add_rmsnorm_matmul(h, residual, norm_w, EPS, _weight(24, 64, dtype, gen))
    norm_w = (1 + 0.1 * torch.randn(64, generator=gen, device=DEV)).to(dtype)
    w = _weight(24, 64, dtype, gen)
    res_big = _poisoned((3, 100), dtype)
    res_out = res_big[:, 5:69]
    out = _poisoned((3, 24), dtype)
    add_rmsnorm_matmul(h, residual, norm_w, EPS, w, out=out, residual_out=res_out, config=DOT)
    ref, ref_res = add_rmsnorm_matmul_ref(h, residual, norm_w, EPS, w)
    _check(out, ref, dtype)
    torch.testing.assert_close(res_out, ref_res, rtol=0, atol=0)
    assert res_big[:, :5].isnan().all() and res_big[:, 69:].isnan().all(), "wrote outside residual_out"


def test_add_rmsnorm_matmul_fp32_norm_weight_on_fp16() -> None:
    # like kernels/rmsnorm.py, the norm weight may be any float dtype (applied in fp32, then rounded)
    gen = _gen(5)
    h, r = _randn((2, 64), torch.float16, gen), _randn((2, 64), torch.float16, gen)
    norm_w = 1 + 0.1 * torch.randn(64, generator=gen, device=DEV)
    w = _weight(32, 64, torch.float16, gen)
    y, _ = add_rmsnorm_matmul(h, r, norm_w, EPS, w, config=DOT)
    ref, _ = add_rmsnorm_matmul_ref(h, r, norm_w, EPS, w)
    _check(y, ref, torch.float16)


# ---------------------------------------------------------------------------------------------------------
# silu_mul_matmul
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("inter", "n"), SHAPES)
def test_silu_mul_matmul(dtype: torch.dtype, m: int, inter: int, n: int) -> None:
    gen = _gen(6)
    gu = _randn((m, 2 * inter), dtype, gen, 3.0)
    w = _weight(n, inter, dtype, gen)
    ref = silu_mul_matmul_ref(gu, w)
    for config in _configs(m):
        out = _poisoned((m, n), dtype)
        assert silu_mul_matmul(gu, w, out=out, config=config) is out
        _check(out, ref, dtype)


def test_silu_mul_matmul_strided_bias_and_unfused_triton() -> None:
    gen = _gen(7)
    dtype = torch.float16
    buf = _randn((3, 2 * 48 + 10), dtype, gen, 2.0)
    gu = buf[:, 10:]  # [3, 96], row stride 106
    w = _weight(30, 48, dtype, gen)
    bias = _randn((30,), dtype, gen)
    out = _poisoned((3, 30), dtype)
    silu_mul_matmul(gu, w, bias, out=out, config=DOT)
    _check(out, silu_mul_matmul_ref(gu, w, bias), dtype)
    torch.testing.assert_close(out, skinny_matmul(silu_and_mul(gu), w, bias, config=DOT), **_tol(dtype))


# ---------------------------------------------------------------------------------------------------------
# rounding points: with an identity weight y == x exactly, so the fused prologue must reproduce the unfused
# kernels' intermediate roundings (a tolerance on y after a real matmul would not see them)
# ---------------------------------------------------------------------------------------------------------


def _assert_same_up_to_rare_ulp(out: torch.Tensor, ref: torch.Tensor, max_frac: float = 0.01) -> None:
    """Equal except for a few elements 1 ulp apart (the fp32 sum of squares / exp of the kernel and torch
    differ in the last bits, which can flip a rounding that sits on a boundary)."""
    assert not out.isnan().any()
    diff = out.float() - ref.float()
    ulp = torch.finfo(out.dtype).eps * ref.float().abs().clamp_min(torch.finfo(out.dtype).tiny)
    assert bool((diff.abs() <= ulp * 1.01).all()), f"max diff {diff.abs().max():.3e}"
    frac = float((diff != 0).float().mean())
    assert frac <= max_frac, f"{frac:.1%} of the elements differ"


def _identity_case(dtype: torch.dtype, m: int, config: SkinnyConfig | None, seed: int) -> None:
    gen = _gen(seed)
    k = 64 if dtype != torch.bfloat16 else HIDDEN
    eye = torch.eye(k, device=DEV, dtype=dtype)
    h, r = _randn((m, k), dtype, gen, 3.0), _randn((m, k), dtype, gen)
    norm_w = (1 + 0.3 * torch.randn(k, generator=gen, device=DEV)).to(dtype)
    for residual in (None, r):
        y, _ = add_rmsnorm_matmul(h, residual, norm_w, EPS, eye, out=_poisoned((m, k), dtype), config=config)
        x_ref, _ = add_rmsnorm_matmul_ref(h, residual, norm_w, EPS, eye)
        _assert_same_up_to_rare_ulp(y, x_ref)
    gu = _randn((m, 2 * k), dtype, gen, 3.0)
    y = silu_mul_matmul(gu, eye, out=_poisoned((m, k), dtype), config=config)
    _assert_same_up_to_rare_ulp(y, silu_mul_matmul_ref(gu, eye))


@pytest.mark.parametrize("m", [1, 3])
def test_prologue_rounding_points_fp16(m: int) -> None:
    for config in _configs(m):
        _identity_case(torch.float16, m, config, seed=20 + m)


# ---------------------------------------------------------------------------------------------------------
# configs, edge cases, bad input
# ---------------------------------------------------------------------------------------------------------


def test_default_config_rules() -> None:
    # Llama-3-8B projections on 132 SMs: several programs per SM, weight tiles of <= 16 KB, FMA only at M = 1
    for m in (2, 8, 16):
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
            cfg = default_config(m, n, k, 2, 132)
            assert cfg.use_dot
            assert cfg.block_n in (16, 32, 64) and 64 <= cfg.block_k <= 256
            assert cfg.block_n * cfg.block_k * 2 <= 16384
            assert -(-n // cfg.block_n) >= 2 * 132 or cfg.block_n == 16
    # M = 1: the family measured best on the H200 (16 rows, 256-wide K steps, 512 for K >= 8192, FMA)
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        cfg = default_config(1, n, k, 2, 132)
        assert (cfg.block_n, cfg.block_k, cfg.use_dot) == (16, 512 if k >= 8192 else 256, False)
    assert default_config(1, 10, 20, 4, 4).block_k == 32  # never wider than K needs
    with pytest.raises(ValueError):
        SkinnyConfig(block_n=24, block_k=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError):
        SkinnyConfig(block_n=16, block_k=8, num_warps=4, num_stages=2)
    with pytest.raises(ValueError):
        SkinnyConfig(block_n=16, block_k=64, num_warps=3, num_stages=2)
    with pytest.raises(ValueError):
        SkinnyConfig(block_n=16, block_k=64, num_warps=4, num_stages=0)


def test_empty_batch() -> None:
    w = _weight(8, 16, torch.float32, _gen(8))
    x = torch.empty((0, 16), device=DEV)
    assert skinny_matmul(x, w).shape == (0, 8)
    y, r = add_rmsnorm_matmul(x, x.clone(), torch.ones(16, device=DEV), EPS, w)
    assert y.shape == (0, 8) and r.shape == (0, 16)
    assert silu_mul_matmul(torch.empty((0, 32), device=DEV), w).shape == (0, 8)


def test_launchers_do_not_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # .item() / .tolist() on a device tensor would be a host sync (and break CUDA-graph capture)
    gen = _gen(9)
    h, r = _randn((2, 32), torch.float32, gen), _randn((2, 32), torch.float32, gen)
    w = _weight(16, 32, torch.float32, gen)
    nw = torch.ones(32, device=DEV)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in a skinny matmul launcher")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    y1 = skinny_matmul(h, w)
    y2, _ = add_rmsnorm_matmul(h, r, nw, EPS, w)
    y3 = silu_mul_matmul(torch.cat([h, r], 1), w)
    monkeypatch.undo()
    _check(y1, skinny_matmul_ref(h, w), torch.float32)
    _check(y2, add_rmsnorm_matmul_ref(h, r, nw, EPS, w)[0], torch.float32)
    _check(y3, silu_mul_matmul_ref(torch.cat([h, r], 1), w), torch.float32)


_BAD = [
    "m17",
    "x1d",
    "x_int",
    "x_last_stride",
    "w_k",
    "w_noncontig",
    "w_dtype",
    "w_device",
    "bias_shape",
    "bias_dtype",
    "fma_m3",
    "out_shape",
    "out_dtype",
    "out_aliases_x",
    "gu_odd",
    "res_shape",
    "res_dtype",
    "res_last_stride",
    "nw_shape",
    "nw_int",
    "resout_aliases_res",
    "resout_aliases_h",
    "resout_without_res",
    "resout_is_out",
]


@pytest.mark.parametrize("case", _BAD)
def test_launchers_reject_bad_input(case: str) -> None:
    gen = _gen(10)
    f32 = torch.float32
    x, r = _randn((3, 32), f32, gen), _randn((3, 32), f32, gen)
    w = _weight(16, 32, f32, gen)
    nw = torch.ones(32, device=DEV)
    gu = _randn((3, 64), f32, gen)
    w_gu = w  # [16, 32] for gu [3, 64]
    sq = _randn((3, 16), f32, gen)
    buf = torch.empty_like(x)

    def mm(**kw: Any) -> object:
        args = {"x": x, "w": w} | kw
        return skinny_matmul(**args)

    def norm(**kw: Any) -> object:
        args = {"h": x, "residual": r, "norm_weight": nw, "eps": EPS, "w": w} | kw
        return add_rmsnorm_matmul(**args)

    calls = {
        "m17": lambda: mm(x=_randn((17, 32), f32, gen)),
        "x1d": lambda: mm(x=x[0]),
        "x_int": lambda: mm(x=x.to(torch.int32), w=w.to(torch.int32)),
        "x_last_stride": lambda: mm(x=_randn((3, 64), f32, gen)[:, ::2]),
        "w_k": lambda: mm(w=_weight(16, 31, f32, gen)),
        "w_noncontig": lambda: mm(w=_weight(32, 16, f32, gen).t()),
        "w_dtype": lambda: mm(w=w.half()),
        "w_device": lambda: mm(w=torch.empty((16, 32), device="meta")),
        "bias_shape": lambda: mm(bias=torch.zeros(15, device=DEV)),
        "bias_dtype": lambda: mm(bias=torch.zeros(16, device=DEV, dtype=torch.float16)),
        "fma_m3": lambda: mm(config=FMA),
        "out_shape": lambda: mm(out=torch.empty((3, 15), device=DEV)),
        "out_dtype": lambda: mm(out=torch.empty((3, 16), device=DEV, dtype=torch.float16)),
        "out_aliases_x": lambda: mm(x=sq, w=_weight(16, 16, f32, gen), out=sq),
        "gu_odd": lambda: silu_mul_matmul(gu[:, :63], w_gu),
        "res_shape": lambda: norm(residual=r[:2]),
        "res_dtype": lambda: norm(residual=r.half()),
        "res_last_stride": lambda: norm(residual=_randn((3, 64), f32, gen)[:, ::2]),
        "nw_shape": lambda: norm(norm_weight=torch.ones(31, device=DEV)),
        "nw_int": lambda: norm(norm_weight=torch.ones(32, device=DEV, dtype=torch.int32)),
        "resout_aliases_res": lambda: norm(residual_out=r),
        "resout_aliases_h": lambda: norm(residual_out=x),
        "resout_without_res": lambda: norm(residual=None, residual_out=torch.empty_like(x)),
        "resout_is_out": lambda: norm(w=_weight(32, 32, f32, gen), out=buf, residual_out=buf),
    }
    with pytest.raises(ValueError):
        calls[case]()


# ---------------------------------------------------------------------------------------------------------
# ahead-of-time compile for Hopper (sm_90) on a CPU-only machine: catches GPU-only compile errors and checks
# that the K loops of the Llama-3-8B default configs are software-pipelined (async copies)
# ---------------------------------------------------------------------------------------------------------


def _sm90_compile_all() -> None:
    """Run in a subprocess with TRITON_INTERPRET=0 (kernels must be decorated as real JIT functions)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    import tokenmill.kernels.gemv as g

    target = GPUTarget("cuda", 90, 32)
    fn = g._skinny_kernel
    names = list(fn.arg_names)

    def build(dt: str, prologue: int, m: int, n: int, k: int, cfg: Any, bias: bool, pdl: bool = False) -> str:
        block_m = g._next_pow2(m) if cfg.use_dot else 1
        stats = g._stats_block(block_m, k, cfg) if prologue == g._NORM else 16
        consts = {"PROLOGUE": prologue, "HAS_RESIDUAL": prologue == g._NORM, "HAS_BIAS": bias,
                  "BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "EVEN_K": k % cfg.block_k == 0, "STATS_BLOCK": stats, "EVEN_KS": k % stats == 0,
                  "USE_DOT": cfg.use_dot, "DOT_PRECISION": "ieee" if dt == "fp32" else "tf32",
                  "NUM_STAGES": cfg.num_stages, "PDL": pdl}  # fmt: skip
        ptrs = {a: f"*{dt}" for a in names if a.endswith("_ptr")}
        signature = {a: "constexpr" if a in consts else ptrs.get(a, "i32") for a in names}
        signature["eps"] = "fp32"
        constexprs = {(names.index(a),): v for a, v in consts.items()}
        aligned = [a for a in names if a.endswith("_ptr") or a.startswith("stride_") or a == "K"]
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        kernel = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                         "launch_pdl": pdl})  # fmt: skip
        if pdl:  # the PDL protocol (kernels/launch.py): wait before the first load, release after the last store
            ptx = str(kernel.asm["ptx"])
            wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
            first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i > -1)
            last_store = ptx.rfind("st.global")
            assert -1 < wait < first_load and -1 < last_store < release, (wait, first_load, last_store, release)
        return str(kernel.asm["ttgir"])

    shapes = {"qkv": (6144, 4096, g._NORM), "o": (4096, 4096, g._PLAIN), "gate_up": (28672, 4096, g._NORM),
              "down": (4096, 14336, g._SILU)}  # fmt: skip
    for name, (n, k, prologue) in shapes.items():
        for m in (1, 2, 8, 16):
            cfg = g.default_config(m, n, k, 2, 132)
            for pdl in (False, True):
                ttgir = build("bf16", prologue, m, n, k, cfg, False, pdl)
                assert "async_copy_global_to_local" in ttgir, f"{name} M={m} {cfg} {pdl=}: K loop is not pipelined"
    # other dtypes, bias, K tails, the dot variant at M = 1
    build("fp16", g._PLAIN, 3, 100, 100, SkinnyConfig(16, 32, 4, 3), True)
    build("fp32", g._NORM, 5, 64, 200, SkinnyConfig(32, 64, 4, 3), True)
    build("bf16", g._SILU, 1, 4096, 14336, SkinnyConfig(16, 256, 4, 4, use_dot=True), False)
    build("bf16", g._NORM, 1, 6144, 4096, SkinnyConfig(32, 128, 8, 3, use_dot=False), False)


@pytest.mark.slow
def test_gemv_compiles_for_hopper(tmp_path: Any) -> None:
    run_sm90_compile("test_gemv", "_sm90_compile_all", tmp_path)


# ---------------------------------------------------------------------------------------------------------
# GPU tests (bf16, Llama-3-8B shapes: hidden 4096, q/k/v 4096 + 2 x 1024, intermediate 14336)
# ---------------------------------------------------------------------------------------------------------

HIDDEN, QKV, INTER = 4096, 6144, 14336
GPU_M1_CONFIGS = [None, SkinnyConfig(16, 256, 4, 4, use_dot=True)]  # default (FMA at M = 1) and the dot variant


def _gpu_check(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
               bias: torch.Tensor | None = None) -> None:  # fmt: skip
    """out vs the bf16 unfused reference `ref` (cuBLAS, which may reduce split-K partials in bf16) and, more
    tightly, vs the fp32 product of the same (rounded) matmul input x: there the only error left is the
    output rounding (~1.6e-3 rms relative)."""
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten (NaN) outputs"
    exact = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    err32, err = rel_err(out, exact), rel_err(out, ref)
    assert err32 < 3e-3, f"relative error vs fp32 product {err32:.3e}"
    assert err < 1e-2, f"relative error vs bf16 reference {err:.3e}"
    torch.testing.assert_close(out.float(), exact, **_tol(torch.bfloat16))


def _gpu_configs(m: int) -> list[SkinnyConfig | None]:
    return GPU_M1_CONFIGS if m == 1 else [None]


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize(("n", "name"), [(QKV, "qkv"), (2 * INTER, "gate_up")])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_add_rmsnorm_matmul_llama(m: int, n: int, name: str, with_residual: bool) -> None:
    dtype = torch.bfloat16
    gen = _gen(11)
    h = _randn((m, HIDDEN), dtype, gen)
    residual = _randn((m, HIDDEN), dtype, gen, 4.0) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=DEV)).to(dtype)
    w = _weight(n, HIDDEN, dtype, gen)
    ref, ref_res = add_rmsnorm_matmul_ref(h, residual, norm_w, EPS, w)
    x = rmsnorm_ref(ref_res, norm_w, EPS)  # the unfused matmul input
    for config in _gpu_configs(m):
        out = _poisoned((m, n), dtype)
        res_out = _poisoned((m, HIDDEN), dtype) if with_residual else None
        _, new_res = add_rmsnorm_matmul(h, residual, norm_w, EPS, w, out=out, residual_out=res_out, config=config)
        _gpu_check(out, ref, x, w)
        if with_residual:
            torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
        else:
            assert new_res is h


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_silu_mul_matmul_down(m: int) -> None:
    dtype = torch.bfloat16
    gen = _gen(12)
    gu = _randn((m, 2 * INTER), dtype, gen, 2.0)
    w = _weight(HIDDEN, INTER, dtype, gen)
    ref = silu_mul_matmul_ref(gu, w)
    for config in _gpu_configs(m):
        out = _poisoned((m, HIDDEN), dtype)
        silu_mul_matmul(gu, w, out=out, config=config)
        _gpu_check(out, ref, silu_and_mul_ref(gu), w)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize(("n", "k"), [(HIDDEN, HIDDEN), (QKV, HIDDEN)])
def test_gpu_skinny_matmul_o_and_qkv(m: int, n: int, k: int) -> None:
    dtype = torch.bfloat16
    gen = _gen(13)
    x = _randn((m, k), dtype, gen)
    w = _weight(n, k, dtype, gen)
    bias = _randn((n,), dtype, gen, 0.1)  # Qwen-style qkv bias
    for b in (None, bias):
        ref = skinny_matmul_ref(x, w, b)
        for config in _gpu_configs(m):
            out = _poisoned((m, n), dtype)
            skinny_matmul(x, w, b, out=out, config=config)
            _gpu_check(out, ref, x, w, b)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_prologue_rounding_points_bf16(m: int) -> None:
    for config in _gpu_configs(m):
        _identity_case(torch.bfloat16, m, config, seed=30 + m)


@gpu
@needs_cuda
def test_gpu_fp16_fp32_and_cuda_graph() -> None:
    gen = _gen(14)
    for dtype in (torch.float16, torch.float32):
        h, r = _randn((8, HIDDEN), dtype, gen), _randn((8, HIDDEN), dtype, gen)
        norm_w = torch.ones(HIDDEN, device=DEV, dtype=dtype)
        w = _weight(QKV, HIDDEN, dtype, gen)
        y, _ = add_rmsnorm_matmul(h, r, norm_w, EPS, w)
        ref, _ = add_rmsnorm_matmul_ref(h, r, norm_w, EPS, w)
        torch.cuda.synchronize()
        assert rel_err(y, ref) < 2e-3
    # one decode layer's four projections captured in a CUDA graph, replayed on new inputs
    dtype = torch.bfloat16
    h, r = _randn((1, HIDDEN), dtype, gen), _randn((1, HIDDEN), dtype, gen)
    nw = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=DEV)).to(dtype)
    w_qkv, w_o = _weight(QKV, HIDDEN, dtype, gen), _weight(HIDDEN, HIDDEN, dtype, gen)
    w_gu, w_down = _weight(2 * INTER, HIDDEN, dtype, gen), _weight(HIDDEN, INTER, dtype, gen)

    def layer() -> tuple[torch.Tensor, torch.Tensor]:
        qkv, res = add_rmsnorm_matmul(h, r, nw, EPS, w_qkv)
        o = skinny_matmul(qkv[:, :HIDDEN], w_o)
        gu, res2 = add_rmsnorm_matmul(o, res, nw, EPS, w_gu)
        return silu_mul_matmul(gu, w_down), res2

    def layer_ref() -> tuple[torch.Tensor, torch.Tensor]:
        qkv, res = add_rmsnorm_matmul_ref(h, r, nw, EPS, w_qkv)
        o = skinny_matmul_ref(qkv[:, :HIDDEN], w_o)
        gu, res2 = add_rmsnorm_matmul_ref(o, res, nw, EPS, w_gu)
        return silu_mul_matmul_ref(gu, w_down), res2

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res2 = layer()
    h.copy_(_randn((1, HIDDEN), dtype, gen))
    r.copy_(_randn((1, HIDDEN), dtype, gen))
    graph.replay()
    ref, ref_res2 = layer_ref()
    torch.cuda.synchronize()
    assert rel_err(res2, ref_res2) < 1e-2
    assert rel_err(out, ref) < 2e-2  # four chained bf16 projections
