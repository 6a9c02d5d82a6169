"""Model resolution and loading: GGUF (embedded SmolLM2 and handcrafted files), HF errors, dummy shapes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.config import RopeScaling
from tokenmill.worker.loader import ModelLoadError, ModelSource, build_model, gguf_loader, resolve_model
from tokenmill.worker.loader.dummy import DUMMY_SHAPES
from tokenmill.worker.models.llama import LlamaForCausalLM, expected_hf_weights
from tokenmill.worker.registry_fetch import embedded_model_path

CPU = torch.device("cpu")
TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
)
PROMPT = [1, 5, 77, 12, 3, 100, 64, 9, 33, 2, 18]

# ---------------------------------------------------------------- helpers


def logits_for(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Single-request prefill through the paged path; [len(ids), vocab] float32."""
    a, n, bs = model.arch, len(ids), 16
    blocks = math.ceil(n / bs)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], slot_mapping=torch.arange(n),
        max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
    shape = (blocks, bs, a.num_kv_heads, a.head_dim)
    caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
              for _ in range(a.num_layers)]
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def random_hf_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = name.endswith("norm.weight")
            p.copy_(1.0 + 0.2 * noise if is_norm else noise / math.sqrt(p.shape[-1]))
    return model.eval()


_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TO_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def to_gguf_name(hf: str) -> str:
    if hf in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    return f"blk.{parts[2]}.{_TO_GGUF_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows of llama-arch models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, cfg: dict[str, int | float], state: dict[str, np.ndarray],
               types: dict[str, Q], head_dim: int | None = None) -> None:
    """state: GGUF-named float32 arrays in HF [out, in] layout (or uint8 arrays: the type's raw blocks, rows
    [out, bytes]); types: per-name ggml type (default F32)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg["num_key_value_heads"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in state.items():
        qtype = types.get(name, Q.F32)
        data = arr if arr.dtype == np.uint8 else gguf.quants.quantize(arr.astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_state_to_gguf(model: PreTrainedModel, arch: str, n_heads: int, n_kv: int) -> dict[str, np.ndarray]:
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        arr = t.float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            arr = llama_cpp_permute(arr, n_heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = llama_cpp_permute(arr, n_kv)
        out[to_gguf_name(name)] = arr
    return out


# ---------------------------------------------------------------- GGUF


LLAMA31_ROPE: dict[str, Any] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}


def llama_cpp_rope_freqs(head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1 (divisor per frequency)."""
    factors = []
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


