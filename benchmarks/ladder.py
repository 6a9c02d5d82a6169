"""The optimization ladder as one report: each step's tokens/s, TTFT, TPOT and memory side by side.

1. static batching: our engine driven in fixed batches (admit B requests, run all to completion, then
   the next B), prefix caching off, ShareGPT;
2. continuous batching: the same requests all at once, prefix caching off;
3. the shared-prefix chat workload (~1,000-token system prompt, multi-turn), prefix caching off, then on
   (the TTFT gain of prefix caching); the system prompt has been served once before each run;
4. quantization: the continuous-batching step (same requests, prefix caching off) on an engine whose
   decoder-layer weights are quantized on load: INT8 weight-only (W8A16, per output channel; it runs on
   the CPU and on CUDA) and, on a GPU with FP8 (compute capability >= 8.9), FP8 W8A8 with the FP8 KV cache;
   beside each, its accuracy against the unquantized model (perplexity change, mean KL and greedy agreement
   on held-out ShareGPT replies, quant_accuracy's measure; real weights only, FP8 emulated on the CPU);
5. speculative decoding: the same again with n-gram prompt lookup and with EAGLE (the head shipped for
   the model; none for other models), k = 3 drafts per step, the automatic switch as the engine sets it
   (on for CUDA, off on the CPU).
A variant that cannot run for the model or device is a row that says why, without numbers.

Latencies are measured from the moment a request is handed to the engine (static batching: all arrive
at the start, so later batches wait: that wait is in their TTFT). Memory: the KV cache actually in use
at the peak of the run (blocks x bytes per block) on top of the weights (with EAGLE: the target's and the
draft head's own).

    python -m tokenmill.benchmarks.ladder --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.common import dist, write_results
from tokenmill.benchmarks.throughput import (
    EngineRun,
    ModelSpec,
    StepTrace,
    _sync,
    add_model_args,
    build_engine,
    drive,
    free_device_memory,
    memory_info,
    observing,
    set_prefix_caching,
    spec_from_args,
    where_it_runs,
    workload_tokenizer,
)
from tokenmill.benchmarks.workloads import BenchRequest, Workload, shared_prefix_workload, sharegpt_workload
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import SpeculativeConfig
from tokenmill.worker.engine import LLMEngine, StepRecord


@dataclass(frozen=True)
class Variant:
    """One row of the quantization or speculative-decoding rung: the continuous-batching step on an engine
    built with these ModelSpec fields changed."""

    key: str  # short name: int8, fp8, ngram, eagle
    step: str  # the row's label
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    speculative: str = "off"

    def spec(self, base: ModelSpec) -> ModelSpec:
        return replace(base, quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                       speculative=self.speculative)

    @property
    def quantized(self) -> bool:
        """Whether the variant changes what the model computes (weights or KV cache rounded)."""
        return self.quantization != "auto" or self.kv_cache_dtype != "auto"


QUANT_VARIANTS = (
    Variant("int8", "quantization: INT8 weight-only (W8A16, per output channel)", quantization="int8"),
    Variant("fp8", "quantization: FP8 W8A8 weights + FP8 KV cache (e4m3)", quantization="fp8",
            kv_cache_dtype="fp8"),
)
_K = SpeculativeConfig().num_speculative_tokens  # what ModelSpec.speculative builds
SPEC_VARIANTS = (
    Variant("ngram", f"speculative decoding: n-gram prompt lookup (k = {_K})", speculative="ngram"),
    Variant("eagle", f"speculative decoding: EAGLE, the shipped head (k = {_K})", speculative="eagle"),
)
RUNGS = {"quantization": QUANT_VARIANTS, "speculative": SPEC_VARIANTS}  # suite section -> its rows
ACCURACY_REPLIES = 32  # held-out ShareGPT exchanges the quantization rung's accuracy is measured on


def why_not(variant: Variant, spec: ModelSpec) -> str | None:
    """Why `variant` cannot run for the spec's model and device (a short phrase), or None if it can."""
    if variant.kv_cache_dtype == "fp8" or variant.quantization == "fp8":
        import torch

        from tokenmill.worker.quant.fp8 import fp8_supported

        if not spec.device.startswith("cuda") or not fp8_supported(torch.device(spec.device)):
            return "needs a GPU with FP8 (compute capability >= 8.9)"
    if variant.speculative == "eagle":
        from tokenmill.worker.loader import resolve_model
        from tokenmill.worker.spec.eagle import EagleHeadError, head_folder

        name = resolve_model(spec.model, spec.load_format).name  # type: ignore[arg-type]
        try:
            head_folder(None, name)
        except EagleHeadError:
            return f"no EAGLE head shipped for {name}"
    return None


