"""Start-up settings of the engine and its public step hook: KernelConfig (kernels/config.py) and the
decode-rope switch reach the kernels and the attention backend from EngineConfig; Triton's interpreter is
chosen by the first kernel module imported (before its kernels are decorated), not by importing the
package; the step observer sees every launched step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tokenmill.kernels.config import KernelConfig, configure, current
from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.engine import LLMEngine, StepRecord


@pytest.fixture(autouse=True)
def _default_kernel_config() -> object:
    yield
    configure(KernelConfig())


def _engine(**config: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", dtype="float32",
                                  **config))  # type: ignore[arg-type]


def test_configure_replaces_the_settings_and_drops_derived_caches() -> None:
    from tokenmill.kernels.launch import pdl_enabled

    assert current() == KernelConfig(pdl=True)  # the default is the behaviour before the config existed
    pdl_enabled(torch.device("cpu"))
    assert pdl_enabled.cache_info().currsize == 1
    configure(KernelConfig(pdl=False))
    assert current().pdl is False and pdl_enabled.cache_info().currsize == 0
    assert pdl_enabled(torch.device("cpu")) is False
    with pytest.raises(TypeError, match="KernelConfig"):
        configure({"pdl": False})  # type: ignore[arg-type]


def test_engine_config_reaches_the_kernels_and_the_backend() -> None:
    engine = _engine(attention_backend="triton", decode_rope_in_attention=False, kernels=KernelConfig(pdl=False))
    assert current() == KernelConfig(pdl=False)
    assert engine.runner.backend.name == "triton" and engine.runner.backend.decode_rope_in_attention is False
    assert _engine(attention_backend="triton").runner.backend.decode_rope_in_attention is True
    assert current() == KernelConfig()


def test_unknown_attention_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")  # type: ignore[arg-type]


def _run(code: str, **env: str) -> None:
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**base, **env}, check=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen on machines without CUDA")
def test_interpreter_is_chosen_by_the_first_kernel_module_not_by_the_package() -> None:
    _run("""
        import os, sys
        import tokenmill.kernels, tokenmill.kernels.config
        assert not {"torch", "triton"} & set(sys.modules), "the package and its config import neither"
        assert "TRITON_INTERPRET" not in os.environ
        from triton.runtime.interpreter import InterpretedFunction
        import tokenmill.kernels.rmsnorm as rn
        import tokenmill.kernels.launch as launch
        assert isinstance(rn._rmsnorm_kernel, InterpretedFunction), type(rn._rmsnorm_kernel)
        assert launch.INTERPRET is True and os.environ["TRITON_INTERPRET"] == "1"  # Triton mirrors its knob
    """)


def test_triton_interpret_0_keeps_compiled_kernels() -> None:
    _run("""
        from triton.runtime.jit import JITFunction
        import tokenmill.kernels.launch as launch
        import tokenmill.kernels.rmsnorm as rn
        assert isinstance(rn._rmsnorm_kernel, JITFunction) and launch.INTERPRET is False
    """, TRITON_INTERPRET="0")


def test_step_observer_sees_each_launched_step() -> None:
    engine = _engine()
    records: list[tuple[list[str], list[int], float]] = []

    def observe(r: StepRecord) -> None:
        records.append(([q.request_id for q in r.batch.requests], list(r.batch.num_new_tokens), r.launch_s))

    engine.step_observer = observe
    engine.add_request("a", prompt_token_ids=list(range(300, 340)), params=SamplingParams(max_tokens=3,
                                                                                          ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert [ids for ids, _, _ in records] == [["a"]] * 3  # the prompt, then two decodes; the sync engine
    assert [n for _, n, _ in records] == [[40], [1], [1]] and steps == 3
    assert all(s > 0 for _, _, s in records)
    engine.step_observer = None
    engine.generate([[300, 301]], SamplingParams(max_tokens=2))
    assert len(records) == 3
