"""GPU kernel benchmark (H200): `python benchmarks/gpu_kernels.py --out DIR`.

Sections (each guarded: a failure prints its traceback and the script goes on):
  copy     device copy bandwidth (torch copy of a 2 GiB buffer; bytes read + written) = the ceiling
  decode   paged decode attention, Llama-3-8B heads (32 q / 8 kv, D=128, bf16, block 16), batch x context
           sweep; achieved K+V bandwidth and % of copy; a small autotune of (BLOCK_N, warps, stages) first,
           and a num_splits sensitivity check at batch 1
  prefill  causal prefill of one sequence (4k/8k/16k tokens) TFLOP/s (flops = 4 * T^2/2 * D * Hq), small
           autotune of (BLOCK_M, BLOCK_N, warps, stages), vs torch SDPA (flash) on the same shapes
  small    rmsnorm / add_rmsnorm / silu_and_mul bandwidth as % of copy (and torch eager for reference)
Every kernel is checked against its reference in bf16 before it is timed. Timing: `bench_ms`, median over
replays of a CUDA graph of back-to-back calls (as the engine runs decode), rotating several input sets
when one set is smaller than 4x L2.
Writes DIR/gpu_kernels.json and DIR/gpu_kernels.md and prints the Markdown last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Row = dict[str, Any]

GIB = 1 << 30
# Problem sizes (module globals so that --smoke can shrink them for a CPU/interpreter dry run).
DEV = "cuda"
HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
COPY_BYTES = 2 * GIB
DECODE_BATCHES = [1, 8, 32, 128, 256]
DECODE_CONTEXTS = [1024, 4096, 16384, 32768]
DECODE_TUNE_POINTS = [(1, 32768), (32, 4096), (128, 4096)]  # first one also gets the num_splits check
DECODE_CHECK_LENS = [1000, 4097, 16, 31, 2048, 8191, 1, 17]
KV_LIMIT_BYTES = 60e9
SPLITS_POINTS = [(1, 16384), (1, 32768), (8, 32768)]  # num_splits sensitivity
SPLITS_TRIED = [8, 16, 24, 33, 40, 50, 66, 99]
PREFILL_LENS = [4096, 8192, 16384]
PREFILL_CHECK = ([512, 700, 1, 1], [2048, 700, 3000, 17])  # (query lens, seq lens)
SMALL_SHAPES = [(8192, 4096), (8192, 14336 * 2)]
SMOKE = False


def apply_smoke() -> None:
    """Tiny shapes, fp16 (the interpreter's bf16 dot is wrong), CPU when there is no GPU: checks the script's
    logic end to end in seconds, timings are meaningless."""
    global DEV, HQ, HKV, HEAD_DIM, DTYPE, COPY_BYTES, DECODE_BATCHES, DECODE_CONTEXTS, DECODE_TUNE_POINTS
    global DECODE_CHECK_LENS, PREFILL_LENS, PREFILL_CHECK, SPLITS_POINTS, SMALL_SHAPES, SMOKE
    SMOKE = True
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    HQ, HKV, HEAD_DIM, DTYPE = 8, 2, 32, torch.float16
    COPY_BYTES = 1 << 20
    DECODE_BATCHES, DECODE_CONTEXTS = [1, 3], [40, 300]
    DECODE_TUNE_POINTS = [(1, 300), (3, 40)]
    DECODE_CHECK_LENS = [100, 17, 16, 1]
    PREFILL_LENS = [48, 96]
    SPLITS_POINTS = [(1, 300)]
    PREFILL_CHECK = ([20, 30, 1, 1], [50, 30, 70, 17])
    SMALL_SHAPES = [(4, 64), (3, 200)]


class Ctx:
    """Shared state of one benchmark run."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline  # time.perf_counter() value after which optional work is skipped
        self.copy_bw: float | None = None  # bytes/s
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) if DEV == "cuda" else 0
        self.l2_bytes = int(l2 or 50 * 1024 * 1024)
        self.tables: list[tuple[str, list[str], list[list[str]]]] = []  # (title, header, rows)
        self.notes: list[str] = []

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()


