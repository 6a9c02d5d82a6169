"""GGUF Q8_0 / Q4_0 / Q4_1 run from their blocks (worker/quant/gguf.py): the repacked layout keeps ggml's bits
(dequantized it equals gguf.quants' own dequantization, bit for bit), and the Triton kernels that run it (the
skinny split-K and fused decode kernels of kernels/quant_gemv.py, the tiled kernel of kernels/quant_gemm.py; Q4_1
through their `mins` path) match the torch reference (the weight dequantized in fp32, rounded once to the
activations' dtype, then F.linear).

Without CUDA the kernels run under the Triton interpreter in fp16 / fp32 on small shapes (K = 160: five blocks
and, with BLOCK_K = 64, a K tail; N = 40: a partial row tile); outputs go to NaN-poisoned buffers. The bf16
test needs a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf.quants
import numpy as np
import pytest
from test_quant_kernels import DEV, DTYPES, _tol, _x

import tokenmill.kernels.quant_gemv as qv
from tokenmill.kernels.gemv import SkinnyConfig
from tokenmill.kernels.quant_gemm import GemmConfig, quant_matmul
from tokenmill.kernels.quant_weight import PackedWeight, check_packed, dequantize_packed, quant_matmul_ref
from tokenmill.kernels.tuned import QuantSkinnyConfig
from tokenmill.worker.models.layers import Linear
from tokenmill.worker.quant.gguf import BLOCK_BYTES, NATIVE_TYPES, GgufLinearMethod, repack_blocks

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
QTYPES = sorted(NATIVE_TYPES)
DOT = SkinnyConfig(block_n=16, block_k=64, num_warps=4, num_stages=2)
FMA = SkinnyConfig(block_n=8, block_k=64, num_warps=4, num_stages=2, use_dot=False)
EVEN = SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)  # K = 160 = 5 x 32: no masks
PLANES = QuantSkinnyConfig(block_n=8, block_k=64, num_warps=4, num_stages=2, use_dot=False, planes=True)
TILE = GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2)
K, N = 160, 40


def dense(n: int, k: int, seed: int) -> np.ndarray:
    """A float32 weight [n, k] with y = x @ W.T of O(1) for unit-normal x; an offset per row (Q4_1's min)."""
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((n, k)) + rng.standard_normal((n, 1))) / k**0.5).astype(np.float32)


def gguf_layer(qtype: str, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[Linear, np.ndarray]:
    """A Linear holding ggml's own blocks of a random weight (quantized by gguf.quants, repacked) and the blocks."""
    blocks = gguf.quants.quantize(dense(n, k, seed), NATIVE_TYPES[qtype])
    layer = Linear(k, n, False, GgufLinearMethod(qtype), dtype=dtype, device=DEV)
    for name, t in repack_blocks(torch.from_numpy(blocks).to(DEV), qtype).items():
        layer.method.load_weight(layer, name, t, None)
    return layer, blocks


def packed(layer: Linear) -> PackedWeight:
    w = layer.method.packed(layer)  # type: ignore[attr-defined]
    assert isinstance(w, PackedWeight)
    return w


def _poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("qtype", QTYPES)
def test_repacked_blocks_keep_ggml_bits(qtype: str) -> None:
    """Dequantizing the repacked tensors gives gguf.quants' dequantization of the file's blocks exactly, and the
    layer holds no more bytes than the blocks (scales and mins are the blocks' fp16 values, not a rounding)."""
    layer, blocks = gguf_layer(qtype, N, K, torch.float32)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, NATIVE_TYPES[qtype]))
    w = packed(layer)
    check_packed(w, DEV)
    assert torch.equal(dequantize_packed(w).cpu(), expected)
    held = sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.mins) if t is not None)
    assert held == blocks.nbytes == N * K // 32 * BLOCK_BYTES[qtype]


