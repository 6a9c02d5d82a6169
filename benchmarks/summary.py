"""The headline figures of one device: benchmarks/results/<device>/summary.json, and summary.md beside it.

summary.json is flat: one key per figure (KEYS; benchmarks/README.md defines each), its value one record
    {"value": <number>, "commit": <the commit measured>, "date": "YYYY-MM-DD", "source": <result file>}
where `source` is the result file beside it that holds the figure with its command and environment.
A benchmark run that measures some of the keys merges them in (`record_file`, called at the end of the
suite, gpu_e2e.py and broker_bench.py); the other keys keep their records. Each key has one definition:
a run whose configuration differs from it (other workload sizes, a variant flag) writes no figure for it.

    python -m tokenmill.benchmarks.summary benchmarks/results/h200/suite.json [--commit SHA] [--date D]

records the figures of result files copied in from elsewhere (e.g. the device's $OUT) into the
summary.json of their folder; --commit / --date override what the files say (a device copy can report a
stale base commit; results written before 2026-12-02 carry no date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"

# key -> unit. Keep in step with the table "Headline figures" in benchmarks/README.md (a test checks).
KEYS: dict[str, str] = {
    "sharegpt_200_req_s": "req/s",
    "fixed_1000x1000_out_tok_s": "output tok/s",
    "decode_b1_ms": "ms",
    "latency_config_ms": "ms",
    "prefix_ttft_gain_1k": "x",
    "prefix_ttft_gain_2k": "x",
    "mixed_step_host_ms": "ms",
    "serving_ttft_p99_ms_25pct": "ms",
    "serving_ttft_p99_ms_50pct": "ms",
    "serving_kernels_compiled": "kernels",
    "hf_static_ratio": "x",
    "broker_relay_tok_s": "tok/s",
    "broker_added_p99_ms": "ms",
    "ppl_delta_pct_int8": "%",
    "ppl_delta_pct_fp8": "%",
    "ppl_delta_pct_fp8_gptq": "%",
    "ppl_delta_pct_int4_rtn": "%",
    "ppl_delta_pct_int4_gptq": "%",
    "ppl_delta_pct_fp8_kv": "%",
    "ppl_delta_pct_fp8_kv_hadamard": "%",
    "int8_decode_b1_ms": "ms",
    "int4_decode_b1_ms": "ms",
    "fp8_decode_b1_ms": "ms",
    "fp8_kv_blocks_ratio": "x",
    "fp8_fixed_1000x1000_out_tok_s": "output tok/s",
    "ngram_cpu_b1_speedup": "x",
    "ngram_cpu_b1_copy_speedup": "x",
    "tp1_decode_b1_ms": "ms",
    "tp2_decode_b1_ms": "ms",
    "tp2_decode_b1_ratio": "x",
    "tp2_fixed_1000x1000_out_tok_s": "output tok/s",
    "gateway_added_p50_ms": "ms",
    "gateway_added_p50_ms_w4": "ms",
    "gateway_added_p50_ms_w8": "ms",
    "eagle_cpu_b1_speedup": "x",
    "eagle_b1_speedup": "x",
    "eagle_b32_speedup": "x",
    "eagle_b128_speedup": "x",
    "eagle_tau_k4": "tokens/step",
    "eagle_draft_round_b1_ms": "ms",
    "eagle_draft_round_b32_ms": "ms",
    "disagg_ttft_p99_ms": "ms",
    "disagg_tpot_p99_ms": "ms",
    "agg2_ttft_p99_ms": "ms",
    "agg2_tpot_p99_ms": "ms",
}

# The suite section each suite figure comes from (a merged suite takes sections from several runs).
SUITE_SECTION = {"sharegpt_200_req_s": "sharegpt", "fixed_1000x1000_out_tok_s": "fixed",
                 "prefix_ttft_gain_1k": "prefix", "prefix_ttft_gain_2k": "prefix", "mixed_step_host_ms": "prefix",
                 "serving_ttft_p99_ms_25pct": "serving", "serving_ttft_p99_ms_50pct": "serving",
                 "serving_kernels_compiled": "serving",
                 "hf_static_ratio": "hf_compare"}


def today() -> str:
    return datetime.datetime.now(datetime.UTC).date().isoformat()


# -- the summary file -------------------------------------------------------------------------------------


def load(path: Path) -> dict[str, dict[str, Any]]:
    """A summary.json, checked: known keys, each a record of a finite number, a commit, a date, a source."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    for key, rec in data.items():
        where = f"{path}: {key}"
        if key not in KEYS:
            raise ValueError(f"{where}: not a known key (add it to KEYS and benchmarks/README.md)")
        if not isinstance(rec, dict) or set(rec) != {"value", "commit", "date", "source"}:
            raise ValueError(f"{where}: want {{value, commit, date, source}}, got {rec!r}")
        _check(where, rec["value"], rec["commit"], rec["date"], rec["source"])
    return data


