"""The EAGLE-1 draft head (worker/spec/eagle.py) and its training (`tokenmill train-eagle`), on a tiny
model on CPU: the dense training attention equals the paged reference, a smoke training run lowers the
held-out loss, the safetensors checkpoint round-trips exactly, and a head that does not fit the target, a
broken checkpoint or bad data are clear errors. Drafting with the head through the engine: test_eagle_spec.py,
test_eagle_tree.py, test_eagle_unroll.py."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from tiny_hf import save_tiny_model

from tokenmill.cli.main import main
from tokenmill.kernels.attention_ref import paged_attention_ref, rotary_embedding_ref
from tokenmill.protocol import SamplingParams
from tokenmill.worker.attention.backend import AttentionLayer
from tokenmill.worker.config import CacheConfig, EngineConfig, ModelArch
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.models.layers import kernel_path
from tokenmill.worker.spec.eagle import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    DenseCausalBackend,
    EagleHeadError,
    load_eagle_head,
)
from tokenmill.worker.spec.eagle_train import (
    EagleTrainConfig,
    all_features,
    head_loss,
    head_rows,
    new_head,
    target_features,
    train,
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", cache=CacheConfig(num_blocks=64)))


@pytest.fixture(scope="module")
def sequences(engine: LLMEngine) -> list[list[int]]:
    """Prompts and the target's own sampled continuations (what a head drafts in)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(8)] for _ in range(28)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.7, seed=3, max_tokens=32, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def test_dense_training_attention_equals_the_paged_reference() -> None:
    torch.manual_seed(0)
    lens, hq, hkv, d = [5, 9, 1], 4, 2, 16
    t = sum(lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    positions = torch.cat([torch.arange(n) for n in lens])
    angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    layer = AttentionLayer(d**-0.5, None, torch.cat([angles.cos(), angles.sin()], dim=-1))
    meta = attention_metadata(lens, lens, [[0]] * len(lens), [-1] * t, torch.device("cpu"))
    dense = DenseCausalBackend().forward(layer, q, k, v, positions, (torch.empty(0), torch.empty(0)), meta)
    # The paged reference over a cache holding exactly these keys and values (request i in block i).
    qr, kr = rotary_embedding_ref(q, k, layer.cos_sin_cache, positions)
    k_cache, v_cache = torch.zeros(3, 16, hkv, d), torch.zeros(3, 16, hkv, d)
    starts = [0, 5, 14]
    for i, (s, n) in enumerate(zip(starts, lens)):
        k_cache[i, :n], v_cache[i, :n] = kr[s : s + n], v[s : s + n]
    ref = paged_attention_ref(qr, k_cache, v_cache, torch.tensor([[0], [1], [2]], dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32), meta.query_start_loc, d**-0.5)
    torch.testing.assert_close(dense, ref, atol=1e-5, rtol=1e-5)


def test_features_batched_in_one_forward_equal_one_sequence_at_a_time(engine: LLMEngine,
                                                                     sequences: list[list[int]]) -> None:
    seqs = [sequences[0], sequences[1][:7], sequences[2][:2], *sequences[3:30]]  # more than one cache's worth
    batched = all_features(engine.runner, seqs)
    assert [f.shape[0] for f in batched] == [len(s) for s in seqs]
    for f, seq in zip(batched, seqs):
        torch.testing.assert_close(f.float(), target_features(engine.runner, seq), atol=1e-5, rtol=1e-5)


def test_training_lowers_the_heldout_loss_and_the_checkpoint_round_trips(engine: LLMEngine,
                                                                         sequences: list[list[int]],
                                                                         tmp_path: Path) -> None:
    head, summary = train(engine.runner, sequences[:24], sequences[24:], EagleTrainConfig(steps=150, lr=1e-3))
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"], summary
    assert 0.0 <= summary["heldout_agreement_after"] <= 1.0
    head.save(tmp_path, {"model": "tiny"}, {"summary": summary})
    loaded = load_eagle_head(tmp_path, engine.runner.arch, DenseCausalBackend(), dtype=torch.float32,
                             device=torch.device("cpu"))
    rows = head_rows(engine.runner, sequences[24:26], 0.0, None)
    empty = torch.empty(0)
    with torch.no_grad():
        a = head(rows.token_embeds, rows.features, rows.positions, (empty, empty), rows.meta)
        b = loaded(rows.token_embeds, rows.features, rows.positions, (empty, empty), rows.meta)
    assert torch.equal(a, b)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["format"] == "tokenmill-eagle-1" and config["arch"]["num_layers"] == 1
    assert config["training"]["summary"]["steps"] == 150


def test_a_head_that_does_not_fit_the_target_is_refused(engine: LLMEngine, sequences: list[list[int]],
                                                         tmp_path: Path) -> None:
    head, _ = train(engine.runner, sequences[:4], sequences[4:6], EagleTrainConfig(steps=2))
    head.save(tmp_path, {}, {})
    def load(arch: ModelArch) -> None:
        load_eagle_head(tmp_path, arch, DenseCausalBackend(), dtype=torch.float32, device=torch.device("cpu"))

    arch = engine.runner.arch
    with pytest.raises(EagleHeadError, match="does not fit the target: hidden_size 64 \\(the target has 128\\)"):
        load(dataclasses.replace(arch, hidden_size=128))
    with pytest.raises(EagleHeadError, match="vocab_size 384 \\(the target has 500\\)"):
        load(dataclasses.replace(arch, vocab_size=500))
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config | {"format": "other"}))
    with pytest.raises(EagleHeadError, match="not a tokenmill-eagle-1 checkpoint"):
        load(arch)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / WEIGHTS_FILE))
    save_file({k: v for k, v in weights.items() if k != "fc.bias"}, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(EagleHeadError, match=r"fc\.bias"):
        load(arch)
    (tmp_path / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(EagleHeadError):
        load(arch)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_every_parameter_of_a_head_in_training_gets_a_gradient(device: str, sequences: list[list[int]],
                                                               tmp_path: Path) -> None:
    """On CUDA the head's norms and SwiGLU would take their Triton kernels, which compute no gradient: the head's
    fc, attention and norms would never train (only the down projection after the last kernel would)."""
    path = save_tiny_model("llama", tmp_path)
    runner = LLMEngine(EngineConfig(model=str(path), device=device, dtype="float32",
                                    cache=CacheConfig(num_blocks=64))).runner
    head = new_head(runner, seed=0)
    loss, _, _ = head_loss(runner, head, head_rows(runner, sequences[:4], 0.1, None), cls_weight=0.1)
    loss.backward()
    untrained = [n for n, p in head.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not untrained, f"no gradient reaches {untrained}"


def test_kernels_are_taken_only_where_autograd_needs_no_gradient() -> None:
    """kernel_path's rule, on stand-ins for CUDA tensors (the CPU has none): inference takes the kernels,
    training (grad enabled and an input that requires grad) the torch code."""
    from types import SimpleNamespace

    def t(cuda: bool, grad: bool) -> torch.Tensor:
        return SimpleNamespace(is_cuda=cuda, requires_grad=grad)  # type: ignore[return-value]

    assert kernel_path(t(True, False), t(True, False))
    assert not kernel_path(t(False, False))
    assert not kernel_path(t(True, True)) and not kernel_path(t(True, False), t(True, True))
    with torch.no_grad():
        assert kernel_path(t(True, True), t(True, True))


def test_bad_training_settings_are_refused() -> None:
    for kw in (dict(steps=0), dict(lr=0.0), dict(noise=-1.0), dict(batch_sequences=0)):
        with pytest.raises(ValueError):
            EagleTrainConfig(**kw)  # type: ignore[arg-type]


def test_train_eagle_command_smoke_run(engine: LLMEngine, sequences: list[list[int]], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in sequences[:10]))
    model = engine.config.model
    out = tmp_path / "head"
    argv = ["train-eagle", "--model", model, "--data", str(data), "--out", str(out), "--steps", "5",
            "--heldout", "2", "--max-len", "40", "--device", "cpu", "--dtype", "float32"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 5 and summary["train_sequences"] == 8 and summary["heldout_sequences"] == 2
    assert (out / WEIGHTS_FILE).is_file()
    load_eagle_head(out, engine.runner.arch, DenseCausalBackend(), dtype=torch.float32, device=torch.device("cpu"))
    data.write_text('{"token_ids": [1, 99999]}\n')
    assert main([*argv[:6], str(tmp_path / "h2"), *argv[7:]]) == 2
    assert "line 1" in capsys.readouterr().err


def test_train_eagle_on_the_targets_own_replies(engine: LLMEngine, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--replies self: each ShareGPT prompt (chat template, generation prompt) followed by the target's own greedy
    reply, as --save-sequences writes them; without ShareGPT data it is refused."""
    turns = ["Name a color.", "Count to three.", "Say hi.", "What is two plus two?", "Pick a fruit."]
    records = [{"id": str(i), "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "x"}]}
               for i, t in enumerate(turns)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(records))
    saved = tmp_path / "seqs.jsonl"
    argv = ["train-eagle", "--model", engine.config.model, "--data", str(data), "--replies", "self",
            "--save-sequences", str(saved), "--out", str(tmp_path / "head"), "--steps", "2", "--heldout", "1",
            "--max-len", "160", "--device", "cpu", "--dtype", "float32"]
    assert main(argv) == 0
    seqs = [json.loads(line)["token_ids"] for line in saved.read_text().splitlines()]
    assert len(seqs) == len(turns)
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": turns[0]}], add_generation_prompt=True),
                        add_special_tokens=False)
    reply = engine.generate([prompt], SamplingParams(max_tokens=160 - len(prompt), temperature=0.0))[0].token_ids
    assert seqs[0] == prompt + reply
    capsys.readouterr()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"token_ids": [1, 2, 3]}\n')
    assert main([*argv[:4], str(jsonl), *argv[5:]]) == 2
    assert "--replies self needs ShareGPT data" in capsys.readouterr().err
