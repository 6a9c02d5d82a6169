"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32) against transformers loading
the same file: greedy chat answers token-identical alone and inside a batch of 32 mixed-length requests."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from greedy_ref import compare_greedy, hf_greedy

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.registry_fetch import embedded_model_path

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.",
    "What is 12 times 12?",
]
N_TOKENS = 24


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", device="cpu",
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32)))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch
    import transformers

    d = tmp_path_factory.mktemp("gguf")
    src = embedded_model_path()
    shutil.copy(src, d / src.name)
    return transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=src.name, dtype=torch.float32, attn_implementation="eager").eval()


def _chat_ids(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def test_embedded_greedy_matches_hf_alone_and_in_batch_of_32(engine: LLMEngine, hf_model: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS)
    chats = [_chat_ids(engine, c) for c in CHATS]
    # 24 more requests of other lengths: raw-text prompts of 1..~300 tokens.
    filler_text = " ".join(CHATS) * 8
    filler_ids = engine.tokenizer.encode(filler_text)
    fillers = [filler_ids[: 1 + 13 * i] for i in range(24)]
    refs = [hf_greedy(hf_model, ids, N_TOKENS, eos=engine.eos_token_ids) for ids in chats]

    alone = [engine.generate([ids], params)[0].token_ids for ids in chats]
    batch = engine.generate(chats + fillers, params)
    ties = []
    for i, (ref, ref_logits) in enumerate(refs):
        if not compare_greedy(alone[i], ref, ref_logits).equal:
            ties.append(("alone", i))
        if not compare_greedy(batch[i].token_ids, ref, ref_logits).equal:
            ties.append(("batch", i))
    print(f"float ties: {len(ties)} of {2 * len(refs)} sequences: {ties}")
    assert len(ties) <= 2
    assert "Paris" in engine.tokenizer.decode(alone[0])
