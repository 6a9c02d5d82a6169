"""EAGLE-3's fusion of low / middle / high target layers (worker/spec/eagle.py's fusion_layers), on CPU with tiny
targets and random fused heads: the target's recorded layer states equal Hugging Face's hidden states, in one
forward and as the engine keeps them step by step; the engine's chains and trees equal a cache-free reference of
the fused head; greedy and seeded output token-identical to decoding without speculation (alone, batched, chain
and tree); a short training run and its checkpoint's round trip, through the library and `tokenmill
train-eagle --fusion-layers`; heads that do not fit are clear errors, as are the settings it is not built for;
EAGLE-1 heads (the shipped one) load as before."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_async_scheduling import make_engine, run
from test_eagle_spec import assert_drafts_are_the_heads, eagle, mixed_prompts, save_head, spec_and_plain
from test_eagle_tree import assert_trees_are_the_rule, eagle_tree, identical
from test_spec import repetitive
from tiny_hf import load_hf, save_tiny_model
from torch import Tensor

from tokenmill.cli.main import main
from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError
from tokenmill.worker.request import Request
from tokenmill.worker.spec.eagle import (
    CONFIG_FILE,
    HEADS_DIR,
    WEIGHTS_FILE,
    DenseCausalBackend,
    EagleHeadError,
    auto_fusion_layers,
    load_eagle_head,
)
from tokenmill.worker.spec.eagle_proposer import EagleProposer
from tokenmill.worker.spec.eagle_train import (
    EagleTrainConfig,
    head_loss,
    head_rows,
    new_head,
    predict,
    target_features,
    train,
)

LAYERS = (0, 1, 2)  # of the 4-layer tiny target


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    model = save_tiny_model("llama", root, num_hidden_layers=4)
    return model, save_head(model, root / "head", fusion_layers=LAYERS)


def greedy(n: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# -- the recorded layer states ------------------------------------------------------------------------------------


def test_recorded_layer_states_equal_hf_hidden_states(fused: tuple[Path, Path]) -> None:
    model, _ = fused
    engine = make_engine(str(model), False)
    tokens = mixed_prompts(4, seed=3)[3]
    with torch.no_grad():
        hf = load_hf(model)(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # L + 1 of [1, T, H]
    h = engine.runner.arch.hidden_size
    whole = target_features(engine.runner, tokens, (2, 0, 3, 1))  # [T, H + 4H]: final, then in the order asked
    torch.testing.assert_close(whole[:, :h], hf[-1][0], rtol=1e-4, atol=1e-4)  # HF's last one is final-normed
    for j, layer in enumerate((2, 0, 3)):  # after the last layer (3) HF gives the normed state: checked above
        if layer < 3:
            torch.testing.assert_close(whole[:, h * (1 + j) : h * (2 + j)], hf[layer + 1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(whole[:, 4 * h :], hf[2][0], rtol=1e-4, atol=1e-4)


def test_the_engine_keeps_the_fusion_layers_states_of_every_step(fused: tuple[Path, Path]) -> None:
    """Chunked prefill, decode and verify steps, batched: each row the proposer is handed is the fusion layers'
    state [s^0; s^1; s^2] of the target run cache-free over the request's tokens (and drafts) up to it."""
    model, head = fused
    engine = make_engine(str(model), False, speculative=eagle(head, k=3),
                         scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
    proposer = engine.proposer
    assert isinstance(proposer, EagleProposer) and engine.runner.feature_layers == LAYERS
    seen: list[tuple[list[int], int, Tensor]] = []
    observe = proposer.observe

    def recording(reqs: Sequence[Request], starts: Sequence[int], features: Tensor, lens: Sequence[int]) -> None:
        assert features.shape[0] == sum(lens) and len(reqs) == len(starts) == len(lens)
        for req, start, rows in zip(reqs, starts, features.split(list(lens)), strict=True):
            seen.append((list(req.token_ids) + list(req.draft_token_ids), start, rows.clone()))
        observe(reqs, starts, features, lens)

    proposer.observe = recording  # type: ignore[method-assign]
    run(engine, [(f"r{i}", p, greedy(8)) for i, p in enumerate(mixed_prompts(4, seed=5))])
    assert len(seen) > 12 and any(f.shape[0] > 1 for _, s, f in seen if s > 0), "prefill chunks and verify steps"
    ref, h = make_engine(str(model), False).runner, engine.runner.arch.hidden_size
    for tokens, start, features in seen:
        n = features.shape[0]
        assert features.shape[1] == 3 * h
        want = target_features(ref, tokens[: start + n], LAYERS)[start:, h:]
        torch.testing.assert_close(features, want, rtol=1e-4, atol=1e-4)


# -- the drafts are the fused head's ---------------------------------------------------------------------------


def test_chains_equal_the_cache_free_reference_of_the_fused_head(fused: tuple[Path, Path]) -> None:
    assert_drafts_are_the_heads(*fused)


def test_trees_equal_the_cache_free_rule_of_the_fused_head(fused: tuple[Path, Path]) -> None:
    assert_trees_are_the_rule(*fused)


# -- token-identical output ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2-bias", "smollm2-tied", "qwen3-qknorm"])
def test_greedy_with_a_fused_head_is_identical_chain_and_tree(arch: str, tmp_path: Path) -> None:
    model = save_tiny_model(arch, tmp_path, num_hidden_layers=3)
    head = save_head(model, tmp_path / "head", fusion_layers=(0, 1, 2))
    jobs = [(f"r{i}", p, greedy()) for i, p in enumerate(repetitive(384, 5, seed=2) + mixed_prompts(3, seed=2))]
    small: dict[str, Any] = dict(scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))
    for spec in (eagle(head), eagle_tree(head, k=6, width=3)):
        identical(model, jobs, spec, **small)  # batched, chunked
        identical(model, jobs[:1], spec)  # alone


