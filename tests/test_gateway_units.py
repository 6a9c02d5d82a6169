"""Gateway pieces without processes: health rules, model checks, error mapping, request translation,
SSE chunks, usage, API keys."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the gateway extra (pip install tokenmill[gateway])")

from tokenmill.client import StreamEvent, Usage
from tokenmill.gateway.config import GatewayConfig, load_api_keys
from tokenmill.gateway.errors import APIError, from_tokenmill
from tokenmill.gateway.pool import PoolView, evaluate_health
from tokenmill.gateway.responses import ChunkWriter, chat_logprobs, event_logprobs, usage_json
from tokenmill.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tokenmill.gateway.tenants import Tenants, owner_of_key
from tokenmill.protocol.errors import BrokerUnavailable, DeadlineExceeded, InvalidRequest, JobFailed, Overloaded
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.structured import StructuredOutput

CFG = GatewayConfig(heartbeat_stale=2.5, progress_stall=10.0)


def _worker(**kw: Any) -> dict[str, Any]:
    w = {"name": "w0", "models": ["m"], "inflight": 0, "running": 0, "waiting": 0, "last_seen_ago": 0.1,
         "steps": 5, "kv_blocks": 100, "free_blocks": 100, "cached_blocks": 0, "max_model_len": 2048}
    return {**w, **kw}


def _stats(*workers: dict[str, Any], queues: dict[str, int] | None = None) -> dict[str, Any]:
    return {"workers": list(workers), "queues": queues or {}, "counters": {}}


@pytest.mark.parametrize(("stats", "age", "progress", "ok", "reason"), [
    (None, 0.0, 0.0, False, "broker not answering"),
    (_stats(_worker()), 60.0, 0.0, False, "broker not answering"),
    (_stats(), 0.0, 0.0, False, "no worker registered"),
    (_stats(_worker()), 0.0, 99.0, True, "idle"),  # idle: no progress needed
    (_stats(_worker(last_seen_ago=3.0)), 0.0, 0.0, False, "silent"),  # stopped process
    (_stats(_worker(running=2)), 0.0, 1.0, True, "progressing"),
    (_stats(_worker(running=2)), 0.0, 11.0, False, "no engine step"),  # hung engine loop
    (_stats(_worker(inflight=1)), 0.0, 11.0, False, "no engine step"),  # dispatched, never picked up
    (_stats(_worker(), queues={"m": 3}), 0.0, 11.0, False, "no engine step"),  # idle while work queues
    (_stats(_worker(), queues={"other": 3}), 0.0, 11.0, True, "idle"),
])
def test_health_rules(stats: Any, age: float, progress: float, ok: bool, reason: str) -> None:
    h = evaluate_health(stats, age, {"w0": progress}, CFG)
    assert h.ok is ok
    assert reason in h.reason or any(reason in w["reason"] for w in h.workers)


def test_one_healthy_worker_is_enough() -> None:
    h = evaluate_health(_stats(_worker(last_seen_ago=9.0), _worker(name="w1")), 0.0, {}, CFG)
    assert h.ok and h.reason == "1 of 2 workers healthy"


def test_pool_view_tracks_progress_and_checks_models() -> None:
    pool = PoolView(None, GatewayConfig(models=("declared",), progress_stall=1.0))
    with pytest.raises(APIError) as e:
        pool.check_model("m")
    assert e.value.status == 503  # never answered
    pool.update(_stats(_worker(running=1, steps=5)), now=100.0)
    pool.update(_stats(_worker(running=1, steps=5)), now=101.5)
    assert not pool.health(now=101.6).ok  # 1.6 s without a step, with work
    pool.update(_stats(_worker(running=1, steps=6)), now=101.7)
    assert pool.health(now=101.8).ok
    pool.stats_at = 1e18  # (fresh for check_model's age test)
    assert pool.check_model("m")["name"] == "w0"
    for model, status in (("declared", 503), ("nope", 404)):
        with pytest.raises(APIError) as e:
            pool.check_model(model)
        assert e.value.status == status
    pool.update(_stats(), now=1e18)
    with pytest.raises(APIError) as e:
        pool.check_model("m")
    assert e.value.status == 503  # once served, now gone: 503 not 404


class _StatsClient:
    """A stand-in for the AsyncClient: STATS answers from a list, one per call."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def stats(self, timeout: float) -> dict[str, Any]:
        self.calls += 1
        return self.answers.pop(0)


def test_a_model_missing_from_a_stale_view_is_looked_up_once_more() -> None:
    """A worker that registered after the last poll serves at once; an unknown model costs one more poll."""
    client = _StatsClient(_stats(_worker()), _stats(_worker()))
    pool = PoolView(client, GatewayConfig())
    pool.update(_stats(), now=time.monotonic())  # the view from before the worker registered
    assert asyncio.run(pool.require_model("m"))["name"] == "w0"
    assert client.calls == 1
    assert asyncio.run(pool.require_model("m"))["name"] == "w0"
    assert client.calls == 1  # served in the view: no poll
    with pytest.raises(APIError) as e:
        asyncio.run(pool.require_model("nope"))
    assert e.value.status == 404 and client.calls == 2


