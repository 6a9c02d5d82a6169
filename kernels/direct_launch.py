"""Launching a compiled Triton variant again without Triton's per-launch Python.

`compiled[grid](*args)` (triton/compiler/compiler.py CompiledKernel.__getitem__ and its runner, then the CUDA
driver's CudaLauncher.__call__) looks up the current device and stream, builds the launch metadata for the
launch hooks, sizes the global and profile scratch and only then calls the C launcher: about 20 us of host
time per launch on the H200 host, paid 64 times by a mixed step's attention between its graph pieces. A
`DirectLaunch` does that work once, when a step's second layer launches, and then each launch is one call of
the C launcher with the current stream.

It is taken only where the runner's extra work is a constant: no scratch memory, no launch hooks (profilers
such as proton set them; then every launch keeps Triton's path) and Triton's own CUDA launcher. Anything else
gets the runner itself, so `direct_launcher` never changes what is launched, only how fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

Launch = Callable[..., None]


class DirectLaunch:
    """`compiled[grid](*args)` as one call of the variant's C launcher, on the current stream of `device_index`."""

    __slots__ = ("_c_launch", "_device", "_grid", "_head", "_stream")

    def __init__(self, c_launch: Launch, grid: tuple[int, int, int], head: tuple[Any, ...], device_index: int,
                 stream: Callable[[int], int]) -> None:
        self._c_launch = c_launch
        self._grid = grid
        self._head = head  # what CudaLauncher.__call__ puts between the stream and the kernel's arguments
        self._device = device_index
        self._stream = stream

    def __call__(self, *args: Any) -> None:
        gx, gy, gz = self._grid
        self._c_launch(gx, gy, gz, self._stream(self._device), *self._head, *args)


def direct_launcher(compiled: Any, grid: tuple[int, int, int], device_index: int,
                    stream: Callable[[int], int] | None = None) -> Launch:
    """A launcher of `compiled` (a Triton CompiledKernel) at `grid` taking every kernel parameter in signature order
    (constexprs included, as the runner does): a DirectLaunch where that is the same launch, else the runner.
    `stream`: device index -> raw stream handle (default: torch's current stream, what Triton itself asks for)."""
    runner = compiled[grid]  # loads the module (CompiledKernel._init_handles) on first use
    from triton.backends.nvidia.driver import CudaLauncher

    knobs = triton.knobs.runtime
    launcher = getattr(compiled, "run", None)  # (a stand-in variant in the tests has none)
    if (not isinstance(launcher, CudaLauncher) or _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook)
            or launcher.global_scratch_size > 0 or launcher.profile_scratch_size > 0):
        return runner  # type: ignore[no-any-return]
    # CudaLauncher.__call__(gx, gy, gz, stream, function, *rest) calls
    # launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch, *rest), and the runner's
    # rest is (packed_metadata, launch_metadata, enter_hook, exit_hook, *args). With no hook set the C launcher's
    # calls of the (empty) hook chains do nothing, so metadata and hooks go as None.
    head = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None)
    return DirectLaunch(launcher.launch, grid, head, device_index,
                        stream or torch._C._cuda_getCurrentRawStream)  # type: ignore[attr-defined]


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook does anything: Triton 3.6 keeps an always-present HookChain (empty unless a
    profiler added to it); older releases None or a function."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True
