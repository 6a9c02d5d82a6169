"""Structured outputs: the protocol's validation of a constraint, the packed bitmask, the llguidance backend, and
the engine on the embedded SmolLM2 holding outputs to a JSON schema, a regex and a choice (greedy and sampled,
batched with unconstrained neighbours whose tokens stay those of a run without them), a bad schema failing
its request alone, a resumed request replaying its delivered tokens, and no speculation when constrained."""

from __future__ import annotations

import json
import re
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.protocol.structured import MAX_SPEC_CHARS, StructuredOutput
from tokenmill.worker.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.structured.bitmask import apply_token_bitmask, unpack_bitmask

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


# ---- protocol ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire", [{"json_schema": PERSON}, {"json_schema": True}, {"json_object": True},
                                  {"regex": "[0-9]+"}, {"choice": ["yes", "no"]}, {"grammar": 'start: "a"+'}])
def test_constraint_round_trips_through_msgpack(wire: dict[str, Any]) -> None:
    p = SamplingParams(max_tokens=4, structured_output=wire)
    assert isinstance(p.structured_output, StructuredOutput)
    d = msgpack.unpackb(msgpack.packb(p.to_dict()))
    assert SamplingParams.from_dict(d) == p
    ((kind, value),) = d["structured_output"].items()
    if kind == "json_schema":  # sent as its JSON text
        assert json.loads(value) == wire[kind] and p.structured_output.schema == wire[kind]
    else:
        assert d["structured_output"] == wire


def test_a_deep_schema_passes_the_wire_decoder() -> None:
    from tokenmill.protocol import wire as w

    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(20):  # deeper than the decoder lets a params map nest
        schema = {"type": "object", "properties": {"x": schema}}
    params = SamplingParams(max_tokens=4, structured_output={"json_schema": schema}).to_dict()
    msg = w.decode(w.encode(w.Submit("j", "m", w.RequestInput(prompt="p"), params)))
    assert isinstance(msg, w.Submit)
    constraint = SamplingParams.from_dict(msg.params).structured_output
    assert constraint is not None and constraint.schema == schema


def test_no_constraint_is_left_off_the_wire_and_a_missing_field_means_none() -> None:
    d = SamplingParams(max_tokens=4).to_dict()
    assert "structured_output" not in d  # a peer that predates the field reads these params unchanged
    assert SamplingParams.from_dict({"max_tokens": 4}).structured_output is None


def test_schema_keys_keep_their_order() -> None:  # the order of properties is the order of the output's keys
    c = StructuredOutput.from_wire({"json_schema": {"properties": {"z": {}, "a": {}}}})
    assert list(c.schema["properties"]) == ["z", "a"]


