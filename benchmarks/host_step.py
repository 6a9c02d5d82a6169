"""Host time of launching one engine step on the CPU, phase by phase, with the model's math taken out.

The step anatomy of benchmarks/ladder.py (16 requests decoding; one new request whose 1,000-token system
prompt is cached, plus 136 new tokens; one of the same length that shares nothing) on a dummy model, the
forward replaced by a stub that returns zeros: what is left of `ModelRunner.launch` is host work that runs the
same on the GPU (input preparation, `ship`, sampling metadata, the sampler's ops, the output copy). Each phase is
timed by wrapping the runner's method of that name; `launch` is the StepRecord's launch_s (the whole call) and
`rest` what the phases do not cover. Medians over --repeats steps of each kind, in microseconds.

Only APIs that older commits share are used, so the same script measures another checkout:

    python -m tokenmill.benchmarks.host_step --repeats 200
    PYTHONPATH=/tmp/old/pkg python benchmarks/host_step.py --repeats 200    # a package dir of another tree
    python -m tokenmill.benchmarks.host_step --profile "new request, system prompt cached"

On the CPU this leaves out the GPU's part of the host path: the graph replays, the attention launches between
the piecewise graph pieces, pinned allocations and the host-to-device copy itself. With --device cuda (the suite's
dummy Llama-3-8B, bf16) the forward is real and the device is synced after each launch, outside the timed part,
so `_forward` is the host time of the replays and attention launches. Two commits on one GPU in one call:

    AB_SECTIONS= AB_TESTS= AB_CMD="python3 $PWD/benchmarks/host_step.py --device cuda --repeats 30" \
        bash benchmarks/gpu_ab.sh      # .cache/before.tar = git archive of the baseline
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tokenmill.worker.model_runner as model_runner
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine, StepRecord

KINDS = ("decode-only", "new request, system prompt cached", "new request, nothing cached")
RUNNER_PHASES = ("_host_inputs", "_host_sampling", "_device_inputs", "_forward", "_device_sampling")
MODULE_PHASES = ("ship", "HostCopy")  # names model_runner imported: patched in its namespace


class PhaseClock:
    """Seconds spent in each wrapped callable during the current step (`take` returns and resets them)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return spent


class _TimedSampler:
    def __init__(self, sampler: Any, clock: PhaseClock) -> None:
        self._sampler = sampler
        self._call = clock.wrap("sampler", sampler.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


def instrument(engine: LLMEngine, clock: PhaseClock, stub_forward: bool) -> None:
    """Wrap the runner's per-step phases in `clock`; with `stub_forward` the forward returns zeros [T, H]."""
    runner = engine.runner
    if stub_forward:
        hidden = torch.zeros((8192, runner.arch.hidden_size), dtype=runner.dtype)

        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
            return hidden[: ids.shape[0]]

        runner._forward = forward  # type: ignore[method-assign]
    for name in RUNNER_PHASES:
        if hasattr(runner, name):
            setattr(runner, name, clock.wrap(name, getattr(runner, name)))
    for name in MODULE_PHASES:
        setattr(model_runner, name, clock.wrap(name, getattr(model_runner, name)))
    runner.model.compute_logits = clock.wrap("compute_logits", runner.model.compute_logits)  # type: ignore[method-assign]
    runner.sampler = _TimedSampler(runner.sampler, clock)  # type: ignore[assignment]


def build_engine(model: str, device: str, whole_step_graphs: bool | None = None) -> LLMEngine:
    """The suite's GPU engine settings (benchmarks/suite.py GPU) on CUDA; a small CPU cache otherwise.
    `whole_step_graphs` (CUDA): EngineConfig.whole_step_graphs, None for the engine's default (a field older
    commits do not have: only passed when given)."""
    if device == "cuda":
        extra = {} if whole_step_graphs is None else {"whole_step_graphs": whole_step_graphs}
        return LLMEngine(EngineConfig(
            model=model, load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=4096,
            async_scheduling=False, cache=CacheConfig(gpu_memory_utilization=0.9),
            scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256), **extra))
    return LLMEngine(EngineConfig(
        model=model, load_format="dummy", device="cpu", dtype="float32", max_model_len=4096,
        attention_backend="torch", async_scheduling=False,
        cache=CacheConfig(num_blocks=4096), scheduler=SchedulerConfig(max_num_batched_tokens=8192)))


