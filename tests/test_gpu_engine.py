"""On CUDA (bf16): the Triton backend, with and without decode CUDA graphs, gives the same greedy tokens as
the torch reference backend for tiny random models of each architecture. Where a token differs, the
reference's own logprobs must show a float tie at that position."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_hf import ARCHS, save_tiny_model

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_TIE = 0.06  # bf16 logits carry ~3 significant digits; a gap under this is a tie


def run(path: Path, backend: str, graphs: bool, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device="cuda", attention_backend=backend,  # type: ignore[arg-type]
                                    cuda_graphs=graphs,
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=32)))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    return [(o.token_ids, o.logprobs or []) for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_triton_backend_and_graphs_match_torch_reference(arch: str, tmp_path: Path) -> None:
    path = save_tiny_model(arch, tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 3, 15, 16, 17, 40, 70, 100) * 4]
    ref = run(path, "torch", False, prompts)
    ties = 0
    for backend, graphs in (("triton", False), ("triton", True)):
        got = run(path, backend, graphs, prompts)
        for (ours, _), (theirs, ref_lp) in zip(got, ref):
            for i, (a, b) in enumerate(zip(ours, theirs)):
                if a != b:
                    assert a in ref_lp[i], f"{backend} graphs={graphs}: token {i} {a} not in reference top-5"
                    gap = ref_lp[i][b] - ref_lp[i][a]
                    assert gap < BF16_TIE, f"{backend} graphs={graphs}: token {i} differs by {gap:.3f}"
                    ties += 1
                    break
    # Every difference above was shown to be a tie. bf16 rounds logits to ~3 significant digits, so
    # over 512 greedy tokens a few near-equal pairs flip (10-18 of 64 sequences on the H200); the bound
    # only guards against a comparison that degenerated into ties everywhere.
    print(f"{arch}: {ties} of 64 sequences diverged at a float tie")
    assert ties <= 32, f"{ties} ties of 64 sequences"
