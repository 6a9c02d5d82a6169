"""The quantized LinearMethods (worker/quant/), their quantizers (round to nearest, GPTQ), the checkpoint layouts
(written by worker/quant/export.py and `tokenmill quantize`, read by worker/loader/quantized.py) and online
quantization at load, on tiny models on the CPU (fused decode kernels under the Triton interpreter, float32)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_hf import save_tiny_model

from tokenmill.cli.main import main
from tokenmill.kernels.quant_weight import FP8, PackedWeight, dequantize_packed, quantize_fp8_rows, unpack_int4
from tokenmill.protocol import SamplingParams
from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.attention.triton_backend import TritonBackend
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import build_model, resolve_model
from tokenmill.worker.loader.dummy import dummy_arch
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.models.layers import Linear, RotaryEmbedding
from tokenmill.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.worker.quant.config import QuantConfig, make_linear_method
from tokenmill.worker.quant.export import write_folder
from tokenmill.worker.quant.fp8 import Fp8LinearMethod, fp8_matmul_ref
from tokenmill.worker.quant.gptq import Hessian, gptq_quantize, gptq_quantize_fp8
from tokenmill.worker.quant.int4 import Int4LinearMethod
from tokenmill.worker.quant.int8 import Int8LinearMethod
from tokenmill.worker.quant.packed import PackedLinearMethod
from tokenmill.worker.quant.quantizer import gptq_quantize_model, rtn_quantize_model
from tokenmill.worker.quant.rtn import quantize_int4, quantize_int8

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
CPU = torch.device("cpu")


# ---- quantizers ------------------------------------------------------------------------------------------------


def test_rtn_int8_error_is_at_most_half_a_step() -> None:
    w = torch.randn(32, 100)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (32, 1) and int(q.abs().max()) <= 127
    assert bool(((q.float() * s - w).abs() <= s / 2 + 1e-7).all())


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_int4_error_is_at_most_half_a_step_with_a_ragged_last_group(symmetric: bool) -> None:
    w = torch.randn(16, 96) + (0.0 if symmetric else 0.7)
    q, s, z = quantize_int4(w, 64, symmetric, torch.float32)  # groups of 64 and 32
    assert s.shape == z.shape == (16, 2) and int(q.max()) <= 15
    if symmetric:
        assert bool((z == 8).all())
    per_col = s.repeat_interleave(64, 1)[:, :96]
    err = ((q.float() - z.float().repeat_interleave(64, 1)[:, :96]) * per_col - w).abs()
    assert bool((err <= per_col / 2 + 1e-6).all())


def _correlated_inputs(k: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k) * torch.rand(k, generator=gen) * 3
    return torch.randn(tokens, k, generator=gen) @ mix


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_the_layer_output(act_order: bool) -> None:
    k, n = 128, 48
    x = _correlated_inputs(k, 2048, 0)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) / k**0.5
    h = Hessian(k)
    h.add(x)
    r = gptq_quantize(w, h.value(), 32, True, act_order, torch.float32, block_size=64)
    assert (r.perm is not None) == act_order
    perm = None if r.perm is None else r.perm.to(torch.int32)
    from tokenmill.kernels.quant_weight import pack_int4

    gptq_w = dequantize_packed(PackedWeight(pack_int4(r.q), r.scales, None, perm, 4, 32))
    q, s, _ = quantize_int4(w, 32, True, torch.float32)
    rtn_w = dequantize_packed(PackedWeight(pack_int4(q), s, None, None, 4, 32))
    err_gptq, err_rtn = float(((gptq_w - w) @ x.T).norm()), float(((rtn_w - w) @ x.T).norm())
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    if act_order:  # groups are runs of 32 packed columns, in descending diag(H) order
        d = torch.diag(h.value())[r.perm]
        assert bool((d[:-1] >= d[1:]).all())


def test_fp8_gptq_keeps_the_grid_and_beats_round_to_nearest_on_the_layer_output() -> None:
    k, n = 128, 48
    x = _correlated_inputs(k, 2048, 2)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) / k**0.5
    h = Hessian(k)
    h.add(x)
    q, s = gptq_quantize_fp8(w, h.value(), block_size=64)
    rtn_q, rtn_s = quantize_fp8_rows(w)
    assert q.dtype == FP8 and q.shape == w.shape and torch.equal(s, rtn_s)  # the per-row scales of plain FP8
    err_gptq = float(((q.float() * s - w) @ x.T).norm())
    err_rtn = float(((rtn_q.float() * rtn_s - w) @ x.T).norm())
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    # the columns come back in the input's order: with H = I (no correlations) GPTQ is round to nearest
    eye = torch.eye(k)
    assert torch.equal(gptq_quantize_fp8(w, eye * 2.0, damp=1e-6)[0].float(), rtn_q.float())


# ---- methods ------------------------------------------------------------------------------------------------------


def _methods() -> dict[str, PackedLinearMethod]:
    return {"int8": Int8LinearMethod(), "int4": Int4LinearMethod(32), "int4-zp": Int4LinearMethod(64, False)}


@pytest.mark.parametrize("name", sorted(_methods()))
def test_method_quantize_load_and_apply(name: str) -> None:
    method = _methods()[name]
    layer = Linear(96, 40, True, method, dtype=torch.float32)
    w, b = torch.randn(40, 96) / 10, torch.randn(40)
    for suffix, t in method.quantize(w).items():
        method.load_weight(layer, suffix, t, None)
    method.load_weight(layer, "bias", b, None)
    dense = dequantize_packed(method.packed(layer))
    assert (dense - w).abs().max() < (0.01 if name == "int8" else 0.1)
    x = torch.randn(5, 3, 96)
    torch.testing.assert_close(layer(x), x @ dense.T + b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.forward_skinny(x[0]), x[0] @ dense.T + b, atol=1e-5, rtol=1e-5)  # kernel


def test_load_weight_refuses_wrong_dtype_shape_and_unequal_shared_parts() -> None:
    method = Int4LinearMethod(32, act_order=True)
    layer = Linear(64, 16, False, method, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"dtype torch\.float32, the int4 format stores torch\.int32"):
        method.load_weight(layer, "qweight", torch.zeros(16, 8), None)
    with pytest.raises(ValueError, match=r"shape \(8, 8\), expected \(16, 8\)"):
        method.load_weight(layer, "qweight", torch.zeros(8, 8, dtype=torch.int32), None)
    perm = torch.randperm(64).to(torch.int32)
    method.load_weight(layer, "perm", perm, (0, 8))
    method.load_weight(layer, "perm", perm, (8, 16))  # the same for the second part: fine
    with pytest.raises(ValueError, match="differs between the parts"):
        method.load_weight(layer, "perm", torch.arange(64, dtype=torch.int32), (0, 8))


def test_fp8_is_refused_without_fp8_and_emulated_on_request() -> None:
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*the cpu device has none"):
        Fp8LinearMethod(CPU)
    method = Fp8LinearMethod(CPU, emulate=True)
    layer = Linear(64, 32, False, method, dtype=torch.float32)
    w = torch.randn(32, 64) / 8
    for suffix, t in method.quantize(w).items():
        method.load_weight(layer, suffix, t, None)
    x = torch.randn(4, 64)
    y = layer(x)
    assert torch.equal(y, fp8_matmul_ref(x, cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales),
                                         None))
    rel = float((y - x @ w.T).norm() / (x @ w.T).norm())
    assert 1e-3 < rel < 0.08, rel  # e4m3 has 3 mantissa bits: visibly rounded, still close


def test_fp8_few_token_matmuls_take_the_fused_kernel_only_when_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """KernelConfig.fp8_skinny off (the default): the fused-prologue entry points fold the norm / SwiGLU into the
    activation quantization (kernels/fp8_quant.py) before torch._scaled_mm; on: they launch kernels/fp8_gemv.py's
    whole-matmul kernels; the emulation declines (the caller runs the unfused path)."""
    import tokenmill.kernels.fp8_gemv as fg
    import tokenmill.kernels.fp8_quant as fq
    import tokenmill.worker.quant.fp8 as fp8
    from tokenmill.kernels.config import KernelConfig, configure

    monkeypatch.setattr(fp8, "require_fp8", lambda *a: None)  # the CPU has no FP8: only the routing is tested
    calls: list[str] = []
    monkeypatch.setattr(fg, "fp8_add_rmsnorm_matmul", lambda *a, **k: calls.append("norm") or (a[0], a[0]))
    monkeypatch.setattr(fg, "fp8_silu_mul_matmul", lambda *a, **k: calls.append("silu") or a[0])
    monkeypatch.setattr(fq, "fp8_add_rmsnorm_quantize", lambda h, *a: calls.append("q-norm") or (h, h, h))
    monkeypatch.setattr(fq, "fp8_silu_mul_quantize", lambda g: calls.append("q-silu") or (g, g))
    monkeypatch.setattr(fp8.Fp8LinearMethod, "_matmul_quantized", staticmethod(lambda *a: calls.append("mm") or a[0]))
    method = Fp8LinearMethod(CPU)
    layer = Linear(64, 32, False, method, dtype=torch.float32)
    h = torch.randn(1, 64)
    try:
        assert method.apply_add_rmsnorm(layer, h, None, torch.ones(64), 1e-6) is not None
        assert method.apply_silu_mul(layer, torch.randn(1, 128)) is not None
        assert calls == ["q-norm", "mm", "q-silu", "mm"]
        calls.clear()
        configure(KernelConfig(fp8_skinny=True))
        assert method.apply_add_rmsnorm(layer, h, None, torch.ones(64), 1e-6) is not None
        assert method.apply_silu_mul(layer, torch.randn(1, 128)) is not None and calls == ["norm", "silu"]
        assert Fp8LinearMethod(CPU, emulate=True).apply_silu_mul(layer, torch.randn(1, 128)) is None
        assert Fp8LinearMethod(CPU, emulate=True).apply_add_rmsnorm(layer, h, None, torch.ones(64), 1e-6) is None
    finally:
        configure(KernelConfig())


def _int4_decoder_layer(seed: int) -> tuple[LlamaDecoderLayer, LlamaDecoderLayer]:
    """A qwen2 (qkv bias) decoder layer with INT4 act-order zero-point projections, and its dense twin holding
    the dequantized weights."""
    arch = dummy_arch("tiny-qwen2")
    assert arch is not None
    rope = RotaryEmbedding(arch.head_dim, 256, arch.rope_theta, arch.rope_scaling)
    method = Int4LinearMethod(32, False, act_order=True)
    layer = LlamaDecoderLayer(arch, TritonBackend(), rope, method, torch.float32)
    twin = LlamaDecoderLayer(arch, TritonBackend(), rope, None, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    ours = dict(layer.named_modules())
    for name, module in twin.named_modules():
        if isinstance(module, Linear):
            q = ours[name]
            k = module.input_size
            perm = torch.randperm(k, generator=gen).to(torch.int32)
            tensors = Int4LinearMethod(32, False).quantize(torch.randn(module.output_size, k, generator=gen) / 8)
            q.method.load_weight(q, "perm", perm, None)
            for suffix, t in tensors.items():
                q.method.load_weight(q, suffix, t, None)
            module.weight.data.copy_(dequantize_packed(cast(Int4LinearMethod, q.method).packed(q)))
            if module.bias is not None:
                module.bias.data.normal_(generator=gen)
                q.bias.data.copy_(module.bias)
        elif hasattr(module, "weight"):
            module.weight.data.normal_(1.0, 0.1, generator=gen)
            ours[name].weight.data.copy_(module.weight)
    return layer, twin


def test_int4_decoder_layer_fused_decode_path_matches_the_dense_twin() -> None:
    """The batch-1 decode path through the INT4 method's fused kernels (norm -> qkv, o, norm -> gate_up,
    SwiGLU -> down) gives the dense layer's numbers."""
    layer, twin = _int4_decoder_layer(0)
    meta = attention_metadata([1], [21], [[2, 0]], [4], CPU)
    positions = torch.tensor([20])
    gen = torch.Generator().manual_seed(1)
    h, residual = torch.randn(1, 64, generator=gen), torch.randn(1, 64, generator=gen)
    shape = (3, 16, 2, 16)
    cache = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    ours, dense = (cache[0].clone(), cache[1].clone()), (cache[0].clone(), cache[1].clone())
    got = layer._forward_skinny(positions, h, residual, ours, meta)
    want = twin(positions, h, residual, dense, meta)
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer(positions, h, residual, (cache[0].clone(), cache[1].clone()), meta)[0],
                               want[0], atol=1e-4, rtol=1e-4)  # CPU tensors: the unfused torch path


