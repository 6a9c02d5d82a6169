"""Disaggregated prefill and decode on CUDA (the lent H200): the KV blocks a prefill engine exports (gathered
on the device, staged through pinned memory) arrive bit for bit in the decode engine's cache, and a prefill
and a decode worker process sharing the GPU give the greedy output of one engine (float32, torch attention
backend: no bf16 ties between differently batched runs)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers_net import addr, free_port, procs_ctx, wait_until, wait_workers

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.kv_transfer.blocks import as_buffer, stage_in

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
FP32 = ["--dtype", "float32", "--attention-backend", "torch"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _engine(dtype: str = "float32", backend: str = "torch") -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device=DEVICE, dtype=dtype,  # type: ignore[arg-type]
                                  attention_backend=backend, max_model_len=1024))  # type: ignore[arg-type]


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(17, 300))] for _ in range(n)]


def _hand_over(src: LLMEngine, dst: LLMEngine, prompt: list[int]) -> list[int]:
    """src computes the prompt; its KV goes to dst as a decode worker receives it (pinned staging)."""
    src.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    exported = src.export_prefix_kv(prompt)
    assert exported is not None
    ids, kv = exported
    assert kv.is_pinned()
    geo = src.kv_geometry()
    staged = stage_in(as_buffer(kv), geo.payload_shape(len(ids) // geo.block_size), geo.dtype, torch.device(DEVICE))
    assert staged.is_pinned()
    assert dst.import_prefix_kv(ids, staged) == len(ids) // geo.block_size
    return ids


def test_kv_arrives_bit_for_bit_in_bf16() -> None:
    src, dst = _engine("bfloat16", "auto"), _engine("bfloat16", "auto")
    for prompt in _prompts(4):
        ids = _hand_over(src, dst, prompt)
        back = dst.export_prefix_kv(prompt)
        again = src.export_prefix_kv(prompt)
        assert back is not None and again is not None and back[0] == ids
        assert torch.equal(back[1].view(torch.int16), again[1].view(torch.int16))


def test_decode_engine_from_imported_kv_matches_one_engine() -> None:
    ref, src, dst = _engine(), _engine(), _engine()
    prompts = _prompts(6)
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    got = []
    for prompt in prompts:
        _hand_over(src, dst, prompt)
        got.append(dst.generate([prompt], GREEDY)[0].token_ids)
    assert got == expected


@pytest.mark.timeout(300)
def test_prefill_and_decode_processes_on_one_gpu_match_one_engine(tmp_path: Path) -> None:
    from tokenmill.client import Client

    prompts = _prompts(8)
    expected = [o.token_ids for o in _engine().generate(prompts, GREEDY)]
    front, back = free_port(), free_port()
    model = ["--model", "tiny-llama", "--load-format", "dummy", "--device", DEVICE, "--max-model-len", "1024", *FP32]
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back)
        ps.worker(back, "--role", "prefill", "--gpu-memory-utilization", "0.2", model=model, name="pf")
        with Client(addr(front)) as c:
            wait_workers(c, 1)
            # (after the first: a worker's budget is a share of the whole GPU less what other processes hold)
            ps.worker(back, "--role", "decode", "--gpu-memory-utilization", "0.4", model=model, name="dc")
            wait_workers(c, 2)
            handles = [c.submit(prompt_token_ids=pr, max_tokens=16, temperature=0.0, ignore_eos=True)
                       for pr in prompts]
            got = [h.result(timeout=120).token_ids for h in handles]
            wait_until(lambda: c.stats()["counters"].get("prefills", 0) >= len(prompts), 10, what="PREFILLED")
            counters = c.stats()["counters"]
    assert got == expected
    assert counters["prefills"] == len(prompts) and counters.get("kv_lost", 0) == 0
