"""Our loader + LlamaForCausalLM + TorchRefBackend against transformers (eager, float32) on tiny
random models of every supported architecture, saved to disk with save_pretrained."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.loader import build_model, resolve_model
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.models.llama import LlamaForCausalLM

VOCAB = 256
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)

CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**COMMON),
    "llama3-rope": LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "smollm2-tied": LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True),
    "mistral-window": MistralConfig(**COMMON, sliding_window=8, head_dim=16),
    "qwen2-bias": Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3-qknorm": Qwen3Config(**COMMON, head_dim=32),
}
SHARDED = {"llama"}

PROMPT = [1, 17, 200, 33, 5, 91, 250, 8, 8, 64, 3, 120, 7, 77, 19, 4, 201, 13, 99, 2]


def randomize(model: PreTrainedModel, seed: int) -> None:
    """Weights large enough that every component (rope, attention, biases, norms) moves the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, PreTrainedModel, LlamaForCausalLM]:
    name: str = request.param
    torch.manual_seed(0)
    config = CONFIGS[name]
    config._attn_implementation = "eager"
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf_model, seed=len(name))
    path = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(path, max_shard_size="40KB" if name in SHARDED else "1GB")
    if name in SHARDED:
        assert (path / "model.safetensors.index.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    reloaded.eval()
    source = resolve_model(str(path), "auto")
    ours = build_model(source, TorchRefBackend(), torch.device("cpu"), torch.float32)
    return name, reloaded, ours


def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def make_caches(model: LlamaForCausalLM, num_blocks: int, block_size: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a = model.arch
    shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
    return [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(a.num_layers)]


def step_meta(prefix_lens: list[int], query_lens: list[int], block_size: int) -> AttentionMetadata:
    """Request i owns blocks [i * M, (i + 1) * M) with M = blocks for the longest request."""
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    per_req = math.ceil(max(seq_lens) / block_size)
    tables = torch.arange(len(seq_lens) * per_req, dtype=torch.int32).reshape(len(seq_lens), per_req)
    slots = [int(tables[i, pos // block_size]) * block_size + pos % block_size
             for i, (p, s) in enumerate(zip(prefix_lens, seq_lens)) for pos in range(p, s)]
    return attention_metadata(list(query_lens), seq_lens, tables.tolist(), slots, torch.device("cpu"))

def run_step(model: LlamaForCausalLM, caches: list[tuple[torch.Tensor, torch.Tensor]],
             chunks: list[list[int]], prefix_lens: list[int], block_size: int) -> torch.Tensor:
    """One varlen step: chunks[i] are request i's new tokens after prefix_lens[i] cached ones."""
    meta = step_meta(prefix_lens, [len(c) for c in chunks], block_size)
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
    positions = torch.tensor([p + j for c, p in zip(chunks, prefix_lens) for j in range(len(c))])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, caches, meta))


def test_single_prompt(pair: tuple[str, PreTrainedModel, LlamaForCausalLM]) -> None:
    _, hf_model, ours = pair
    caches = make_caches(ours, num_blocks=2, block_size=16)
    logits = run_step(ours, caches, [PROMPT], [0], 16)
    assert logits.dtype == torch.float32 and logits.shape == (len(PROMPT), VOCAB)
    torch.testing.assert_close(logits, hf_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_varlen_batch(pair: tuple[str, PreTrainedModel, LlamaForCausalLM]) -> None:
    _, hf_model, ours = pair
    prompts = [PROMPT[:5], PROMPT[3:], PROMPT[:11]]
    caches = make_caches(ours, num_blocks=3 * 5, block_size=4)
    logits = run_step(ours, caches, prompts, [0, 0, 0], 4)
    expected = torch.cat([hf_logits(hf_model, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_reads_paged_cache(pair: tuple[str, PreTrainedModel, LlamaForCausalLM]) -> None:
    _, hf_model, ours = pair
    caches = make_caches(ours, num_blocks=5, block_size=4)
    first = run_step(ours, caches, [PROMPT[:9]], [0], 4)
    second = run_step(ours, caches, [PROMPT[9:]], [9], 4)
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_decode_steps_match_full_prompt(pair: tuple[str, PreTrainedModel, LlamaForCausalLM]) -> None:
    """Prefill then one token per step: the mistral case crosses its 8-token window here."""
    _, hf_model, ours = pair
    caches = make_caches(ours, num_blocks=2, block_size=16)
    rows = [run_step(ours, caches, [PROMPT[:12]], [0], 16)]
    rows += [run_step(ours, caches, [[tok]], [pos], 16) for pos, tok in enumerate(PROMPT[12:], start=12)]
    torch.testing.assert_close(torch.cat(rows), hf_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_arch_read_from_config(pair: tuple[str, PreTrainedModel, LlamaForCausalLM]) -> None:
    name, _, ours = pair
    a = ours.arch
    assert a.tie_word_embeddings == (name in ("smollm2-tied", "qwen2-bias"))
    assert (ours.lm_head is None) == a.tie_word_embeddings
    assert a.sliding_window == (8 if name == "mistral-window" else None)
    assert a.qkv_bias == (name == "qwen2-bias") and a.qk_norm == (name == "qwen3-qknorm")
    assert a.rope_scaling.kind == ("llama3" if name == "llama3-rope" else "none")
    assert a.head_dim == (32 if name == "qwen3-qknorm" else 16)
    assert a.eos_token_ids == (2,)


def test_weights_live_on_requested_dtype() -> None:
    src = resolve_model("tiny-llama", "dummy")
    model = build_model(src, TorchRefBackend(), torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    logits = run_step(model, make_caches(model, 2, 16), [PROMPT[:7]], [0], 16)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