GGUF_CASES: dict[str, tuple[str, PretrainedConfig, int | None]] = {
    "llama": ("llama", LlamaConfig(**TINY), None),
    "llama3.1": ("llama", LlamaConfig(**{**TINY, "max_position_embeddings": 16384},
                                      rope_parameters=LLAMA31_ROPE), None),
    "qwen2": ("qwen2", Qwen2Config(**TINY), None),
    "qwen3": ("qwen3", Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True), 32),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_handcrafted_f32_gguf_matches_transformers(tmp_path: Path, case: str) -> None:
    """Exact weights: proves the name mapping, the Q/K un-permutation (llama), Llama 3.1 rope from
    rope_freqs, biases (qwen2), q/k norms and tied embeddings (qwen3)."""
    arch, config, head_dim = GGUF_CASES[case]
    hf_model = random_hf_model(config, seed=3)
    state = hf_state_to_gguf(hf_model, arch, 4, 2)
    cfg = dict(TINY)
    if case == "llama3.1":
        cfg.update(rope_theta=LLAMA31_ROPE["rope_theta"], max_position_embeddings=16384)
        state["rope_freqs.weight"] = llama_cpp_rope_freqs(16, LLAMA31_ROPE)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, arch, cfg, state, {}, head_dim)

    source = resolve_model(str(path), "auto")
    assert source.kind == "gguf" and source.arch.arch == arch
    assert source.arch.tie_word_embeddings == (arch == "qwen3")
    expected_rope = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position=8192) if case == "llama3.1" else RopeScaling()
    assert source.arch.rope_scaling == expected_rope
    assert source.gguf_metadata is not None and source.gguf_metadata["tokenizer.ggml.eos_token_id"] == 2
    model = build_model(source, TorchRefBackend(), CPU, torch.float32)
    torch.testing.assert_close(logits_for(model, PROMPT), hf_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_foreign_rope_freqs_are_rejected(tmp_path: Path) -> None:
    state = hf_state_to_gguf(random_hf_model(LlamaConfig(**TINY), seed=9), "llama", 4, 2)
    state["rope_freqs.weight"] = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    write_gguf(tmp_path / "odd.gguf", "llama", TINY, state, {})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        resolve_model(str(tmp_path / "odd.gguf"))


def test_handcrafted_quantized_gguf_dequantizes_like_ggml(tmp_path: Path) -> None:
    hf_model = random_hf_model(LlamaConfig(**TINY), seed=4)
    state = hf_state_to_gguf(hf_model, "llama", 4, 2)
    types = {"token_embd.weight": Q.Q8_0, "output.weight": Q.F16, "output_norm.weight": Q.BF16,
             "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1, "blk.0.attn_v.weight": Q.Q8_0,
             "blk.0.attn_output.weight": Q.F16, "blk.0.ffn_gate.weight": Q.Q4_1,
             "blk.0.ffn_up.weight": Q.Q4_0, "blk.0.ffn_down.weight": Q.BF16, "blk.1.attn_q.weight": Q.Q8_0,
             "blk.1.attn_k.weight": Q.Q4_0, "blk.1.ffn_down.weight": Q.Q4_1}
    path = tmp_path / "quant.gguf"
    write_gguf(path, "llama", TINY, state, types)
    source = resolve_model(str(path), "gguf")
    loaded = dict(source.iter_weights(CPU, torch.float32))

    hf_state = hf_model.state_dict()
    assert set(loaded) == set(hf_state)
    for hf_name, ref in hf_state.items():
        qtype = types.get(to_gguf_name(hf_name), Q.F32)
        # Rows are quantized independently, so un-permuting after dequantization equals quantizing the
        # unpermuted HF weight: compare against ggml's own round trip of the HF tensor.
        quant = gguf.quants.quantize(ref.numpy(), qtype)
        expected = torch.from_numpy(gguf.quants.dequantize(quant, qtype).copy()).reshape(ref.shape)
        torch.testing.assert_close(loaded[hf_name], expected, atol=1e-6, rtol=0,
                                   msg=f"{hf_name} ({qtype.name})")
    model = build_model(source, TorchRefBackend(), CPU, torch.float32)
    hf_out, ours = hf_logits(hf_model, PROMPT), logits_for(model, PROMPT)
    assert (ours - hf_out).abs().max() < 0.25 * hf_out.abs().max()  # close to the float model, not exact


def test_block_formats_match_the_ggml_spec() -> None:
    """Hand-packed blocks, independent of gguf.quants: Q8_0 x = d*q; Q4_0 x = d*(q-8); Q4_1 x = d*q + m,
    element j < 16 in the low nibble of byte j, element 16 + j in its high nibble."""
    def f16(x: float) -> list[int]:
        return list(np.array([x], dtype=np.float16).view(np.uint8))

    q8 = np.arange(-16, 16, dtype=np.int8)
    lo, hi = np.arange(16, dtype=np.uint8), np.arange(15, -1, -1, dtype=np.uint8)
    nibbles = list(lo | (hi << 4))
    blocks = {
        Q.Q8_0: (f16(0.5) + list(q8.view(np.uint8)), 0.5 * q8.astype(np.float32)),
        Q.Q4_0: (f16(0.25) + nibbles, 0.25 * (np.concatenate([lo, hi]).astype(np.float32) - 8)),
        Q.Q4_1: (f16(2.0) + f16(-3.0) + nibbles, 2.0 * np.concatenate([lo, hi]).astype(np.float32) - 3.0),
    }
    for qtype, (raw, expected) in blocks.items():
        got = gguf_loader.dequantize_blocks(torch.tensor([raw], dtype=torch.uint8), qtype)
        torch.testing.assert_close(got[0], torch.from_numpy(expected), msg=qtype.name)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_torch_block_kernels_match_ggml_numpy(qtype: Q) -> None:
    """The torch path (used on accelerators) against gguf.quants on random data."""
    x = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32) * 3
    quant = gguf.quants.quantize(x, qtype)
    blocks = torch.from_numpy(quant).reshape(-1, quant.shape[1] // 3)
    got = gguf_loader.dequantize_blocks(blocks, qtype).reshape(8, 96)
    torch.testing.assert_close(got, torch.from_numpy(gguf.quants.dequantize(quant, qtype)), atol=0, rtol=0)
    assert (got - torch.from_numpy(x)).abs().max() < 1.5  # a real round trip, not garbage


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    for n_head in (6, 3):
        back = gguf_loader.unpermute_qk(torch.from_numpy(llama_cpp_permute(w, n_head)), n_head)
        assert torch.equal(back, torch.from_numpy(w))


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers_gguf(tmp_path: Path) -> None:
    gguf_path = embedded_model_path(quiet=True)
    source = resolve_model("embedded", "auto")
    a = source.arch
    assert (a.arch, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert a.tie_word_embeddings and a.vocab_size == 49152 and a.rope_theta == 100000.0
    assert source.gguf_metadata is not None and len(source.gguf_metadata["tokenizer.ggml.tokens"]) == 49152
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30]
    ours = logits_for(build_model(source, TorchRefBackend(), CPU, torch.float32), ids)

    (tmp_path / gguf_path.name).symlink_to(gguf_path)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    expected = hf_logits(hf_model, ids)
    assert (ours - expected).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_unsupported_gguf_tensor_type(tmp_path: Path) -> None:
    state = hf_state_to_gguf(random_hf_model(LlamaConfig(**TINY), seed=5), "llama", 4, 2)
    path = tmp_path / "iq4.gguf"
    name = "blk.1.ffn_up.weight"
    block, size = gguf.constants.GGML_QUANT_SIZES[Q.IQ4_NL]  # written as raw blocks: gguf.quants cannot make them
    rows, cols = state[name].shape
    state[name] = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    write_gguf(path, "llama", TINY, state, {name: Q.IQ4_NL})
    source = resolve_model(str(path))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight.*IQ4_NL"):
        build_model(source, TorchRefBackend(), CPU, torch.float32)


def test_truncated_gguf(tmp_path: Path) -> None:
    state = hf_state_to_gguf(random_hf_model(LlamaConfig(**TINY), seed=6), "llama", 4, 2)
    path = tmp_path / "cut.gguf"
    write_gguf(path, "llama", TINY, state, {})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        build_model(resolve_model(str(path)), TorchRefBackend(), CPU, torch.float32)
    path.write_bytes(data[:100])  # cut inside the metadata
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        resolve_model(str(path))


# ---------------------------------------------------------------- resolution and HF errors


def test_unknown_path() -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("/definitely/not/here")


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"no config.json in {tmp_path}"):
        resolve_model(str(tmp_path))