def variant_row(base: ModelSpec, variant: Variant, workload: Workload) -> dict[str, Any]:
    """The continuous-batching step (all requests at once, prefix caching off) on a fresh engine built for
    `variant`, freed afterwards; or the row saying why it cannot run."""
    reason = why_not(variant, base)
    if reason is not None:
        return {"step": variant.step, "variant": variant.key, "not_run": reason}
    engine = build_engine(variant.spec(base), prefix_caching=False)
    try:
        c0 = replace(engine.counters)
        run = drive(engine, workload, desc=variant.step)
        step = variant.step
        if variant.speculative != "off":
            step += f", automatic switch {'on' if engine.switch is not None else 'off'}"
        row = ladder_row(step, workload, run, engine)
        drafted = engine.counters.draft_tokens - c0.draft_tokens
        accepted = engine.counters.accepted_draft_tokens - c0.accepted_draft_tokens
        row |= {"variant": variant.key, "quantization": variant.quantization,
                "kv_cache_dtype": variant.kv_cache_dtype, "speculative": variant.speculative,
                "draft_weights_bytes": memory_info(engine)["draft_weights_bytes"]}
        if variant.speculative != "off":
            row |= {"auto_switch": engine.switch is not None, "draft_tokens": drafted,
                    "accepted_draft_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0}
        return row
    finally:
        del engine
        free_device_memory()


def rung_rows(base: ModelSpec, variants: tuple[Variant, ...], workload: Workload,
              enough_time: Callable[[], bool] = lambda: True,
              accuracy_replies: int = ACCURACY_REPLIES) -> list[dict[str, Any]]:
    """A row per variant; one that would not start in time (`enough_time()` False) says so, one that failed
    records its error (and the next one runs). Quantized variants also get their accuracy (add_accuracy)."""
    rows = []
    for v in variants:
        if not enough_time():
            rows.append({"step": v.step, "variant": v.key, "not_run": "time budget"})
            continue
        try:
            rows.append(variant_row(base, v, workload))
        except Exception as e:
            traceback.print_exc()
            rows.append({"step": v.step, "variant": v.key, "error": f"{type(e).__name__}: {e}"[:300]})
    if any(v.quantized for v in variants) and accuracy_replies > 0 and enough_time():
        add_accuracy(rows, variants, base, accuracy_replies)
    return rows


def add_accuracy(rows: list[dict[str, Any]], variants: tuple[Variant, ...], base: ModelSpec, replies: int) -> None:
    """Give each quantized variant's row `accuracy`: its perplexity change, mean KL and greedy agreement
    against the unquantized model on `replies` held-out ShareGPT exchanges (quant_accuracy's measure, on the
    CPU in float32, FP8 emulated; the device's kernels round the same way). Dummy weights have no accuracy
    to measure: the rows say so. Rows whose engine could not run (FP8 on the CPU) still get it."""
    quantized = {v.key: v for v in variants if v.quantized}
    if base.dummy:
        accuracy: dict[str, dict[str, Any]] = {k: {"not_measured": "dummy weights"} for k in quantized}
    else:
        from tokenmill.benchmarks.quant_accuracy import variant_accuracy

        wanted = {k: (v.quantization, v.kv_cache_dtype == "fp8") for k, v in quantized.items()}
        try:
            accuracy = {k: r | {"replies": replies} for k, r in
                        variant_accuracy(base.model, wanted, replies).items()}
        except Exception as e:
            traceback.print_exc()
            accuracy = {k: {"not_measured": f"{type(e).__name__}: {e}"[:200]} for k in quantized}
    for row in rows:
        if row["variant"] in accuracy:
            row["accuracy"] = accuracy[row["variant"]]


def ladder_row(step: str, workload: Workload, run: EngineRun, engine: LLMEngine) -> dict[str, Any]:
    s = run.summary(engine.runner.bytes_per_block)
    lat = s["latency"]
    return {"step": step, "workload": workload.name, "requests": s["completed"],
            "output_tok_per_s": s["output_tok_per_s"], "total_tok_per_s": s["total_tok_per_s"],
            "requests_per_s": s["requests_per_s"], "ttft_ms": lat["ttft_ms"], "tpot_ms": lat["tpot_ms"],
            "peak_kv_bytes": s["peak_kv_bytes"], "weights_bytes": memory_info(engine)["weights_bytes"],
            "cached_prompt_tokens": s["cached_prompt_tokens"], "input_tokens": s["input_tokens"],
            "preemptions": s["preemptions"], "duration_s": s["duration_s"],
            "first_token": s.get("first_token", {}), "step_ms": s.get("step_ms", {})}


def static_row(engine: LLMEngine, workload: Workload, batch: int) -> dict[str, Any]:
    set_prefix_caching(engine, False)
    run = drive(engine, workload, batch_size=batch, desc=f"static batches of {batch}")
    return ladder_row(f"static batching (batches of {batch})", workload, run, engine)


def continuous_row(engine: LLMEngine, workload: Workload) -> dict[str, Any]:
    set_prefix_caching(engine, False)
    run = drive(engine, workload, desc="continuous batching")
    return ladder_row("continuous batching", workload, run, engine)


def common_prefix(workload: Workload) -> tuple[int, ...]:
    """The longest prompt prefix every request of `workload` shares (the system prompt)."""
    prompts = [r.prompt_ids for r in workload.requests]
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return prompts[0][:i]
    return prompts[0][:n]


def prefix_rows(engine: LLMEngine, workload: Workload, sessions: int | None,
                deadline: float | None = None, *, ramp: bool = False) -> list[dict[str, Any]]:
    """The shared-prefix workload with prefix caching off, then on (same requests, same order). Before
    the cached run one request of the bare system prompt goes through, as on a server that has served it
    before (with caching off that would leave nothing behind, so it is skipped there). `sessions`
    conversations are open at once (None: all), opened together or, with `ramp`, one per engine step.
    Past `deadline` (time.monotonic) the uncached run sends no new turn, and the cached run gets the
    requests it sent. Each row records the steps from arrival to first token and the step times
    (`drive`'s StepTrace), so what TTFT is made of can be read from the JSON."""
    rows = []
    system = common_prefix(workload)
    warm = Workload("system prompt", (BenchRequest(system, 1),))
    for on in (False, True):
        set_prefix_caching(engine, on)
        if on:
            drive(engine, warm, desc="system prompt")
        run = drive(engine, workload, sessions=sessions, ramp=ramp,
                    desc=f"shared prefix, caching {'on' if on else 'off'}", deadline=None if on else deadline)
        if len(run.sent) < len(workload):
            workload = Workload(workload.name, tuple(workload.requests[i] for i in run.sent),
                                {**workload.params, "subset_of": len(workload)})
        label = "continuous batching + prefix caching" if on else "continuous batching, prefix caching off"
        uncached = [t.prompt_len - t.cached_tokens for t in run.timings if t.ok]
        rows.append(ladder_row(label, workload, run, engine) | {
            "prefix_caching": on, "sessions": sessions, "session_ramp": ramp,
            "of_requests": workload.params.get("subset_of"), "system_prompt_tokens": len(system),
            "conversations": workload.params.get("conversations"), "turns": workload.params.get("turns"),
            "max_turn_len": workload.params.get("max_turn_len"),
            "uncached_prompt_tokens": dist([float(u) for u in uncached], 1.0)})
    set_prefix_caching(engine, True)
    return rows


def step_anatomy(engine: LLMEngine, workload: Workload, running: int, new_tokens: int, repeats: int = 3,
                 ) -> dict[str, Any]:
    """Single steps timed apart, with async scheduling off for the measurement and a device sync after
    each launch: `host_ms` is the time the host takes to launch the step (schedule excluded), `device_ms`
    what the device still needs after that, `step_ms` the whole step() call. Three kinds of step, each
    beside `running` requests that decode (the shared-prefix workload's prompts, cache on):
    decode-only; plus one new request of the system prompt (cached) + `new_tokens` new tokens; plus one
    of the same length that shares nothing (what prefix caching saves). On CPU the launch computes the
    step, so host_ms is all of it."""
    assert not engine.has_unfinished_requests()
    system = common_prefix(workload)
    vocab = engine.runner.arch.vocab_size
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(260, vocab) for _ in range(n)]

    sessions = {r.session: r for r in workload.requests if r.turn == 0}
    background = [list(r.prompt_ids) for r in list(sessions.values())[:running]]
    longest = max(len(p) for p in background) + 1
    decode = SamplingParams(temperature=0.0, max_tokens=max(1, engine.max_model_len - longest), ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    records: list[tuple[float, float]] = []
    was_async = engine.async_scheduling
    engine.async_scheduling = False
    set_prefix_caching(engine, True)
    runner = engine.runner
    trace = StepTrace(async_scheduling=False)

    def timed(record: StepRecord) -> None:  # the launch's host time, then a device sync: its device time
        trace.on_step(record)
        t1 = time.perf_counter()
        _sync(runner.device.type)
        records.append((record.launch_s, time.perf_counter() - t1))

    kinds: dict[str, list[dict[str, float]]] = {"decode-only": [], "new request, system prompt cached": [],
                                                 "new request, nothing cached": []}
    try:
        engine.generate([list(system)], one)  # the system prompt is in the cache, as on a warm server
        for k, p in enumerate(background):
            engine.add_request(f"anatomy-bg{k}", prompt_token_ids=p, params=decode)
        while _prefilling(engine):
            engine.step()  # the background prefills (not measured)
        with observing(engine, timed):
            for rep in range(repeats):
                for kind, prompt in (("decode-only", None), ("new request, system prompt cached",
                                                             [*system, *fresh(new_tokens)]),
                                     ("new request, nothing cached", fresh(len(system) + new_tokens))):
                    if prompt is not None:
                        engine.add_request(f"anatomy-{rep}-{len(kinds[kind])}-{kind[:12]}", prompt_token_ids=prompt,
                                           params=one)
                    t = time.perf_counter()
                    engine.step()
                    trace.on_call(time.perf_counter() - t)
                    host, dev = records[-1]
                    prompt_tokens, decodes = trace.launched[-1]
                    kinds[kind].append({"host_ms": host * 1e3, "device_ms": dev * 1e3, "step_ms": trace.wall[-1] * 1e3,
                                        "prompt_tokens": prompt_tokens, "decodes": decodes})
                    while _prefilling(engine):  # what a small token budget left of the prompt (not measured)
                        engine.step()
    finally:
        for rid in [r.request_id for r in (*engine.scheduler.running, *engine.scheduler.waiting)]:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        engine.async_scheduling = was_async
        set_prefix_caching(engine, True)
    return {"running": len(background), "new_tokens": new_tokens, "system_prompt_tokens": len(system),
            "repeats": repeats, "device": runner.device.type,
            "kinds": {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in kinds.items() if v}}


def _prefilling(engine: LLMEngine) -> bool:
    s = engine.scheduler
    return bool(s.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running)


def anatomy_table(a: dict[str, Any]) -> str:
    out = ["| step | decodes | prompt tokens | host: launch ms | device: after launch ms | step() ms |",
           "|---|---|---|---|---|---|"]
    for kind, m in a["kinds"].items():
        out.append(f"| {kind} | {m['decodes']:.0f} | {m['prompt_tokens']:.0f} | {m['host_ms']:.1f} | "
                   f"{m['device_ms']:.1f} | {m['step_ms']:.1f} |")
    return "\n".join(out)


def prefix_gain(rows: list[dict[str, Any]]) -> dict[str, float]:
    """How much lower TTFT is with prefix caching (off / on) at p50, p90 and the mean."""
    off, on = rows[0]["ttft_ms"], rows[1]["ttft_ms"]
    return {f"ttft_{k}_ratio": off[k] / on[k] for k in ("p50", "p90", "mean") if on[k] > 0}


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB" if x < 2**30 else f"{x / 2**30:.2f} GiB"


def accuracy_cell(row: dict[str, Any]) -> str:
    """The ladder's accuracy column: perplexity change (mean KL, greedy agreement) against the unquantized
    model, or why it was not measured; empty for rows that do not quantize."""
    a = row.get("accuracy")
    if a is None:
        return ""
    if "not_measured" in a:
        return f"not measured: {a['not_measured']}"
    return (f"ppl {a['ppl_delta_pct']:+.2f}% (KL {a['mean_kl']:.4f}, {a['greedy_agreement']:.0%} greedy agree, "
            f"{a['replies']} replies)")


def ladder_table(rows: list[dict[str, Any]]) -> str:
    out = ["| step | workload | requests | output tok/s | TTFT p50 / p90 (ms) | TPOT p50 (ms) | "
           "peak KV in use | weights | prompt tokens from cache | accuracy vs unquantized |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = accuracy_cell(r)
        if "not_run" in r:
            out.append(f"| {r['step']} | not run: {r['not_run']} | | | | | | | | {acc} |")
            continue
        if "error" in r:
            out.append(f"| {r['step']} | failed: {r['error']} | | | | | | | | {acc} |")
            continue
        t, p = r["ttft_ms"], r["tpot_ms"]
        share = r["cached_prompt_tokens"] / max(r["input_tokens"], 1)
        out.append(f"| {r['step']} | {r['workload']} | {r['requests']} | {r['output_tok_per_s']:.1f} | "
                   f"{t['p50']:.0f} / {t['p90']:.0f} | {p['p50']:.1f} | {_mb(r['peak_kv_bytes'])} | "
                   f"{_mb(r['weights_bytes'])} | {share:.0%} | {acc} |")
    return "\n".join(out)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--static-batch", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--max-turn-len", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=None, help="conversations open at once (default: all)")
    ap.add_argument("--session-ramp", action="store_true", help="open the sessions one per engine step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accuracy-replies", type=int, default=ACCURACY_REPLIES,
                    help="held-out ShareGPT exchanges for the quantization rung's accuracy (0: not measured)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    return ap


def run_cli(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    print(f"bench ladder: {where_it_runs(spec)}, in this process", flush=True)
    tok, vocab, _ = workload_tokenizer(spec)
    sg = sharegpt_workload(tok, args.num_prompts, args.seed, ids_vocab=vocab, max_input_len=args.max_input_len,
                           max_output_len=args.max_output_len)
    sp = shared_prefix_workload(tok, args.conversations, args.turns, args.seed, system_len=args.system_len,
                                max_turn_len=args.max_turn_len, ids_vocab=vocab)
    engine = build_engine(spec)
    rows = [static_row(engine, sg, args.static_batch), continuous_row(engine, sg)]
    pre = prefix_rows(engine, sp, args.sessions, ramp=args.session_ramp)
    rows += pre
    del engine
    free_device_memory()  # each variant builds its own engine
    for variants in RUNGS.values():
        rows += rung_rows(spec, variants, sg, accuracy_replies=args.accuracy_replies)
    write_results(args.out, "ladder", {"model": spec.describe(), "rows": rows, "prefix_gain": prefix_gain(pre)},
                  ladder_table(rows))
    return 0


def main() -> None:
    raise SystemExit(run_cli(build_parser().parse_args()))


if __name__ == "__main__":
    main()
