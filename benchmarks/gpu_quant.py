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
   Llama-3-8B quantized on load, bf16 / int8 / int4 / fp8 engines one after another in this process;
4. FP8 KV cache (`--kv-cache-dtype fp8`): (a) correctness in bf16 before anything is timed: the KV-write kernel's
   e4m3 bytes equal the torch reference's, and paged attention over the fp8 cache (decode batch 64, a split-K
   long context, a mixed prefill batch) matches the reference reading the same cache (norm-wise relative error;
   the error against a bf16 cache of the same keys and values is recorded beside it); (b) KV blocks at the same
   memory: two engines with bf16 weights and no CUDA graphs (quick to start), KV cache auto vs fp8, the same
   gpu_memory_utilization, max_num_seqs high enough that the "useful blocks" cap does not bind (checked);
   `fp8_kv_blocks_ratio` = fp8 blocks / bf16 blocks; (c) fixed 1000 in / 1000 out as suite.py's fixed section
   (GPU suite engine: max_num_seqs 256, 8,192 batched tokens, max_model_len 4096, prefix caching off, at most
   2 x max_num_seqs requests unfinished at a time, a warm-up of the full-budget prefill shapes first) with bf16 vs
   FP8 weights + FP8 KV, --fixed-requests of them (default 512, two windows, not the suite's 1,000, to keep the
   script within minutes: output tok/s over the whole run, prefill included, as the suite measures it).

    python -m tokenmill.benchmarks.gpu_quant --out benchmarks/results/h200
    python -m tokenmill.benchmarks.gpu_quant --skip-decode --skip-fixed   # kernels and checks only
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tokenmill.benchmarks import summary
from tokenmill.benchmarks.common import write_results

if TYPE_CHECKING:
    from tokenmill.worker.engine import LLMEngine

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


FP8_KV_CASES = {  # (query lens, seq lens): Llama-3-8B attention (32 q heads, 8 kv heads, head dim 128, blocks of 16)
    "decode_b64": ([1] * 64, [1024 + 113 * i for i in range(64)]),
    "decode_long_split": ([1, 1], [32768, 20001]),
    "mixed_prefill": ([512, 1, 1, 300], [2560, 3000, 17, 300]),
}


def fp8_kv_case(query_lens: list[int], seq_lens: list[int], dev: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """One batch (bf16 on the GPU; the CPU tests run it in fp16 under the interpreter): every context key/value
    written by the KV-write kernel into an e4m3 cache (scales calibrated on
    them, as the engine's first step), then attention of random queries over it. Raises if the kernel's bytes
    differ from the reference's or its attention is off."""
    from tokenmill.kernels.attention_ref import FP8_KV, paged_attention_ref, write_kv_cache_ref
    from tokenmill.kernels.kv_cache import write_kv_cache
    from tokenmill.kernels.paged_attention import paged_attention
    from tokenmill.worker.attention.kv_scales import calibrate
    from tokenmill.worker.model_runner import attention_metadata

    hq, hkv, d, bs = 32, 8, 128, 16
    counts = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(counts) + 1).tolist()
    tables = [perm[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, s in zip(tables, seq_lens) for p in range(s)], device=dev)
    k = torch.randn((len(slots), hkv, d), device=dev)
    k[..., :4] *= 20.0  # outlier channels, as Llama keys have
    k, v = k.to(dtype), torch.randn((len(slots), hkv, d), device=dev, dtype=dtype)
    scales = torch.ones((2, hkv), device=dev)
    calibrate(k, v, scales)
    shape = (len(perm), bs, hkv, d)
    kc, vc, kr, vr = (torch.zeros(shape, dtype=FP8_KV, device=dev) for _ in range(4))
    kb, vb = torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)
    write_kv_cache(k, v, kc, vc, slots, scales)
    write_kv_cache_ref(k, v, kr, vr, slots, scales)
    write_kv_cache(k, v, kb, vb, slots)
    if not (torch.equal(kc.view(torch.uint8), kr.view(torch.uint8)) and torch.equal(vc.view(torch.uint8),
                                                                                     vr.view(torch.uint8))):
        raise AssertionError("the fp8 KV-write kernel's bytes differ from the torch reference's")
    meta = attention_metadata(query_lens, seq_lens, tables, [-1] * sum(query_lens), dev)
    q = torch.randn((sum(query_lens), hq, d), device=dev, dtype=dtype)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5)
    out = paged_attention(q, kc, vc, *args, max_query_len=max(query_lens), max_seq_len=max(seq_lens), kv_scales=scales)
    ref = paged_attention_ref(q, kc, vc, *args, kv_scales=scales).float()
    dense = paged_attention_ref(q, kb, vb, *args).float()
    err = float((out.float() - ref).norm() / ref.norm())
    if not err < 1e-2:
        raise AssertionError(f"fp8 KV attention: relative error {err:.3e} vs the reference")
    return {"rel_err_vs_reference": err, "rel_err_vs_bf16_cache": float((out.float() - dense).norm() / dense.norm())}


def check_fp8_kv(dev: torch.device) -> dict[str, dict[str, float]]:
    return {name: fp8_kv_case(ql, sl, dev) for name, (ql, sl) in FP8_KV_CASES.items()}


