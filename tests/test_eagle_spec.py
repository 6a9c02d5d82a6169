"""EAGLE drafts in the engine (worker/spec/eagle_proposer.py), on CPU with heads saved in a temp dir:
the drafts equal a cache-free reference of the head over the target's features (so the head's paged KV
cache and its catch-up across rounds are right), greedy and seeded-sampled outputs are token-identical to
decoding without speculation on every tiny architecture, alone and batched, with chunked prefill,
preemption and prefix hits; a head that does not fit the target, or no head, is a clear error."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_async_scheduling import Job, assert_same, make_engine, results, run
from test_spec import repetitive
from tiny_hf import ARCHS, save_tiny_model

from tokenmill.kernels.launch import next_pow2
from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError
from tokenmill.worker.model_runner import ModelRunner, attention_metadata
from tokenmill.worker.request import Request
from tokenmill.worker.spec.eagle import (
    CONFIG_FILE,
    HEADS_DIR,
    DenseCausalBackend,
    EagleHead,
    FusionLayers,
    head_folder,
    load_eagle_head,
)
from tokenmill.worker.spec.eagle_proposer import EagleProposer, heldout_tau
from tokenmill.worker.spec.eagle_train import new_head, target_features
from tokenmill.worker.spec.switch import SpeculationSwitch, StepCosts


def save_head(model: Path, out: Path, seed: int = 0, fusion_layers: FusionLayers | None = None) -> Path:
    """An untrained head (eagle_train's initialisation; EAGLE-3's fusion of `fusion_layers` if given) for the model
    in `model`, saved in `out`."""
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", cache=CacheConfig(num_blocks=8)))
    new_head(engine.runner, seed, fusion_layers).save(out, {"model": model.name}, {})
    return out


def head_inputs(runner: ModelRunner, head: EagleHead, tokens: Sequence[int]) -> torch.Tensor:
    """The head's feature inputs [len(tokens), H] from the target run cache-free over `tokens`: its final-normed
    features f_t (EAGLE-1), or its fusion layers' states fused into g_t."""
    layers = head.fusion_layers or ()
    whole = target_features(runner, tokens, layers)  # [L, H (+ 3H)]
    with torch.no_grad():
        return head.fuse(whole[:, runner.arch.hidden_size :] if layers else whole)


def eagle(head: Path, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle", num_speculative_tokens=k, draft_model=str(head))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle")
    model = save_tiny_model("llama", root)
    return model, save_head(model, root / "head")


def spec_and_plain(model: Path, jobs: list[Job], spec: SpeculativeConfig, **config: Any,
                   ) -> tuple[dict[str, Any], dict[str, Any], LLMEngine]:
    engine = make_engine(str(model), False, speculative=spec, **config)
    got = results(run(engine, jobs))
    return got, results(run(make_engine(str(model), False, **config), jobs)), engine


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(2 + 7 * i % 41)] for i in range(n)]


# -- the drafts are the head's --------------------------------------------------------------------------


def reference_drafts(engine: LLMEngine, head_dir: Path, tokens: Sequence[int], k: int) -> list[int]:
    """The head run cache-free (dense attention) over the whole sequence: rows t < m from the target's
    real features f_t and embed(x_{t+1}), then one row per draft from the predicted feature."""
    runner = engine.runner
    head = load_eagle_head(head_dir, runner.arch, DenseCausalBackend(), dtype=torch.float32, device=runner.device)
    embed, logits = runner.model.model.embed_tokens, runner.model.compute_logits
    m = len(tokens) - 1
    with torch.no_grad():
        feats = head_inputs(runner, head, tokens[:m])  # [m, H]
        ids = list(tokens[1:])
        drafts: list[int] = []
        for _ in range(k):
            n = feats.shape[0]
            meta = attention_metadata([n], [n], [[0]], [-1] * n, runner.device)
            empty = torch.empty(0)
            out = head(embed(torch.tensor(ids)), feats, torch.arange(n), (empty, empty), meta)
            d = int(logits(out[-1:]).argmax(-1))
            drafts.append(d)
            ids.append(d)
            feats = torch.cat([feats, out[-1:]])
    return drafts


