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

5. `--sweep` (alone: nothing above runs): the launch-config search of the weight-only kernels that writes the
   per-device table of kernels/tuned.py, <slug>.json, and gpu_quant_sweep.{json,md} into --out (the stages,
   the grid's bound and how to commit the table: benchmarks/README.md, "Tuning the quantized kernels' launch
   configs"). Like 1-4, not run on a GPU yet.

    python -m tokenmill.benchmarks.gpu_quant --out benchmarks/results/h200
    python -m tokenmill.benchmarks.gpu_quant --skip-decode --skip-fixed   # kernels and checks only
    python -m tokenmill.benchmarks.gpu_quant --sweep --out DIR            # DIR/nvidia-h200.json on the H200
"""

from __future__ import annotations

import argparse
import dataclasses
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
# "auto": the bf16 baseline; "fp8-fused": fp8 with KernelConfig.fp8_skinny (kernels/fp8_gemv.py at <= 16 tokens)
DECODE_FORMATS = ("auto", "int8", "int4", "fp8", "fp8-fused")


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
    from tokenmill.kernels.config import KernelConfig
    from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    fused = quantization == "fp8-fused"
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device="cuda",
                                    quantization="fp8" if fused else quantization,  # type: ignore[arg-type]
                                    kernels=KernelConfig(fp8_skinny=fused),
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


def _release() -> None:
    """Give the device memory of engines no longer referenced back (call it after the function that held the
    engine has returned: a reference still held, even by a caller's local, keeps the whole KV cache alive)."""
    gc.collect()
    torch.cuda.empty_cache()


def kv_blocks(model: str) -> dict[str, Any]:
    """KV blocks of bf16-weight engines with a bf16 and an fp8 cache at the same memory (see the docstring)."""
    out: dict[str, Any] = {}
    for kv in ("auto", "fp8"):
        out[kv] = _kv_blocks_of(model, kv)
        _release()
    out["fp8_kv_blocks_ratio"] = out["fp8"]["num_blocks"] / out["auto"]["num_blocks"]
    return out


def _kv_blocks_of(model: str, kv: str) -> dict[str, Any]:
    """One engine's KV blocks with KV cache dtype `kv` (the engine is dropped on return)."""
    from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device="cuda",
                                    kv_cache_dtype=kv,  # type: ignore[arg-type]
                                    cuda_graphs=False, max_model_len=4096,
                                    cache=CacheConfig(gpu_memory_utilization=0.9),
                                    scheduler=SchedulerConfig(max_num_seqs=4096)))
    r = engine.runner
    useful = r.config.scheduler.max_num_seqs * -(-r.max_model_len // r.block_size)
    if r.num_blocks >= useful:
        raise AssertionError(f"kv {kv}: {r.num_blocks} blocks hit the useful-blocks cap; raise max_num_seqs")
    return {"num_blocks": r.num_blocks, "bytes_per_block": r.bytes_per_block,
            "kv_bytes": r.num_blocks * r.bytes_per_block}


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



# ---- the launch-config sweep of the weight-only kernels (`--sweep`): kernels/configs/<device>.json ------------

SWEEP_FORMATS: dict[str, tuple[int, int | None, str, torch.dtype]] = {
    # table key (kernels/tuned.format_key) -> (bits, group size (None: per channel), kind, scale dtype), in sweep
    # order (a budget stop keeps the first ones): GPTQ / AWQ / INT8 first, then GGUF Q4_0, Q4_1, Q8_0, the rest
    "int4-g128-sym": (4, 128, "sym", torch.float16),
    "int8-ch-sym": (8, None, "sym", torch.float32),
    "int4-g128-zp": (4, 128, "zp", torch.float16),
    "int4-g32-sym": (4, 32, "sym", torch.float16),  # also GGUF Q4_0
    "int4-g32-min": (4, 32, "min", torch.float16),  # GGUF Q4_1
    "int8-g32-sym": (8, 32, "sym", torch.float16),  # GGUF Q8_0
    "int4-g64-sym": (4, 64, "sym", torch.float16),
    "int4-g64-zp": (4, 64, "zp", torch.float16),
    "int4-g32-zp": (4, 32, "zp", torch.float16),
}
TINY_SHAPES = {"qkv": (40, 128), "down": (24, 96)}  # (N, K): the CPU test hook (`--shapes tiny`, interpreter)
# The skinny entry point batch-1 decode launches for each projection (the layer's fused path: RMSNorm -> qkv, o,
# RMSNorm -> gate_up, SwiGLU -> down); the prologue changes the compiled kernel, so a skinny cell is timed through it.
# The tiled kernel has no prologue: its cells, and projections not named here, time the plain entry point.
DECODE_PROLOGUE = {"qkv": "norm", "o": "plain", "gate_up": "norm", "down": "silu"}
ROTATE_BYTES = 256 << 20  # weight copies a timed graph cycles through: several L2s (50 MiB), so every launch is cold
GRAPH_LAUNCHES = 64  # launches captured in one timed graph
NORM_EPS = 1e-5
SKINNY_ROWS = (1, 8, 16)
TILED_ROWS = (64, 512)
SWEEP_TOL = 1e-2  # norm-wise relative error vs the fp32 reference above which a candidate is rejected
NOISE = 0.97  # a candidate replaces the default rule only when at least 3% faster (else the table keeps the rule)

Candidate = Any  # tuned.QuantSkinnyConfig | tuned.GemmConfig


def random_packed(fmt: str, n: int, k: int, dev: torch.device, seed: int = 0) -> Any:
    """A random PackedWeight of table format `fmt` [n, k] with y = x @ W.T of O(1) for unit-normal x."""
    from tokenmill.kernels.quant_weight import PackedWeight

    bits, group, kind, scale_dtype = SWEEP_FORMATS[fmt]
    g = group or k
    groups = -(-k // g)
    gen = torch.Generator(device=dev).manual_seed(seed)
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=gen, device=dev, dtype=torch.int8)
    else:
        q = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, device=dev, dtype=torch.int32)
    scales = ((torch.rand(n, groups, generator=gen, device=dev) + 0.5) / (k**0.5 * (40 if bits == 8 else 4)))
    zeros = torch.randint(0, 16, (n, groups), generator=gen, device=dev, dtype=torch.uint8) if kind == "zp" else None
    mins = (-7.5 * scales).to(scale_dtype) if kind == "min" else None  # q * s + m centred on 0 as Q4_1 weights are
    return PackedWeight(q, scales.to(scale_dtype), zeros, None, bits, g, mins)


