"""EAGLE training past the first draft (worker/spec/eagle_train.py): the training-time test's chain steps are the
engine's draft steps (the same rows attended, the same positions), the reply-only loss rows, the learning-rate
schedule, going on from a saved head, and `train-eagle --unroll --loss-rows reply` end to end into the engine,
on a tiny model on CPU."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import test_eagle
import torch

from tokenmill.cli.main import main
from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import EngineConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.spec.eagle import CONFIG_FILE, DenseCausalBackend, EagleHead, load_eagle_head
from tokenmill.worker.spec.eagle_train import (
    EagleTrainConfig,
    assistant_marker,
    head_loss,
    head_rows,
    learning_rate,
    new_head,
    predict_steps,
    reply_start,
    target_features,
    train,
)

EMPTY = (torch.empty(0), torch.empty(0))
engine = test_eagle.engine  # the fixture: the tiny target


@pytest.fixture(scope="module")
def sequences(engine: LLMEngine) -> list[list[int]]:
    """Prompts of 6 random tokens and the target's own greedy continuations."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(6)] for _ in range(8)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def chain_reference(engine: LLMEngine, head: EagleHead, seq: list[int], t: int, depth: int) -> list[torch.Tensor]:
    """The head's predictions of chain steps 1..depth from row t, as the engine drafts (reference_drafts of
    test_eagle_spec.py, the next tokens given): one dense causal run over the real rows 0..t and the chain's
    rows, step j's row at position t + j - 1 reading (embed(x_{t+j}), the prediction of step j - 1)."""
    runner = engine.runner
    embed = runner.model.model.embed_tokens
    dense = EagleHead(head.arch, DenseCausalBackend(), dtype=torch.float32, device=torch.device("cpu"))
    dense.load_state_dict(head.state_dict())
    feats = target_features(runner, seq)[: t + 1]  # [t + 1, H] f_0..f_t
    ids = list(seq[1 : t + 2])  # x_1..x_{t+1}
    preds = []
    with torch.no_grad():
        for j in range(1, depth + 1):
            n = feats.shape[0]
            meta = attention_metadata([n], [n], [[0]], [-1] * n, runner.device)
            out = dense(embed(torch.tensor(ids)), feats, torch.arange(n), EMPTY, meta)[-1:]
            preds.append(out[0])
            if j < depth:
                ids.append(seq[t + j + 1])
                feats = torch.cat([feats, out])
    return preds


def test_unrolled_chain_steps_are_the_engines_draft_steps(engine: LLMEngine, sequences: list[list[int]]) -> None:
    """Every chain step of every row, two sequences batched, equals the cache-free chain the engine drafts (whose
    equality with the engine's paged drafts test_eagle_spec.py checks)."""
    head = new_head(engine.runner, seed=1)
    with torch.no_grad():  # a head far from the identity, so that its steps differ
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    seqs, depth = [sequences[0][:14], sequences[1][:9]], 3
    rows = head_rows(engine.runner, seqs, 0.0, None, depth=depth)
    with torch.no_grad():
        steps = predict_steps(head, rows)  # depth x [R, H]
    offset = 0
    for seq in seqs:
        for t in range(len(seq) - depth):  # rows whose whole chain lies in the sequence
            for j, want in enumerate(chain_reference(engine, head, seq, t, depth)):
                torch.testing.assert_close(steps[j][offset + t], want, atol=1e-4, rtol=1e-4)
        offset += len(seq) - 1


def test_loss_rows_start_at_the_reply_and_end_with_the_sequence(engine: LLMEngine,
                                                                sequences: list[list[int]]) -> None:
    seq = sequences[0][:12]  # rows t = 0..10; step j of row t predicts token x_{t+j+1}
    rows = head_rows(engine.runner, [seq], 0.0, None, loss_starts=[6], depth=3)
    for j, mask in enumerate(rows.step_masks, 1):
        assert mask.tolist() == [t + j + 1 >= 6 and t + j <= 11 for t in range(11)], j
    assert torch.equal(rows.step_embeds[1][:10], rows.token_embeds[1:])  # step 2 reads x_{t+2}
    assert torch.equal(rows.step_targets[2][:9], rows.targets[2:])  # step 3 predicts f_{t+3}
    assert reply_start([5, 1, 7, 9, 4, 1, 7], [1, 7]) == 3 and reply_start([5, 1, 9], [1, 7]) is None