def test_wrong_load_format(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"needs a \.gguf file"):
        resolve_model(str(tmp_path), "gguf")
    with pytest.raises(ModelLoadError, match="unknown dummy model shape 'nope'"):
        resolve_model("nope", "dummy")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"expected a \.gguf file or a folder"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2'.*llama, mistral, qwen2, qwen3"):
        resolve_model(str(tmp_path))


def write_config(path: Path, **overrides: Any) -> None:
    cfg = {"model_type": "llama", **TINY, "num_hidden_layers": 2, **overrides}
    (path / "config.json").write_text(json.dumps(cfg))


def test_legacy_rope_layout_and_head_dim(tmp_path: Path) -> None:
    """transformers 4.x config.json (rope_theta + rope_scaling with "type"), as Llama 3.1 ships it."""
    write_config(tmp_path, rope_theta=500000.0, head_dim=32, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, eos_token_id=[5, 6], torch_dtype="bfloat16")
    source = resolve_model(str(tmp_path))
    a = source.arch
    assert a.rope_theta == 500000.0 and a.head_dim == 32 and a.eos_token_ids == (5, 6)
    assert (a.rope_scaling.kind, a.rope_scaling.factor, a.rope_scaling.original_max_position) == \
        ("llama3", 8.0, 8192)
    assert source.native_dtype == torch.bfloat16
    write_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
    assert resolve_model(str(tmp_path)).arch.rope_scaling.kind == "linear"
    write_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'yarn'"):
        resolve_model(str(tmp_path))


def test_qwen_sliding_window_rules(tmp_path: Path) -> None:
    write_config(tmp_path, model_type="qwen2", sliding_window=64, use_sliding_window=False)
    assert resolve_model(str(tmp_path)).arch.sliding_window is None
    write_config(tmp_path, model_type="qwen2", sliding_window=64, use_sliding_window=True,
                 max_window_layers=0)
    assert resolve_model(str(tmp_path)).arch.sliding_window == 64
    write_config(tmp_path, model_type="qwen3", sliding_window=64, use_sliding_window=True,
                 layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ModelLoadError, match="only some layers"):
        resolve_model(str(tmp_path))
    write_config(tmp_path, model_type="mistral", sliding_window=None)
    assert resolve_model(str(tmp_path)).arch.sliding_window is None