def _tiles(kernel: str, m: int) -> list[Candidate]:
    """Stage 1 of the search: tile shapes at a default pipeline, no split (plus the rules, added by the caller)."""
    from tokenmill.kernels.tuned import GemmConfig, QuantSkinnyConfig

    if kernel == "tiled":
        shapes = ([(64, 64, 64), (64, 128, 64), (64, 64, 128), (32, 64, 128), (64, 128, 128), (64, 256, 64)]
                  if m <= 64 else
                  [(128, 128, 64), (128, 256, 64), (128, 128, 128), (64, 128, 128), (128, 64, 128), (64, 256, 64)])
        return [GemmConfig(bm, bn, bk, num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3)
                for bm, bn, bk in shapes]
    if m == 1:  # FMA tiles of <= 8192 accumulators (64 fp32 registers a thread at 4 warps), then tl.dot ones
        fma = [(16, 256), (16, 512), (8, 512), (32, 256), (8, 1024)]
        return ([QuantSkinnyConfig(bn, bk, 4, 3 if bk >= 512 else 4, use_dot=False) for bn, bk in fma]
                + [QuantSkinnyConfig(bn, bk, 4, 4) for bn, bk in ((16, 256), (32, 256))])
    dot = [(16, 256), (16, 512), (32, 256), (64, 128), (32, 512), (64, 256), (16, 1024)]
    return [QuantSkinnyConfig(bn, bk, 4, 3 if bk >= 512 else 4) for bn, bk in dot]


