"""Quantized weights on load: the `quantization_config` of a Hugging Face config.json, conversion of each
checkpoint layout to the canonical tensors of the LinearMethods (worker/quant/), and online quantization of
dense checkpoints (HF, GGUF, dummy).

Checkpoint layouts read here (4-bit values v, W[n, k] = (v - z) * s, groups g(k) = k // group_size):
  gptq (AutoGPTQ v1 / GPTQModel v2, bits 4): qweight int32 [K/8, N] (k = 8i + j at bits 4j of row i), qzeros
      int32 [G, N/8] (n = 8c + j at bits 4j; v1 stores z - 1, v2 z), scales float16 [G, N], g_idx int32 [K] (the
      group of each input column; with desc_act the groups are not contiguous runs of columns).
  awq (AutoAWQ GEMM, bits 4, zero points): qweight int32 [K, N/8] and qzeros int32 [G, N/8], packed along N in
      the interleaved order n = 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j] at bits 4j; scales float16 [G, N].
  compressed-tensors (llm-compressor): pack-quantized int4 (weight_packed int32 [N, K/8], k = 8i + j at bits 4j,
      stored v + 8 for signed v; weight_scale [N, G]; asymmetric: weight_zero_point int32 [N/8, G] packed along
      N, stored zp + 8; actorder: weight_g_idx [K]; weight_shape [2]); int-quantized int8 channel (weight int8
      [N, K], weight_scale [N, 1]) or pack-quantized int8 (weight_packed int32 [N, K/4], k = 4i + j at bits 8j,
      stored v + 128); float-quantized fp8 (weight e4m3 [N, K], weight_scale [N, 1] or [1]) with
      dynamic per-token activations.
  fp8 (vLLM's own): weight e4m3 [N, K], weight_scale per tensor ([] or [1]), activation_scheme dynamic.
An unsupported method or option fails when the model is resolved, naming it; a tensor of the wrong shape or
dtype fails naming the tensor and what was expected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.kernels.quant_weight import awq_unpack, pack_int4, unpack_int4
from tokenmill.worker.models.layers import ModelLoadError
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.config import INT4_GROUP_SIZES, METHODS, QuantConfig

Weights = Iterator[tuple[str, torch.Tensor]]
FORMATS = ("gptq", "awq", "compressed-tensors", "fp8")
_PROJ_SUFFIX = "_proj"


@dataclass(frozen=True)
class CheckpointQuant:
    """A quantized checkpoint: its layout (FORMATS), the QuantConfig it maps to, and the layout's options."""

    format: str
    config: QuantConfig
    options: tuple[tuple[str, Any], ...] = ()  # e.g. (("ct_format", "pack-quantized"),)

    def option(self, key: str) -> Any:
        return dict(self.options).get(key)


# ---- config.json ---------------------------------------------------------------------------------------


