"""A request's first-token timeline in the engine (worker/outputs.RequestTimeline on its final output): added,
first scheduled, first token, in that order; a request that waits for a free sequence slot is first scheduled only
after a running one finishes; and the serving benchmark takes a TTFT apart with it (benchmarks/common.py)."""

from __future__ import annotations

import math

import pytest
from tiny_hf import save_tiny_model

from tokenmill.benchmarks.common import RequestTiming, slowest_timelines
from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", cache=CacheConfig(num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_seqs=2)))


def test_timelines_are_ordered_and_a_waiting_request_starts_after_a_slot_frees(engine: LLMEngine) -> None:
    for i, n in enumerate((3, 12, 5)):
        engine.add_request(f"r{i}", prompt_token_ids=[5 + i, 6, 7], params=SamplingParams(max_tokens=n,
                                                                                          temperature=0.0))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for out in finals.values():
        tl = out.timeline
        assert tl is not None and tl.added <= tl.first_scheduled <= tl.first_token
    # two sequence slots: r2 waits until r0 (3 tokens) finishes, so its first step comes after r0's last
    assert finals["r2"].timeline.first_scheduled > finals["r0"].timeline.first_token  # type: ignore[union-attr]
    assert finals["r0"].timeline.first_scheduled <= finals["r1"].timeline.first_token  # type: ignore[union-attr]


def test_a_ttft_is_taken_apart_into_its_parts() -> None:
    t = RequestTiming(sent=10.0, prompt_len=4, chunk_times=[10.5, 10.6], chunk_sizes=[1, 1], output_len=2, done=10.7,
                      queue_time=0.1, worker=(0.02, 0.12, 0.32))
    tl = t.timeline()
    assert tl["ttft_ms"] == pytest.approx(500.0)
    assert tl["broker_queue_ms"] == pytest.approx(100.0) and tl["worker_admission_ms"] == pytest.approx(20.0)
    assert tl["wait_for_step_ms"] == pytest.approx(100.0) and tl["first_step_ms"] == pytest.approx(200.0)
    assert tl["transit_ms"] == pytest.approx(500.0 - 100.0 - 320.0)
    unknown = RequestTiming(sent=0.0, prompt_len=1, chunk_times=[1.0], chunk_sizes=[1], output_len=1, done=1.0)
    assert math.isnan(unknown.timeline()["first_step_ms"]) and unknown.timeline()["ttft_ms"] == pytest.approx(1e3)
    slow = slowest_timelines([unknown, t], n=1)
    assert len(slow) == 1 and slow[0]["ttft_ms"] == pytest.approx(1e3)
