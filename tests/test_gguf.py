"""GGUF files run from their blocks or dequantized on load (worker/loader/gguf_loader.py, worker/quant/gguf.py):
which one `gguf_native` picks, the native model against the dequantized one, the memory it holds, the errors,
and the K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 dequantized through the gguf library on load.

The native kernels themselves are tested in tests/test_gguf_kernels.py; on the CPU the native method computes
through its torch reference (dequantize in fp32, then F.linear), so the native and dequantized models agree
to rounding here.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernels are imported (tests/test_gguf_kernels.py runs them)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_loader import (
    CPU,
    PROMPT,
    TINY,
    hf_state_to_gguf,
    logits_for,
    random_hf_model,
    to_gguf_name,
    write_gguf,
)
from transformers import LlamaConfig, Qwen2Config

from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.loader import ModelLoadError, build_model, gguf_loader, resolve_model
from tokenmill.worker.loader import gguf_native_method as choose
from tokenmill.worker.models.layers import Linear
from tokenmill.worker.models.llama import LlamaForCausalLM
from tokenmill.worker.quant.gguf import GgufLinearMethod

CUDA = torch.device("cuda")  # gguf_native_method only looks at the device type: no GPU needed
QTYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}


MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def projection_names(num_layers: int) -> list[str]:
    return [to_gguf_name(f"model.layers.{i}.{m}.weight") for i in range(num_layers) for m in MODULES]


def tiny_gguf(tmp_path: Path, arch: str, types: dict[str, Q], seed: int = 0) -> Path:
    config = LlamaConfig(**TINY) if arch == "llama" else Qwen2Config(**TINY)
    state = hf_state_to_gguf(random_hf_model(config, seed), arch, 4, 2)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, TINY, state, types)
    return path


def all_projections(qtype: Q) -> dict[str, Q]:
    return {n: qtype for n in projection_names(TINY["num_hidden_layers"])}


def projection_layers(model: LlamaForCausalLM) -> list[Linear]:
    return [m for name, m in model.named_modules() if isinstance(m, Linear) and name.startswith("model.layers.")]


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "q4_0"), ("llama", "q4_1"), ("llama", "q8_0"),
                                             ("qwen2", "q4_1")])
def test_native_model_matches_the_dequantized_one(tmp_path: Path, arch: str, qtype: str) -> None:
    """llama: the Q/K rows of the block tensors are un-permuted like dense ones; qwen2: q/k/v biases (F32) load
    beside the blocks. The layers hold the blocks' bytes and no dense weight."""
    types = {**all_projections(QTYPES[qtype]), "token_embd.weight": Q.Q8_0}
    path = tiny_gguf(tmp_path, arch, types)
    source = resolve_model(str(path))
    native = build_model(source, TorchRefBackend(), CPU, torch.float32, gguf_native="on")
    dense = build_model(source, TorchRefBackend(), CPU, torch.float32, gguf_native="off")
    layers = projection_layers(native)
    assert len(layers) == 4 * TINY["num_hidden_layers"]
    for layer in layers:
        assert isinstance(layer.method, GgufLinearMethod) and layer.method.qtype == qtype
        assert not hasattr(layer, "weight")
    held = sum(t.numel() * t.element_size() for layer in layers for name, t in layer.named_parameters()
               if name != "bias")
    reader = gguf_loader.open_gguf(path)
    assert held == sum(int(t.data.nbytes) for t in reader.tensors if t.name in types and t.name.startswith("blk."))
    assert all(m.method.name == "none" for m in projection_layers(dense))
    ours, expected = logits_for(native, PROMPT), logits_for(dense, PROMPT)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert expected.abs().max() > 0.1  # a real model, not zeros


def test_auto_is_native_on_cuda_and_dequantized_on_cpu(tmp_path: Path) -> None:
    source = resolve_model(str(tiny_gguf(tmp_path, "llama", all_projections(Q.Q4_1))))
    method = choose(source, "auto", "auto", CUDA)
    assert isinstance(method, GgufLinearMethod) and method.qtype == "q4_1"
    assert choose(source, "auto", "auto", CPU) is None
    assert choose(source, "auto", "off", CUDA) is None
    assert choose(source, "int8", "auto", CUDA) is None  # online quantization of the dequantized weights
    with pytest.raises(ModelLoadError, match="cannot also quantize them to int8"):
        choose(source, "int8", "on", CUDA)
    dummy = resolve_model("tiny-llama", "dummy")
    assert choose(dummy, "auto", "on", CUDA) is None  # the setting is about GGUF files
    assert build_model(dummy, TorchRefBackend(), CPU, torch.float32, gguf_native="on").linear_method is None


