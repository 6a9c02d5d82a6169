"""Checkpoints written by llm-compressor itself (tests/fixtures/llmcompressor, made by make_llmcompressor.py in
a virtual environment of its own) load through our compressed-tensors loader and give the logits of
llm-compressor's own quantized model, and serve in the engine. (Checkpoints of GPTQModel / AutoGPTQ / AutoAWQ
are not among them: no release of those installs on a CPU machine without a CUDA build of torch.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.loader import build_model, resolve_model
from tokenmill.worker.model_runner import attention_metadata

FIXTURES = Path(__file__).parent / "fixtures" / "llmcompressor"
SCHEMES = ["gptq_w4a16_g32_sym", "gptq_w4a16_g32_asym_actorder", "rtn_w8a16_channel", "fp8_dynamic"]
CPU = torch.device("cpu")


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = build_model(resolve_model(str(folder)), TorchRefBackend(), CPU, torch.float32,
                        fp8_emulation=True)
    n, block = ids.numel(), 16
    blocks = -(-n // block)
    a = model.arch
    shape = (blocks, block, a.num_kv_heads, a.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.num_layers)]
    meta = attention_metadata([n], [n], [list(range(blocks))], list(range(n)), CPU)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n), caches, meta)).float()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_llmcompressor_checkpoint_gives_its_own_logits(scheme: str) -> None:
    folder = FIXTURES / scheme
    ref = load_file(str(folder / "reference.safetensors"))
    ids, want = ref["input_ids"][0], ref["logits"][0]
    got = _logits(folder, ids)
    # the same dequantized weights (and, for FP8, the same per-token activation rounding): float32 sums in
    # another order apart (measured ~7e-7 of the largest logit)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-5, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_llmcompressor_checkpoints_serve_in_the_engine() -> None:
    """The W4A16 and W8A16 checkpoints through the whole engine (FP8 needs a GPU there): the greedy token is the
    argmax of llm-compressor's own logits."""
    from tokenmill.protocol.sampling import SamplingParams
    from tokenmill.worker.config import EngineConfig
    from tokenmill.worker.engine import LLMEngine

    for scheme in ("gptq_w4a16_g32_asym_actorder", "rtn_w8a16_channel"):
        ref = load_file(str(FIXTURES / scheme / "reference.safetensors"))
        ids, want = ref["input_ids"][0].tolist(), ref["logits"][0].argmax(-1)
        engine = LLMEngine(EngineConfig(model=str(FIXTURES / scheme), device="cpu", dtype="float32",
                                        max_model_len=128))
        out = engine.generate([ids[:8]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        assert out[0].token_ids == [int(want[7])], scheme
