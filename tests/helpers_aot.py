"""Ahead-of-time compiles for Hopper (sm_90) on a CPU-only machine: GPU-only compile errors, pipelining and the
instructions a kernel compiles to, checked without a GPU. The compile runs in a subprocess with the Triton
interpreter off (the test process has it on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_sm90_compile(module: str, function: str, cache_dir: Path) -> None:
    """Run `module.function()` (a test module's compile-everything function) with TRITON_INTERPRET=0 and its own
    Triton cache; skip without Triton's NVIDIA backend, fail with the subprocess's stderr."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache_dir))
    proc = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"],
                          cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