def measure(engine: LLMEngine, clock: PhaseClock, repeats: int, running: int, system_len: int, new_tokens: int,
            profile_kind: str | None) -> tuple[dict[str, dict[str, float]], pstats.Stats | None]:
    """Median microseconds per phase of each kind of step (KINDS), and the profile of `profile_kind`'s steps."""
    vocab = engine.runner.arch.vocab_size
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = fresh(system_len)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - system_len - 200, ignore_eos=True)
    engine.generate([list(system)], one)
    for k in range(running):
        engine.add_request(f"bg{k}", prompt_token_ids=[*system, *fresh(rng.randrange(20, 120))], params=decode)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    launches: list[float] = []
    cuda = engine.runner.device.type == "cuda"

    def observe(record: StepRecord) -> None:  # launch_s, then the device synced (outside the timed launch)
        launches.append(record.launch_s)
        if cuda:
            torch.cuda.synchronize()

    engine.step_observer = observe
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    profiler = cProfile.Profile() if profile_kind else None
    for rep in range(repeats):
        for kind in KINDS:
            if kind == KINDS[1]:
                engine.add_request(f"new{rep}c", prompt_token_ids=[*system, *fresh(new_tokens)], params=one)
            elif kind == KINDS[2]:
                engine.add_request(f"new{rep}u", prompt_token_ids=fresh(system_len + new_tokens), params=one)
            clock.take()
            engine.step()
            phases = clock.take()
            phases["launch"] = launches[-1]
            phases["rest"] = launches[-1] - sum(v for k, v in phases.items() if k != "launch")
            samples[kind].append(phases)
    if profiler is not None:  # extra steps of that kind, after the timed ones: the medians stay unprofiled
        for rep in range(repeats):
            if profile_kind != KINDS[0]:
                prompt = [*system, *fresh(new_tokens)] if profile_kind == KINDS[1] else fresh(system_len + new_tokens)
                engine.add_request(f"prof{rep}", prompt_token_ids=prompt, params=one)
            profiler.enable()
            engine.step()
            profiler.disable()
    engine.step_observer = None
    medians = {kind: {name: statistics.median(s.get(name, 0.0) for s in rows) * 1e6
                      for name in sorted({n for s in rows for n in s})} for kind, rows in samples.items()}
    return medians, (pstats.Stats(profiler) if profiler is not None else None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", help="dummy shape name (worker/loader/dummy.py); default tiny-llama on the CPU, "
                    "llama3-8b on CUDA")
    ap.add_argument("--repeats", type=int, default=100, help="steps of each kind")
    ap.add_argument("--running", type=int, default=16, help="requests decoding beside the new one")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=136)
    ap.add_argument("--real-forward", action="store_true",
                    help="keep the model's forward (always on CUDA: graph replays and attention launches are timed)")
    ap.add_argument("--whole-step-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="CUDA: mixed steps replay whole-step graphs where one was captured (EngineConfig; default: "
                         "the engine's, on; --no-whole-step-graphs: the pieces)")
    ap.add_argument("--profile", choices=KINDS,
                    help="cProfile --repeats more steps of that kind (after the timed ones); print the top functions")
    ap.add_argument("--out", help="folder for host_step.json (the medians and the settings)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = args.model or ("llama3-8b" if args.device == "cuda" else "tiny-llama")
    t0 = time.perf_counter()
    engine = build_engine(model, args.device, args.whole_step_graphs)
    print(f"engine start-up: {time.perf_counter() - t0:.1f} s")
    clock = PhaseClock()
    stub = not args.real_forward and args.device == "cpu"
    instrument(engine, clock, stub_forward=stub)
    medians, stats = measure(engine, clock, args.repeats, args.running, args.system_tokens, args.new_tokens,
                             args.profile)
    names = sorted({n for m in medians.values() for n in m}, key=lambda n: (n in ("rest", "launch"), n))
    print(f"{'phase (us, median)':<20}" + "".join(f"{k[:26]:>28}" for k in KINDS))
    for name in names:
        print(f"{name:<20}" + "".join(f"{medians[k].get(name, 0.0):>28.1f}" for k in KINDS))
    whole = getattr(engine.runner, "whole_step", None)
    if whole is not None:
        print(f"whole-step graphs: {len(whole.graphs)} captured, {whole.replays} steps replayed one")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        settings = vars(args) | {"model": model, "stub_forward": stub}
        result: dict[str, Any] = {"settings": settings, "median_us": medians}
        if whole is not None:
            result["whole_step"] = {"graphs": len(whole.graphs), "replays": whole.replays}
        (Path(args.out) / "host_step.json").write_text(json.dumps(result, indent=1))
    if stats is not None:
        stats.sort_stats("cumulative").print_stats(35)
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
