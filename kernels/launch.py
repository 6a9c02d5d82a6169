"""Launch helpers shared by the kernel launchers: host-int shape arithmetic, device facts, and programmatic
dependent launch (PDL).

PDL (Hopper and later): a kernel launched with `launch_pdl=True` may be scheduled before the kernel ahead of
it in the stream has finished, once every program of that kernel has released its dependents (or exited).
Every kernel here that takes a `PDL` constexpr follows one protocol when it is set:
  1. `pdl_wait` (griddepcontrol.wait) comes before its first global memory access: it blocks until the
     previous kernel has completed and its writes are visible. Since every PDL kernel waits first, a
     kernel's predecessors are complete transitively (reads see all earlier results; writes cannot race
     earlier kernels' reads);
  2. `pdl_release` (griddepcontrol.launch_dependents) comes after its last store: the next kernel is then
     launched while this one's last programs drain and its completion is processed, which hides most of the
     launch gap between two kernels of a captured decode step.
Released at the end, not the start: on the H200 an early release let the next kernel's programs take SM
slots while this one still ran, which spread them unevenly over the SMs and made bandwidth-bound kernels
slower (batch-1 decode +0.1 ms per step; decode attention at batch 8-32 lost 20-30% of its bandwidth),
and pulling the next weights into L2 before the wait made batch-1 decode 1.3-2.8 ms slower (L2 thrash).
Kernels launched without the attribute (cuBLAS, torch) wait for full completion as usual, and the two
griddepcontrol instructions are no-ops when a kernel was launched without it. Inside CUDA graphs the launch
attribute becomes a programmatic edge, so captured decode steps keep the overlap.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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


@functools.lru_cache(maxsize=16)
def l2_bytes(device: torch.device) -> int:
    """L2 cache size of a CUDA device; 64 KiB under the interpreter (CPU), small like num_sms so that tiny test
    shapes exercise the launch rules that depend on it."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return 64 << 10


@functools.lru_cache(maxsize=16)
def shared_memory_per_program(device: torch.device) -> int:
    """The most shared memory one program may use on a CUDA device (opt-in limit: 227 KB on Hopper, 163 KB on
    A100); 0 under the interpreter and when torch does not report it, so launchers keep their small defaults."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0))


@functools.lru_cache(maxsize=16)
def pdl_enabled(device: torch.device) -> bool:
    """Whether launchers on `device` use programmatic dependent launch: CUDA compute capability >= 9.0, not
    under the Triton interpreter, and TOKENMILL_PDL not set to 0 (A/B measurements, or a driver that
    misbehaves with it)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if os.environ.get("TOKENMILL_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_launch_args(device: torch.device) -> dict[str, Any]:
    """Keyword arguments for a kernel launch that takes a `PDL` constexpr: PDL=<flag> (+ launch_pdl)."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Step 1 of the protocol above (nothing when PDL is off)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Step 2 of the protocol above (nothing when PDL is off)."""
    if PDL:
        gdc_launch_dependents()
