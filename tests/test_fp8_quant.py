"""kernels/fp8_quant.py, per-row e4m3 quantization of activations in one kernel, against its torch reference
(kernels/quant_weight.py quantize_fp8_rows): the same scales and the same bits.

Under the Triton interpreter the float -> e4m3 conversion is not the hardware's between grid points (see
tests/test_fp8_gemv.py), so the CPU tests use rows that lie on the e4m3 grid after their scaling (one element
+-448 x a power of two); random rows, whose values fall between grid points, are checked on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_aot import run_sm90_compile
from helpers_fp8 import grid_rows

from tokenmill.kernels.fp8_quant import _MAX_SINGLE_PASS, fp8_quantize_rows
from tokenmill.kernels.quant_weight import FP8, quantize_fp8_rows

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _check(x: torch.Tensor) -> None:
    q, s = fp8_quantize_rows(x)
    rq, rs = quantize_fp8_rows(x)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous() and s.shape == (x.shape[0], 1)
    assert torch.equal(s, rs), (s - rs).abs().max()
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (q.float() - rq.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "k"), [(1, 576), (5, 200), (3, _MAX_SINGLE_PASS + 1000)],
                         ids=["m1", "m5-ragged", "two-pass"])
def test_fp8_quantize_rows_on_grid_rows(dtype: torch.dtype, m: int, k: int) -> None:
    _check(grid_rows(m, k, dtype, m + k, DEV))


def test_the_scale_is_the_product_with_the_reciprocal_on_every_device() -> None:
    """PyTorch's CUDA division by a Python scalar multiplies by the reciprocal and its CPU division does not:
    13.37 / 448 differs between them in the last bit. The reference (and so the kernel) takes the product."""
    amax = torch.tensor([13.37])
    assert (amax * (1 / 448)).item() != (amax / 448).item()  # the two roundings differ for this value
    x = torch.tensor([[13.37, -2.0, 0.5]])
    assert quantize_fp8_rows(x)[1].item() == (amax * (1 / 448)).item()
    gen = torch.Generator().manual_seed(5)
    rows = (torch.randn(6, 333, generator=gen) * 7).to(DEV)  # off the grid: the scales are exact all the same
    assert torch.equal(fp8_quantize_rows(rows)[1], quantize_fp8_rows(rows)[1])


def test_fp8_quantize_rows_zero_rows_and_a_row_stride() -> None:
    x = grid_rows(4, 300, torch.float32, 7, DEV)
    x[2] = 0.0  # an all-zero row keeps a finite scale and quantizes to zeros
    _check(x)
    wide = torch.zeros(4, 512, device=DEV)
    wide[:, 100:400] = x
    _check(wide[:, 100:400])  # columns contiguous, rows 512 apart
    assert fp8_quantize_rows(x)[1][2, 0].item() == pytest.approx(1e-12)


@pytest.mark.parametrize(("x", "says"), [
    (torch.zeros(2, 3, 4), "must be \\[rows, cols\\]"),
    (torch.zeros(2, 4, dtype=torch.int32), "dtype"),
    (torch.zeros(4, 2).t(), "contiguous"),
])
def test_fp8_quantize_rows_bad_input(x: torch.Tensor, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        fp8_quantize_rows(x.to(DEV))


def _sm90_compile() -> None:
    """Run in a subprocess with TRITON_INTERPRET=0: both variants compile for Hopper, with an e4m3 cast and
    IEEE-rounded division (the reference's); so do the fused norm / SwiGLU variants."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    import tokenmill.kernels.fp8_quant as fq

    fn = fq._fp8_quantize_rows_kernel
    names = list(fn.arg_names)
    for single, block in ((True, 16384), (False, 4096)):
        consts = {"FP8_MAX_": 448.0, "INV_MAX": 1 / 448, "MIN_SCALE": 1e-12, "BLOCK": block, "SINGLE_PASS": single,
                  "PDL": True}
        types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in names}
        kernel = triton_compile(ASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        ptx = str(kernel.asm["ptx"])
        assert "e4m3" in ptx and "div.rn.f32" in ptx, f"{single=}: no e4m3 cast or no IEEE division"
    fn = fq._fp8_prologue_quantize_kernel
    names = list(fn.arg_names)
    for norm, residual in ((True, True), (True, False), (False, False)):
        consts = {"FP8_MAX_": 448.0, "INV_MAX": 1 / 448, "MIN_SCALE": 1e-12, "BLOCK": 16384, "NORM": norm,
                  "HAS_RESIDUAL": residual, "PDL": True}
        types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "r_out_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                 "s_ptr": "*fp32", "eps": "fp32"}
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in names}
        kernel = triton_compile(ASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert "e4m3" in str(kernel.asm["ptx"]), f"{norm=} {residual=}: no e4m3 cast"


@pytest.mark.slow
def test_fp8_quantize_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    run_sm90_compile("test_fp8_quant", "_sm90_compile", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hardware's e4m3 rounding between grid points")
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (37, 4096), (1, 14336), (9, 20000)])
def test_fp8_quantize_rows_random_bf16_rows_on_the_gpu(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(k + m)
    _check((torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16).to(DEV))


@pytest.mark.parametrize("m", [1, 5, 64], ids=lambda m: f"m{m}")  # m1: the tensor-wise GEMM; more: row-wise
def test_fp8_method_matmul_against_the_emulation(m: int) -> None:
    """Fp8LinearMethod's GPU path (this kernel, torch._scaled_mm, the scales and bias after it) against the
    emulation; on the CPU through torch's own _scaled_mm and the interpreter, with rows on the e4m3 grid."""
    from tokenmill.kernels.quant_weight import fp8_matmul_ref
    from tokenmill.worker.quant.fp8 import Fp8LinearMethod, fp8_supported

    if DEV.type == "cuda" and not fp8_supported(DEV):
        pytest.skip("this GPU has no FP8 tensor cores")
    gen = torch.Generator().manual_seed(m)
    w = (torch.randn(1024, 4096, generator=gen) / 64).to(DEV)
    q, s = quantize_fp8_rows(w)
    x = (torch.randn(m, 4096, generator=gen).to(torch.bfloat16).to(DEV) if DEV.type == "cuda" else
         grid_rows(m, 4096, torch.bfloat16, m, DEV))
    bias = torch.randn(1024, generator=gen).to(torch.bfloat16).to(DEV)
    for b in (None, bias):
        y = Fp8LinearMethod._scaled_mm(x, q, s, b)
        ref = fp8_matmul_ref(x, q, s, b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 1024)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


# ---- the fused variants: the op before the matmul and the quantization in one kernel ----------------------------


def _same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(a[1], b[1]), (a[1] - b[1]).abs().max()
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))


