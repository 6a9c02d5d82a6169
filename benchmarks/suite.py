"""The whole benchmark suite for one device, in one command, within a time budget.

    python -m tokenmill.benchmarks.suite --device cpu --out benchmarks/results/cpu/
    python -m tokenmill.benchmarks.suite --device gpu --out benchmarks/results/h200/ --budget-s 450

Sections, in order (each wrapped: a failure is printed and recorded, and the suite goes on):
  workloads   ShareGPT (vLLM sampling), shared-prefix chat, fixed-length random
  hf          Hugging Face generate() with static batches on the ShareGPT requests (first; freed after)
  engine      build the engine; memory: weights, KV blocks and bytes
  sharegpt    offline throughput, all ShareGPT requests at once (GPU: vLLM's CI config, 200 prompts)
  hf_compare  the engine on exactly the requests HF served: the ratio
  prefix      shared-prefix chat with prefix caching off, then on: TTFT gain
  fixed       fixed input/output lengths (GPU: 1000 in / 1000 out, up to 1,000 requests)
  static      the ladder's first step: the engine in static batches on the HF requests
  quantization  the ladder's quantization rung: the continuous-batching step (same requests, prefix caching
              off) on engines quantized on load, INT8 weight-only and (FP8 GPUs) FP8 (the engine is freed first)
  speculative the ladder's speculative-decoding rung: the same with n-gram prompt lookup and EAGLE
  serving     broker + worker + client SDK, Poisson arrivals at several rates (the engine is freed first)
Later sections shrink or are skipped so that the suite ends within --budget-s; time is kept back for
the serving section. Results: suite.json, suite.md and PNGs under --out, rewritten after every section.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenmill.benchmarks import summary
from tokenmill.benchmarks.common import device_info, write_results
from tokenmill.benchmarks.ladder import (
    RUNGS,
    anatomy_table,
    ladder_row,
    ladder_table,
    prefix_gain,
    prefix_rows,
    rung_rows,
    step_anatomy,
)
from tokenmill.benchmarks.serving import ServingConfig, serve_rates, serving_table, timeline_table
from tokenmill.benchmarks.throughput import (
    ModelSpec,
    build_engine,
    drive,
    free_device_memory,
    hf_model,
    hf_static,
    memory_info,
    offline_throughput,
    peak_memory,
    set_prefix_caching,
    workload_tokenizer,
)
from tokenmill.benchmarks.workloads import (
    BenchRequest,
    Workload,
    random_workload,
    shared_prefix_workload,
    sharegpt_workload,
)
from tokenmill.worker.engine import LLMEngine

SECTIONS = ("hf", "engine", "sharegpt", "hf_compare", "prefix", "fixed", "static", "quantization", "speculative",
            "serving")
GIB = float(1 << 30)


@dataclass(frozen=True)
class SuiteConfig:
    spec: ModelSpec
    sharegpt_prompts: int
    sharegpt_max_input: int = 1024
    sharegpt_max_output: int | None = None
    hf_batch: int = 8
    hf_time_s: float = 120.0
    conversations: int = 3
    turns: int = 2
    system_len: int = 1000
    max_turn_len: int = 64
    sessions: int | None = None  # conversations open at once (None: all)
    session_ramp: bool = False  # open them one per engine step (True) or all at the start
    more_system_lens: tuple[int, ...] = ()  # the shared-prefix run again with these system prompt lengths
    step_anatomy: bool = False  # time single steps with and without a cached prompt apart (host vs device)
    fixed_requests: int = 16
    fixed_in: int = 128
    fixed_out: int = 64
    serving_rates: tuple[float, ...] = (0.5, 1.0, math.inf)
    serving_rate_fractions: tuple[float, ...] = ()  # of the offline req/s (used when rates is empty)
    serving_prompts: int = 16
    serving_time_s: float = 60.0  # per rate
    serving_reserve_s: float = 150.0  # budget kept back for the serving section
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 200.0
    budget_s: float = 540.0
    seed: int = 0
    anchors: dict[str, float] = field(default_factory=dict)
    goals: dict[str, float] = field(default_factory=dict)


CPU = SuiteConfig(
    spec=ModelSpec(model="embedded", load_format="auto", dtype="float32", device="cpu", max_num_seqs=64,
                   max_num_batched_tokens=512, max_model_len=4096, cpu_kv_bytes=1 << 30),
    sharegpt_prompts=32, sharegpt_max_input=256, sharegpt_max_output=128, hf_batch=8, hf_time_s=150.0,
    conversations=2, turns=2, max_turn_len=32, fixed_requests=16, fixed_in=128, fixed_out=64,
    serving_rates=(0.5, 1.0, math.inf), serving_prompts=16, serving_time_s=60.0, serving_reserve_s=130.0,
    budget_s=1080.0, goals={"prefix_ttft_ratio": 3.0},
)

GPU = SuiteConfig(
    spec=ModelSpec(model="llama3-8b", load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=256,
                   max_num_batched_tokens=8192, max_model_len=4096, gpu_memory_utilization=0.9),
    sharegpt_prompts=200, hf_batch=64, hf_time_s=75.0,
    conversations=32, turns=4, max_turn_len=128, sessions=16, session_ramp=True, more_system_lens=(2048,),
    step_anatomy=True,
    fixed_requests=1000, fixed_in=1000, fixed_out=1000,
    serving_rates=(), serving_rate_fractions=(0.25, 0.5, 0.75, math.inf), serving_prompts=200,
    serving_time_s=25.0, serving_reserve_s=170.0, ttft_slo_ms=500.0, tpot_slo_ms=50.0, budget_s=450.0,
    anchors={"vllm_sharegpt_requests_per_s": 22.57, "trtllm_fp8_fixed_output_tok_per_s": 17744.0,
             "hf_gpu_md_output_tok_per_s_batch32": 473.0, "hf_gpu_md_output_tok_per_s_batch128": 1666.0},
    goals={"sharegpt_requests_per_s": 15.0, "hf_ratio": 10.0, "prefix_ttft_ratio": 3.0},
)


class Skip(Exception):
    """A section that cannot run (what it needs is missing); recorded as skipped, not as an error."""


class Suite:
    def __init__(self, cfg: SuiteConfig, out: Path, sections: tuple[str, ...]) -> None:
        self.cfg, self.out, self.sections = cfg, out, ("workloads", *sections)
        self.start = time.monotonic()
        self.deadline = self.start + cfg.budget_s
        self.engine: LLMEngine | None = None
        self.current: str | None = None  # the section running
        self.current_start = self.start
        self.workloads: dict[str, Workload] = {}
        self.result: dict[str, Any] = {"command": " ".join(["python -m tokenmill.benchmarks.suite", *sys.argv[1:]]),
                                       "device": device_info(), "model": cfg.spec.describe(),
                                       "config": _plain(asdict(cfg)),
                                       "anchors": cfg.anchors, "goals": cfg.goals, "sections_s": {}}

    def left(self, reserve: float = 0.0) -> float:
        return self.deadline - time.monotonic() - reserve

    def section(self, name: str, fn: Callable[[], dict[str, Any]], reserve: float = 0.0, need: float = 5.0) -> None:
        if name not in self.sections:
            return
        if self.left(reserve) < need:
            self.result[name] = {"skipped": f"time budget ({self.left():.0f} s left, {reserve:.0f} s kept back)"}
            print(f"== {name}: skipped (time budget)", flush=True)
            self.save()
            return
        print(f"== {name} ({self.left():.0f} s of budget left)", flush=True)
        t = self.current_start = time.monotonic()
        self.current = name
        try:
            self.result[name] = fn()
        except Skip as e:
            self.result[name] = {"skipped": str(e)}
            print(f"== {name}: skipped ({e})", flush=True)
        except Exception as e:
            traceback.print_exc()
            self.result[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        self.current = None
        self.result["sections_s"][name] = round(time.monotonic() - t, 1)
        self.save()

    def save(self, plots: bool = False) -> None:
        self.result["elapsed_s"] = round(time.monotonic() - self.start, 1)
        write_results(self.out, "suite", _plain(self.result), suite_markdown(self.result), echo=False)
        if plots:
            self.result["plots"] = make_plots(self.result, self.out)
            write_results(self.out, "suite", _plain(self.result), suite_markdown(self.result))

    # -- sections ----------------------------------------------------------------------------------------
    def build_workloads(self) -> dict[str, Any]:
        c = self.cfg
        tok, vocab, tok_name = workload_tokenizer(c.spec)
        self.workloads["sharegpt"] = sharegpt_workload(tok, c.sharegpt_prompts, c.seed, ids_vocab=vocab,
                                                       max_input_len=c.sharegpt_max_input,
                                                       max_output_len=c.sharegpt_max_output)
        for n in (c.system_len, *c.more_system_lens):
            self.workloads[prefix_key(n, c)] = shared_prefix_workload(tok, c.conversations, c.turns, c.seed,
                                                                      system_len=n, max_turn_len=c.max_turn_len,
                                                                      ids_vocab=vocab)
        fixed_vocab = vocab or tok.vocab_size
        self.workloads["fixed"] = random_workload(c.fixed_requests, c.fixed_in, c.fixed_out, fixed_vocab, c.seed)
        return {"length_tokenizer": tok_name, **{k: w.summary() for k, w in self.workloads.items()}}

    def hf(self) -> dict[str, Any]:
        model = hf_model(self.cfg.spec)
        try:
            limit = min(self.cfg.hf_time_s, self.left(self._serving_reserve() + 120))
            return hf_static(model, self.workloads["sharegpt"], self.cfg.hf_batch, self.cfg.spec.device,
                             time_limit_s=max(limit, 1.0))
        finally:
            del model
            free_device_memory()

    def build(self) -> dict[str, Any]:
        free_device_memory()  # and reset the peak: the HF model was here before
        t = time.monotonic()
        self.engine = build_engine(self.cfg.spec)
        return {"startup_s": time.monotonic() - t, **memory_info(self.engine)}

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("the engine was not built")
        return self.engine

    def sharegpt(self) -> dict[str, Any]:
        set_prefix_caching(self._engine(), False)
        return offline_throughput(self._engine(), self.workloads["sharegpt"], desc="ShareGPT, all at once")

    def hf_served(self) -> Workload | None:
        n = self.result.get("hf", {}).get("requests")
        return self.workloads["sharegpt"].subset(n) if n else None

    def hf_compare(self) -> dict[str, Any]:
        served, hf = self.hf_served(), self.result["hf"]
        if served is None:
            raise Skip("the HF baseline did not run")
        full = self.result.get("sharegpt", {})
        if len(served) == len(self.workloads["sharegpt"]) and "output_tok_per_s" in full:
            mine = full  # HF served every request: the offline run is the same comparison
        else:
            set_prefix_caching(self._engine(), False)
            mine = offline_throughput(self._engine(), served, desc="engine on the HF requests")
        return {"hf": hf, "engine": mine, "ratio_output_tok_s": mine["output_tok_per_s"] / hf["output_tok_per_s"],
                "ratio_requests_s": mine["requests_per_s"] / hf["requests_per_s"]}

    def prefix(self) -> dict[str, Any]:
        """The shared-prefix runs (caching off, then on), first with `system_len`, then with each of
        `more_system_lens` while the budget lasts. `rows`/`gain` are the first one's (the ladder's)."""
        c = self.cfg
        lens = (c.system_len, *c.more_system_lens)
        variants: list[dict[str, Any]] = []
        for k, n in enumerate(lens):
            left = self.left(self._serving_reserve() + 15)
            if k and left < 30:
                variants.append({"system_len": n, "skipped": f"time budget ({left:.0f} s left)"})
                continue
            # The uncached run is the slow one: it may use 60% of this variant's share of what is left.
            deadline = time.monotonic() + 0.6 * left / (len(lens) - k)
            rows = prefix_rows(self._engine(), self.workloads[prefix_key(n, c)], c.sessions, deadline,
                               ramp=c.session_ramp)
            variants.append({"system_len": n, "rows": rows, "gain": prefix_gain(rows)})
        first = variants[0]
        out = {"rows": first["rows"], "gain": first["gain"], "variants": variants}
        if c.step_anatomy and self.left(self._serving_reserve() + 15) > 20:
            new = first["rows"][1].get("uncached_prompt_tokens", {}).get("p50") or c.max_turn_len
            out["anatomy"] = step_anatomy(self._engine(), self.workloads["prefix"], c.sessions or c.conversations,
                                          round(new))
        return out

    def fixed(self) -> dict[str, Any]:
        """Fixed input/output lengths. At most 2 x max_num_seqs requests are handed over and unfinished
        at a time (the engine always has more waiting than it can admit, as when all arrive at once;
        TTFT counts from the hand-over); the next is sent only while it can still finish within the
        budget (at the longest end-to-end time so far), so the run shrinks itself when time is short."""
        wl, eng = self.workloads["fixed"], self._engine()
        set_prefix_caching(eng, False)
        if "output_tok_per_s" not in self.result.get("sharegpt", {}):
            self._warm_prefill(wl)  # a fresh engine: compile the full-budget prefill shapes untimed
        window = 2 * self.cfg.spec.max_num_seqs
        deadline = time.monotonic() + self.left(self._serving_reserve() + 15)
        run = drive(eng, wl, window=window, deadline=deadline, desc=f"fixed {wl.name}")
        n = len(run.sent)  # the first n: a window sends in workload order
        return {"workload": wl.subset(n).summary(), **run.summary(eng.runner.bytes_per_block),
                **peak_memory(eng.runner.device.type), "requests_planned": len(wl), "window": window,
                "shrunk_for_budget": n < len(wl)}

    def _warm_prefill(self, wl: Workload) -> None:
        budget = self.cfg.spec.max_num_batched_tokens
        k = min(len(wl), budget // max(wl.requests[0].prompt_len, 1) + 1)  # more prompt tokens than one step takes
        warm = Workload("warm-up", tuple(BenchRequest(r.prompt_ids, 2) for r in wl.requests[:k]))
        drive(self._engine(), warm, desc="warm-up")

    def static(self) -> dict[str, Any]:
        """Static batches of the HF batch size on the requests HF served (all ShareGPT ones without HF)."""
        served = self.hf_served() or self.workloads["sharegpt"]
        eng = self._engine()
        set_prefix_caching(eng, False)
        deadline = time.monotonic() + self.left(self._serving_reserve() + 10)
        run = drive(eng, served, batch_size=self.cfg.hf_batch, desc=f"static batches of {self.cfg.hf_batch}",
                    deadline=deadline)
        return ladder_row(f"static batching (batches of {self.cfg.hf_batch})", served.subset(len(run.timings)),
                          run, eng) | {"of_requests": len(served)}

    def rung(self, name: str) -> dict[str, Any]:
        """A ladder rung (RUNGS[name]): each variant's engine in turn, on the continuous-batching step's
        requests (those HF served, else all ShareGPT ones), after the suite's engine is freed. A variant
        starts only while the suite engine's start-up, twice the continuous step's run time and 30 s are
        left before serving's reserve."""
        self.engine = None
        free_device_memory()
        served = self.hf_served() or self.workloads["sharegpt"]
        base = self.result.get("hf_compare", {}).get("engine") or self.result.get("sharegpt") or {}
        need = self.result.get("engine", {}).get("startup_s", 30.0) + 2 * base.get("duration_s", 60.0) + 30
        rows = rung_rows(self.cfg.spec, RUNGS[name], served,
                         lambda: self.left(self._serving_reserve() + 10) >= need)
        return {"rows": rows, "requests": len(served)}

    def serving(self) -> dict[str, Any]:
        self.engine = None
        free_device_memory()
        c = self.cfg
        rates = c.serving_rates or self._rates_from_offline()
        hint = self.result.get("sharegpt", {}).get("requests_per_s")
        cfg = ServingConfig(rates, c.serving_prompts, None, c.ttft_slo_ms, c.tpot_slo_ms, c.seed, c.serving_time_s,
                            saturation_hint=hint)
        return serve_rates(c.spec, self.workloads["sharegpt"], cfg, prefix_caching=False, deadline=self.deadline)

    def _serving_reserve(self) -> float:
        """Budget kept back for the serving section: none when it is not among the sections."""
        return self.cfg.serving_reserve_s if "serving" in self.sections else 0.0

    def _rates_from_offline(self) -> tuple[float, ...]:
        r = self.result.get("sharegpt", {}).get("requests_per_s")
        if not r:
            raise RuntimeError("no offline request rate to place the serving rates")
        return tuple(f if math.isinf(f) else round(f * r, 2) for f in self.cfg.serving_rate_fractions)

    def run(self) -> None:
        self.section("workloads", self.build_workloads)
        if "sharegpt" not in self.workloads:
            self.save(plots=False)
            return
        res = self._serving_reserve()
        self.section("hf", self.hf, reserve=res + 120)
        self.section("engine", self.build, reserve=res)
        self.section("sharegpt", self.sharegpt, reserve=res)
        self.section("hf_compare", self.hf_compare, reserve=res)
        self.section("prefix", self.prefix, reserve=res)
        self.section("fixed", self.fixed, reserve=res + 15)
        self.section("static", self.static, reserve=res + 10)
        for name in RUNGS:
            self.section(name, lambda: self.rung(name), reserve=res + 10)  # noqa: B023 (called at once)
        self.set_ladder()
        self.section("serving", self.serving, need=20.0)
        self.save(plots=True)

    def set_ladder(self) -> None:
        self.result["ladder"] = {"rows": ladder_rows(self.result),
                                 "prefix_gain": self.result.get("prefix", {}).get("gain")}

    def interrupted(self, why: str) -> None:
        """Stopped from outside (SIGTERM from `timeout`, Ctrl-C): record it with the section that was
        running, and write what the finished sections measured."""
        self.result["interrupted"] = why
        if self.current:
            self.result[self.current] = {"error": f"interrupted ({why}) after "
                                                  f"{time.monotonic() - self.current_start:.0f} s"}
        self.set_ladder()
        self.save()


