"""A model's own sampling defaults: read from its generation config or GGUF keys, announced in READY within the
wire's ranges, kept by the broker, and applied by the gateway to the fields a request leaves unset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.broker.workers import WorkerInfo
from tokenmill.protocol import wire as p
from tokenmill.protocol.wire import SAMPLING_DEFAULT_FIELDS
from tokenmill.worker.generation_defaults import (
    MODEL_DEFAULT_KEYS,
    announced_defaults,
    from_generation_config,
    from_gguf_metadata,
)


def test_every_model_default_is_a_wire_field() -> None:
    assert set(MODEL_DEFAULT_KEYS) <= set(SAMPLING_DEFAULT_FIELDS)


def test_generation_config_and_gguf_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "generation_config.json"
    cfg.write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64,
                               "do_sample": True, "min_p": None, "repetition_penalty": "high"}))
    assert from_generation_config(cfg) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert from_generation_config(tmp_path / "missing.json") == {}
    cfg.write_text("[1, 2]")
    assert from_generation_config(cfg) == {}
    assert from_gguf_metadata({"general.sampling.temp": 0.4, "general.sampling.top_k": 30, "general.name": "x"}) \
        == {"temperature": 0.4, "top_k": 30}


def test_only_defaults_within_the_wire_ranges_are_announced() -> None:
    got = announced_defaults({"temperature": 0.7, "top_p": 0.0, "top_k": 40, "max_tokens": 0})
    assert got == {"temperature": 0.7, "top_k": 40}  # top_p 0 and max_tokens 0 would fail the READY
    msg = p.decode(p.encode(p.Ready("w", ["m"], 1, 10, 16, 64, 0.2, sampling_defaults=got)), p.WORKER_TO_BROKER)
    assert isinstance(msg, p.Ready) and msg.sampling_defaults == got


def test_the_broker_reports_a_workers_defaults() -> None:
    ready = p.Ready("w", ["m"], 1, 10, 16, 64, 0.2, sampling_defaults={"temperature": 0.3})
    info = WorkerInfo.from_ready(b"w", ready, 0.0)
    assert info.describe(0.0)["sampling_defaults"] == {"temperature": 0.3}


def test_engine_reads_its_models_generation_config(tmp_path: Path) -> None:
    from tiny_hf import save_tiny_model

    from tokenmill.worker.config import EngineConfig
    from tokenmill.worker.engine import LLMEngine

    path = save_tiny_model("llama", tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_p": 0.8}))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=64))
    assert engine.sampling_defaults == {"temperature": 0.25, "top_p": 0.8}
    from tokenmill.worker.process import WorkerOptions, ready_message

    assert ready_message(engine, WorkerOptions(name="w")).sampling_defaults == {"temperature": 0.25, "top_p": 0.8}


def test_gateway_fills_only_what_the_request_left_unset() -> None:
    pytest.importorskip("fastapi", reason="the gateway extra")
    from tokenmill.gateway.app import Gateway
    from tokenmill.gateway.schemas import ChatCompletionRequest

    worker: dict[str, Any] = {"max_model_len": 512,
                              "sampling_defaults": {"temperature": 0.2, "top_k": 30, "max_tokens": 100}}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=1.0)
    params = Gateway.with_model_defaults(body.sampling_params(50, None), body.model_fields_set, worker)
    assert params["temperature"] == 1.0 and params["top_k"] == 30  # given: kept; unset: the model's
    assert params["max_tokens"] == 50  # max_tokens is the caller's (Gateway.max_tokens gives its default)
    gw = Gateway.__new__(Gateway)  # max_tokens reads nothing of the instance
    assert gw.max_tokens(None, worker) == 100 and gw.max_tokens(7, worker) == 7
    assert gw.max_tokens(None, {"max_model_len": 64, "sampling_defaults": {"max_tokens": 100}}) == 63
    assert gw.max_tokens(None, {"max_model_len": 64}) == 63  # max_tokens >= the context is refused as unreachable
