"""Speculative sampling gives the target's distribution: many seeded draws of the token at a draft position
from one fixed prefix, through the engine's verify step (n-gram drafts), with and without top-k / top-p.

The prefix is chosen so that the first draft is the target's likeliest token: the draws cover both
branches of the rejection rule. Three chi-square tests per setting (p >= 0.01 each): the drawn tokens
against the target distribution p, the acceptance count of the draft against p(d) (q is a point mass, so
min(1, p/q) = p(d)), and the tokens of the rejected draws against the residual max(0, p - q) normalised.
The reference p comes from Hugging Face transformers' logits with the filters written out here."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_hf import load_hf, save_tiny_model

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.spec.ngram import lookup

N_DRAWS = 2000
MIN_EXPECTED = 5.0  # chi-square bins hold at least this many expected draws (rarer tokens are pooled)
# Temperatures below 1 where no filter cuts the tail: the random tiny model's distribution is flat.
SETTINGS: list[dict[str, Any]] = [dict(temperature=0.5), dict(temperature=1.0, top_k=6),
                                  dict(temperature=0.8, top_k=12, top_p=0.8), dict(temperature=1.0, top_p=0.5)]


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test; bins with expected count < MIN_EXPECTED are pooled into one."""
    small = expected < MIN_EXPECTED
    obs = torch.cat([observed[~small], observed[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    if exp[-1] < MIN_EXPECTED:  # the pool itself too small: fold it into the smallest kept bin
        i = int(exp[:-1].argmin())
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    assert len(exp) >= 2, "nothing to test"
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2, dtype=torch.float64), stat / 2))


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k, then top-p of the renormalised remainder."""
    x = logits.double() / temperature
    if top_k:
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
    p = x.softmax(-1)
    order = p.argsort(descending=True)
    before = torch.cumsum(p[order], 0) - p[order]  # mass of the strictly likelier tokens
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[before < top_p]] = True
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prefix(model_path: Path) -> tuple[list[int], int, torch.Tensor]:
    """(prompt, fixed first output token t, the target's logits after prompt + [t]). The prompt is
    R[:6] + [t, x] + R[6:], so prompt lookup drafts x, R[6], R[7] after prompt + [t]; x is picked, among
    all tokens, as the one the target then finds likeliest."""
    rng = random.Random(17)
    vocab = 384
    r = rng.sample(range(3, vocab), 13)
    t, rest = r[0], r[1:]
    candidates = [x for x in range(3, vocab) if x not in r]
    seqs = torch.tensor([[*rest[:6], t, x, *rest[6:], t] for x in candidates])
    hf = load_hf(model_path)
    with torch.no_grad():
        logits = hf(seqs).logits[:, -1].float()  # [C, V]
    probs = logits.softmax(-1)[torch.arange(len(candidates)), torch.tensor(candidates)]
    best = int(probs.argmax())
    x = candidates[best]
    prompt = [*rest[:6], t, x, *rest[6:]]
    assert lookup([*prompt, t], 3, 1, 4) == [x, rest[6], rest[7]]
    return prompt, t, logits[best]


def speculative_draws(model_path: Path, prompt: list[int], t: int, params: dict[str, Any]) -> list[list[int]]:
    """N_DRAWS seeded requests at prompt + [t]: the prefill step's token is set to t for all of them (the
    prefix is fixed), then one engine step drafts with prompt lookup and verifies. Returns, per request,
    the tokens that step yielded (accepted drafts and the target's token)."""
    engine = LLMEngine(EngineConfig(
        model=str(model_path), device="cpu", dtype="float32", async_scheduling=False, max_model_len=64,
        cache=CacheConfig(num_blocks=3 * N_DRAWS),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        scheduler=SchedulerConfig(max_num_seqs=N_DRAWS, max_num_batched_tokens=N_DRAWS * (len(prompt) + 1))))
    for i in range(N_DRAWS):
        engine.add_request(f"r{i}", prompt_token_ids=prompt,
                           params=SamplingParams(max_tokens=8, ignore_eos=True, seed=1000 + i, **params))
    sched = engine.scheduler
    batch = sched.schedule()
    assert len(batch.requests) == N_DRAWS and all(batch.samples(i) for i in range(N_DRAWS))
    engine.runner.launch(batch, engine.eos_token_ids).result()
    sched.begin_step(batch)
    sched.commit(batch, [t] * N_DRAWS)
    drawn = {}
    records = []
    engine.step_observer = records.append
    for out in engine.step():
        assert out.new_token_ids[0] == t
        drawn[out.request_id] = out.new_token_ids[1:]
    (rec,) = records
    assert rec.batch.num_new_tokens == [4] * N_DRAWS, "every request verified three drafts"
    return [drawn[f"r{i}"] for i in range(N_DRAWS)]


@pytest.mark.slow
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_speculative_sampling_gives_the_target_distribution(model_path: Path, prefix: tuple[list[int], int,
                                                            torch.Tensor], params: dict[str, Any]) -> None:
    prompt, t, logits = prefix
    x = prompt[7]  # the first draft
    p = target_probs(logits, **params)
    assert 0.05 < float(p[x]) < 0.95, f"p(draft) = {float(p[x]):.3f}: both branches must be exercised"
    draws = speculative_draws(model_path, prompt, t, params)
    first = torch.tensor([d[0] for d in draws])
    counts = torch.bincount(first, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    assert chi2_pvalue(counts, N_DRAWS * p) >= 0.01, "drawn tokens do not follow the target distribution"
    n_acc = int((first == x).sum())
    assert chi2_pvalue(torch.tensor([n_acc, N_DRAWS - n_acc]), N_DRAWS * torch.tensor([p[x], 1 - p[x]])) >= 0.01
    rejected = counts.clone()
    rejected[x] = 0
    residual = p.clone()
    residual[x] = 0  # max(0, p - q) with q the point mass at x
    residual /= residual.sum()
    assert chi2_pvalue(rejected, (N_DRAWS - n_acc) * residual) >= 0.01, "rejected draws do not follow the residual"
    # Accepted drafts went on: a draw that accepted x yields at least two tokens.
    assert all(len(d) >= 2 for d in draws if d[0] == x) and all(len(d) == 1 for d in draws if d[0] != x)


def test_chi2_pvalue_tells_a_wrong_distribution_apart() -> None:
    """The test statistic itself: a fair die passes, a loaded one fails."""
    gen = torch.Generator().manual_seed(0)
    fair = torch.full((6,), 1 / 6)
    draws = torch.multinomial(fair, 6000, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=6).double()
    assert chi2_pvalue(counts, 6000 * fair) >= 0.01
    loaded = torch.tensor([0.2, 0.16, 0.16, 0.16, 0.16, 0.16])
    assert chi2_pvalue(counts, 6000 * loaded) < 0.01