def test_error_mapping() -> None:
    e = from_tokenmill(Overloaded("full", retry_after=0.2))
    assert e.status == 429 and e.headers["Retry-After"] == "1" and e.body()["error"]["type"] == "rate_limit_error"
    assert from_tokenmill(Overloaded("full", retry_after=7.5)).headers["Retry-After"] == "8"
    assert from_tokenmill(InvalidRequest("bad")).status == 400
    assert from_tokenmill(BrokerUnavailable("gone")).status == 503
    assert from_tokenmill(DeadlineExceeded("late")).status == 504
    assert from_tokenmill(JobFailed("boom")).status == 500
    body = APIError(404, "no model", param="model", code="model_not_found").body()
    assert body == {"error": {"message": "no model", "type": "not_found_error", "param": "model",
                              "code": "model_not_found"}}


def test_sampling_parameters_as_vllm_takes_them() -> None:
    r = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7, "top_k": -1,
        "min_p": 0.1, "stop": "\n", "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2,
        "logprobs": True, "top_logprobs": 3, "stop_token_ids": [5], "unknown_field": 1})
    r.check(8)
    params = r.sampling_params(r.requested_max_tokens() or 0, r.logprobs_k())
    assert params == {"max_tokens": 7, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2, "stop": ["\n"],
                      "stop_token_ids": [5], "ignore_eos": True, "logprobs": 3}
    c = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "top_k": 5, "temperature": 0})
    assert c.prompts() == [[1, 2], [3]] and c.sampling_params(16, None) == {"max_tokens": 16, "temperature": 0.0,
                                                                            "top_k": 5}
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"response_format": {"type": "json_schema", "json_schema": {}}},
    {"top_logprobs": 2},
    {"n": 9},
    {"logit_bias": {"5": 1.0}},
    {"stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
])
def test_what_tokenmill_refuses_is_400(extra: dict[str, Any]) -> None:
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
    with pytest.raises(APIError) as e:
        r.check(8)
        r.wire_messages()
    assert e.value.status == 400


SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("extra, wire", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
    ({"guided_grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"choice": ["x", "y"]}}, {"choice": ["x", "y"]}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
])
def test_structured_outputs_reach_the_wire(extra: dict[str, Any], wire: dict[str, Any] | None) -> None:
    for body in ({"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "hi"}):
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        r = model.model_validate({"model": "m", **body, **extra})
        r.check(8)
        params = r.sampling_params(5, None)
        if wire is None:
            assert "structured_output" not in params
        else:  # as the broker and the worker read it
            constraint = SamplingParams.from_dict(params).structured_output
            assert constraint is not None and constraint == StructuredOutput.from_wire(wire)


@pytest.mark.parametrize("extra, why", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_json": "[1, 2]"}, "JSON schema"),
    ({"guided_regex": ""}, "non-empty"),
    ({"guided_choice": []}, "non-empty strings"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "at most one"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: a"}}, "exactly one"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"structured_outputs": {"json": "[1]"}}, "JSON schema"),
])
def test_malformed_structured_outputs_are_400(extra: dict[str, Any], why: str) -> None:
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
    with pytest.raises(APIError, match=why) as e:
        r.check(8)
    assert e.value.status == 400


@pytest.mark.parametrize("field", ["max_tokens", "n", "seed", "top_k", "min_tokens"])
def test_numbers_past_what_the_wire_carries_are_refused(field: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: 1 << 70})


def test_chat_messages_content_parts_and_tool_turns() -> None:
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "1"}]})
    assert r.wire_messages() == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""},
                                 {"role": "tool", "content": "42"}]


def _data(line: str) -> dict[str, Any]:
    assert line.startswith("data: ") and line.endswith("\n\n")
    return dict(json.loads(line[6:]))


@pytest.mark.parametrize("chat", [True, False])
def test_plain_text_chunks_are_the_full_objects(chat: bool) -> None:
    w = ChunkWriter(chat, "id-1", 123, "m\"odel", include_usage=True)
    text = 'he said "hi"\n\u00e9'
    fast = _data(w.text(3, text))
    slow = _data(w.text(3, text, logprobs={"content": []}))
    slow["choices"][0]["logprobs"] = None
    assert fast == slow and fast["usage"] is None and fast["model"] == 'm"odel'
    assert (fast["choices"][0]["delta"]["content"] if chat else fast["choices"][0]["text"]) == text
    end = _data(w.finish(3, "stop", "\n"))
    assert end["choices"][0]["finish_reason"] == "stop" and end["choices"][0]["stop_reason"] == "\n"
    assert _data(w.usage({"total_tokens": 1}))["choices"] == []


