"""Hugging Face checkpoints: config.json -> ModelArch, safetensors (single or sharded) -> weights.

Both the transformers 4.x config layout (rope_theta + rope_scaling) and the 5.x one (rope_parameters)
are understood.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenmill.worker.config import ModelArch, RopeScaling
from tokenmill.worker.loader.quantized import CheckpointQuant, read_checkpoint_quant
from tokenmill.worker.models.layers import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def read_hf_arch(model_dir: Path) -> ModelArch:
    """ModelArch from model_dir/config.json (+ generation_config.json for extra eos ids)."""
    cfg = read_json(model_dir / "config.json")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"unsupported model_type {model_type!r} in {model_dir / 'config.json'}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _check_supported_features(cfg, model_dir)
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _rope(cfg)
        return ModelArch(
            arch=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window(cfg, model_type, model_dir),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg, model_dir),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"bad or incomplete {model_dir / 'config.json'}: {type(e).__name__}: {e}") from e


def _check_supported_features(cfg: dict[str, Any], model_dir: Path) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act {act!r} in {model_dir} is not supported (only silu)")
    if cfg.get("attention_bias") and cfg.get("model_type") != "qwen2":
        raise ModelLoadError(f"attention_bias=true in {model_dir} is not supported for {cfg['model_type']}")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"mlp_bias=true in {model_dir} is not supported")


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) from rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x)."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    spec = params if params.get("rope_type", params.get("type")) not in (None, "default") else legacy
    kind = spec.get("rope_type", spec.get("type")) or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(spec["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(spec["factor"]),
            low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
            high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
            original_max_position=int(spec.get("original_max_position_embeddings", 8192)),
        )
    raise ModelLoadError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _layer_uses_window(cfg: dict[str, Any], model_type: str) -> list[bool]:
    """Whether each layer has sliding-window attention, as transformers decides it."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("sliding_window") is None:
        return [False] * n
    if model_type == "mistral":
        return [True] * n
    if not cfg.get("use_sliding_window", False):
        return [False] * n
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return [t == "sliding_attention" for t in layer_types]
    first = int(cfg.get("max_window_layers", 0))
    return [i >= first for i in range(n)]


def _sliding_window(cfg: dict[str, Any], model_type: str, model_dir: Path) -> int | None:
    uses = _layer_uses_window(cfg, model_type)
    if not any(uses):
        return None
    if not all(uses):
        raise ModelLoadError(f"{model_dir}: sliding-window attention on only some layers is not supported")
    return int(cfg["sliding_window"])


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(cfg: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    ids = _as_id_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        ids += _as_id_list(read_json(gen_path).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # de-duplicated, first occurrence order


def native_dtype(model_dir: Path) -> torch.dtype | None:
    """The dtype the checkpoint was saved in (config "dtype" / "torch_dtype"), if it is a float type."""
    cfg = read_json(model_dir / "config.json")
    return _DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")))


def read_hf_quant(model_dir: Path) -> CheckpointQuant | None:
    """The quantization_config of model_dir/config.json (None: a dense checkpoint)."""
    return read_checkpoint_quant(read_json(model_dir / "config.json"), model_dir / "config.json")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's .safetensors files: the shards of model.safetensors.index.json, or
    model.safetensors, or (last resort) every *.safetensors in the folder."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"safetensors shard {f} listed in the index is missing")
    return files


def iter_hf_weights(
    model_dir: Path, device: torch.device, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor on device in dtype), one tensor at a time, memory-mapped from disk. dtype None: as
    stored (quantized checkpoints: their scales and FP8 weights are cast, if at all, by the layer's method)."""
    for path in safetensors_files(model_dir):
        yield from _iter_file(path, device, dtype)


def _iter_file(path: Path, device: torch.device, dtype: torch.dtype | None,
               ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                tensor = f.get_tensor(name).to(device)  # moved first, so a GPU does the cast
                yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    except ModelLoadError:
        raise
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt headers
        raise ModelLoadError(f"cannot read safetensors file {path}: {e}") from e
