"""Tiny random-weight Hugging Face checkpoints of every supported architecture, saved locally."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                              bos_token_id=1, eos_token_id=2)

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "smollm2-tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral-swa": ("MistralConfig", dict(sliding_window=8, head_dim=16)),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3-qknorm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


def save_tiny_model(name: str, root: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write config.json + safetensors for architecture `name` under root/name; returns the folder. `overrides`:
    HF config fields to change (num_hidden_layers=6, ...)."""
    import transformers

    cls_name, extra = ARCHS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init, so logits are not near-uniform
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    out = root / name
    model.save_pretrained(out, safe_serialization=True)
    return out


def load_hf(path: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
