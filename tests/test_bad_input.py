"""Every kind of bad input gets a clear error naming the problem, and a request already running on the
same engine still finishes normally."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_hf import save_tiny_model

from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError
from tokenmill.worker.registry_fetch import embedded_model_path


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", max_model_len=256))


def finish_neighbour(engine: LLMEngine, rid: str, tokens: list[int]) -> list[int]:
    for _ in range(100):
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    assert out.finish_reason == "length" and out.error is None
                    return tokens
    raise AssertionError("the neighbour request did not finish")


def check_rejected_beside_neighbour(engine: LLMEngine, bad: Callable[[], Any], match: str, rid: str) -> None:
    engine.add_request(rid, prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(temperature=0, max_tokens=6,
                                                                                  ignore_eos=True))
    first = [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    with pytest.raises(InvalidRequest, match=match):
        bad()
    assert len(finish_neighbour(engine, rid, first)) == 6
    engine.blocks.check_integrity()
    assert engine.blocks.num_in_use == 0


BAD_REQUESTS: dict[str, tuple[dict[str, Any], str]] = {
    "prompt_too_long": (dict(prompt_token_ids=[3] * 256), "context is 256 tokens"),
    "empty_prompt": (dict(prompt_token_ids=[]), "empty"),
    "token_out_of_vocab": (dict(prompt_token_ids=[1, 10**6]), "outside the vocabulary"),
    "unknown_stop_token": (dict(prompt_token_ids=[1, 2], params={"stop_token_ids": [10**7]}),
                           "stop token id 10000000"),
    "negative_temperature": (dict(prompt_token_ids=[1], params={"temperature": -1.0}), "temperature"),
    "nan_temperature": (dict(prompt_token_ids=[1], params={"temperature": float("nan")}), "temperature"),
    "top_p_zero": (dict(prompt_token_ids=[1], params={"top_p": 0.0}), "top_p"),
    "max_tokens_zero": (dict(prompt_token_ids=[1], params={"max_tokens": 0}), "max_tokens"),
    "min_over_max": (dict(prompt_token_ids=[1], params={"min_tokens": 9, "max_tokens": 3}), "min_tokens"),
    "unknown_param": (dict(prompt_token_ids=[1], params={"temprature": 1.0}), "unknown sampling parameter"),
    "stop_wrong_type": (dict(prompt_token_ids=[1], params={"stop": [1, 2]}), "stop must be a list of str"),
    "two_prompts": (dict(prompt="hi", prompt_token_ids=[1]), "exactly one"),
    "bad_messages": (dict(messages=[{"role": "user"}]), "content"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_fails_alone(engine: LLMEngine, case: str) -> None:
    kwargs, match = BAD_REQUESTS[case]
    check_rejected_beside_neighbour(engine, lambda: engine.add_request(f"bad-{case}", **kwargs), match,
                                    f"good-{case}")


def test_request_too_big_for_the_cache_is_rejected() -> None:
    small = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", max_model_len=256,
                                   cache=CacheConfig(num_blocks=8)))  # 128 tokens of KV cache
    bad = lambda: small.add_request("big", prompt_token_ids=[1] * 10, params={"max_tokens": 200})
    check_rejected_beside_neighbour(small, bad, "needs up to 210 tokens of KV cache but the cache holds 128",
                                    "good-big")


def test_duplicate_request_id_is_rejected(engine: LLMEngine) -> None:
    engine.add_request("dup", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=3))
    check_rejected_beside_neighbour(engine, lambda: engine.add_request("dup", prompt_token_ids=[1]),
                                    "already in use", "good-dup")


def _truncated(src: Path, dst: Path, keep: float) -> Path:
    dst.write_bytes(src.read_bytes()[: int(src.stat().st_size * keep)])
    return dst


def _bad_models(tmp: Path) -> dict[str, tuple[EngineConfig, str]]:
    hf = save_tiny_model("llama", tmp)
    broken = tmp / "broken-hf"
    shutil.copytree(hf, broken)
    st = broken / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    garbage = tmp / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    return {
        "unknown_path": (EngineConfig(model=str(tmp / "nope")), "nope"),
        "dir_without_config": (EngineConfig(model=str(tmp)), "config.json"),
        "unknown_dummy_shape": (EngineConfig(model="llama-99b", load_format="dummy"), "llama-99b"),
        "truncated_safetensors": (EngineConfig(model=str(broken)), "model.safetensors"),
        "truncated_gguf": (EngineConfig(model=str(_truncated(embedded_model_path(), tmp / "cut.gguf", 0.5))),
                           "cut.gguf"),
        "garbage_gguf": (EngineConfig(model=str(garbage)), "garbage.gguf"),
    }


def test_bad_models_fail_clearly_while_an_engine_keeps_serving(engine: LLMEngine, tmp_path: Path) -> None:
    for case, (config, match) in _bad_models(tmp_path).items():
        def load(config: EngineConfig = config) -> None:
            try:
                LLMEngine(config)
            except ModelLoadError as e:  # re-raised as the engine-level error type the test expects
                raise InvalidRequest(str(e)) from e

        check_rejected_beside_neighbour(engine, load, match, f"good-model-{case}")


def test_unknown_load_format_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="unknown load_format"):
        EngineConfig(model="x", load_format="onnx")  # type: ignore[arg-type]
