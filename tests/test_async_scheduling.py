"""Async scheduling (step N+1 scheduled and launched before step N's tokens are on the host) gives the same
outputs as the synchronous engine: greedy and seeded random tokens, texts, finish reasons, logprobs and
usage, over mixed batches with chunked prefill, stop strings, stop ids, EOS, max_tokens, aborts in
flight, preemption under a tiny KV budget and prefix-cache hits. A token computed for a request that had
already finished is never emitted, no block hash ever covers a token in flight, and every block comes back.

The scheduler alone is also driven one step ahead by a fake model over random workloads."""

from __future__ import annotations

import random
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_scheduler import FakeModel, Workload, check_state, make_scheduler, reference, workloads
from tiny_hf import save_tiny_model

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.block_manager import ROOT_HASH, hash_block
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.outputs import RequestOutput
from tokenmill.worker.request import Request
from tokenmill.worker.scheduler import ScheduledBatch, Scheduler
from tokenmill.worker.transfer import HostCopy, ship

Job = tuple[str, list[int], SamplingParams]


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


def make_engine(model: str, async_scheduling: bool, eos: int | None = None, **config: Any) -> LLMEngine:
    dummy = not model.startswith("/")
    config = {"device": "cpu", "dtype": "float32", **config}
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy" if dummy else "auto",
                                    async_scheduling=async_scheduling, **config))
    if eos is not None:  # an EOS id that the model actually produces, so the EOS rule fires
        engine.eos_token_ids = (eos,)
        engine.scheduler.eos_token_ids = frozenset({eos})
    return engine


def model_name(which: str, hf_path: Path) -> str:
    return str(hf_path) if which == "hf" else "tiny-llama"


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 15, 16, 17, 33, 70, 5]
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


# -- driving an engine and checking what it emits ---------------------------------------------------


def audit_hashes(engine: LLMEngine) -> None:
    """Every request's block hashes are the hash chain of its known tokens: none covers a token in flight."""
    bs = engine.blocks.block_size
    vocab = engine.runner.arch.vocab_size
    for req in engine.scheduler.running + engine.scheduler.waiting:
        known = req.token_ids
        assert all(0 <= t < vocab for t in known), f"{req.request_id}: a token that is no vocabulary id"
        assert len(known) + req.num_inflight == req.num_tokens and 0 <= req.num_inflight <= 2
        assert len(req.block_hashes) <= len(known) // bs
        parent = ROOT_HASH
        for i, h in enumerate(req.block_hashes):
            parent = hash_block(parent, known[i * bs : (i + 1) * bs])
            assert h == parent, f"{req.request_id}: block {i} hash does not match its tokens"


def run(engine: LLMEngine, jobs: list[Job], aborts: dict[int, list[str]] | None = None,
        readd: dict[int, list[Job]] | None = None) -> dict[str, list[RequestOutput]]:
    """Add `jobs`, step to the end (aborting / adding more at given steps); outputs per request id."""
    for rid, ids, params in jobs:
        engine.add_request(rid, prompt_token_ids=ids, params=params)
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    step = 0
    while engine.has_unfinished_requests():
        for rid in (aborts or {}).get(step, []):
            engine.abort_request(rid)
        for rid, ids, params in (readd or {}).get(step, []):
            engine.add_request(rid, prompt_token_ids=ids, params=params)
        for out in engine.step():
            outs[out.request_id].append(out)
        audit_hashes(engine)
        step += 1
        assert step < 2000
    engine.blocks.check_integrity()
    assert engine.blocks.num_in_use == 0 and not engine._inflight
    return outs


class Result(NamedTuple):
    tokens: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    completion_tokens: int
    logprobs: list[dict[int, float]]


def summarize(deltas: list[RequestOutput]) -> Result:
    """Check the deltas of one request (gap-free, one final delta, last) and join them."""
    tokens: list[int] = []
    logprobs: list[dict[int, float]] = []
    for i, d in enumerate(deltas):
        assert d.first_index == len(tokens), "deltas are not gap-free"
        assert d.finished == (i == len(deltas) - 1), "exactly the last delta is final"
        tokens += d.new_token_ids
        logprobs += d.logprobs or []
    last = deltas[-1]
    assert last.usage is not None and last.usage.completion_tokens == len(tokens)
    assert all(t >= 0 for t in tokens)
    return Result(tokens, "".join(d.text_delta for d in deltas), last.finish_reason, last.stop_reason,
                  last.usage.completion_tokens, logprobs)


def results(outs: dict[str, list[RequestOutput]]) -> dict[str, Result]:
    return {rid: summarize(d) for rid, d in outs.items()}


def assert_same(got: dict[str, Result], want: dict[str, Result]) -> None:
    """Equal results; logprobs to float tolerance (a different batch mix changes the last bits)."""
    assert got.keys() == want.keys()
    for rid, a in got.items():
        b = want[rid]
        assert a._replace(logprobs=[]) == b._replace(logprobs=[]), rid
        assert [d.keys() for d in a.logprobs] == [d.keys() for d in b.logprobs], rid
        for da, db in zip(a.logprobs, b.logprobs):
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da), rid


def both(model: str, jobs: list[Job], eos: int | None = None, **config: Any) -> tuple[dict[str, Result], ...]:
    return tuple(results(run(make_engine(model, a, eos, **config), jobs)) for a in (False, True))


# -- mixed batches ----------------------------------------------------------------------------------


def stop_jobs(model: str, seed: int, **config: Any) -> tuple[list[Job], int]:
    """A mixed batch whose stop ids, stop strings and EOS id are chosen from a reference run, so every
    stop rule fires; returns the jobs and the EOS id to use."""
    engine = make_engine(model, False, **config)
    ps = prompts(engine.runner.arch.vocab_size, 16, seed)
    free = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    ref = results(run(engine, [(f"r{i}", p, free) for i, p in enumerate(ps)]))
    eos = ref["r0"].tokens[4]
    jobs: list[Job] = []
    for i, p in enumerate(ps):
        r = ref[f"r{i}"]
        kind = i % 6
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=14)  # EOS at token 4 (or earlier)
        elif kind == 1:
            params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop_token_ids=[r.tokens[3]])
        elif kind == 2:
            text = r.text
            params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                    stop=[text[len(text) // 3 : len(text) // 3 + 3]])
        elif kind == 3:
            params = SamplingParams(temperature=0.0, max_tokens=1 + i % 5, ignore_eos=True, logprobs=2)
        elif kind == 4:
            params = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=6, stop_token_ids=[r.tokens[1]])
        else:
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        jobs.append((f"r{i}", p, params))
    return jobs, eos


@pytest.mark.parametrize("which", ["dummy", "hf"])
def test_mixed_batch_with_every_stop_rule_is_identical(which: str, hf_path: Path) -> None:
    model = model_name(which, hf_path)
    jobs, eos = stop_jobs(model, seed=1)
    # A small token budget chunks the long prompts and mixes them with decodes of the others.
    sync, asyn = both(model, jobs, eos, scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))
    assert_same(asyn, sync)
    reasons = {(r.finish_reason, type(r.stop_reason).__name__) for r in sync.values()}
    assert {("stop", "NoneType"), ("stop", "int"), ("stop", "str"), ("length", "NoneType")} <= reasons, reasons
    assert any(r.logprobs for r in sync.values())


def test_seeded_random_sampling_with_penalties_is_identical(hf_path: Path) -> None:
    ps = prompts(384, 12, seed=2)
    kinds = [dict(temperature=0.9, top_p=0.9, seed=7), dict(temperature=1.2, top_k=20),
             dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
             dict(temperature=0.0, frequency_penalty=1.5, logprobs=3), dict(temperature=1.0, min_p=0.05, min_tokens=5)]
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=12, **kinds[i % len(kinds)]))  # type: ignore[arg-type]
            for i, p in enumerate(ps)]
    sync, asyn = both(str(hf_path), jobs, scheduler=SchedulerConfig(max_num_batched_tokens=64), seed=5)
    assert_same(asyn, sync)


