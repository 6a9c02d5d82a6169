"""On CUDA (bf16): piecewise CUDA graphs (steps with prompt tokens) give the same greedy tokens as the same
engine without them, for tiny random models of each architecture, and serving after start-up compiles no
attention kernel (the warm-up built every variant, the tree-draft ones too when trees are verified)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_hf import ARCHS, save_tiny_model

from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def engine(path: Path, piecewise: bool, speculative: SpeculativeConfig | None = None,
           dtype: str = "bfloat16", whole_step: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cuda", attention_backend="triton",
                                  piecewise_graphs=piecewise, whole_step_graphs=whole_step,
                                  speculative=speculative or SpeculativeConfig(),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32)))


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 3, 15, 16, 17, 40, 70, 100, 230, 300) * 3]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_piecewise_graphs_greedy_identical(arch: str, tmp_path: Path) -> None:
    path = save_tiny_model(arch, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ps = prompts(7)
    eager = [o.token_ids for o in engine(path, False).generate(ps, params)]
    graphed_engine = engine(path, True)
    assert graphed_engine.runner.piecewise is not None
    graphed = [o.token_ids for o in graphed_engine.generate(ps, params)]
    same = sum(a == b for a, b in zip(eager, graphed))
    assert same == len(ps), f"{arch}: {len(ps) - same} of {len(ps)} sequences differ"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_whole_step_graphs_greedy_identical_to_the_pieces(arch: str, tmp_path: Path) -> None:
    """A whole-step replay computes what the pieces compute, bit for bit (WholeStepGraphs), so the tokens agree
    exactly with the piecewise engine's; most mixed steps of this workload replay a whole-step graph."""
    path = save_tiny_model(arch, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ps = prompts(7)
    pieces = [o.token_ids for o in engine(path, True).generate(ps, params)]
    whole = engine(path, True, whole_step=True)
    assert whole.runner.whole_step is not None and whole.runner.whole_step.graphs
    tokens = [o.token_ids for o in whole.generate(ps, params)]
    same = sum(a == b for a, b in zip(pieces, tokens))
    assert same == len(ps), f"{arch}: {len(ps) - same} of {len(ps)} sequences differ"
    assert whole.runner.whole_step.replays > 0


def test_no_compile_after_start_up_with_whole_step_graphs(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path)
    eng = engine(path, True, whole_step=True)
    before = _compiled_variants()
    rng = random.Random(5)
    ps = [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 400))] for _ in range(48)]
    outs = eng.generate(ps, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert len(outs) == len(ps) and _compiled_variants() == before
    assert eng.runner.whole_step is not None and eng.runner.whole_step.replays > 0


def _compiled_variants() -> int:
    from tokenmill.kernels import paged_attention as pa

    kernels = (pa._paged_attn_kernel, pa._paged_attn_kernel_dyn, pa._reduce_splits_kernel, pa._reduce_splits_kernel_dyn)
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


def test_no_attention_compile_after_start_up(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path)
    eng = engine(path, True)
    before = _compiled_variants()
    rng = random.Random(3)
    ps = [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 400))] for _ in range(48)]
    outs = eng.generate(ps, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40), ignore_eos=True))
    assert len(outs) == len(ps)
    assert _compiled_variants() == before, "attention kernels compiled while serving"


TREES = SpeculativeConfig(method="ngram", tree_width=3, auto_switch=False)


def motif_prompts(seed: int, n: int, lengths: tuple[int, int] = (8, 300), repeats: int = 80) -> list[list[int]]:
    """Prompts that repeat a short motif (`repeats` times, cut at a length drawn from `lengths`), so n-gram drafts
    are proposed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 384) for _ in range(rng.randrange(2, 6))]
        out.append((motif * repeats)[: rng.randrange(*lengths)])
    return out


def test_no_attention_compile_after_start_up_with_tree_drafts(tmp_path: Path) -> None:
    """Tree verification launches the TREE variants: the warm-up builds them too (n-gram trees on prompts
    that repeat themselves, so drafts are proposed). The tree-verified tokens equal plain decoding's in float32:
    in bf16 a verify step's M-token GEMMs and dynamic attention round otherwise than the decode graph's, and
    a near-tie of this random model flips (seen on the H200: one token of 160, inside a repeated motif)."""
    path = save_tiny_model("llama", tmp_path)
    eng = engine(path, True, TREES)
    before = _compiled_variants()
    ps = motif_prompts(5, 24)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = eng.generate(ps, params)
    assert len(outs) == len(ps) and eng.counters.accepted_draft_tokens > 0
    assert _compiled_variants() == before, "attention kernels compiled while serving"
    del eng
    trees = engine(path, True, TREES, dtype="float32").generate(ps, params)
    plain = engine(path, True, dtype="float32").generate(ps, params)
    assert [o.token_ids for o in trees] == [o.token_ids for o in plain]


def test_no_attention_compile_after_start_up_one_tree_request_long_context(tmp_path: Path) -> None:
    """One request verifying trees over 1,200 tokens of context: steps of 2-4 tokens, split, whose reduce takes
    more programs per row (fewer dims each) than at any token bucket (8 heads of 128 dims); the warm-up builds
    those variants too (tests/test_warmup_variants.py: "one-long-tree")."""
    path = save_tiny_model("llama", tmp_path, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    eng = engine(path, True, TREES)
    before = _compiled_variants()
    outs = eng.generate(motif_prompts(6, 1, (1200, 1201), 600), SamplingParams(temperature=0.0, max_tokens=32,
                                                                         ignore_eos=True))
    assert len(outs[0].token_ids) == 32 and eng.counters.draft_tokens > 0
    assert _compiled_variants() == before, "attention kernels compiled while serving"
