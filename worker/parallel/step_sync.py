"""Rank 0's step inputs to the other ranks of a tensor-parallel group, over the host (gloo, CPU) group.

Only rank 0 schedules: the others run what it sends, so no scheduler, block manager or request state is
kept twice (and nothing can diverge between copies of them). Each step rank 0 broadcasts a fixed-size
header (the op, then per STEP_KEYS tensor its dtype and shape) and one byte payload holding those tensors:
the token ids, positions and attention metadata that the model's forward reads, the rows whose logits are
computed, and where tokens still in flight go. The sampling inputs stay on rank 0, which alone samples;
the sampled ids reach the other ranks by a device broadcast (worker/parallel/runner.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from tokenmill.worker.parallel.group import TPGroup

OP_STOP, OP_STEP, OP_LOGITS_ALL = 0, 1, 2  # OP_STEP: logits of `logits_rows`; OP_LOGITS_ALL: of every token
STEP_KEYS = ("input_ids", "positions", "fix_index", "fix_source", "query_start_loc", "seq_lens", "block_tables",
             "slot_mapping", "logits_rows")
_DTYPES = (torch.int64, torch.int32)
_FIELDS = 3  # per key: dtype index (-1: absent), rows, columns (-1: a 1-D tensor)
HEADER_LEN = 1 + _FIELDS * len(STEP_KEYS)


class StepChannel:
    """send() on rank 0, recv() on the others, in the same order."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def send(self, op: int, tensors: Mapping[str, Tensor]) -> None:
        """Broadcast `op` and the STEP_KEYS tensors of `tensors` (CPU, int64 or int32, 1-D or 2-D)."""
        header = torch.full((HEADER_LEN,), -1, dtype=torch.int64)
        header[0] = op
        parts = []
        for i, key in enumerate(STEP_KEYS):
            t = tensors.get(key)
            if t is None:
                continue
            assert t.device.type == "cpu" and t.dim() in (1, 2), (key, t.device, t.shape)
            at = 1 + _FIELDS * i
            header[at] = _DTYPES.index(t.dtype)
            header[at + 1] = t.shape[0]
            header[at + 2] = t.shape[1] if t.dim() == 2 else -1
            parts.append(t.contiguous().view(-1).view(torch.uint8))
        self.group.host_broadcast(header)
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        if payload.numel():
            self.group.host_broadcast(payload)

    def recv(self) -> tuple[int, dict[str, Tensor]]:
        """(op, the tensors rank 0 sent, as CPU tensors of their dtypes and shapes)."""
        header = self.group.host_broadcast(torch.empty(HEADER_LEN, dtype=torch.int64)).tolist()
        layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for i, key in enumerate(STEP_KEYS):
            code, rows, cols = header[1 + _FIELDS * i : 1 + _FIELDS * (i + 1)]
            if code >= 0:
                layout.append((key, _DTYPES[code], (rows,) if cols < 0 else (rows, cols)))
        sizes = [dtype.itemsize * math.prod(shape) for _, dtype, shape in layout]
        payload = torch.empty(sum(sizes), dtype=torch.uint8)
        if payload.numel():
            self.group.host_broadcast(payload)
        out = {}
        for (key, dtype, shape), piece in zip(layout, payload.split(sizes), strict=True):
            out[key] = piece.clone().view(dtype).view(shape)  # clone: aligned for the dtype
        return int(header[0]), out