# ---- online quantization in the engine -----------------------------------------------------------------------


def _greedy(quantization: str, model: str = "tiny-llama", load_format: str = "dummy") -> tuple[list[int], Any]:
    engine = LLMEngine(EngineConfig(model=model, load_format=load_format, device="cpu", max_model_len=256,  # type: ignore[arg-type]
                                    quantization=quantization))  # type: ignore[arg-type]
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return list(out[0].token_ids), engine


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_quantizes_on_load_and_serves(quantization: str) -> None:
    dense, _ = _greedy("auto")
    ids, engine = _greedy(quantization)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.method.name == quantization and not hasattr(qkv, "weight")
    assert engine.runner.model.lm_head is None or engine.runner.model.lm_head.method.name == "none"
    assert len(ids) == 6
    if quantization == "int8":  # dummy weights are small: INT8 keeps the greedy tokens of the dense model
        assert ids == dense


# ---- checkpoints ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("qwen2-bias", tmp_path_factory.mktemp("hf"))  # qkv bias, untied head


def _dense(path: Path) -> LlamaForCausalLM:
    return build_model(resolve_model(str(path)), TorchRefBackend(), CPU, torch.float32)


def _projection_weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Every decoder-layer projection's weight in input column order, float32 (dequantized if quantized)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name.startswith("model.layers."):
            method = m.method
            if isinstance(method, PackedLinearMethod):
                out[name] = dequantize_packed(cast(PackedWeight, method.packed(m)))
            elif method.name == "fp8":
                out[name] = cast(torch.Tensor, m.qweight).float() * cast(torch.Tensor, m.scales)
            else:
                out[name] = cast(torch.Tensor, m.weight).float()
    return out