def test_mixed_or_other_types_are_dequantized_or_refused(tmp_path: Path) -> None:
    types = {**all_projections(Q.Q4_0), "blk.1.attn_v.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.F16}
    source = resolve_model(str(tiny_gguf(tmp_path, "llama", types)))
    assert choose(source, "auto", "auto", CUDA) is None
    with pytest.raises(ModelLoadError, match=r"one of Q8_0, Q4_0, Q4_1; the file has 1 x F16, 12 x Q4_0, 1 x Q8_0"):
        choose(source, "auto", "on", CUDA)
    with pytest.raises(ModelLoadError, match="unknown gguf_native 'yes'"):
        choose(source, "auto", "yes", CUDA)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown gguf_native"):
        EngineConfig(gguf_native="native")  # type: ignore[arg-type]


# ---------------------------------------------------------------- K-quants, dequantized on load

KQ = dict(zip(MODULES, (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q4_K)))
WIDE: dict[str, Any] = dict(TINY, hidden_size=256, intermediate_size=512, num_hidden_layers=1)


def random_kquant_rows(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks [rows, cols / 256 * bytes]: random bits, finite fp16 super-block scales."""
    _, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    scales = (rng.random((blocks.shape[0], 2)) * 0.02 + 0.002).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ... scales int8 [16] | d fp16
        blocks[:, -2:] = scales[:, :2]
    else:  # d fp16 | dmin fp16 | ...
        blocks[:, :4] = scales
    return blocks.reshape(rows, -1)


def kquant_state(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Q]]:
    """A one-layer WIDE llama: GGUF-named tensors (the projections as raw K-quant blocks) and their types."""
    h, inter = WIDE["hidden_size"], WIDE["intermediate_size"]
    state = {"token_embd.weight": rng.standard_normal((WIDE["vocab_size"], h)).astype(np.float32) / 16,
             "output_norm.weight": np.ones(h, dtype=np.float32)}
    shapes = [(h, h), (h // 2, h), (h // 2, h), (h, h), (inter, h), (inter, h), (h, inter)]  # [out, in]
    types = {}
    for module, (rows, cols) in zip(MODULES, shapes):
        name = to_gguf_name(f"model.layers.0.{module}.weight")
        types[name] = KQ[module]
        state[name] = random_kquant_rows(KQ[module], rows, cols, rng)
    for norm in ("attn_norm", "ffn_norm"):
        state[f"blk.0.{norm}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    return state, types


def test_kquants_dequantize_through_the_gguf_library(tmp_path: Path) -> None:
    """A file of Q4_K / Q5_K / Q6_K projections loads dequantized (gguf.quants; Q/K rows un-permuted) and gives
    the logits of an F32 file holding the same dequantized values; native execution is never picked for it."""
    state, types = kquant_state(np.random.default_rng(0))
    kpath, fpath = tmp_path / "k.gguf", tmp_path / "f32.gguf"
    write_gguf(kpath, "llama", WIDE, state, types)
    dequantized = {n: gguf.quants.dequantize(a, types[n]) if n in types else a for n, a in state.items()}
    write_gguf(fpath, "llama", WIDE, dequantized, {})

    source = resolve_model(str(kpath))
    assert gguf_loader.projection_types(gguf_loader.open_gguf(kpath)) == {"Q4_K": 3, "Q5_K": 2, "Q6_K": 2}
    assert choose(source, "auto", "auto", CUDA) is None
    with pytest.raises(ModelLoadError, match="2 x Q5_K"):
        choose(source, "auto", "on", CUDA)
    loaded = dict(source.iter_weights(CPU, torch.float32))
    v = torch.from_numpy(dequantized["blk.0.attn_v.weight"])
    torch.testing.assert_close(loaded["model.layers.0.self_attn.v_proj.weight"], v, atol=0, rtol=0)
    q = gguf_loader.unpermute_qk(torch.from_numpy(dequantized["blk.0.attn_q.weight"]), WIDE["num_attention_heads"])
    torch.testing.assert_close(loaded["model.layers.0.self_attn.q_proj.weight"], q, atol=0, rtol=0)

    ours = logits_for(build_model(source, TorchRefBackend(), CPU, torch.float32), PROMPT)
    expected = logits_for(build_model(resolve_model(str(fpath)), TorchRefBackend(), CPU, torch.float32), PROMPT)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert expected.std() > 1e-3


def test_q5_0_and_q5_1_dequantize_through_the_gguf_library(tmp_path: Path) -> None:
    """A qwen2 file with Q5_0 and Q5_1 tensors (as llama.cpp's Q4_K_M writes for rows that are not a multiple of
    256) loads dequantized, the embedding too, and gives the logits of an F32 file of the same values; native
    execution is never picked for it."""
    q5 = {n: (Q.Q5_0 if i % 2 else Q.Q5_1) for i, n in enumerate(projection_names(TINY["num_hidden_layers"]))}
    types = {**q5, "token_embd.weight": Q.Q5_0}
    qpath = tiny_gguf(tmp_path, "qwen2", types)
    source = resolve_model(str(qpath))
    assert choose(source, "auto", "auto", CUDA) is None
    raw = {t.name: t for t in gguf_loader.open_gguf(qpath).tensors}
    loaded = dict(source.iter_weights(CPU, torch.float32))
    v_name = next(n for n in q5 if "attn_v" in n)
    v = gguf.quants.dequantize(raw[v_name].data, q5[v_name]).reshape(loaded[
        "model.layers.0.self_attn.v_proj.weight"].shape)
    torch.testing.assert_close(loaded["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(v), atol=0, rtol=0)

    dequantized = {n: gguf.quants.dequantize(t.data, types[n]) if n in types else np.array(t.data)
                   for n, t in raw.items()}
    fdir = tmp_path / "f32"
    fdir.mkdir()
    fpath = fdir / "f32.gguf"
    write_gguf(fpath, "qwen2", TINY, {n: a.reshape(tuple(reversed(raw[n].shape.tolist()))).astype(np.float32)
                                      for n, a in dequantized.items()}, {})
    ours = logits_for(build_model(source, TorchRefBackend(), CPU, torch.float32), PROMPT)
    expected = logits_for(build_model(resolve_model(str(fpath)), TorchRefBackend(), CPU, torch.float32), PROMPT)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert expected.std() > 1e-3


def test_q5_0_block_follows_the_ggml_spec() -> None:
    """One hand-packed Q5_0 block (independent of gguf.quants): d fp16 | qh uint32 | qs [16]; element j < 16 is
    the low nibble of qs[j] with bit j of qh as its fifth bit, element j + 16 the high nibble with bit j + 16;
    W = d * (q - 16)."""
    d = np.array([0.5], dtype=np.float16).view(np.uint8)
    q = (np.arange(32) * 7) % 32  # every 5-bit value, scattered
    qh = np.array([sum(int(q[j] >> 4) << j for j in range(32))], dtype="<u4").view(np.uint8)
    qs = ((q[:16] & 15) | ((q[16:] & 15) << 4)).astype(np.uint8)
    got = gguf.quants.dequantize(np.concatenate([d, qh, qs])[None], Q.Q5_0).reshape(32)
    np.testing.assert_array_equal(got, 0.5 * (q.astype(np.float32) - 16))


def test_q4_k_block_follows_the_ggml_spec() -> None:
    """One hand-packed Q4_K super-block (independent of gguf.quants): 8 sub-blocks of 32 with 6-bit scales and
    mins, W = d * sc * q - dmin * m; qs byte 32c + j holds element 64c + j (low nibble) and 64c + 32 + j (high)."""
    header = np.array([1.0, 0.5], dtype=np.float16).view(np.uint8)  # d, dmin
    scales = np.array([1] * 4 + [2] * 4 + [0x21] * 4, dtype=np.uint8)  # sc = 1, m = 2 for all 8 sub-blocks
    i = np.arange(128)
    qs = ((i % 16) | ((15 - i % 16) << 4)).astype(np.uint8)
    block = np.concatenate([header, scales, qs])[None]
    got = gguf.quants.dequantize(block, Q.Q4_K).reshape(256)
    c, j = np.divmod(np.arange(256), 64)
    byte = 32 * c + j % 32
    q = np.where(j < 32, byte % 16, 15 - byte % 16)
    np.testing.assert_array_equal(got, q.astype(np.float32) - 1.0)  # 1 * 1 * q - 0.5 * 2


@pytest.mark.slow
def test_embedded_model_native_generates_what_the_dequantized_one_does() -> None:
    """The engine path (EngineConfig.gguf_native -> the runner's build_model) on the real Q4_1 file: the native
    engine holds the file's blocks and its greedy tokens equal those of the dequantized one (fp32 CPU)."""
    from tokenmill.protocol import SamplingParams
    from tokenmill.worker.engine import LLMEngine

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is"]
    tokens = {}
    for mode in ("on", "off"):
        engine = LLMEngine(EngineConfig(model="embedded", device="cpu", dtype="float32", gguf_native=mode))
        methods = {type(m.method).__name__ for m in projection_layers(engine.runner.model)}
        assert methods == {"GgufLinearMethod" if mode == "on" else "UnquantizedLinearMethod"}
        tokens[mode] = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens["on"] == tokens["off"] and all(len(t) == 4 for t in tokens["on"])
