"""Isolation between tests that run commands in-process: a command configures logging for its process and exports
its level and format (protocol/logs.py) so that the processes it starts agree. In the test process that export
would outlive the test and reach every worker a later test starts (an exported "warning" hides the info lines
those tests read). Each test gets the logging environment it started with back."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

from tokenmill.protocol.logs import FORMAT_ENV, JSON_ENV, LEVEL_ENV

# The repo root holds the folders that install as tokenmill.* (kernels/, worker/, ...). `python -m pytest` puts the
# working directory on sys.path, where kernels/ shadows Hugging Face's `kernels` package, which transformers (a
# dependency of it since 5.2x) imports at once: `import transformers` then fails. Nothing this process imports
# needs the root (worker processes that tests start from it import tests.* in their own interpreter).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

# Triton's interpreter on machines without CUDA, before any test module imports Triton: a module that imports Triton's
# compiler or driver first (tests/test_direct_launch.py) would otherwise leave later modules' kernels uninterpretable.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _logging_environment_restored() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (LEVEL_ENV, FORMAT_ENV, JSON_ENV)}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a CUDA machine the interpreter must stay off: a test module that sets TRITON_INTERPRET at import runs
    every later kernel, and every worker process a test starts, in the interpreter (minutes, then failures)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise pytest.UsageError("TRITON_INTERPRET was set while collecting the tests on a CUDA machine: guard the "
                                "module that sets it with `if not torch.cuda.is_available()`")