def test_seeded_sampling_with_a_fused_head_is_identical(fused: tuple[Path, Path]) -> None:
    model, head = fused
    kinds: list[dict[str, Any]] = [dict(temperature=0.9, top_p=0.9, seed=7), dict(temperature=0.5, top_k=20, seed=2)]
    jobs = [(f"s{i}", p, SamplingParams(max_tokens=16, ignore_eos=True, **kinds[i % 2]))
            for i, p in enumerate(repetitive(384, 4, seed=9))]
    got, want, engine = spec_and_plain(model, jobs, eagle(head, k=4))
    assert got == want and engine.counters.draft_tokens > 0


# -- training ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sequences(fused: tuple[Path, Path]) -> list[list[int]]:
    engine = make_engine(str(fused[0]), False)
    prompts = mixed_prompts(20, seed=11)
    outs = engine.generate(prompts, SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def test_a_short_fused_training_run_lowers_its_loss_and_round_trips(fused: tuple[Path, Path],
                                                                    sequences: list[list[int]], tmp_path: Path) -> None:
    engine = make_engine(str(fused[0]), False, cache=CacheConfig(num_blocks=64))
    head, summary = train(engine.runner, sequences[:16], sequences[16:], EagleTrainConfig(steps=60, lr=1e-3),
                          fusion_layers=LAYERS)
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"], summary
    head.save(tmp_path, {"model": "tiny"}, {})
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["format"] == "tokenmill-eagle-3" and config["fusion_layers"] == list(LAYERS)
    loaded = load_eagle_head(tmp_path, engine.runner.arch, DenseCausalBackend(), dtype=torch.float32,
                             device=torch.device("cpu"))
    assert loaded.fusion_layers == LAYERS
    rows = head_rows(engine.runner, sequences[16:18], 0.0, None, layers=LAYERS)
    assert rows.features.shape[1] == 3 * engine.runner.arch.hidden_size
    with torch.no_grad():
        assert torch.equal(predict(head, rows), predict(loaded, rows))


def test_a_fused_heads_states_are_normed_before_the_fusion_and_its_output_after(fused: tuple[Path, Path],
                                                                              sequences: list[list[int]]) -> None:
    """The residual streams are un-normed (their scales grow with depth): the fused head reads each one RMS-normed,
    so scaling them changes nothing, and its output is normed as the target's final features are (the LM head reads
    it directly; without the norm a real target's logits came out in the hundreds)."""
    engine = make_engine(str(fused[0]), False, cache=CacheConfig(num_blocks=64))
    head = load_eagle_head(fused[1], engine.runner.arch, DenseCausalBackend(), dtype=torch.float32,
                           device=torch.device("cpu"))
    assert head.out_norm is not None
    rows = head_rows(engine.runner, sequences[:2], 0.0, None, layers=LAYERS)
    with torch.no_grad():
        out = predict(head, rows)
        scaled = predict(head, rows._replace(features=rows.features * 1000.0))
    torch.testing.assert_close(scaled, out, rtol=1e-4, atol=1e-4)
    rms = (out / head.out_norm.weight).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_every_parameter_of_a_fused_head_in_training_gets_a_gradient(fused: tuple[Path, Path],
                                                                     sequences: list[list[int]], device: str) -> None:
    """The fusion's norms and fc and the output norm train with the rest (tests/test_eagle.py: the kernels' rule)."""
    engine = make_engine(str(fused[0]), False, device=device, cache=CacheConfig(num_blocks=64))
    head = new_head(engine.runner, 0, LAYERS)
    rows = head_rows(engine.runner, sequences[:4], 0.1, None, layers=LAYERS)
    head_loss(engine.runner, head, rows, cls_weight=0.0)[0].backward()
    untrained = [n for n, p in head.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not untrained, f"no gradient reaches {untrained}"


def test_eagle_accept_measures_a_fused_head_on_its_layers_states(fused: tuple[Path, Path],
                                                                 sequences: list[list[int]]) -> None:
    """benchmarks/eagle_accept.py hands a fused head its fusion layers' states (it handed it final features): its
    teacher-forced first drafts are the cache-free head's."""
    from tokenmill.benchmarks import eagle_accept

    engine = make_engine(str(fused[0]), False, cache=CacheConfig(num_blocks=64))
    runner, seq = engine.runner, sequences[0]
    backend = eagle_accept.ChainBackend()
    head = load_eagle_head(fused[1], runner.arch, backend, dtype=torch.float32, device=torch.device("cpu"))
    got = eagle_accept.measure_sequence(runner, head, backend, seq, start=4, k_max=3, stride=1, window=8)
    dense = load_eagle_head(fused[1], runner.arch, DenseCausalBackend(), dtype=torch.float32,
                            device=torch.device("cpu"))
    rows = head_rows(runner, [seq], 0.0, None, layers=LAYERS)
    with torch.no_grad():
        drafts = runner.model.compute_logits(predict(dense, rows)).argmax(-1)
        greedy = runner.model.compute_logits(target_features(runner, seq)).argmax(-1)
    assert got["tf_all_rows"] == len(seq) - 1
    assert got["tf_all_hits"] == int((drafts == greedy[1:]).sum())


def test_train_eagle_command_with_fusion_layers(fused: tuple[Path, Path], sequences: list[list[int]],
                                                tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = fused[0]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in sequences[:10]))
    out = tmp_path / "head"
    argv = ["train-eagle", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", "4",
            "--heldout", "2", "--max-len", "40", "--device", "cpu", "--dtype", "float32", "--fusion-layers", "1,2,3"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 4
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["fusion_layers"] == [1, 2, 3] and config["training"]["fusion_layers"] == [1, 2, 3]
    jobs = [(f"r{i}", p, greedy(10)) for i, p in enumerate(mixed_prompts(3, seed=4))]
    identical(model, jobs, eagle(out))  # the trained head drafts in the engine
    for bad, message in (("1,2,4", "fusion layer 4 is out of range for a target of 4 layers"),
                         ("auto", "need a target of at least 6 layers"), ("1,2", "must be three layer indices"),
                         ("a,b,c", "want 'auto' or three comma-separated")):
        assert main([*argv[:-1], bad]) == 2
        assert message in capsys.readouterr().err


def test_automatic_fusion_layers_are_eagle3s() -> None:
    assert auto_fusion_layers(32) == (2, 16, 29) and auto_fusion_layers(6) == (2, 3, 3)
    with pytest.raises(ValueError, match="at least 6 layers"):
        auto_fusion_layers(5)


# -- bad heads, unsupported settings, EAGLE-1 unchanged -------------------------------------------------------------


def _edit_config(head: Path, out: Path, **fields: Any) -> Path:
    out.mkdir()
    (out / WEIGHTS_FILE).write_bytes((head / WEIGHTS_FILE).read_bytes())
    config = json.loads((head / CONFIG_FILE).read_text())
    (out / CONFIG_FILE).write_text(json.dumps(config | fields))
    return out


def test_a_fused_head_that_does_not_fit_the_target_is_a_clear_error(fused: tuple[Path, Path], tmp_path: Path) -> None:
    model, head = fused
    for fusion, message in (([0, 1, 4], "fusion layer 4 is out of range for a target of 4 layers"),
                            ([0, 1], "must be three layer indices"), (None, "must be a list of three")):
        bad = _edit_config(head, tmp_path / f"h{len(fusion or [])}", fusion_layers=fusion)
        with pytest.raises(ModelLoadError, match=f"speculative eagle: .*does not fit the target: .*{message}"):
            make_engine(str(model), False, speculative=eagle(bad))
    wide = save_tiny_model("llama", tmp_path, num_hidden_layers=4, hidden_size=32)
    with pytest.raises(ModelLoadError, match=r"hidden_size 64 \(the target has 32\)"):
        make_engine(str(wide), False, speculative=eagle(head))
    shape = tmp_path / "shape"
    _edit_config(head, shape)
    weights = load_file(str(shape / WEIGHTS_FILE))
    save_file(weights | {"fuse_fc.weight": weights["fuse_fc.weight"][:, :64].contiguous()}, str(shape / WEIGHTS_FILE))
    with pytest.raises(ModelLoadError, match=r"weight fuse_fc.weight has shape \(64, 64\), .* expects \(64, 192\)"):
        make_engine(str(model), False, speculative=eagle(shape))


@pytest.mark.parametrize("setting", ["graphs", "piecewise", "tp", "fp8"])
def test_a_fused_head_refuses_what_it_is_not_built_for(fused: tuple[Path, Path], setting: str) -> None:
    """CUDA graphs (decode or piecewise), tensor parallelism and an fp8 KV cache (stood in for on the CPU runner)."""
    model, head = fused
    runner = make_engine(str(model), False).runner
    if setting == "fp8":
        runner.kv_dtype = torch.float8_e4m3fn
    else:
        setattr(runner, setting, object())
    want = {"graphs": "need --no-cuda-graphs", "piecewise": "need --no-cuda-graphs",
            "tp": "not built for tensor parallelism", "fp8": "not built with an fp8 KV cache"}[setting]
    with pytest.raises(EagleHeadError, match=want):
        EagleProposer(runner, head, 4)
    assert runner.feature_layers == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fused_head_on_cuda_without_graphs_is_identical_and_refused_with_them(fused: tuple[Path, Path]) -> None:
    """On the GPU (float32, Triton backend): chain and tree token-identical with --no-cuda-graphs; graphs refused."""
    model, head = fused
    jobs = [(f"r{i}", p, greedy(24)) for i, p in enumerate(repetitive(384, 4, seed=8) + mixed_prompts(3, seed=8))]
    cuda: dict[str, Any] = dict(device="cuda", dtype="float32", cuda_graphs=False)
    for spec in (eagle(head, k=4), eagle_tree(head, k=6, width=3)):
        identical(model, jobs, dataclasses.replace(spec, auto_switch=False), **cuda)
    with pytest.raises(ModelLoadError, match="need --no-cuda-graphs"):
        make_engine(str(model), True, speculative=eagle(head), device="cuda", dtype="float32")


def test_eagle1_heads_load_and_run_as_before(tmp_path: Path) -> None:
    """The shipped head: no fusion, its weights exactly fc and layer; an engine with it keeps final features (the
    runner records no layer); and an EAGLE-1 head saved now writes the same config keys as before."""
    shipped = HEADS_DIR / "smollm2-135m-instruct"
    config = json.loads((shipped / CONFIG_FILE).read_text())
    assert config["format"] == "tokenmill-eagle-1" and "fusion_layers" not in config
    engine = embedded_engine()
    proposer = engine.proposer
    assert isinstance(proposer, EagleProposer) and proposer.head.fusion_layers is None
    assert proposer.head.fuse_fc is None and engine.runner.feature_layers == ()
    assert set(proposer.head.state_dict()) == set(load_file(str(shipped / WEIGHTS_FILE)))
    model = save_tiny_model("llama", tmp_path)
    saved = json.loads((save_head(model, tmp_path / "h1") / CONFIG_FILE).read_text())
    assert list(saved) == ["format", "arch", "target", "training"] and saved["format"] == "tokenmill-eagle-1"


def embedded_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=128,
                                  speculative=SpeculativeConfig(method="eagle"),
                                  scheduler=SchedulerConfig(max_num_seqs=2)))
