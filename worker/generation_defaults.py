"""The sampling defaults a model ships with: a Hugging Face folder's generation_config.json, or the
general.sampling.* keys of a GGUF file (what vLLM's `--generation-config auto` and llama.cpp read). The
worker announces them in READY; the HTTP gateway applies them to the fields a request leaves unset, and the
command line to the flags it is not given. Torch-free (a broker-only install imports it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenmill.protocol.wire import SAMPLING_DEFAULT_FIELDS

# SamplingParams field -> (generation_config.json key, GGUF key, type)
MODEL_DEFAULT_KEYS: dict[str, tuple[str, str, type]] = {
    "max_tokens": ("max_new_tokens", "", int),
    "temperature": ("temperature", "general.sampling.temp", float),
    "top_p": ("top_p", "general.sampling.top_p", float),
    "top_k": ("top_k", "general.sampling.top_k", int),
    "min_p": ("min_p", "general.sampling.min_p", float),
    "repetition_penalty": ("repetition_penalty", "general.sampling.penalty_repeat", float),
}


def from_generation_config(path: Path) -> dict[str, int | float]:
    """The defaults in a generation_config.json ({} if it is missing or unreadable)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    return _typed({name: cfg.get(hf) for name, (hf, _, _) in MODEL_DEFAULT_KEYS.items() if hf})


def from_gguf_metadata(meta: Mapping[str, Any]) -> dict[str, int | float]:
    """The defaults among a GGUF file's key/values (as plain Python values)."""
    return _typed({name: meta.get(key) for name, (_, key, _) in MODEL_DEFAULT_KEYS.items() if key})


def from_gguf_file(path: Path) -> dict[str, int | float]:
    """The defaults of a .gguf file read with the gguf library ({} without it, or for an unreadable file)."""
    try:
        import gguf
    except ImportError:  # a broker-only install: no worker extras
        return {}
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError):
        return {}
    found: dict[str, Any] = {}
    for _, key, _ in MODEL_DEFAULT_KEYS.values():
        field = reader.get_field(key) if key else None
        if field is not None and field.data:
            found[key] = field.parts[field.data[0]].tolist()[0]
    return from_gguf_metadata(found)


def model_sampling_defaults(path: Path | None, load_format: str = "auto") -> dict[str, int | float]:
    """The defaults of the model at `path` (an HF folder or a .gguf file); {} for none or a dummy model."""
    if path is None or load_format == "dummy":
        return {}
    if path.is_dir():
        return from_generation_config(path / "generation_config.json")
    if path.suffix == ".gguf" or load_format == "gguf":
        return from_gguf_file(path)
    return {}


def announced_defaults(defaults: Mapping[str, int | float]) -> dict[str, int | float]:
    """The defaults READY may carry: those within the wire's ranges (protocol SAMPLING_DEFAULT_FIELDS; e.g.
    a generation config's top_p of 0 is dropped, not sent to fail the registration)."""
    out: dict[str, int | float] = {}
    for key, value in defaults.items():
        kind, lo, hi = SAMPLING_DEFAULT_FIELDS.get(key, (None, 0.0, -1.0))
        if kind is not None and lo <= value <= hi:
            out[key] = int(value) if kind is int else float(value)
    return out


def _typed(values: Mapping[str, Any]) -> dict[str, int | float]:
    """Each present value as its field's type; missing values and values of the wrong type are left out."""
    out: dict[str, int | float] = {}
    for name, v in values.items():
        if v is None or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        out[name] = int(v) if MODEL_DEFAULT_KEYS[name][2] is int else float(v)
    return out
