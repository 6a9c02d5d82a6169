"""kernels/fp8_gemv.py, the fused FP8 W8A8 skinny matmuls, against their references (kernels/quant_weight.py
fp8_matmul_ref after the unfused prologue).

Under the Triton interpreter the float -> e4m3 conversion is not the hardware's (it is off by several units in
the last place for values between the grid points), so the CPU tests quantize activations that lie on the e4m3
grid after their per-token scaling (each row holds +-448 x a power of two): there every rounding is exact and
the kernel must give the reference's sums. The fused prologues produce activations off the grid: they run on
the GPU (bf16, @gpu), with the ahead-of-time sm_90 compile on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers_aot import run_sm90_compile
from helpers_fp8 import grid_rows

from tokenmill.kernels.fp8_gemv import (
    fp8_add_rmsnorm_matmul,
    fp8_add_rmsnorm_matmul_ref,
    fp8_silu_mul_matmul,
    fp8_silu_mul_matmul_ref,
    fp8_skinny_matmul,
)
from tokenmill.kernels.gemv import SkinnyConfig
from tokenmill.kernels.quant_weight import fp8_matmul_ref, quantize_fp8_rows

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
SMALL = SkinnyConfig(block_n=16, block_k=64, num_warps=4, num_stages=2)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    q, s = quantize_fp8_rows(w)
    return q.to(DEV), s.to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "k"), [(1, 256), (5, 200), (16, 128)], ids=["m1", "m5-ragged-k", "m16"])
def test_fp8_skinny_matmul_on_grid_activations(dtype: torch.dtype, m: int, k: int) -> None:
    n = 40
    q, s = _weight(n, k, 1)
    x = grid_rows(m, k, dtype, 2, DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEV)
    qx, sx = quantize_fp8_rows(x)
    assert torch.equal(qx.float() * sx, x.float()), "the test's activations quantize exactly"
    ref = fp8_matmul_ref(x, q, s, bias)
    for config in (SMALL, None):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        y = fp8_skinny_matmul(x, q, s, bias, out=out, config=config)
        assert y is out
        # fp32: the scales apply after the sum here, before it in the reference (rounding of the fp32 sums)
        tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
        torch.testing.assert_close(y, ref, **tol)


def test_all_zero_token_keeps_a_finite_scale() -> None:
    q, s = _weight(24, 64, 4)
    x = torch.zeros(2, 64, device=DEV)
    y = fp8_skinny_matmul(x, q, s, config=SMALL)
    assert torch.equal(y, torch.zeros(2, 24, device=DEV))


BAD: dict[str, Any] = {
    "weight_dtype": lambda q, s: (q.float(), s),
    "weight_k": lambda q, s: (q[:, :-16].contiguous(), s),
    "scales_dtype": lambda q, s: (q, s.half()),
    "scales_size": lambda q, s: (q, s[:-1]),
    "weight_strided": lambda q, s: (q.t().contiguous().t(), s),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_fp8_launchers_reject_bad_weights(case: str) -> None:
    q, s = _weight(32, 64, 5)
    q, s = BAD[case](q, s)
    with pytest.raises(ValueError):
        fp8_skinny_matmul(torch.zeros(1, 64, device=DEV), q, s)


def test_fp8_skinny_refuses_more_than_16_rows() -> None:
    q, s = _weight(32, 64, 6)
    with pytest.raises(ValueError, match="M <= 16"):
        fp8_skinny_matmul(torch.zeros(17, 64, device=DEV), q, s)


# ---- sm_90 ahead of time, on the CPU --------------------------------------------------------------------------


def _sm90_compile() -> None:
    """Run in a subprocess with TRITON_INTERPRET=0: every prologue compiles for Hopper with an fp8 dot."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    import tokenmill.kernels.fp8_gemv as fg

    fn = fg._fp8_skinny_kernel
    names = list(fn.arg_names)
    for prologue, block_n, block_k in ((0, 64, 128), (1, 64, 128), (2, 64, 128), (1, 16, 256), (2, 16, 512)):
        # (16 rows x 256 / 512 columns: the default rule's M = 1 shapes for 1-byte weights, as the tl.dot variant)
        consts = {"PROLOGUE": prologue, "HAS_RESIDUAL": prologue == 1, "HAS_BIAS": True, "BLOCK_M": 16,
                  "BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": True, "STATS_BLOCK": 256, "EVEN_KS": True,
                  "NUM_STAGES": 3, "PDL": False}
        types = {"q_ptr": "*fp8e4nv", "ws_ptr": "*fp32"}
        sig = {a: "constexpr" if a in consts else types.get(a, "*bf16") if a.endswith("_ptr") else
               "fp32" if a == "eps" else "i32" for a in names}
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a.endswith("_ptr") or a == "K"}
        kernel = triton_compile(ASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}, attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        ttgir = str(kernel.asm["ttgir"])
        assert "f8E4M3FN" in ttgir and ("warp_group_dot" in ttgir or "tt.dot" in ttgir), f"{prologue=}: no fp8 dot"


@pytest.mark.slow
def test_fp8_kernel_compiles_for_hopper(tmp_path: Any) -> None:
    run_sm90_compile("test_fp8_gemv", "_sm90_compile", tmp_path)


# ---- CUDA, bf16: every entry point at Llama-3-8B's K -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_entry_points_in_bf16_on_the_gpu(m: int) -> None:
    k, n = 4096, 1024
    q, s = _weight(n, k, 7)
    gen = torch.Generator().manual_seed(8)
    h, res = (torch.randn(m, k, generator=gen).bfloat16().cuda() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).bfloat16().cuda()
    gu = torch.randn(m, 2 * k, generator=gen).bfloat16().cuda()

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert err(fp8_skinny_matmul(h, q, s), fp8_matmul_ref(h, q, s, None)) < 1e-2
    y, r = fp8_add_rmsnorm_matmul(h, res, nw, 1e-5, q, s)
    want_y, want_r = fp8_add_rmsnorm_matmul_ref(h, res, nw, 1e-5, q, s)
    assert err(y, want_y) < 1e-2 and torch.equal(r, want_r)
    assert err(fp8_silu_mul_matmul(gu, q, s), fp8_silu_mul_matmul_ref(gu, q, s)) < 1e-2