LAYOUTS = [("gptq", QuantConfig("int4", 32)), ("gptq", QuantConfig("int4", 64, False, True)),
           ("awq", QuantConfig("int4", 32, False)), ("compressed-tensors", QuantConfig("int4", 32)),
           ("compressed-tensors", QuantConfig("int4", 64, False, True)), ("compressed-tensors", QuantConfig("int8")),
           ("compressed-tensors", QuantConfig("fp8"))]


@pytest.mark.parametrize(("fmt", "config"), LAYOUTS, ids=lambda v: v if isinstance(v, str) else v.describe())
def test_checkpoint_layouts_round_trip_exactly(tiny_hf: Path, tmp_path: Path, fmt: str, config: QuantConfig) -> None:
    """Canonical tensors -> a checkpoint in `fmt` -> the loader: the same weights, bit for bit. Act-order configs
    get a random column order (what GPTQ's would be)."""
    model = _dense(tiny_hf)
    canonical = rtn_quantize_model(model, QuantConfig(config.method, config.group_size, config.symmetric))
    if config.act_order:
        _permute(canonical, config.group_size)
    write_folder(tmp_path, model, canonical, config, fmt, torch.float32, json.loads((tiny_hf / "config.json")
                 .read_text()), tiny_hf)
    source = resolve_model(str(tmp_path))
    assert source.quant is not None and source.quant.config == config
    loaded = build_model(source, TorchRefBackend(), CPU, torch.float32, fp8_emulation=config.method == "fp8")
    method = make_linear_method(config, CPU, fp8_emulation=True)
    want = LlamaForCausalLM(model.arch, TorchRefBackend(), dtype=torch.float32, device=CPU, linear_method=method)
    from tokenmill.worker.loader.quantized import is_projection

    dense_rest = ((n, t) for n, t in _hf_state(tiny_hf) if not (is_projection(n) and n.endswith(".weight")))
    want.load_weights([*dense_rest, *((f"{n}.{s}", t) for n, ts in canonical.items() for s, t in ts.items())])
    got, ref = _projection_weights(loaded), _projection_weights(want)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    x = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    torch.testing.assert_close(_logits(loaded, x), _logits(want, x))


