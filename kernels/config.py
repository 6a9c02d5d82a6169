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
    with it)."""

    pdl: bool = True


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
