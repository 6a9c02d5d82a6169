"""CPU benchmark on the embedded model (issue 2, item 8).

1. 32 concurrent ShareGPT chat requests through the engine vs Hugging Face `generate()` one request at a
   time, same prompts and the same output lengths (each the token length of the recorded reply, capped;
   forced with ignore_eos / min_new_tokens): output tokens/s.
2. Time to first token of a request whose 1,000-token prefix is cached vs the same request cold.

    python -m tokenmill.benchmarks.engine_cpu --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.datasets import sharegpt_pairs
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.registry_fetch import embedded_model_path, sharegpt_path


def chat_requests(engine: LLMEngine, n: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    """ShareGPT chats as vLLM's benchmark samples them: the human turn through the chat template, and the
    output length of the recorded reply (in tokens, capped at `max_output`)."""
    requests = []
    for human, reply in sharegpt_pairs(sharegpt_path()):
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": human}])
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        out_len = min(len(engine.tokenizer.encode(reply, add_special_tokens=False)), max_output)
        if 16 <= len(ids) <= max_prompt and out_len >= 16:
            requests.append((ids, out_len))
        if len(requests) == n:
            return requests
    raise RuntimeError("not enough ShareGPT prompts")


def load_hf() -> Any:
    import transformers

    src = embedded_model_path()
    tmp = Path(tempfile.mkdtemp())
    shutil.copy(src, tmp / src.name)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp, gguf_file=src.name, dtype=torch.float32).eval()


@torch.no_grad()
def hf_one_at_a_time(model: Any, requests: list[tuple[list[int], int]]) -> float:
    start = time.perf_counter()
    for ids, out_len in tqdm(requests, desc="HF generate, one at a time"):
        x = torch.tensor([ids])
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=out_len, min_new_tokens=out_len,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def engine_concurrent(engine: LLMEngine, requests: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = engine.generate([ids for ids, _ in requests], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == n for o, (_, n) in zip(outs, requests))
    return elapsed


def ttft(engine: LLMEngine, ids: list[int]) -> float:
    start = time.perf_counter()
    for out in engine.stream(ids, SamplingParams(temperature=0.0, max_tokens=1)):
        if out.new_token_ids:
            return time.perf_counter() - start
    raise AssertionError("no token")


def prefix_ttft(engine: LLMEngine, repeats: int) -> dict[str, float]:
    text = " ".join(h for h, _ in sharegpt_pairs(sharegpt_path())[:200])
    prefix = engine.tokenizer.encode(text)[:1000]
    cold, warm = [], []
    for r in range(repeats):
        engine.blocks.reset_prefix_cache()
        cold.append(ttft(engine, [*prefix, 100 + r]))  # prefix cold
        warm.append(ttft(engine, [*prefix, 200 + r]))  # same prefix, now cached
    return {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
            "ratio": statistics.median(cold) / statistics.median(warm)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256, help="cap on the ShareGPT reply length")
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(cpu_kv_bytes=2 << 30),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64)))
    requests = chat_requests(engine, args.requests, args.max_prompt, args.max_output)
    n_out = sum(n for _, n in requests)
    engine_concurrent(engine, [(ids, 4) for ids, _ in requests[:2]])  # warm-up
    t_engine = engine_concurrent(engine, requests)
    hf = load_hf()
    t_hf = hf_one_at_a_time(hf, requests)
    prefix = prefix_ttft(engine, args.repeats)
    results: dict[str, Any] = {
        "config": vars(args) | {"out": str(args.out)},
        "output_tokens": n_out,
        "throughput": {"engine_s": t_engine, "hf_s": t_hf, "engine_tok_s": n_out / t_engine,
                       "hf_tok_s": n_out / t_hf, "ratio": t_hf / t_engine},
        "prefix_ttft": prefix,
        "torch_threads": torch.get_num_threads(),
    }
    tp = results["throughput"]
    table = "\n".join([
        "| measure | tokenmill | HF transformers | ratio |",
        "|---|---|---|---|",
        f"| output tok/s, {args.requests} ShareGPT chats, {n_out} output tokens (reply lengths, capped at "
        f"{args.max_output}; engine concurrent, HF one at a time) | {tp['engine_tok_s']:.1f} | {tp['hf_tok_s']:.1f} | "
        f"{tp['ratio']:.2f}x |",
        f"| TTFT, 1,000-token prefix: cached vs cold (median of {args.repeats}) | {prefix['warm_s'] * 1e3:.1f} ms"
        f" | cold {prefix['cold_s'] * 1e3:.1f} ms | {prefix['ratio']:.2f}x lower |",
    ])
    write_results(args.out, "engine_cpu", results, table)


if __name__ == "__main__":
    main()