def save_tiny_hf(path: Path) -> PreTrainedModel:
    model = random_hf_model(LlamaConfig(**TINY, eos_token_id=[2, 7]), seed=7)
    model.save_pretrained(path)
    return model


def test_eos_ids_merge_generation_config(tmp_path: Path) -> None:
    save_tiny_hf(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    source = resolve_model(str(tmp_path))
    assert source.kind == "hf" and source.arch.eos_token_ids == (2, 7, 11)
    assert source.gguf_metadata is None


def test_truncated_safetensors(tmp_path: Path) -> None:
    save_tiny_hf(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    source = resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        build_model(source, TorchRefBackend(), CPU, torch.float32)


def test_mis_shaped_tensor(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in save_tiny_hf(tmp_path).state_dict().items()}
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj.weight.*\(95, 64\).*\(96, 64\)"):
        build_model(resolve_model(str(tmp_path)), TorchRefBackend(), CPU, torch.float32)


def test_unexpected_and_missing_weights() -> None:
    source = resolve_model("tiny-llama", "dummy")
    model = LlamaForCausalLM(source.arch, TorchRefBackend(), dtype=torch.float32, device=CPU)
    weights = list(source.iter_weights(CPU, torch.float32))
    unexpected = re.escape("unexpected weight 'model.layers.2.mlp.up_proj.weight'")
    with pytest.raises(ModelLoadError, match=unexpected):
        model.load_weights([*weights, ("model.layers.2.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ModelLoadError, match=r"missing 1 weight.*model\.norm\.weight"):
        model.load_weights([w for w in weights if w[0] != "model.norm.weight"])
    model.load_weights([*weights, ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


# ---------------------------------------------------------------- dummy shapes


def test_tiny_llama_parameter_count() -> None:
    model = build_model(resolve_model("tiny-llama", "dummy"), TorchRefBackend(), CPU, torch.float32)
    h, inter, vocab, kv = 64, 128, 512, 2 * 16
    per_layer = 2 * h + h * (h + 2 * kv) + h * h + 2 * h * inter + inter * h
    assert sum(p.numel() for p in model.parameters()) == 2 * vocab * h + 2 * per_layer + h


@pytest.mark.parametrize(("name", "count"), [
    ("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248), ("llama3.1-8b", 8_030_261_248),
    ("mistral-7b", 7_241_732_096), ("qwen2.5-7b", 7_615_616_512), ("qwen2.5-0.5b", 494_032_768),
    ("qwen3-0.6b", 596_049_920), ("smollm2-135m", 134_515_008),
])
def test_real_shapes_have_published_parameter_counts(name: str, count: int) -> None:
    source = resolve_model(name, "dummy")
    meta = torch.device("meta")
    model = LlamaForCausalLM(source.arch, TorchRefBackend(), dtype=torch.bfloat16, device=meta)
    assert sum(p.numel() for p in model.parameters()) == count
    assert set(expected_hf_weights(source.arch)) >= {"model.embed_tokens.weight", "model.norm.weight"}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_dummy_models_are_reproducible(name: str) -> None:
    source = resolve_model(name, "dummy")
    assert source == ModelSource(kind="dummy", path=None, arch=DUMMY_SHAPES[name], name=name)
    first = build_model(source, TorchRefBackend(), CPU, torch.float32)
    second = build_model(source, TorchRefBackend(), CPU, torch.float32)
    for (n, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), n
    assert torch.equal(first.model.norm.weight, torch.ones(64))
    assert 0.015 < float(first.model.embed_tokens.weight.std()) < 0.025
    assert torch.equal(logits_for(first, PROMPT).argmax(-1), logits_for(second, PROMPT).argmax(-1))


def test_folder_of_gguf_points_at_the_file(tmp_path: Path) -> None:
    state = hf_state_to_gguf(random_hf_model(LlamaConfig(**TINY), seed=8), "llama", 4, 2)
    write_gguf(tmp_path / "m.gguf", "llama", TINY, state, {})
    with pytest.raises(ModelLoadError, match=r"no config\.json.*m\.gguf"):
        resolve_model(str(tmp_path))
    source = resolve_model(str(tmp_path / "m.gguf"))
    assert source.name == "m" and source.path == tmp_path / "m.gguf"
    assert source.arch.num_layers == 2 and source.arch.vocab_size == 128 and source.arch.eos_token_ids == (2,)
