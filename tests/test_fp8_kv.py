"""FP8 (e4m3) KV cache: the KV-write, fused rotary + KV-write and paged-attention kernels against the torch
references (kernels/attention_ref.py), the calibration of the per-head scales, both attention backends, the
engine's block count, and bad input.

Without CUDA the kernels run under the Triton interpreter (fp16 / fp32 queries). The interpreter's float8 cast
rounds unlike the GPU's, which is why the kernels quantize on the bits (kernels/kv_cache.py, quantize_e4m3): the
bit-exact checks below hold the kernels to torch's `.to(torch.float8_e4m3fn)`. It also reads e4m3 NaN as 480, so
slots no request owns are poisoned with 448 (the largest e4m3 value) instead of NaN: a stray read shifts the output
far beyond the tolerances. GPU tests (@pytest.mark.gpu) run bf16 at realistic shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
from typing import Any

import pytest
from test_kernels import Batch, make_batch, rel_err
from test_quant_bad_input import DUMMY

from tokenmill.kernels.attention_ref import (
    FP8_KV,
    paged_attention_ref,
    quantize_kv_fp8,
    read_kv,
    rotary_embedding_ref,
    write_kv_cache_ref,
)
from tokenmill.kernels.kv_cache import new_kv_cache, write_kv_cache
from tokenmill.kernels.paged_attention import DecodeRope, PagedAttentionConfig, paged_attention
from tokenmill.kernels.rotary import cos_sin_cache_from_inv_freq, rotary_and_cache
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.attention.backend import AttentionLayer
from tokenmill.worker.attention.kv_scales import HEADROOM, calibrate, pow2_scales
from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.attention.triton_backend import TritonBackend
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError
from tokenmill.worker.model_runner import attention_metadata

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
SMALL = PagedAttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
POISON = 448.0  # e4m3's largest value: unused slots (see the module docstring)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _rope_table(head_dim: int, max_position: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=DEV) / head_dim))
    return cos_sin_cache_from_inv_freq(inv_freq, max_position)


def _scales(num_kv_heads: int, seed: int = 0) -> torch.Tensor:
    """[2, Hkv] powers of two from 2^-6 to 2^2, different per head."""
    gen = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-6, 3, (2, num_kv_heads), generator=gen).float()).to(DEV)


def _outlier_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Llama-like keys: per-head magnitudes 10x apart and a few channels 30x the rest."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=DEV)
    x *= torch.logspace(-1, 0, shape[-2], device=DEV)[:, None]
    x[..., :3] *= 30.0
    return x.to(dtype)


def fp8_batch(batch: Batch, scales: torch.Tensor) -> Batch:
    """`batch` with its caches quantized to e4m3 by scales [2, Hkv]; its NaN (unused) slots become POISON."""

    def quant(cache: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x = quantize_kv_fp8(cache.float().nan_to_num(0.0), s)
        poison = torch.full_like(x.float(), POISON).to(FP8_KV)
        return torch.where(cache.isnan(), poison.view(torch.uint8), x.view(torch.uint8)).view(FP8_KV)

    return dataclasses.replace(batch, k_cache=quant(batch.k_cache, scales[0]), v_cache=quant(batch.v_cache, scales[1]))


def dim_major(v_cache: torch.Tensor) -> torch.Tensor:
    """The same [num_blocks, block_size, Hkv, D] values stored dim-major inside each block (the kernels take V's
    strides)."""
    nb, bs, h, d = v_cache.shape
    out = torch.empty((nb, h, d, bs), dtype=v_cache.dtype, device=v_cache.device).permute(0, 3, 1, 2)
    out.copy_(v_cache)
    assert out.stride(1) == 1
    return out


def _make_fp8_batch(query_lens: list[int], seq_lens: list[int], hq: int, hkv: int, d: int, bs: int,
                    dtype: torch.dtype) -> tuple[Batch, torch.Tensor]:
    scales = _scales(hkv)
    batch = make_batch(query_lens, seq_lens, hq, hkv, d, bs, dtype)
    # values of each head's own magnitude (~40 of its scale): the kernel must apply the scale of the right head
    kmag, vmag = (40.0 * scales[i][:, None] for i in (0, 1))  # [Hkv, 1]
    k_cache, v_cache = (batch.k_cache * kmag).to(dtype), (batch.v_cache * vmag).to(dtype)
    batch = dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache)
    return fp8_batch(batch, scales), scales


# ---- quantization: bit for bit ------------------------------------------------------------------------------


def test_write_kv_cache_rounds_like_torch() -> None:
    """Every fp16 value on a grid through ties, subnormals and saturation, at scale 1 and per-head scales."""
    grid = torch.arange(-69632, 69632, dtype=torch.float32) * 2.0**-14  # ties of every e4m3 binade up to 4.25
    wide = torch.randn(2 * 69632, generator=torch.Generator().manual_seed(0)) * 300.0  # beyond +-448 as well
    x = torch.cat([grid, wide, grid * 2.0**-8]).to(torch.float16).reshape(-1, 4, 256).to(DEV)
    n = x.shape[0]
    for scales in (torch.ones(2, 4, device=DEV), _scales(4)):
        kc = torch.zeros((n, 1, 4, 256), dtype=FP8_KV, device=DEV)
        vc, kr, vr = kc.clone(), kc.clone(), kc.clone()
        slots = torch.arange(n, device=DEV)
        write_kv_cache(x, x.flip(0), kc, vc, slots, scales)
        write_kv_cache_ref(x, x.flip(0), kr, vr, slots, scales)
        assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))
    assert float(kc.float().abs().max()) == 448.0  # saturated, not NaN


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_write_kv_cache_fp8_slots_and_heads(dtype: torch.dtype) -> None:
    t, hkv, d, nb, bs = 13, 3, 32, 5, 8
    k, v = _outlier_kv((t, hkv, d), dtype, 1), _outlier_kv((t, hkv, d), dtype, 2)
    slots = torch.randperm(nb * bs)[:t].to(DEV)
    slots[[1, 9]] = -1
    scales = torch.ones(2, hkv, device=DEV)
    calibrate(k, v, scales)  # per-head powers of two: nothing saturates
    kc = torch.full((nb, bs, hkv, d), 7.0, device=DEV).to(FP8_KV)
    vc, kr, vr = dim_major(kc), kc.clone(), kc.clone()
    write_kv_cache(k, v, kc, vc, slots, scales)
    write_kv_cache_ref(k, v, kr, vr, slots, scales)
    assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))
    assert int((kc.float() != 7.0).any(-1).any(-1).sum()) == t - 2  # the written slots, and only those
    flat = read_kv(kc.flatten(0, 1), slots[slots >= 0], scales[0])
    torch.testing.assert_close(flat, k[slots >= 0].float(), rtol=1 / 16, atol=float(scales[0].max()) * 2**-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotary_and_cache_fp8(dtype: torch.dtype) -> None:
    """The cache holds quantize_kv_fp8 of the rotated k the kernel leaves in memory (rounded to k's dtype) and of v;
    q / k rotation as the bf16 path."""
    t, hq, hkv, d, nb, bs = 10, 4, 2, 64, 4, 8
    q, k, v = (_outlier_kv((t, h, d), dtype, s) for s, h in ((3, hq), (4, hkv), (5, hkv)))
    cos_sin = _rope_table(d, 512)
    positions = torch.randint(0, 512, (t,), device=DEV)
    slots = torch.randperm(nb * bs)[:t].to(DEV)
    slots[3] = -1
    scales = _scales(hkv, 1)
    kc, vc = new_kv_cache(nb, bs, hkv, d, FP8_KV, DEV)
    vc = dim_major(vc)  # the kernel writes through V's strides
    kr, vr = kc.clone(), kc.clone()
    q_ref, k_ref = rotary_embedding_ref(q, k, cos_sin, positions)
    rotary_and_cache(q, k, v, cos_sin, positions, kc, vc, slots, scales)
    write_kv_cache_ref(k, v, kr, vr, slots, scales)  # k: rotated in place by the kernel
    assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))
    tol: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-3}
    torch.testing.assert_close(k, k_ref, **tol)
    torch.testing.assert_close(q, q_ref, **tol)


# ---- paged attention over fp8 caches --------------------------------------------------------------------------


def _check(batch: Batch, scales: torch.Tensor, *, num_splits: int | None = None,
           config: PagedAttentionConfig | None = None, window: int | None = None, tol: float = 2e-3) -> None:
    scale = batch.q.shape[-1] ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(*batch.args(), scale, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                    sliding_window=window, out=out, num_splits=num_splits, config=config, kv_scales=scales)
    ref = paged_attention_ref(*batch.args(), scale, sliding_window=window, kv_scales=scales)
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol, rel_err(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_fp8(dtype: torch.dtype, num_splits: int | None) -> None:
    batch, scales = _make_fp8_batch([1] * 4, [15, 16, 17, 33], 8, 2, 32, 8, dtype)
    _check(batch, scales, num_splits=num_splits)
    _check(dataclasses.replace(batch, v_cache=dim_major(batch.v_cache)), scales, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_prefill_and_mixed_fp8(num_splits: int) -> None:
    """Multi-token tiles (the dynamic-shape kernels), a chunk after a cached prefix, decodes beside it."""
    batch, scales = _make_fp8_batch([5, 1, 20, 1], [30, 17, 20, 9], 4, 2, 32, 8, torch.float16)
    _check(batch, scales, num_splits=num_splits, config=SMALL)


def test_sliding_window_fp8() -> None:
    batch, scales = _make_fp8_batch([3, 1], [40, 25], 4, 1, 32, 8, torch.float16)
    _check(batch, scales, window=9, config=SMALL)


def test_attention_reads_the_scales() -> None:
    """Swapping two heads' scales changes the kernel's output as it changes the reference's."""
    batch, scales = _make_fp8_batch([1, 1], [20, 9], 4, 2, 32, 8, torch.float32)
    swapped = scales.flip(1).contiguous()
    assert not torch.equal(swapped, scales)
    _check(batch, swapped)
    scale = 32**-0.5
    a = paged_attention(*batch.args(), scale, max_query_len=1, max_seq_len=20, kv_scales=scales)
    b = paged_attention(*batch.args(), scale, max_query_len=1, max_seq_len=20, kv_scales=swapped)
    assert rel_err(a, b) > 0.05


@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_rope_fp8(num_splits: int | None) -> None:
    """paged_attention(rope=...) writes the cache bytes rotary_and_cache writes, and attends as the unfused path."""
    seq_lens, hq, hkv, d, bs, dtype = [1, 17, 40, 16], 4, 2, 64, 16, torch.float16
    batch, scales = _make_fp8_batch([1] * 4, seq_lens, hq, hkv, d, bs, dtype)
    k, v = _outlier_kv((4, hkv, d), dtype, 7), _outlier_kv((4, hkv, d), dtype, 8)
    cos_sin = _rope_table(d, max(seq_lens) + 1)
    positions = torch.tensor([s - 1 for s in seq_lens], device=DEV)
    bt = batch.block_tables.cpu()
    slots = torch.tensor([int(bt[i, (s - 1) // bs]) * bs + (s - 1) % bs for i, s in enumerate(seq_lens)])
    slots[1] = -1
    slots = slots.to(DEV)
    kc_ref, vc_ref, q_ref = batch.k_cache.clone(), batch.v_cache.clone(), batch.q.clone()
    rotary_and_cache(q_ref, k.clone(), v, cos_sin, positions, kc_ref, vc_ref, slots, scales)
    kw: dict[str, Any] = {"max_query_len": 1, "max_seq_len": max(seq_lens), "num_splits": num_splits,
                          "kv_scales": scales}
    scale = d**-0.5
    ref = paged_attention(q_ref, kc_ref, vc_ref, *batch.args()[3:], scale, **kw)
    out = paged_attention(*batch.args(), scale, rope=DecodeRope(k, v, cos_sin, positions, slots), **kw)
    assert torch.equal(_bits(batch.k_cache), _bits(kc_ref)) and torch.equal(_bits(batch.v_cache), _bits(vc_ref))
    assert rel_err(out, ref) < 2e-3


def test_fp8_cache_bad_input() -> None:
    batch, scales = _make_fp8_batch([1], [9], 4, 2, 32, 8, torch.float32)
    kw: dict[str, Any] = {"max_query_len": 1, "max_seq_len": 9}
    with pytest.raises(ValueError, match="needs kv_scales"):
        paged_attention(*batch.args(), 1.0, **kw)
    with pytest.raises(ValueError, match=r"kv_scales must be a contiguous \[2, 2\] float32"):
        paged_attention(*batch.args(), 1.0, kv_scales=scales[:, :1], **kw)
    with pytest.raises(ValueError, match="kv_scales must be"):
        paged_attention(*batch.args(), 1.0, kv_scales=scales.half(), **kw)
    dense = make_batch([1], [9], 4, 2, 32, 8, torch.float32)
    with pytest.raises(ValueError, match="kv_scales are for"):
        paged_attention(*dense.args(), 1.0, kv_scales=scales, **kw)
    k = torch.zeros((1, 2, 32), device=DEV)
    with pytest.raises(ValueError, match="needs kv_scales"):
        write_kv_cache(k, k, batch.k_cache, batch.v_cache, torch.zeros(1, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="dtypes differ"):
        write_kv_cache(k, k, batch.k_cache, dense.v_cache, torch.zeros(1, dtype=torch.long, device=DEV), scales)
    strided = torch.zeros((*batch.v_cache.shape[:3], 64), dtype=FP8_KV, device=DEV)[..., ::2]  # neither layout
    with pytest.raises(ValueError, match="v_cache must be contiguous in its head dim or in its block's slots"):
        paged_attention(batch.q, batch.k_cache, strided, *batch.args()[3:], 1.0, kv_scales=scales, **kw)
    with pytest.raises(ValueError, match="v_cache must be contiguous in its head dim or in its block's slots"):
        write_kv_cache(k, k, batch.k_cache, strided, torch.zeros(1, dtype=torch.long, device=DEV), scales)


# ---- calibration and backends ----------------------------------------------------------------------------------


def test_pow2_scales_leave_headroom() -> None:
    amax = torch.tensor([0.0, 1e-3, 1.0, 223.9, 224.0, 224.1, 5000.0])
    s = pow2_scales(amax)
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # powers of two
    ratio = amax[1:] * HEADROOM / s[1:]
    assert bool((ratio <= 448.0).all() and (ratio > 224.0).all())  # the smallest such power
    assert float(s[0]) > 0.0


def _step(query_lens: list[int], seq_lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor]:
    t = sum(query_lens)
    q = torch.randn((t, hq, d), generator=torch.Generator(device=DEV).manual_seed(11), device=DEV).to(dtype) * 0.3
    k, v = _outlier_kv((t, hkv, d), dtype, 12), _outlier_kv((t, hkv, d), dtype, 13)
    blocks = [list(range(i * 8, i * 8 + -(-s // bs))) for i, s in enumerate(seq_lens)]
    slots = [b[p // bs] * bs + p % bs for b, ql, sl in zip(blocks, query_lens, seq_lens) for p in range(sl - ql, sl)]
    meta = attention_metadata(query_lens, seq_lens, blocks, slots, DEV)
    positions = torch.tensor([p for ql, sl in zip(query_lens, seq_lens) for p in range(sl - ql, sl)], device=DEV)
    return q, k, v, meta, positions


@pytest.mark.parametrize("query_lens", [[12, 5], [1, 1]])
def test_backends_agree_and_calibrate(query_lens: list[int]) -> None:
    """A first (calibrating) prefill step, then a second step (decode: rotary fused into attention), on both
    backends with fp8 caches: the same scales, cache bytes within one e4m3 step (rotation rounding), close outputs;
    and the fp8 outputs are close to those over a float32 cache (the quantization error, per-head scales)."""
    hq, hkv, d, bs, dtype = 4, 2, 32, 8, torch.float16
    table = _rope_table(d, 64)
    layers = [AttentionLayer(d**-0.5, None, table, torch.ones(2, hkv, device=DEV)) for _ in range(3)]
    shape = (16, bs, hkv, d)
    caches = [new_kv_cache(*shape, dt, DEV) for dt in (FP8_KV, FP8_KV, torch.float32)]
    backends = [TritonBackend(), TorchRefBackend(), TorchRefBackend()]
    for step, (ql, sl) in enumerate((([20, 7], [20, 7]), (query_lens, [s + n for s, n in zip([20, 7], query_lens)]))):
        q, k, v, meta, positions = _step(ql, sl, hq, hkv, d, bs, dtype)
        outs = []
        for be, layer, cache in zip(backends, layers, caches):
            be.calibrate_kv_scales = step == 0
            outs.append(be.forward(layer, q.clone(), k.clone(), v, positions, cache, meta).float())
        assert torch.equal(layers[0].kv_scales, layers[1].kv_scales)
        assert bool((layers[0].kv_scales != 1.0).any())
        assert bool((caches[0][0].float() - caches[1][0].float()).abs().le(caches[1][0].float().abs() / 8).all())
        assert torch.equal(_bits(caches[0][1]), _bits(caches[1][1]))
        assert rel_err(outs[0], outs[1]) < 5e-3
        assert rel_err(outs[1], outs[2]) < 0.1  # e4m3: 3 mantissa bits (outlier keys sharpen the softmax)


def test_unscaled_fp8_fails_on_outlier_keys() -> None:
    """Why scales: keys of ~1000 saturate an unscaled e4m3 cache; the calibrated per-head scale keeps them."""
    k = _outlier_kv((50, 2, 32), torch.float32, 21) * 40.0
    scales = torch.ones(2, 2)
    calibrate(k, k, scales)
    unscaled = quantize_kv_fp8(k, torch.ones(2)).float()
    scaled = quantize_kv_fp8(k, scales[0]).float() * scales[0][:, None]
    assert rel_err(unscaled, k) > 0.2
    assert rel_err(scaled, k) < 0.05


# ---- the engine --------------------------------------------------------------------------------------------------


def test_cpu_engine_refuses_fp8_kv_cache() -> None:
    """One line naming the flag, the device and what to use instead (test_quant_bad_input: a serving engine keeps
    serving beside the refused one)."""
    with pytest.raises(ModelLoadError, match=r"^--kv-cache-dtype fp8 needs a GPU with FP8 tensor cores [^\n]* "
                                             r"Use --kv-cache-dtype auto \(the model dtype\)$"):
        LLMEngine(EngineConfig(**DUMMY, kv_cache_dtype="fp8"))  # type: ignore[arg-type]


def test_engine_with_fp8_cache_doubles_blocks_and_calibrates(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the device check lifted (the CPU engine refuses fp8), the runner's wiring on the torch backend: 1 byte
    per entry instead of 4 (float32 on the CPU; bf16's 2 on a GPU), so 4x the blocks in the same bytes, scales
    set by the first step, and mostly the greedy tokens of the dense cache."""
    import tokenmill.worker.model_runner as mr

    monkeypatch.setattr(mr, "check_kv_cache_dtype", lambda dtype, device: None)
    cache = CacheConfig(cpu_kv_bytes=64 * 8192)  # 64 float32 blocks of tiny-llama: far below the useful-blocks cap
    engines = {dt: LLMEngine(EngineConfig(**DUMMY, kv_cache_dtype=dt, cache=cache))  # type: ignore[arg-type]
               for dt in ("auto", "fp8")}
    dense, fp8 = engines["auto"].runner, engines["fp8"].runner
    assert fp8.kv_caches[0][0].dtype == FP8_KV
    assert dense.bytes_per_block == 8192 and fp8.bytes_per_block == 2048  # float32 on the CPU, e4m3
    assert (dense.num_blocks, fp8.num_blocks) == (64, 256)
    assert engines["fp8"].blocks.num_blocks == 256  # the block manager holds them all
    layer = fp8.model.model.layers[0].self_attn.spec
    assert bool((layer.kv_scales == 1.0).all())
    outs = {dt: _greedy(e, [5, 17, 99, 3, 42, 8, 61, 77], 8) for dt, e in engines.items()}
    assert bool((layer.kv_scales != 1.0).any())  # calibrated by the first step
    same = sum(a == b for a, b in zip(outs["auto"], outs["fp8"]))
    assert same >= 6, outs


def _greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return list(engine.generate([prompt], params)[0].token_ids)


def test_gpu_quant_fp8_kv_check_runs() -> None:
    """benchmarks/gpu_quant.py's FP8 KV check at Llama-3-8B head shapes on tiny contexts (fp16: the interpreter)."""
    from tokenmill.benchmarks.gpu_quant import fp8_kv_case

    r = fp8_kv_case([1, 3], [20, 9], DEV, torch.float16 if not HAS_CUDA else torch.bfloat16)
    assert r["rel_err_vs_reference"] < 1e-2 and 0.0 < r["rel_err_vs_bf16_cache"] < 0.1


# ---- GPU (bf16) ---------------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("case", ["decode", "long_split", "mixed"])
def test_gpu_fp8_attention_bf16(case: str) -> None:
    shapes = {"decode": ([1] * 64, [1024 + 97 * i for i in range(64)]), "long_split": ([1, 1], [32768, 20001]),
              "mixed": ([512, 1, 1, 300], [2560, 3000, 17, 300])}
    ql, sl = shapes[case]
    batch, scales = _make_fp8_batch(ql, sl, 32, 8, 128, 16, torch.bfloat16)
    _check(batch, scales, tol=1e-2)


@gpu
@needs_cuda
def test_gpu_fp8_writes_bit_exact_bf16() -> None:
    t, hq, hkv, d = 300, 32, 8, 128
    q, k, v = (_outlier_kv((t, h, d), torch.bfloat16, s) for s, h in ((1, hq), (2, hkv), (3, hkv)))
    cos_sin = _rope_table(d, 4096)
    positions = torch.randint(0, 4096, (t,), device=DEV)
    slots = torch.randperm(40 * 16, device=DEV)[:t]
    scales = _scales(hkv)
    kc, vc = new_kv_cache(40, 16, hkv, d, FP8_KV, DEV)
    kr, vr = kc.clone(), kc.clone()
    rotary_and_cache(q, k, v, cos_sin, positions, kc, vc, slots, scales)
    write_kv_cache_ref(k, v, kr, vr, slots, scales)
    assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))
    write_kv_cache(k, v, kc, vc, slots.flip(0), scales)
    write_kv_cache_ref(k, v, kr, vr, slots.flip(0), scales)
    assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))


@gpu
@needs_cuda
def test_gpu_engine_fp8_kv_cache() -> None:
    """A CUDA engine with an fp8 cache (decode and piecewise CUDA graphs, the calibrating first step eager): half
    the bytes per block, calibrated scales, and the greedy tokens of the torch backend reading the same kind of
    cache (most sequences identical; bf16 ties may flip a few)."""
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 16, 17, 40, 100) * 4]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend, kv in (("triton", "auto"), ("triton", "fp8"), ("torch", "fp8")):
        engine = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", dtype="bfloat16", device="cuda",
                                        attention_backend=backend, kv_cache_dtype=kv,  # type: ignore[arg-type]
                                        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=32)))
        tokens[backend, kv] = [o.token_ids for o in engine.generate(prompts, params)]
        if kv == "fp8":
            assert engine.runner.kv_caches[0][0].dtype == FP8_KV
            assert bool((engine.runner.model.model.layers[0].self_attn.spec.kv_scales != 1.0).any())
        del engine
    same = sum(a == b for a, b in zip(tokens["triton", "fp8"], tokens["torch", "fp8"]))
    assert same >= len(prompts) // 2, same
