"""Disaggregated prefill and decode against two aggregated workers on ONE GPU, through broker + AsyncClient.

Two configurations, one after the other, each a broker and two worker processes on 127.0.0.1 that share the
device (each worker takes --mem-fraction of its memory), under the same ShareGPT mixed load (Poisson at
--rate, the same requests and send times):
    disagg  one `--role prefill` worker + one `--role decode` worker (KV blocks handed over worker to worker)
    agg2    two `--role both` workers (the broker balances whole jobs between them)
Measured at the client: TTFT, TPOT, ITL, end-to-end latency (p50/p90/p99), throughput and goodput under
--ttft-slo-ms / --tpot-slo-ms; and from the broker's counters, how many jobs went disaggregated and how many
prefills had to be recomputed (kv_lost). Writes disagg.json + disagg.md to --out and, for the headline
configuration (the defaults on CUDA), the summary keys disagg_ttft_p99_ms, disagg_tpot_p99_ms,
agg2_ttft_p99_ms, agg2_tpot_p99_ms (benchmarks/README.md).

On the H200 (dummy Llama-3-8B bf16, ~3 minutes: four worker starts of ~20-40 s and two runs of <= 60 s):

    python -m tokenmill.benchmarks.disagg_bench --out $OUT

CPU smoke (tiny model, seconds):

    python -m tokenmill.benchmarks.disagg_bench --device cpu --model tiny-llama --requests 8

The engine's KV budget is a share of the whole device less what other processes hold (the model runner's
profile), so the second worker of a configuration starts once the first has registered, with twice the
fraction: both end up with about --mem-fraction of the GPU each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.serving import (
    HOST,
    SPEC_ENV,
    Cluster,
    ServingConfig,
    _wait_ready,
    free_port,
    rate_result,
    run_rate,
)
from tokenmill.benchmarks.throughput import ModelSpec, resolved_device, where_it_runs, workload_tokenizer
from tokenmill.benchmarks.workloads import Workload, sharegpt_workload

CONFIGS: dict[str, tuple[str, str]] = {"disagg": ("prefill", "decode"), "agg2": ("both", "both")}
# The headline configuration of the summary keys (benchmarks/README.md): these arguments, on CUDA.
HEADLINE = {"model": "llama3-8b", "requests": 64, "rate": 6.0, "max_input_len": 1024, "max_output_len": 256,
            "mem_fraction": 0.45}


@contextlib.contextmanager
def pool(spec: ModelSpec, roles: tuple[str, ...], mem_fraction: float, ready_timeout: float) -> Iterator[Cluster]:
    """A broker and one worker per role on 127.0.0.1, started one after the other (module docstring)."""
    front, back = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
    c = Cluster(front, Path(tempfile.mkdtemp(prefix="tokenmill-disagg-")))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENMILL_LOG_LEVEL": "info"}
    try:
        c.spawn("broker", ["broker", "--frontend", front, "--backend", back, "--queue-size", "4096",
                           "--queue-timeout", "3600"], env)
        for i, role in enumerate(roles):
            share = replace(spec, gpu_memory_utilization=min(0.95, mem_fraction * (i + 1)))
            c.spawn(f"{role}-{i}", ["worker", "--broker", back, "--model", spec.model, "--role", role,
                                    "--max-num-seqs", str(spec.max_num_seqs), "--prefix-caching",
                                    "--engine-factory", "tokenmill.benchmarks.serving:engine_from_env",
                                    "--name", f"{role}-{i}"], {**env, SPEC_ENV: json.dumps(share.describe())})
            _wait_ready(c, ready_timeout, workers=i + 1)
        yield c
    finally:
        c.stop()


def broker_counters(address: str) -> dict[str, Any]:
    from tokenmill.client import Client

    with Client(address) as client:
        st = client.stats()
    keys = ("dispatches", "disaggregated_dispatches", "prefills", "prefills_without_kv", "kv_lost", "migrations")
    return {"counters": {k: st["counters"].get(k, 0) for k in keys},
            "workers": [{k: w[k] for k in ("name", "role", "dispatched", "prefix_hits", "preemptions")}
                        for w in st["workers"]]}


def run_config(name: str, spec: ModelSpec, wl: Workload, args: argparse.Namespace,
               cfg: ServingConfig) -> dict[str, Any]:
    t0 = time.monotonic()
    with pool(spec, CONFIGS[name], args.mem_fraction, args.ready_timeout) as c:
        started = time.monotonic() - t0
        asyncio.run(run_rate(c.frontend, wl.subset(min(4, len(wl))), math.inf, desc=f"{name} warm-up"))
        timings, duration = asyncio.run(run_rate(c.frontend, wl, args.rate, seed=args.seed,
                                                 time_limit_s=args.time_limit_s, desc=name))
        res = rate_result(timings, duration, args.rate, cfg) | {"requests_sent": len(wl), "start_s": round(started, 1)}
        res |= broker_counters(c.frontend)
    t, p = res["latency"]["ttft_ms"], res["latency"]["tpot_ms"]
    print(f"{name}: {res['completed']}/{len(wl)} ok, TTFT p50/p99 {t['p50']:.0f}/{t['p99']:.0f} ms, TPOT p50/p99 "
          f"{p['p50']:.1f}/{p['p99']:.1f} ms, counters {res['counters']}, logs {c.logs}", flush=True)
    return res


def ratios(res: dict[str, dict[str, Any]]) -> dict[str, float]:
    """disagg / agg2 of each latency percentile (below 1: disaggregated is faster)."""
    out = {}
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for q in ("p50", "p99"):
            a, b = res["disagg"]["latency"][metric][q], res["agg2"]["latency"][metric][q]
            if b and math.isfinite(a) and math.isfinite(b):
                out[f"{metric}_{q}"] = round(a / b, 3)
    return out


def table(res: dict[str, dict[str, Any]], rat: dict[str, float]) -> str:
    rows = ["| config | done | req/s | out tok/s | goodput req/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
            "ITL p50 / p99 (ms) | E2E p50 / p99 (s) | disaggregated / prefills / kv_lost |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        lat, k = r["latency"], r["counters"]
        t, p, i, e = lat["ttft_ms"], lat["tpot_ms"], lat["itl_ms"], lat["e2e_ms"]
        rows.append(f"| {name} | {r['completed']}/{r['requests_sent']} | {r['requests_per_s']:.2f} | "
                    f"{r['output_tok_per_s']:.1f} | {r['goodput_requests_per_s']:.2f} | "
                    f"{t['p50']:.0f} / {t['p99']:.0f} | {p['p50']:.1f} / {p['p99']:.1f} | "
                    f"{i['p50']:.1f} / {i['p99']:.1f} | {e['p50'] / 1e3:.2f} / {e['p99'] / 1e3:.2f} | "
                    f"{k['disaggregated_dispatches']} / {k['prefills']} / {k['kv_lost']} |")
    rows.append("")
    rows.append("disagg / agg2: " + ", ".join(f"{k} {v:.2f}x" for k, v in rat.items()))
    return "\n".join(rows)


def is_headline(args: argparse.Namespace, spec: ModelSpec, res: dict[str, dict[str, Any]]) -> bool:
    mine = {"model": spec.model, "requests": args.requests, "rate": args.rate, "max_input_len": args.max_input_len,
            "max_output_len": args.max_output_len, "mem_fraction": args.mem_fraction}
    return (mine == HEADLINE and spec.dummy and spec.device == "cuda" and spec.dtype == "bfloat16"
            and all(r["completed"] == r["requests_sent"] for r in res.values()))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h = HEADLINE
    ap.add_argument("--model", default=h["model"], help="a dummy shape name (dummy weights) or a model path")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "hf", "gguf", "dummy"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=h["requests"])
    ap.add_argument("--rate", type=float, default=h["rate"], help="requests/s (Poisson)")
    ap.add_argument("--max-input-len", type=int, default=h["max_input_len"])
    ap.add_argument("--max-output-len", type=int, default=None,
                    help=f"default: {h['max_output_len']} (64 on the CPU: a smoke run)")
    ap.add_argument("--mem-fraction", type=float, default=h["mem_fraction"], help="of the GPU's memory per worker")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="per configuration's measured run (default: 60 s; 180 s on the CPU)")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="per worker start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<cpu|h200>")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.mem_fraction <= 0.475:
        raise SystemExit("--mem-fraction must be in (0, 0.475]: two workers share the device")
    device, dtype = resolved_device(args.device, args.dtype)
    cpu = device == "cpu"
    if args.max_output_len is None:
        args.max_output_len = 64 if cpu else HEADLINE["max_output_len"]
    if args.time_limit_s is None:
        args.time_limit_s = 180.0 if cpu else 60.0
    spec = ModelSpec(model=args.model, load_format=args.load_format, dtype=dtype, device=device,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_model_len=2048)
    print(f"disagg bench: {where_it_runs(spec)}, two workers per configuration on one device", flush=True)
    tok, vocab, tok_name = workload_tokenizer(spec)
    wl = sharegpt_workload(tok, args.requests, args.seed, ids_vocab=vocab, max_input_len=args.max_input_len,
                           max_output_len=args.max_output_len)
    cfg = ServingConfig(rates=(args.rate,), num_prompts=args.requests, ttft_slo_ms=args.ttft_slo_ms,
                        tpot_slo_ms=args.tpot_slo_ms, seed=args.seed, time_limit_s=args.time_limit_s)
    t0 = time.monotonic()
    res = {name: run_config(name, spec, wl, args, cfg) for name in CONFIGS}
    rat = ratios(res)
    out = args.out or Path("benchmarks/results") / ("cpu" if cpu else "h200")
    config = {k: getattr(args, k) for k in ("requests", "rate", "max_input_len", "max_output_len", "mem_fraction",
                                            "ttft_slo_ms", "tpot_slo_ms", "time_limit_s", "seed")}
    payload = {"benchmark": "disagg", "model": spec.describe(), "length_tokenizer": tok_name, "config": config,
               "headline": is_headline(args, spec, res), "workload": wl.summary(), "results": res,
               "disagg_over_agg2": rat, "wall_s": round(time.monotonic() - t0, 1)}
    write_results(out, "disagg", payload, table(res, rat))
    from tokenmill.benchmarks import summary

    print("summary.json:", summary.record_file(out / "disagg.json", date=summary.today()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
