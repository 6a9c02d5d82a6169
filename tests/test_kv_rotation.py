"""The Hadamard rotation of keys and values for an FP8 KV cache (worker/attention/kv_rotation.py,
EngineConfig.kv_cache_rotation): the matrix, both attention backends with it (exact over a float cache, less
e4m3 error over an fp8 one), the Triton backend against the torch one with it (prefill, decode-only and mixed
steps, float and fp8 caches, under the interpreter without CUDA), the config and the engine.

A rotation of the float caches goes through the backends' own `kv_rotation` (the internal hook): the user flag
needs --kv-cache-dtype fp8, which the CPU engine refuses.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
from test_fp8_kv import _outlier_kv, _rope_table
from test_kernels import rel_err
from test_quant_bad_input import DUMMY
from tiny_hf import save_tiny_model

from tokenmill.kernels.attention_ref import FP8_KV
from tokenmill.kernels.kv_cache import new_kv_cache
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata, KVCache
from tokenmill.worker.attention.kv_rotation import hadamard_rotation, kv_rotation_matrix, rotate, rotate_back
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
HQ, HKV, D, BS = 4, 2, 32, 8
FIRST = ([20, 7], [20, 7])  # the first step: two prompts
SECOND = {"prefill": [5, 3], "decode": [1, 1], "mixed": [1, 6]}  # the second step's query lengths


# ---- the matrix --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4, 16, 64, 128, 256])
def test_hadamard_is_orthonormal_and_symmetric(d: int) -> None:
    r = hadamard_rotation(d)
    assert r.shape == (d, d) and r.dtype == torch.float32
    torch.testing.assert_close(r @ r.T, torch.eye(d), rtol=0, atol=1e-6)
    assert torch.equal(r, r.T)
    assert bool((r.abs() == r.abs()[0, 0]).all()) and float(r.abs()[0, 0]) == pytest.approx(d**-0.5)
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(rotate_back(rotate(x, r), r), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("d", [0, 3, 12, 80, 96])
def test_other_head_dims_are_refused_naming_the_flag(d: int) -> None:
    with pytest.raises(ValueError, match=rf"^--kv-cache-rotation hadamard needs a power-of-two head dim; this "
                                         rf"model's is {d} \(use --kv-cache-rotation none\)$"):
        hadamard_rotation(d)


def test_none_is_no_matrix() -> None:
    assert kv_rotation_matrix("none", 12, DEV) is None
    assert torch.equal(kv_rotation_matrix("hadamard", 8, DEV), hadamard_rotation(8, DEV))  # type: ignore[arg-type]


# ---- two steps through a backend ---------------------------------------------------------------------------------


def _step(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, seed: int,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """q [T, HQ, D], keys and values [T, HKV, D], metadata and positions [T] of one step (request i owns blocks
    8i..8i+7). Llama-like: q and k have their outliers in the same channels, so a few channels carry the scores."""
    t = sum(query_lens)
    q = (_outlier_kv((t, HQ, D), torch.float32, seed) * 0.05).to(dtype)
    k, v = _outlier_kv((t, HKV, D), dtype, seed + 1), _outlier_kv((t, HKV, D), dtype, seed + 2)
    blocks = [list(range(i * 8, i * 8 + -(-s // BS))) for i, s in enumerate(seq_lens)]
    slots = [b[p // BS] * BS + p % BS for b, ql, sl in zip(blocks, query_lens, seq_lens) for p in range(sl - ql, sl)]
    positions = torch.tensor([p for ql, sl in zip(query_lens, seq_lens) for p in range(sl - ql, sl)], device=DEV)
    return q, k, v, attention_metadata(query_lens, seq_lens, blocks, slots, DEV), positions


def _two_steps(backend: AttentionBackend, cache_dtype: torch.dtype, dtype: torch.dtype, second: list[int],
               ) -> tuple[list[torch.Tensor], KVCache, AttentionLayer]:
    """The outputs of a first step of two prompts (calibrating an fp8 cache) and a second step with query lengths
    `second`, over a new cache; the cache and the layer (its kv_scales) after them."""
    layer = AttentionLayer(D**-0.5, None, _rope_table(D, 64), torch.ones(2, HKV, device=DEV))
    cache = new_kv_cache(16, BS, HKV, D, cache_dtype, DEV)
    outs = []
    for n, (ql, sl) in enumerate((FIRST, (second, [s + n for s, n in zip(FIRST[1], second)]))):
        q, k, v, meta, positions = _step(ql, sl, dtype, seed=10 * n)
        backend.calibrate_kv_scales = n == 0
        outs.append(backend.forward(layer, q.clone(), k.clone(), v, positions, cache, meta).float())
    backend.calibrate_kv_scales = False
    return outs, cache, layer


def _written(cache: KVCache) -> torch.Tensor:
    """The cache's keys [slots, HKV, D] as float32 (fp8 entries as they are, unscaled)."""
    return cache[0].float().flatten(0, 1)


