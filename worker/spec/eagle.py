"""EAGLE draft head: one decoder layer over the target's own features (EAGLE-1), optionally fused from three
of the target's layers (EAGLE-3).

At position t the head reads the target's feature f_t (its final-normed hidden state, what the target's LM
head turns into the logits of token t+1) and the embedding of the token that followed, x_{t+1}:
    f^_{t+1} = layer(fc([embed(x_{t+1}); f_t]))        fc: [2H] -> [H], one Llama decoder layer
and the target's LM head turns f^_{t+1} into the draft of token t+2. The embedding and the LM head are the
target's (not stored in the head); the head's checkpoint is its fc and its layer (safetensors) plus a JSON
config naming the target shape it was trained for, which `load_eagle_head` checks.

The layer has the target's shape (ModelArch with one layer, no sliding window) and runs through any
attention backend; `DenseCausalBackend` is the cache-free one training uses (eagle_train's UnrolledDenseBackend
extends it to the draft steps past the first). The head is trained by
worker/spec/eagle_train.py (`tokenmill train-eagle`); the engine drafts with it through
worker/spec/eagle_proposer.py. Heads shipped with the package live in worker/spec/heads/<name>/
(`SHIPPED_HEADS`: the model each one is for).

EAGLE-3's fusion (a head with `fusion_layers` (low, mid, high), format "tokenmill-eagle-3"): the target feature
of position t is instead
    g_t = fuse([s^low_t; s^mid_t; s^high_t])        fuse: [3H] -> [H], no bias
s^i_t the target's residual stream after decoder layer i (un-normed; LlamaForCausalLM.forward_recording), each
RMS-normed before `fuse` (the streams' scales differ by orders of magnitude), and g_t takes f_t's place above; the
head's output is RMS-normed (`out_norm`) before the LM head reads it, as the target's features are. Drafting steps
past the first read the head's own output f^ where g would be (as EAGLE-3 does). Without fusion layers the head, its
weights and its config are EAGLE-1's, byte for byte ("tokenmill-eagle-1"), so heads saved before the option existed
load unchanged."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tokenmill.kernels.attention_ref import rotary_embedding_ref
from tokenmill.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata, KVCache
from tokenmill.worker.config import ModelArch, RopeScaling
from tokenmill.worker.models.layers import Linear, RMSNorm, RotaryEmbedding
from tokenmill.worker.models.llama import LlamaDecoderLayer

EAGLE_FORMAT = "tokenmill-eagle-1"  # a head without fusion layers
EAGLE3_FORMAT = "tokenmill-eagle-3"  # a head with fusion layers (its config's "fusion_layers")
FusionLayers = tuple[int, int, int]  # (low, mid, high) decoder-layer indices of the target, 0-based
CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "model.safetensors"
HEADS_DIR = Path(__file__).parent / "heads"
SHIPPED_HEADS = {"embedded": "smollm2-135m-instruct"}  # engine model name -> folder under HEADS_DIR


class EagleHeadError(ValueError):
    """A draft-head checkpoint that cannot be used with this target (the message says why)."""


class DenseCausalBackend(AttentionBackend):
    """Attention without a KV cache: each request of the flattened batch attends causally to its own query
    tokens (its whole sequence, positions 0..n-1). Differentiable; for training, never for serving."""

    name = "dense"

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.query_lens_cpu == meta.seq_lens_cpu, "dense attention: every request is its whole sequence"
        assert layer.sliding_window is None
        q, k = rotary_embedding_ref(q, k, layer.cos_sin_cache, positions)
        group = q.shape[1] // k.shape[1]
        outs, start = [], 0
        for n in meta.query_lens_cpu:  # [n, H, D] -> [H, n, D] per request
            qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=layer.scale).transpose(0, 1))
            start += n
        return torch.cat(outs)


def draft_arch(target: ModelArch) -> ModelArch:
    """The head's layer shape: the target's, one layer, full attention."""
    return dataclasses.replace(target, num_layers=1, sliding_window=None)


def auto_fusion_layers(num_layers: int) -> FusionLayers:
    """EAGLE-3's usual choice of low / middle / high layers for a target of `num_layers` decoder layers:
    2, num_layers // 2, num_layers - 3 (in order from 6 layers up). Raises ValueError below that."""
    if num_layers < 6:
        raise ValueError(f"automatic fusion layers (2, n // 2, n - 3) need a target of at least 6 layers, this one "
                         f"has {num_layers}: name three layers in [0, {num_layers}) instead")
    return 2, num_layers // 2, num_layers - 3


def check_fusion_layers(layers: Sequence[int], num_layers: int) -> FusionLayers:
    """`layers` as FusionLayers if they are three decoder-layer indices of a `num_layers`-layer target, else
    ValueError saying what is wrong."""
    if len(layers) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"fusion layers must be three layer indices (low, mid, high), got {list(layers)}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"fusion layer {bad[0]} is out of range for a target of {num_layers} layers "
                         f"(indices 0 .. {num_layers - 1})")
    return layers[0], layers[1], layers[2]