def test_hand_packed_q4_1_block_reaches_the_kernel_in_order() -> None:
    """One Q4_1 row packed by hand (independent of gguf.quants): element j < 16 in the low nibble of byte j, 16 + j
    in its high nibble, W = d * q + m; x = one-hot columns read each weight back through the skinny kernel."""
    lo, hi = np.arange(16, dtype=np.uint8), np.arange(15, -1, -1, dtype=np.uint8)
    raw = np.concatenate([np.array([2.0, -3.0], dtype=np.float16).view(np.uint8), lo | (hi << 4)])
    layer = Linear(32, 1, False, GgufLinearMethod("q4_1"), dtype=torch.float32, device=DEV)
    for name, t in repack_blocks(torch.from_numpy(raw[None]).to(DEV), "q4_1").items():
        layer.method.load_weight(layer, name, t, None)
    eye = torch.eye(32, device=DEV)  # two launches of 16 rows (the skinny kernel's most)
    got = torch.cat([qv.quant_skinny_matmul(eye[:16], packed(layer), config=DOT),
                     qv.quant_skinny_matmul(eye[16:], packed(layer), config=DOT)])
    expected = 2.0 * np.concatenate([lo, hi]).astype(np.float32) - 3.0
    torch.testing.assert_close(got[:, 0].cpu(), torch.from_numpy(expected), atol=0, rtol=0)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_skinny_matches_reference(qtype: str, dtype: torch.dtype, m: int) -> None:
    layer, _ = gguf_layer(qtype, N, K, dtype, seed=m)
    w, x = packed(layer), _x((m, K), dtype, seed=10 + m)
    ref = quant_matmul_ref(x, w)
    configs = [DOT, EVEN] + ([FMA, PLANES] if m == 1 else [])
    for cfg in configs:
        got = qv.quant_skinny_matmul(x, w, out=_poisoned(m, N, dtype), config=cfg)
        torch.testing.assert_close(got, ref, **_tol(dtype), msg=f"{cfg}")
    torch.testing.assert_close(layer.method.apply(layer, x), ref, **_tol(dtype))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_prologues_match_reference(qtype: str, dtype: torch.dtype) -> None:
    """The fused decode entry points (residual add + RMSNorm -> matmul, SwiGLU -> matmul) of the method."""
    layer, _ = gguf_layer(qtype, N, K, dtype, seed=3)
    w, m = packed(layer), 3
    h, res = _x((m, K), dtype, 1), _x((m, K), dtype, 2)
    norm_w = (1 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(4))).to(dtype).to(DEV)
    y, r = layer.method.apply_add_rmsnorm(layer, h, res, norm_w, 1e-6)  # type: ignore[misc]
    y_ref, r_ref = qv.quant_add_rmsnorm_matmul_ref(h, res, norm_w, 1e-6, w)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(r, r_ref, atol=0, rtol=0)
    y2, _ = qv.quant_add_rmsnorm_matmul(h, None, norm_w, 1e-6, w, config=DOT)
    torch.testing.assert_close(y2, qv.quant_add_rmsnorm_matmul_ref(h, None, norm_w, 1e-6, w)[0], **_tol(dtype))

    down, _ = gguf_layer(qtype, N, K, dtype, seed=5)
    gu = _x((m, 2 * K), dtype, 6)
    got = down.method.apply_silu_mul(down, gu)
    assert got is not None
    torch.testing.assert_close(got, qv.quant_silu_mul_matmul_ref(gu, packed(down)), **_tol(dtype))
    got = qv.quant_silu_mul_matmul(gu, packed(down), out=_poisoned(m, N, dtype), config=DOT)
    torch.testing.assert_close(got, qv.quant_silu_mul_matmul_ref(gu, packed(down)), **_tol(dtype))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_matches_reference(qtype: str, dtype: torch.dtype) -> None:
    layer, _ = gguf_layer(qtype, N, K, dtype, seed=7)
    w, x = packed(layer), _x((37, K), dtype, 8)
    bias = _x((N,), dtype, 9)
    got = quant_matmul(x, w, bias, out=_poisoned(37, N, dtype), config=TILE)
    torch.testing.assert_close(got, quant_matmul_ref(x, w, bias), **_tol(dtype))


def test_bad_blocks_and_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="does not run natively"):
        GgufLinearMethod("q4_k")
    with pytest.raises(ValueError, match=r"uint8 \[N, blocks \* 20\]"):
        repack_blocks(torch.zeros(4, 30, dtype=torch.uint8), "q4_1")
    with pytest.raises(ValueError, match="uint8"):
        repack_blocks(torch.zeros(4, 34, dtype=torch.int8), "q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        Linear(48, 8, False, GgufLinearMethod("q8_0"), dtype=torch.float32)
    layer, _ = gguf_layer("q4_1", N, K, torch.float32)
    w = packed(layer)
    x = _x((1, K), torch.float32, 0)
    bad = {
        "mins_shape": PackedWeight(w.qweight, w.scales, None, None, 4, 32, w.scales[:, :2].contiguous()),
        "mins_dtype": PackedWeight(w.qweight, w.scales, None, None, 4, 32, w.scales.to(torch.int16)),
        "mins_with_zeros": PackedWeight(w.qweight, w.scales, torch.zeros_like(w.scales, dtype=torch.uint8), None,
                                        4, 32, w.mins),
    }
    for pw in bad.values():
        with pytest.raises(ValueError, match="mins"):
            qv.quant_skinny_matmul(x, pw)
        with pytest.raises(ValueError, match="mins"):
            quant_matmul(x, pw)
    with pytest.raises(ValueError, match=r"dtype torch.float32, the gguf format stores torch.int32"):
        layer.method.load_weight(layer, "qweight", torch.zeros(N, K // 8), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 8, 64])
def test_bf16_on_gpu(qtype: str, m: int) -> None:
    """bf16 (which the interpreter gets wrong): the method's own dispatch (skinny up to 16 rows, tiled above),
    Llama-shaped K = 4096."""
    layer, _ = gguf_layer(qtype, 512, 4096, torch.bfloat16, seed=m)
    x = _x((m, 4096), torch.bfloat16, m)
    ref = quant_matmul_ref(x.float(), packed(layer))
    got = layer.method.apply(layer, x)
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)
    if m <= 16:
        torch.testing.assert_close(layer.forward_skinny(x).float(), ref, atol=3e-2, rtol=2e-2)