@pytest.mark.parametrize("second", SECOND.values(), ids=SECOND.keys())
def test_torch_backend_rotation_is_exact_over_a_float_cache(second: list[int]) -> None:
    """Over a float32 cache the rotated backend's outputs are the unrotated one's (R orthonormal: q.k and the
    values' combination unchanged), while its cache holds the rotated keys and values."""
    r = hadamard_rotation(D, DEV)
    plain, plain_cache, _ = _two_steps(TorchRefBackend(), torch.float32, torch.float32, second)
    rotated, rotated_cache, _ = _two_steps(TorchRefBackend(r), torch.float32, torch.float32, second)
    for a, b in zip(plain, rotated):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for plain_entries, rotated_entries in zip(plain_cache, rotated_cache):
        torch.testing.assert_close(rotated_entries, rotate(plain_entries, r), rtol=1e-5, atol=1e-4)
        assert rel_err(rotated_entries, plain_entries) > 0.5


def test_rotation_only_of_keys_changes_the_output() -> None:
    """The check above fails when q is not rotated like k: it is what makes the scores unchanged."""
    r = hadamard_rotation(D, DEV)

    class KeysOnly(TorchRefBackend):  # rotates k (and v, out) but not q: what the test must catch
        def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
            return super().forward(layer, rotate_back(q, r), k, v, positions, kv_cache, meta)

    plain, _, _ = _two_steps(TorchRefBackend(), torch.float32, torch.float32, SECOND["mixed"])
    broken, _, _ = _two_steps(KeysOnly(r), torch.float32, torch.float32, SECOND["mixed"])
    assert all(rel_err(b, a) > 0.05 for a, b in zip(plain, broken))


def test_rotation_brings_an_fp8_cache_closer_to_float32() -> None:
    """Queries and keys with outliers in the same few channels (30x the rest): unrotated, the scores' e4m3 error
    is that of the few products that carry them; rotated, every channel carries an equal share, so the relative
    errors of the D products average out."""
    r = hadamard_rotation(D, DEV)
    truth, _, _ = _two_steps(TorchRefBackend(), torch.float32, torch.float32, SECOND["mixed"])
    plain, _, _ = _two_steps(TorchRefBackend(), FP8_KV, torch.float32, SECOND["mixed"])
    rotated, _, _ = _two_steps(TorchRefBackend(r), FP8_KV, torch.float32, SECOND["mixed"])
    for want, a, b in zip(truth, plain, rotated):
        assert rel_err(b, want) < 0.8 * rel_err(a, want), (rel_err(b, want), rel_err(a, want))


# ---- the Triton backend against the torch one --------------------------------------------------------------------