def record_drafts(proposer: EagleProposer) -> list[list[list[int]]]:
    """The drafts of each of the proposer's rounds from now on, in a list that grows as it drafts."""
    rounds: list[list[list[int]]] = []
    propose = proposer.propose

    def recording(reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        rounds.append(propose(reqs, ks))
        return rounds[-1]

    proposer.propose = recording  # type: ignore[method-assign]
    return rounds


def test_drafts_equal_the_cache_free_reference_of_the_head(tiny: tuple[Path, Path]) -> None:
    assert_drafts_are_the_heads(*tiny)


def test_drafts_from_the_chain_graphs_buffers_equal_the_reference(tiny: tuple[Path, Path]) -> None:
    """The chain graphs' rounds (run here eagerly from their static buffers, as a capture replays them: the
    catch-up padded to k + 1 rows a request, then the single-row steps), with batches padded to their buckets and
    requests asking fewer drafts than the graphs make."""
    assert_drafts_are_the_heads(*tiny, graph_sizes=(1, 4), per_request_k=True)


def assert_drafts_are_the_heads(model: Path, head: Path, graph_sizes: Sequence[int] = (),
                                per_request_k: bool = False) -> None:
    """Batched and chunked: every chain the engine drafts equals reference_drafts (`graph_sizes`: through chain
    graphs of those buckets; `per_request_k`: some requests ask 2 or 3 drafts instead of 4)."""
    engine = make_engine(str(model), False, speculative=eagle(head, k=4),
                         scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4))
    assert isinstance(engine.proposer, EagleProposer)
    used = []
    if graph_sizes:
        engine.proposer.capture_graphs(4, graph_sizes)
        graphs = engine.proposer.chain_graphs
        assert graphs is not None
        run_graphs = graphs.run

        def counting(*args: Any) -> torch.Tensor:
            used.append(len(args[4]))  # starts: one per request
            return run_graphs(*args)

        graphs.run = counting  # type: ignore[method-assign]
    calls: list[tuple[list[int], int, list[int]]] = []
    propose = engine.proposer.propose

    def recording(reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        drafts = propose(reqs, ks)
        calls.extend((list(r.token_ids), k, d) for r, k, d in zip(reqs, ks, drafts))
        return drafts

    engine.proposer.propose = recording  # type: ignore[method-assign]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                             num_speculative_tokens=(2 + i % 3) if per_request_k else None) for i in range(5)]
    run(engine, [(f"r{i}", p, params[i]) for i, p in enumerate(mixed_prompts(5, seed=2))])
    assert len(calls) > 20 and all(len(d) == k for _, k, d in calls), "every decoding request was drafted"
    if graph_sizes:
        assert len(used) > 10 and {2, 3} <= set(used), f"the graphs drafted batches of {used}"
        assert {2, 3, 4} <= {k for _, k, _ in calls} if per_request_k else 4 in {k for _, k, _ in calls}
    ref = make_engine(str(model), False)
    for tokens, k, drafts in calls:
        assert drafts == reference_drafts(ref, head, tokens, k), f"after {len(tokens)} tokens"


# -- token-identical output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_is_identical_on_every_tiny_architecture(arch: str, tmp_path: Path) -> None:
    model = save_tiny_model(arch, tmp_path)
    head = save_head(model, tmp_path / "head")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 6, seed=1) + mixed_prompts(3, seed=1))]
    small = dict(scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))  # chunks and mixes
    batched, plain, engine = spec_and_plain(model, jobs, eagle(head), **small)
    assert batched == plain
    assert engine.counters.draft_tokens > 0
    alone, plain_alone, _ = spec_and_plain(model, jobs[:1], eagle(head, k=5))
    assert alone == plain_alone == {"r0": plain["r0"]}