def read_checkpoint_quant(cfg: dict[str, Any], where: Path) -> CheckpointQuant | None:
    """The checkpoint's quantization (None for a dense checkpoint); ModelLoadError naming what is unsupported."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{where}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    readers: dict[str, Callable[[dict[str, Any], Path], CheckpointQuant]] = {
        "gptq": _gptq_config, "awq": _awq_config, "compressed-tensors": _ct_config, "fp8": _fp8_config}
    if method not in readers:
        raise ModelLoadError(f"{where}: quantization method {method!r} is not supported (supported: "
                             f"{', '.join(FORMATS)})")
    try:
        return readers[method](qc, where)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: bad {method} quantization_config: {e}") from None


def _int4_group(bits: Any, group_size: Any, method: str, where: Path) -> int:
    if int(bits) != 4:
        raise ModelLoadError(f"{where}: {method} with bits={bits} is not supported (4-bit only)")
    g = int(group_size)
    if g not in INT4_GROUP_SIZES:
        raise ModelLoadError(f"{where}: {method} group_size {g} is not supported (supported: "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))})")
    return g


def _gptq_config(qc: dict[str, Any], where: Path) -> CheckpointQuant:
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    g = _int4_group(qc.get("bits", 4), qc.get("group_size", 128), "GPTQ", where)
    if qc.get("lm_head"):
        raise ModelLoadError(f"{where}: a GPTQ-quantized lm_head is not supported")
    return CheckpointQuant("gptq", QuantConfig("int4", g, bool(qc.get("sym", True)), bool(qc.get("desc_act"))),
                           (("zero_offset", 1 if fmt == "gptq" else 0),))


def _awq_config(qc: dict[str, Any], where: Path) -> CheckpointQuant:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"{where}: AWQ version {version!r} is not supported (the GEMM layout)")
    g = _int4_group(qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128)), "AWQ",
                    where)
    return CheckpointQuant("awq", QuantConfig("int4", g, not bool(qc.get("zero_point", True))))


def _fp8_config(qc: dict[str, Any], where: Path) -> CheckpointQuant:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"{where}: fp8 activation_scheme {qc.get('activation_scheme')!r} is not supported "
                             "(dynamic per-token scales only)")
    if qc.get("weight_block_size"):
        raise ModelLoadError(f"{where}: block-wise fp8 (weight_block_size) is not supported")
    return CheckpointQuant("fp8", QuantConfig("fp8"))


def _ct_config(qc: dict[str, Any], where: Path) -> CheckpointQuant:
    fmt = str(qc.get("format", ""))
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ModelLoadError(f"{where}: compressed-tensors with {len(groups)} config groups is not supported (one)")
    scheme = next(iter(groups.values()))
    w, a = scheme.get("weights") or {}, scheme.get("input_activations")
    kind, bits, strategy = w.get("type"), int(w.get("num_bits", 0)), w.get("strategy")
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and a is None:
        if strategy not in ("group", "channel") or (strategy == "group" and w.get("group_size") is None):
            raise ModelLoadError(f"{where}: compressed-tensors int4 strategy {strategy!r} is not supported")
        g = _int4_group(4, w.get("group_size") or 128, "compressed-tensors int4", where)
        # only "group" order stores weight_g_idx; "weight" and "static" quantize in activation order but keep
        # contiguous groups, so their layout is the plain one
        act_order = w.get("actorder") in ("group", True)
        return CheckpointQuant("compressed-tensors", QuantConfig("int4", g, bool(w.get("symmetric", True)), act_order),
                               (("ct_format", fmt),))
    if fmt in ("int-quantized", "pack-quantized") and kind == "int" and bits == 8 and a is None \
            and strategy == "channel":
        if not w.get("symmetric", True):
            raise ModelLoadError(f"{where}: asymmetric compressed-tensors int8 is not supported")
        return CheckpointQuant("compressed-tensors", QuantConfig("int8"), (("ct_format", fmt),))
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
        if strategy not in ("channel", "tensor"):
            raise ModelLoadError(f"{where}: compressed-tensors fp8 weight strategy {strategy!r} is not supported")
        if a is not None and (not a.get("dynamic") or a.get("strategy") != "token"):
            raise ModelLoadError(f"{where}: compressed-tensors fp8 activations must be dynamic per token")
        return CheckpointQuant("compressed-tensors", QuantConfig("fp8"), (("ct_format", "float-quantized"),))
    raise ModelLoadError(f"{where}: compressed-tensors format {fmt!r} with weights {kind}{bits} "
                         f"({strategy}) and input activations {a} is not supported (supported: pack-quantized int4, "
                         "int-quantized or pack-quantized int8 per channel, float-quantized fp8 with dynamic per-token "
                         "activations)")


def effective_quant(ckpt: CheckpointQuant | None, requested: str, model: str) -> QuantConfig:
    """The QuantConfig to build: the checkpoint's, else the requested online one ("auto": none)."""
    if requested not in ("auto", *METHODS):
        raise ModelLoadError(f"unknown quantization {requested!r}; use auto, {', '.join(METHODS[1:])}")
    if ckpt is None:
        return QuantConfig("none" if requested == "auto" else requested)  # type: ignore[arg-type]
    if requested not in ("auto", ckpt.config.method):
        raise ModelLoadError(f"{model} is a {ckpt.format} {ckpt.config.method} checkpoint; it cannot be loaded "
                             f"as {requested} (use --quantization auto)")
    return ckpt.config


# ---- conversion to the canonical tensors ------------------------------------------------------------------


def is_projection(name: str) -> bool:
    """A decoder-layer projection tensor (model.layers.N.self_attn.q_proj.*, ...)?"""
    parts = name.split(".")
    return len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[-2].endswith(_PROJ_SUFFIX)


def quantize_online(weights: Weights, method: LinearMethod | None) -> Weights:
    """Dense projection weights -> the method's canonical tensors (round to nearest); others unchanged."""
    for name, t in weights:
        if method is None or not (is_projection(name) and name.endswith(".weight")):
            yield name, t
            continue
        prefix = name.removesuffix("weight")
        for suffix, q in method.quantize(t).items():
            yield prefix + suffix, q


