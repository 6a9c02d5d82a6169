"""GGUF Q8_0, Q4_0 and Q4_1 weights executed from their blocks (llama.cpp's legacy formats, 32 weights a block).

A ggml block of one output row holds 32 consecutive input columns:
    Q8_0  34 bytes: d fp16 | 32 x int8 q                        W = d * q
    Q4_0  18 bytes: d fp16 | 16 bytes of nibbles                W = d * (q - 8)
    Q4_1  20 bytes: d fp16 | m fp16 | 16 bytes of nibbles       W = d * q + m
    (nibbles: element j < 16 is the low nibble of byte j, element 16 + j its high nibble)

The layer keeps exactly these bits, repacked once at load into the PackedWeight layout of
kernels/quant_weight.py with groups of 32, so that the INT8 / INT4 Triton kernels (the skinny split-K and fused
decode kernels of kernels/quant_gemv.py, the tiled kernel of kernels/quant_gemm.py) run them unchanged:
    qweight  Q8_0: int8 [N, K] (the q bytes in place); Q4_0 / Q4_1: int32 [N, K // 8], element k at bits
             4 (k % 8) of word k // 8 (the same nibbles, reordered within each block)
    scales   float16 [N, K // 32]: every block's d
    mins     float16 [N, K // 32]: every block's m (Q4_1 only; the kernels compute q * d + m)
Q4_0 is the symmetric 4-bit format with z = 8, Q8_0 the symmetric 8-bit one with groups of 32. Separate scale
planes keep the packed words aligned to 16 bytes (a 20-byte Q4_1 block is not); the memory is the file's own
(Q4_1: 5 bits a weight, Q4_0: 4.5, Q8_0: 8.5). The scales stay float16 in every model dtype (no rounding).
"""

from __future__ import annotations

from typing import ClassVar, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill.kernels.quant_weight import PACK, PackedWeight
from tokenmill.worker.quant.packed import PackedLinearMethod, frozen, register_bias

BLOCK = 32  # weights per ggml block: the group size
NATIVE_TYPES: dict[str, GGMLQuantizationType] = {
    "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


class GgufLinearMethod(PackedLinearMethod):
    """One of the ggml block formats of NATIVE_TYPES (`qtype`: "q8_0", "q4_0" or "q4_1") for every projection."""

    name: ClassVar[str] = "gguf"

    def __init__(self, qtype: str) -> None:
        if qtype not in NATIVE_TYPES:
            raise ValueError(f"GGUF type {qtype!r} does not run natively; supported: {', '.join(NATIVE_TYPES)}")
        self.qtype = qtype

    @property
    def bits(self) -> int:
        return 8 if self.qtype == "q8_0" else 4

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        blocks = input_size // BLOCK
        cols = input_size if self.bits == 8 else input_size // PACK
        shapes: dict[str, tuple[int, ...]] = {"qweight": (output_size, cols), "scales": (output_size, blocks)}
        if self.qtype == "q4_1":
            shapes["mins"] = (output_size, blocks)
        return shapes

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | None) -> None:
        if input_size % BLOCK:
            raise ValueError(f"GGUF {self.qtype.upper()} stores blocks of {BLOCK} input columns: in_features "
                             f"{input_size} is not a multiple of {BLOCK}")
        shapes = self.param_shapes(input_size, output_size)
        qdtype = torch.int8 if self.bits == 8 else torch.int32
        layer.register_parameter("qweight", frozen(torch.zeros(shapes["qweight"], dtype=qdtype, device=device)))
        layer.register_parameter("scales", frozen(torch.zeros(shapes["scales"], dtype=torch.float16, device=device)))
        mins = torch.zeros(shapes["mins"], dtype=torch.float16, device=device) if "mins" in shapes else None
        layer.register_parameter("mins", None if mins is None else frozen(mins))
        register_bias(layer, bias, output_size, dtype, device)

    def packed(self, layer: nn.Module) -> PackedWeight:
        return PackedWeight(cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales), None, None,
                            self.bits, BLOCK, cast(torch.Tensor | None, layer.mins))

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """A dense weight [out, in] -> this format's tensors, rounded as llama.cpp's reference quantizer does
        (gguf.quants, on the CPU), then repacked (`repack_blocks`)."""
        import gguf.quants

        data = gguf.quants.quantize(weight.detach().float().cpu().numpy(), NATIVE_TYPES[self.qtype])
        return repack_blocks(torch.from_numpy(np.ascontiguousarray(data)).to(weight.device), self.qtype)


def repack_blocks(rows: torch.Tensor, qtype: str) -> dict[str, torch.Tensor]:
    """The ggml blocks of a matrix, rows uint8 [N, K // 32 * block bytes] (one output row each, as a GGUF tensor
    stores them), -> the canonical tensors of GgufLinearMethod(qtype) on the same device; no bit changes."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype!r} does not run natively; supported: {', '.join(NATIVE_TYPES)}")
    size = BLOCK_BYTES[qtype]
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] % size:
        raise ValueError(f"{qtype.upper()} rows must be uint8 [N, blocks * {size}], got {tuple(rows.shape)} "
                         f"{rows.dtype}")
    n, nb = rows.shape[0], rows.shape[1] // size
    blocks = rows.reshape(n, nb, size)

    def f16(start: int) -> torch.Tensor:  # [N, nb] float16 from the 2 bytes at `start` of every block
        return blocks[:, :, start:start + 2].contiguous().view(torch.float16).reshape(n, nb)

    if qtype == "q8_0":
        return {"qweight": blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, nb * BLOCK), "scales": f16(0)}
    qs = blocks[:, :, 4 if qtype == "q4_1" else 2:]  # [N, nb, 16]
    out = {"qweight": _pack_block_nibbles(qs), "scales": f16(0)}
    if qtype == "q4_1":
        out["mins"] = f16(2)
    return out


def _pack_block_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [N, nb, 16] in ggml order -> int32 [N, nb * 4] in PackedWeight order (element k of a row at bits
    4 (k % 8) of word k // 8). uint8 ops only (no int64 copy of a large matrix)."""
    n, nb, _ = qs.shape
    nib = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [N, nb, 32]: element order
    pairs = nib[..., 0::2] | (nib[..., 1::2] << 4)  # [N, nb, 16]: byte b = elements 2b (low), 2b + 1 (high)
    # little-endian words: byte b of a row's byte stream is bits 8 (b % 4).. of word b // 4
    return pairs.reshape(n, nb * 16).contiguous().view(torch.int32)