class EagleHead(nn.Module):
    """forward(token_embeds [T, H], features [T, H], positions [T], kv_cache, meta) -> predicted features
    [T, H]: row t is f^_{t+1} from (embed(x_{t+1}), f_t). The target's rows reach `features` through
    `fuse` (EAGLE-1: f_t as is; with fusion layers: g_t from the three recorded layer states)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, *, dtype: torch.dtype,
                 device: torch.device, fusion_layers: FusionLayers | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.fusion_layers = fusion_layers
        with torch.device(device):
            rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
            self.fc = Linear(2 * arch.hidden_size, arch.hidden_size, True, dtype=dtype)
            self.layer = LlamaDecoderLayer(arch, backend, rotary, None, dtype)  # its attention keeps the table
            # EAGLE-3: [s^low; s^mid; s^high] [T, 3H] -> g [T, H]. The residual streams are un-normed and of
            # very different scales, so each is RMS-normed before the fusion; and the head's output, which the LM
            # head reads as it reads the target's final-normed features, is normed as those are (out_norm)
            self.fuse_fc = Linear(3 * arch.hidden_size, arch.hidden_size, False, dtype=dtype) if fusion_layers else None
            self.fuse_norms = nn.ModuleList(RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)
                                            for _ in range(3)) if fusion_layers else None
            self.out_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype) if fusion_layers else None

    def fuse(self, target_rows: Tensor) -> Tensor:
        """The head's feature input [T, H] from the target's kept rows: [T, H] final-normed features f_t
        (EAGLE-1: returned as they are), or [T, 3H] layer states [s^low; s^mid; s^high] -> g_t."""
        if self.fuse_fc is None or self.fuse_norms is None:
            return target_rows
        states = target_rows.chunk(3, dim=-1)  # s^low, s^mid, s^high [T, H] each
        return self.fuse_fc(torch.cat([norm(s.contiguous()) for norm, s in zip(self.fuse_norms, states)], dim=-1))

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        h, residual = self.layer(positions, x, None, kv_cache, meta)
        if self.out_norm is None:
            return h + residual
        return self.out_norm.add_forward(h, residual)[0]

    def save(self, out: Path, target: dict[str, Any], training: dict[str, Any]) -> None:
        """model.safetensors (fc and layer, and fuse_fc with fusion layers) and eagle_config.json (format, fusion
        layers if any, arch, target, training) in `out`."""
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / WEIGHTS_FILE))
        config: dict[str, Any] = {"format": EAGLE_FORMAT, "arch": _arch_to_json(self.arch)}
        if self.fusion_layers is not None:
            config = {"format": EAGLE3_FORMAT, "fusion_layers": list(self.fusion_layers), "arch": config["arch"]}
        config |= {"target": target, "training": training}
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_eagle_head(path: Path, target: ModelArch, backend: AttentionBackend, *, dtype: torch.dtype,
                    device: torch.device) -> EagleHead:
    """The head saved in folder `path`, checked against the target it will draft for. Raises EagleHeadError."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EagleHeadError(f"{path}: no readable {CONFIG_FILE} ({e})") from None
    if not isinstance(config, dict) or config.get("format") not in (EAGLE_FORMAT, EAGLE3_FORMAT):
        raise EagleHeadError(f"{path}: not a {EAGLE_FORMAT} checkpoint (nor {EAGLE3_FORMAT})")
    fusion = _fusion_layers(path, config, target)
    try:
        arch = _arch_from_json(config["arch"])
    except (KeyError, TypeError, ValueError) as e:
        raise EagleHeadError(f"{path}: bad arch in {CONFIG_FILE} ({e})") from None
    want = draft_arch(target)
    misfit = [f"{f.name} {getattr(arch, f.name)} (the target has {getattr(want, f.name)})"
              for f in dataclasses.fields(ModelArch)
              if f.name not in ("bos_token_id", "eos_token_ids") and getattr(arch, f.name) != getattr(want, f.name)]
    if misfit:
        raise EagleHeadError(f"{path}: the head does not fit the target: " + "; ".join(misfit))
    head = EagleHead(arch, backend, dtype=dtype, device=device, fusion_layers=fusion)
    try:
        weights = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise EagleHeadError(f"{path}: cannot read {WEIGHTS_FILE} ({e})") from None
    expected = head.state_dict()
    if set(weights) != set(expected):
        raise EagleHeadError(f"{path}: weights {sorted(set(weights) ^ set(expected))} missing or unexpected")
    bad = [n for n, t in weights.items() if t.shape != expected[n].shape]
    if bad:
        raise EagleHeadError(f"{path}: weight {bad[0]} has shape {tuple(weights[bad[0]].shape)}, "
                             f"the head expects {tuple(expected[bad[0]].shape)}")
    head.load_state_dict(weights)
    return head


def _fusion_layers(path: Path, config: dict[str, Any], target: ModelArch) -> FusionLayers | None:
    """The fusion layers of a checkpoint's config (None for EAGLE-1), checked against the target's layers."""
    if config["format"] == EAGLE_FORMAT:
        return None
    layers = config.get("fusion_layers")
    try:
        if not isinstance(layers, list):
            raise ValueError(f"fusion layers must be a list of three layer indices, got {layers!r}")
        return check_fusion_layers(layers, target.num_layers)
    except ValueError as e:
        raise EagleHeadError(f"{path}: the head does not fit the target: {e}") from None


def head_folder(draft_model: str | None, model_name: str) -> Path:
    """The head to draft with: `draft_model` if given, else the head shipped for `model_name`. Raises
    EagleHeadError when there is none."""
    if draft_model is not None:
        return Path(draft_model).expanduser()
    name = SHIPPED_HEADS.get(model_name)
    if name is None or not (HEADS_DIR / name / CONFIG_FILE).is_file():
        shipped = ", ".join(f"{m!r}" for m, n in SHIPPED_HEADS.items() if (HEADS_DIR / n / CONFIG_FILE).is_file())
        raise EagleHeadError(f"no EAGLE head is shipped for model {model_name!r} (shipped for: {shipped or 'none'}); "
                             "pass --draft-model DIR, a head made by `tokenmill train-eagle`")
    return HEADS_DIR / name


def _arch_to_json(arch: ModelArch) -> dict[str, Any]:
    d = dataclasses.asdict(arch)
    d["eos_token_ids"] = list(arch.eos_token_ids)
    return d


def _arch_from_json(d: dict[str, Any]) -> ModelArch:
    d = dict(d)
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelArch(**d)
