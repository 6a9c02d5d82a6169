"""GPU figures of issue 16 (quantization), in one device call. Written in a CPU-only session and NOT RUN yet:
the first run on the H200 is its test (kernels were checked only under the Triton interpreter and by an
ahead-of-time sm_90 compile).

1. correctness on the GPU: each format's kernel against its torch reference in bf16 at Llama-3-8B shapes
   (norm-wise relative error; the run stops before timing anything if one is off);
2. kernel table: y = x @ W.T on the four Llama-3-8B projections at M = 1, 8, 32, 128, 512: bf16 cuBLAS
   (F.linear) vs INT8 and INT4 g128 (Triton: the skinny kernel for M <= 16, the tiled one above) vs FP8
   (per-token activation quantization + torch._scaled_mm); median ms of triton.testing.do_bench (L2 flushed)
   and the speed-up over bf16;
3. batch-1 decode per output token (prompt 128, 128 new tokens, decode steps only, as gpu_e2e.py), dummy
   Llama-3-8B quantized on load, bf16 / int8 / int4 / fp8 engines one after another in this process.

    python -m tokenmill.benchmarks.gpu_quant --out benchmarks/results/h200
    python -m tokenmill.benchmarks.gpu_quant --skip-decode          # kernels only (about a minute)
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.benchmarks import summary
from tokenmill.benchmarks.common import write_results

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 8, 32, 128, 512)
FORMATS = ("int8", "int4", "fp8")
DECODE_FORMATS = ("auto", "int8", "int4", "fp8")  # "auto": the bf16 baseline


def _methods(dev: torch.device) -> dict[str, Any]:
    from tokenmill.worker.quant.fp8 import Fp8LinearMethod
    from tokenmill.worker.quant.int4 import Int4LinearMethod
    from tokenmill.worker.quant.int8 import Int8LinearMethod

    return {"int8": Int8LinearMethod(), "int4": Int4LinearMethod(128), "fp8": Fp8LinearMethod(dev)}


def _layers(n: int, k: int, dev: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """A random bf16 weight [n, k] and a Linear of each format holding its quantization."""
    from tokenmill.worker.models.layers import Linear

    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    layers = {}
    for name, method in _methods(dev).items():
        layer = Linear(k, n, False, method, dtype=torch.bfloat16, device=dev)
        for suffix, t in method.quantize(w).items():
            method.load_weight(layer, suffix, t, None)
        layers[name] = layer
    return w, layers


def _reference(name: str, layer: Any, x: torch.Tensor) -> torch.Tensor:
    from tokenmill.kernels.quant_weight import quant_matmul_ref
    from tokenmill.worker.quant.fp8 import fp8_matmul_ref

    if name == "fp8":
        return fp8_matmul_ref(x.float(), layer.qweight, layer.scales, None)
    return quant_matmul_ref(x.float(), layer.method.packed(layer)).float()


def check_kernels(dev: torch.device) -> dict[str, dict[str, float]]:
    """Norm-wise relative error of every format's GPU path vs its fp32 reference, per projection and M."""
    errors: dict[str, dict[str, float]] = {}
    for proj, (n, k) in SHAPES.items():
        _, layers = _layers(n, k, dev)
        for m in (1, 16, 128):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for name, layer in layers.items():
                got = layer(x).float()
                ref = _reference(name, layer, x)
                err = float((got - ref).norm() / ref.norm())
                errors.setdefault(name, {})[f"{proj}_m{m}"] = err
                if err > 2e-2:
                    raise AssertionError(f"{name} {proj} M={m}: relative error {err:.3e} vs the reference")
    return errors


def kernel_table(dev: torch.device) -> list[dict[str, Any]]:
    from triton.testing import do_bench

    rows = []
    for proj, (n, k) in SHAPES.items():
        w, layers = _layers(n, k, dev)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row: dict[str, Any] = {"proj": proj, "m": m, "n": n, "k": k}
            row["bf16_ms"] = float(do_bench(lambda x=x, w=w: F.linear(x, w), return_mode="median"))
            for name, layer in layers.items():
                ms = float(do_bench(lambda x=x, layer=layer: layer(x), return_mode="median"))
                row[f"{name}_ms"] = ms
                row[f"{name}_speedup"] = row["bf16_ms"] / ms
            rows.append(row)
            print(row, flush=True)
        del w, layers
        torch.cuda.empty_cache()
    return rows


def decode_b1(model: str, quantization: str, steps: int) -> dict[str, Any]:
    from tokenmill.benchmarks.gpu_e2e import decode_step_times
    from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device="cuda",
                                    quantization=quantization,  # type: ignore[arg-type]
                                    cache=CacheConfig(gpu_memory_utilization=0.5),
                                    scheduler=SchedulerConfig(max_num_seqs=8)))
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    decode_step_times(engine, 1, 128, 16)  # warm-up
    times = decode_step_times(engine, 1, 128, steps)
    out = {"ms_per_step_p50": 1e3 * statistics.median(times), "ms_per_step_mean": 1e3 * statistics.fmean(times),
           "steps": len(times), "weight_bytes": weights, "kv_blocks": engine.runner.num_blocks}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def table_md(payload: dict[str, Any]) -> str:
    lines = ["| proj | M | bf16 cuBLAS ms | " + " | ".join(f"{f} ms (x)" for f in FORMATS) + " |",
             "|---|---|---|" + "---|" * len(FORMATS)]
    for r in payload.get("kernels", []):
        cells = " | ".join(f"{r[f + '_ms']:.4f} ({r[f + '_speedup']:.2f}x)" for f in FORMATS)
        lines.append(f"| {r['proj']} | {r['m']} | {r['bf16_ms']:.4f} | {cells} |")
    if payload.get("decode"):
        lines += ["", "| decode b1 (dummy " + payload["model"] + ") | ms / token p50 | weights GiB | KV blocks |",
                  "|---|---|---|---|"]
        for q, d in payload["decode"].items():
            lines.append(f"| {'bf16' if q == 'auto' else q} | {d['ms_per_step_p50']:.3f} | "
                         f"{d['weight_bytes'] / 2**30:.2f} | {d['kv_blocks']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    payload: dict[str, Any] = {"benchmark": "gpu_quant", "model": args.model,
                               "gpu": torch.cuda.get_device_name(dev)}
    payload["errors"] = check_kernels(dev)
    if not args.skip_kernels:
        payload["kernels"] = kernel_table(dev)
    if not args.skip_decode:
        payload["decode"] = {q: decode_b1(args.model, q, args.steps) for q in DECODE_FORMATS}
    write_results(args.out, "gpu_quant", payload, table_md(payload))
    summary.record_file(args.out / "gpu_quant.json")


if __name__ == "__main__":
    main()
