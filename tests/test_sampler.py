"""Tests of the seeded batched sampler (worker/sampler.py) against independent numpy/Python references."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
    gumbel_noise,
    min_p_race,
    random_bits,
    vocab_counters,
)

CPU = torch.device("cpu")
SAMPLER = Sampler()
# Upper 0.1% points of chi-square with df = 1..7 (the statistic exceeds them with probability 0.001).
CHI2_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322]


def build(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    vocab_size: int,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    eos: Sequence[int] = (),
    positions: Sequence[int] | None = None,
    device: torch.device = CPU,
) -> SamplingMetadata:
    n = len(params)
    meta = SamplingMetadata.build(
        params, prompts or [[]] * n, outputs or [[]] * n, seeds, eos, vocab_size, device
    )
    if positions is not None:  # large positions without building huge output lists
        rows = meta.rows_i64.clone()  # [top_k, seeds, positions]
        rows[2] = torch.tensor(positions, dtype=torch.int64, device=device)
        meta = dataclasses.replace(meta, rows_i64=rows)
    return meta


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return SAMPLER(logits, meta).sampled_token_ids


# ---------------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------------

M64 = (1 << 64) - 1


def _py_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _py_bits(seed: int, position: int, index: int) -> int:
    """Unsigned 64-bit reference of random_bits (same construction, plain Python ints)."""
    stream = _py_mix64((seed + 0x9E3779B97F4A7C15) & M64)
    key = _py_mix64((stream + (position + 1) * 0xD1B54A32D192ED03) & M64)
    return _py_mix64((key + (index + 1) * 0x9E3779B97F4A7C15) & M64)


def ref_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Target distribution in float64: softmax(x / T) truncated by top-k, top-p, min-p, renormalised."""
    x = logits.astype(np.float64) / temperature
    v = len(x)
    keep = np.ones(v, dtype=bool)
    if 0 < top_k < v:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    keep[order[before >= top_p]] = False
    p = np.where(keep, p, 0.0)
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def ref_allowed(x32: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Tokens a random row may sample, with a small tolerance at each cut (float32 vs float64)."""
    tol = 1e-4
    x = x32.astype(np.float64) / np.float32(temperature)
    v = len(x)
    finite = np.isfinite(x)
    srt = np.sort(x)[::-1]
    kth = srt[min(top_k, v) - 1] if top_k > 0 else srt[-1]
    strict = x >= kth
    keep = finite & (x >= kth - tol * (1 + abs(kth))) if np.isfinite(kth) else finite.copy()
    if top_p < 1.0:
        p = np.where(strict & finite, np.exp(x - x[finite].max()), 0.0)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        last = order[np.nonzero(before < top_p + tol)[0][-1]]
        thr = x[last]
        if np.isfinite(thr):
            keep &= x >= thr - tol * (1 + abs(thr))
    ratio = np.exp(np.where(finite, x - x[finite].max(), -np.inf))
    return keep & (ratio >= min_p * (1 - tol))


def check_frequencies(tokens: torch.Tensor, expected: np.ndarray) -> None:
    """Excluded tokens never appear; kept ones match `expected` (chi-square at 0.1% and abs error)."""
    n = tokens.numel()
    counts = np.bincount(tokens.numpy(), minlength=len(expected)).astype(np.float64)
    assert counts[expected == 0].sum() == 0, f"excluded tokens sampled: {counts} vs {expected}"
    kept = expected > 0
    freq = counts / n
    assert np.abs(freq - expected).max() < 0.015, (freq, expected)
    if kept.sum() > 1:
        e = expected[kept] * n
        chi2 = float(((counts[kept] - e) ** 2 / e).sum())
        assert chi2 < CHI2_999[int(kept.sum()) - 2], (chi2, freq, expected)


# ---------------------------------------------------------------------------------------------------
# Random bits
# ---------------------------------------------------------------------------------------------------


def test_random_bits_match_uint64_reference() -> None:
    seeds = [0, 1, 12345, 2**62 + 7, 2**63 - 1]
    positions = [0, 1, 17, 10**6, 2**40]
    bits = random_bits(torch.tensor(seeds), torch.tensor(positions), vocab_counters(6, CPU))
    for r, (s, p) in enumerate(zip(seeds, positions)):
        for i in range(6):
            assert int(bits[r, i]) & M64 == _py_bits(s, p, i)


def test_gumbel_noise_finite_and_row_independent() -> None:
    seeds, positions = torch.arange(50), torch.arange(50) * 3
    g = gumbel_noise(seeds, positions, vocab_counters(1000, CPU))
    assert g.dtype == torch.float32 and g.shape == (50, 1000) and torch.isfinite(g).all()
    # Standard Gumbel: mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert abs(g.mean().item() - 0.5772) < 0.02
    assert abs(g.var().item() - math.pi**2 / 6) < 0.05
    alone = gumbel_noise(seeds[7:8], positions[7:8], vocab_counters(1000, CPU))
    assert torch.equal(alone[0], g[7])


# ---------------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ignores_seeds() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    want = logits.argmax(dim=-1)
    for seeds in ([0] * 16, list(range(16)), [2**63 - 1 - i for i in range(16)]):
        params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3)] * 16
        assert torch.equal(sample(logits, build(params, seeds, 100)), want)
    tiny = [SamplingParams(temperature=1e-7)] * 16
    assert torch.equal(sample(logits, build(tiny, list(range(16)), 100)), want)


def test_mixed_batch_greedy_rows_unaffected() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 30)
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.5) for r in range(8)]
    out = sample(logits, build(params, list(range(8)), 30))
    assert torch.equal(out[1::2], logits[1::2].argmax(dim=-1))


# ---------------------------------------------------------------------------------------------------
# Distributions
# ---------------------------------------------------------------------------------------------------

LOGITS8 = np.array([2.0, 1.2, 0.9, 0.3, -0.2, -0.9, -1.5, -3.0], dtype=np.float32)
N_DRAWS = 20_000


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.6, 0, 1.0, 0.0),
        (2.5, 0, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.1),
        (1.3, 6, 0.9, 0.05),
        (0.8, 5, 0.7, 0.0),
        (1.0, 4, 0.72, 0.0),  # top-p must see the renormalised top-k mass (keeps 2, not 3)
    ],
)
def test_distribution_over_seeds(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * N_DRAWS
    logits = torch.from_numpy(LOGITS8).expand(N_DRAWS, 8)
    tokens = sample(logits, build(params, list(range(N_DRAWS)), 8))
    check_frequencies(tokens, ref_probs(LOGITS8, temperature, top_k, top_p, min_p))


# Groups of rows sharing one batch: (temperature, top_k, top_p, min_p). The first set takes the
# torch.topk path (no row uses top-p), the second the full-sort path; each row keeps its own cut.
MIXED_BATCHES = [
    [(1.0, 2, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (0.9, 0, 1.0, 0.0)],
    [(1.0, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (1.2, 0, 1.0, 0.0), (0.0, 2, 0.5, 0.0)],
]


@pytest.mark.parametrize("groups", MIXED_BATCHES)
def test_distribution_in_mixed_batch(groups: list[tuple[float, int, float, float]]) -> None:
    per_group = 10_000
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in groups]
    rows = [params[i % len(groups)] for i in range(per_group * len(groups))]  # interleaved groups
    logits = torch.from_numpy(LOGITS8).expand(len(rows), 8)
    tokens = sample(logits, build(rows, list(range(len(rows))), 8))
    for g, (t, k, p, m) in enumerate(groups):
        got = tokens[g :: len(groups)]
        if t == 0.0:
            assert (got == int(np.argmax(LOGITS8))).all()
        else:
            check_frequencies(got, ref_probs(LOGITS8, t, k, p, m))


DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_top_p_one_keeps_whole_vocab_despite_rounding(device: torch.device) -> None:
    """A float32 cumsum can overshoot 1 on a long tail of tiny probabilities; top_p = 1 keeps all."""
    x = torch.tensor([[0.0] + [-17.0] * 5000] * 2, device=device)
    meta = build([SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)], [0, 1], 5001, device=device)
    assert not meta.no_top_p  # the sort path runs for both rows
    assert torch.equal(apply_top_k_top_p(x, meta)[0], x[0])


def test_reference_truncation_sanity() -> None:
    """The reference itself cuts where expected (so the distribution tests exercise truncation)."""
    assert (ref_probs(LOGITS8, 1.0, 3, 1.0, 0.0) > 0).sum() == 3
    assert 1 < (ref_probs(LOGITS8, 1.0, 0, 0.8, 0.0) > 0).sum() < 8
    assert 1 < (ref_probs(LOGITS8, 1.0, 0, 1.0, 0.1) > 0).sum() < 8
    assert (ref_probs(LOGITS8, 1.0, 4, 0.72, 0.0) > 0).sum() == 2


def test_distribution_over_positions_of_one_seed() -> None:
    params = [SamplingParams(temperature=1.0)] * N_DRAWS
    logits = torch.from_numpy(LOGITS8).expand(N_DRAWS, 8)
    meta = build(params, [987654321] * N_DRAWS, 8, positions=list(range(N_DRAWS)))
    check_frequencies(sample(logits, meta), ref_probs(LOGITS8, 1.0, 0, 1.0, 0.0))


# ---------------------------------------------------------------------------------------------------
# Determinism and batch independence
# ---------------------------------------------------------------------------------------------------

TARGETS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.01),
    SamplingParams(temperature=1.2, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2),
]


def _neighbour(rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.5, 1.0, 1.7])),
        top_k=int(rng.choice([0, 1, 5, 40])),
        top_p=float(rng.choice([1.0, 0.5, 0.9])),
        min_p=float(rng.choice([0.0, 0.2])),
        repetition_penalty=float(rng.choice([1.0, 1.5])),
        frequency_penalty=float(rng.choice([0.0, 1.0])),
        logprobs=None if rng.random() < 0.5 else 5,
    )


@pytest.mark.parametrize("target", TARGETS)
def test_token_independent_of_batch(target: SamplingParams) -> None:
    v, seed = 64, 1234
    rng = np.random.default_rng(7)
    row = torch.from_numpy(rng.normal(size=v).astype(np.float32) * 2)
    prompt, output = [3, 9, 9, 40], [1, 2, 3] * 5 + [7, 8]  # position 17
    alone = sample(row[None], build([target], [seed], v, prompts=[prompt], outputs=[output]))
    for at in (0, 3, 6):
        params = [_neighbour(rng) for _ in range(7)]
        logits = torch.from_numpy(rng.normal(size=(7, v)).astype(np.float32))
        prompts = [list(rng.integers(0, v, size=rng.integers(0, 30))) for _ in range(7)]
        outputs = [list(rng.integers(0, v, size=rng.integers(0, 30))) for _ in range(7)]
        seeds = [int(s) for s in rng.integers(0, 2**63 - 1, size=7)]
        params[at], logits[at], prompts[at], outputs[at], seeds[at] = target, row, prompt, output, seed
        batch = sample(logits, build(params, seeds, v, prompts=prompts, outputs=outputs))
        assert batch[at] == alone[0]


def test_stream_depends_on_seed_and_position() -> None:
    v, n = 50, 400
    logits = torch.zeros(n, v)  # uniform: each draw is a fresh token
    params = [SamplingParams(temperature=1.0)] * n
    streams = [sample(logits, build(params, [s] * n, v, positions=list(range(n)))) for s in (1, 2, 2**40)]
    again = sample(logits, build(params, [1] * n, v, positions=list(range(n))))
    assert torch.equal(streams[0], again)
    assert len(set(streams[0].tolist())) > 30  # the position moves the stream
    for a in range(3):
        for b in range(a + 1, 3):
            agree = (streams[a] == streams[b]).float().mean().item()
            assert agree < 0.1  # ~1/50 expected for independent streams


# ---------------------------------------------------------------------------------------------------
# Penalties, min_tokens, logprobs
# ---------------------------------------------------------------------------------------------------


def test_penalties_match_reference() -> None:
    v = 12
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(3, v)).astype(np.float32) * 3)
    params = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=0.6),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0),
    ]
    prompts = [[0, 1, 1, 5], [2, 11], [4]]
    outputs = [[1, 3, 3, 3, 6], [6, 0], [4, 4, 7]]
    meta = build(params, [0, 1, 2], v, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, meta)
    for r, p in enumerate(params):
        for t in range(v):
            x = float(logits[r, t])
            if t in prompts[r] or t in outputs[r]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            c = outputs[r].count(t)
            x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            assert float(got[r, t]) == pytest.approx(x, rel=1e-6, abs=1e-6), (r, t)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    base = build([SamplingParams(temperature=0.0)], [0], 3, outputs=[[0]])
    assert sample(logits, base)[0] == 0
    pen = build([SamplingParams(temperature=0.0, frequency_penalty=1.5)], [0], 3, outputs=[[0]])
    assert sample(logits, pen)[0] == 1


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    v, n = 10, 300
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 0.0, 3.0, 0.0, 0.0]]).expand(n, v)
    short = SamplingParams(min_tokens=3, stop_token_ids=(5, 99))
    for temperature in (0.0, 1.0):
        p = dataclasses.replace(short, temperature=temperature)
        out = sample(logits, build([p] * n, list(range(n)), v, outputs=[[1]] * n, eos=[2, 1000]))
        assert not ((out == 2) | (out == 5)).any()
    greedy = dataclasses.replace(short, temperature=0.0)
    done = build([greedy], [0], v, outputs=[[1, 1, 1]], eos=[2])
    assert sample(logits[:1], done)[0] == 2  # min_tokens reached: EOS allowed again
    free_eos = dataclasses.replace(greedy, ignore_eos=True)
    ign = build([free_eos], [0], v, outputs=[[1]], eos=[2])
    assert sample(logits[:1], ign)[0] == 2  # ignore_eos: EOS is an ordinary token
    stop_only = build([dataclasses.replace(free_eos)], [0], v, outputs=[[1]], eos=[])
    logits5 = logits[:1].clone()
    logits5[0, 2] = 0.0
    assert sample(logits5, stop_only)[0] == 7  # stop id 5 still banned


def test_logprobs_from_raw_logits() -> None:
    v = 40
    torch.manual_seed(5)
    logits = torch.randn(5, v) * 2
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.4, logprobs=3),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0),
        SamplingParams(temperature=1.5, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=2),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    outputs = [[int(logits[r].argmax())] * 3 for r in range(5)]
    out = SAMPLER(logits, build(params, list(range(5)), v, outputs=outputs))
    assert torch.equal(logits, before)  # input never modified
    assert out.logprobs_token_ids is not None and out.logprobs is not None
    assert out.logprobs_token_ids.shape == (5, 4) and out.logprobs.shape == (5, 4)
    assert torch.equal(out.logprobs_token_ids[:, 0], out.sampled_token_ids)
    want = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, want.gather(1, out.logprobs_token_ids))
    top = torch.topk(want, 3, dim=-1)
    assert torch.equal(out.logprobs_token_ids[:, 1:], top.indices)
    assert (out.logprobs[:, 1:-1] >= out.logprobs[:, 2:]).all()
    # The penalised greedy row did not take the raw argmax, and its logprob is the raw one.
    assert out.sampled_token_ids[1] != logits[1].argmax()


def test_no_logprobs_when_none_requested() -> None:
    out = SAMPLER(torch.randn(2, 9), build([SamplingParams()] * 2, [0, 1], 9))
    assert out.logprobs is None and out.logprobs_token_ids is None
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids.shape == (2,)


def test_build_flags_and_padding() -> None:
    params = [SamplingParams(temperature=0.0, top_k=3), SamplingParams(top_k=500, repetition_penalty=1.1)]
    meta = build(params, [1, 2**64 - 1], 50, prompts=[[1, 2], [3]], outputs=[[4], []])
    assert not meta.all_greedy and not meta.all_random
    assert meta.no_top_k  # the only random row has top_k >= V
    assert meta.no_top_p and meta.no_min_p and not meta.no_penalties and meta.no_banned
    assert meta.top_k.tolist() == [3, 50] and meta.positions.tolist() == [1, 0]
    assert meta.prompt_ids.tolist() == [[1, 2], [3, 50]] and meta.output_ids.tolist() == [[4], [50]]
    assert meta.seeds.tolist() == [1, -1]
    plain = build([SamplingParams()], [0], 50, prompts=[[1, 2, 3]], outputs=[[4]])
    assert plain.prompt_ids.shape == (1, 0) and plain.output_ids.shape == (1, 0) and plain.no_penalties


# ---------------------------------------------------------------------------------------------------
# Property: filters are never violated, ids always in range
# ---------------------------------------------------------------------------------------------------

_logit = st.one_of(
    st.floats(-30, 30, width=32, allow_nan=False), st.just(float("-inf"))
).map(float)


Row = tuple[list[float], SamplingParams, int, int]  # logits, params, seed, position


@st.composite
def _row(draw: st.DrawFn, v: int) -> Row:
    logits = draw(st.lists(_logit, min_size=v, max_size=v))
    if not any(math.isfinite(x) for x in logits):
        logits[0] = 0.0
    params = SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 5.0))),
        top_k=draw(st.integers(0, v + 2)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
    )
    return logits, params, draw(st.integers(0, 2**63 - 1)), draw(st.integers(0, 2**40))


@st.composite
def _batch(draw: st.DrawFn) -> tuple[int, list[Row]]:
    v = draw(st.integers(2, 24))
    return v, draw(st.lists(_row(v), min_size=1, max_size=4))


@settings(max_examples=120, deadline=None)
@given(_batch())
def test_filters_never_violated(batch: tuple[int, list[Row]]) -> None:
    v, rows = batch
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    params = [r[1] for r in rows]
    meta = build(params, [r[2] for r in rows], v, positions=[r[3] for r in rows])
    out = sample(logits, meta)
    assert out.shape == (len(rows),) and ((out >= 0) & (out < v)).all()
    for r, p in enumerate(params):
        tok = int(out[r])
        x = logits[r].numpy()
        if p.temperature == 0.0:
            assert tok == int(np.argmax(x))
        else:
            allowed = ref_allowed(x, p.temperature, p.top_k, p.top_p, p.min_p)
            assert allowed[tok], (tok, x, p, allowed)


# ---------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_sync() -> None:
    cuda = torch.device("cuda")
    v, n = 1000, 64
    rng = np.random.default_rng(11)
    logits = torch.from_numpy(rng.normal(size=(n, v)).astype(np.float32) * 3)
    params = [_neighbour(rng) for _ in range(n)]
    prompts = [list(rng.integers(0, v, size=20)) for _ in range(n)]
    outputs = [list(rng.integers(0, v, size=int(rng.integers(0, 20)))) for _ in range(n)]
    seeds = [int(s) for s in rng.integers(0, 2**63 - 1, size=n)]
    cpu_out = SAMPLER(logits, build(params, seeds, v, prompts=prompts, outputs=outputs, eos=[0]))
    meta = build(params, seeds, v, prompts=prompts, outputs=outputs, eos=[0], device=cuda)
    dev_logits = logits.to(cuda)
    compiled, eager = Sampler(), Sampler(use_compile=False)
    compiled(dev_logits, meta)  # compile outside the no-sync window
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu_out = compiled(dev_logits, meta)
        eager_out = eager(dev_logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert compiled._compile is None  # still compiled: no fallback happened
    assert torch.equal(gpu_out.sampled_token_ids, eager_out.sampled_token_ids)
    assert torch.equal(gpu_out.sampled_token_ids.cpu(), cpu_out.sampled_token_ids)
    assert gpu_out.logprobs is not None and cpu_out.logprobs is not None
    torch.testing.assert_close(gpu_out.logprobs.cpu(), cpu_out.logprobs)
    bits = random_bits(meta.seeds, meta.positions, vocab_counters(v, cuda))
    cpu_bits = random_bits(meta.seeds.cpu(), meta.positions.cpu(), vocab_counters(v, CPU))
    assert torch.equal(bits.cpu(), cpu_bits)


def test_compile_failure_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: object, **kwargs: object) -> object:
        def fail(*args: object) -> object:
            raise RuntimeError("no compiler here")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    logits = torch.randn(6, 20)
    meta = build([SamplingParams(min_p=0.1)] * 6, list(range(6)), 20)
    sampler = Sampler(use_compile=True)
    assert torch.equal(sampler(logits, meta).sampled_token_ids, sample(logits, meta))
    assert sampler._compile is False


def test_empty_batch_and_shape_check() -> None:
    empty = build([], [], 9)
    out = SAMPLER(torch.zeros(0, 9), empty)
    assert out.sampled_token_ids.shape == (0,)
    with pytest.raises(ValueError):
        SAMPLER(torch.zeros(2, 10), build([SamplingParams()] * 2, [0, 1], 9))



class _RecordingSampler(Sampler):
    def __init__(self, use_compile: bool) -> None:
        super().__init__(use_compile)
        self.rows: list[int] = []

    def _race(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return super()._race(x, *args)


def test_warm_up_runs_the_compiled_race_for_one_and_several_rows() -> None:
    eager = _RecordingSampler(use_compile=False)
    eager.warm_up(50, torch.device("cpu"))
    assert eager.rows == []  # nothing to compile
    compiled = _RecordingSampler(use_compile=True)
    compiled._compiled = min_p_race  # stands in for torch.compile's result: the test needs no compiler
    compiled.warm_up(50, torch.device("cpu"))
    assert compiled.rows == [1, 2]  # torch specialises size 1: both shapes are compiled at start-up


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_stage_greedy_argmax_matches_torch(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tokenmill.worker.sampler import greedy_argmax

    g = torch.Generator(device=device).manual_seed(0)
    for v in (128256, 40000, 1024 * 32, 50257):  # chunks of 1002, 1000, 1024; 1024 with a padded last chunk
        x = torch.randn((5, v), generator=g, device=device)
        x[1, 7] = x[1, v - 3] = x[1].max() + 1.0  # a tie: the first index wins, as in torch.argmax
        x[2, -1] = 1e9  # the maximum in the last chunk (a partial one for 50257)
        x[3] = -torch.inf
        x[3, 9000] = 0.0
        want = x.argmax(dim=-1)
        assert want[1] == 7
        torch.testing.assert_close(greedy_argmax(x, two_stage=True), want, rtol=0, atol=0)


def test_unit_temperature_skips_the_divide_and_changes_no_token() -> None:
    """A batch whose temperatures are all exactly 1 (greedy rows hold 1 too) is not divided: the same tokens as
    with the divide, for every seed; one row at another temperature turns the skip off."""
    v, n = 300, 6
    logits = torch.randn((n, v), generator=torch.Generator().manual_seed(5)) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=20), SamplingParams(min_p=0.1),
              SamplingParams(top_p=0.9), SamplingParams()]
    for seed in range(20):
        meta = build(params, [seed * 7 + i for i in range(n)], v)
        assert meta.unit_temperature
        divided = dataclasses.replace(meta, unit_temperature=False)
        assert torch.equal(sample(logits, meta), sample(logits, divided))
    assert not build([SamplingParams(), SamplingParams(temperature=0.7)], [0, 1], v).unit_temperature