def prefix_key(system_len: int, cfg: SuiteConfig) -> str:
    """Workload name of the shared-prefix chat with this system prompt length ("prefix": the main one)."""
    return "prefix" if system_len == cfg.system_len else f"prefix_{system_len}"


def ladder_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Static (HF requests) -> continuous (same requests) -> shared prefix off -> on -> quantization ->
    speculative decoding (a rung whose section did not run: one row saying why)."""
    rows: list[dict[str, Any]] = []
    st = result.get("static", {})
    if "step" in st:
        rows.append(st)
    eng = result.get("hf_compare", {}).get("engine") or result.get("sharegpt")
    if eng and "latency" in eng:
        rows.append(_row_from_offline("continuous batching", eng, result.get("engine", {}).get("weights_bytes", 0)))
    rows += result.get("prefix", {}).get("rows", [])
    for name in RUNGS:
        sec = result.get(name) or {"skipped": "not in this run"}
        why = sec.get("skipped") or sec.get("error")
        rows += sec.get("rows") or [{"step": name, "not_run": why or "no rows"}]
    return rows


def _row_from_offline(step: str, r: dict[str, Any], weights_bytes: int) -> dict[str, Any]:
    return {"step": step, "workload": r["workload"]["name"], "requests": r["completed"],
            "output_tok_per_s": r["output_tok_per_s"], "total_tok_per_s": r["total_tok_per_s"],
            "requests_per_s": r["requests_per_s"], "ttft_ms": r["latency"]["ttft_ms"],
            "tpot_ms": r["latency"]["tpot_ms"], "peak_kv_bytes": r["peak_kv_bytes"],
            "weights_bytes": weights_bytes, "cached_prompt_tokens": r["cached_prompt_tokens"],
            "input_tokens": r["input_tokens"], "preemptions": r["preemptions"], "duration_s": r["duration_s"]}


# -- report ----------------------------------------------------------------------------------------------


def suite_markdown(r: dict[str, Any]) -> str:
    parts = ["## Headline", headline_table(r)]
    eng = r.get("engine", {})
    if "kv_blocks" in eng:
        parts += ["## Memory", memory_table(eng)]
    if r.get("serving", {}).get("rates"):
        s = r["serving"]["config"]
        parts += [f"## Serving (broker + worker + client SDK; SLO: TTFT <= {s['ttft_slo_ms']:.0f} ms, "
                  f"TPOT <= {s['tpot_slo_ms']:.0f} ms)", serving_table(r["serving"]),
                  "", "The slowest first tokens of each rate, taken apart (ms; RequestTiming.timeline):", "",
                  timeline_table(r["serving"])]
    if prefix_variants(r):
        parts += ["## Prefix caching: what TTFT is made of", prefix_table(r)]
    an = r.get("prefix", {}).get("anatomy")
    if an:
        parts += [f"Single steps timed apart (async scheduling off, device synced after each launch; "
                  f"{an['running']} requests decoding, the new one has the {an['system_prompt_tokens']}-token "
                  f"system prompt + {an['new_tokens']} tokens; median of {an['repeats']}):", anatomy_table(an)]
    rows = r.get("ladder", {}).get("rows")
    if rows:
        parts += ["## Optimization ladder", ladder_table(rows)]
    if r.get("merged"):
        parts += ["## Runs merged here", "\n".join(
            f"- `{m['command']}` (commit `{m['commit']}`): {', '.join(m['sections']) or 'nothing kept'}"
            for m in r["merged"])]
    skipped = {k: v.get("skipped") or v.get("error") for k, v in r.items()
               if isinstance(v, dict) and ("skipped" in v or "error" in v)}
    if skipped:
        parts += ["## Not run / failed", "\n".join(f"- {k}: {v}" for k, v in skipped.items())]
    for p in r.get("plots", []):
        parts.append(f"![{Path(p).stem}]({Path(p).name})")
    return "\n\n".join(parts)


def headline_table(r: dict[str, Any]) -> str:
    """One row per headline measure that ran: | measure | tokenmill | baseline / anchor | ratio | goal |."""
    rows = ["| measure | tokenmill | baseline / anchor | ratio | goal |", "|---|---|---|---|---|"]
    for make in (_sharegpt_row, _hf_rows, _fixed_row, _prefix_row):
        rows += make(r, r.get("anchors", {}), r.get("goals", {}))
    return "\n".join(rows)


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _sharegpt_row(r: dict[str, Any], a: dict[str, float], g: dict[str, float]) -> list[str]:
    sg = r.get("sharegpt", {})
    if "requests_per_s" not in sg:
        return []
    anchor = a.get("vllm_sharegpt_requests_per_s")
    return [_row(f"ShareGPT offline, {sg['completed']} prompts: requests/s (output tok/s)",
                 f"{sg['requests_per_s']:.2f} ({sg['output_tok_per_s']:.0f})",
                 f"vLLM on H200: {anchor} (published)" if anchor else "",
                 f"{sg['requests_per_s'] / anchor:.2f}x" if anchor else "",
                 _goal(g, "sharegpt_requests_per_s", ">= {} req/s"))]


def _hf_rows(r: dict[str, Any], a: dict[str, float], g: dict[str, float]) -> list[str]:
    c, sg = r.get("hf_compare", {}), r.get("sharegpt", {})
    if "ratio_output_tok_s" not in c:
        return []
    hf, goal = c["hf"], _goal(g, "hf_ratio", ">= {}x")
    rows = [_row(f"same {hf['requests']} ShareGPT requests: output tok/s vs HF generate() static batch "
                 f"{hf['batch_size']}", f"{c['engine']['output_tok_per_s']:.1f}",
                 f"HF: {hf['output_tok_per_s']:.1f} (measured in this run)", f"{c['ratio_output_tok_s']:.2f}x", goal)]
    if hf["requests"] < hf["of_requests"] and "output_tok_per_s" in sg:
        rows.append(_row(f"ShareGPT output tok/s: tokenmill on all {sg['completed']} requests vs HF on the first "
                         f"{hf['requests']} (its time limit)", f"{sg['output_tok_per_s']:.1f}",
                         f"HF: {hf['output_tok_per_s']:.1f}", f"{sg['output_tok_per_s'] / hf['output_tok_per_s']:.2f}x",
                         goal))
    return rows


def _fixed_row(r: dict[str, Any], a: dict[str, float], g: dict[str, float]) -> list[str]:
    fx = r.get("fixed", {})
    if "output_tok_per_s" not in fx:
        return []
    anchor, wl = a.get("trtllm_fp8_fixed_output_tok_per_s"), fx["workload"]
    shrunk = " (shrunk for time)" if fx.get("shrunk_for_budget") else ""
    return [_row(f"fixed {wl['input_len']} in / {wl['output_len']} out x {fx['completed']}{shrunk}: output tok/s",
                 f"{fx['output_tok_per_s']:.0f}",
                 f"TensorRT-LLM FP8 on H200: {anchor:,.0f} (published)" if anchor else "",
                 f"{fx['output_tok_per_s'] / anchor:.2f}x" if anchor else "", "")]


def prefix_variants(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The shared-prefix runs that have both rows (results written before variants existed: the one)."""
    pg = r.get("prefix", {})
    variants = pg.get("variants") or ([{"rows": pg["rows"], "gain": pg.get("gain", {})}] if "rows" in pg else [])
    return [v for v in variants if len(v.get("rows", [])) == 2]


