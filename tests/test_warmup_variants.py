"""CPU proof that the piecewise-graph warm-up (worker/cuda_graphs.py: PiecewiseGraphs.warm_up_attention) compiles
every paged-attention / split-reduce variant that serving then launches, tree drafts included, so that nothing is
JIT-compiled while serving (tests/test_gpu_graphs.py checks the same on a GPU by counting Triton's caches).

Each launch goes through kernels/paged_attention.py's `_run`; a recording stand-in computes the key Triton's JIT
would look its compiled variant up by (Triton's own binder over the kernel's signature: the constexprs, the
options, each int's class (== 1 is a constant, % 16 == 0 "D", unless in do_not_specialize) and each tensor's dtype
and 16-byte alignment), and launches nothing. Like Triton's `kernel[grid](...)` it returns a handle that the
AttentionPlan keeps for its later launches, which on a GPU reuse that variant without looking it up: only a
plan's first launch of each kernel can compile, so only those count as compiled.

On a GPU, decode-only steps replay DecodeGraphs (compiled at capture) and every other step of at most
max_num_batched_tokens tokens launches attention from PiecewiseGraphs.run between its graph pieces. Here a
CPU PiecewiseGraphs with no-op pieces and bf16 buffers (the GPU test's dtype) launches, for every step the engine
runs (its outputs from the torch reference backend), exactly what PiecewiseGraphs.run would; the device facts the
plans read (SMs, L2, shared memory, PDL) are the H200's."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/test_kernels.py): later tests run kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from test_gpu_graphs import TREES, motif_prompts
from tiny_hf import save_tiny_model
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from tokenmill.kernels import paged_attention as pa
from tokenmill.protocol import SamplingParams
from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.cuda_graphs import PiecewiseGraphs, _AttentionCall, graph_batch_sizes, mixed_graph_sizes
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.spec.tree import MAX_TREE_NODES, ancestor_masks
from tokenmill.worker.transfer import ship

KERNELS = {"attention": pa._paged_attn_kernel, "attention_dyn": pa._paged_attn_kernel_dyn,
           "reduce": pa._reduce_splits_kernel, "reduce_dyn": pa._reduce_splits_kernel_dyn}
# The H200 (torch.cuda.get_device_properties): 132 SMs, 50 MiB of L2, 227 KiB of shared memory per program; PDL on.
H200 = dict(num_sms=132, l2_bytes=50 << 20, shared_limit=232448, pdl={"PDL": True, "launch_pdl": True})
SCHED = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32)  # tests/test_gpu_graphs.py's


# -- Triton's variant key of a launch -------------------------------------------------------------------------

_BINDERS: dict[str, Callable[..., Any]] = {}


def _binder(name: str) -> Callable[..., Any]:
    """Triton's argument binder of kernel `name` (what JITFunction.run computes its cache key with): a
    JITFunction's own, or under the interpreter one built from the same function and do_not_specialize."""
    if name not in _BINDERS:
        kernel = KERNELS[name]
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        _BINDERS[name] = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    return _BINDERS[name]


@dataclass(frozen=True)
class Variant:
    """One compiled variant: the kernel, its specialization (per parameter: type and class, or constexpr value)
    and its compile options."""

    kernel: str
    specialization: tuple[Any, ...]
    options: tuple[tuple[str, Any], ...]

    def describe(self) -> str:
        """The kernel, its constexprs and options, and the parameters not of the usual class (16-byte aligned
        tensors, ints divisible by 16, unspecialized ints)."""
        params = [p.name for p in _binder_params(self.kernel)]
        spec = {n: s[1] if s[0] == "constexpr" else s for n, s in zip(params, self.specialization)
                if s[0] == "constexpr" or s[1] not in ("D", None)}
        return f"{self.kernel} {spec} {dict(self.options)}"


def _binder_params(name: str) -> list[Any]:
    kernel = KERNELS[name]
    return list((kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)).params)


def variant_of(kernel: Any, args: tuple[Any, ...], constexprs: dict[str, Any], options: dict[str, Any]) -> Variant:
    name = next(n for n, k in KERNELS.items() if k is kernel)
    _, specialization, opts = _binder(name)(*args, **constexprs, **options)
    return Variant(name, tuple(specialization), tuple(sorted(opts.items())))


