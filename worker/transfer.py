"""Host <-> device copies that never make the host wait for the stream.

A pageable `torch.tensor(list, device="cuda")` blocks the host until the stream has drained, so while a
step runs on the GPU the host could not prepare the next one. Instead every per-step input goes through
`ship` (one pinned staging buffer, one non_blocking copy) and every per-step output through `HostCopy`
(pinned destination, non_blocking copy, a CUDA event to wait on). On CPU both are plain tensors.

The engine's runner passes `ship` a `StagingRing` and `HostCopy` an `OutputBuffers`: pinned buffers allocated
once and handed out again only when no copy and no reader can still use them (a pinned allocation per step
costs the host more than the rest of the copy)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import numpy as np
import torch
from torch import Tensor

HostArray: TypeAlias = "Tensor | np.ndarray"  # a per-step input on the host: a CPU tensor or a numpy array
_ALIGN = 16  # every part starts at a multiple of this many bytes (any dtype can view it; Triton's alignment)


class Fence(Protocol):
    """What a copy's completion is waited on with (torch.cuda.Event; tests pass fakes)."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


def cuda_fence() -> Fence:
    return torch.cuda.Event()


class StagingRing:
    """`slots` pinned staging buffers used in turn by `ship`. A buffer is written again only after the copy
    that last read it has run (its fence is synchronized first: that waits only with `slots` copies still
    queued, never with async scheduling's one step in flight). A buffer too small for a step is replaced."""

    def __init__(self, slots: int = 4, pin: bool = True, fence: Callable[[], Fence] = cuda_fence) -> None:
        assert slots >= 1
        self._bufs: list[Tensor | None] = [None] * slots
        self._fences: list[Fence | None] = [None] * slots
        self._next = 0
        self._pin = pin
        self._fence = fence

    def take(self, nbytes: int) -> tuple[int, Tensor]:
        """(slot, uint8 buffer of at least nbytes) that no queued copy reads any more."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        fence = self._fences[i]
        if fence is not None and not fence.query():
            fence.synchronize()  # the copy that read this buffer has run (query first: no sync call when it has)
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            size = max(4096, 1 << (nbytes - 1).bit_length())  # doubling: a few reallocations at most
            buf = self._bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        return i, buf

    def copied(self, slot: int) -> None:
        """The copy out of `slot`'s buffer has been enqueued: fence it."""
        fence = self._fences[slot]
        if fence is None:
            fence = self._fences[slot] = self._fence()
        fence.record()