def _hf_state(path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(str(path / "model.safetensors")).items())


def _permute(canonical: dict[str, dict[str, torch.Tensor]], group_size: int) -> None:
    """Give each fused input a random column order (shared by its parts), as act-order GPTQ would."""
    from tokenmill.kernels.quant_weight import pack_int4

    perms: dict[str, torch.Tensor] = {}
    for name, t in canonical.items():
        key = name.rsplit(".", 1)[0] + ("qkv" if "self_attn" in name and "o_proj" not in name else
                                        "gu" if "gate" in name or "up_proj" in name else name)
        q = unpack_int4(t["qweight"])
        perm = perms.setdefault(key, torch.randperm(q.shape[1], generator=torch.Generator().manual_seed(len(perms))))
        t["qweight"] = pack_int4(q[:, perm])  # the same values, stored in the order perm (scales unchanged)
        t["perm"] = perm.to(torch.int32)


def _logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    n = ids.numel()
    a = model.arch
    caches = [(torch.zeros(1, 16, a.num_kv_heads, a.head_dim), torch.zeros(1, 16, a.num_kv_heads, a.head_dim))
              for _ in range(a.num_layers)]
    meta = attention_metadata([n], [n], [[0]], list(range(n)), CPU)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), caches, meta))


def test_gptq_model_quantizer_and_cli_round_trip(tiny_hf: Path, tmp_path: Path) -> None:
    """`tokenmill quantize --gptq --act-order` writes a GPTQ checkpoint whose weights equal the quantizer's (run
    again in-process on the same calibration), not RTN's; `tokenmill generate` serves it."""
    from tokenmill.cli.quantize import quantize

    base: dict[str, Any] = dict(model=str(tiny_hf), load_format="auto", method="int4", group_size=32,
                                asymmetric=False, calibration="sharegpt", num_calibration=4, calibration_tokens=64,
                                format=None, dtype="float32", true_sequential=False, damp=0.01, clip=None)
    seqs = [[(7 * i + 3 * j) % 380 + 2 for j in range(48)] for i in range(6)]
    import tokenmill.cli.quantize as cq

    original = cq.calibration_ids
    cq.calibration_ids = lambda _tok, _args: seqs  # type: ignore[assignment]  # no ShareGPT download in a unit test
    try:
        import argparse

        quantize(argparse.Namespace(**base, gptq=True, act_order=True, out=str(tmp_path / "gptq")))
    finally:
        cq.calibration_ids = original  # type: ignore[assignment]
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["desc_act"], cfg["group_size"]) == ("gptq", True, 32)
    loaded = _dense(tmp_path / "gptq")
    model = _dense(tiny_hf)
    canonical = gptq_quantize_model(model, QuantConfig("int4", 32, act_order=True), seqs)
    got = _projection_weights(loaded)
    assert all(torch.equal(got[k], w) for k, w in _projection_weights(model).items())  # model holds the GPTQ weights
    assert all("perm" in t for t in canonical.values())
    rtn = _projection_weights(_rtn(tiny_hf))
    assert all(not torch.equal(got[k], rtn[k]) for k in rtn)  # GPTQ's rounding is not the nearest one
    assert main(["generate", "hello", "--model", str(tmp_path / "gptq"), "--max-tokens", "3", "--device", "cpu"]) == 0