@dataclass
class _Handle:
    """What the recorder returns for a launch through the JIT: the plan passes it back for its later launches."""

    variant: Variant

    def __getitem__(self, grid: tuple[int, int, int]) -> Callable[..., None]:
        """A compiled kernel's launcher (AttentionPlan keeps it for the step's later layers): launches nothing."""
        return lambda *args: None


@dataclass
class LaunchRecorder:
    """Stands in for paged_attention._run: records the variants launches compile and launches nothing."""

    compiled: set[Variant] = field(default_factory=set)  # variants of launches through the JIT
    # launches that reused a plan's cached variant with the arguments of another variant (a GPU would run the
    # cached one: a wrong kernel, and the variant the arguments ask for stays uncompiled)
    mismatched: list[tuple[Variant, Variant]] = field(default_factory=list)

    def __call__(self, kernel: Any, compiled: Any, grid: tuple[int, int, int], args: tuple[Any, ...],
                 constexprs: dict[str, Any], options: dict[str, Any]) -> _Handle:
        variant = variant_of(kernel, args, constexprs, options)
        if compiled is None:
            self.compiled.add(variant)
            return _Handle(variant)
        assert isinstance(compiled, _Handle)
        if compiled.variant != variant:
            self.mismatched.append((compiled.variant, variant))
        return compiled


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plans' device facts of an H200 (on the CPU the launch heuristics read the interpreter's small ones)."""
    monkeypatch.setattr(pa, "_num_sms", lambda device: H200["num_sms"])
    monkeypatch.setattr(pa, "_l2_bytes", lambda device: H200["l2_bytes"])
    monkeypatch.setattr(pa, "_shared_limit", lambda device: H200["shared_limit"])
    monkeypatch.setattr(pa, "pdl_launch_args", lambda device: dict(H200["pdl"]))


def record(monkeypatch: pytest.MonkeyPatch) -> Iterator[LaunchRecorder]:
    """A fresh recorder in place of _run for each phase (warm-up, serving)."""
    while True:
        recorder = LaunchRecorder()
        monkeypatch.setattr(pa, "_run", recorder)
        yield recorder


# -- the GPU's launch path, on the CPU -----------------------------------------------------------------------


class _NoReplay:
    """A graph piece that replays nothing (only the attention launches between the pieces are of interest)."""

    def replay(self) -> None:
        pass


def cpu_piecewise(num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int, max_num_batched_tokens: int,
                  sliding_window: int | None = None, block_size: int = 16,
                  dtype: torch.dtype = torch.bfloat16) -> PiecewiseGraphs:
    """PiecewiseGraphs as ModelRunner._capture_piecewise builds it for a model of this geometry, on the CPU in
    `dtype`, holding what a capture records (one attention call per layer: caches, scale, window) and pieces that
    replay nothing. The caches have one block: their strides, all a launch sees of them, do not depend on it."""
    shape = (1, block_size, num_kv_heads, head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
    pw = PiecewiseGraphs(None, None, caches, mixed_graph_sizes(max_num_batched_tokens),  # type: ignore[arg-type]
                         num_heads, head_dim, num_heads * head_dim, torch.device("cpu"), dtype)
    calls = [_AttentionCall(k, v, head_dim**-0.5, sliding_window, None) for k, v in caches]
    pw.calls = {t: calls for t in pw.sizes}
    pw.pieces = {t: [_NoReplay()] * (num_layers + 1) for t in pw.sizes}  # type: ignore[misc]
    return pw


def engine_piecewise(eng: LLMEngine) -> PiecewiseGraphs:
    runner, arch = eng.runner, eng.runner.arch
    return cpu_piecewise(runner.num_heads, runner.num_kv_heads, arch.head_dim, arch.num_layers,
                         eng.config.scheduler.max_num_batched_tokens, arch.sliding_window, runner.block_size)


@dataclass
class StepKinds:
    decode_graph: int = 0  # decode-only steps: DecodeGraphs replays (compiled at capture)
    piecewise: int = 0
    piecewise_trees: int = 0  # ... of them with tree drafts
    eager: int = 0  # steps past the largest token bucket


def serve_as_on_gpu(monkeypatch: pytest.MonkeyPatch, eng: LLMEngine, pw: PiecewiseGraphs) -> StepKinds:
    """Route every step the engine runs as ModelRunner._forward does on CUDA and launch the piecewise steps'
    attention through `pw.run`; the step's outputs still come from the engine's own (eager) forward."""
    runner = eng.runner
    forward = runner._forward
    graph_sizes = graph_batch_sizes(eng.config.scheduler.max_num_seqs)
    kinds = StepKinds()

    def routed(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_decode_only and bisect.bisect_left(graph_sizes, meta.num_seqs) < len(graph_sizes):
            kinds.decode_graph += 1
        elif pw.bucket(ids.shape[0]) is not None:
            kinds.piecewise += 1
            kinds.piecewise_trees += meta.tree_mask is not None
            pw.run(ids, positions, meta)
        else:
            kinds.eager += 1
        return forward(ids, positions, meta)

    monkeypatch.setattr(runner, "_forward", routed)
    return kinds


def cpu_engine(path: Path, speculative: SpeculativeConfig) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", attention_backend="torch",
                                  speculative=speculative, scheduler=SCHED))


def missing(serving: set[Variant], warm: set[Variant]) -> list[str]:
    return sorted(v.describe() for v in serving - warm)


# -- the tests ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    speculative: SpeculativeConfig
    prompts: list[list[int]]
    model: dict[str, Any] = field(default_factory=dict)  # tiny_hf overrides of the llama config


WORKLOADS = [  # tests/test_gpu_graphs.py's
    Workload("trees", TREES, motif_prompts(5, 24)),
    Workload("plain", SpeculativeConfig(), motif_prompts(5, 24)),
    # one request verifying trees over a long context: steps of 2-4 tokens whose split reduce takes fewer dims
    # per program than at any token bucket (8 heads of 128 dims: more reduce programs per row)
    Workload("one-long-tree", TREES, motif_prompts(6, 1, (1200, 1201), 600),
             dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128)),
]


@pytest.mark.parametrize("w", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_warm_up_covers_every_variant_served(w: Workload, tmp_path: Path, h200: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving, on the CPU, routed as on a GPU: every attention and reduce variant a piecewise step launches was
    compiled by the start-up warm-up."""
    eng = cpu_engine(save_tiny_model("llama", tmp_path, **w.model), w.speculative)
    pw = engine_piecewise(eng)
    phases = record(monkeypatch)
    warm = next(phases)
    pw.warm_up_attention(SCHED.max_num_seqs, eng.max_model_len, w.speculative.tree_width > 1)
    serving = next(phases)
    kinds = serve_as_on_gpu(monkeypatch, eng, pw)
    outs = eng.generate(w.prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert len(outs) == len(w.prompts) and kinds.eager == 0 and kinds.piecewise > 0
    if w.speculative.enabled:  # the workload verifies trees, in piecewise steps
        assert eng.counters.draft_tokens > 0 and kinds.piecewise_trees > 0
    assert not missing(serving.compiled, warm.compiled), "\n".join(missing(serving.compiled, warm.compiled))
    for phase in (warm, serving):  # every launch of a plan ran the variant its arguments ask for
        assert not phase.mismatched, [(a.describe(), b.describe()) for a, b in phase.mismatched[:2]]


@dataclass(frozen=True)
class Geometry:
    """A model's attention heads and an engine's limits."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int


GEOMETRIES = [
    Geometry("tiny-llama", 4, 2, 16, 2048, 256, 32),  # tests/test_gpu_graphs.py's model and scheduler
    Geometry("smollm2-135m", 9, 3, 64, 2048, 384, 48),  # 3 query heads per kv head (padded to 4)
    Geometry("llama-3-8b", 32, 8, 128, 4096, 512, 64),
]


def _query_lens(t: int, n: int) -> list[int]:
    """Longest query run per request of a step of t tokens over n requests (not decode-only: >= 2) at every
    threshold a plan compares it with (the decode tile's rows, each config's tile tokens), and at both ends."""
    lo, hi = -(-t // n), t - n + 1
    edges = {lo, hi}
    for gp in (1, 2, 4, 8):
        for rows in (16, 64, 128, 256):
            edges |= {max(rows, gp) // gp, max(rows, gp) // gp + 1}
    return sorted(m for m in edges if max(lo, 2) <= m <= hi)


def _context_lens(m: int, max_model_len: int) -> list[int]:
    """Longest context per step, at the split heuristic's steps (256 keys per split; split counts 8, 16, 32 pad
    the reduce differently) and the ends."""
    edges = {m, max_model_len} | {256 * k for k in (1, 2, 3, 4, 8, 9, 16, 17, 32, 33)}
    return sorted(c for c in edges if m <= c <= max_model_len)


def step_shapes(g: Geometry) -> Iterator[tuple[int, int, int, int]]:
    """(tokens, requests, longest query run, longest context) of the steps that launch from piecewise graphs."""
    counts = [n for n in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64) if n <= g.max_num_seqs]
    for t in range(2, g.max_num_batched_tokens + 1):
        for n in (n for n in counts if n < t):
            for m in _query_lens(t, n):
                for ctx in _context_lens(m, g.max_model_len):
                    yield t, n, m, ctx


def _plan_signature(plan: Any) -> tuple[Any, ...]:
    """Everything of an AttentionPlan a launch's variant can depend on besides the buffers (a superset of
    what Triton keys on: the split count itself, not only whether there is one; num_seqs' int classes)."""
    return (plan.dynamic, plan.config, plan.block_m, plan.block_q, plan.one_tile, plan.num_splits,
            plan.heads_per_group, plan.reduce_block_d, plan.window, plan.num_seqs == 1, plan.num_seqs % 16 == 0)