def test_seeded_sampling_preemption_and_prefix_hits_are_identical(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    kinds: list[dict[str, Any]] = [dict(temperature=0.9, top_p=0.9, seed=7), dict(temperature=0.3, top_k=20),
                                   dict(temperature=0.0, frequency_penalty=1.5, logprobs=2),
                                   dict(temperature=0.5, min_p=0.05, min_tokens=5, repetition_penalty=1.2)]
    ps = repetitive(384, 8, seed=4)
    shared = ps[0][:20]
    ps += [shared + p for p in ps[1:4]]  # prefix hits on the first prompt's blocks
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=18, ignore_eos=True, **kinds[i % len(kinds)]))
            for i, p in enumerate(ps)]
    got, want, engine = spec_and_plain(model, jobs, eagle(head, k=4), seed=5,
                                       cache=CacheConfig(block_size=4, num_blocks=48))
    assert_same(got, want)
    assert engine.stats().num_preemptions > 0 and engine.counters.draft_tokens > 0
    assert engine.stats().prefix_cache_hits > 0


def test_per_request_k_and_off_with_eagle(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    ps = mixed_prompts(4, seed=6)
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                        num_speculative_tokens=[0, 1, 5, None][i])) for i, p in enumerate(ps)]
    got, want, engine = spec_and_plain(model, jobs, eagle(head))
    assert got == want and engine.counters.draft_tokens > 0