def prefix_setup(row: dict[str, Any]) -> str:
    """'system prompt 1000 tok, 32 x 4 turns, 16 sessions opened one per step' from a prefix row."""
    parts = []
    if row.get("system_prompt_tokens"):
        parts.append(f"system prompt {row['system_prompt_tokens']} tok")
    if row.get("conversations"):
        parts.append(f"{row['conversations']} conversations x {row['turns']} turns")
    n = row.get("sessions")
    ramp = " (opened one per step)" if row.get("session_ramp") else ""
    parts.append(f"{n} open at once{ramp}" if n else "all open at once")
    return ", ".join(parts)


def _prefix_row(r: dict[str, Any], a: dict[str, float], g: dict[str, float]) -> list[str]:
    out = []
    for v in prefix_variants(r):
        off, on = v["rows"][0]["ttft_ms"], v["rows"][1]["ttft_ms"]
        gain = v.get("gain", {})
        out.append(_row(f"shared-prefix chat ({prefix_setup(v['rows'][1])}): TTFT p50 / p90 (ms), prefix caching "
                        "on vs off", f"{on['p50']:.0f} / {on['p90']:.0f}", f"off: {off['p50']:.0f} / {off['p90']:.0f}",
                        f"{gain.get('ttft_p50_ratio', math.nan):.2f}x / {gain.get('ttft_p90_ratio', math.nan):.2f}x "
                        "lower", _goal(g, "prefix_ttft_ratio", ">= {}x lower")))
    return out


