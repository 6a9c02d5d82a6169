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
Released at the end, not the start: an early release lets the next kernel's programs take SM slots while
this one still runs, which spreads them unevenly over the SMs and slows bandwidth-bound kernels; and pulling
the next weights into L2 before the wait thrashes L2 (H200 measurements: benchmarks/results/h200/NOTES.md,
"Programmatic dependent launch").
Kernels launched without the attribute (cuBLAS, torch) wait for full completion as usual, and the two
griddepcontrol instructions are no-ops when a kernel was launched without it. Inside CUDA graphs the launch
attribute becomes a programmatic edge, so captured decode steps keep the overlap. PDL is on unless the
process's KernelConfig (kernels/config.py) turns it off.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .config import current as _kernel_config
from .config import on_configure as _on_configure


def choose_interpreter() -> bool:
    """Whether Triton interprets the kernels (on the CPU) instead of compiling them; turns the interpreter
    on when this machine has no CUDA device and TRITON_INTERPRET does not decide (TRITON_INTERPRET=0 keeps
    compiled kernels, e.g. to build them for a GPU target on a CPU-only machine).

    Triton makes this choice for each function when `@triton.jit` decorates it, so it has to be made before
    the first decoration. It is made here, at the top of the module every kernel module imports before its
    own kernels, rather than by a start-up call of the engine: tests, benchmarks and library code import
    kernel modules directly, and on a CPU-only machine a compiled kernel only fails at its first launch.
    It sets Triton's own knob, which Triton mirrors into TRITON_INTERPRET (child processes agree)."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        triton.knobs.runtime.interpret = True
    return bool(triton.knobs.runtime.interpret)


INTERPRET = choose_interpreter()  # before the @triton.jit functions below and in every kernel module


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
    if device.type != "cuda" or INTERPRET:
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0))


@functools.lru_cache(maxsize=16)
def pdl_enabled(device: torch.device) -> bool:
    """Whether launchers on `device` use programmatic dependent launch: CUDA compute capability >= 9.0, not
    under the Triton interpreter, and KernelConfig.pdl (cached per device; `configure` clears the cache)."""
    if device.type != "cuda" or INTERPRET or not _kernel_config().pdl:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


_on_configure(pdl_enabled.cache_clear)


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