def convert_checkpoint(weights: Weights, ckpt: CheckpointQuant) -> Weights:
    """A quantized checkpoint's tensors -> canonical ones, one projection at a time. A projection's tensors are
    gathered until a tensor of another module comes (checkpoints store a module's tensors side by side, in
    name order) and its required ones are all there."""
    convert, complete = _CONVERTERS[ckpt.format](ckpt)
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def flush(prefix: str) -> Weights:
        parts = pending.pop(prefix)
        try:
            canonical = convert(parts, ckpt.config)
        except ValueError as e:
            raise ModelLoadError(f"{ckpt.format} tensors of {prefix}: {e}") from None
        for key, value in canonical.items():
            yield f"{prefix}.{key}", value

    for name, t in weights:
        prefix, _, suffix = name.rpartition(".")
        for other in [p for p, parts in pending.items() if p != prefix and complete(parts)]:
            yield from flush(other)
        if not is_projection(name) or suffix == "bias":
            yield name, t
            continue
        pending.setdefault(prefix, {})[suffix] = t
    for prefix in [p for p, parts in pending.items() if complete(parts)]:
        yield from flush(prefix)
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise ModelLoadError(f"{ckpt.format} checkpoint: {prefix} has only {', '.join(sorted(parts))} "
                             f"({len(pending)} projection(s) incomplete)")


def _need(*names: str) -> Callable[[dict[str, torch.Tensor]], bool]:
    return lambda parts: all(n in parts for n in names)