def _step_meta(t: int, n: int, m: int, ctx: int, tree: bool) -> AttentionMetadata:
    """A step of t tokens: request 0 runs m query tokens over ctx keys (with tree drafts: its last up to 63 tokens
    are a chain's nodes; the other requests have no tree), the others share the rest as evenly as possible."""
    q_lens = [m, *((t - m) // (n - 1) + (i < (t - m) % (n - 1)) for i in range(n - 1))]
    seq_lens = [ctx, *q_lens[1:]]
    meta = attention_metadata(q_lens, seq_lens, [[0] * -(-s // 16) for s in seq_lens], [-1] * t, torch.device("cpu"))
    if not tree:
        return meta
    nodes = min(m - 1, MAX_TREE_NODES)
    mask = [0] * t
    mask[m - nodes : m] = ancestor_masks(list(range(-1, nodes - 1)))
    parts = ship({"tree_mask": torch.tensor(mask, dtype=torch.int64),
                  "tree_start": torch.tensor([ctx - nodes, *seq_lens[1:]], dtype=torch.int32)}, torch.device("cpu"))
    return replace(meta, tree_mask=parts["tree_mask"], tree_start=parts["tree_start"])


@pytest.mark.parametrize("g", GEOMETRIES, ids=[g.name for g in GEOMETRIES])
def test_warm_up_compiles_exactly_the_variants_steps_can_launch(g: Geometry, h200: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step shape a piecewise replay can take (tokens x requests x longest query run x longest context, at
    each threshold of the launch heuristics), with and without tree drafts: the warm-up compiled each variant
    those launch, and none that no step launches."""
    pw = cpu_piecewise(g.num_heads, g.num_kv_heads, g.head_dim, 2, g.max_num_batched_tokens)
    phases = record(monkeypatch)
    warm = next(phases)
    pw.warm_up_attention(g.max_num_seqs, g.max_model_len, trees=True)
    steps = next(phases)
    call = pw.calls[pw.sizes[0]][0]
    cache_shape = call.k_cache.shape
    shapes: dict[tuple[Any, ...], tuple[int, int, int, int]] = {}
    for t, n, m, ctx in step_shapes(g):  # one step per distinct plan (PiecewiseGraphs.run's plan of that step)
        plan = pa.plan_paged_attention((t, g.num_heads, g.head_dim), pw.attn_q.dtype, cache_shape, pw.device, n,
                                       call.scale, max_query_len=m, max_seq_len=ctx)
        shapes.setdefault(_plan_signature(plan), (t, n, m, ctx))
    ids = torch.zeros(g.max_num_batched_tokens, dtype=torch.long)
    for t, n, m, ctx in shapes.values():
        for tree in (False, True):
            pw.run(ids[:t], ids[:t], _step_meta(t, n, m, ctx, tree))
    assert not missing(steps.compiled, warm.compiled), "\n".join(missing(steps.compiled, warm.compiled))
    assert not missing(warm.compiled, steps.compiled), "never launched:\n" + "\n".join(
        missing(warm.compiled, steps.compiled))
    for phase in (warm, steps):
        assert not phase.mismatched, [(a.describe(), b.describe()) for a, b in phase.mismatched[:2]]
