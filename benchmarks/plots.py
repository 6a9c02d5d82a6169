"""PNG plots of a suite result (matplotlib, Agg backend): throughput vs request rate, latency percentiles
per rate, the optimization ladder, and tokenmill vs the HF baseline and the published anchors.

    python -m tokenmill.benchmarks.plots benchmarks/results/h200/suite.json   # (re)draws the PNGs beside it
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

PCT_COLORS = {"p50": "#4C72B0", "p90": "#DD8452", "p99": "#C44E52"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def title_suffix(result: dict[str, Any]) -> str:
    dev = result.get("device", {})
    name = dev.get("gpu") or f"CPU ({dev.get('cpu_count', '?')} cores)"
    m = result.get("model", {})
    if m.get("model") == "embedded":
        return f"SmolLM2-135M-Instruct (embedded GGUF, {m.get('dtype', '')}) on {name}"
    return f"{m.get('model', '?')} ({m.get('load_format', '')} weights, {m.get('dtype', '')}) on {name}"


def _rate_label(r: Any) -> str:
    return "max (burst)" if r == "inf" else f"{float(r):g}"


def _served_rates(serving: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in serving.get("rates", []) if "skipped" not in r and r.get("completed")]


def plot_throughput_vs_rate(result: dict[str, Any], path: Path) -> Path | None:
    rates = _served_rates(result.get("serving", {}))
    if not rates:
        return None
    plt = _plt()
    x = list(range(len(rates)))
    labels = [_rate_label(r["rate"]) for r in rates]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot(x, [r["requests_per_s"] for r in rates], "o-", label="achieved")
    a1.plot(x, [r["goodput_requests_per_s"] for r in rates], "s--", label="goodput (within SLO)")
    offered = [(i, float(r["rate"])) for i, r in enumerate(rates) if r["rate"] != "inf"]
    if offered:
        a1.plot([i for i, _ in offered], [v for _, v in offered], ":", color="gray", label="offered")
    a1.set(xlabel="offered request rate (requests/s)", ylabel="requests/s", title="request throughput")
    a2.plot(x, [r["output_tok_per_s"] for r in rates], "o-", color="#55A868")
    a2.set(xlabel="offered request rate (requests/s)", ylabel="output tokens/s", title="output token throughput")
    for a in (a1, a2):
        a.set_xticks(x, labels)
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
    a1.legend()
    fig.suptitle(f"Serving throughput vs request rate: {title_suffix(result)}", fontsize=11)
    return _save(fig, path)


def plot_latency_percentiles(result: dict[str, Any], path: Path) -> Path | None:
    rates = _served_rates(result.get("serving", {}))
    if not rates:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [_rate_label(r["rate"]) for r in rates]
    for ax, key, name in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "tpot_ms", "time per output token")):
        _grouped_bars(ax, labels, {p: [r["latency"][key][p] for r in rates] for p in PCT_COLORS})
        ax.margins(y=0.15)
        ax.set(xlabel="offered request rate (requests/s)", ylabel=f"{key.split('_')[0].upper()} (ms)",
               title=f"{name} ({key.split('_')[0].upper()}): p50 / p90 / p99")
        ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.suptitle(f"Serving latency percentiles per request rate: {title_suffix(result)}", fontsize=11)
    return _save(fig, path)


def _grouped_bars(ax: Any, labels: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [v if math.isfinite(v) else 0 for v in values], width, label=name, color=PCT_COLORS.get(name))
    ax.set_xticks(range(len(labels)), labels)
    ax.grid(axis="y", alpha=0.3)


def plot_ladder(result: dict[str, Any], path: Path) -> Path | None:
    rows = [r for r in result.get("ladder", {}).get("rows", []) if "not_run" not in r and "error" not in r]
    if not rows:
        return None
    plt = _plt()
    names = {"sharegpt": "ShareGPT", "shared-prefix-chat": "shared prefix"}
    labels = [f"{short_step(r['step'])}\n[{names.get(r['workload'], r['workload'])}]" for r in rows]
    panels = (("output_tok_per_s", "output tokens/s"), ("ttft_p50", "TTFT p50 (ms)"), ("tpot_p50", "TPOT p50 (ms)"),
              ("memory", "memory (MiB): weights + peak KV in use"))
    fig, axes = plt.subplots(1, 4, figsize=(max(17.0, 3.6 * len(rows)), 5.4))
    colors = ["#8172B2", "#4C72B0", "#937860", "#55A868", "#C44E52", "#DD8452", "#DA8BC3", "#64B5CD"][: len(rows)]
    xs = range(len(rows))
    for ax, (key, name) in zip(axes, panels):
        if key == "memory":  # weights (solid) with the peak KV cache in use on top (hatched)
            weights = [r.get("weights_bytes", 0) / 2**20 for r in rows]
            kv = [r["peak_kv_bytes"] / 2**20 for r in rows]
            ax.bar(xs, weights, color=colors, label="weights")
            bars = ax.bar(xs, kv, bottom=weights, color=colors, alpha=0.45, hatch="//", label="peak KV in use")
            ax.bar_label(bars, labels=[f"{value_label(w)}\n+ {value_label(k)}" for w, k in zip(weights, kv)],
                         fontsize=7.5)
            ax.legend(fontsize=7.5, loc="lower right")
        else:
            vals = [_ladder_value(r, key) for r in rows]
            bars = ax.bar(xs, vals, color=colors)
            ax.bar_label(bars, labels=[value_label(v) for v in vals], fontsize=8)
        ax.set_xticks(xs, labels, fontsize=7.5)
        ax.margins(y=0.15)
        ax.set(title=name, ylabel=name)
        ax.grid(axis="y", alpha=0.3)
    all_rows = result.get("ladder", {}).get("rows", [])
    missing = "; ".join(f"{r['step'].split(' (')[0]} ({r['not_run']})" for r in all_rows if "not_run" in r)
    fig.suptitle(f"Optimization ladder: {title_suffix(result)}" + (f"\nnot run: {missing}" if missing else ""),
                 fontsize=11)
    return _save(fig, path)


def value_label(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _ladder_value(r: dict[str, Any], key: str) -> float:
    if key == "ttft_p50":
        return float(r["ttft_ms"]["p50"])
    if key == "tpot_p50":
        return float(r["tpot_ms"]["p50"])
    return float(r[key])


def short_step(step: str) -> str:
    """A two-line label for a ladder step."""
    if step.startswith("static"):
        return "static\nbatching"
    if "prefix caching off" in step:
        return "continuous,\nno prefix\ncache"
    if "prefix caching" in step:
        return "continuous\n+ prefix\ncache"
    for name, label in (("INT8", "INT8\nweights"), ("FP8", "FP8 W8A8\n+ FP8 KV"), ("n-gram", "n-gram\nspeculation"),
                        ("EAGLE", "EAGLE\nspeculation")):
        if name in step:
            return label
    return "continuous\nbatching"


def plot_baselines(result: dict[str, Any], path: Path) -> Path | None:
    """tokenmill vs HF static batching on the same requests, and vs the published anchors."""
    bars = baseline_bars(result)
    if not bars:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(bars), figsize=(max(8.0, 5.2 * len(bars)), 4.4), squeeze=False)
    for ax, (title, unit, items) in zip(axes[0], bars):
        names = [n for n, _, _ in items]
        vals = [v for _, v, _ in items]
        b = ax.bar(range(len(items)), vals, color=[c for _, _, c in items])
        ax.bar_label(b, labels=[value_label(v) for v in vals], fontsize=8)
        ax.set_xticks(range(len(items)), names, fontsize=8)
        ax.set(title=title, ylabel=unit)
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"tokenmill vs baselines and anchors: {title_suffix(result)}", fontsize=11)
    return _save(fig, path)


def baseline_bars(result: dict[str, Any]) -> list[tuple[str, str, list[tuple[str, float, str]]]]:
    out = []
    hf = result.get("hf_compare")
    if hf and "hf" in hf:
        n = hf["hf"]["requests"]
        out.append((f"same {n} ShareGPT requests", "output tokens/s", [
            (f"HF generate()\nstatic batch {hf['hf']['batch_size']}", hf["hf"]["output_tok_per_s"], "#C44E52"),
            ("tokenmill", hf["engine"]["output_tok_per_s"], "#4C72B0")]))
    pre = result.get("prefix", {}).get("rows") or []
    if len(pre) == 2:
        out.append((f"shared-prefix chat, {pre[0]['requests']} requests: TTFT p50", "milliseconds", [
            ("prefix caching off", pre[0]["ttft_ms"]["p50"], "#C44E52"),
            ("prefix caching on", pre[1]["ttft_ms"]["p50"], "#4C72B0")]))
    anchors = result.get("anchors", {})
    sg = result.get("sharegpt")
    if sg and "requests_per_s" in sg and "vllm_sharegpt_requests_per_s" in anchors:
        out.append((f"{sg['completed']} ShareGPT prompts (vLLM CI config)", "requests/s", [
            ("tokenmill", sg["requests_per_s"], "#4C72B0"),
            ("vLLM on H200\n(published)", anchors["vllm_sharegpt_requests_per_s"], "#8C8C8C")]))
    fx = result.get("fixed")
    if fx and "output_tok_per_s" in fx and "trtllm_fp8_fixed_output_tok_per_s" in anchors:
        out.append((f"{fx['completed']} x (1000 in, 1000 out)", "output tokens/s", [
            ("tokenmill bf16", fx["output_tok_per_s"], "#4C72B0"),
            ("TensorRT-LLM FP8\non H200 (published)", anchors["trtllm_fp8_fixed_output_tok_per_s"], "#8C8C8C")]))
    return out


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


PLOTS = (("serving_throughput.png", plot_throughput_vs_rate), ("serving_latency.png", plot_latency_percentiles),
         ("ladder.png", plot_ladder), ("baselines.png", plot_baselines))


def plot_all(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every plot the result has data for; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn in PLOTS:
        p = fn(result, out_dir / name)
        if p is not None:
            written.append(p)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path, help="a suite JSON (suite.json)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: beside the JSON)")
    args = ap.parse_args()
    result = json.loads(args.result.read_text())
    for p in plot_all(result, args.out or args.result.parent):
        print(p)


if __name__ == "__main__":
    main()