def _check(where: str, value: Any, commit: Any, date: Any, source: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: value {value!r} is not a finite number")
    if not isinstance(commit, str) or not commit.strip():
        raise ValueError(f"{where}: no commit")
    if not isinstance(source, str) or not source:
        raise ValueError(f"{where}: no source file")
    try:
        datetime.date.fromisoformat(date)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: date {date!r} is not YYYY-MM-DD") from None


def update(folder: Path, figures: Mapping[str, float], *, commit: str, date: str,
           source: str) -> dict[str, dict[str, Any]]:
    """Merge `figures` (key -> number, measured at `commit` on `date`, held by the result file `source`)
    into folder/summary.json and rewrite summary.md; keys not in `figures` keep their records."""
    path = folder / SUMMARY
    data = load(path) if path.exists() else {}
    for key, value in figures.items():
        if key not in KEYS:
            raise ValueError(f"{key}: not a known key (add it to KEYS and benchmarks/README.md)")
        _check(key, value, commit, date, source)
        data[key] = {"value": value if isinstance(value, int) else round(float(value), 3), "commit": commit,
                     "date": date, "source": source}
    data = {k: data[k] for k in KEYS if k in data}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    (folder / "summary.md").write_text(markdown(folder, data))
    return data


def markdown(folder: Path, data: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [f"# Headline figures: {folder.name}", "",
             "Written from summary.json by benchmarks/summary.py (the keys are defined in benchmarks/README.md; "
             "the history of what was tried is in NOTES.md).", "",
             "| key | value | unit | commit | measured | from |", "|---|---|---|---|---|---|"]
    lines += [f"| `{k}` | {r['value']:,} | {KEYS[k]} | {r['commit']} | {r['date']} | [{r['source']}]({r['source']}) |"
              for k, r in data.items()]
    lines += ["", "| result file | command | environment |", "|---|---|---|"]
    for source in dict.fromkeys(r["source"] for r in data.values()):
        try:
            res = json.loads((folder / source).read_text())
        except (OSError, ValueError):
            lines.append(f"| {source} | (not in this folder) | |")
            continue
        lines.append(f"| {source} | `{res.get('command', '')}` | {environment(res)} |")
    return "\n".join(lines) + "\n"


def environment(result: Mapping[str, Any]) -> str:
    """The machine a result file records (suite/write_results: `device`; broker_bench: `machine`)."""
    device = result.get("device")
    env = {**result.get("machine", {}), **(device if isinstance(device, dict) else {})}
    names = ("gpu", "driver", "cuda", "torch", "triton", "python", "cpu_count", "cpus_visible", "platform")
    return "; ".join(f"{n} {env[n]}" for n in names if env.get(n) not in (None, ""))


# -- figures from result files -------------------------------------------------------------------------------


def _section(r: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """A suite section that ran (neither skipped nor failed), else None."""
    sec = r.get(name)
    return sec if isinstance(sec, dict) and "error" not in sec and "skipped" not in sec else None


def suite_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """The suite's figures, each only where the run has the configuration the key is defined on."""
    cfg = r.get("config", {})
    out: dict[str, float] = {}
    sg, fx, hc = _section(r, "sharegpt"), _section(r, "fixed"), _section(r, "hf_compare")
    if (sg and (cfg.get("sharegpt_prompts"), cfg.get("sharegpt_max_input"), cfg.get("sharegpt_max_output"))
            == (200, 1024, None) and (sg["completed"], sg["failed"]) == (200, 0)):
        out["sharegpt_200_req_s"] = sg["requests_per_s"]
    if fx and (cfg.get("fixed_in"), cfg.get("fixed_out"), fx["completed"], fx["failed"]) == (1000, 1000, 1000, 0):
        out["fixed_1000x1000_out_tok_s"] = fx["output_tok_per_s"]
    if hc and "ratio_output_tok_s" in hc:
        out["hf_static_ratio"] = hc["ratio_output_tok_s"]
    return out | _prefix_figures(_section(r, "prefix")) | _serving_figures(cfg, _section(r, "serving"))


def _prefix_figures(pre: dict[str, Any] | None) -> dict[str, float]:
    """TTFT p50 gains by system prompt length; the mixed step's host launch (16 decodes + a request of the
    1,000-token system prompt + 136 tokens, cached and uncached: the larger)."""
    out: dict[str, float] = {}
    if pre is None:
        return out
    for v in pre.get("variants", []):
        key = {1000: "prefix_ttft_gain_1k", 2048: "prefix_ttft_gain_2k"}.get(v["system_len"])
        if key and "ttft_p50_ratio" in v.get("gain", {}):
            out[key] = v["gain"]["ttft_p50_ratio"]
    a = pre.get("anatomy") or {}
    mixed = [k["host_ms"] for k in a.get("kinds", {}).values() if k["prompt_tokens"] > 0]
    if (a.get("device") == "cuda" and (a.get("running"), a.get("system_prompt_tokens"), a.get("new_tokens"))
            == (16, 1000, 136) and len(mixed) == 2):
        out["mixed_step_host_ms"] = max(mixed)
    return out


def _serving_figures(cfg: Mapping[str, Any], sv: dict[str, Any] | None) -> dict[str, float]:
    """TTFT p99 at the rates set as 25% / 50% of the offline req/s, where every request completed."""
    fractions = cfg.get("serving_rate_fractions") or []
    if sv is None or cfg.get("serving_rates") or len(fractions) != len(sv["rates"]):
        return {}
    out = {}
    for frac, row in zip(fractions, sv["rates"]):
        key = {0.25: "serving_ttft_p99_ms_25pct", 0.5: "serving_ttft_p99_ms_50pct"}.get(frac)
        if key and "skipped" not in row and row["failed"] == 0 and row["completed"] > 0:
            out[key] = row["latency"]["ttft_ms"]["p99"]
    if "kernels_compiled_after_start_up" in sv:
        out["serving_kernels_compiled"] = float(sum(sv["kernels_compiled_after_start_up"].values()))
    return out


def e2e_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """gpu_e2e.py on dummy Llama-3-8B with async scheduling (its default)."""
    if r.get("model") != "llama3-8b" or "--sync-scheduling" in str(r.get("command", "")):
        return {}
    out = {}
    if "1" in r.get("decode", {}):
        out["decode_b1_ms"] = r["decode"]["1"]["ms_per_step_p50"]
    if r.get("latency_b8_in32_out128_s") is not None:
        out["latency_config_ms"] = 1e3 * r["latency_b8_in32_out128_s"]
    return out


def broker_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """broker_bench.py in its headline configuration: synthetic worker, traced broker without busy-poll,
    256 jobs x 1 token per chunk (throughput), 64 jobs at 100 steps/s (latency)."""
    t, lat = r["throughput"], r["latency"]
    headline = (str(r.get("worker", "")).startswith("synthetic") and "busy_poll" not in str(r.get("broker", ""))
                and lat.get("hops") is not None and (t["jobs"], t["tokens_per_chunk"]) == (256, 1)
                and (lat["jobs"], lat["step_rate_hz"]) == (64, 100.0))
    return {"broker_relay_tok_s": t["tokens_per_s"], "broker_added_p99_ms": lat["added_p99_ms"]} if headline else {}


def quant_accuracy_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """quant_accuracy.py on the embedded model (the dequantized Q4_1 reference), INT4 in groups of 128."""
    if (r.get("model"), r.get("group_size"), r.get("max_prompt_tokens"), r.get("max_reply_tokens")) != (
            "embedded", 128, 128, 128):
        return {}
    return {f"ppl_delta_pct_{name}": res["ppl_delta_pct"] for name, res in r.get("results", {}).items()
            if f"ppl_delta_pct_{name}" in KEYS}


def gpu_quant_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """gpu_quant.py on dummy Llama-3-8B: batch-1 decode quantized on load (bf16 measured in the same call), the FP8
    KV cache's blocks at bf16's memory, and the fixed 1000/1000 run with FP8 weights + FP8 KV (bf16 beside it)."""
    if r.get("model") != "llama3-8b":
        return {}
    decode = r.get("decode") or {}
    out = {f"{q}_decode_b1_ms": d["ms_per_step_p50"] for q, d in decode.items()
           if q in ("int8", "int4", "fp8") and "auto" in decode}
    if "kv_blocks" in r:
        out["fp8_kv_blocks_ratio"] = r["kv_blocks"]["fp8_kv_blocks_ratio"]
    fixed = r.get("fixed") or {}
    if "bf16" in fixed and "fp8_fp8kv" in fixed:
        out["fp8_fixed_1000x1000_out_tok_s"] = fixed["fp8_fp8kv"]["output_tok_per_s"]
    return out


def spec_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """spec_cpu.py in its headline configurations, batch 1, k = 3, one thread: n-gram on 8 requests of up to
    128 tokens; EAGLE (slower on the CPU: it drafts with the LM head) on 4 requests of up to 64 tokens."""
    c = r["config"]
    shape = (c["requests"], c["max_tokens"], c["max_prompt"], c.get("threads"))
    keys = ({"chat_k3": "ngram_cpu_b1_speedup", "copy_k3": "ngram_cpu_b1_copy_speedup"} if shape == (8, 128, 384, 1)
            else {"eagle_chat_k3": "eagle_cpu_b1_speedup"} if shape == (4, 64, 384, 1) else {})
    return {key: r["results"][name]["speedup"] for name, key in keys.items() if name in r["results"]}


def tp_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """gpu_tp.py on dummy Llama-3-8B on CUDA, TP = 2 against TP = 1 in the same call; the fixed figure only
    where all 1,000 requests of 1,000 in / 1,000 out completed."""
    if (r.get("model"), r.get("device_kind"), r.get("tp")) != ("llama3-8b", "cuda", 2):
        return {}
    one, two = r["runs"]["1"], r["runs"]["2"]
    out = {"tp1_decode_b1_ms": one["decode_b1"]["ms_per_step_p50"],
           "tp2_decode_b1_ms": two["decode_b1"]["ms_per_step_p50"], "tp2_decode_b1_ratio": r["decode_b1_ratio"]}
    fx, wl = two["fixed"], two["fixed"]["workload"]
    if (wl["input_len"], wl["output_len"], fx["completed"], fx["failed"]) == (1000, 1000, 1000, 0):
        out["tp2_fixed_1000x1000_out_tok_s"] = fx["output_tok_s"]
    return out


def gateway_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """gateway_bench.py in its headline configuration: 64 streams x 200 tokens at 50 steps/s (busy 0.3), the lean
    SSE reader; one gateway process (gateway_added_p50_ms) or 4 / 8 (..._w4, _w8); the figure is the median over
    rounds of each round's p50 added."""
    workers = r.get("gateway_workers", 1)
    key = "gateway_added_p50_ms" if workers == 1 else f"gateway_added_p50_ms_w{workers}"
    load = (r.get("streams"), r.get("tokens_per_stream"), r.get("step_rate"), r.get("busy"))
    headline = (load == (64, 200, 50.0, 0.3) and key in KEYS and "sse" in (r.get("added_ms") or {}))
    return {key: r["added_ms"]["sse"]["p50_median_of_rounds"]} if headline else {}


def spec_gpu_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """spec_gpu.py in its headline configuration (not --smoke): k = 4, up to 256 tokens, prompts <= 512, the head
    alone (no prompt lookup first), CUDA graphs on."""
    c = r["config"]
    if r.get("smoke") or (c["k"], c["max_tokens"], c["max_prompt"], c.get("eagle_lookup_min", 0),
                          c.get("method", "eagle"), c.get("cuda_graphs", True)) != (4, 256, 512, 0, "eagle", True):
        return {}
    out = {f"eagle_b{b}_speedup": r["throughput"][str(b)]["speedup"] for b in (1, 32, 128)
           if str(b) in r["throughput"]}
    tau = r["tau"].get("4", {}).get("tau")
    return out | ({"eagle_tau_k4": tau} if tau is not None else {})


def spec_costs_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """spec_costs.py at k = 4: the draft round from the chain CUDA graphs at batch 1 and 32."""
    if r.get("k") != 4:
        return {}
    rounds = r["draft_round_ms"]
    return {f"eagle_draft_round_b{b}_ms": rounds[str(b)]["graphs"] for b in (1, 32)
            if rounds.get(str(b), {}).get("graphs") is not None}


def disagg_figures(r: Mapping[str, Any]) -> dict[str, float]:
    """disagg_bench.py in its headline configuration (the file's `headline`: its defaults on CUDA, every
    request of both configurations completed)."""
    if not r.get("headline"):
        return {}
    res = r["results"]
    return {f"{name}_{m}_p99_ms": res[name]["latency"][f"{m}_ms"]["p99"] for name in ("disagg", "agg2")
            for m in ("ttft", "tpot")}


def figures_of(result: Mapping[str, Any]) -> dict[str, float]:
    """The figures a result file holds, by what kind of result it is."""
    kind: Callable[[Mapping[str, Any]], dict[str, float]] | None = (
        broker_figures if result.get("benchmark") == "broker_relay" else
        quant_accuracy_figures if result.get("benchmark") == "quant_accuracy" else
        gpu_quant_figures if result.get("benchmark") == "gpu_quant" else
        spec_figures if result.get("benchmark") == "spec_cpu" else
        tp_figures if result.get("benchmark") == "gpu_tp" else
        gateway_figures if result.get("benchmark") == "gateway" else
        spec_gpu_figures if result.get("benchmark") == "spec_gpu" else
        spec_costs_figures if result.get("benchmark") == "spec_costs" else
        disagg_figures if result.get("benchmark") == "disagg" else
        suite_figures if "sections_s" in result else
        e2e_figures if "latency_b8_in32_out128_s" in result else None)
    return kind(result) if kind else {}


def _run_of(result: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """The run that measured `key`: in a merged suite, the one its section came from."""
    for run in result.get("merged") or []:
        if SUITE_SECTION.get(key) in run.get("sections", []):
            return run
    return result


def record_file(path: Path, *, commit: str | None = None, date: str | None = None) -> dict[str, float]:
    """Merge the figures of the result file `path` into the summary.json of its folder; `commit` / `date`
    override the file's (its `commit`, its `measured` stamp). Returns the figures recorded."""
    result = json.loads(path.read_text())
    figures = figures_of(result)
    by_run: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in figures.items():
        run = _run_of(result, key)
        c, d = commit or run.get("commit"), date or (run.get("measured") or "")[:10]
        if not c or not d:
            raise ValueError(f"{path}: no {'commit' if not c else 'measured date'} for {key}: pass it")
        by_run.setdefault((c, d), {})[key] = value
    for (c, d), figs in by_run.items():
        update(path.parent, figs, commit=c, date=d, source=path.name)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", type=Path, nargs="+", help="result JSONs (suite, gpu_e2e_*, broker_relay*)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: each file's)")
    ap.add_argument("--date", default=None, help="YYYY-MM-DD of the measurement (default: each file's)")
    args = ap.parse_args(argv)
    for f in args.files:
        figs = record_file(f, commit=args.commit, date=args.date)
        print(f"{f}: " + (", ".join(f"{k} {v:.4g}" for k, v in figs.items()) or "no headline figure"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