def _plane_tiles(cell: _Cell) -> list[Candidate]:
    """M = 1: the FMA variant by planes of int32 words (kernels/quant_gemv.py planes_fma) at tiles of 2048-8192 words
    (one accumulator a word: a tile holds 8x (INT4) or 4x (INT8) the columns of the plain FMA one)."""
    from tokenmill.kernels.tuned import QuantSkinnyConfig

    if cell.kernel != "skinny" or cell.m != 1:
        return []
    tiles = [(16, 1024), (32, 512), (32, 1024), (64, 512), (16, 2048), (64, 1024)]
    per_word = 32 // cell.w.bits
    return [QuantSkinnyConfig(bn, bk * per_word // 8, 4, 3, use_dot=False, planes=True) for bn, bk in tiles]


def _magic_tiles(cell: _Cell) -> list[Candidate]:
    """INT4 in groups of 128 (GPTQ / AWQ), every M: the variants whose fields become floats by their bits
    (kernels/quant_gemv.py magic_dot), K steps of whole 128-column segments; skinny 6 tiles, tiled 3."""
    from tokenmill.kernels.tuned import GemmConfig, QuantSkinnyConfig

    bits, group, kind, _ = SWEEP_FORMATS[cell.fmt]
    if bits != 4 or not group or group % 128 or kind == "min":
        return []
    if cell.kernel == "tiled":
        shapes = [(64, 64, 128), (64, 128, 128), (32, 128, 256)] if cell.m <= 64 else \
            [(128, 128, 128), (128, 64, 128), (64, 128, 256)]
        return [GemmConfig(bm, bn, bk, num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3, magic=True)
                for bm, bn, bk in shapes]
    tiles = [(16, 256), (32, 256), (64, 256), (16, 512), (32, 512), (64, 128)]
    return [QuantSkinnyConfig(bn, bk, 4, 3, planes=True) for bn, bk in tiles]


def _pipelines(best: Candidate) -> list[Candidate]:
    """Stage 2: the best tile at num_warps 2 / 4 / 8 x num_stages 2..4 (tiled: 4 / 8)."""
    warps = (4, 8) if hasattr(best, "block_m") else (2, 4, 8)
    return [dataclasses.replace(best, num_warps=nw, num_stages=ns, split_k=1) for nw in warps for ns in (2, 3, 4)]


def _splits(best: Candidate) -> list[Candidate]:
    """Stage 3: the best tile and pipeline with K cut into 2, 4 or 8 slices."""
    return [dataclasses.replace(best, split_k=s) for s in (2, 4, 8)]


def _tiny_grid(kernel: str, m: int) -> list[Candidate]:
    """`--grid tiny` (the CPU test): two tiles small enough for the interpreter."""
    from tokenmill.kernels.tuned import GemmConfig, QuantSkinnyConfig

    if kernel == "tiled":
        return [GemmConfig(16, 16, 32, group_m=2), GemmConfig(32, 16, 32, group_m=2)]
    return [QuantSkinnyConfig(16, 32, 4, 2, use_dot=m > 1), QuantSkinnyConfig(8, 32, 4, 2)]


def _prologue(kernel: str, proj: str) -> str:
    """The entry point a cell is timed through: decode's for skinny cells (DECODE_PROLOGUE), plain for tiled ones."""
    return DECODE_PROLOGUE.get(proj, "plain") if kernel == "skinny" else "plain"


def _operands(prologue: str, m: int, k: int, dev: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The activations of an entry point with K input columns: (x [M, K],) plain; (h [M, K], residual [M, K],
    norm weight [K]) norm; (gate_up [M, 2K],) silu."""
    if prologue == "norm":
        return (torch.randn(m, k, device=dev, dtype=dtype), torch.randn(m, k, device=dev, dtype=dtype),
                (1 + 0.1 * torch.randn(k, device=dev)).to(dtype))
    if prologue == "silu":
        return (torch.randn(m, 2 * k, device=dev, dtype=dtype),)
    return (torch.randn(m, k, device=dev, dtype=dtype),)


def _entry_reference(prologue: str, ops: tuple[torch.Tensor, ...], w: Any) -> torch.Tensor:
    """The entry point's output in fp32 (its kernels' torch references on fp32 inputs)."""
    from tokenmill.kernels.quant_gemv import quant_add_rmsnorm_matmul_ref, quant_silu_mul_matmul_ref
    from tokenmill.kernels.quant_weight import quant_matmul_ref

    f32 = tuple(t.float() for t in ops)
    if prologue == "norm":
        return quant_add_rmsnorm_matmul_ref(f32[0], f32[1], f32[2], NORM_EPS, w)[0].float()
    if prologue == "silu":
        return quant_silu_mul_matmul_ref(f32[0], w).float()
    return quant_matmul_ref(f32[0], w).float()


def _launch_fn(kernel: str, prologue: str, ops: tuple[torch.Tensor, ...], w: Any, cfg: Candidate | None) -> Any:
    """A closure launching the cell's entry point once; it returns the product y [M, N]."""
    from tokenmill.kernels.quant_gemm import quant_matmul
    from tokenmill.kernels.quant_gemv import quant_add_rmsnorm_matmul, quant_silu_mul_matmul, quant_skinny_matmul

    if kernel == "tiled":
        return lambda: quant_matmul(ops[0], w, config=cfg)
    if prologue == "norm":
        return lambda: quant_add_rmsnorm_matmul(ops[0], ops[1], ops[2], NORM_EPS, w, config=cfg)[0]
    if prologue == "silu":
        return lambda: quant_silu_mul_matmul(ops[0], w, config=cfg)
    return lambda: quant_skinny_matmul(ops[0], w, config=cfg)


def _default(kernel: str, m: int, w: Any) -> Candidate:
    """The config the launcher picks without a table (the default rule), as a table class."""
    from tokenmill.kernels.gemv import SkinnyConfig, default_config
    from tokenmill.kernels.launch import num_sms
    from tokenmill.kernels.quant_gemm import default_gemm_config
    from tokenmill.kernels.tuned import QuantSkinnyConfig

    n, k = w.shape
    if kernel == "tiled":
        return default_gemm_config(m, n, k)
    rule = default_config(m, n, k, 1, num_sms(w.qweight.device))
    return QuantSkinnyConfig(**{f.name: getattr(rule, f.name) for f in dataclasses.fields(SkinnyConfig)})


def _bf16_gemv_config(m: int, w: Any) -> Candidate:
    """What the bf16 skinny kernel (kernels/gemv.py, fast on the H200) launches for this shape."""
    from tokenmill.kernels.gemv import SkinnyConfig, default_config
    from tokenmill.kernels.launch import num_sms
    from tokenmill.kernels.tuned import QuantSkinnyConfig

    n, k = w.shape
    rule = default_config(m, n, k, 2, num_sms(w.qweight.device))
    return QuantSkinnyConfig(**{f.name: getattr(rule, f.name) for f in dataclasses.fields(SkinnyConfig)})


def _compile_key(fmt: str, kernel: str, prologue: str, m: int, cfg: Candidate) -> tuple[Any, ...]:
    """Candidates that share a compiled kernel (all the shapes swept specialize alike; splits > 1 share one)."""
    return fmt, kernel, prologue, m, dataclasses.replace(cfg, split_k=min(cfg.split_k, 2))


_WORKER_WEIGHTS: dict[tuple[str, int, int], Any] = {}


# format, N, K, M, kernel, prologue, config, dtype, device type
Job = tuple[str, int, int, int, str, str, Candidate, str, str]


def _compile_one(job: Job) -> str | None:
    """In a compile worker: launch one candidate once (Triton compiles it into the shared on-disk cache)."""
    fmt, n, k, m, kernel, prologue, cfg, dtype, device = job
    dev = torch.device(device)
    if (fmt, n, k) not in _WORKER_WEIGHTS:
        _WORKER_WEIGHTS.clear()
        _WORKER_WEIGHTS[(fmt, n, k)] = random_packed(fmt, n, k, dev)
    ops = _operands(prologue, m, k, dev, getattr(torch, dtype))
    try:
        _launch_fn(kernel, prologue, ops, _WORKER_WEIGHTS[(fmt, n, k)], cfg)()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # reported again, and recorded, when the main process runs it
        return f"{type(e).__name__}: {e}"
    return None


class _Precompiler:
    """Compiles candidates in parallel processes ahead of their timing (compiling is most of a sweep's time:
    several hundred kernels at ~0.5-1 s each); the timing process then loads them from Triton's cache.
    workers = 0: none (the sweep's default under the interpreter, where nothing compiles)."""

    def __init__(self, workers: int) -> None:
        self.pool: Any = None
        self.done: set[tuple[Any, ...]] = set()
        if workers > 0:
            import concurrent.futures
            import multiprocessing

            self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

    def run(self, jobs: list[Job], timeout_s: float) -> list[str | None]:
        """Compile the jobs not seen before (one per compiled kernel); each one's error or None, in order."""
        fresh: dict[tuple[Any, ...], Job] = {}
        for job in jobs:
            key = _compile_key(job[0], job[4], job[5], job[3], job[6])
            if key not in self.done:
                fresh.setdefault(key, job)
        self.done |= set(fresh)
        if self.pool is None or not fresh:
            return []
        try:
            errors = list(self.pool.map(_compile_one, list(fresh.values()), timeout=max(1.0, timeout_s)))
            failed = [e for e in errors if e is not None]
            if failed:  # the timing process runs them again and records why they fail
                print(f"sweep: {len(failed)} of {len(errors)} kernels failed in the compile workers, e.g. "
                      f"{failed[0][:300]}", flush=True)
            return errors
        except Exception as e:  # a timeout or a dead worker: the timing process compiles what is missing
            print(f"sweep: precompile stopped ({type(e).__name__}: {e}); compiling in-process", flush=True)
            self.close()  # no worker may launch kernels on the GPU while candidates are timed
            self.pool = None
            return []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


# A timer takes the launches of one candidate, one per weight copy (the same product on distinct copies), and
# returns ms per launch.


def graph_timer(fns: list[Any], warmup_ms: int, rep_ms: int) -> float:
    """Median ms of one launch, from CUDA-graph replays of GRAPH_LAUNCHES launches cycling through the copies: each
    launch reads its weight cold (the copies span several L2s) and no host launch cost is in the figure, as in the
    decode step's graph. do_bench times one eager launch after an L2 flush; where a Triton launcher's host time
    exceeds the flush kernel's, the GPU idles before the kernel and the gap is in its figure (the suspected cause
    of the ninth session's drift between calls: benchmarks/README.md)."""
    import statistics

    for fn in fns:
        fn()  # compiled and allocated before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_LAUNCHES):
            fns[i % len(fns)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay_ms() -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    first = max(replay_ms(), 1e-3)
    for _ in range(max(1, int(warmup_ms / first))):
        replay_ms()
    times = [replay_ms() for _ in range(max(5, min(1000, int(rep_ms / first))))]
    return statistics.median(times) / GRAPH_LAUNCHES


def cuda_timer(fns: list[Any], warmup_ms: int, rep_ms: int) -> float:
    """Median ms of one eager launch, L2 flushed before each run (triton.testing.do_bench, as the kernel tables)."""
    from triton.testing import do_bench

    return float(do_bench(fns[0], warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def wall_timer(fns: list[Any], warmup_ms: int, rep_ms: int) -> float:
    """One wall-clock run in ms: the plumbing of a sweep under the interpreter (the figure means nothing)."""
    import time

    t0 = time.perf_counter()
    fns[0]()
    return 1e3 * (time.perf_counter() - t0)


TIMERS = {"graph": graph_timer, "do_bench": cuda_timer}


def _copies_needed(nbytes: int, dev: torch.device) -> int:
    """Weight copies a timed graph cycles through: ROTATE_BYTES of them on CUDA (at least 2), one elsewhere."""
    return max(2, -(-ROTATE_BYTES // max(1, nbytes))) if dev.type == "cuda" else 1


def _packed_bytes(w: Any) -> int:
    parts = (w.qweight, w.scales, w.zeros, w.mins, w.perm)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclasses.dataclass
class _Cell:
    """One (kernel, format, shape, M) of the sweep: its operands, reference and every candidate's outcome."""

    kernel: str
    fmt: str
    proj: str
    n: int
    k: int
    m: int
    ops: tuple[torch.Tensor, ...]  # the entry point's activations (_operands)
    copies: list[Any]  # the weight, then the copies a timed graph cycles through (the first is the checked one)
    ref: torch.Tensor
    default: Candidate
    times: dict[Candidate, float] = dataclasses.field(default_factory=dict)
    rejected: dict[Candidate, str] = dataclasses.field(default_factory=dict)
    eager_ms: dict[Candidate, float] = dataclasses.field(default_factory=dict)  # do_bench of the default, winner

    @property
    def w(self) -> Any:
        return self.copies[0]

    @property
    def prologue(self) -> str:
        return _prologue(self.kernel, self.proj)

    def best(self) -> Candidate:
        return min(self.times, key=self.times.__getitem__) if self.times else self.default

    def launches(self, cfg: Candidate) -> list[Any]:
        return [_launch_fn(self.kernel, self.prologue, self.ops, w, cfg) for w in self.copies]

    def measure(self, cfg: Candidate, timer: Any, bench: tuple[int, int]) -> None:
        """Check cfg's output against the reference, then time it (a failure or a wrong output: rejected)."""
        if cfg in self.times or cfg in self.rejected:
            return
        fns = self.launches(cfg)
        try:
            err = float((fns[0]().float() - self.ref).norm() / self.ref.norm())
        except Exception as e:  # e.g. out of shared memory: not a candidate on this device
            self.rejected[cfg] = f"{type(e).__name__}: {str(e)[:200]}"
            return
        if not err <= SWEEP_TOL:
            self.rejected[cfg] = f"relative error {err:.2e} vs the reference"
            print(f"sweep: WRONG OUTPUT {self.kernel} {self.fmt} {self.proj} M={self.m} {cfg}: {err:.2e}", flush=True)
            return
        try:
            self.times[cfg] = timer(fns, *bench)
        except Exception as e:  # e.g. a launch that cannot be captured: reported, not a candidate
            self.rejected[cfg] = f"timing failed: {type(e).__name__}: {str(e)[:200]}"


def _cells(fmt: str, shapes: dict[str, tuple[int, int]], skinny_rows: tuple[int, ...], tiled_rows: tuple[int, ...],
           dev: torch.device, dtype: torch.dtype) -> list[_Cell]:
    cells = []
    for proj, (n, k) in shapes.items():
        w = random_packed(fmt, n, k, dev)
        copies = [w, *(random_packed(fmt, n, k, dev, seed=i) for i in range(1, _copies_needed(_packed_bytes(w), dev)))]
        for kernel, rows in (("skinny", skinny_rows), ("tiled", tiled_rows)):
            for m in rows:
                entry = _prologue(kernel, proj)
                ops = _operands(entry, m, k, dev, dtype)
                cells.append(_Cell(kernel, fmt, proj, n, k, m, ops, copies, _entry_reference(entry, ops, w),
                                   _default(kernel, m, w)))
    return cells


def _stage_candidates(cell: _Cell, stage: int, tiny: bool) -> list[Candidate]:
    if tiny:
        return [*_tiny_grid(cell.kernel, cell.m), cell.default] if stage == 0 else []
    if stage == 0:
        extra = [_bf16_gemv_config(cell.m, cell.w)] if cell.kernel == "skinny" else []
        return [cell.default, *extra, *_tiles(cell.kernel, cell.m), *_plane_tiles(cell), *_magic_tiles(cell)]
    best = cell.best()
    return _pipelines(best) if stage == 1 else _splits(best)


def sweep(dev: torch.device, dtype: torch.dtype, formats: list[str], shapes: dict[str, tuple[int, int]],
          skinny_rows: tuple[int, ...], tiled_rows: tuple[int, ...], *, tiny: bool, budget_s: float,
          bench: tuple[int, int], compile_workers: int, timer_name: str = "graph") -> tuple[list[_Cell], bool]:
    """Per format (in order): every cell's stage-0 candidates (the rules, the tiles), then the best tile's
    pipelines, then its K splits; each stage precompiled in parallel, then checked and timed cell by cell
    (`timer_name` of TIMERS on CUDA; one wall-clock run elsewhere). On CUDA each cell's default and winner are also
    timed by do_bench (Cell.eager_ms: what the figures of earlier sweeps were). Stops at the first cell past
    `budget_s` (the cells done so far are kept). Returns (cells, complete)."""
    import time

    t0 = time.monotonic()
    timer = TIMERS[timer_name] if dev.type == "cuda" else wall_timer
    pre = _Precompiler(compile_workers)
    done: list[_Cell] = []
    try:
        for fmt in formats:
            cells = _cells(fmt, shapes, skinny_rows, tiled_rows, dev, dtype)
            for stage in range(3):
                plans = [(c, _stage_candidates(c, stage, tiny)) for c in cells]
                pre.run([(c.fmt, c.n, c.k, c.m, c.kernel, c.prologue, cfg, str(dtype).removeprefix("torch."), dev.type)
                         for c, cands in plans for cfg in cands], budget_s - (time.monotonic() - t0))
                for cell, cands in plans:
                    for cfg in cands:
                        if time.monotonic() - t0 > budget_s:
                            print(f"sweep: budget of {budget_s:.0f} s spent; writing what was measured", flush=True)
                            return done + [c for c in cells if c.times], False
                        cell.measure(cfg, timer, bench)
            for cell in cells:
                if dev.type == "cuda" and cell.times:
                    for cfg in {cell.default, _winner(cell)} & set(cell.times):
                        cell.eager_ms[cfg] = cuda_timer(cell.launches(cfg), *bench)
                cell.copies = cell.copies[:1]  # the rotation's memory back before the next format
            done += cells
            print(f"sweep: {fmt} done at {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        pre.close()
    return done, True


def _winner(cell: _Cell) -> Candidate:
    """The fastest checked candidate, unless the default rule is within the noise margin of it."""
    best = cell.best()
    if cell.default in cell.times and cell.times[best] > NOISE * cell.times[cell.default]:
        return cell.default
    return best


def sweep_table(cells: list[_Cell], device: str, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
    """The tuned table (kernels/tuned.py's layout) of the cells' winners, over `base` (an earlier sweep's table
    of the same device and dtype: entries measured now replace its ones)."""
    from tokenmill.kernels import tuned

    table: dict[str, Any] = base or {"version": tuned.VERSION, "device": device,
                                      "dtype": str(dtype).removeprefix("torch."), "skinny": {}, "tiled": {}}
    table["source"] = "python -m tokenmill.benchmarks.gpu_quant --sweep (do_bench medians, L2 flushed)"
    for cell in cells:
        if not cell.times:
            continue
        shape = table[cell.kernel].setdefault(cell.fmt, {}).setdefault(f"{cell.n}x{cell.k}", {})
        shape[str(cell.m)] = dataclasses.asdict(_winner(cell))
    return table


def _cfg_text(cfg: Candidate) -> str:
    d = dataclasses.asdict(cfg)
    tile = "x".join(str(d[f]) for f in ("block_m", "block_n", "block_k") if f in d)
    planes = (" magic" if d.get("use_dot", True) else " planes") if d.get("planes") else ""
    extra = ("" if d.get("use_dot", True) else " fma") + planes + (" magic" if d.get("magic") else "")
    return f"{tile} w{d['num_warps']} s{d['num_stages']} sk{d['split_k']}{extra}"


def sweep_md(cells: list[_Cell], bf16_ms: dict[tuple[str, int], float], complete: bool, timer_note: str) -> str:
    lines = [f"Timer: {timer_note}. {'Complete' if complete else 'STOPPED AT THE BUDGET: partial'}; a winner within "
             f"{100 * (1 - NOISE):.0f}% of the default rule is not taken (the table keeps the rule). Weight GB/s: the "
             "packed weight's bytes over the table config's time.", "",
             "| kernel | format | proj | entry | M | table config | ms | weight GB/s | default config | default ms | "
             "bf16 cuBLAS ms | x default | x cuBLAS | do_bench ms (table / default) | tried / rejected |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if not c.times:
            continue
        win, base = _winner(c), bf16_ms[(c.proj, c.m)]
        d_ms = c.times.get(c.default)
        d_text = f"{d_ms:.4f}" if d_ms is not None else "rejected"
        vs_default = f"{d_ms / c.times[win]:.2f}" if d_ms is not None else "-"
        eager = " / ".join(f"{c.eager_ms[cfg]:.4f}" if cfg in c.eager_ms else "-" for cfg in (win, c.default))
        gbs = _packed_bytes(c.w) / c.times[win] / 1e6
        lines.append(f"| {c.kernel} | {c.fmt} | {c.proj} | {c.prologue} | {c.m} | {_cfg_text(win)} | "
                     f"{c.times[win]:.4f} | {gbs:.0f} | {_cfg_text(c.default)} | {d_text} | {base:.4f} | "
                     f"{vs_default} | {base / c.times[win]:.2f} | {eager} | "
                     f"{len(c.times) + len(c.rejected)} / {len(c.rejected)} |")
    rejected = [(c, cfg, why) for c in cells for cfg, why in c.rejected.items()]
    if rejected:
        lines += ["", "Rejected candidates (not timed):", ""]
        lines += [f"- {c.kernel} {c.fmt} {c.proj} M={c.m} {_cfg_text(cfg)}: {why}" for c, cfg, why in rejected]
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace) -> None:
    """`--sweep`: the tuned table DIR/<device slug>.json plus gpu_quant_sweep.{json,md} (every timing)."""
    import json
    import os

    if not torch.cuda.is_available():  # the CPU test of the plumbing: the interpreter, set before the kernels load
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tokenmill.kernels import tuned

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    shapes = TINY_SHAPES if args.shapes == "tiny" else SHAPES
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    cells, complete = sweep(dev, dtype, args.formats, shapes, tuple(args.skinny_rows), tuple(args.tiled_rows),
                            tiny=args.grid == "tiny", budget_s=args.sweep_budget_s,
                            bench=(args.bench_warmup_ms, args.bench_rep_ms),
                            compile_workers=args.compile_workers if args.compile_workers is not None else
                            12 if dev.type == "cuda" else 0, timer_name=args.timer)
    timer = TIMERS[args.timer] if dev.type == "cuda" else wall_timer
    bf16_ms = {}
    for proj, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(_copies_needed(n * k * 2, dev))]
        for m in sorted({c.m for c in cells if c.proj == proj}):
            x = torch.randn(m, k, device=dev, dtype=dtype)
            fns = [lambda x=x, w=w: F.linear(x, w) for w in ws]
            bf16_ms[(proj, m)] = timer(fns, args.bench_warmup_ms, args.bench_rep_ms)
        del ws
    path = tuned.table_path(device, args.out)
    base = None
    if path.exists():  # a previous call's table of this device (e.g. the other half of --formats): keep its entries
        base = json.loads(path.read_text())
        tuned.load_table(path)  # fails, naming the file, if it is malformed
        if base.get("dtype") != args.dtype:
            raise SystemExit(f"{path} is a {base.get('dtype')} table; this sweep is {args.dtype}")
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sweep_table(cells, device, dtype, base), indent=1) + "\n")
    tuned.load_table(path)  # the written table parses as the launchers will read it
    if dev.type != "cuda":
        note = "one wall-clock run under the Triton interpreter"
    elif args.timer == "graph":
        note = (f"median of CUDA-graph replays of {GRAPH_LAUNCHES} launches over weight copies of >= "
                f"{ROTATE_BYTES >> 20} MiB (every weight read cold, no host launch time; 'do_bench' columns: one eager "
                "launch after an L2 flush, the earlier sweeps' timer)")
    else:
        note = "do_bench median, L2 flushed"
    note += (f"; {args.dtype} activations, random weights of each format, no bias; skinny cells through the entry "
             f"point batch-1 decode launches ({', '.join(f'{p}: {e}' for p, e in DECODE_PROLOGUE.items())}), "
             "tiled cells and bf16 cuBLAS y = x @ W.T")
    payload = {"benchmark": "gpu_quant_sweep", "table": path.name, "complete": complete, "dtype": args.dtype,
               "cells": [{"kernel": c.kernel, "format": c.fmt, "proj": c.proj, "n": c.n, "k": c.k, "m": c.m,
                          "default": dataclasses.asdict(c.default), "winner": dataclasses.asdict(_winner(c)),
                          "bf16_cublas_ms": bf16_ms[(c.proj, c.m)],
                          "prologue": c.prologue, "timer": args.timer if dev.type == "cuda" else "wall",
                          "times_ms": [[dataclasses.asdict(cfg), t] for cfg, t in c.times.items()],
                          "do_bench_ms": [[dataclasses.asdict(cfg), t] for cfg, t in c.eager_ms.items()],
                          "rejected": [[dataclasses.asdict(cfg), why] for cfg, why in c.rejected.items()]}
                         for c in cells if c.times]}
    write_results(args.out, "gpu_quant_sweep", payload, sweep_md(cells, bf16_ms, complete, note))
    print(f"sweep: wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-fixed", action="store_true", help="no KV-block count nor fixed 1000/1000 runs")
    ap.add_argument("--fixed-requests", type=int, default=512)
    ap.add_argument("--decode-formats", nargs="+", choices=list(DECODE_FORMATS), default=list(DECODE_FORMATS),
                    help="engines of the batch-1 decode run (auto: the bf16 baseline)")
    sw = ap.add_argument_group("--sweep: tune the weight-only kernels' launch configs (nothing else runs)")
    sw.add_argument("--sweep", action="store_true", help="write DIR/<device slug>.json (the tuned table) and "
                    "gpu_quant_sweep.{json,md} into --out DIR")
    sw.add_argument("--sweep-budget-s", type=float, default=420.0,
                    help="stop at the first cell past this many seconds and write what was measured")
    sw.add_argument("--formats", nargs="+", choices=list(SWEEP_FORMATS), default=list(SWEEP_FORMATS))
    sw.add_argument("--shapes", choices=("llama3-8b", "tiny"), default="llama3-8b",
                    help="tiny: two small shapes (the CPU test under the Triton interpreter)")
    sw.add_argument("--grid", choices=("full", "tiny"), default="full", help="tiny: two candidates a cell (tests)")
    sw.add_argument("--skinny-rows", type=int, nargs="*", default=list(SKINNY_ROWS))
    sw.add_argument("--tiled-rows", type=int, nargs="*", default=list(TILED_ROWS))
    sw.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    sw.add_argument("--timer", choices=tuple(TIMERS), default="graph",
                    help="CUDA: graph = launches replayed from a CUDA graph over weight copies bigger than L2 (as "
                    "decode runs them); do_bench = one eager launch after an L2 flush (host launch time can show)")
    sw.add_argument("--bench-warmup-ms", type=int, default=5)
    sw.add_argument("--bench-rep-ms", type=int, default=25)
    sw.add_argument("--compile-workers", type=int, default=None,
                    help="processes compiling each stage's candidates ahead of their timing (default: 12 on CUDA, "
                         "0 under the interpreter)")
    args = ap.parse_args(argv)
    if args.sweep:
        run_sweep(args)
        return
    dev = torch.device("cuda")
    payload: dict[str, Any] = {"benchmark": "gpu_quant", "model": args.model,
                               "gpu": torch.cuda.get_device_name(dev)}
    payload["errors"] = check_kernels(dev)
    payload["fp8_kv_check"] = check_fp8_kv(dev)
    if not args.skip_kernels:
        payload["kernels"] = kernel_table(dev)
    if not args.skip_decode:
        payload["decode"] = {q: decode_b1(args.model, q, args.steps) for q in args.decode_formats}
    if not args.skip_fixed:
        payload["kv_blocks"] = kv_blocks(args.model)  # (its engines released)
        payload["fixed"] = {}
        for name, q, kv in (("bf16", "auto", "auto"), ("fp8_fp8kv", "fp8", "fp8")):
            payload["fixed"][name] = fixed_run(args.model, q, kv, args.fixed_requests)
            _release()
        f = payload["fixed"]
        payload["fp8_over_bf16"] = f["fp8_fp8kv"]["output_tok_per_s"] / f["bf16"]["output_tok_per_s"]
    write_results(args.out, "gpu_quant", payload, table_md(payload))
    summary.record_file(args.out / "gpu_quant.json")


if __name__ == "__main__":
    main()
