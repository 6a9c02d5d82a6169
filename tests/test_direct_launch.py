"""kernels/direct_launch.py: a DirectLaunch hands the C launcher what Triton's own path (CompiledKernel's runner,
then CudaLauncher.__call__) hands it, and every launch it cannot reproduce keeps the runner. Triton's real runner and
CudaLauncher.__call__ run here over a recording C launcher (no module is built), so a change in Triton's argument
order fails this test."""

from __future__ import annotations

from typing import Any

import pytest
import triton
from triton.backends.nvidia.driver import CudaLauncher
from triton.compiler.compiler import CompiledKernel

from tokenmill.kernels.direct_launch import DirectLaunch, direct_launcher

STREAM = 0x5EED
HOOK_POSITIONS = (10, 11, 12)  # launch metadata, enter and exit hooks in the C launcher's arguments


def _compiled(log: list[tuple[Any, ...]], scratch: int = 0) -> CompiledKernel:
    launcher = CudaLauncher.__new__(CudaLauncher)
    launcher.num_ctas = 1
    launcher.launch = lambda *a: log.append(a)
    launcher.global_scratch_size, launcher.global_scratch_align = scratch, 1
    launcher.profile_scratch_size, launcher.profile_scratch_align = 0, 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
    kernel = CompiledKernel.__new__(CompiledKernel)  # loaded as _init_handles leaves it
    kernel.module, kernel.function, kernel._run = object(), 0xF00D, launcher
    kernel.packed_metadata, kernel.name, kernel.src = ("meta", 4), "k", None
    return kernel


def test_direct_launch_passes_what_tritons_path_passes() -> None:
    triton_log: list[tuple[Any, ...]] = []
    direct_log: list[tuple[Any, ...]] = []
    args = ("q", "k", 7, 3.5, None, True)
    _compiled(triton_log)[(3, 2, 1)](*args, stream=STREAM)
    launch = direct_launcher(_compiled(direct_log), (3, 2, 1), 0, stream=lambda dev: STREAM)
    assert isinstance(launch, DirectLaunch)
    launch(*args)
    launch(*args)
    seen = triton_log[0]
    assert seen[:4] == (3, 2, 1, STREAM) and seen[-len(args):] == args
    for i in HOOK_POSITIONS[1:]:  # Triton passes its hook chains, empty: calling them does nothing
        assert not seen[i].calls
    expected = tuple(None if i in HOOK_POSITIONS else a for i, a in enumerate(seen))
    assert direct_log == [expected] * 2


def test_the_current_stream_is_read_at_every_launch() -> None:
    log: list[tuple[Any, ...]] = []
    streams = iter([11, 22])
    launch = direct_launcher(_compiled(log), (1, 1, 1), 3, stream=lambda dev: next(streams) + dev)
    launch()
    launch()
    assert [entry[3] for entry in log] == [14, 25]


@pytest.mark.parametrize("case", ["scratch", "hook", "stand-in"])
def test_what_a_direct_launch_cannot_reproduce_keeps_tritons_runner(case: str) -> None:
    log: list[tuple[Any, ...]] = []
    compiled: Any = _compiled(log, scratch=64 if case == "scratch" else 0)
    if case == "stand-in":
        compiled = type("StandIn", (), {"__getitem__": lambda self, grid: (lambda *a: log.append(a))})()
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(metadata: Any) -> None:
        pass

    if case == "hook":
        hooks.add(hook)
    try:
        launch = direct_launcher(compiled, (1, 1, 1), 0, stream=lambda dev: STREAM)
    finally:
        hooks.remove(hook)
    assert not isinstance(launch, DirectLaunch)