# On the GPU the two kernels' row sums may reduce in another order: 16-bit activations round the normalised row
# before the weight multiply and hide it, float32 does not (seen: scales 1 ulp apart at 5 x 4096, no residual).
# The engine's FP8 path runs 16-bit models; the interpreter checks float32 exactly.
FUSED_DTYPES = [torch.float16, torch.bfloat16] if DEV.type == "cuda" else [torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize(("m", "k"), [(1, 96), (5, 4096)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fp8_add_rmsnorm_quantize_equals_the_two_kernels(dtype: torch.dtype, m: int, k: int,
                                                         with_residual: bool) -> None:
    """kernels/rmsnorm.py's add_rmsnorm then fp8_quantize_rows, bit for bit (the interpreter's e4m3 cast is the
    same in both), the new residual included; an odd row stride on h."""
    from tokenmill.kernels.fp8_quant import fp8_add_rmsnorm_quantize
    from tokenmill.kernels.rmsnorm import add_rmsnorm, rmsnorm

    gen = torch.Generator().manual_seed(m * k)
    h = (torch.randn(m, k + 8, generator=gen) * 2).to(dtype).to(DEV)[:, :k]
    res = (torch.randn(m, k, generator=gen)).to(dtype).to(DEV) if with_residual else None
    w = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEV)
    q, s, r = fp8_add_rmsnorm_quantize(h, res, w, 1e-5)
    if res is None:
        y, r_ref = rmsnorm(h, w, 1e-5), h
    else:
        y, r_ref = add_rmsnorm(h, res, w, 1e-5)
    _same_bits((q, s), fp8_quantize_rows(y))
    assert torch.equal(r, r_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_silu_mul_quantize_equals_the_two_kernels(dtype: torch.dtype, m: int) -> None:
    from tokenmill.kernels.activation import silu_and_mul
    from tokenmill.kernels.fp8_quant import fp8_silu_mul_quantize

    gen = torch.Generator().manual_seed(m)
    gate_up = (torch.randn(m, 2 * 352, generator=gen) * 3).to(dtype).to(DEV)
    _same_bits(fp8_silu_mul_quantize(gate_up), fp8_quantize_rows(silu_and_mul(gate_up)))


def test_fp8_fused_quantize_bad_input() -> None:
    from tokenmill.kernels.fp8_quant import FUSED_MAX_COLS, fp8_add_rmsnorm_quantize, fp8_silu_mul_quantize

    h = torch.zeros(2, 64, device=DEV)
    with pytest.raises(ValueError, match="weight must be a contiguous \\[64\\]"):
        fp8_add_rmsnorm_quantize(h, None, torch.ones(32, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        fp8_add_rmsnorm_quantize(h, h.half(), torch.ones(64, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="gate_up must be \\[rows, 2 \\* I\\]"):
        fp8_silu_mul_quantize(torch.zeros(2, 7, device=DEV))
    with pytest.raises(ValueError, match=f"at most {FUSED_MAX_COLS} columns"):
        fp8_silu_mul_quantize(torch.zeros(1, 2 * FUSED_MAX_COLS + 2, device=DEV))


def test_fp8_method_fuses_the_norm_and_swiglu_into_its_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fp8LinearMethod's few-token hooks (layers.Linear.forward_norm / forward_silu_mul): the fused kernel's
    result equals the unfused path's (the op's kernel, then apply) exactly; the emulation keeps the unfused path.
    torch._scaled_mm runs on the CPU too; rows on the e4m3 grid keep the interpreter's cast exact."""
    from tokenmill.kernels.activation import silu_and_mul
    from tokenmill.kernels.rmsnorm import add_rmsnorm
    from tokenmill.worker.quant.fp8 import Fp8LinearMethod

    method = object.__new__(Fp8LinearMethod)  # the GPU path, built without the device check
    method.emulate = False
    layer = torch.nn.Module()
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 128, generator=gen) / 16).to(DEV)
    q, s = quantize_fp8_rows(w)
    layer.register_parameter("qweight", torch.nn.Parameter(q, requires_grad=False))
    layer.register_parameter("scales", torch.nn.Parameter(s, requires_grad=False))
    layer.bias = None
    h, res = grid_rows(2, 128, torch.float16, 1, DEV), grid_rows(2, 128, torch.float16, 2, DEV)
    norm_w = torch.ones(128, dtype=torch.float16, device=DEV)
    got = method.apply_add_rmsnorm(layer, h, res, norm_w, 1e-5)
    assert got is not None
    x, r = add_rmsnorm(h, res, norm_w, 1e-5)
    assert torch.equal(got[1], r) and torch.equal(got[0], method.apply(layer, x))
    gate_up = grid_rows(2, 256, torch.float16, 4, DEV)
    small = torch.nn.Module()
    small.register_parameter("qweight", torch.nn.Parameter(q[:, :128].contiguous(), requires_grad=False))
    small.register_parameter("scales", torch.nn.Parameter(s, requires_grad=False))
    small.bias = None
    y = method.apply_silu_mul(small, gate_up)
    assert y is not None and torch.equal(y, method.apply(small, silu_and_mul(gate_up)))
    method.emulate = True
    assert method.apply_add_rmsnorm(layer, h, res, norm_w, 1e-5) is None
    assert method.apply_silu_mul(small, gate_up) is None