def ship(host: Mapping[str, HostArray], device: torch.device,
         ring: StagingRing | None = None) -> dict[str, Tensor]:
    """Copy CPU tensors or numpy arrays to `device` in one transfer; returns device tensors of the same names,
    dtypes and shapes (views of one buffer; a part with no elements is a tensor of its own). On CUDA the
    staging buffer is pinned and the copy non_blocking; it is a fresh buffer each call (the caching host
    allocator keeps it until its copy has run) or, with `ring`, one of the ring's (ignored on CPU, where the
    staging buffer is the result).

    Every part starts at a multiple of 16 bytes (as Triton's pointer specialization, and so the warm-up, assumes).
    Host cost matters here (once per step, ~15 small parts): parts are grouped by dtype, and each group is cut out
    of the device buffer with one split_with_sizes (a view per part, made in C++); only a part of 2 or more
    dimensions, or one that does not fill its 16-byte slots, takes one more view."""
    groups: dict[np.dtype[Any] | torch.dtype, _Group] = {}
    empty: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, t in host.items():
        if isinstance(t, np.ndarray):
            a = np.ascontiguousarray(t)
            key: np.dtype[Any] | torch.dtype = a.dtype
            n, shape = a.size, a.shape
        else:
            a, key, n, shape = _tensor_part(t)
        if not n:
            empty.append((name, _torch_dtype_of(t.dtype), shape))
            continue
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Group()
        group.names.append(name)
        group.arrays.append(a)
        group.shapes.append(shape)
        group.counts.append(n)
        padded = -(-a.nbytes // _ALIGN) * _ALIGN  # every part starts on the 16-byte grid (Triton specializes
        group.slots.append(padded // a.itemsize)  # pointers by their divisibility by 16: warm-up's variants)
        group.nbytes += padded
    total = 0
    for group in groups.values():
        group.start = total
        total += group.nbytes
    cuda = device.type == "cuda"
    if ring is not None and cuda:
        slot, buf = ring.take(total)
    else:
        slot, buf = -1, torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=cuda)
    staging = buf.numpy()
    for group in groups.values():
        dest = staging[group.start : group.start + group.nbytes].view(group.arrays[0].dtype)
        at = 0
        for a, n in zip(group.arrays, group.slots):
            dest[at : at + a.size] = a.reshape(-1)
            at += n
    if cuda:
        dev = buf[:total].to(device, non_blocking=True)
        if ring is not None:
            ring.copied(slot)
    else:
        dev = buf
    out: dict[str, Tensor] = {}
    for key, group in groups.items():
        typed = dev[group.start : group.start + group.nbytes].view(_torch_dtype_of(key))
        pieces = typed.split_with_sizes(group.slots) if len(group.slots) > 1 else (typed,)
        for name, shape, n, slot, piece in zip(group.names, group.shapes, group.counts, group.slots, pieces):
            part = piece if n == slot else piece[:n]
            out[name] = part if len(shape) == 1 else part.view(shape)
    for name, dtype, shape in empty:
        out[name] = _empty(shape, dtype, device)
    return out


class _Group:
    """The parts of one dtype in a ship, staged in order from byte `start`, each in a slot of whole _ALIGN bytes."""

    __slots__ = ("arrays", "counts", "names", "nbytes", "shapes", "slots", "start")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.arrays: list[np.ndarray] = []
        self.shapes: list[tuple[int, ...]] = []
        self.counts: list[int] = []  # elements of each part
        self.slots: list[int] = []  # elements of each part's slot (its count rounded up to _ALIGN bytes)
        self.nbytes = 0
        self.start = 0


def _tensor_part(t: Tensor) -> tuple[np.ndarray, np.dtype[Any] | torch.dtype, int, tuple[int, ...]]:
    """(values as a C-contiguous array, group key, elements, shape) of a CPU tensor. A dtype numpy lacks
    (bfloat16, float8) is staged as its raw bytes (uint8) and grouped under its torch dtype."""
    assert t.device.type == "cpu", f"ship stages CPU tensors, got one on {t.device}"
    if t.dtype in _NUMPY_DTYPES:
        a = np.ascontiguousarray(t.numpy())
        return a, a.dtype, a.size, a.shape
    return t.contiguous().view(-1).view(torch.uint8).numpy(), t.dtype, t.numel(), tuple(t.shape)


def _torch_dtype_of(key: np.dtype[Any] | torch.dtype) -> torch.dtype:
    """The torch dtype of a ship group (its key: a torch dtype numpy lacks, or the arrays' numpy dtype)."""
    return key if isinstance(key, torch.dtype) else _FROM_NUMPY[key.type]


_EMPTY: dict[tuple[tuple[int, ...], torch.dtype, torch.device], Tensor] = {}


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of no elements: shared between calls (it has no data anything could write)."""
    key = (shape, dtype, device)
    t = _EMPTY.get(key)
    if t is None:
        if len(_EMPTY) > 4096:  # shapes are bounded by the batch sizes; never grow without end
            _EMPTY.clear()
        t = _EMPTY[key] = torch.empty(shape, dtype=dtype, device=device)
    return t


_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.float16, torch.float32, torch.float64})
_FROM_NUMPY = {np.bool_: torch.bool, np.uint8: torch.uint8, np.int8: torch.int8, np.int16: torch.int16,
               np.int32: torch.int32, np.int64: torch.int64, np.float16: torch.float16, np.float32: torch.float32,
               np.float64: torch.float64}


def from_numpy(a: np.ndarray) -> Tensor:
    """torch.from_numpy(a), except that an empty array gives a tensor of dense strides (from_numpy's are 0, which
    byte views such as tensor-parallel step_sync's refuse). Per-step inputs are built through numpy: torch.tensor
    of a Python list costs about three times as much as np.array + from_numpy."""
    t = torch.from_numpy(a)
    return t if a.size else torch.empty(t.shape, dtype=t.dtype)


class OutputBuffers:
    """Pinned destinations of `HostCopy`, reused: a set of buffers (one flat buffer per output of a step, grown
    when a step's output is larger) goes back to the free list only from `HostCopy.tolist()`, after the copy's
    fence and after every value was read into Python lists. A copy whose tensors were handed out (`wait()`) or
    that is dropped unread never gives its buffers back: nothing can read a buffer that is being rewritten."""

    def __init__(self, pin: bool = True, fence: Callable[[], Fence] = cuda_fence, max_free: int = 4) -> None:
        self._free: list[_OutputSlot] = []
        self._pin = pin
        self._fence = fence
        self._max_free = max_free
        self.slots_made = 0  # sets of buffers ever made (the rest of the takes reused one)

    def take(self) -> _OutputSlot:
        if self._free:
            return self._free.pop()
        self.slots_made += 1
        return _OutputSlot([], self._fence())

    def give_back(self, slot: _OutputSlot) -> None:
        if len(self._free) < self._max_free:
            self._free.append(slot)

    def destinations(self, slot: _OutputSlot, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Host tensors of `tensors`' dtypes and shapes, views of `slot`'s buffers (grown as needed)."""
        flats = slot.flats
        out = []
        for j, t in enumerate(tensors):
            n = t.numel()
            if j == len(flats) or flats[j].dtype != t.dtype or flats[j].numel() < n:
                flat = torch.empty(max(256, 1 << max(n - 1, 0).bit_length()), dtype=t.dtype, pin_memory=self._pin)
                if j == len(flats):
                    flats.append(flat)
                else:
                    flats[j] = flat
            view = flats[j][:n]
            out.append(view if t.dim() == 1 else view.view(t.shape))
        return out


class _OutputSlot:
    __slots__ = ("fence", "flats")

    def __init__(self, flats: list[Tensor], fence: Fence) -> None:
        self.flats = flats  # per output index: a flat pinned buffer of that output's dtype
        self.fence = fence


class HostCopy:
    """Device tensors copied to host memory without blocking the host; `wait()` returns them once the
    device has written them, `tolist()` their values as Python lists. On CPU the tensors are used as they are.
    With `buffers` (CUDA) the destinations are reused pinned buffers, given back by `tolist()`."""

    def __init__(self, tensors: Sequence[Tensor], buffers: OutputBuffers | None = None) -> None:
        self._event: Fence | None = None
        self._slot: _OutputSlot | None = None
        self._buffers = buffers
        self._lists: list[list[Any]] | None = None
        self._given_back = False
        if buffers is not None and tensors:
            self._slot = buffers.take()
            self._host = buffers.destinations(self._slot, tensors)
            for dst, t in zip(self._host, tensors):
                dst.copy_(t, non_blocking=True)
            self._event = self._slot.fence
            self._event.record()
        elif tensors and tensors[0].is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = list(tensors)

    def wait(self) -> list[Tensor]:
        """The host tensors (valid for as long as they are referenced: their buffers are then never reused)."""
        assert not self._given_back, "tolist() gave the buffers back"
        self._slot = None  # handed out: never given back
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def tolist(self) -> list[list[Any]]:
        """Each tensor's values (Tensor.tolist()); the pinned buffers go back to `buffers` once read."""
        if self._lists is None:
            if self._event is not None:
                self._event.synchronize()
            self._lists = [t.tolist() for t in self._host]
            if self._slot is not None and self._buffers is not None:
                self._buffers.give_back(self._slot)
                self._slot, self._host, self._given_back = None, [], True
        return self._lists


def as_tensors(host: Mapping[str, HostArray], keys: Sequence[str]) -> dict[str, Tensor]:
    """The entries `keys` of `host` (those it has) as CPU tensors (arrays through from_numpy, no copy)."""
    return {k: from_numpy(v) if isinstance(v, np.ndarray) else v for k in keys if (v := host.get(k)) is not None}