def _free(engine: LLMEngine) -> None:
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def kv_blocks(model: str) -> dict[str, Any]:
    """KV blocks of bf16-weight engines with a bf16 and an fp8 cache at the same memory (see the docstring)."""
    from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    out: dict[str, Any] = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device="cuda",
                                        kv_cache_dtype=kv,  # type: ignore[arg-type]
                                        cuda_graphs=False, max_model_len=4096,
                                        cache=CacheConfig(gpu_memory_utilization=0.9),
                                        scheduler=SchedulerConfig(max_num_seqs=4096)))
        r = engine.runner
        useful = r.config.scheduler.max_num_seqs * -(-r.max_model_len // r.block_size)
        if r.num_blocks >= useful:
            raise AssertionError(f"kv {kv}: {r.num_blocks} blocks hit the useful-blocks cap; raise max_num_seqs")
        out[kv] = {"num_blocks": r.num_blocks, "bytes_per_block": r.bytes_per_block,
                   "kv_bytes": r.num_blocks * r.bytes_per_block}
        _free(engine)
    out["fp8_kv_blocks_ratio"] = out["fp8"]["num_blocks"] / out["auto"]["num_blocks"]
    return out


def fixed_run(model: str, quantization: str, kv_cache_dtype: str, requests: int) -> dict[str, Any]:
    """suite.py's fixed section (GPU suite engine) on `requests` requests of 1000 in / 1000 out."""
    import dataclasses

    from tokenmill.benchmarks.suite import GPU
    from tokenmill.benchmarks.throughput import drive, peak_memory, set_prefix_caching, warm_up
    from tokenmill.benchmarks.workloads import BenchRequest, Workload, random_workload
    from tokenmill.worker.engine import LLMEngine

    spec = dataclasses.replace(GPU.spec, model=model, quantization=quantization)
    engine = LLMEngine(dataclasses.replace(spec.engine_config(prefix_caching=False),
                                           kv_cache_dtype=kv_cache_dtype))  # type: ignore[arg-type]
    warm_up(engine)  # (with an fp8 cache its first step calibrates the K/V scales)
    set_prefix_caching(engine, False)
    wl = random_workload(requests, GPU.fixed_in, GPU.fixed_out, engine.runner.arch.vocab_size, GPU.seed)
    k = min(len(wl), spec.max_num_batched_tokens // GPU.fixed_in + 1)  # untimed: the full-budget prefill shapes
    drive(engine, Workload("warm-up", tuple(BenchRequest(r.prompt_ids, 2) for r in wl.requests[:k])), desc="warm-up")
    window = 2 * spec.max_num_seqs
    run = drive(engine, wl, window=window, desc=f"fixed {quantization} kv {kv_cache_dtype}")
    out = {"workload": wl.summary(), **run.summary(engine.runner.bytes_per_block),
           **peak_memory(engine.runner.device.type), "window": window, "kv_blocks": engine.runner.num_blocks,
           "quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    _free(engine)
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
    if payload.get("fp8_kv_check"):
        lines += ["", "| FP8 KV attention (bf16 GPU) | rel. error vs reference | vs a bf16 cache |", "|---|---|---|"]
        lines += [f"| {name} | {r['rel_err_vs_reference']:.2e} | {r['rel_err_vs_bf16_cache']:.2e} |"
                  for name, r in payload["fp8_kv_check"].items()]
    if payload.get("kv_blocks"):
        b = payload["kv_blocks"]
        lines += ["", f"KV blocks at the same memory (bf16 weights): bf16 {b['auto']['num_blocks']}, fp8 "
                      f"{b['fp8']['num_blocks']}: ratio {b['fp8_kv_blocks_ratio']:.3f}"]
    if payload.get("fixed"):
        lines += ["", "| fixed 1000 in / 1000 out | requests | output tok/s | KV blocks |", "|---|---|---|---|"]
        lines += [f"| {name} | {r['completed']} | {r['output_tok_per_s']:.0f} | {r['kv_blocks']} |"
                  for name, r in payload["fixed"].items()]
        if "fp8_over_bf16" in payload:
            lines.append(f"\nFP8 weights + FP8 KV over bf16: {payload['fp8_over_bf16']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-fixed", action="store_true", help="no KV-block count nor fixed 1000/1000 runs")
    ap.add_argument("--fixed-requests", type=int, default=512)
    args = ap.parse_args()
    dev = torch.device("cuda")
    payload: dict[str, Any] = {"benchmark": "gpu_quant", "model": args.model,
                               "gpu": torch.cuda.get_device_name(dev)}
    payload["errors"] = check_kernels(dev)
    payload["fp8_kv_check"] = check_fp8_kv(dev)
    if not args.skip_kernels:
        payload["kernels"] = kernel_table(dev)
    if not args.skip_decode:
        payload["decode"] = {q: decode_b1(args.model, q, args.steps) for q in DECODE_FORMATS}
    if not args.skip_fixed:
        payload["kv_blocks"] = kv_blocks(args.model)
        payload["fixed"] = {name: fixed_run(args.model, q, kv, args.fixed_requests)
                            for name, q, kv in (("bf16", "auto", "auto"), ("fp8_fp8kv", "fp8", "fp8"))}
        f = payload["fixed"]
        payload["fp8_over_bf16"] = f["fp8_fp8kv"]["output_tok_per_s"] / f["bf16"]["output_tok_per_s"]
    write_results(args.out, "gpu_quant", payload, table_md(payload))
    summary.record_file(args.out / "gpu_quant.json")


if __name__ == "__main__":
    main()