@pytest.mark.parametrize("bad, why", [
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({}, "exactly one"),
    ({"xml": "<a/>"}, "kind must be one of"),
    ({"regex": ""}, "non-empty"),
    ({"regex": 5}, "must be a string"),
    ({"grammar": ["start"]}, "must be a string"),
    ({"choice": []}, "non-empty strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"choice": "a"}, "list of strings"),
    ({"json_object": False}, "must be true"),
    ({"json_schema": [1]}, "JSON object"),
    ({"json_schema": "[1]"}, "JSON object"),
    ({"json_schema": "{nope"}, "not JSON"),
    ({"json_schema": {"maximum": float("nan")}}, "not JSON-serializable"),
    ({"json_schema": {"enum": {1, 2}}}, "not JSON-serializable"),
    ({"json_schema": {"description": "x" * MAX_SPEC_CHARS}}, "at most"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "at most"),
    ("json", "mapping"),
])
def test_malformed_constraints_are_invalid_requests(bad: object, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        SamplingParams.from_dict({"structured_output": bad})


def test_protocol_stays_free_of_grammar_libraries() -> None:
    import subprocess
    import sys

    code = ("import sys; import tokenmill.protocol.structured, tokenmill.protocol.sampling; "
            "print(sorted(m for m in ('torch', 'llguidance', 'numpy') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


# ---- bitmask -----------------------------------------------------------------------------------------


def test_bitmask_unpacks_as_llguidance_applies_it() -> None:
    import llguidance.numpy

    rng = np.random.default_rng(0)
    v = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    bits = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    expected = np.zeros((3, v), dtype=np.float32)
    llguidance.numpy.apply_token_bitmask_inplace(expected, bits)
    allowed = unpack_bitmask(torch.from_numpy(bits), v)
    assert torch.equal(allowed, torch.from_numpy(expected == 0))
    x = torch.randn(5, v)
    y = apply_token_bitmask(x, torch.tensor([4, 1]), torch.from_numpy(bits[:2]))
    assert torch.equal(y[[0, 2, 3]], x[[0, 2, 3]])  # unconstrained rows untouched
    assert torch.equal(torch.isfinite(y[4]), allowed[0]) and torch.equal(torch.isfinite(y[1]), allowed[1])


# ---- backend and constraints --------------------------------------------------------------------------


def test_backend_compiles_each_constraint_once_and_matchers_are_independent(tiny: LLMEngine) -> None:
    from tokenmill.worker.structured.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend(tiny.tokenizer.backend.to_str(), tiny.runner.arch.vocab_size, tiny.eos_token_ids)
    regex = StructuredOutput.from_wire({"regex": "ab|ac"})
    a, b = backend.matcher(regex), backend.matcher(StructuredOutput.from_wire({"regex": "ab|ac"}))
    assert len(backend._compiled) == 1
    assert a.advance(ord("a")) and a.advance(ord("b")) and a.is_finished()
    assert not b.is_finished() and not b.advance(ord("b")) and b.error  # b is still at the start
    bits = backend.fill_bitmask([backend.matcher(regex)])
    assert bits.dtype == torch.int32 and bits.shape == (1, -(-tiny.runner.arch.vocab_size // 32))
    assert torch.nonzero(unpack_bitmask(bits, tiny.runner.arch.vocab_size)[0]).flatten().tolist() == [ord("a")]


def test_a_backend_that_cannot_be_made_is_tried_once() -> None:
    from tokenmill.worker.structured.constraints import Constraints

    calls = []

    def make() -> Any:
        calls.append(1)
        raise InvalidRequest("structured outputs are unavailable: no tokenizer.json")

    constraints = Constraints(make)
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="unavailable"):
            constraints.add("r", StructuredOutput.from_wire({"regex": "a"}), [])
    assert calls == [1] and len(constraints) == 0


# ---- the engine on a byte-level tiny model (fast) ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", max_model_len=256,
                                  speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)))


def test_constrained_requests_do_not_speculate(tiny: LLMEngine) -> None:
    constrained = SamplingParams(max_tokens=20, temperature=0.0, structured_output={"regex": "(ab){8}c"})
    plain = SamplingParams(max_tokens=20, temperature=0.0)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]]
    before = tiny.counters.draft_tokens
    [out] = tiny.generate(prompts[:1], constrained)
    assert tiny.counters.draft_tokens == before  # no drafts were verified for it
    assert re.fullmatch("(ab){8}c", out.text) and out.finish_reason == "stop", out
    [free] = tiny.generate(prompts[1:], plain)
    assert tiny.counters.draft_tokens > before  # the same engine drafts for an unconstrained request
    # together: the neighbour's verify steps carry the constrained request as a plain, masked row
    before = tiny.counters.draft_tokens
    both = tiny.generate(prompts, [constrained, plain])
    assert tiny.counters.draft_tokens > before
    assert [o.token_ids for o in both] == [out.token_ids, free.token_ids]


def test_an_empty_mask_fails_that_request_alone(tiny: LLMEngine) -> None:
    # After "a" the regex allows only "b" (byte 98), which min_tokens bans as a stop id: nothing is left.
    doomed = SamplingParams(max_tokens=8, min_tokens=5, temperature=0.0, stop_token_ids=[98],
                            structured_output={"regex": "ab"})
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    [alone] = tiny.generate([[9, 10, 11]], plain)
    failed, neighbour = tiny.generate([[1, 2, 3], [9, 10, 11]], [doomed, plain])
    assert failed.finish_reason == "error" and failed.error is not None and "refused token" in failed.error
    assert failed.token_ids[0] == ord("a")
    assert neighbour.token_ids == alone.token_ids and neighbour.finish_reason == "length"


# ---- the engine on the embedded SmolLM2 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", device="cpu",
                                  scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8)))


