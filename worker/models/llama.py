"""Llama-family decoder (Llama 2/3/3.1, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

The module tree mirrors Hugging Face transformers (model.embed_tokens, model.layers.N.self_attn, ...,
model.norm, lm_head) except that q/k/v and gate/up projections are fused into `qkv_proj` ([q|k|v] rows)
and `gate_up_proj` ([gate|up] rows); `load_weights` takes HF names and fills the fused slices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from tokenmill.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata, KVCache
from tokenmill.worker.config import ModelArch
from tokenmill.worker.models.layers import (
    SINGLE_DEVICE,
    LayerFactory,
    ModelLoadError,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
)
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.unquantized import UnquantizedLinearMethod

# Steps of at most this many tokens use the fused decode GEMMs (kernels/gemv.py). Measured on the H200
# (bench_gemv): at 1 token they beat cuBLAS + the separate norm/SwiGLU kernels on all four projections; at
# 8 tokens cuBLAS wins on qkv, gate_up and down, so batches go to cuBLAS (figures: kernels/gemv.py's notes).
SKINNY_MAX_TOKENS = 1

# HF names that may appear in checkpoints but carry nothing we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, rotary: RotaryEmbedding,
                 linear_method: LinearMethod | None, dtype: torch.dtype, layers: LayerFactory = SINGLE_DEVICE) -> None:
        super().__init__()
        # This rank's heads (all of them on one device): q and kv heads split alike, so GQA groups stay whole.
        self.num_heads = arch.num_heads // layers.shards
        self.num_kv_heads = arch.num_kv_heads // layers.shards
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.backend = backend
        # rotary: shared by all layers, holds no parameters; its table is on the model's device already
        # kv_scales [2, this rank's kv heads]: ones until an fp8 KV cache calibrates them (attention/kv_scales.py)
        kv_scales = torch.ones((2, self.num_kv_heads), device=rotary.cos_sin_cache.device)
        self.spec = AttentionLayer(arch.head_dim**-0.5, arch.sliding_window, rotary.cos_sin_cache, kv_scales)
        self.qkv_proj = layers.column(arch.hidden_size, [arch.q_size, arch.kv_size, arch.kv_size], arch.qkv_bias,
                                      linear_method, dtype)
        self.o_proj = layers.row(arch.q_size, arch.hidden_size, False, linear_method, dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """positions: [T]; x: [T, hidden] -> [T, hidden]."""
        return self.o_proj(self.attend(positions, self.qkv_proj(x), kv_cache, meta))

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """qkv: [T, q_size + 2 kv_size] (the fused projection's output) -> attention output [T, q_size],
        before o_proj. Writes this step's keys and values into kv_cache."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.backend.forward(self.spec, q, k, v, positions, kv_cache, meta)  # rotary inside
        return out.reshape(num_tokens, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, linear_method: LinearMethod | None, dtype: torch.dtype,
                 layers: LayerFactory = SINGLE_DEVICE) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = layers.column(arch.hidden_size, [inter, inter], False, linear_method, dtype)
        self.down_proj = layers.row(inter, arch.hidden_size, False, linear_method, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, rotary: RotaryEmbedding,
                 linear_method: LinearMethod | None, dtype: torch.dtype, layers: LayerFactory = SINGLE_DEVICE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(arch, backend, rotary, linear_method, dtype, layers)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(arch, linear_method, dtype, layers)
        # Few-token steps (decode) on CUDA with the Triton backend go through the linear methods' fused
        # decode kernels: each reads its weight once and computes its input on the fly (the norm, the
        # SwiGLU product), so four projections replace seven kernels per layer. A method whose format has
        # no such kernel runs the unfused ops there instead (worker/quant/base.py).
        self.skinny_decode = backend.name == "triton"

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried as (h, residual) with stream = h + residual (residual None in
        the first layer), so each residual add fuses into the following norm. Shapes [T, hidden]."""
        if self.skinny_decode and h.is_cuda and h.shape[0] <= SKINNY_MAX_TOKENS:
            return self._forward_skinny(positions, h, residual, kv_cache, meta)
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(x), residual

    def _forward_skinny(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() for T <= SKINNY_MAX_TOKENS through the fused decode entry points of the layers'
        linear methods (norm -> qkv, o_proj, norm -> gate_up, SwiGLU -> down); same numerics."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.forward_norm(self.input_layernorm, h, residual)
        o = attn.o_proj.forward_skinny(attn.attend(positions, qkv, kv_cache, meta))
        gate_up, residual = mlp.gate_up_proj.forward_norm(self.post_attention_layernorm, o, residual)
        return mlp.down_proj.forward_silu_mul(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        linear_method: LinearMethod | None,
        dtype: torch.dtype,
        layers: LayerFactory,
    ) -> None:
        super().__init__()
        self.embed_tokens: VocabEmbedding = layers.embedding(arch.vocab_size, arch.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                          arch.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, backend, self.rotary_emb, linear_method, dtype, layers)
            for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] float32."""

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        linear_method: LinearMethod | None = None,
        layers: LayerFactory | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        self.linear_method = linear_method  # the decoder layers' projections (None: dense)
        layers = layers if layers is not None else SINGLE_DEVICE  # one device, or one tensor-parallel rank
        with torch.device(self.device):
            self.model = LlamaModel(arch, backend, linear_method, dtype, layers)
            # Tied models read logits straight off embed_tokens.weight; lm_head is then None.
            self.lm_head: nn.Module | None = None
            if not arch.tie_word_embeddings:
                self.lm_head = layers.lm_head(arch.hidden_size, arch.vocab_size, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches[i] belongs to layer i. Returns [T, hidden]."""
        return self.forward_recording(input_ids, positions, kv_caches, meta, ())[0]

    def forward_recording(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        layers: Sequence[int],
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward(), also recording the residual stream after each decoder layer of `layers` (0-based; an EAGLE-3
        head's fusion layers): for layer i, h + residual as layer i returns them, i.e. the un-normed hidden
        state [T, hidden] that layer i + 1 reads (what HF's output_hidden_states[i + 1] is, for i below the last
        layer), in the order of `layers`; only its rows `rows` ([R] int64 indices; None: all T) are kept, each
        [R, hidden]. With no layers nothing is recorded and nothing is added to the forward."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.model.layers)} layers")
        h = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        recorded: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            h, residual = layer(positions, h, residual, kv_cache, meta)
            if i in layers:  # a new tensor: later layers may fuse their adds into h or residual in place
                recorded[i] = h + residual if rows is None else h[rows] + residual[rows]
        assert residual is not None
        out, _ = self.model.norm.add_forward(h, residual)
        return out, [recorded[i] for i in layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32 (through embed_tokens.weight when tied)."""
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden)
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (possibly fused) parameters, casting dtype and device. Projection
        tensors are in their LinearMethod's canonical layout and go through it (worker/quant/base.py).
        Raises ModelLoadError on an unexpected name, a shape or dtype mismatch, or a tensor never provided."""
        expected = expected_hf_weights(self.arch, self.linear_method)
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in expected:
                raise ModelLoadError(f"unexpected weight {name!r} for a {self.arch.arch} model "
                                     f"with {self.arch.num_layers} layers{_method_note(self.linear_method)}")
            if tuple(tensor.shape) != expected[name]:
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {expected[name]}")
            param_name, rows = fused_target(name, self.arch)
            module_name, _, suffix = param_name.rpartition(".")
            load_part = getattr(modules.get(module_name), "load_part", None)  # projections, vocabulary layers
            if load_part is not None:
                try:  # a tensor-parallel rank's layer keeps its slice of the tensor
                    load_part(suffix, tensor, rows)
                except ValueError as e:
                    raise ModelLoadError(f"weight {name!r}: {e}") from None
            else:
                target = params[param_name].data
                if rows is not None:
                    target = target[rows[0]:rows[1]]
                target.copy_(tensor)
            seen.add(name)
        missing = [n for n in expected if n not in seen]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint is missing {len(missing)} weight(s): {shown}")


def _method_note(method: LinearMethod | None) -> str:
    return "" if method is None else f" with {method.name} projections"


def _fused_shards(arch: ModelArch) -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (fused module name, first row, end row) in the fused weight."""
    q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
    return {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, q + kv),
        "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, 2 * inter),
    }


def fused_target(hf_name: str, arch: ModelArch) -> tuple[str, tuple[int, int] | None]:
    """Our parameter name for an HF weight name, and the row range it fills (None: the whole tensor)."""
    parts = hf_name.split(".")
    shard = _fused_shards(arch).get(parts[-2]) if len(parts) >= 2 else None
    if shard is None:
        return hf_name, None
    fused, start, end = shard
    return ".".join([*parts[:-2], fused, parts[-1]]), (start, end)


def projections(arch: ModelArch) -> list[tuple[str, int, int]]:
    """(HF module name under model.layers.N, in_features, out_features) of every decoder-layer projection."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    return [("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
            ("self_attn.o_proj", q, h), ("mlp.gate_proj", h, inter), ("mlp.up_proj", h, inter),
            ("mlp.down_proj", inter, h)]


def expected_hf_weights(arch: ModelArch, method: LinearMethod | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF-named tensor a checkpoint of `arch` must provide, with its shape (HF layout [out, in]; the
    projections in `method`'s canonical layout, dense by default)."""
    h, q, kv, d = arch.hidden_size, arch.q_size, arch.kv_size, arch.head_dim
    method = method if method is not None else UnquantizedLinearMethod()
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, fan_in, fan_out in projections(arch):
            for suffix, shape in method.param_shapes(fan_in, fan_out).items():
                shapes[f"{p}{proj}.{suffix}"] = shape
        if arch.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes
