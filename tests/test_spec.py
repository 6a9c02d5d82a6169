"""Speculative decoding with n-gram (prompt lookup) drafts, on CPU: the proposer and the verifier alone, then
the engine. Greedy and seeded random outputs are token-identical to decoding without speculation on every
tiny architecture, alone and batched, with chunked prefill, every stop rule, logprobs, penalties, preemption,
prefix hits and async scheduling; per-request k and off; bad settings. The distribution tests are in
test_spec_distribution.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_async_scheduling import Job, assert_same, make_engine, prompts, results, run, stop_jobs
from tiny_hf import ARCHS, save_tiny_model

from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine, StepRecord
from tokenmill.worker.spec.ngram import SuffixIndex, continuations, lookup
from tokenmill.worker.spec.verifier import DraftLayout, accept_drafts

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


def repetitive(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (prompt lookup finds drafts in them), of mixed lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(3 + i % 5)]
        out.append((phrase * (2 + i % 4) + [rng.randrange(3, vocab) for _ in range(i % 3)])[: 60])
    return out


def spec_and_plain(model: str, jobs: list[Job], eos: int | None = None, async_scheduling: bool = False,
                   spec: SpeculativeConfig = NGRAM, **config: Any) -> tuple[dict[str, Any], dict[str, Any], LLMEngine]:
    """Results with and without speculation, and the speculating engine (its counters)."""
    engine = make_engine(model, async_scheduling, eos, speculative=spec, **config)
    with_drafts = results(run(engine, jobs))
    plain = results(run(make_engine(model, False, eos, **config), jobs))
    return with_drafts, plain, engine


def accepted(engine: LLMEngine) -> int:
    return engine.counters.accepted_draft_tokens


# -- the proposer and the verifier alone -------------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    assert lookup([1, 2, 3, 4, 1, 2], 3, 1, 4) == [3, 4, 1]
    # [9, 2] occurs at the start, [2] alone later: the longer n-gram wins.
    assert lookup([9, 2, 5, 6, 2, 7, 9, 2], 2, 1, 4) == [5, 6]
    # Among equal n-grams the latest earlier occurrence wins.
    assert lookup([2, 5, 3, 2, 6, 3, 2], 1, 1, 1) == [6]
    assert lookup([2, 5, 3, 2, 6, 3, 2], 2, 2, 2) == [6, 3]
    # A continuation running into the end reads on through its own drafts (the period repeats).
    assert lookup([5, 1, 2, 1, 2], 5, 1, 4) == [1, 2, 1, 2, 1]
    assert lookup([7, 7, 7], 3, 1, 4) == [7, 7, 7]
    assert lookup([1, 2, 3], 3, 1, 4) == [] and lookup([4], 3, 1, 4) == []
    assert lookup([1, 2, 3, 1], 3, 2, 4) == [], "no 2-gram repeats"


def brute_continuations(tokens: list[int], k: int, min_n: int, max_n: int, width: int) -> list[list[int]]:
    """The rule spelled out: for n from the longest suffix down, every earlier occurrence of the last n tokens
    (latest first), its continuation read on through itself past the end, distinct ones only."""
    found: list[list[int]] = []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == tokens[-n:]:
                cont = list(tokens[i + n : i + n + k])
                while len(cont) < k:
                    cont.append(cont[len(cont) - (len(tokens) - i - n)])
                if cont not in found:
                    found.append(cont)
                    if len(found) == width:
                        return found
    return found


def test_ngram_continuations_equal_the_rule_spelled_out() -> None:
    rng = random.Random(11)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 40])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi, width = lo + rng.randrange(0, 6), rng.randrange(1, 5)
        assert continuations(tokens, k, lo, hi, width) == brute_continuations(tokens, k, lo, hi, width), tokens


def test_the_suffix_index_looks_up_what_lookup_does_as_tokens_arrive() -> None:
    """The proposers' incremental index (each token indexed once) against lookup over the whole list, one step at a
    time as tokens are appended; a new list, and a shorter one (a stop string cut it), start it again."""
    rng = random.Random(5)
    for _ in range(200):
        vocab, lo = rng.choice([2, 3, 5, 40]), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 6)
        index, tokens = SuffixIndex(lo, hi), [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        for _ in range(40):
            k = rng.randrange(1, 6)
            assert index.lookup(tokens, k) == lookup(tokens, k, lo, hi), (tokens, k, lo, hi)
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
        del tokens[rng.randrange(1, len(tokens)) :]
        assert index.lookup(tokens, 3) == lookup(tokens, 3, lo, hi)
        other = [rng.randrange(vocab) for _ in range(len(tokens))]
        assert index.lookup(other, 3) == lookup(other, 3, lo, hi)


def test_verifier_accepts_the_leading_drafts_equal_to_the_target() -> None:
    # Three requests with 2, 0 and 3 drafts: rows 0-2, 3, 4-7.
    drafts = [[5, 6], [], [1, 2, 3]]
    layout = DraftLayout.build(drafts)
    assert layout.starts == [0, 3, 4]
    target = torch.tensor([5, 9, 4, 8, 1, 2, 7, 0])  # the target's token at each row
    assert accept_drafts(target, layout.rows, layout.drafts).tolist() == [1, 0, 2]
    target = torch.tensor([5, 6, 4, 8, 1, 2, 3, 0])
    assert accept_drafts(target, layout.rows, layout.drafts).tolist() == [2, 0, 3]
    target = torch.tensor([0, 6, 4, 8, 0, 2, 3, 0])  # a later equal token does not count after a miss
    assert accept_drafts(target, layout.rows, layout.drafts).tolist() == [0, 0, 0]


# -- greedy: token-identical ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_is_identical_on_every_tiny_architecture(arch: str, tmp_path: Path) -> None:
    model = str(save_tiny_model(arch, tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 8, seed=1))]
    small = dict(scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))  # chunks and mixes
    batched, plain, engine = spec_and_plain(model, jobs, **small)
    assert batched == plain
    assert accepted(engine) > 0, "some drafts were accepted"
    alone, plain_alone, _ = spec_and_plain(model, jobs[:1])
    assert alone == plain_alone == {"r0": plain["r0"]}


@pytest.mark.parametrize("which", ["dummy", "hf"])
def test_mixed_batch_with_every_stop_rule_is_identical(which: str, hf_path: Path) -> None:
    model = str(hf_path) if which == "hf" else "tiny-llama"
    jobs, eos = stop_jobs(model, seed=1)
    # The stop-string rule with several tokens per step; repetitive prompts so that drafts get accepted.
    extra = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    jobs += [(f"x{i}", p, extra) for i, p in enumerate(repetitive(384, 4, seed=2))]
    got, want, engine = spec_and_plain(model, jobs, eos,
                                       scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))
    assert_same(got, want)
    assert accepted(engine) > 0


def test_stops_inside_accepted_drafts_end_the_request_where_plain_decoding_does(hf_path: Path) -> None:
    """Stop ids, EOS and stop strings placed on tokens that come in as accepted drafts (a request that
    repeats itself: drafts are accepted for many tokens in a row)."""
    model = str(hf_path)
    ps = repetitive(384, 6, seed=3)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base, _, engine = spec_and_plain(model, [(f"r{i}", p, free) for i, p in enumerate(ps)])
    assert accepted(engine) > 0
    jobs: list[Job] = []
    for i, p in enumerate(ps):
        r = base[f"r{i}"]
        jobs.append((f"id{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                 stop_token_ids=[r.tokens[9]], logprobs=1)))
        text = r.text
        jobs.append((f"str{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                  stop=[text[len(text) // 2 : len(text) // 2 + 2]], logprobs=0)))
        jobs.append((f"len{i}", p, SamplingParams(temperature=0.0, max_tokens=7 + i, ignore_eos=True)))
    got, want, _ = spec_and_plain(model, jobs)
    assert_same(got, want)
    eos = base["r0"].tokens[12]
    got, want, _ = spec_and_plain(model, [("e", ps[0], SamplingParams(temperature=0.0, max_tokens=40))], eos)
    assert got == want and want["e"].finish_reason == "stop"


# -- seeded random sampling: token-identical too -----------------------------------------------------------


def test_seeded_random_sampling_with_every_filter_and_penalty_is_identical(hf_path: Path) -> None:
    # Low temperatures too: the random tiny model then repeats itself, so drafts get accepted.
    kinds: list[dict[str, Any]] = [dict(temperature=0.9, top_p=0.9, seed=7), dict(temperature=0.2, top_k=20),
                                   dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
                                        presence_penalty=0.4),
                                   dict(temperature=0.0, frequency_penalty=1.5, logprobs=3),
                                   dict(temperature=0.3, min_p=0.05, min_tokens=5, logprobs=2),
                                   dict(temperature=0.1, top_p=0.8, repetition_penalty=1.1, seed=11)]
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=20, ignore_eos=True, **kinds[i % len(kinds)]))
            for i, p in enumerate(repetitive(384, 12, seed=4))]
    got, want, engine = spec_and_plain(str(hf_path), jobs, scheduler=SchedulerConfig(max_num_batched_tokens=64),
                                       seed=5)
    assert_same(got, want)
    assert accepted(engine) > 0


# -- the cache and the step loop -----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dummy", "hf"])
def test_preemption_under_a_tiny_kv_budget_is_identical(which: str, hf_path: Path) -> None:
    model = str(hf_path) if which == "hf" else "tiny-llama"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 10, seed=5) + prompts(384, 4, seed=5))]
    got, want, engine = spec_and_plain(model, jobs, cache=CacheConfig(block_size=4, num_blocks=40))
    assert got == want
    assert engine.stats().num_preemptions > 0 and accepted(engine) > 0


def test_prefix_cache_hits_after_speculation_are_identical(hf_path: Path) -> None:
    """The second prompt is the first's prompt and output: its cached blocks were filled by verify steps
    (rejected drafts' KV overwritten)."""
    first = repetitive(384, 6, seed=6)[5]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine = make_engine(str(hf_path), False, speculative=NGRAM)
    out1 = results(run(engine, [("a", first, params)]))["a"]
    second = first + out1.tokens
    got = results(run(engine, [("b", second, params)]))["b"]
    assert engine.stats().prefix_cache_hits > 0 and accepted(engine) > 0
    cold = make_engine(str(hf_path), False, cache=CacheConfig(enable_prefix_caching=False))
    assert results(run(cold, [("b", second, params)]))["b"] == got


def test_async_scheduling_with_speculating_and_plain_requests_is_identical(hf_path: Path) -> None:
    """Async scheduling on, half the requests with speculation off: the engine runs synchronous steps
    while a request speculates, async ones once none does; outputs never change."""
    ps = repetitive(384, 8, seed=7)
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=16 + 4 * (i % 2),
                                        ignore_eos=True, num_speculative_tokens=0 if i % 2 else None))
            for i, p in enumerate(ps)]
    got, want, engine = spec_and_plain(str(hf_path), jobs, async_scheduling=True)
    assert_same(got, want)
    assert accepted(engine) > 0


def test_per_request_k_and_off(hf_path: Path) -> None:
    ps = repetitive(384, 3, seed=8)
    ks = [0, 2, None]  # off, two drafts, the engine's four
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_speculative_tokens=k))
            for i, (p, k) in enumerate(zip(ps, ks))]
    engine = make_engine(str(hf_path), False, speculative=NGRAM)
    widest: dict[str, int] = {}

    def observe(rec: StepRecord) -> None:
        for r, n in zip(rec.batch.requests, rec.batch.num_new_tokens):
            if r.num_computed_tokens >= r.num_prompt_tokens:  # a decode or verify step
                widest[r.request_id] = max(widest.get(r.request_id, 0), n)
                assert n == 1 + len(r.draft_token_ids)

    engine.step_observer = observe
    got = results(run(engine, jobs))
    assert widest == {"r0": 1, "r1": 3, "r2": 5}
    plain = results(run(make_engine(str(hf_path), False), jobs))
    assert got == plain


def test_a_request_asking_for_drafts_on_an_engine_without_speculation_decodes_plainly(hf_path: Path) -> None:
    jobs = [("r", repetitive(384, 1, seed=9)[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                                 num_speculative_tokens=5))]
    engine = make_engine(str(hf_path), False)
    assert engine.proposer is None
    got = results(run(engine, jobs))
    assert engine.counters.draft_tokens == 0
    assert got == results(run(make_engine(str(hf_path), False, speculative=NGRAM), jobs))


# -- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [-1, 17, 2.0, True, "3"])
def test_request_k_out_of_range_is_a_clear_error(k: object) -> None:
    with pytest.raises(InvalidRequest, match="num_speculative_tokens must be an integer in \\[0, 16\\]"):
        SamplingParams(num_speculative_tokens=k)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="num_speculative_tokens"):
        SamplingParams.from_dict({"num_speculative_tokens": k})


def test_a_bad_request_k_fails_alone_in_a_running_engine() -> None:
    engine = make_engine("tiny-llama", False, speculative=NGRAM)
    engine.add_request("ok", prompt_token_ids=[5, 6, 5, 6], params=SamplingParams(temperature=0.0, max_tokens=6))
    with pytest.raises(InvalidRequest):
        engine.add_request("bad", prompt_token_ids=[5, 6], params={"num_speculative_tokens": 99})
    outs = results(run(engine, []))
    assert list(outs) == ["ok"] and len(outs["ok"].tokens) == 6


@pytest.mark.parametrize("kw", [dict(method="eagle3"), dict(num_speculative_tokens=0),
                                dict(num_speculative_tokens=17), dict(prompt_lookup_min=0),
                                dict(prompt_lookup_min=3, prompt_lookup_max=2)])
def test_bad_speculative_config_is_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SpeculativeConfig(**kw)


def test_engine_config_default_is_no_speculation() -> None:
    assert EngineConfig().speculative.method == "off" and not EngineConfig().speculative.enabled
    assert SpeculativeConfig(method="ngram").enabled