def test_penalties_see_the_token_still_in_flight() -> None:
    """Strong penalties make the next token depend on the previous one, which is still in flight (not on
    the host) when the next step is prepared: the runner must fill it in on the device."""
    kinds = [dict(frequency_penalty=2.0, presence_penalty=2.0), dict(frequency_penalty=-2.0),
             dict(repetition_penalty=5.0), dict(repetition_penalty=0.2)]
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                        **kinds[i % len(kinds)]))  # type: ignore[arg-type]
            for i, p in enumerate(prompts(512, 8, seed=9))]
    sync, asyn = both("tiny-llama", jobs)
    assert_same(asyn, sync)


# -- aborts, preemption, prefix caching -------------------------------------------------------------


def test_aborts_in_flight_free_everything_and_never_leak_tokens() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(prompts(512, 8, seed=3))]
    full = results(run(make_engine("tiny-llama", False), jobs))
    # r0 before its first step, r1 mid-prefill, r2..r4 while decoding; r2's id is reused at once.
    aborts = {0: ["r0"], 1: ["r1"], 3: ["r2"], 5: ["r3"], 8: ["r4"]}
    again = {3: [("r2", jobs[2][1], params)]}
    cfg = dict(scheduler=SchedulerConfig(max_num_batched_tokens=24))
    for async_scheduling in (False, True):
        engine = make_engine("tiny-llama", async_scheduling, **cfg)  # type: ignore[arg-type]
        outs = run(engine, jobs, aborts, again)
        aborted = {rid for ids in aborts.values() for rid in ids if rid != "r2"}
        for rid, deltas in outs.items():
            if rid == "r2":  # the first r2's abort delta, then the new r2's whole output
                cut = next(i for i, d in enumerate(deltas) if d.finished) + 1
                assert summarize(deltas[:cut]).finish_reason == "abort"
                assert summarize(deltas[cut:]) == full["r2"]
                continue
            got = summarize(deltas)
            if rid in aborted:
                assert got.finish_reason == "abort" and got.tokens == full[rid].tokens[: len(got.tokens)]
            else:
                assert got == full[rid]
        assert summarize(outs["r3"]).tokens, "r3 was aborted while decoding"


def test_everything_aborted_while_a_step_is_in_flight() -> None:
    engine = make_engine("tiny-llama", True)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(prompts(512, 3, seed=4)):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    engine.step()
    engine.step()
    assert engine._inflight, "a step is in flight between step() calls"
    for i in range(3):
        assert engine.abort_request(f"r{i}")
    assert engine.blocks.num_in_use == 0 and engine.has_unfinished_requests()
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"] and all(o.finish_reason == "abort" for o in outs)
    assert all(not o.new_token_ids for o in outs)
    while engine.has_unfinished_requests():
        assert engine.step() == []
    engine.blocks.check_integrity()


@pytest.mark.parametrize("which", ["dummy", "hf"])
def test_preemption_under_a_tiny_kv_budget_is_identical(which: str, hf_path: Path) -> None:
    model = model_name(which, hf_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(prompts(384, 12, seed=5))]
    big = results(run(make_engine(model, False), jobs))
    for async_scheduling in (False, True):
        engine = make_engine(model, async_scheduling, cache=CacheConfig(block_size=4, num_blocks=40))
        assert results(run(engine, jobs)) == big
        assert engine.stats().num_preemptions > 0


