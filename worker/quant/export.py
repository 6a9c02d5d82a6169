"""Write a quantized Hugging Face folder (config.json with quantization_config, model.safetensors, tokenizer)
from a dense model and the canonical tensors of its projections (worker/quant/quantizer.py), in the layouts
worker/loader/quantized.py reads:

    gptq                 INT4 (AutoGPTQ v1 layout when symmetric; GPTQModel's gptq_v2 when asymmetric,
                         since v1 stores z - 1 and cannot hold a zero point of 0), act-order through g_idx
    awq                  INT4 with zero points, GEMM layout (no act-order)
    compressed-tensors   INT4 pack-quantized, INT8 int-quantized per channel, FP8 float-quantized per channel
                         with dynamic per-token activations

The embeddings, norms, biases and lm_head are written dense in `dtype`; INT4 scales in float16.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenmill.kernels.quant_weight import awq_pack, pack_int4, unpack_int4
from tokenmill.worker.config import ModelArch
from tokenmill.worker.models.llama import LlamaForCausalLM, expected_hf_weights, fused_target
from tokenmill.worker.quant.config import QuantConfig

FORMATS = ("gptq", "awq", "compressed-tensors")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja")


def default_format(config: QuantConfig) -> str:
    return "gptq" if config.method == "int4" else "compressed-tensors"


def check_format(config: QuantConfig, fmt: str) -> None:
    """ValueError when `fmt` cannot hold `config`'s weights."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; use {', '.join(FORMATS)}")
    if fmt in ("gptq", "awq") and config.method != "int4":
        raise ValueError(f"the {fmt} layout holds INT4 weights, not {config.method} (use compressed-tensors)")
    if fmt == "awq" and config.act_order:
        raise ValueError("the AWQ layout has no act-order (g_idx); use gptq or compressed-tensors")


# ---- canonical -> layout -----------------------------------------------------------------------------------


def _int4_input_order(t: dict[str, torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in input column order, zero points int16 [N, G], g_idx int32 [K]) of canonical tensors."""
    q = unpack_int4(t["qweight"])
    k = q.shape[1]
    g_idx = (torch.arange(k) // group_size).to(torch.int32)
    perm = t.get("perm")
    if perm is not None:
        q_in = torch.empty_like(q)
        q_in[:, perm.long()] = q
        g_idx = torch.empty_like(g_idx)
        g_idx[perm.long()] = (torch.arange(k) // group_size).to(torch.int32)
        q = q_in
    zeros = t.get("zeros")
    z = torch.full(t["scales"].shape, 8, dtype=torch.int16) if zeros is None else zeros.to(torch.int16)
    return q, z, g_idx


def layout_tensors(t: dict[str, torch.Tensor], config: QuantConfig, fmt: str) -> dict[str, torch.Tensor]:
    """One projection's canonical tensors in the checkpoint layout `fmt` (suffixes after the module name)."""
    if config.method != "int4":  # compressed-tensors int8 / fp8: the canonical tensors are the layout
        return {"weight": t["qweight"].contiguous(), "weight_scale": t["scales"].float().contiguous()}
    q, z, g_idx = _int4_input_order(t, config.group_size)
    scales = t["scales"].to(torch.float16)
    if fmt == "gptq":
        offset = 1 if config.symmetric else 0  # v1 stores z - 1; v2 (asymmetric) z
        return {"qweight": pack_int4(q).t().contiguous(), "qzeros": pack_int4((z - offset).t().contiguous()),
                "scales": scales.t().contiguous(), "g_idx": g_idx}
    if fmt == "awq":
        return {"qweight": awq_pack(q.t().contiguous()), "qzeros": awq_pack(z.t().contiguous()),
                "scales": scales.t().contiguous()}
    out = {"weight_packed": pack_int4(q), "weight_scale": scales.contiguous(),
           "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if not config.symmetric:  # packed along the output dim, as compressed-tensors does
        out["weight_zero_point"] = pack_int4(z.t().contiguous()).t().contiguous()
    if config.act_order:
        out["weight_g_idx"] = g_idx
    return out


def quantization_config(config: QuantConfig, fmt: str) -> dict[str, Any]:
    """The config.json quantization_config of a checkpoint of `config` in layout `fmt`."""
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": config.group_size, "desc_act": config.act_order,
                "sym": config.symmetric, "damp_percent": 0.01, "true_sequential": False, "static_groups": False,
                "lm_head": False, "checkpoint_format": "gptq" if config.symmetric else "gptq_v2"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": config.group_size, "zero_point": True,
                "version": "gemm"}
    if config.method == "int4":
        weights = {"num_bits": 4, "type": "int", "symmetric": config.symmetric, "strategy": "group",
                   "group_size": config.group_size, "actorder": "group" if config.act_order else None,
                   "dynamic": False}
        ct_format, acts = "pack-quantized", None
    elif config.method == "int8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
        ct_format, acts = "int-quantized", None
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        ct_format = "float-quantized"
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


# ---- the folder ------------------------------------------------------------------------------------------------


def hf_config(arch: ModelArch, dtype: torch.dtype) -> dict[str, Any]:
    """A transformers config.json for `arch` (for sources that have none: GGUF, dummy)."""
    cfg: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch.arch]], "model_type": arch.arch, "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta, "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": _DTYPE_NAMES[dtype],
        "bos_token_id": arch.bos_token_id, "eos_token_id": list(arch.eos_token_ids) or None,
    }
    s = arch.rope_scaling
    if s.kind == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
    elif s.kind == "llama3":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_position}
    if arch.sliding_window is not None:
        cfg |= {"sliding_window": arch.sliding_window, "use_sliding_window": True, "max_window_layers": 0}
    return cfg


