"""worker/compile_watch.py: while the watch is open, a Triton JIT compile (the hook Triton calls after compiling a
new variant) and a torch.compile compile are logged as kernel_compiled_while_serving and counted; the hook installed
before keeps being called, and closing the watch puts it back. The serving benchmark counts those lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import triton

from tokenmill.benchmarks.serving import Cluster
from tokenmill.worker.compile_watch import EVENT, watch_compiles


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


class _Fn:  # what Triton hands the hook as `fn` (JitFunctionInfo)
    name = "_paged_attn_fn"


def _triton_compiled() -> None:
    """What JITFunction._do_compile does after compiling: call the post-compile hook with keyword arguments."""
    hook = triton.knobs.runtime.jit_post_compile_hook
    if hook is not None:
        hook(key="k", repr="r", fn=_Fn(), compile={}, is_manual_warmup=False, already_compiled=False)


def test_a_triton_compile_while_open_is_logged_counted_and_chained() -> None:
    log, earlier = _Log(), []
    runtime = triton.knobs.runtime
    saved = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw["fn"].name)
    try:
        _triton_compiled()  # before the watch: not counted
        with watch_compiles(log) as count:
            _triton_compiled()
            _triton_compiled()
        _triton_compiled()  # after: the earlier hook alone again
        assert count.triton == 2 and count.torch == 0
        assert log.lines == [(EVENT, {"kernel": "_paged_attn_fn", "by": "triton"})] * 2
        assert earlier == ["_paged_attn_fn"] * 4
    finally:
        runtime.jit_post_compile_hook = saved


def test_a_torch_compile_while_open_is_logged_and_counted() -> None:
    log = _Log()

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    warm = torch.compile(f, backend="eager", dynamic=True)
    warm(torch.ones(3))  # compiled before the watch (start-up)
    with watch_compiles(log) as count:
        warm(torch.ones(7))  # dynamic shapes: no new compile
        assert count.torch == 0
        torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))  # a function first met while serving
    torch.compile(lambda x: x + 3, backend="eager")(torch.ones(2))  # after the watch: not counted
    assert count.torch == 1 and [e for e, _ in log.lines] == [EVENT]


def test_the_serving_benchmark_counts_the_workers_compile_lines(tmp_path: Path) -> None:
    c = Cluster("tcp://127.0.0.1:1", tmp_path)
    assert c.compiles() == 0  # no worker log yet
    (tmp_path / "worker.log").write_text(f"a\n{{\"event\": \"{EVENT}\", \"kernel\": \"x\"}}\nb\n{EVENT} kernel=y\n")
    (tmp_path / "broker.log").write_text(EVENT)  # another process's log is not the worker's
    assert c.compiles() == 2


def test_a_process_without_dynamo_loaded_does_not_load_it() -> None:
    """Loading dynamo takes seconds with the GIL held (a worker's heartbeats would stall): the watch leaves it out where
    nothing has loaded it, and such a process has compiled nothing with torch.compile."""
    import subprocess
    import sys

    code = ("import sys, structlog\nfrom tokenmill.worker.compile_watch import watch_compiles\n"
            "with watch_compiles(structlog.get_logger()):\n    pass\n"
            "assert 'torch._dynamo' not in sys.modules, 'the watch loaded dynamo'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
