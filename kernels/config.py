"""Process-wide kernel settings: chosen once at start-up (`configure`, called by the engine's model runner
from `EngineConfig.kernels`) and read by the launchers as a plain attribute, never from the environment.

Imports neither torch nor Triton, so the config dataclasses that embed `KernelConfig` stay light.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class KernelConfig:
    """pdl: launch the kernels that support it with programmatic dependent launch (kernels/launch.py) where
    the device has it (CUDA compute capability >= 9.0, not under the Triton interpreter). False: every kernel
    waits for the one before it to complete, as without PDL (A/B measurements, or a driver that misbehaves
    with it).

    fp8_skinny: FP8 W8A8 matmuls of up to 16 tokens run kernels/fp8_gemv.py's fused kernel (RMSNorm / SwiGLU and
    the activation quantization inside) instead of the row quantization + torch._scaled_mm. Off: on the H200 it
    made batch-1 decode of Llama-3-8B slower (18.5 ms a token against 6.5 through torch._scaled_mm,
    benchmarks/results/h200/NOTES.md), so it stays an A/B variant until it wins."""

    pdl: bool = True
    fp8_skinny: bool = False


class _State:
    config: ClassVar[KernelConfig] = KernelConfig()
    # called after a change: caches derived from the config (kernels/launch.py's per-device PDL decision)
    listeners: ClassVar[list[Callable[[], None]]] = []


def configure(config: KernelConfig) -> None:
    """Make `config` the process's kernel settings (one process drives one device: the last engine built
    sets them). Caches derived from the previous settings are dropped."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"expected a KernelConfig, got {type(config).__name__}")
    if config == _State.config:
        return
    _State.config = config
    for listener in _State.listeners:
        listener()


def current() -> KernelConfig:
    """The kernel settings in force."""
    return _State.config


def on_configure(listener: Callable[[], None]) -> None:
    """Call `listener` whenever `configure` changes the settings."""
    _State.listeners.append(listener)
