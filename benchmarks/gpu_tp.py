"""Tensor parallelism on a machine of 2 GPUs (issue 18, acceptance 3): TP = 1 against TP = N in the same call.

- batch-1 decode: p50 time of a decode step (prompt 128, 128 new tokens; decode steps only), as gpu_e2e.py
- fixed: 1,000 requests of 1,000 random tokens in and 1,000 out (the suite's `fixed` section: at most
  2 x max_num_seqs handed over at once), output tokens/s
- GPU greedy equivalence: the tiny dummy models in float32, TP = N against TP = 1, token for token

on dummy Llama-3-8B in bfloat16 (max_num_seqs 256, max_num_batched_tokens 8192, max_model_len 4096, as the
suite's GPU config). Each engine runs in a child process of its own (`--measure`), so one's KV cache and
graph pools never share a GPU with the next one's; this process collects their JSON and writes
<out>/gpu_tp_<model>.json + .md and merges the headline figures into <out>/summary.json.

    python -m tokenmill.benchmarks.gpu_tp --out benchmarks/results/h200-x2         # 2 GPUs
    python -m tokenmill.benchmarks.gpu_tp --device cpu --model tiny-llama --out /tmp/tp-smoke   # smoke, gloo

NOT RUN YET on GPUs: no machine of several GPUs was lent while it was written, so no figure of it exists;
the CPU smoke mode (tiny model, small sizes, gloo) is what was run. The figures are only recorded for the
configuration the summary keys define (llama3-8b on CUDA, TP = 2, the full fixed workload completed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.benchmarks import summary
from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.gpu_e2e import decode_step_times
from tokenmill.benchmarks.throughput import ModelSpec, drive, free_device_memory
from tokenmill.benchmarks.workloads import random_workload
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig
from tokenmill.worker.engine import LLMEngine

TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workload of one run (the GPU defaults define the summary keys; smoke runs shrink them)."""

    decode_prompt: int = 128
    decode_tokens: int = 128
    fixed_requests: int = 1000
    fixed_in: int = 1000
    fixed_out: int = 1000


GPU_SIZES = Sizes()
SMOKE_SIZES = Sizes(decode_prompt=16, decode_tokens=16, fixed_requests=8, fixed_in=32, fixed_out=16)


def spec_for(args: argparse.Namespace) -> ModelSpec:
    if args.device == "cpu":
        return ModelSpec(model=args.model, load_format="dummy", dtype="float32", device="cpu", max_num_seqs=8,
                         max_num_batched_tokens=256, max_model_len=1024, async_scheduling=False)
    return ModelSpec(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=256,
                     max_num_batched_tokens=8192, max_model_len=4096, gpu_memory_utilization=0.9)


def build(spec: ModelSpec, tp: int) -> LLMEngine:
    return LLMEngine(dataclasses.replace(spec.engine_config(), tensor_parallel_size=tp))


# -- measured in a child process, one engine each ------------------------------------------------------------


def measure_perf(spec: ModelSpec, tp: int, sizes: Sizes) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = build(spec, tp)
    try:
        startup = time.perf_counter() - t0
        vocab = engine.runner.arch.vocab_size
        engine.generate([[10 + i for i in range(16)]] * 4, SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        times = decode_step_times(engine, 1, sizes.decode_prompt, sizes.decode_tokens)
        wl = random_workload(sizes.fixed_requests, sizes.fixed_in, sizes.fixed_out, vocab, seed=0)
        run = drive(engine, wl, window=2 * spec.max_num_seqs, desc=f"fixed tp{tp}")
        fixed = run.summary(engine.runner.bytes_per_block)
        return {"tp": tp, "startup_s": startup, "kv_blocks": engine.runner.num_blocks,
                "decode_b1": {"ms_per_step_p50": 1e3 * statistics.median(times), "steps": len(times)},
                "fixed": {"workload": wl.summary(), "completed": fixed["completed"], "failed": fixed["failed"],
                          "output_tok_s": fixed["output_tok_per_s"], "duration_s": fixed["duration_s"]}}
    finally:
        engine.close()


def measure_greedy(device: str, tp: int, models: list[str]) -> dict[str, list[list[int]]]:
    """Greedy tokens of fixed prompts on each tiny model (float32) at `tp` ranks."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 33, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = {}
    for model in models:
        # a fixed small cache: the engine before this one may still hold its memory while this one starts
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy", dtype="float32", device=device,
                                        max_model_len=512, tensor_parallel_size=tp,
                                        cache=CacheConfig(num_blocks=256)))
        try:
            out[model] = [o.token_ids for o in engine.generate(prompts, params)]
        finally:
            engine.close()
            del engine
            free_device_memory()
    return out


# -- the orchestrating process ---------------------------------------------------------------------------------


def child(args: argparse.Namespace, what: str, tp: int) -> Any:
    """Run `--measure what --tp-size tp` in a fresh interpreter; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "tokenmill.benchmarks.gpu_tp", "--measure", what, "--tp-size", str(tp),
               "--result", str(path), "--device", args.device, "--model", args.model,
               "--tiny-models", args.tiny_models]
        subprocess.run(cmd, check=True)
        return json.loads(path.read_text())


