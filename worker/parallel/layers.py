"""The layers of one tensor-parallel rank (Megatron-style), made by `TensorParallelLayers` for the model code
of worker/models/ (which never asks whether it runs in parallel: the factory decides).

- ColumnParallelLinear (qkv_proj, gate_up_proj): each part of the fused output ([q | k | v], [gate | up]) is
  split into `size` equal row slices; rank r keeps slice r of every part, fused in the same order. The input
  is the full hidden state (the same on every rank); no collective.
- RowParallelLinear (o_proj, down_proj): the input columns are split (rank r reads what its column layer
  wrote); the partial products are summed by one all-reduce, so the output is whole on every rank.
- VocabParallelEmbedding / VocabParallelHead: the vocabulary is split into `size` ranges of ceil(V / size)
  rows (the last padded with zero rows); the embedding sums the ranks' lookups (an id outside a rank's range
  gives zeros there), the head all-gathers the ranks' logit columns and drops the padding.

Weights arrive as the full checkpoint tensors in their LinearMethod's canonical layout (worker/quant/base.py)
and each layer keeps its slice (`load_part`). Output rows are the first dim of every canonical tensor but the
shared ones (act-order's `perm`, over the input, kept whole by column layers); a row layer slices every dim
whose size depends on the input size (found by comparing the format's shapes for the full and the local
input), which for INT4 needs each rank's columns to be whole groups: what cannot split is refused at build.
Weight scales are those of the whole tensor (quantized before it is sliced), so INT8 and INT4 shards compute
what the whole layer does; FP8 W8A8 quantizes each token's activations per rank, over the columns that rank
reads (a scale per slice instead of per row: a finer quantization, not the same numbers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.worker.models.layers import LayerFactory, Linear, RMSNorm, VocabEmbedding, frozen_param
from tokenmill.worker.parallel.group import TPGroup
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.int4 import Int4LinearMethod
from tokenmill.worker.quant.unquantized import UnquantizedLinearMethod


def _split(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"tensor parallelism over {parts} ranks splits {what} ({size}) evenly: "
                         f"{size} is not a multiple of {parts}")
    return size // parts


class ColumnParallelLinear(Linear):
    """Rank r's rows of a fused layer: slice r of each part of `output_sizes` (full sizes), concatenated."""

    def __init__(self, group: TPGroup, input_size: int, output_sizes: Sequence[int], bias: bool,
                 method: LinearMethod | None, *, dtype: torch.dtype) -> None:
        self.local_sizes = [_split(s, group.size, "a projection's output rows") for s in output_sizes]
        super().__init__(input_size, sum(self.local_sizes), bias, method, dtype=dtype)
        self.group = group
        self.full_starts = [sum(output_sizes[:i]) for i in range(len(output_sizes))]  # each part's first row

    def load_part(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None) -> None:
        if name in self.method.shared_params:  # over the input columns: the same for every part and rank
            self.method.load_weight(self, name, tensor, rows)
            return
        part = 0 if rows is None else self.full_starts.index(rows[0])
        n = self.local_sizes[part]
        start = sum(self.local_sizes[:part])
        shard = tensor.narrow(0, self.group.rank * n, n)
        self.method.load_weight(self, name, shard, (start, start + n))


class RowParallelLinear(Linear):
    """Rank r's input columns of a layer; forward sums the ranks' partial outputs (one all-reduce)."""

    def __init__(self, group: TPGroup, input_size: int, output_size: int, bias: bool,
                 method: LinearMethod | None, *, dtype: torch.dtype) -> None:
        if bias:
            raise ValueError("a row-parallel projection with a bias is not supported (Llama-family o_proj and "
                             "down_proj have none)")
        method = method if method is not None else UnquantizedLinearMethod()
        local = _split(input_size, group.size, "a projection's input columns")
        check_row_split(method, input_size, local, group.size)
        super().__init__(local, output_size, False, method, dtype=dtype)
        self.group = group
        self.full_shapes = method.param_shapes(input_size, output_size)
        self.local_shapes = method.param_shapes(local, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.method.apply(self, x))

    def forward_skinny(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward_skinny(x))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward_silu_mul(gate_up))

    def forward_norm(self, norm: RMSNorm, h: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a row-parallel layer reads a split input: a norm of the whole hidden state cannot "
                        "precede it")

    def load_part(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None) -> None:
        assert rows is None, "row-parallel layers are not fused"
        shard = tensor
        for dim, (full, local) in enumerate(zip(self.full_shapes[name], self.local_shapes[name], strict=True)):
            if full != local:  # a dim over the input columns (or their groups, or packed words)
                assert full == local * self.group.size, (name, full, local)
                shard = shard.narrow(dim, self.group.rank * local, local)
        self.method.load_weight(self, name, shard.contiguous(), None)


