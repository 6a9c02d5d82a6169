"""The embedded Q4_1 model on the CPU with its projections run from their GGUF blocks (--gguf-native on) against
dequantized on load (off, what "auto" picks on the CPU): greedy agreement of the generated tokens, the weight
bytes each holds, and the decode speed of each. On the CPU the native method computes through its torch
reference (the blocks dequantized in fp32 at every call, then F.linear), so this measures the loading and
repacking path on real weights and what native costs on a CPU, not the Triton kernels (GPU: gpu_gguf.py).
Not a timed test: a benchmark (minutes on the CPU).

    python -m tokenmill.benchmarks.gguf_native_cpu --prompts 16 --max-tokens 48 --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.datasets import chat_exchanges
from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.models.layers import Linear


def run_mode(native: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    config = EngineConfig(model="embedded", device="cpu", dtype="float32", gguf_native=native)  # type: ignore[arg-type]
    engine = LLMEngine(config)
    modules = engine.runner.model.named_modules()
    layers = [m for n, m in modules if n.startswith("model.layers.") and isinstance(m, Linear)]
    proj_bytes = sum(p.numel() * p.element_size() for m in layers for n, p in m.named_parameters() if n != "bias")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return {"method": type(layers[0].method).__name__, "projection_bytes": proj_bytes,
            "tokens": [o.token_ids for o in outs], "seconds": seconds,
            "out_tok_s": sum(len(o.token_ids) for o in outs) / seconds}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Share of positions with equal tokens up to each pair's first difference (after it the contexts differ)."""
    same = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]
    total = sum(len(r) for r in a)
    return {"identical_sequences": sum(s == len(r) for s, r in zip(same, a)), "sequences": len(a),
            "tokens_before_first_difference": sum(same), "tokens": total, "share": sum(same) / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="held-out ShareGPT prompts (the file's last)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from tokenmill.worker.engine import load_tokenizer
    from tokenmill.worker.loader import resolve_model

    tok = load_tokenizer(resolve_model("embedded"))
    prompts = [list(ex.prompt_ids) for ex in chat_exchanges(tok, range(-args.prompts, 0), 128, 1)]
    modes = {mode: run_mode(mode, prompts, args.max_tokens) for mode in ("off", "on")}
    payload: dict[str, Any] = {
        "benchmark": "gguf_native_cpu", "model": "embedded (SmolLM2-135M-Instruct Q4_1)", "dtype": "float32",
        "prompts": len(prompts), "max_tokens": args.max_tokens, "greedy": True,
        "agreement": agreement(modes["on"]["tokens"], modes["off"]["tokens"]),
        "modes": {m: {k: v for k, v in r.items() if k != "tokens"} for m, r in modes.items()}}
    a, off, on = payload["agreement"], payload["modes"]["off"], payload["modes"]["on"]
    md = "\n".join([
        f"Embedded SmolLM2-135M Q4_1, fp32 CPU, {a['sequences']} ShareGPT prompts x {args.max_tokens} greedy tokens.",
        "", "| gguf_native | projection method | projection weights MiB | out tok/s |", "|---|---|---|---|",
        f"| off (dequantized on load) | {off['method']} | {off['projection_bytes'] / 2**20:.1f} | "
        f"{off['out_tok_s']:.1f} |",
        f"| on (GGUF blocks) | {on['method']} | {on['projection_bytes'] / 2**20:.1f} | {on['out_tok_s']:.1f} |",
        "", f"Greedy agreement: {a['identical_sequences']}/{a['sequences']} sequences identical, "
        f"{100 * a['share']:.2f}% of tokens before the first difference."])
    if args.out:
        write_results(args.out, "gguf_native_cpu", payload, md)
    else:
        print(md)


if __name__ == "__main__":
    main()