def test_the_chain_loss_reads_each_steps_target_distribution_from_step_one(engine: LLMEngine,
                                                                         sequences: list[list[int]]) -> None:
    """head_loss computes the target's distribution once (step 1's rows) and reads step j's from row t + j: the
    same loss and gradient as the target's distribution of each step's own targets."""
    runner = engine.runner
    head = new_head(runner, seed=2)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rows = head_rows(runner, [sequences[0][:15], sequences[2][:11]], 0.0, None, loss_starts=[6, 4], depth=3)
    loss, reg, cls = head_loss(runner, head, rows, cls_weight=0.3)
    loss.backward()
    got = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    regs, clss = [], []
    for pred, target, mask in zip(predict_steps(head, rows), rows.step_targets, rows.step_masks):
        logits = runner.model.compute_logits
        p_t = logits(target[mask]).float().softmax(-1)
        clss.append(-(p_t * logits(pred[mask]).float().log_softmax(-1)).sum(-1).mean())
        regs.append(torch.nn.functional.smooth_l1_loss(pred[mask], target[mask]))
    want = torch.stack(regs).mean() + 0.3 * torch.stack(clss).mean()
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(cls, torch.stack(clss).mean())
    torch.testing.assert_close(reg, torch.stack(regs).mean())
    for g, p in zip(got, head.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_cosine_learning_rate_warms_up_then_decays_to_zero_by_steps_or_time() -> None:
    config = EagleTrainConfig(steps=100, lr=1e-3, lr_schedule="cosine", warmup_steps=10)
    assert learning_rate(config, 5, 0.0) == pytest.approx(0.5e-3 * 0.5 * (1 + math.cos(math.pi * 0.05)))
    assert learning_rate(config, 50, 0.0) == pytest.approx(0.5e-3)
    assert learning_rate(config, 100, 0.0) == pytest.approx(0.0)
    timed = EagleTrainConfig(steps=10**6, lr=1e-3, lr_schedule="cosine", time_limit_s=60.0)
    assert learning_rate(timed, 7, 30.0) == pytest.approx(0.5e-3)
    assert learning_rate(EagleTrainConfig(lr=1e-3), 999, 1e9) == 1e-3
    for bad in (dict(unroll=0), dict(lr_schedule="linear"), dict(warmup_steps=-1), dict(eval_depth=0)):
        with pytest.raises(ValueError):
            EagleTrainConfig(**bad)  # type: ignore[arg-type]


def test_an_unrolled_head_on_reply_rows_drafts_its_sequences_through_the_engine(
        engine: LLMEngine, sequences: list[list[int]], tmp_path: Path) -> None:
    """A head trained (unroll 3, loss on the rows after the 6-token prompt, cosine) to fit four sequences: the
    engine accepts nearly all its k = 4 drafts on them, with the output of plain decoding; going on from the saved
    head starts where it ended."""
    seqs, starts = sequences[:4], [6] * 4
    config = EagleTrainConfig(steps=300, lr=3e-3, unroll=3, noise=0.0, lr_schedule="cosine", warmup_steps=10)
    head, summary = train(engine.runner, seqs, seqs, config, loss_starts=starts, heldout_loss_starts=starts)
    assert summary["heldout_agreement_after"] > 0.95 and summary["heldout_tau_after"] > 4.5, summary
    assert summary["heldout_rows"] == 4 * 19 and summary["heldout_tau_depth"] == 4
    head.save(tmp_path / "head", {"model": "tiny"}, {})
    spec = LLMEngine(EngineConfig(model=engine.config.model, device="cpu", dtype="float32",
                                  speculative=SpeculativeConfig(method="eagle", num_speculative_tokens=4,
                                                                draft_model=str(tmp_path / "head"))))
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    outs = spec.generate([s[:6] for s in seqs], params)
    assert [s[:6] + o.token_ids for s, o in zip(seqs, outs)] == seqs
    assert spec.counters.accepted_draft_tokens >= 0.9 * spec.counters.draft_tokens > 0
    _, summary2 = train(engine.runner, seqs, seqs, EagleTrainConfig(steps=1, lr=1e-9), loss_starts=starts,
                            heldout_loss_starts=starts, init_from=tmp_path / "head")
    assert summary2["heldout_agreement_before"] == pytest.approx(summary["heldout_agreement_after"])
    assert summary2["heldout_tau_before"] == pytest.approx(summary["heldout_tau_after"])


def test_train_eagle_reply_rows_unrolled_command(engine: LLMEngine, sequences: list[list[int]], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    marker = assistant_marker(engine.tokenizer)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": s[:6] + marker + s[6:]}) + "\n" for s in sequences[:6]))
    out = tmp_path / "head"
    argv = ["train-eagle", "--model", engine.config.model, "--data", str(data), "--out", str(out), "--steps", "4",
            "--heldout", "2", "--max-len", "64", "--device", "cpu", "--dtype", "float32", "--unroll", "2",
            "--loss-rows", "reply", "--lr-schedule", "cosine", "--eval-depth", "3"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["heldout_rows"] == 2 * 19 and summary["heldout_tau_depth"] == 3
    training = json.loads((out / CONFIG_FILE).read_text())["training"]
    assert training["unroll"] == 2 and training["loss_rows"] == "reply" and training["lr_schedule"] == "cosine"
    load_eagle_head(out, engine.runner.arch, DenseCausalBackend(), dtype=torch.float32, device=torch.device("cpu"))
    assert main([*argv[:6], str(tmp_path / "on"), *argv[7:], "--init-head", str(out)]) == 0  # trained on
    on = json.loads((tmp_path / "on" / CONFIG_FILE).read_text())["training"]
    assert on["init_head"] == str(out) and on["init_head_training"] == training
    capsys.readouterr()
    data.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in sequences[:6]))  # no reply marker
    assert main([*argv[:6], str(tmp_path / "h2"), *argv[7:]]) == 2
    assert "--loss-rows reply" in capsys.readouterr().err


def test_heldout_prompts_skip_the_pairs_of_the_head_trained_on(tmp_path: Path) -> None:
    """spec_gpu / spec_cpu prompts start after every ShareGPT pair the head saw, its init head's included."""
    from tokenmill.benchmarks.spec_gpu import heldout_offset

    first = {"command": "tokenmill train-eagle --num-sequences 8000 --heldout 200"}
    on = {"command": "tokenmill train-eagle --num-sequences 1020 --init-head h", "init_head_training": first}
    big = {"command": "tokenmill train-eagle --num-sequences 20000", "init_head_training": first}
    for training, want in ((on, 10051), ({"command": "tokenmill train-eagle --num-sequences 1020"}, 10051),
                           (big, 20000), ({"command": "tokenmill train-eagle --num-sequences 11000"}, 11000)):
        (tmp_path / CONFIG_FILE).write_text(json.dumps({"training": training}))
        assert heldout_offset(tmp_path) == want


def test_spec_gpu_refuses_a_draft_count_out_of_range_at_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.benchmarks.spec_gpu import main as spec_gpu

    for bad, says in (("0", "must be in [1, 16], got 0"), ("x", "takes a whole number")):
        with pytest.raises(SystemExit) as stop:
            spec_gpu(["--k", bad, "--smoke"])
        assert stop.value.code == 2 and says in capsys.readouterr().err