def test_fp8_gptq_checkpoint_holds_the_quantizers_weights(tiny_hf: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenmill quantize --method fp8 --gptq` writes a compressed-tensors FP8 checkpoint whose e4m3 weights and
    scales are gptq_quantize_model's on the same calibration, not round to nearest's (the same scales)."""
    import argparse

    import tokenmill.cli.quantize as cq

    seqs = [[(5 * i + 3 * j) % 380 + 2 for j in range(48)] for i in range(6)]
    monkeypatch.setattr(cq, "calibration_ids", lambda _tok, _args: seqs)  # no ShareGPT download in a unit test
    cq.quantize(argparse.Namespace(model=str(tiny_hf), load_format="auto", method="fp8", group_size=128,
                                   asymmetric=False, calibration="sharegpt", num_calibration=4, calibration_tokens=64,
                                   format=None, dtype="float32", true_sequential=False, damp=0.01, clip=None,
                                   gptq=True, act_order=False, out=str(tmp_path / "fp8")))
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    loaded = build_model(resolve_model(str(tmp_path / "fp8")), TorchRefBackend(), CPU, torch.float32,
                         fp8_emulation=True)
    canonical = gptq_quantize_model(_dense(tiny_hf), QuantConfig("fp8"), seqs)
    rtn = rtn_quantize_model(_dense(tiny_hf), QuantConfig("fp8"))
    layer = cast(LlamaDecoderLayer, loaded.model.layers[0])
    q_loaded = cast(torch.Tensor, layer.self_attn.o_proj.qweight).float()
    ours, nearest = canonical["model.layers.0.self_attn.o_proj"], rtn["model.layers.0.self_attn.o_proj"]
    assert torch.equal(q_loaded, ours["qweight"].float()) and torch.equal(ours["scales"], nearest["scales"])
    assert not torch.equal(ours["qweight"].float(), nearest["qweight"].float())


def _rtn(path: Path) -> LlamaForCausalLM:
    return build_model(resolve_model(str(path)), TorchRefBackend(), CPU, torch.float32, "int4")


def test_compressed_tensors_packing_matches_the_library() -> None:
    """Our int4 pack-quantized layout (weights along K, zero points along N) is compressed-tensors' own, where
    that library is installed (it is not a dependency)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from tokenmill.kernels.quant_weight import pack_int4

    v = torch.randint(-8, 8, (24, 64), dtype=torch.int8)
    assert torch.equal(helpers.pack_to_int32(v, 4), pack_int4(v.int() + 8))
    zp = torch.randint(-8, 8, (24, 3), dtype=torch.int8)
    assert torch.equal(helpers.pack_to_int32(zp, 4, packed_dim=0), pack_int4((zp.int() + 8).t().contiguous()).t())