def bench_ms(fn: Callable[[int], object], n_sets: int, rep: int = 15) -> float:
    """Median ms of one fn(i) call, i cycling over n_sets input sets, timed inside a CUDA graph.

    The engine runs decode kernels inside CUDA graphs, so that is how they are timed: a graph of
    `calls` back-to-back launches (>= ~2 ms of work, a multiple of n_sets) is replayed `rep` times and
    each replay's time is divided by `calls`. Host launch overhead is therefore excluded, the small gap
    between kernels inside a graph is included; rotating input sets keep L2 from serving the data."""
    if SMOKE:  # no CUDA graphs under the interpreter: one timed call
        fn(0)
        t0 = time.perf_counter()
        fn(min(1, n_sets - 1))
        return (time.perf_counter() - t0) * 1e3
    for i in range(n_sets):  # compile and warm up outside the capture
        fn(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n_sets):
        fn(i)
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t0) * 1e3 / n_sets
    rounds = max(1, min(64, math.ceil(2.0 / max(eager_ms, 1e-3) / n_sets)))
    calls = rounds * n_sets
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return float(sorted(times)[len(times) // 2])


def eager_ms(fn: Callable[[], object], rep: int) -> float:
    """Median ms of fn() launched eagerly, timed with CUDA events (for calls long enough that launch
    overhead is noise)."""
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


def n_rotations(bytes_per_call: int, l2_bytes: int, cap: int = 8) -> int:
    return max(1, min(cap, math.ceil(4 * l2_bytes / max(1, bytes_per_call))))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def pct(bw: float, ctx: Ctx) -> str:
    return f"{100 * bw / ctx.copy_bw:.0f}%" if ctx.copy_bw else "n/a"


# ---------------------------------------------------------------------------------------------------
# (a) copy bandwidth
# ---------------------------------------------------------------------------------------------------


def section_copy(ctx: Ctx) -> Row:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    # Timed eagerly: inside a CUDA graph a device-to-device copy becomes a copy-engine memcpy node (2.8 TB/s
    # measured) instead of the SM copy kernel that eager copy_ runs (4.3 TB/s), and the ceiling should be
    # what kernels can reach. One 2 GiB copy is ~1 ms, so launch overhead does not matter here.
    ms = eager_ms(lambda: dst.copy_(src), rep=30)
    nbytes = 2 * src.numel()  # read + write
    ctx.copy_bw = nbytes / (ms * 1e-3)
    ctx.tables.append(
        (
            f"Device copy ({COPY_BYTES / GIB:g} GiB, read + write)",
            ["ms", "GB/s"],
            [[f"{ms:.3f}", f"{ctx.copy_bw / 1e9:.0f}"]],
        )
    )
    return {"ms": ms, "bytes": nbytes, "gbps": ctx.copy_bw / 1e9}


# ---------------------------------------------------------------------------------------------------
# paged-attention helpers
# ---------------------------------------------------------------------------------------------------


class AttnSet:
    """One input set: queries and block tables into a shared cache pool."""

    def __init__(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor) -> None:
        self.q = q  # [T, HQ, D]
        self.block_tables = block_tables  # [B, max_blocks] int32
        self.seq_lens = seq_lens  # [B] int32
        self.qsl = qsl  # [B+1] int32
        self.out = torch.empty_like(q)


def make_sets(
    query_lens: list[int], seq_lens: list[int], pool_blocks: int, n_sets: int, gen: torch.Generator
) -> list[AttnSet]:
    """n_sets input sets whose blocks are disjoint, randomly scattered ranges of a pool of pool_blocks."""
    nb = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    per_set = sum(nb)
    if per_set * n_sets > pool_blocks:
        raise ValueError(f"pool of {pool_blocks} blocks too small for {n_sets} x {per_set}")
    perm = torch.randperm(pool_blocks, generator=gen, device="cpu")[: per_set * n_sets].to(torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    sets = []
    for r in range(n_sets):
        chunk = perm[r * per_set : (r + 1) * per_set]
        bt = torch.zeros((len(seq_lens), max(nb)), dtype=torch.int32)
        used = 0
        for i, n in enumerate(nb):
            bt[i, :n] = chunk[used : used + n]
            used += n
        q = torch.randn((sum(query_lens), HQ, HEAD_DIM), generator=gen).to(DTYPE)
        sets.append(AttnSet(q.to(DEV), bt.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), qsl.to(DEV)))
    return sets


def run_attn(
    s: AttnSet,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    config: Any = None,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    from tokenmill.kernels.paged_attention import paged_attention

    return paged_attention(
        s.q, k_pool, v_pool, s.block_tables, s.seq_lens, s.qsl, HEAD_DIM**-0.5,
        max_query_len=max_query_len, max_seq_len=max_seq_len, out=s.out, config=config,
        num_splits=num_splits, kv_scales=kv_scales,
    )  # fmt: skip


def attn_call(
    sets: list[AttnSet],
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    config: Any = None,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> Callable[[int], object]:
    """fn(i) running the attention kernel on input set i."""

    def call(i: int) -> object:
        return run_attn(sets[i], k_pool, v_pool, max_query_len, max_seq_len, config, num_splits, kv_scales)

    return call


def check_attn(
    s: AttnSet,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    config: Any = None,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> float:
    from tokenmill.kernels.attention_ref import paged_attention_ref

    s.out.fill_(float("nan"))
    out = run_attn(s, k_pool, v_pool, max_query_len, max_seq_len, config, num_splits, kv_scales).clone()
    ref = paged_attention_ref(s.q, k_pool, v_pool, s.block_tables, s.seq_lens, s.qsl, HEAD_DIM**-0.5,
                              kv_scales=kv_scales)
    err = rel_err(out, ref)
    if not err < 1e-2:  # also catches NaN
        raise AssertionError(f"paged_attention mismatch: relative error {err:.3e}")
    return err


# ---------------------------------------------------------------------------------------------------
# (b) decode
# ---------------------------------------------------------------------------------------------------


def kv_bytes(batch: int, context: int) -> int:
    return batch * context * HKV * HEAD_DIM * 2 * DTYPE.itemsize  # K + V


def section_decode(ctx: Ctx) -> Row:
    from tokenmill.kernels.paged_attention import (
        DECODE_CONFIG,
        PagedAttentionConfig,
        _num_sms,
        choose_num_splits,
    )

    gen = torch.Generator().manual_seed(0)
    num_sms = _num_sms(torch.device(DEV))
    combos = [(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS if kv_bytes(b, c) <= KV_LIMIT_BYTES]
    rot = {bc: n_rotations(kv_bytes(*bc), ctx.l2_bytes) for bc in [*combos, *DECODE_TUNE_POINTS]}
    # one pool serves every input set (sets of one benchmark point use disjoint, scattered blocks)
    need = [rot[(b, c)] * b * math.ceil(c / BLOCK_SIZE) for b, c in rot]
    need.append(sum(math.ceil(s / BLOCK_SIZE) for s in DECODE_CHECK_LENS))
    pool_blocks = max(need)
    shape = (pool_blocks, BLOCK_SIZE, HKV, HEAD_DIM)
    k_pool = torch.empty(shape, dtype=DTYPE, device=DEV).normal_()
    v_pool = torch.empty(shape, dtype=DTYPE, device=DEV).normal_()
    result: Row = {"pool_gb": 2 * k_pool.numel() * DTYPE.itemsize / 1e9}

    # correctness (default config, heuristic splits and forced splits; ragged lengths, block edges)
    lens = DECODE_CHECK_LENS
    chk = make_sets([1] * len(lens), lens, pool_blocks, 1, gen)[0]
    errs = [check_attn(chk, k_pool, v_pool, 1, max(lens), num_splits=n) for n in (None, 1, 5)]
    result["check_rel_err"] = max(errs)

    # autotune a few configs on representative points (split and unsplit paths)
    candidates = [
        DECODE_CONFIG,
        PagedAttentionConfig(16, 64, 4, 5),
        PagedAttentionConfig(16, 128, 8, 3),
        PagedAttentionConfig(16, 32, 4, 6),
        PagedAttentionConfig(16, 64, 8, 5),
        PagedAttentionConfig(16, 64, 2, 4),
        PagedAttentionConfig(16, 128, 4, 4),
        PagedAttentionConfig(16, 64, 4, 2),
        PagedAttentionConfig(16, 32, 2, 3),
        PagedAttentionConfig(16, 64, 2, 3),
    ]
    tune_sets = {(b, c): make_sets([1] * b, [c] * b, pool_blocks, rot[(b, c)], gen) for b, c in DECODE_TUNE_POINTS}
    tune_rows: list[list[str]] = []
    scores: dict[PagedAttentionConfig, float] = {}
    for cfg in candidates:
        if ctx.time_left() < 150 and cfg is not DECODE_CONFIG:
            ctx.notes.append("decode autotune cut short (time budget)")
            break
        try:
            check_attn(chk, k_pool, v_pool, 1, max(lens), config=cfg, num_splits=3)
            times = []
            for b, c in DECODE_TUNE_POINTS:
                sets = tune_sets[(b, c)]
                times.append(bench_ms(attn_call(sets, k_pool, v_pool, 1, c, cfg), len(sets)))
        except Exception as exc:  # a config that fails to compile / verify is skipped
            print(f"decode config {cfg} failed: {exc!r}", file=sys.stderr)
            continue
        scores[cfg] = math.exp(sum(math.log(t) for t in times) / len(times))
        tune_rows.append([str(cfg), *(f"{t * 1e3:.1f}" for t in times), f"{scores[cfg] * 1e3:.1f}"])
    best = min(scores, key=lambda k: scores[k]) if scores else DECODE_CONFIG
    result["best_config"] = str(best)
    result["tune"] = tune_rows
    ctx.tables.append(
        (
            "Decode autotune (us, median; geo-mean last)",
            ["config", *(f"B={b} ctx={c}" for b, c in DECODE_TUNE_POINTS), "geomean"],
            tune_rows,
        )
    )

    def timed(b: int, c: int, config: PagedAttentionConfig | None = None, splits: int | None = None) -> tuple[
            float, float]:  # fmt: skip
        """(ms, KV bytes/s) of decode attention at batch b, context c (None: the launcher's default rule)."""
        sets = tune_sets.get((b, c)) or make_sets([1] * b, [c] * b, pool_blocks, rot[(b, c)], gen)
        ms = bench_ms(attn_call(sets, k_pool, v_pool, 1, c, config, splits), len(sets))
        return ms, kv_bytes(b, c) / (ms * 1e-3)

    # num_splits sensitivity (a runtime argument: no recompiles) at batch 1 and 8, long contexts
    sens_rows: list[list[str]] = []
    for b1, c1 in SPLITS_POINTS:
        if ctx.time_left() < 120:
            ctx.notes.append(f"num_splits check stopped before B={b1} ctx={c1} (time budget)")
            break
        auto = choose_num_splits(b1 * HKV, c1, num_sms, best.block_n)
        for n in sorted({auto, *SPLITS_TRIED}):
            ms, bw = timed(b1, c1, best, n)
            label = f"{n} (auto)" if n == auto else str(n)
            sens_rows.append([str(b1), str(c1), label, str(n * b1 * HKV), f"{ms * 1e3:.1f}", f"{bw / 1e9:.0f}",
                              pct(bw, ctx)])  # fmt: skip
    result["splits_sensitivity"] = sens_rows
    ctx.tables.append(("Decode vs num_splits", ["batch", "context", "num_splits", "programs", "us", "KV GB/s",
                                                "% copy"], sens_rows))  # fmt: skip

    # the sweep
    rows: list[list[str]] = []
    sweep: list[Row] = []
    for b, c in combos:
        if ctx.time_left() < 90:
            ctx.notes.append(f"decode sweep stopped before B={b} ctx={c} (time budget)")
            break
        splits = choose_num_splits(b * HKV, c, num_sms, DECODE_CONFIG.block_n)
        ms, bw = timed(b, c)
        sweep.append({"batch": b, "context": c, "ms": ms, "kv_gbps": bw / 1e9, "splits": splits})
        rows.append([str(b), str(c), str(splits), f"{ms * 1e3:.1f}", f"{bw / 1e9:.0f}", pct(bw, ctx)])
    result["sweep"] = sweep
    ctx.tables.append(
        (f"Decode attention (Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, {DTYPE}, block {BLOCK_SIZE}), default launch rule "
         f"({DECODE_CONFIG})",
         ["batch", "context", "splits", "us", "KV GB/s", "% copy"], rows)
    )  # fmt: skip
    return result


# FP8 KV decode: (batch, context) points of serving (the fixed 1000/1000 run decodes 256 requests at 1-2k keys)
FP8_DECODE_POINTS = [(1, 4096), (32, 4096), (128, 2048), (256, 1536), (256, 4096)]


def section_decode_fp8(ctx: Ctx) -> Row:
    """Decode attention over fp8 caches against bf16: V slot-major (a plain [blocks, slots, Hkv, D] tensor) and
    dim-major (kernels/kv_cache.py new_kv_cache, the engine's), at the default decode config and wider tiles."""
    from tokenmill.kernels.attention_ref import quantize_kv_fp8
    from tokenmill.kernels.kv_cache import FP8_KV, new_kv_cache
    from tokenmill.kernels.paged_attention import DECODE_CONFIG, FP8_DECODE_CONFIG, PagedAttentionConfig

    gen = torch.Generator().manual_seed(0)
    points = FP8_DECODE_POINTS if not SMOKE else DECODE_TUNE_POINTS
    rot = {bc: n_rotations(kv_bytes(*bc) // 2, ctx.l2_bytes) for bc in points}
    pool_blocks = max(rot[(b, c)] * b * math.ceil(c / BLOCK_SIZE) for b, c in points)
    shape = (pool_blocks, BLOCK_SIZE, HKV, HEAD_DIM)
    k16 = torch.empty(shape, dtype=DTYPE, device=DEV).normal_()
    v16 = torch.empty(shape, dtype=DTYPE, device=DEV).normal_()
    scales = torch.full((2, HKV), 1.0 / 64, device=DEV)
    k8 = new_kv_cache(*shape, FP8_KV, DEV)[0]
    k8.copy_(quantize_kv_fp8(k16.float(), scales[0]))
    v8_slot = quantize_kv_fp8(v16.float(), scales[1])  # [blocks, slots, Hkv, D] in memory
    v8_dim = torch.empty((pool_blocks, HKV, HEAD_DIM, BLOCK_SIZE), dtype=FP8_KV, device=DEV).permute(0, 3, 1, 2)
    v8_dim.copy_(v8_slot)  # the same values, dim-major inside each block
    del v16
    v16 = (v8_slot.float() * scales[1][:, None]).to(DTYPE)  # bf16 pools hold the same values as the fp8 ones
    k16.copy_(k8.float() * scales[0][:, None])
    variants: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None, PagedAttentionConfig]] = [
        (str(DTYPE).removeprefix("torch."), k16, v16, None, DECODE_CONFIG),
        ("fp8 V slot-major, 150 registers (before)", k8, v8_slot, scales, DECODE_CONFIG),
        ("fp8 (FP8_DECODE_CONFIG: maxnreg 128)", k8, v8_slot, scales, FP8_DECODE_CONFIG),
        ("fp8, 3 stages, maxnreg 128", k8, v8_slot, scales, PagedAttentionConfig(16, 64, 4, 3, 128)),
        ("fp8, maxnreg 96", k8, v8_slot, scales, PagedAttentionConfig(16, 64, 4, 2, 96)),
        ("fp8, block_n 128, maxnreg 168", k8, v8_slot, scales, PagedAttentionConfig(16, 128, 4, 2, 168)),
        ("fp8, block_n 128, 8 warps, maxnreg 128", k8, v8_slot, scales, PagedAttentionConfig(16, 128, 8, 2, 128)),
        ("fp8 V dim-major, maxnreg 128", k8, v8_dim, scales, PagedAttentionConfig(16, 64, 4, 2, 128)),
    ]
    result: Row = {"points": points}
    chk = make_sets([1] * 3, [37, 300, 1025], pool_blocks, 1, gen)[0]
    errs = {}
    for name, kp, vp, sc, cfg in variants:
        errs[name] = check_attn(chk, kp, vp, 1, 1025, cfg, None, sc)
    result["check_rel_err"] = errs
    rows: list[list[str]] = []
    sweep: list[Row] = []
    for b, c in points:
        if ctx.time_left() < 30:
            ctx.notes.append(f"fp8 decode stopped before B={b} ctx={c} (time budget)")
            break
        sets = make_sets([1] * b, [c] * b, pool_blocks, rot[(b, c)], gen)
        base = None
        for name, kp, vp, sc, cfg in variants:
            ms = bench_ms(attn_call(sets, kp, vp, 1, c, cfg, None, sc), len(sets))
            base = ms if base is None else base
            nbytes = kv_bytes(b, c) // (2 if sc is not None else 1)
            sweep.append({"batch": b, "context": c, "variant": name, "ms": ms, "kv_gbps": nbytes / ms / 1e6})
            rows.append([str(b), str(c), name, f"{ms * 1e3:.1f}", f"{nbytes / ms / 1e6:.0f}", f"{base / ms:.2f}x"])
    result["sweep"] = sweep
    ctx.tables.append((f"Decode attention over fp8 caches (Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, q {DTYPE}, block "
                       f"{BLOCK_SIZE}); speed-up against bf16 at the same point", ["batch", "context", "cache",
                       "us", "KV GB/s", "vs bf16"], rows))  # fmt: skip
    return result


# ---------------------------------------------------------------------------------------------------
# (c) prefill
# ---------------------------------------------------------------------------------------------------


def prefill_flops(t: int) -> float:
    return 4.0 * t * t / 2 * HEAD_DIM * HQ


def section_prefill(ctx: Ctx) -> Row:
    from tokenmill.kernels.paged_attention import (
        LONG_PREFILL_CONFIG,
        LONG_PREFILL_CONFIG_DEEP,
        PREFILL_CONFIG,
        PREFILL_CONFIG_DEEP,
        PagedAttentionConfig,
    )

    gen = torch.Generator().manual_seed(1)
    lens = PREFILL_LENS
    chk_q, chk_s = PREFILL_CHECK
    blocks = [math.ceil(t / BLOCK_SIZE) for t in [*lens, sum(chk_s)]]
    pool_blocks = max(blocks) + 16
    shape = (pool_blocks, BLOCK_SIZE, HKV, HEAD_DIM)
    k_pool = torch.empty(shape, dtype=DTYPE, device=DEV).normal_()
    v_pool = torch.empty(shape, dtype=DTYPE, device=DEV).normal_()
    result: Row = {}

    # correctness: a chunk with a cached prefix + a fresh prompt + decodes
    chk = make_sets(chk_q, chk_s, pool_blocks, 1, gen)[0]
    result["check_rel_err"] = check_attn(chk, k_pool, v_pool, max(chk_q), max(chk_s))

    # every candidate at every length (the default rule may pick by length)
    candidates = [
        PREFILL_CONFIG,
        LONG_PREFILL_CONFIG,
        PREFILL_CONFIG_DEEP,
        LONG_PREFILL_CONFIG_DEEP,
        PagedAttentionConfig(256, 64, 8, 5),
        PagedAttentionConfig(256, 64, 16, 3),
        PagedAttentionConfig(256, 32, 16, 5),
        PagedAttentionConfig(128, 64, 8, 5),
        PagedAttentionConfig(128, 128, 8, 2),
        PagedAttentionConfig(64, 64, 4, 3),
        PagedAttentionConfig(128, 32, 4, 4),
    ]
    sets = {t: make_sets([t], [t], pool_blocks, 1, gen)[0] for t in lens}
    tune_rows: list[list[str]] = []
    for cfg in candidates:
        if ctx.time_left() < 75 and cfg is not PREFILL_CONFIG:
            ctx.notes.append("prefill autotune cut short (time budget)")
            break
        try:
            check_attn(chk, k_pool, v_pool, max(chk_q), max(chk_s), config=cfg)
            times = [bench_ms(attn_call([sets[t]], k_pool, v_pool, t, t, cfg), 1) for t in lens]
        except Exception as exc:
            print(f"prefill config {cfg} failed: {exc!r}", file=sys.stderr)
            continue
        tune_rows.append([str(cfg), *(f"{prefill_flops(t) / (ms * 1e-3) / 1e12:.0f}" for t, ms in zip(lens, times))])
    result["tune"] = tune_rows
    ctx.tables.append(("Prefill autotune (TFLOP/s)", ["config", *(f"T={t}" for t in lens)], tune_rows))

    # the sweep: the launcher's default rule (what the engine runs), on one sequence of T tokens and, as
    # FlashAttention's papers measure, on batch x T = max(lens) tokens (batch = max(lens) // T sequences)
    rows: list[list[str]] = []
    sweep: list[Row] = []
    total = max(lens)
    points = [(t, 1) for t in lens] + [(t, total // t) for t in lens if total // t > 1]
    for t, batch in points:
        s = sets[t] if batch == 1 else make_sets([t] * batch, [t] * batch, pool_blocks, 1, gen)[0]
        ms = bench_ms(attn_call([s], k_pool, v_pool, t, t), 1)
        flops = batch * prefill_flops(t)
        tflops = flops / (ms * 1e-3) / 1e12
        sdpa_ms, sdpa_note = bench_sdpa(t, batch)
        sdpa_tflops = flops / (sdpa_ms * 1e-3) / 1e12 if sdpa_ms else None
        sweep.append({"tokens": t, "batch": batch, "ms": ms, "tflops": tflops, "sdpa_ms": sdpa_ms,
                      "sdpa_tflops": sdpa_tflops, "sdpa": sdpa_note})  # fmt: skip
        rows.append([
            str(t), str(batch), f"{ms:.3f}", f"{tflops:.0f}",
            f"{sdpa_ms:.3f}" if sdpa_ms else "n/a", f"{sdpa_tflops:.0f}" if sdpa_tflops else "n/a",
            f"{sdpa_ms / ms:.2f}" if sdpa_ms else "n/a", sdpa_note,
        ])  # fmt: skip
    result["sweep"] = sweep
    ctx.tables.append(
        (f"Prefill attention, causal (Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, {DTYPE}), default launch rule; batch > 1: "
         f"{total} tokens in all, as FlashAttention's benchmarks",
         ["tokens", "batch", "ms", "TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "SDPA/ours time", "SDPA backend"], rows)
    )  # fmt: skip
    return result


def bench_sdpa(t: int, batch: int = 1) -> tuple[float | None, str]:
    """torch scaled_dot_product_attention (flash backend) on [batch, Hq, T, D], causal, as a reference point."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, HQ, t, HEAD_DIM, dtype=DTYPE, device=DEV)
    k = torch.randn(batch, HKV, t, HEAD_DIM, dtype=DTYPE, device=DEV)
    v = torch.randn(batch, HKV, t, HEAD_DIM, dtype=DTYPE, device=DEV)
    attempts: list[tuple[str, Callable[[], torch.Tensor]]] = [
        (
            "flash, enable_gqa",
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        )
    ]
    ke, ve = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    attempts.append(("flash, kv expanded", lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)))
    for note, fn in attempts:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                fn()
                ms = bench_ms(lambda i, fn=fn: fn(), 1)  # type: ignore[misc]
            return ms, note
        except Exception as exc:
            print(f"SDPA ({note}) unavailable: {exc!r}", file=sys.stderr)
    return None, "unavailable"


# ---------------------------------------------------------------------------------------------------
# (d) rmsnorm / add_rmsnorm / silu_and_mul
# ---------------------------------------------------------------------------------------------------

Tensors = list[torch.Tensor]


class SmallOp:
    """One norm/activation kernel: the kernel, its reference, a torch-eager baseline, bytes moved per call."""

    def __init__(
        self,
        name: str,
        nbytes: int,
        n_inputs: int,
        kernel: Callable[[Tensors], Tensors],
        reference: Callable[[Tensors], Tensors],
        eager: Callable[[Tensors], object],
    ) -> None:
        self.name, self.nbytes, self.n_inputs = name, nbytes, n_inputs
        self.kernel, self.reference, self.eager = kernel, reference, eager


def small_ops(num_tokens: int, hidden: int, weight: torch.Tensor, eps: float) -> list[SmallOp]:
    from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref
    from tokenmill.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref

    elem = num_tokens * hidden * DTYPE.itemsize
    half = hidden // 2

    def eager_silu(a: Tensors) -> torch.Tensor:
        return torch.nn.functional.silu(a[0][:, :half]) * a[0][:, half:]

    return [
        SmallOp("rmsnorm", 2 * elem, 1, lambda a: [rmsnorm(a[0], weight, eps)],
                lambda a: [rmsnorm_ref(a[0], weight, eps)], lambda a: rmsnorm_ref(a[0], weight, eps)),
        SmallOp("add_rmsnorm", 4 * elem, 2, lambda a: list(add_rmsnorm(a[0], a[1], weight, eps)),
                lambda a: list(add_rmsnorm_ref(a[0], a[1], weight, eps)),
                lambda a: add_rmsnorm_ref(a[0], a[1], weight, eps)),
        SmallOp("silu_and_mul", elem + elem // 2, 1, lambda a: [silu_and_mul(a[0])],
                lambda a: [silu_and_mul_ref(a[0])], eager_silu),
    ]  # fmt: skip


def cycle_call(fn: Callable[[Tensors], object], sets: list[Tensors]) -> Callable[[int], object]:
    def call(i: int) -> object:
        return fn(sets[i])

    return call


def section_small(ctx: Ctx) -> Row:
    result: Row = {}
    rows: list[list[str]] = []
    for t, h in SMALL_SHAPES:
        w = (1 + 0.1 * torch.randn(h, device=DEV)).to(DTYPE)
        for op in small_ops(t, h, w, 1e-5):
            try:
                n_sets = n_rotations(op.nbytes, ctx.l2_bytes, cap=4)
                sets = [[torch.randn(t, h, device=DEV).to(DTYPE) for _ in range(op.n_inputs)]
                        for _ in range(n_sets)]  # fmt: skip
                err = max(rel_err(g, r) for g, r in zip(op.kernel(sets[0]), op.reference(sets[0])))
                if not err < 1e-2:
                    raise AssertionError(f"{op.name} mismatch: relative error {err:.3e}")
                ms = bench_ms(cycle_call(op.kernel, sets), n_sets, rep=50)
                eager_ms = bench_ms(cycle_call(op.eager, sets), n_sets, rep=50)
                bw = op.nbytes / (ms * 1e-3)
                result[f"{op.name}_{t}x{h}"] = {
                    "ms": ms,
                    "gbps": bw / 1e9,
                    "eager_ms": eager_ms,
                    "rel_err": err,
                }
                rows.append([op.name, f"{t}x{h}", f"{ms * 1e3:.1f}", f"{bw / 1e9:.0f}", pct(bw, ctx),
                             f"{eager_ms * 1e3:.1f}"])  # fmt: skip
            except Exception:
                traceback.print_exc()
                rows.append([op.name, f"{t}x{h}", "error", "", "", ""])
    ctx.tables.append(
        (f"Norm / activation kernels ({DTYPE}; bytes = inputs read + outputs written)",
         ["kernel", "shape [T, H]", "us", "GB/s", "% copy", "torch eager us"], rows)
    )  # fmt: skip
    return result


# ---------------------------------------------------------------------------------------------------


def to_markdown(ctx: Ctx, header: str) -> str:
    lines = [header, ""]
    for title, cols, rows in ctx.tables:
        lines += [f"### {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    if ctx.notes:
        lines += ["Notes:", *(f"- {n}" for n in ctx.notes), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="output folder for JSON + Markdown")
    parser.add_argument("--budget-s", type=float, default=210.0, help="soft time budget of the whole run")
    parser.add_argument("--sections", default="copy,decode,prefill,small", help="comma-separated subset")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU (interpreter) too")
    args = parser.parse_args(argv)
    if args.smoke:
        apply_smoke()
    elif not torch.cuda.is_available():
        print("gpu_kernels.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    import triton  # (without CUDA the kernel modules choose Triton's interpreter: kernels/launch.py)

    t_start = time.perf_counter()
    ctx = Ctx(deadline=t_start + args.budget_s)
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name, sms = str(props.name), int(props.multi_processor_count)
    else:
        device_name, sms = "cpu (Triton interpreter)", 0
    results: Row = {
        "device": device_name,
        "sms": sms,
        "l2_bytes": ctx.l2_bytes,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": SMOKE,
    }
    sections: dict[str, Callable[[Ctx], Row]] = {
        "copy": section_copy,
        "decode": section_decode,
        "decode_fp8": section_decode_fp8,
        "prefill": section_prefill,
        "small": section_small,
    }
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        fn = sections.get(name)
        if fn is None:
            print(f"unknown section {name!r}", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        print(f"== {name} (t={t0 - t_start:.0f}s)", file=sys.stderr, flush=True)
        try:
            results[name] = fn(ctx)
        except Exception as exc:
            traceback.print_exc()
            results[name] = {"error": repr(exc)}
            ctx.notes.append(f"section {name} failed: {exc!r}")
        results[f"{name}_seconds"] = time.perf_counter() - t0
        if DEV == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    results["total_seconds"] = time.perf_counter() - t_start
    results["notes"] = ctx.notes
    header = (
        f"## GPU kernels on {device_name} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}; "
        f"{results['total_seconds']:.0f} s" + (" (SMOKE RUN: tiny shapes, timings meaningless)" if SMOKE else "")
    )
    md = to_markdown(ctx, header)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps(results, indent=2, default=str))
    (args.out / "gpu_kernels.md").write_text(md)
    print(md)
    return 0


# ---------------------------------------------------------------------------------------------------
# (e) skinny decode matmuls (kernels/gemv.py) vs cuBLAS + the separate norm / SwiGLU kernels
# ---------------------------------------------------------------------------------------------------


def bench_gemv(
    ms: tuple[int, ...] = (1, 8),
    *,
    tune: bool = False,
    projections: tuple[str, ...] = ("qkv", "o", "gate_up", "down"),
    budget_s: float = 420.0,
    smoke: bool = False,
) -> list[Row]:
    """Llama-3-8B decode projections (bf16) at M tokens: cuBLAS F.linear, preceded by the kernel the fused op
    absorbs (qkv / gate_up: add_rmsnorm; down: silu_and_mul; o: nothing), vs the one fused skinny kernel.

    Timing: `bench_ms`, i.e. inside a CUDA graph like the decode step, so the baseline's launch bubbles count,
    cycling over n_sets weight copies (>= 4x L2 in all): every weight comes from HBM, as in a real step where
    each layer has its own weights. Each variant is checked against the unfused bf16 reference first
    (relative error < 1e-2).

    tune=True also sweeps a few SkinnyConfigs per shape (correctness-checked; configs that fail to compile
    are skipped) and reports the best; `budget_s` stops the sweep when time runs out (the untuned rows are
    always produced). smoke=True: tiny shapes in fp16 on CPU under the Triton interpreter (timings meaningless).

    Returns one row per (projection, M): us / weight GB/s of both variants, speedup, the fused config, and with
    tune the best config, its timing and the whole sweep ([config, us] pairs)."""
    import torch.nn.functional as F

    from tokenmill.kernels.activation import silu_and_mul
    from tokenmill.kernels.gemv import (
        SkinnyConfig,
        _num_sms,
        add_rmsnorm_matmul,
        add_rmsnorm_matmul_ref,
        default_config,
        silu_mul_matmul,
        silu_mul_matmul_ref,
        skinny_matmul,
        skinny_matmul_ref,
    )
    from tokenmill.kernels.rmsnorm import add_rmsnorm

    if smoke:
        apply_smoke()
    t_end = time.perf_counter() + budget_s
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not smoke and dev.type != "cuda":
        raise RuntimeError("bench_gemv needs a CUDA device (or smoke=True)")
    dtype = torch.float16 if smoke else torch.bfloat16
    hidden, inter = (64, 112) if smoke else (4096, 14336)
    qkv_out = 96 if smoke else 6144
    # name -> (N, K, prologue)
    shapes = {"qkv": (qkv_out, hidden, "norm"), "o": (hidden, hidden, "plain"),
              "gate_up": (2 * inter, hidden, "norm"), "down": (hidden, inter, "silu")}  # fmt: skip
    l2 = Ctx(deadline=t_end).l2_bytes
    eps = 1e-5
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype)

    def candidates(m: int, default: SkinnyConfig) -> list[SkinnyConfig]:
        shapes_ = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4),
                   (64, 64, 4, 5), (64, 128, 4, 4), (16, 256, 4, 6), (32, 128, 8, 4), (64, 128, 8, 3),
                   (16, 256, 4, 1), (32, 256, 8, 3), (8, 256, 4, 4), (8, 512, 4, 3), (8, 256, 2, 4),
                   (8, 512, 2, 4)]  # fmt: skip
        out = [default]
        for bn, bk, nw, ns in shapes_:
            for use_dot in (False, True) if m == 1 else (True,):
                cfg = SkinnyConfig(bn, bk, nw, ns, use_dot=use_dot)
                if cfg not in out:
                    out.append(cfg)
        return out

    def case(name: str, n: int, k: int, prologue: str, weights: list[torch.Tensor], m: int) -> Row:
        weight_bytes = n * k * dtype.itemsize
        n_sets = len(weights)
        h, res = randn(m, k), randn(m, k, scale=4.0)
        nw = (1 + 0.1 * torch.randn(k, generator=gen, device=dev)).to(dtype)
        gu = randn(m, 2 * k, scale=2.0)

        def fused(w: torch.Tensor, cfg: SkinnyConfig | None) -> torch.Tensor:
            if prologue == "norm":
                return add_rmsnorm_matmul(h, res, nw, eps, w, config=cfg)[0]
            if prologue == "silu":
                return silu_mul_matmul(gu, w, config=cfg)
            return skinny_matmul(h, w, config=cfg)

        def unfused(w: torch.Tensor) -> torch.Tensor:
            if prologue == "norm":
                return F.linear(add_rmsnorm(h, res, nw, eps)[0], w)
            if prologue == "silu":
                return F.linear(silu_and_mul(gu), w)
            return F.linear(h, w)

        def reference(w: torch.Tensor) -> torch.Tensor:
            if prologue == "norm":
                return add_rmsnorm_matmul_ref(h, res, nw, eps, w)[0]
            if prologue == "silu":
                return silu_mul_matmul_ref(gu, w)
            return skinny_matmul_ref(h, w)

        ref = reference(weights[0])

        def run_fused(cfg: SkinnyConfig | None) -> tuple[float, float]:
            """(relative error vs the reference, us per call)"""
            err = rel_err(fused(weights[0], cfg), ref)
            if not err < 1e-2:  # also catches NaN
                raise AssertionError(f"{name} M={m} {cfg}: relative error {err:.3e}")
            return err, 1e3 * bench_ms(lambda i: fused(weights[i], cfg), n_sets)

        def gbps(us: float) -> float:
            return weight_bytes / (us * 1e-6) / 1e9

        base_err = rel_err(unfused(weights[0]), ref)
        base_us = 1e3 * bench_ms(lambda i: unfused(weights[i]), n_sets)
        cfg0 = default_config(m, n, k, dtype.itemsize, _num_sms(dev))
        fused_err, fused_us = run_fused(None)
        row: Row = {
            "proj": name, "m": m, "n": n, "k": k, "weight_mb": weight_bytes / 1e6, "n_sets": n_sets,
            "base": "cuBLAS" + {"norm": " + add_rmsnorm", "silu": " + silu_and_mul", "plain": ""}[prologue],
            "base_us": base_us, "base_gbps": gbps(base_us), "fused_us": fused_us, "fused_gbps": gbps(fused_us),
            "speedup": base_us / fused_us, "config": str(cfg0), "rel_err": fused_err, "base_rel_err": base_err,
        }  # fmt: skip
        if tune:
            sweep: list[list[Any]] = []
            best_cfg, best_us = cfg0, fused_us
            for cfg in candidates(m, cfg0):
                if time.perf_counter() > t_end:
                    row["tune_note"] = "sweep cut short (budget_s)"
                    break
                try:
                    us = fused_us if cfg == cfg0 else run_fused(cfg)[1]
                except Exception as exc:  # e.g. out of shared memory: skip the config
                    print(f"gemv {name} M={m} {cfg} failed: {exc!r}"[:400], file=sys.stderr)
                    sweep.append([str(cfg), None])
                    continue
                sweep.append([str(cfg), us])
                if us < best_us:
                    best_cfg, best_us = cfg, us
            row.update(best_config=str(best_cfg), best_us=best_us, best_gbps=gbps(best_us),
                       best_speedup=base_us / best_us, tune=sweep)  # fmt: skip
        print(
            f"gemv {name:8s} M={m:2d} N={n} K={k}: {row['base']} {base_us:7.1f} us ({gbps(base_us):5.0f} GB/s)"
            f" | fused {fused_us:7.1f} us ({gbps(fused_us):5.0f} GB/s) x{base_us / fused_us:.2f} {cfg0}"
            + (f" | best {row['best_us']:.1f} us {row['best_config']}" if tune else ""),
            file=sys.stderr,
            flush=True,
        )
        return row

    rows: list[Row] = []
    for name in projections:
        n, k, prologue = shapes[name]
        n_sets = 2 if smoke else max(2, min(16, math.ceil(4 * l2 / (n * k * dtype.itemsize))))
        weights = [randn(n, k, scale=k**-0.5) for _ in range(n_sets)]
        rows += [case(name, n, k, prologue, weights, m) for m in ms]
        del weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    sys.exit(main())