def _chat_ids(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def _check_person(text: str) -> None:
    person = json.loads(text)
    assert isinstance(person, dict) and set(person) == {"name", "age"}, person
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert type(person["age"]) is int and 0 <= person["age"] <= 150


@pytest.mark.slow
def test_constrained_outputs_in_a_batch_leave_unconstrained_neighbours_unchanged(engine: LLMEngine) -> None:
    neighbours = [_chat_ids(engine, "What is the capital of France?"), _chat_ids(engine, "Name a color.")]
    plain = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.9, seed=7)]
    alone = engine.generate(neighbours, plain)
    ask = _chat_ids(engine, ASK[0]["content"])
    constrained = [
        SamplingParams(max_tokens=64, temperature=0.0, structured_output={"json_schema": PERSON}),
        SamplingParams(max_tokens=64, temperature=1.0, seed=3, structured_output={"json_schema": PERSON}),
        SamplingParams(max_tokens=16, temperature=0.0, structured_output={"regex": "[0-9]{3}-[a-z]{2,5}"}),
        SamplingParams(max_tokens=16, temperature=0.7, seed=1, structured_output={"choice": ["yes", "no", "maybe"]}),
        SamplingParams(max_tokens=64, temperature=0.0, structured_output={"json_object": True}),
    ]
    outs = engine.generate([ask, ask, _chat_ids(engine, "Give me a code."), _chat_ids(engine, "Is the sky blue?"),
                            ask, *neighbours], [*constrained, *plain])
    json_greedy, json_sampled, code, choice, obj, *mixed = outs
    for o in (json_greedy, json_sampled):
        assert o.finish_reason == "stop", o
        _check_person(o.text)
    assert re.fullmatch("[0-9]{3}-[a-z]{2,5}", code.text), code.text
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    assert isinstance(json.loads(obj.text), dict)
    assert [m.token_ids for m in mixed] == [a.token_ids for a in alone]
    # the same batch again: seeded and greedy constrained outputs repeat exactly
    again = engine.generate([ask, ask], constrained[:2])
    assert [a.token_ids for a in again] == [json_greedy.token_ids, json_sampled.token_ids]


def test_async_scheduling_gives_the_same_tokens_with_constrained_requests(engine: LLMEngine) -> None:
    prompts = [_chat_ids(engine, "Give me a code."), _chat_ids(engine, "Name a color.")]
    params = [SamplingParams(max_tokens=12, temperature=0.0, structured_output={"regex": "[0-9]{3}-[a-z]{2,5}"}),
              SamplingParams(max_tokens=12, temperature=0.0)]
    sync = engine.generate(prompts, params)
    engine.async_scheduling = True  # on CPU it is off by default; the engine reads the flag each step
    try:
        overlapped = engine.generate(prompts, params)
    finally:
        engine.async_scheduling = False
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    assert re.fullmatch("[0-9]{3}-[a-z]{2,5}", overlapped[0].text), overlapped[0].text


def test_a_bad_schema_fails_that_request_alone(engine: LLMEngine) -> None:
    engine.add_request("ok", messages=ASK, params=SamplingParams(max_tokens=2, temperature=0.0))
    for bad, why in [({"json_schema": {"type": "foo"}}, "Invalid type"),
                     ({"json_schema": {"$ref": "#/nowhere"}}, "does not exist"),
                     ({"regex": "(unclosed"}, "regex"),
                     ({"grammar": "start: undefined_rule"}, "undefined_rule")]:
        with pytest.raises(InvalidRequest, match=why):
            engine.add_request("bad", messages=ASK, params=SamplingParams(max_tokens=4, structured_output=bad))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"] and outs[-1].error is None


@pytest.mark.slow
def test_a_resumed_request_replays_its_delivered_tokens(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output={"json_schema": PERSON})
    ids = _chat_ids(engine, ASK[0]["content"])
    [whole] = engine.generate([ids], params)
    k = 5
    engine.add_request("resumed", prompt_token_ids=ids, params=params, resume_token_ids=whole.token_ids[:k])
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            rest += o.new_token_ids
    assert whole.token_ids[:k] + rest == whole.token_ids
    wrong = engine.tokenizer.encode("not json", add_special_tokens=False)
    with pytest.raises(InvalidRequest, match="breaks the structured output"):
        engine.add_request("wrong", messages=ASK, params=params, resume_token_ids=wrong)


def test_a_complete_constraint_finishes_before_min_tokens(engine: LLMEngine) -> None:
    [out] = engine.generate([_chat_ids(engine, "Is water wet?")],
                            SamplingParams(max_tokens=10, min_tokens=6, temperature=0.0,
                                           structured_output={"choice": ["yes", "no"]}))
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.stop_reason is None