@pytest.mark.parametrize("second", SECOND.values(), ids=SECOND.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache", ["float", "fp8"])
def test_triton_backend_matches_torch_with_rotation(second: list[int], dtype: torch.dtype, cache: str) -> None:
    """A prefill step (calibrating an fp8 cache), then a chunked-prefill, decode-only (no fused rotary: it cannot
    rotate) or mixed step; both backends rotate. The same scales, cache entries within one rounding step of the
    element (rotary and rotation round once each, in both), close outputs."""
    _check_triton_against_torch(second, dtype, cache)


@gpu
@needs_cuda
@pytest.mark.parametrize("second", SECOND.values(), ids=SECOND.keys())
@pytest.mark.parametrize("cache", ["float", "fp8"])
def test_gpu_triton_backend_matches_torch_with_rotation_bf16(second: list[int], cache: str) -> None:
    _check_triton_against_torch(second, torch.bfloat16, cache)


def _check_triton_against_torch(second: list[int], dtype: torch.dtype, cache: str) -> None:
    r = hadamard_rotation(D, DEV)
    cache_dtype = FP8_KV if cache == "fp8" else dtype
    ours, our_cache, our_layer = _two_steps(TritonBackend(kv_rotation=r), cache_dtype, dtype, second)
    ref, ref_cache, ref_layer = _two_steps(TorchRefBackend(r), cache_dtype, dtype, second)
    assert torch.equal(our_layer.kv_scales, ref_layer.kv_scales)  # type: ignore[arg-type]
    # e4m3: 3 mantissa bits; bf16: 8; fp16 / fp32: one rounding within 2e-3
    step = 1 / 8 if cache == "fp8" else (1 / 128 if dtype == torch.bfloat16 else 2e-3)
    assert bool((_written(our_cache) - _written(ref_cache)).abs().le(_written(ref_cache).abs() * step + 1e-3).all())
    for a, b in zip(ours, ref):
        assert not a.isnan().any()
        assert rel_err(a, b) < (5e-3 if cache == "fp8" or dtype == torch.bfloat16 else 2e-3)


def test_triton_decode_with_rotation_does_not_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rotated decode path stays graph safe: no .item() / .tolist() (host syncs)."""
    backend = TritonBackend(kv_rotation=hadamard_rotation(D, DEV))
    layer = AttentionLayer(D**-0.5, None, _rope_table(D, 64))
    cache = new_kv_cache(16, BS, HKV, D, torch.float32, DEV)
    q, k, v, meta, positions = _step([1, 1], [9, 17], torch.float32, seed=3)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in TritonBackend.forward")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    out = backend.forward(layer, q, k, v, positions, cache, meta)
    monkeypatch.undo()
    assert out.shape == q.shape and not out.isnan().any()


# ---- config and engine -------------------------------------------------------------------------------------------


def test_config_refuses_a_rotation_without_an_fp8_cache() -> None:
    with pytest.raises(ValueError, match=r"^--kv-cache-rotation hadamard changes only an fp8 KV cache's rounding: "
                                         r"use it with --kv-cache-dtype fp8, or --kv-cache-rotation none$"):
        EngineConfig(kv_cache_rotation="hadamard")
    with pytest.raises(ValueError, match=r"^unknown kv_cache_rotation 'random'; use none or hadamard$"):
        EngineConfig(kv_cache_dtype="fp8", kv_cache_rotation="random")  # type: ignore[arg-type]
    assert EngineConfig(kv_cache_dtype="fp8", kv_cache_rotation="hadamard").kv_cache_rotation == "hadamard"
    assert EngineConfig().kv_cache_rotation == "none"


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 77], [9, 4], list(range(30, 70))]


def test_engine_rotation_over_a_float_cache_keeps_greedy_tokens(tmp_path: Path) -> None:
    """A tiny HF Llama (head dim 16) on the CPU engine, its backend given the rotation (the internal hook): the
    same greedy tokens as without, prompts and decode steps alike, while the cache holds rotated keys."""
    folder = save_tiny_model("llama", tmp_path)
    config = EngineConfig(model=str(folder), device="cpu", max_model_len=256)
    plain, rotated = LLMEngine(config), LLMEngine(config)
    rotated.runner.backend.kv_rotation = hadamard_rotation(rotated.runner.arch.head_dim)
    assert _greedy(rotated, PROMPTS, 12) == _greedy(plain, PROMPTS, 12)
    plain_keys, rotated_keys = plain.runner.kv_caches[0][0], rotated.runner.kv_caches[0][0]
    assert rel_err(rotated_keys, plain_keys) > 0.5  # the same tokens, rotated keys


def test_engine_builds_the_rotation_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the device check lifted (the CPU engine refuses fp8): the flag gives the backend its matrix, the first
    step calibrates, and the tokens are mostly the dense cache's."""
    import tokenmill.worker.model_runner as mr

    monkeypatch.setattr(mr, "check_kv_cache_dtype", lambda dtype, device: None)
    cache = CacheConfig(cpu_kv_bytes=64 * 8192)
    dense = LLMEngine(EngineConfig(**DUMMY, cache=cache))  # type: ignore[arg-type]
    fp8 = LLMEngine(EngineConfig(**DUMMY, cache=cache, kv_cache_dtype="fp8",  # type: ignore[arg-type]
                                 kv_cache_rotation="hadamard"))
    assert dense.runner.backend.kv_rotation is None
    assert torch.equal(fp8.runner.backend.kv_rotation, hadamard_rotation(fp8.runner.arch.head_dim))  # type: ignore
    want, got = _greedy(dense, PROMPTS[:1], 8)[0], _greedy(fp8, PROMPTS[:1], 8)[0]
    assert bool((fp8.runner.model.model.layers[0].self_attn.spec.kv_scales != 1.0).any())
    assert sum(a == b for a, b in zip(want, got)) >= 6, (want, got)


def test_engine_refuses_a_head_dim_that_is_not_a_power_of_two(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.worker.model_runner as mr

    monkeypatch.setattr(mr, "check_kv_cache_dtype", lambda dtype, device: None)
    folder = save_tiny_model("llama", tmp_path, hidden_size=48)  # 4 heads of 12
    with pytest.raises(ModelLoadError, match=r"^--kv-cache-rotation hadamard needs a power-of-two head dim; this "
                                             r"model's is 12"):
        LLMEngine(EngineConfig(model=str(folder), device="cpu", kv_cache_dtype="fp8", kv_cache_rotation="hadamard"))


@gpu
@needs_cuda
def test_gpu_engine_fp8_kv_cache_with_rotation() -> None:
    """A CUDA engine with an fp8 cache and the rotation, decode, piecewise and whole-step CUDA graphs on (the
    calibrating first step eager): the greedy tokens of the same engine without graphs and of the torch backend
    (most sequences identical; bf16 ties may flip a few)."""
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 16, 17, 40, 100) * 4]
    tokens = {}
    for backend, graphs in (("triton", True), ("triton", False), ("torch", False)):
        engine = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", dtype="bfloat16", device="cuda",
                                        attention_backend=backend, cuda_graphs=graphs, kv_cache_dtype="fp8",
                                        kv_cache_rotation="hadamard",
                                        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=32)))
        assert engine.runner.backend.kv_rotation is not None
        tokens[backend, graphs] = _greedy(engine, prompts, 16)
        del engine
    for other in (("triton", False), ("torch", False)):
        same = sum(a == b for a, b in zip(tokens["triton", True], tokens[other]))
        assert same >= len(prompts) // 2, (other, same)