def equivalence(tp1: dict[str, list[list[int]]], tpn: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Per model: equal, or the first (prompt, token) where TP = N left TP = 1."""
    out: dict[str, Any] = {}
    for model, ref in tp1.items():
        diffs = [(p, next(i for i, (a, b) in enumerate(zip(x, y)) if a != b))
                 for p, (x, y) in enumerate(zip(ref, tpn[model])) if x != y]
        out[model] = {"equal": not diffs, "first_difference": diffs[0] if diffs else None}
    return out


def table(r: dict[str, Any]) -> str:
    one, many = r["runs"]["1"], r["runs"][str(r["tp"])]
    n = r["tp"]
    rows = [f"| measure | TP = 1 | TP = {n} | ratio |", "|---|---|---|---|",
            f"| start-up | {one['startup_s']:.1f} s | {many['startup_s']:.1f} s | |",
            f"| KV blocks (per rank: its KV heads) | {one['kv_blocks']} | {many['kv_blocks']} | |",
            f"| batch-1 decode, ms per step (p50) | {one['decode_b1']['ms_per_step_p50']:.2f} | "
            f"{many['decode_b1']['ms_per_step_p50']:.2f} | {r['decode_b1_ratio']:.3f} (goal <= 0.6) |"]
    fw = one["fixed"]["workload"]
    rows.append(f"| fixed {fw['input_len']} in / {fw['output_len']} out x {one['fixed']['completed']}: output tok/s | "
                f"{one['fixed']['output_tok_s']:.0f} | {many['fixed']['output_tok_s']:.0f} | "
                f"{many['fixed']['output_tok_s'] / one['fixed']['output_tok_s']:.2f} |")
    for model, eq in r["greedy_equivalence"].items():
        rows.append(f"| greedy TP = {n} vs 1, {model} (float32) | | "
                    f"{'equal' if eq['equal'] else 'differs at ' + str(eq['first_difference'])} | |")
    return "\n".join(rows)


def orchestrate(args: argparse.Namespace) -> None:
    sizes = SMOKE_SIZES if args.device == "cpu" else GPU_SIZES
    runs = {str(tp): child(args, "perf", tp) for tp in (1, args.tp)}
    greedy = {tp: child(args, "greedy", tp) for tp in (1, args.tp)}
    one, many = runs["1"], runs[str(args.tp)]
    results = {"benchmark": "gpu_tp", "model": args.model, "device_kind": args.device, "tp": args.tp,
               "sizes": dataclasses.asdict(sizes), "spec": spec_for(args).describe(), "runs": runs,
               "decode_b1_ratio": many["decode_b1"]["ms_per_step_p50"] / one["decode_b1"]["ms_per_step_p50"],
               "greedy_equivalence": equivalence(greedy[1], greedy[args.tp])}
    name = f"gpu_tp_{args.model}"
    write_results(args.out, name, results, table(results))
    print("summary.json:", summary.record_file(args.out / f"{name}.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", help="dummy shape (default: llama3-8b)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the gloo smoke mode")
    ap.add_argument("--tp", type=int, default=2, help="the tensor-parallel size measured against 1 (default 2)")
    ap.add_argument("--tiny-models", default=",".join(TINY_MODELS), help="models of the greedy equivalence")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/h200-x2"))
    ap.add_argument("--measure", choices=("perf", "greedy"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure is None:
        orchestrate(args)
        return
    if args.measure == "perf":
        sizes = SMOKE_SIZES if args.device == "cpu" else GPU_SIZES
        result: Any = measure_perf(spec_for(args), args.tp_size, sizes)
    else:
        result = measure_greedy(args.device, args.tp_size, args.tiny_models.split(","))
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