def test_prompt_lookup_first_then_the_head_is_identical_and_drafts_both_ways(tiny: tuple[Path, Path]) -> None:
    """eagle_lookup_min: repeating prompts take prompt lookup's drafts, the others the head's (whose state catches
    up over the rounds lookup drafted), seeded sampling and greedy output as without speculation."""
    model, head = tiny
    prompts = repetitive(384, 4, seed=5) + mixed_prompts(4, seed=5)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    jobs = [(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    spec = dataclasses.replace(eagle(head, k=4), eagle_lookup_min=1)
    engine = make_engine(str(model), False, speculative=spec)
    assert isinstance(engine.proposer, EagleProposer) and engine.proposer.lookup is not None
    assert (engine.proposer.lookup.min_n, engine.proposer.lookup.max_n) == (1, 8)
    head_rows: list[int] = []
    draft_round = engine.proposer._round

    def counting(plan: Any) -> list[list[int]]:
        head_rows.append(len(plan.ks))
        return draft_round(plan)

    engine.proposer._round = counting  # type: ignore[method-assign]
    drafted = record_drafts(engine.proposer)
    assert results(run(engine, jobs)) == results(run(make_engine(str(model), False), jobs))
    per_round = [sum(bool(d) for d in r) for r in drafted]
    assert head_rows and sum(head_rows) < sum(per_round), "the head drafted some requests, lookup the others"
    with pytest.raises(ValueError, match="eagle_lookup_min"):
        SpeculativeConfig(method="eagle", eagle_lookup_min=9)
    with pytest.raises(ValueError, match="tree_width 1"):
        SpeculativeConfig(method="eagle", eagle_lookup_min=2, tree_width=2)


def test_the_switch_starts_from_the_heads_own_held_out_tau(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model, head = tiny
    assert heldout_tau(head) is None, "an untrained head's config records no tau"
    engine = make_engine(str(model), False, speculative=eagle(head, k=4))
    assert isinstance(engine.proposer, EagleProposer) and engine.proposer.expected_tau(4) is None
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "model.safetensors").write_bytes((head / "model.safetensors").read_bytes())
    config = json.loads((head / CONFIG_FILE).read_text())
    config["training"] = {"summary": {"heldout_tau_after": 1.6, "heldout_tau_depth": 4}}
    (trained / CONFIG_FILE).write_text(json.dumps(config))
    engine = make_engine(str(model), False, speculative=dataclasses.replace(eagle(trained, k=4), auto_switch=True))
    assert isinstance(engine.proposer, EagleProposer)
    assert engine.proposer.expected_tau(4) == pytest.approx(1.6)
    assert engine.proposer.expected_tau(2) == pytest.approx(1.3) and engine.proposer.expected_tau(6) == 1.6
    assert engine.switch is not None and engine.switch.tau == pytest.approx(1.6), "the switch's prior"
    assert heldout_tau(HEADS_DIR / "smollm2-135m-instruct") is not None, "the shipped head records its tau"


def test_the_switch_measures_the_heads_draft_cost(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    spec = dataclasses.replace(eagle(head, k=2), auto_switch=True)
    engine = make_engine(str(model), False, speculative=spec, scheduler=SchedulerConfig(max_num_seqs=4))
    assert engine.switch is not None and engine.switch.costs.batch_sizes == (1, 4)
    assert all(t > 0 for t in engine.switch.costs.draft_s)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(mixed_prompts(3, seed=9))]
    assert results(run(engine, jobs)) == results(run(make_engine(str(model), False), jobs))


def test_head_state_keeps_its_rows_of_each_steps_tensor_and_trims_them() -> None:
    """A request's kept features are views of the steps' whole kept tensors (its rows of each): read back in
    position order, joined into one tensor of its own past MAX_SHARED_CHUNKS, trimmed across chunks, and moved
    without touching the other requests' rows of a shared tensor."""
    from tokenmill.worker.spec.eagle_proposer import MAX_SHARED_CHUNKS, _HeadState, _Rows

    steps = [torch.arange(100.0 * i, 100.0 * i + 12).view(6, 2) for i in range(MAX_SHARED_CHUNKS + 3)]
    state = _HeadState(feat_start=10, head_pos=10)
    for base in steps:  # this request's rows of each step: 2..4 of its 6
        state.append(_Rows(base, 2, 3))
        assert len(state.chunks) <= MAX_SHARED_CHUNKS
    want = torch.cat([base[2:5] for base in steps])
    assert state.rows == want.shape[0] and state.feat_end == 10 + want.shape[0]
    torch.testing.assert_close(state.features(10, state.feat_end), want, rtol=0, atol=0)
    torch.testing.assert_close(state.features(13, 17), want[3:7], rtol=0, atol=0)
    state.keep_before(15)
    assert state.rows == 5 and state.feat_end == 15
    torch.testing.assert_close(state.features(10, 15), want[:5], rtol=0, atol=0)
    state.keep_before(30)  # past its rows: nothing to drop
    assert state.rows == 5

    trimmed = _HeadState(feat_start=0, head_pos=0)
    for base in steps[:3]:
        trimmed.append(_Rows(base, 1, 2))
    trimmed.keep_before(3)  # the first chunk whole, one row of the second, none of the third
    assert [c.n for c in trimmed.chunks] == [2, 1] and trimmed.rows == 3
    torch.testing.assert_close(trimmed.features(0, 3), torch.cat([steps[0][1:3], steps[1][1:2]]), rtol=0, atol=0)

    shared = torch.arange(12.0).view(6, 2)
    before = shared.clone()
    moved = _HeadState(feat_start=10, head_pos=10)
    moved.append(_Rows(shared, 2, 3))  # positions 10..12 are rows 2..4
    moved.move([(12, 10)])
    torch.testing.assert_close(shared[2], before[4], rtol=0, atol=0)
    rest = [0, 1, 3, 4, 5]
    torch.testing.assert_close(shared[rest], before[rest], rtol=0, atol=0)


def test_features_are_kept_only_for_requests_that_speculate(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    engine = make_engine(str(model), False, speculative=eagle(head))
    kept: list[int] = []
    launch = engine.runner.launch

    def recording(batch: Any, eos: Any, prev: Any = None, keep: Sequence[int] = (), bitmask: Any = None) -> Any:
        kept.extend(keep)
        pending = launch(batch, eos, prev, keep, bitmask)
        assert pending.feature_lens == [batch.num_new_tokens[i] for i in keep]
        assert (pending.features is None) == (not keep)
        assert pending.features is None or pending.features.shape[0] == sum(pending.feature_lens)
        return pending

    engine.runner.launch = recording  # type: ignore[method-assign]
    off = SamplingParams(temperature=0.0, max_tokens=6, num_speculative_tokens=0)
    run(engine, [("off", [5, 6, 7], off)])
    assert kept == []
    run(engine, [("on", [5, 6, 7], dataclasses.replace(off, num_speculative_tokens=2))])
    assert kept


def test_a_paused_switch_keeps_features_only_before_its_probes_and_output_is_unchanged(tiny: tuple[Path, Path],
                                                                                       ) -> None:
    """While the switch pauses speculation, a step keeps the target's features only in the window before a probe
    (a paused step costs what a plain one does); the probes still draft, and greedy output is the plain one."""
    model, head = tiny
    engine = make_engine(str(model), False, speculative=eagle(head))
    engine.switch = SpeculationSwitch(StepCosts((1,), (0.01,), (1.0,), (0.0,), 3), prior_tau=2.0, probe_every=6,
                                      feature_window=2)
    keeps: list[bool] = []
    launch = engine.runner.launch

    def recording(batch: Any, eos: Any, prev: Any = None, keep: Sequence[int] = (), bitmask: Any = None) -> Any:
        if batch.num_new_tokens == [1]:  # decode steps (the prefill precedes the switch's first decision)
            keeps.append(bool(keep))
        return launch(batch, eos, prev, keep, bitmask)

    engine.runner.launch = recording  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [("r", mixed_prompts(1, seed=3)[0], params)]
    assert results(run(engine, jobs)) == results(run(make_engine(str(model), False), jobs))
    assert engine.counters.draft_tokens > 0, "the probes drafted"
    assert 0 < sum(keeps) < len(keeps) / 2, f"features kept at {keeps}"


def test_the_heads_attention_meets_no_launch_its_warm_up_did_not_make(tiny: tuple[Path, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On the Triton backend (the interpreter here) the head's attention takes fixed launch choices (one key
    split, fixed_config's tile), so every kind of launch a run meets was made by the warm-up, which on a GPU
    compiles the variants at start-up; greedy output stays the plain one."""
    import tokenmill.worker.attention.triton_backend as tb

    model, head = tiny
    seen: set[tuple[Any, ...]] = set()
    launch = tb.paged_attention
    group_pad = [0]  # the target's query heads per kv head, to a power of two (set once the engine is built)

    def recording(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        config = kw.get("config")
        if config is not None:  # the head's launches (the target's take the heuristics': no override)
            tile_rows = max(config.block_m, group_pad[0]) // group_pad[0]  # one request's rows in a tile
            seen.add((config, kw["num_splits"], kw["rope"] is not None, kw["max_query_len"] <= tile_rows))
        return launch(q, *args, **kw)

    monkeypatch.setattr(tb, "paged_attention", recording)
    engine = make_engine(str(model), False, speculative=eagle(head, k=3), attention_backend="triton")
    arch = engine.runner.arch
    group_pad[0] = next_pow2(arch.num_heads // arch.num_kv_heads)
    engine.proposer.warm_up(3)  # type: ignore[union-attr]  # (the engine warms up on CUDA only)
    warmed, seen = set(seen), set()
    assert warmed and all(splits == 1 for _, splits, _, _ in warmed)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    jobs = [(f"w{i}", p, params) for i, p in enumerate(repetitive(384, 2, seed=5) + mixed_prompts(1, seed=5))]
    assert results(run(engine, jobs)) == results(run(make_engine(str(model), False, attention_backend="torch"), jobs))
    assert engine.counters.draft_tokens > 0 and seen and seen <= warmed, f"met {seen - warmed}"


# -- bad heads -------------------------------------------------------------------------------------------------


def test_a_head_for_another_shape_is_a_clear_error(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model, _ = tiny
    other = save_head(save_tiny_model("qwen2-bias", tmp_path), tmp_path / "qwen-head")
    with pytest.raises(ModelLoadError, match=r"speculative eagle: .*does not fit the target: arch qwen2 "
                                             r"\(the target has llama\); .*qkv_bias True"):
        make_engine(str(model), False, speculative=eagle(other))
    with pytest.raises(ModelLoadError, match=f"speculative eagle: {tmp_path}/nothing: no readable {CONFIG_FILE}"):
        make_engine(str(model), False, speculative=eagle(tmp_path / "nothing"))


def test_no_head_for_the_model_is_a_clear_error(tiny: tuple[Path, Path]) -> None:
    model, _ = tiny
    with pytest.raises(ModelLoadError, match=r"no EAGLE head is shipped for model 'llama'.*--draft-model"):
        make_engine(str(model), False, speculative=SpeculativeConfig(method="eagle"))


def test_the_embedded_model_has_its_shipped_head() -> None:
    folder = HEADS_DIR / "smollm2-135m-instruct"
    assert head_folder(None, "embedded") == folder
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["arch"]["hidden_size"] == 576 and config["arch"]["vocab_size"] == 49152
    assert head_folder("~/h", "embedded") == Path("~/h").expanduser()


def shipped_head_chats_are_identical(spec: SpeculativeConfig) -> None:
    """The embedded model with `spec` (its shipped head): two chats greedily, without drafts
    (num_speculative_tokens=0) and with them, batched: the same tokens, and drafts accepted."""
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=256, speculative=spec,
                                    scheduler=SchedulerConfig(max_num_seqs=2)))
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a Python function that adds two numbers."}]]
    prompts = [engine.tokenizer.encode(engine.tokenizer.apply_chat_template(c), add_special_tokens=False)
               for c in chats]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    plain = engine.generate(prompts, dataclasses.replace(greedy, num_speculative_tokens=0))
    assert engine.counters.draft_tokens == 0
    spec_out = engine.generate(prompts, greedy)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain]
    assert engine.counters.accepted_draft_tokens > 0


@pytest.mark.slow
def test_the_shipped_head_drafts_for_the_embedded_model_and_greedy_output_is_identical() -> None:
    """`--speculative eagle` without --draft-model on the embedded model: its shipped head, accepted drafts,
    the same tokens as plain decoding (requests with num_speculative_tokens=0 on the same engine)."""
    shipped_head_chats_are_identical(SpeculativeConfig(method="eagle"))


def test_an_unknown_speculative_method_is_refused() -> None:
    with pytest.raises(ValueError, match="use off, ngram or eagle"):
        SpeculativeConfig(method="medusa")  # type: ignore[arg-type]


def test_generate_command_with_eagle(tiny: tuple[Path, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli.main import build_parser, main
    from tokenmill.cli.settings import build_config

    model, head = tiny
    argv = ["generate", "hello", "--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--temperature", "0", "--max-tokens", "6", "--speculative", "eagle", "--num-speculative-tokens", "2"]
    config = build_config(EngineConfig, build_parser().parse_args([*argv, "--draft-model", str(head)]), "generate")
    assert (config.speculative.method, config.speculative.draft_model) == ("eagle", str(head))
    assert main([*argv, "--draft-model", str(head)]) == 0
    with_eagle = capsys.readouterr().out
    assert main(argv[:-4]) == 0
    assert capsys.readouterr().out == with_eagle
    assert main([*argv, "--draft-model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "speculative eagle" in err and "no readable eagle_config.json" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
def test_eagle_on_cuda_with_the_triton_backend_is_identical(tiny: tuple[Path, Path], graphs: bool) -> None:
    """On the GPU (float32, so that verify rows and decode rows agree to the bit on the tiny model): the head
    runs through the Triton backend (its fused decode path, the in-kernel rotary and KV write), with and
    without the target's CUDA graphs; and the automatic switch is measured at start-up (auto: on for CUDA)."""
    model, head = tiny
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 6, seed=8) + mixed_prompts(4, seed=8))]
    cuda = dict(device="cuda", dtype="float32", cuda_graphs=graphs)
    spec = make_engine(str(model), True, speculative=dataclasses.replace(eagle(head, k=4), auto_switch=False), **cuda)
    assert isinstance(spec.proposer, EagleProposer) and (spec.proposer.chain_graphs is not None) == graphs
    drafted = record_drafts(spec.proposer)
    got = results(run(spec, jobs))
    assert got == results(run(make_engine(str(model), True, **cuda), jobs))
    assert spec.counters.draft_tokens > 0
    if graphs:  # the captured draft steps draft what the eager ones do
        eager = make_engine(str(model), True, speculative=dataclasses.replace(eagle(head, k=4), auto_switch=False),
                            **cuda)
        assert isinstance(eager.proposer, EagleProposer)
        eager.proposer.chain_graphs = None
        drafted_eagerly = record_drafts(eager.proposer)
        assert results(run(eager, jobs)) == got and drafted_eagerly == drafted
    auto = make_engine(str(model), True, speculative=eagle(head), **cuda)
    assert auto.switch is not None and all(t > 0 for t in auto.switch.costs.draft_s)
    assert results(run(auto, jobs)) == got