def _expect(t: torch.Tensor, what: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{what} is {tuple(t.shape)} {t.dtype}, expected {shape}{f' {dtype}' if dtype else ''}")


def _act_order(q: torch.Tensor, g_idx: torch.Tensor, config: QuantConfig) -> dict[str, torch.Tensor]:
    """q [N, K] in input column order + g_idx [K] -> {"qweight" packed in group order, "perm"} (act-order), or
    {"qweight"} when g_idx is the plain k // group_size."""
    k = q.shape[1]
    plain = torch.arange(k, device=g_idx.device) // config.group_size
    g_idx = g_idx.to(torch.int64)
    if not config.act_order:
        if not torch.equal(g_idx, plain):
            raise ValueError("g_idx is not k // group_size but desc_act / actorder is off")
        return {"qweight": pack_int4(q)}
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(f"g_idx does not split the columns into groups of {config.group_size}")
    return {"qweight": pack_int4(q[:, perm.to(q.device)]), "perm": perm.to(torch.int32)}


def _int4_zeros(z: torch.Tensor, config: QuantConfig, what: str) -> dict[str, torch.Tensor]:
    """Zero points z [N, G] (integers) -> {"zeros": uint8} for asymmetric configs; symmetric ones must be all 8."""
    if config.symmetric:
        if not bool((z == 8).all()):
            raise ValueError(f"{what} are not all 8 although the config is symmetric")
        return {}
    if int(z.min()) < 0 or int(z.max()) > 255:
        raise ValueError(f"{what} lie outside 0..255")
    return {"zeros": z.to(torch.uint8).contiguous()}


def _gptq(parts: dict[str, torch.Tensor], config: QuantConfig, offset: int) -> dict[str, torch.Tensor]:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight is {tuple(qweight.shape)} {qweight.dtype}, expected int32 [in / 8, out]")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = -(-k // config.group_size)
    _expect(qzeros, "qzeros", (groups, -(-n // 8)), torch.int32)
    _expect(scales, "scales", (groups, n))
    q = unpack_int4(qweight.t().contiguous())  # [N, K]
    z = unpack_int4(qzeros)[:, :n].t().to(torch.int16) + offset  # v1 stores z - 1, v2 z
    g_idx = parts.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32) // config.group_size
    _expect(g_idx, "g_idx", (k,))
    return {**_act_order(q, g_idx, config), "scales": scales.t().contiguous(),
            **_int4_zeros(z, config, f"qzeros + {offset}")}


def _awq(parts: dict[str, torch.Tensor], config: QuantConfig) -> dict[str, torch.Tensor]:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight is {tuple(qweight.shape)} {qweight.dtype}, expected int32 [in, out / 8]")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = -(-k // config.group_size)
    _expect(qzeros, "qzeros", (groups, n // 8), torch.int32)
    _expect(scales, "scales", (groups, n))
    q = awq_unpack(qweight).t().contiguous()  # [N, K]
    z = awq_unpack(qzeros).t().to(torch.int16)
    return {"qweight": pack_int4(q), "scales": scales.t().contiguous(), **_int4_zeros(z, config, "qzeros")}


def _channel_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-channel [N, 1] / [N] or per-tensor [] / [1] scale -> float32 [N, 1]."""
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(n, 1).contiguous()
    _expect(scale.reshape(-1), "weight_scale", (n,))
    return scale.float().reshape(n, 1).contiguous()


def _ct_int4(parts: dict[str, torch.Tensor], config: QuantConfig) -> dict[str, torch.Tensor]:
    packed, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    n, k = (int(v) for v in shape.tolist())
    groups = -(-k // config.group_size)
    _expect(packed, "weight_packed", (n, -(-k // 8)), torch.int32)
    _expect(scale, "weight_scale", (n, groups))
    q = unpack_int4(packed)[:, :k]  # stored v + 8
    zp = parts.get("weight_zero_point")  # int32 [N/8, G], packed along the output dim (stored zp + 8)
    z = torch.full((n, groups), 8, dtype=torch.int16)
    if zp is not None:
        _expect(zp, "weight_zero_point", (-(-n // 8), groups), torch.int32)
        z = unpack_int4(zp.t().contiguous())[:, :n].t().to(torch.int16)
    g_idx = parts.get("weight_g_idx")
    g_idx = torch.arange(k, dtype=torch.int32) // config.group_size if g_idx is None else g_idx
    _expect(g_idx, "weight_g_idx", (k,))
    return {**_act_order(q, g_idx, config), "scales": scale.contiguous(),
            **_int4_zeros(z, config, "weight_zero_point + 8")}


def _ct_dense(parts: dict[str, torch.Tensor], config: QuantConfig) -> dict[str, torch.Tensor]:
    """int8 or fp8 weight [N, K] + weight_scale (per channel or tensor); zero points must be 0."""
    weight, scale = parts["weight"], parts["weight_scale"]
    want = torch.int8 if config.method == "int8" else torch.float8_e4m3fn
    if weight.dtype != want or weight.dim() != 2:
        raise ValueError(f"weight is {tuple(weight.shape)} {weight.dtype}, expected {want} [out, in]")
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(f"weight is {tuple(weight.shape)} {weight.dtype} but weight_scale {tuple(scale.shape)}: "
                         "one scale per output row (or one for the tensor) expected")
    zp = parts.get("weight_zero_point")
    if zp is not None and bool((zp != 0).any()):
        raise ValueError("weight_zero_point is not 0: asymmetric weights are not supported in this format")
    return {"qweight": weight.contiguous(), "scales": _channel_scales(scale, weight.shape[0])}


def _ct_int8_packed(parts: dict[str, torch.Tensor], config: QuantConfig) -> dict[str, torch.Tensor]:
    """pack-quantized int8 (what llm-compressor writes for W8A16): weight_packed int32 [N, K/4], element k at
    bits 8 (k % 4) of word k // 4, stored v + 128; weight_scale per channel."""
    packed, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    n, k = (int(v) for v in shape.tolist())
    _expect(packed, "weight_packed", (n, -(-k // 4)), torch.int32)
    shifts = torch.arange(0, 32, 8, dtype=torch.int32)
    stored = ((packed[..., None] >> shifts) & 0xFF).reshape(n, -1)[:, :k]
    return _ct_dense({"weight": (stored - 128).to(torch.int8), "weight_scale": scale}, config)


def _ct_converter(ckpt: CheckpointQuant) -> tuple[Callable[..., dict[str, torch.Tensor]],
                                                  Callable[[dict[str, torch.Tensor]], bool]]:
    if ckpt.option("ct_format") != "pack-quantized":
        return _ct_dense, _need("weight", "weight_scale")
    if ckpt.config.method == "int8":
        return _ct_int8_packed, _need("weight_packed", "weight_scale", "weight_shape")
    names = ["weight_packed", "weight_scale", "weight_shape"]
    names += [] if ckpt.config.symmetric else ["weight_zero_point"]
    names += ["weight_g_idx"] if ckpt.config.act_order else []
    return _ct_int4, _need(*names)


_CONVERTERS: dict[str, Callable[[CheckpointQuant], tuple[Callable[..., dict[str, torch.Tensor]],
                                                         Callable[[dict[str, torch.Tensor]], bool]]]] = {
    "gptq": lambda c: (functools.partial(_gptq, offset=c.option("zero_offset")),
                       _need("qweight", "qzeros", "scales")),
    "awq": lambda c: (_awq, _need("qweight", "qzeros", "scales")),
    "compressed-tensors": _ct_converter,
    "fp8": lambda c: (_ct_dense, _need("weight", "weight_scale")),
}