def checkpoint_state(model: LlamaForCausalLM, canonical: dict[str, dict[str, torch.Tensor]], config: QuantConfig,
                     fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, HF-named: the dense ones from `model`, the projections from `canonical`."""
    params = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name, tensors in canonical.items():
        for suffix, t in layout_tensors(tensors, config, fmt).items():
            state[f"{name}.{suffix}"] = t
    for name in _dense_names(model):
        param, rows = fused_target(name, model.arch)
        t = params[param].data
        state[name] = (t if rows is None else t[rows[0]:rows[1]]).to(dtype).contiguous()
    return state


def _dense_names(model: LlamaForCausalLM) -> list[str]:
    """HF names of the tensors written dense: embeddings, norms, biases, lm_head."""
    return [n for n in expected_hf_weights(model.arch)
            if not (n.endswith(".weight") and n.split(".")[-2].endswith("_proj"))]


def write_folder(out: Path, model: LlamaForCausalLM, canonical: dict[str, dict[str, torch.Tensor]],
                 config: QuantConfig, fmt: str, dtype: torch.dtype, base_config: dict[str, Any] | None,
                 tokenizer_dir: Path | None, tokenizer: Any = None) -> None:
    """Write the checkpoint folder `out` (created; existing files of the same names are replaced).
    base_config: the source's config.json (HF sources) or None (synthesised from the arch). The tokenizer comes
    from `tokenizer_dir`'s files or, for GGUF sources, from a worker Tokenizer (tokenizer.json + its config)."""
    check_format(config, fmt)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(base_config) if base_config is not None else hf_config(model.arch, dtype)
    cfg["torch_dtype"] = _DTYPE_NAMES[dtype]
    cfg.pop("dtype", None)
    cfg["quantization_config"] = quantization_config(config, fmt)
    weights = out / "model.safetensors"
    save_file(checkpoint_state(model, canonical, config, fmt, dtype), str(weights), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    weights.chmod(0o666 & ~umask)  # safetensors creates it 0600; the rest of the folder gets the usual mode
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out / name)
    elif tokenizer is not None:
        _write_tokenizer(out, tokenizer)


def _write_tokenizer(out: Path, tok: Any) -> None:
    """tokenizer.json + tokenizer_config.json from a worker Tokenizer (what Tokenizer.from_hf_folder reads)."""
    tok.backend.save(str(out / "tokenizer.json"))

    def text(i: int | None) -> str | None:
        return None if i is None else tok.id_to_token(i)

    cfg = {"bos_token": text(tok.bos_token_id), "eos_token": text(tok.eos_token_id),
           "pad_token": text(tok.pad_token_id), "unk_token": text(tok.unk_token_id), "add_bos_token": tok.add_bos,
           "chat_template": tok.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None},
                                                          indent=2) + "\n")
