"""Kernels compiled while serving: what start-up should have built.

An engine builds at start-up every Triton variant a step can launch (the warm-up over the CUDA graphs' buckets,
worker/cuda_graphs.py) and compiles its torch.compile functions (the sampler's), so that no request waits for a
compile. One first met later compiles (or loads from a disk cache) inside a step and stalls every request of that
step. While `watch_compiles` is open, each Triton JIT compile and each torch.compile (dynamo) compile in this process
(where dynamo is loaded when the watch opens) is logged as `kernel_compiled_while_serving` with what compiled, and
counted: the serving benchmark reads those lines from the worker's log.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

EVENT = "kernel_compiled_while_serving"


@dataclass
class CompileCount:
    """Compiles seen since the watch opened."""

    triton: int = 0
    torch: int = 0


@contextlib.contextmanager
def watch_compiles(log: Any) -> Iterator[CompileCount]:
    """Log (on `log`, a structlog logger) and count every Triton JIT and torch.compile compile while open; hooks
    installed before keep being called. What this machine lacks (Triton, dynamo's callbacks) is not watched."""
    count = CompileCount()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_triton_hook(log, count))
        stack.enter_context(_dynamo_hook(log, count))
        yield count


@contextlib.contextmanager
def _triton_hook(log: Any, count: CompileCount) -> Iterator[None]:
    try:
        import triton
    except ImportError:
        yield
        return
    runtime = triton.knobs.runtime
    previous = runtime.jit_post_compile_hook

    def on_compile(*, fn: Any, **kwargs: Any) -> Any:
        count.triton += 1
        log.warning(EVENT, kernel=getattr(fn, "name", str(fn)), by="triton")
        return previous(fn=fn, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = on_compile
    try:
        yield
    finally:
        runtime.jit_post_compile_hook = previous


@contextlib.contextmanager
def _dynamo_hook(log: Any, count: CompileCount) -> Iterator[None]:
    """Only where dynamo is loaded already (a CUDA engine's sampler compiled at start-up): importing it takes seconds
    with the GIL held, which would stall a worker's heartbeats; a process that has not loaded it has compiled nothing
    with torch.compile."""
    if "torch._dynamo" not in sys.modules:
        yield
        return
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        yield
        return

    def on_start(args: Any = None) -> None:
        count.torch += 1
        log.warning(EVENT, kernel=str(getattr(args, "compile_id", "")), by="torch.compile")

    callback_handler.register_start_callback(on_start)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(on_start)
