"""KV blocks out of and into the paged cache: one [num_blocks, block_size, kv_heads, head_dim] key and value
tensor per layer (worker/model_runner.py). A transfer is one host tensor [layers, 2, blocks, block_size,
kv_heads, head_dim]: on CUDA gathered on the device and copied once into pinned memory (out), or copied in
once and scattered on the device (in), on the stream the steps run on (so the next step sees the blocks)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

KVCaches = Sequence[tuple[Tensor, Tensor]]


def dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def gather_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> Tensor:
    """A host tensor [layers, 2, len(block_ids), block_size, kv_heads, head_dim] of those blocks (C-contiguous;
    pinned on CUDA, ready once this returns)."""
    key = kv_caches[0][0]
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=key.device)
    dev = torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx))) for k, v in kv_caches])
    if key.device.type == "cpu":
        return dev
    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    host.copy_(dev, non_blocking=True)
    torch.cuda.current_stream(key.device).synchronize()
    return host


def scatter_blocks(kv_caches: KVCaches, block_ids: Sequence[int], kv: Tensor) -> None:
    """Write host rows kv[:, :, j] into block block_ids[j] of every layer's key and value cache."""
    key = kv_caches[0][0]
    assert kv.shape[0] == len(kv_caches) and kv.shape[2] == len(block_ids) and kv.dtype == key.dtype
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=key.device)
    dev = kv.to(key.device, non_blocking=kv.is_pinned())  # pinned (stage_in): the engine loop does not wait
    for layer, (k, v) in enumerate(kv_caches):
        _raw(k).index_copy_(0, idx, _raw(dev[layer, 0]))
        _raw(v).index_copy_(0, idx, _raw(dev[layer, 1]))


def _raw(t: Tensor) -> Tensor:
    """fp8 entries as bytes (index_copy_ has no float8 kernel on the CPU); other dtypes as they are."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def as_buffer(t: Tensor) -> memoryview:
    """The bytes of a C-contiguous host tensor, without a copy (the view keeps the tensor alive)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy().data)


def stage_in(buf: Any, shape: Sequence[int], dtype: str, device: torch.device) -> Tensor:
    """The host tensor scatter_blocks takes, from a received buffer: a view of it on CPU; on CUDA a copy in
    pinned memory (made on the calling thread, the KV receiver's: the engine loop then only enqueues an
    asynchronous host-to-device copy)."""
    view = from_buffer(buf, shape, dtype)
    if device.type == "cpu":
        return view
    return torch.empty(view.shape, dtype=view.dtype, pin_memory=True).copy_(view)


def from_buffer(buf: Any, shape: Sequence[int], dtype: str) -> Tensor:
    """A host tensor over the bytes of `buf` (read-only: only ever copied from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a received frame is not writable; it is only read
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).view(*shape)
