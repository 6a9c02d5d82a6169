"""Quantize a whole dense model: every decoder-layer projection to the canonical tensors of its format
(worker/quant/base.py), by round to nearest or, for INT4 and FP8, by GPTQ over calibration sequences.

GPTQ runs layer by layer (the usual sequential scheme): the calibration sequences' hidden states enter layer i
as the already quantized layers 0..i-1 produce them; forward pre-hooks collect the Hessians of the inputs of
its four projections (qkv, o, gate_up, down), in one pass or, true-sequential (GptqOptions), in four: qkv,
then o with qkv quantized, then gate_up, then down with all before it quantized; each projection is quantized
(the parts of a fused one share its Hessian and column order) and its weight replaced by its dequantized
value; the sequences then run through the quantized layer again to give layer i + 1 its inputs. The model must
be dense, on the CPU with the torch attention backend (this is an offline tool); it is modified in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from tokenmill.kernels.quant_weight import PackedWeight, dequantize_packed, pack_int4
from tokenmill.worker.attention.backend import AttentionMetadata, KVCache
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, fused_target, projections
from tokenmill.worker.quant.config import QuantConfig, make_linear_method
from tokenmill.worker.quant.gptq import GptqOptions, Hessian, gptq_quantize, gptq_quantize_fp8
from tokenmill.worker.quant.int4 import Int4LinearMethod
from tokenmill.worker.quant.rtn import MseClip

Canonical = dict[str, dict[str, torch.Tensor]]  # HF projection name (model.layers.N.self_attn.q_proj) -> tensors
Progress = Callable[[str], None]
DEFAULT_OPTIONS = GptqOptions()


def rtn_quantize_model(model: LlamaForCausalLM, config: QuantConfig, progress: Progress | None = None, *,
                       clip: MseClip | None = None) -> Canonical:
    """Round to nearest: each HF projection's dense weight through the method's `quantize` (INT4 scales in
    float16, what checkpoints store; `clip`: INT4's group-range search, worker/quant/rtn.py)."""
    method = make_linear_method(config, torch.device("cpu"), fp8_emulation=True)
    assert method is not None, "quantization method 'none' has nothing to quantize"
    if clip is not None and not isinstance(method, Int4LinearMethod):
        raise ValueError(f"clipping is an INT4 option, not {config.method}'s")
    quantize = functools.partial(method.quantize, scale_dtype=torch.float16, clip=clip) if isinstance(
        method, Int4LinearMethod) else method.quantize
    params = dict(model.named_parameters())
    out: Canonical = {}
    for i in range(model.arch.num_layers):
        for hf, _, _ in projections(model.arch):
            name = f"model.layers.{i}.{hf}"
            param, rows = fused_target(name + ".weight", model.arch)
            weight = params[param].data
            out[name] = quantize(weight if rows is None else weight[rows[0]:rows[1]])
        if progress is not None:
            progress(f"layer {i + 1}/{model.arch.num_layers}")
    return out


# ---- GPTQ ------------------------------------------------------------------------------------------------


class _Sequence:
    """One calibration sequence: its positions, attention metadata, and the residual stream entering the next
    layer (h, residual)."""

    def __init__(self, model: LlamaForCausalLM, ids: Sequence[int], block_size: int) -> None:
        n = len(ids)
        blocks = -(-n // block_size)
        self.positions = torch.arange(n)
        self.meta: AttentionMetadata = attention_metadata([n], [n], [list(range(blocks))], list(range(n)),
                                                          torch.device("cpu"))
        self.h = model.model.embed_tokens(torch.tensor(list(ids), dtype=torch.int64))
        self.residual: torch.Tensor | None = None


def gptq_quantize_model(model: LlamaForCausalLM, config: QuantConfig, sequences: Sequence[Sequence[int]],
                        progress: Progress | None = None, *, block_size: int = 16,
                        options: GptqOptions = DEFAULT_OPTIONS) -> Canonical:
    """Sequential GPTQ of every decoder layer (INT4: config's group size / symmetry / act-order, scales float16;
    FP8: e4m3 per output channel, rounded in act-order; `options`: how it rounds), calibrated on token-id
    `sequences`. Returns the canonical tensors per HF projection name."""
    if config.method not in ("int4", "fp8"):
        raise ValueError(f"GPTQ quantizes to int4 or fp8, not {config.method}")
    if config.method == "fp8" and options.clip is not None:
        raise ValueError("clipping is an INT4 option, not fp8's")
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("GPTQ needs non-empty calibration sequences")
    if model.linear_method is not None or model.device.type != "cpu":
        raise ValueError("GPTQ runs on a dense model on the CPU")
    a = model.arch
    longest = max(len(s) for s in sequences)
    shape = (-(-longest // block_size), block_size, a.num_kv_heads, a.head_dim)
    cache: KVCache = (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
    out: Canonical = {}
    with torch.no_grad():
        seqs = [_Sequence(model, s, block_size) for s in sequences]
        for i, layer in enumerate(model.model.layers):
            decoder = cast(LlamaDecoderLayer, layer)
            for stage in _STAGES if options.true_sequential else (tuple(_linears(decoder)),):
                for fused, h in _collect_hessians(decoder, stage, seqs, cache).items():
                    out.update(_quantize_fused(model, decoder, i, fused, h.value(), config, options))
            for s in seqs:  # the quantized layer's outputs: the next layer's inputs
                s.h, s.residual = decoder(s.positions, s.h, s.residual, cache, s.meta)
            if progress is not None:
                progress(f"layer {i + 1}/{len(model.model.layers)}")
    return out


def _linears(layer: LlamaDecoderLayer) -> dict[str, nn.Module]:
    return {"self_attn.qkv_proj": layer.self_attn.qkv_proj, "self_attn.o_proj": layer.self_attn.o_proj,
            "mlp.gate_up_proj": layer.mlp.gate_up_proj, "mlp.down_proj": layer.mlp.down_proj}


# true-sequential order: each stage's inputs depend only on the stages before it
_STAGES = (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",))


def _collect_hessians(layer: LlamaDecoderLayer, names: tuple[str, ...], seqs: list[_Sequence], cache: KVCache,
                      ) -> dict[str, Hessian]:  # fmt: skip
    """The Hessians of the inputs of the projections `names` of `layer` over every sequence (one layer pass)."""
    linears = {name: m for name, m in _linears(layer).items() if name in names}
    hessians = {name: Hessian(cast(torch.Tensor, m.weight).shape[1]) for name, m in linears.items()}
    hooks = [m.register_forward_pre_hook(lambda _m, args, h=hessians[name]: h.add(args[0]))
             for name, m in linears.items()]
    try:
        for s in seqs:
            layer(s.positions, s.h, s.residual, cache, s.meta)
    finally:
        for hook in hooks:
            hook.remove()
    return hessians


def _quantize_fused(model: LlamaForCausalLM, layer: LlamaDecoderLayer, index: int, fused: str, h: torch.Tensor,
                    config: QuantConfig, options: GptqOptions) -> Canonical:
    """GPTQ of one (possibly fused) projection; its weight becomes the dequantized result; canonical tensors of
    each HF part."""
    module = _linears(layer)[fused]
    weight = cast(torch.Tensor, module.weight)
    whole: dict[str, torch.Tensor]
    if config.method == "fp8":
        qweight, scales = gptq_quantize_fp8(weight, h, damp=options.damp)
        weight.copy_((qweight.float() * scales).to(weight.dtype))
        whole = {"qweight": qweight, "scales": scales}
    else:
        whole = _gptq_int4(weight, h, config, options)
    out: Canonical = {}
    for hf, _, _ in projections(model.arch):
        name = f"model.layers.{index}.{hf}"
        param, rows = fused_target(name + ".weight", model.arch)
        if not param.endswith(f".{fused}.weight"):
            continue
        start, end = rows if rows is not None else (0, weight.shape[0])
        out[name] = {key: t if key == "perm" else t[start:end].clone() for key, t in whole.items()}
    return out


def _gptq_int4(weight: torch.Tensor, h: torch.Tensor, config: QuantConfig, options: GptqOptions,
               ) -> dict[str, torch.Tensor]:  # fmt: skip
    """INT4 GPTQ of a whole (possibly fused) weight, replaced by its dequantized value; its canonical tensors."""
    r = gptq_quantize(weight, h, config.group_size, config.symmetric, config.act_order, torch.float16,
                      damp=options.damp, clip=options.clip)
    perm = None if r.perm is None else r.perm.to(torch.int32)
    packed = PackedWeight(pack_int4(r.q), r.scales, None if config.symmetric else r.zeros, perm, 4,
                          config.group_size)
    weight.copy_(dequantize_packed(packed).to(weight.dtype))
    whole = {"qweight": packed.qweight, "scales": r.scales}
    if not config.symmetric:
        whole["zeros"] = r.zeros
    if perm is not None:
        whole["perm"] = perm
    return whole
