"""GGUF files (llama.cpp): metadata -> ModelArch, tensors -> HF-named weights.

Supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the K-quants Q2_K..Q6_K (the Q4_K_M / Q5_K_M
files most GGUF users hold). By default every tensor is dequantized to float32 one at a time (with ggml's numpy
reference on CPU, and for the K-quants everywhere; with the torch kernels below for Q8_0 / Q4_0 / Q4_1 on
other devices). When the decoder-layer projections all share one of Q8_0, Q4_0, Q4_1, they can instead run
from their blocks (`native_projection_type`, worker/quant/gguf.py): iter_gguf_weights(native=...) then hands
each projection over as that method's tensors, repacked on the target device with the same bits, never
dequantized (embeddings, norms and lm_head are dequantized as before).
llama.cpp stores the Q and K projections of the "llama" architecture with the rows of every head
permuted (it uses interleaved-pair rope); that permutation is undone here so the weights fit the
HF/neox rotate_half convention used by the model. qwen2/qwen3 GGUFs are stored unpermuted.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.constants import GGML_QUANT_SIZES

from tokenmill.worker.config import ModelArch, RopeScaling
from tokenmill.worker.models.layers import ModelLoadError, rope_inv_freq
from tokenmill.worker.quant.gguf import NATIVE_TYPES, GgufLinearMethod, repack_blocks

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")

# ggml block layouts: elements per block, bytes per block.
_BLOCK_BYTES = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# dequantized by gguf.quants (numpy) on every device: the K-quants (blocks of 256 with packed sub-block scales) and
# Q5_0 / Q5_1 (blocks of 32 with a fifth bit plane), which llama.cpp's Q4_K_M / Q5_K_M files use for the tensors
# whose rows are not a multiple of 256 (e.g. hidden size 896)
_LIBRARY_TYPES = (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q2_K,
                  GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                  GGMLQuantizationType.Q6_K)
_SUPPORTED = ", ".join(t.name for t in (*_FLOAT_TYPES, *_BLOCK_BYTES, *_LIBRARY_TYPES))

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors consumed into the ModelArch rather than loaded as weights.
_SKIPPED = ("rope_freqs.weight",)


def open_gguf(path: Path) -> GGUFReader:
    """A reader over the memory-mapped file. Parsing the metadata of a big vocabulary takes seconds, so
    the last reader is reused while the file's size and mtime are unchanged (resolve, then load)."""
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"cannot open GGUF file {path}: {e}") from e
    return _cached_reader(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_reader(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on truncated or corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from e


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata (general.*, tokenizer.*, <arch>.*) as plain Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> Hugging Face transformers name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ModelLoadError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _tensor(reader: GGUFReader, name: str) -> ReaderTensor | None:
    return next((t for t in reader.tensors if t.name == name), None)


def read_gguf_arch(reader: GGUFReader, meta: dict[str, Any], path: Path) -> ModelArch:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path}; "
                             f"supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    embd = _tensor(reader, "token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF file {path} lacks metadata key {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    theta = float(key("rope.freq_base", 10000.0))
    window = meta.get(f"{arch}.attention.sliding_window")
    try:
        return ModelArch(
            arch=arch,
            vocab_size=int(embd.shape[1]),  # ggml dims are [hidden, vocab]
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=_rope_scaling(reader, meta, arch, head_dim, theta, path),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings=_tensor(reader, "output.weight") is None,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_eos_ids(meta),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"inconsistent GGUF metadata in {path}: {e}") from e


def _eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(int(meta[k]) for k in keys if meta.get(k) is not None))


def _rope_scaling(
    reader: GGUFReader, meta: dict[str, Any], arch: str, head_dim: int, theta: float, path: Path
) -> RopeScaling:
    """Linear scaling from metadata; Llama 3.1 scaling recognised from its `rope_freqs` tensor."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    if kind not in ("none", None):
        raise ModelLoadError(f"unsupported rope scaling type {kind!r} in {path}")
    freqs = _tensor(reader, "rope_freqs.weight")
    if freqs is None:
        return RopeScaling()
    return _llama3_from_rope_freqs(torch.from_numpy(np.array(freqs.data, dtype=np.float32)), head_dim,
                                   theta, path)


def _llama3_from_rope_freqs(divisors: torch.Tensor, head_dim: int, theta: float, path: Path) -> RopeScaling:
    """llama.cpp stores Llama 3.1 scaling as per-frequency divisors [head_dim / 2]; the largest is the
    scaling factor. The other parameters are Meta's (1, 4, 8192); checked against the stored divisors."""
    scaling = RopeScaling(kind="llama3", factor=float(divisors.max()), low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position=8192)
    expected = rope_inv_freq(head_dim, theta, RopeScaling()) / rope_inv_freq(head_dim, theta, scaling)
    if divisors.shape != expected.shape or not torch.allclose(divisors, expected, rtol=1e-3):
        raise ModelLoadError(f"rope_freqs tensor in {path} does not match Llama 3.1 rope scaling")
    return scaling


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of a Q/K weight [n_head * D, ...] or bias [n_head * D]:
    it stored rows (half-index, pair) where HF has (pair, half-index)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _checked(t: ReaderTensor) -> tuple[GGMLQuantizationType, tuple[int, ...]]:
    """(type, numpy/HF-order shape) of a tensor of a supported type whose byte count fits its shape."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype not in _FLOAT_TYPES and qtype not in _BLOCK_BYTES and qtype not in _LIBRARY_TYPES:
        raise ModelLoadError(f"GGUF tensor {t.name!r} has unsupported type {qtype.name} (supported: {_SUPPORTED})")
    numel = int(np.prod(shape))
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    expected_bytes = numel // block * block_bytes
    if t.data.nbytes != expected_bytes or numel % block or shape[-1] % block:
        raise ModelLoadError(f"GGUF tensor {t.name!r} holds {t.data.nbytes} bytes, "
                             f"{qtype.name} {shape} needs {expected_bytes} (corrupt file?)")
    return qtype, shape


def dequantize(t: ReaderTensor, device: torch.device) -> torch.Tensor:
    """The tensor as float32 on device, shaped in numpy/HF order (reversed ggml dims)."""
    qtype, shape = _checked(t)
    if qtype in _LIBRARY_TYPES or (qtype in _BLOCK_BYTES and device.type == "cpu"):
        # ggml's numpy reference is several times faster than the torch kernels below on CPU.
        return torch.from_numpy(gguf.quants.dequantize(t.data, qtype)).reshape(shape).to(device)
    raw = torch.from_numpy(np.array(t.data)).to(device)  # copied out of the read-only memmap
    if qtype == GGMLQuantizationType.BF16:
        return raw.reshape(-1).view(torch.bfloat16).float().reshape(shape)
    if qtype in _FLOAT_TYPES:
        return raw.float().reshape(shape)
    blocks = raw.reshape(-1, _BLOCK_BYTES[qtype])
    return dequantize_blocks(blocks, qtype).reshape(shape)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[N, 1] float32 from the little-endian fp16 at byte `start` of each block [N, bytes] uint8."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [N, 16] uint8 -> [N, 32] float32: element j is the low nibble of byte j, element 16 + j the high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def dequantize_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """blocks [N, bytes] uint8 -> [N, 32] float32."""
    if qtype == GGMLQuantizationType.Q8_0:  # d fp16 | 32 x int8; x = d * q
        return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if qtype == GGMLQuantizationType.Q4_0:  # d fp16 | 16 bytes of nibbles; x = d * (q - 8)
        return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)
    # Q4_1: d fp16 | m fp16 | 16 bytes of nibbles; x = d * q + m
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]) + _f16(blocks, 2)


def _is_projection_weight(hf: str) -> bool:
    parts = hf.split(".")  # model.layers.N.<self_attn|mlp>.<x>_proj.weight
    return len(parts) == 6 and parts[1] == "layers" and parts[4].endswith("_proj") and parts[5] == "weight"


def projection_types(reader: GGUFReader) -> dict[str, int]:
    """ggml type name -> how many decoder-layer projection weights (q/k/v/o/gate/up/down) the file stores in it."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if t.name not in _SKIPPED and _is_projection_weight(hf_name(t.name)):
            qname = GGMLQuantizationType(t.tensor_type).name
            counts[qname] = counts.get(qname, 0) + 1
    return counts


def native_projection_type(reader: GGUFReader) -> str | None:
    """The GgufLinearMethod type ("q8_0", "q4_0", "q4_1") that every projection weight of the file is stored in,
    or None when they use another type or several (then the file is dequantized on load)."""
    types = projection_types(reader)
    if len(types) != 1:
        return None
    qtype = next(iter(types)).lower()
    return qtype if qtype in NATIVE_TYPES else None


def _native_tensors(t: ReaderTensor, method: GgufLinearMethod, device: torch.device) -> dict[str, torch.Tensor]:
    """A projection weight's blocks -> method's canonical tensors on device (repacked, the same bits)."""
    qtype, shape = _checked(t)
    if qtype.name.lower() != method.qtype:
        raise ModelLoadError(f"GGUF tensor {t.name!r} is {qtype.name}; the model runs {method.qtype.upper()} "
                             "blocks natively (every projection must share one type)")
    raw = torch.from_numpy(np.array(t.data)).to(device)  # copied out of the read-only memmap
    return repack_blocks(raw.reshape(shape[0], -1), method.qtype)


def iter_gguf_weights(
    path: Path, arch: ModelArch, device: torch.device, dtype: torch.dtype, native: GgufLinearMethod | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor on device), one tensor at a time: dequantized in dtype, except with `native` the
    decoder-layer projection weights, which come as native's canonical tensors (`<prefix>.qweight`,
    `.scales`, `.mins`; every one has the output rows first, so the llama Q/K rows are un-permuted alike)."""
    reader = open_gguf(path)
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name)
        if native is not None and _is_projection_weight(name):
            parts = {name.removesuffix("weight") + k: v for k, v in _native_tensors(t, native, device).items()}
        else:
            parts = {name: dequantize(t, device).to(dtype)}
        for part, w in parts.items():
            if arch.arch == "llama" and ".q_proj." in part:
                w = unpermute_qk(w, arch.num_heads)
            elif arch.arch == "llama" and ".k_proj." in part:
                w = unpermute_qk(w, arch.num_kv_heads)
            yield part, w
