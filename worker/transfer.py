"""Host <-> device copies that never make the host wait for the stream.

A pageable `torch.tensor(list, device="cuda")` blocks the host until the stream has drained, so while a
step runs on the GPU the host could not prepare the next one. Instead every per-step input goes through
`ship` (one pinned staging buffer, one non_blocking copy) and every per-step output through `HostCopy`
(pinned destination, non_blocking copy, a CUDA event to wait on). On CPU both are plain tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

_ALIGN = 16  # every part starts at a multiple of this many bytes, so any dtype can view it


def ship(host: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """Copy CPU tensors to `device` in one transfer; returns device tensors of the same names, dtypes
    and shapes (views of one buffer). On CUDA the staging buffer is pinned and the copy non_blocking.
    Each call stages into a fresh buffer: the caching host allocator keeps it alive until its copy has
    run, so a later call never overwrites bytes an earlier copy has not read yet."""
    parts = [t.contiguous().view(-1).view(torch.uint8) for t in host.values()]
    sizes = [-(-p.numel() // _ALIGN) * _ALIGN for p in parts]
    total = sum(sizes)
    buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=device.type == "cuda")[:total]
    for p, piece in zip(parts, buf.split(sizes)):
        if p.numel():
            piece[: p.numel()].copy_(p)
    dev = buf if device.type == "cpu" else buf.to(device, non_blocking=True)
    return {name: piece[: p.numel()].view(t.dtype).view(t.shape)
            for (name, t), p, piece in zip(host.items(), parts, dev.split(sizes))}


class HostCopy:
    """Device tensors copied to host memory without blocking the host; `wait()` returns them once the
    device has written them. On CPU the tensors are returned as they are."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = list(tensors)

    def wait(self) -> list[Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
