"""ShareGPT reading (the shipped file is cut off mid-record) and vLLM-style request sampling."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tokenmill.benchmarks.datasets import (
    SampledRequest,
    iter_sharegpt,
    sample_sharegpt_requests,
    sharegpt_pairs,
)
from tokenmill.worker.registry_fetch import embedded_model_path
from tokenmill.worker.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_file(embedded_model_path(quiet=True))


def test_counts_of_the_shipped_file() -> None:
    records = list(iter_sharegpt())
    assert len(records) == 17_671
    assert records[0]["id"] == "QWJhYvA_0"
    pairs = sharegpt_pairs()
    assert len(pairs) == 11_135
    assert pairs[0][0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")


def test_truncated_and_chunked_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.benchmarks.datasets as datasets

    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi ñ"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only one"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "q" * 50}, {"from": "gpt", "value": "r"}]},
    ]
    text = json.dumps(records, indent=2, ensure_ascii=False)
    monkeypatch.setattr(datasets, "_CHUNK_CHARS", 7)  # records straddle many chunk boundaries
    whole, cut = tmp_path / "whole.json", tmp_path / "cut.json"
    whole.write_text(text, encoding="utf-8")
    assert [r["id"] for r in iter_sharegpt(whole)] == ["a", "b", "c", "d"]
    cut.write_bytes(text.encode("utf-8")[: text.encode("utf-8").index(b'"d"') + 40])
    assert [r["id"] for r in iter_sharegpt(cut)] == ["a", "b", "c"]
    assert sharegpt_pairs(cut) == [("hi ñ", "hello")]
    assert sharegpt_pairs(whole) == [("hi ñ", "hello"), ("q" * 50, "r")]
    (tmp_path / "bad.json").write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_sharegpt(tmp_path / "bad.json"))


def test_sampling_respects_limits_and_seed(tok: Tokenizer) -> None:
    requests = sample_sharegpt_requests(tok, 40, seed=3)
    assert len(requests) == 40 and all(isinstance(r, SampledRequest) for r in requests)
    for r in requests:
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048
        assert r.prompt_len == len(tok.encode(r.prompt))
    assert sample_sharegpt_requests(tok, 40, seed=3) == requests
    other = sample_sharegpt_requests(tok, 40, seed=4)
    assert [r.prompt for r in other] != [r.prompt for r in requests]
    # A prefix of a larger sample under the same seed: sampling walks one shuffled order.
    assert sample_sharegpt_requests(tok, 20, seed=3) == requests[:20]


def test_sampling_options(tok: Tokenizer, tmp_path: Path) -> None:
    replies: dict[str, list[str]] = {}
    for prompt, reply in sharegpt_pairs():
        replies.setdefault(prompt, []).append(reply)
    short = sample_sharegpt_requests(tok, 40, seed=1, max_input_len=128, max_output_len=300,
                                     max_total_len=400)
    for r in short:
        assert r.prompt_len <= 128 and r.output_len <= 300 and r.prompt_len + r.output_len <= 400
        assert r.output_len in {len(tok.encode(reply)) for reply in replies[r.prompt]}
    fixed = sample_sharegpt_requests(tok, 10, seed=1, fixed_output_len=32)
    assert {r.output_len for r in fixed} == {32}
    small = tmp_path / "small.json"
    pairs = [[{"from": "human", "value": f"question number {i} is here"},
              {"from": "gpt", "value": "an answer " * i}] for i in range(8)]
    small.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(pairs)]))
    assert len(sample_sharegpt_requests(tok, 6, seed=0, path=small)) == 6  # "an answer " * 0..1 is too short
    with pytest.raises(ValueError, match="only 6 ShareGPT pairs fit"):
        sample_sharegpt_requests(tok, 7, seed=0, path=small)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fixed[0].prompt_len = 1  # type: ignore[misc]