def check_row_split(method: LinearMethod, input_size: int, local: int, size: int) -> None:
    """ValueError unless `method`'s tensors of an input_size-column layer split into `size` slices of `local`
    columns: every input-sized dim exactly, INT4 groups whole, no act-order permutation across the slices."""
    full_shapes, local_shapes = method.param_shapes(input_size, 1), method.param_shapes(local, 1)
    if method.shared_params & full_shapes.keys():
        raise ValueError(f"{method.name} act-order weights cannot be split by input columns for tensor "
                         "parallelism (their column permutation spans the whole input)")
    if isinstance(method, Int4LinearMethod) and local % method.group_size:
        raise ValueError(f"int4 groups of {method.group_size} columns cannot split a projection of {input_size} "
                         f"input columns over {size} ranks ({local} columns each is not whole groups); use a "
                         f"smaller --tensor-parallel-size, a group size dividing {local}, or --quantization int8")
    for name, full in full_shapes.items():
        for f, n in zip(full, local_shapes[name], strict=True):
            if f != n and f != n * size:
                raise ValueError(f"{method.name} tensor {name} ({f} along the input) does not split into "
                                 f"{size} slices of {n}")


class VocabParallelEmbedding(VocabEmbedding):
    """Rank r's rows [r * per_rank, (r + 1) * per_rank) of the embedding (rows past the vocabulary: zeros)."""

    def __init__(self, group: TPGroup, vocab_size: int, hidden_size: int, *, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.group = group
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // group.size)
        self.start = group.rank * self.per_rank
        self.num_real = max(0, min(vocab_size - self.start, self.per_rank))  # rows of real tokens
        self.weight = frozen_param(torch.zeros(self.per_rank, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        outside = (local < 0) | (local >= self.num_real)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab(self.group, F.linear(hidden, self.weight), self.vocab_size).float()

    def load_part(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None) -> None:
        assert name == "weight" and rows is None, name
        self.weight.data[: self.num_real].copy_(tensor[self.start : self.start + self.num_real])


class VocabParallelHead(VocabParallelEmbedding):
    """An untied LM head split like VocabParallelEmbedding: hidden [N, hidden] -> logits [N, vocab] in the
    model dtype."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return gather_vocab(self.group, F.linear(hidden, self.weight), self.vocab_size)


def gather_vocab(group: TPGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each rank's logit columns [N, per_rank] -> the whole vocabulary [N, vocab_size] on every rank."""
    return group.gather_columns(local)[:, :vocab_size]


class TensorParallelLayers(LayerFactory):
    """The layers of rank `group.rank` of `group.size`; sizes given are the full model's."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.shards = group.size

    def column(self, input_size: int, output_sizes: Sequence[int], bias: bool, method: LinearMethod | None,
               dtype: torch.dtype) -> Linear:
        return ColumnParallelLinear(self.group, input_size, output_sizes, bias, method, dtype=dtype)

    def row(self, input_size: int, output_size: int, bias: bool, method: LinearMethod | None,
            dtype: torch.dtype) -> Linear:
        return RowParallelLinear(self.group, input_size, output_size, bias, method, dtype=dtype)

    def embedding(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> VocabEmbedding:
        return VocabParallelEmbedding(self.group, vocab_size, hidden_size, dtype=dtype)

    def lm_head(self, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> nn.Module:
        return VocabParallelHead(self.group, vocab_size, hidden_size, dtype=dtype)