def prefix_table(r: dict[str, Any]) -> str:
    """Per shared-prefix run: TTFT, the engine steps from arrival to first token, and the step times."""
    out = ["| setup | prefix caching | requests | TTFT p50 / p90 (ms) | steps to first token p50 / max | step() ms "
           "p50: decode-only / launching prompt tokens / returning them | prompt tokens per such step (p50) | "
           "uncached prompt tokens per request (p50) | prompt tokens from cache |", "|---" * 9 + "|"]
    notes = [f"- system prompt {v['system_len']} tok: skipped ({v['skipped']})"
             for v in r.get("prefix", {}).get("variants", []) if "skipped" in v]
    for v in prefix_variants(r):
        for row in v["rows"]:
            t, ft, st = row["ttft_ms"], row.get("first_token") or {}, row.get("step_ms") or {}
            steps = ft.get("steps", {})
            share = row["cached_prompt_tokens"] / max(row["input_tokens"], 1)
            on = "on" if row.get("prefix_caching") else "off"
            out.append(f"| {prefix_setup(row)} | {on} | {row['requests']} | {t['p50']:.0f} / {t['p90']:.0f} | "
                       f"{_num(steps.get('p50'))} / {_num(steps.get('max'))} | "
                       f"{_num(st.get('decode_only_ms', {}).get('p50'), '.1f')} / "
                       f"{_num(st.get('launching_prompt_tokens_ms', {}).get('p50'), '.1f')} / "
                       f"{_num(st.get('returning_prompt_tokens_ms', {}).get('p50'), '.1f')} | "
                       f"{_num(st.get('prompt_tokens_per_step', {}).get('p50'))} | "
                       f"{_num(row.get('uncached_prompt_tokens', {}).get('p50'))} | {share:.0%} |")
            ex = ft.get("examples", {}).get("p50")
            if ex:
                calls = "; ".join(f"{c['ms']:.1f} ms (launched {c['launched'][0]} prompt tok + {c['launched'][1]} "
                                  f"decodes, returned {c['completed'][0]} + {c['completed'][1]})" for c in ex["calls"])
                n = len(ex["calls"])
                notes.append(f"- {prefix_setup(row)}, caching {on}: the request at the TTFT p50 rank "
                             f"({ex['ttft_ms']:.0f} ms) got its first token {n} step() call{'s'[:n != 1]} after it "
                             f"arrived: {calls}")
    if not notes:
        return "\n".join(out)
    asy = next((row.get("step_ms", {}).get("async_scheduling") for v in prefix_variants(r) for row in v["rows"]), None)
    head = [] if asy is None else [f"Async scheduling {'on' if asy else 'off'}: a step() call launches one step and "
                                   + ("returns the tokens of the one before." if asy else "returns its tokens.")]
    return "\n\n".join(["\n".join(out), *head, "\n".join(notes)])


