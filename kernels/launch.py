"""Launch helpers shared by the kernel launchers: host-int shape arithmetic and device facts."""

from __future__ import annotations

import functools

import torch


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 under the interpreter (CPU), small so that the
    launch heuristics that fill the GPU (attention splits, GEMV tiles) are exercised on tiny test shapes."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4
