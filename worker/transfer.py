"""Host <-> device copies that never make the host wait for the stream.

A pageable `torch.tensor(list, device="cuda")` blocks the host until the stream has drained, so while a
step runs on the GPU the host could not prepare the next one. Instead every per-step input goes through
`ship` (one pinned staging buffer, one non_blocking copy) and every per-step output through `HostCopy`
(pinned destination, non_blocking copy, a CUDA event to wait on). On CPU both are plain tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

_ALIGN = 16  # every part starts at a multiple of this many bytes, so any dtype can view it


def ship(host: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """Copy CPU tensors to `device` in one transfer; returns device tensors of the same names, dtypes
    and shapes (views of one buffer). On CUDA the staging buffer is pinned and the copy non_blocking.
    Each call stages into a fresh buffer: the caching host allocator keeps it alive until its copy has
    run, so a later call never overwrites bytes an earlier copy has not read yet.

    Host cost matters here (once per step, ~20 small tensors): the parts are written through one numpy view
    of the staging buffer, and each result is one slice of the device buffer viewed as its dtype (a view per
    dtype, not per part)."""
    parts = [(name, t, _host_bytes(t)) for name, t in host.items()]
    offsets, total = [], 0
    for _, _, a in parts:
        offsets.append(total)
        total += -(-a.size // _ALIGN) * _ALIGN
    buf = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = buf.numpy()
    for (_, _, a), off in zip(parts, offsets):
        if a.size:
            staging[off : off + a.size] = a
    dev = buf if device.type == "cpu" else buf.to(device, non_blocking=True)
    typed: dict[torch.dtype, Tensor] = {}
    out = {}
    for (name, t, a), off in zip(parts, offsets):
        view = typed.get(t.dtype)
        if view is None:
            view = typed[t.dtype] = dev.view(t.dtype)
        size = t.itemsize
        part = view[off // size : (off + a.size) // size]
        out[name] = part if t.dim() == 1 else part.view(t.shape)
    return out


def from_numpy(a: np.ndarray) -> Tensor:
    """torch.from_numpy(a), except that an empty array gives a tensor of dense strides (from_numpy's are 0, which
    byte views such as tensor-parallel step_sync's refuse). Per-step inputs are built through numpy: torch.tensor
    of a Python list costs about three times as much as np.array + from_numpy."""
    t = torch.from_numpy(a)
    return t if a.size else torch.empty(t.shape, dtype=t.dtype)


def host_tensor(vals: Sequence[Any] | np.ndarray, dtype: type[np.generic]) -> Tensor:
    """A C-contiguous CPU tensor of `vals` (numbers, rows of them, or an array): what torch.tensor(vals) gives, built
    through numpy at a third of its host cost (from_numpy)."""
    return from_numpy(np.array(vals, dtype=dtype, order="C"))


def _host_bytes(t: Tensor) -> np.ndarray:
    """The bytes of CPU tensor t as a flat uint8 array (a copy only when t is not contiguous)."""
    assert t.device.type == "cpu", f"ship stages CPU tensors, got one on {t.device}"
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy().reshape(-1).view(np.uint8)
    return t.contiguous().view(-1).view(torch.uint8).numpy()  # bfloat16, float8: no numpy dtype


_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.float16, torch.float32, torch.float64})


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