def _num(x: Any, fmt: str = ".0f") -> str:
    return "" if x is None else format(x, fmt)


def _goal(goals: dict[str, float], key: str, fmt: str) -> str:
    return fmt.format(f"{goals[key]:g}") if key in goals else ""


def memory_table(e: dict[str, Any]) -> str:
    peak = e.get("peak_device_bytes", e.get("peak_rss_bytes", 0))
    kind = "peak device memory (after start-up)" if "peak_device_bytes" in e else "peak RSS of the process"
    return "\n".join([
        "| weights | KV cache | start-up | " + kind + " |", "|---|---|---|---|",
        f"| {e['weights_bytes'] / GIB:.2f} GiB | {e['kv_blocks']} blocks x {e['block_size']} tokens = "
        f"{e['kv_bytes'] / GIB:.2f} GiB | {e['startup_s']:.1f} s | {peak / GIB:.2f} GiB |"])


def make_plots(result: dict[str, Any], out: Path) -> list[str]:
    try:
        from tokenmill.benchmarks.plots import plot_all

        return [str(p.name) for p in plot_all(_plain(result), out)]
    except ImportError as e:
        print(f"plots skipped ({e}); draw them elsewhere: python -m tokenmill.benchmarks.plots {out}/suite.json")
        return []


def merge_results(results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One suite result from several runs on the same device (e.g. the whole suite, then a second call
    of `--sections engine,fixed` at full size): each section comes from the last run in which it ran
    (neither skipped nor failed; else from the last one that has it). Run-level fields (device, model,
    config, anchors, goals) are the first run's; `merged` says which run each section came from."""
    gpus = {r.get("device", {}).get("gpu") for r in results}
    if len(gpus) > 1:
        raise SystemExit(f"these results come from different devices: {sorted(map(str, gpus))}")
    merged = dict(results[0])
    merged["sections_s"] = {}
    sources: dict[str, int] = {}
    workloads: dict[str, Any] = {}
    for k, r in enumerate(results):
        for name in SECTIONS:
            sec = r.get(name)
            if not isinstance(sec, dict):
                continue
            ran = "skipped" not in sec and "error" not in sec
            if ran or name not in sources:
                merged[name] = sec
                sources[name] = k
                if name in r.get("sections_s", {}):
                    merged["sections_s"][name] = r["sections_s"][name]
        w = r.get("workloads") or {}
        if "error" not in w and "skipped" not in w:
            workloads |= w  # the workload summaries of every run (seeded: the same workloads)
    merged["workloads"] = workloads
    merged.pop("interrupted", None)
    merged["merged"] = [{"file": n, "command": r.get("command"), "commit": r.get("commit"),
                         "measured": r.get("measured"), "elapsed_s": r.get("elapsed_s"),
                         "interrupted": r.get("interrupted"),
                         "sections": [s for s, k in sources.items() if k == i]}
                        for i, (n, r) in enumerate(zip(names, results))]
    merged["ladder"] = {"rows": ladder_rows(merged), "prefix_gain": merged.get("prefix", {}).get("gain")}
    return merged


def merge_files(paths: list[Path], out: Path) -> dict[str, Any]:
    """`merge_results` of suite JSONs, written as suite.json / suite.md (+ PNGs when matplotlib is here)."""
    merged = merge_results([json.loads(p.read_text()) for p in paths], [str(p) for p in paths])
    merged.pop("plots", None)
    write_results(out, "suite", _plain(merged), suite_markdown(merged), echo=False, stamp=False)
    merged["plots"] = make_plots(merged, out)
    write_results(out, "suite", _plain(merged), suite_markdown(merged), stamp=False)
    return merged


def _plain(x: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None (inf rates are written as "inf" by their owners), tuples -> lists."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x == math.inf else None
    return x


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: gpu where CUDA is available, else cpu")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<cpu|h200>/")
    ap.add_argument("--budget-s", type=float, default=None, help="end within this many seconds (default: per device)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    ap.add_argument("--model", default=None, help="override the model (a dummy shape needs --load-format dummy)")
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--sharegpt-prompts", type=int, default=None)
    ap.add_argument("--fixed-requests", type=int, default=None)
    ap.add_argument("--hf-batch", type=int, default=None, help="HF generate() static batch size")
    ap.add_argument("--hf-time-s", type=float, default=None, help="time limit of the HF baseline")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engine's max_num_seqs (default: per device; the fixed run hands over twice as many)")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"], help="the engine's KV cache dtype")
    ap.add_argument("--whole-step-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.whole_step_graphs: mixed steps replay one whole-step CUDA graph where captured "
                         "(default: the engine's, on)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: merge these suite JSONs (later runs' sections win) into --out "
                         "(default: the first one's folder)")
    return ap


def suite_device(choice: str) -> str:
    """cpu or gpu: `choice`, or for auto the engine's own choice (gpu where CUDA is available)."""
    if choice != "auto":
        return choice
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def config_from_args(args: argparse.Namespace) -> SuiteConfig:
    args.device = suite_device(args.device)
    cfg = GPU if args.device == "gpu" else CPU
    spec = cfg.spec
    if args.model:
        spec = replace(spec, model=args.model, load_format=args.load_format or spec.load_format)
    if args.threads:
        spec = replace(spec, threads=args.threads)
    if args.max_num_seqs:
        spec = replace(spec, max_num_seqs=args.max_num_seqs)
    if args.kv_cache_dtype:
        spec = replace(spec, kv_cache_dtype=args.kv_cache_dtype)
    if args.whole_step_graphs is not None:
        spec = replace(spec, whole_step_graphs=args.whole_step_graphs)
    over: dict[str, Any] = {"spec": spec}
    for name in ("budget_s", "sharegpt_prompts", "fixed_requests", "hf_batch", "hf_time_s"):
        if getattr(args, name) is not None:
            over[name] = getattr(args, name)
    return replace(cfg, **over)


def run_cli(args: argparse.Namespace) -> int:
    if args.merge:
        out = args.out or args.merge[0].parent
        merge_files(args.merge, out)
        print(f"merged {len(args.merge)} results into {out}/suite.json")
        _record_headline(out / "suite.json")
        return 0
    cfg = config_from_args(args)
    out = args.out or Path("benchmarks/results") / ("h200" if args.device == "gpu" else "cpu")
    print(f"bench suite: {cfg.spec.model} on {cfg.spec.device}, {cfg.spec.dtype} (--device {args.device}); "
          f"results to {out}", flush=True)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}")
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the serving processes are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    suite = Suite(cfg, out, sections)
    try:
        suite.run()
    except BaseException as e:  # SystemExit(143) from SIGTERM, KeyboardInterrupt
        suite.interrupted(f"{type(e).__name__}({e})")
        raise
    print(f"suite finished in {time.monotonic() - suite.start:.0f} s; results in {out}/", flush=True)
    if not args.model:  # the keys are defined on the device's own model
        _record_headline(out / "suite.json")
    return 0


def _record_headline(path: Path) -> None:
    try:
        print("summary.json:", summary.record_file(path), flush=True)
    except ValueError as e:  # e.g. merged runs from before results carried a date
        print(f"summary.json not updated ({e}); python -m tokenmill.benchmarks.summary {path} --date ...")


def main() -> None:
    raise SystemExit(run_cli(build_parser().parse_args()))


if __name__ == "__main__":
    main()