def test_prefix_cache_hits_on_output_blocks_are_identical(hf_path: Path) -> None:
    """The second prompt is the first's prompt and output: its cached blocks hold output tokens,
    which were in flight while their steps ran."""
    first = prompts(384, 8, seed=6)[6]  # 70 tokens
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    got = []
    for async_scheduling in (False, True):
        engine = make_engine(str(hf_path), async_scheduling)
        out1 = results(run(engine, [("a", first, params)]))["a"]
        outs = run(engine, [("b", first + out1.tokens, params)])
        usage = outs["b"][-1].usage
        assert usage is not None
        got.append((out1, summarize(outs["b"]), usage.cached_tokens))
    assert got[0] == got[1]
    assert got[1][2] == (70 + 30 - 1) // 16 * 16, "every full block of prompt and output is reused"
    cold = make_engine(str(hf_path), True, cache=CacheConfig(enable_prefix_caching=False))
    assert results(run(cold, [("b", first + got[0][0].tokens, params)]))["b"].tokens == got[1][1].tokens


def test_generate_and_stream_in_async_mode(hf_path: Path) -> None:
    ps = prompts(384, 5, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    sync, asyn = (make_engine(str(hf_path), a) for a in (False, True))
    assert [o.token_ids for o in asyn.generate(ps, params)] == [o.token_ids for o in sync.generate(ps, params)]
    streamed = [t for out in asyn.stream(ps[0], params) for t in out.new_token_ids]
    assert streamed == sync.generate([ps[0]], params)[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_async_matches_sync(hf_path: Path) -> None:
    """On CUDA (float32, Triton, decode graphs, pinned transfers): the mixed batch of every stop rule,
    then aborts in flight. float32 ties may flip a token where the batch mix differs: allow two."""
    config: dict[str, Any] = dict(device="cuda", scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))
    jobs, eos = stop_jobs(str(hf_path), seed=1, **config)
    sync, asyn = (results(run(make_engine(str(hf_path), a, eos, **config), jobs)) for a in (False, True))
    differ = [rid for rid in sync if asyn[rid].tokens != sync[rid].tokens]
    assert len(differ) <= 2, differ
    aborts = {2: ["r3", "r4"], 6: ["r5"]}
    for async_scheduling in (False, True):
        outs = run(make_engine(str(hf_path), async_scheduling, eos, **config), jobs, aborts)
        for rid in ("r3", "r4", "r5"):
            got = summarize(outs[rid])
            assert got.finish_reason == "abort" and got.tokens == sync[rid].tokens[: len(got.tokens)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_launch_never_waits_for_the_device(hf_path: Path) -> None:
    """Preparing and launching a step (inputs, in-flight gathers, penalties, sampling, the copy back)
    makes no synchronizing CUDA call: the host is free to prepare the next step meanwhile."""
    engine = make_engine(str(hf_path), True, device="cuda", dtype="bfloat16",
                         cache=CacheConfig(enable_prefix_caching=False),  # the second run repeats the shapes
                         scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))
    kinds = [dict(), dict(frequency_penalty=1.0, repetition_penalty=1.2), dict(logprobs=3)]
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                        **kinds[i % 3]))  # type: ignore[arg-type]
            for i, p in enumerate(prompts(384, 9, seed=10))]
    warm = results(run(engine, jobs))  # compiles and autotunes the kernels for these shapes
    launch = engine.runner.launch

    def checked(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.runner.launch = checked  # type: ignore[method-assign]
    again = results(run(engine, jobs))
    assert {k: r.tokens for k, r in again.items()} == {k: r.tokens for k, r in warm.items()}


# -- the scheduler alone, one step ahead ------------------------------------------------------------


class AheadModel(FakeModel):
    """FakeModel for a batch launched before the previous step's tokens are known: an input in flight
    reads the token the previous step sampled for it (as the runner reads it on the device)."""

    def execute_ahead(self, batch: ScheduledBatch, prev: dict[Request, int]) -> list[int | None]:
        saved = []
        for req in batch.requests:
            if req.num_inflight:
                assert req.num_inflight == 1 and req in prev, f"{req.request_id}: an unknown token in flight"
                saved.append(req)
                req.token_ids.append(prev[req])
                req.num_inflight -= 1
        try:
            return self.execute(batch)
        finally:
            for req in saved:
                req.token_ids.pop()
                req.num_inflight += 1


def drive_ahead(sched: Scheduler, w: Workload) -> list[Request]:
    """The engine's async step on the fake model: schedule + launch N+1, then commit N."""
    reqs = [Request(f"r{i}", list(s.prompt), s.params, seed=s.seed, arrival_seq=-1, priority=s.priority)
            for i, s in enumerate(w.specs)]
    model = AheadModel(sched.blocks)
    order = sorted(range(len(w.specs)), key=lambda i: w.specs[i].arrival)
    inflight: deque[tuple[ScheduledBatch, list[int | None]]] = deque()
    arrived = step = 0
    while arrived < len(order) or sched.has_unfinished() or inflight:
        while arrived < len(order) and w.specs[order[arrived]].arrival <= step:
            reqs[order[arrived]].arrival_seq = arrived
            sched.add(reqs[order[arrived]])
            arrived += 1
        for s, r in zip(w.specs, reqs):
            if s.abort_at == step and r.arrival_seq >= 0 and not r.is_finished:
                sched.finish(r, "abort")
                assert not r.block_ids and not r.num_inflight
        batch = sched.schedule()
        if batch.requests:
            prev = dict(zip(inflight[-1][0].requests, inflight[-1][1])) if inflight else {}
            sampled = model.execute_ahead(batch, {r: t for r, t in prev.items() if t is not None})
            sched.begin_step(batch)
            inflight.append((batch, sampled))
        while len(inflight) > (1 if batch.requests else 0):
            sched.commit(*inflight.popleft())
        check_state(sched)
        step += 1
        assert step < 5000, "no termination"
    return reqs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_one_step_ahead_matches_reference(w: Workload) -> None:
    sched = make_scheduler(w.config, w.num_blocks, w.block_size, w.max_model_len, w.caching)
    reqs = drive_ahead(sched, w)
    assert not sched.has_unfinished() and sched.blocks.num_in_use == 0
    sched.blocks.check_integrity()
    for s, r in zip(w.specs, reqs):
        assert r.is_finished and not r.num_inflight
        expect = reference(s, w.max_model_len)
        if r.finish_reason in ("error", "abort"):
            assert r.output_token_ids == expect[0][: r.num_output_tokens]
        else:
            assert (r.output_token_ids, r.finish_reason) == expect, r.request_id


def test_length_bound_request_is_not_scheduled_for_a_token_it_would_discard() -> None:
    sched = make_scheduler(SchedulerConfig(), 16, 4)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), seed=0, arrival_seq=0)
    sched.add(req)
    batches = []
    inflight: deque[tuple[ScheduledBatch, list[int | None]]] = deque()
    while sched.has_unfinished():
        batch = sched.schedule()
        batches.append(list(batch.num_new_tokens))
        if batch.requests:
            sched.begin_step(batch)
            inflight.append((batch, [5]))
        while len(inflight) > (1 if batch.requests else 0):
            sched.commit(*inflight.popleft())
    assert batches == [[3], [1], []], "the second (last) token's step is never followed by a third"
    assert req.finish_reason == "length" and req.num_output_tokens == 2


# -- transfers ------------------------------------------------------------------------------------------


def test_ship_and_host_copy_round_trip() -> None:
    host = {"a": torch.tensor([True, False, True]), "b": torch.arange(5, dtype=torch.int32),
            "c": torch.zeros((3, 0), dtype=torch.int64), "d": torch.tensor([[1.5, -2.0]]),
            "e": torch.arange(7, dtype=torch.int64).reshape(7, 1),
            "f": torch.tensor([1.25, -3.5, 7.0], dtype=torch.bfloat16),  # no numpy dtype: staged through torch
            "g": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),  # not contiguous
            "h": torch.arange(3, dtype=torch.int16)}  # ends off the 16-byte grid
    dev = ship(host, torch.device("cpu"))
    for name, t in host.items():
        assert dev[name].dtype == t.dtype and dev[name].shape == t.shape and torch.equal(dev[name], t)
    assert HostCopy([dev["b"]]).wait()[0].tolist() == [0, 1, 2, 3, 4]