def test_usage_counts_each_prompt_once() -> None:
    u = usage_json({0: [Usage(10, 4, 0), Usage(10, 5, 8)], 1: [Usage(3, 2, 0)]})
    assert u == {"prompt_tokens": 13, "completion_tokens": 11, "total_tokens": 24,
                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_logprobs_with_token_bytes() -> None:
    ev = StreamEvent("j", 0, [7, 8], "ab", logprobs=[{7: -0.1, 3: -0.5, 9: -2.0}, {8: -3.0, 4: -0.2}],
                     token_bytes=[{7: b"a", 3: b"c", 9: b"\xe2"}, {8: b"b", 4: b"d"}])
    toks = event_logprobs(ev, 2)
    assert [t.top for t in toks] == [[(7, -0.1, b"a"), (3, -0.5, b"c")], [(4, -0.2, b"d"), (8, -3.0, b"b")]]
    out = chat_logprobs(toks)["content"]
    assert out[0]["token"] == "a" and out[0]["bytes"] == [97] and out[1]["top_logprobs"][0]["token"] == "d"
    assert [t.top for t in event_logprobs(ev, 0)] == [[(7, -0.1, b"a")], [(8, -3.0, b"b")]]


def test_api_keys_map_to_distinct_owners(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# tenants\nalpha\n\n  beta  \n")
    keys = load_api_keys(f)
    assert keys == ("alpha", "beta")
    t = Tenants(GatewayConfig(api_keys=keys))
    assert t.owner_for("Bearer alpha") == owner_of_key("alpha") != t.owner_for("Bearer beta")
    assert "alpha" not in owner_of_key("alpha")
    for header in (None, "Bearer gamma", "alpha", "Basic alpha"):
        with pytest.raises(APIError) as e:
            t.owner_for(header)
        assert e.value.status == 401
    open_gateway = Tenants(GatewayConfig())
    assert open_gateway.owner_for(None) == open_gateway.default_owner


@pytest.mark.parametrize("kw", [{"port": 70000}, {"stats_interval": 0}, {"api_keys": ("",)}, {"max_n": 0},
                                {"curve_server_key": "k"}, {"request_timeout": -1.0}])
def test_config_is_validated(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GatewayConfig(**kw)


def test_grafana_dashboard_uses_only_metrics_the_gateway_exposes() -> None:
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.gateway.metrics import GatewayMetrics

    pool = PoolView(None, CFG)
    pool.update(_stats(_worker(running=1)), now=0.0)
    metrics = GatewayMetrics(pool)
    metrics.ttft.labels("m").observe(0.1)  # label children exist once used
    for fam in (metrics.request_success.labels("m", "stop"), metrics.request_errors.labels("m", "400")):
        fam.inc()
    for c in (metrics.prompt_tokens, metrics.generation_tokens, metrics.prefix_queries, metrics.prefix_hits):
        c.labels("m").inc()
    for h in (metrics.itl, metrics.tpot, metrics.e2e, metrics.queue_time):
        h.labels("m").observe(0.1)
    exposed = {s.name for fam in text_string_to_metric_families(metrics.exposition().decode()) for s in fam.samples}
    dash = json.loads((Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tokenmill.json").read_text())
    used = {name for panel in dash["panels"] for t in panel["targets"]
            for name in re.findall(r"tokenmill:[a-z0-9_]+", t["expr"])}
    assert used and used <= exposed, sorted(used - exposed)


# ---- the SDK handle the gateway streams from (AsyncJobHandle.next_events) -----------------------------


class _StubClient:
    idle_timeout = 5.0


def test_next_events_returns_what_arrived_in_order_then_the_end() -> None:
    import asyncio

    from tokenmill.client.async_client import AsyncJobHandle
    from tokenmill.protocol import wire as p

    async def go() -> None:
        h = AsyncJobHandle(_StubClient(), "j")  # type: ignore[arg-type]
        for seq, text in enumerate("abc"):
            h._put(p.StreamChunk("j", seq, [seq], text))
        assert [e.text for e in await h.next_events(1.0)] == ["a", "b", "c"]  # three arrivals, one batch
        waiter = asyncio.ensure_future(h.next_events(1.0))
        await asyncio.sleep(0.01)
        h._put(p.StreamChunk("j", 3, [3], "d"))
        h._put(p.Done("j", "length", None, (1, 4, 0), 4))
        last = await waiter
        assert [e.text for e in last] == ["d", ""] and last[-1].finish_reason == "length"
        assert await h.next_events(1.0) == [] and h.done

    asyncio.run(go())


def test_next_events_error_after_events_and_deadline_after_a_longer_wait() -> None:
    import asyncio
    import time

    from tokenmill.client.async_client import AsyncJobHandle
    from tokenmill.protocol import wire as p

    async def go() -> None:
        h = AsyncJobHandle(_StubClient(), "j")  # type: ignore[arg-type]
        h._put(p.StreamChunk("j", 0, [0], "a"))
        h._put(p.Fail("j", "failed", "worker lost"))
        assert [e.text for e in await h.next_events(1.0)] == ["a"]  # the events before the error first
        with pytest.raises(JobFailed):
            await h.next_events(1.0)
        quiet = AsyncJobHandle(_StubClient(), "k")  # type: ignore[arg-type]
        long_wait = asyncio.ensure_future(quiet.next_events(30.0))  # arms a 30 s timer
        await asyncio.sleep(0.01)
        long_wait.cancel()
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await quiet.next_events(0.2)  # a shorter deadline re-arms the timer earlier
        assert time.monotonic() - t0 < 5.0

    asyncio.run(go())
