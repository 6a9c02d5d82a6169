"""AttentionPlan.launch reuses one step's arguments for the step's next layers (kernels/paged_attention.py
_LayerLaunch): every launch must hand the compiled variant exactly the arguments a launch built from scratch
would. The compiled variants are stand-ins that record their arguments (on the CPU the interpreter compiles none)."""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # a CUDA machine's other tests (and the workers they start) compile for real
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.kernels.paged_attention import AttentionPlan, plan_paged_attention

Launch = tuple[tuple[int, int, int], tuple[Any, ...]]


class _Recorder:
    """Stands in for a compiled Triton variant: `variant[grid](*args)` records (grid, args)."""

    def __init__(self, log: list[Launch]) -> None:
        self.log = log

    def __getitem__(self, grid: tuple[int, int, int]) -> Any:
        return lambda *args: self.log.append((grid, args))


def _key(x: Any, plan: AttentionPlan) -> Any:
    """Tensors by what the launcher reads of them (address, shape, strides, dtype), the plan's own split partials by
    their place in it; other arguments as they are."""
    for i, part in enumerate(plan.part):
        if x is part:
            return ("part", i)
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
    return x


def _plan(num_splits: int | None, log: list[Launch]) -> AttentionPlan:
    plan = plan_paged_attention((24, 4, 16), torch.float16, (8, 16, 2, 16), torch.device("cpu"), 3, 0.25,
                                max_query_len=10, max_seq_len=40, num_splits=num_splits)
    # as if the first launch with each set of flags had compiled both kernels
    for flags in itertools.product((False, True), repeat=3):
        plan._compiled[flags] = [_Recorder(log), _Recorder(log)]
    return plan


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fp8_scales", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_layers_of_a_step_get_the_arguments_of_a_fresh_launch(num_splits: int, fp8_scales: bool, tree: bool) -> None:
    q, out = torch.zeros(24, 4, 16, dtype=torch.float16), torch.zeros(24, 4, 16, dtype=torch.float16)
    tables = torch.zeros(3, 3, dtype=torch.int32)
    seq_lens = torch.tensor([40, 30, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 10, 18, 24], dtype=torch.int32)
    trees = (torch.zeros(24, dtype=torch.int64), seq_lens.clone()) if tree else None
    layers = [(torch.zeros(8, 16, 2, 16, dtype=torch.float16), torch.zeros(8, 16, 2, 16, dtype=torch.float16),
               torch.ones(2, 2) * (i + 1) if fp8_scales else None) for i in range(4)]
    reused: list[Launch] = []
    fresh: list[Launch] = []
    shared, alone = _plan(num_splits, reused), _plan(num_splits, fresh)
    assert shared.num_splits == num_splits
    for k, v, scales in layers:
        shared.launch(q, k, v, tables, seq_lens, qsl, out, kv_scales=scales, tree=trees)
        alone._last[0] = None  # every launch built from scratch
        alone.launch(q, k, v, tables, seq_lens, qsl, out, kv_scales=scales, tree=trees)
    assert len(reused) == len(fresh) == len(layers) * (2 if num_splits > 1 else 1)
    for (grid_a, args_a), (grid_b, args_b) in zip(reused, fresh, strict=True):
        assert grid_a == grid_b
        assert [_key(a, shared) for a in args_a] == [_key(b, alone) for b in args_b]
    assert shared._last[0] is not None  # the fast path was taken (launches after the first)


def test_another_step_tensor_or_cache_layout_is_launched_afresh() -> None:
    log: list[Launch] = []
    plan = _plan(1, log)
    q = torch.zeros(24, 4, 16, dtype=torch.float16)
    tables = torch.zeros(3, 3, dtype=torch.int32)
    seq_lens = torch.tensor([40, 30, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 10, 18, 24], dtype=torch.int32)
    k = torch.zeros(8, 16, 2, 16, dtype=torch.float16)
    out_a, out_b = torch.zeros_like(q), torch.zeros_like(q)
    plan.launch(q, k, k, tables, seq_lens, qsl, out_a)
    plan.launch(q, k, k, tables, seq_lens, qsl, out_b)  # another output buffer: its address and strides
    assert log[1][1][6] is out_b
    wide = torch.zeros(8, 16, 2, 32, dtype=torch.float16)[..., :16]  # the planned shape, other strides
    plan.launch(q, wide, wide, tables, seq_lens, qsl, out_b)
    ints = [a for a in log[2][1] if isinstance(a, int)]
    assert log[2][1][1] is wide and wide.stride(0) in ints and k.stride(0) not in ints


def test_a_launch_with_other_flags_gets_a_variant_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan launched with and without a tree mask (a TREE constexpr) never hands one's compiled variant to the
    other: each flag set goes through the JIT once, then reuses its own."""
    from tokenmill.kernels import paged_attention as pa

    log: list[Launch] = []
    given: list[tuple[bool, Any]] = []

    def run(kernel: Any, compiled: Any, grid: Any, args: Any, constexprs: dict[str, Any], options: Any) -> Any:
        given.append((constexprs["TREE"], compiled))
        return compiled if compiled is not None else _Recorder(log)

    monkeypatch.setattr(pa, "_run", run)
    plan = plan_paged_attention((24, 4, 16), torch.float16, (8, 16, 2, 16), torch.device("cpu"), 3, 0.25,
                                max_query_len=10, max_seq_len=40, num_splits=1)
    q, out = torch.zeros(24, 4, 16, dtype=torch.float16), torch.zeros(24, 4, 16, dtype=torch.float16)
    k = torch.zeros(8, 16, 2, 16, dtype=torch.float16)
    tables, seq_lens = torch.zeros(3, 3, dtype=torch.int32), torch.tensor([40, 30, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 10, 18, 24], dtype=torch.int32)
    tree = (torch.zeros(24, dtype=torch.int64), seq_lens.clone())
    for t in (None, tree, None, tree):
        plan.launch(q, k, k, tables, seq_lens, qsl, out, tree=t)
    assert [flag for flag, _ in given] == [False, True, False, True]
    assert given[0][1] is None and given[1][1] is None  # the first launch of each flag set compiles
    assert given[2][1] is not None and given[2][1] is not given[3][1]  # then each reuses its own variant


def test_plans_sharing_a_store_launch_its_variants_from_their_first_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """PiecewiseGraphs plans every step afresh: with a `variants` store, a dynamic plan of the same compile-time
    choices as an earlier one launches the earlier plan's compiled variants at once (no JIT), with its own step's
    arguments; a plan of other choices, or a decode-only (specializing) plan, goes through the JIT."""
    from tokenmill.kernels import paged_attention as pa

    log: list[Launch] = []
    jit: list[Any] = []

    def run(kernel: Any, compiled: Any, grid: Any, args: Any, constexprs: dict[str, Any], options: Any) -> Any:
        if compiled is None:
            jit.append(kernel)
            compiled = _Recorder(log)
        compiled[grid](*args, *constexprs.values())
        return compiled

    monkeypatch.setattr(pa, "_run", run)
    store: dict[Any, Any] = {}
    k = torch.zeros(8, 16, 2, 16, dtype=torch.float16)

    def step(num_seqs: int, max_query_len: int, max_seq_len: int, tokens: int = 24) -> AttentionPlan:
        plan = plan_paged_attention((tokens, 4, 16), torch.float16, (8, 16, 2, 16), torch.device("cpu"), num_seqs,
                                    0.25, max_query_len=max_query_len, max_seq_len=max_seq_len, num_splits=1,
                                    variants=store)
        q = torch.zeros(tokens, 4, 16, dtype=torch.float16)
        tables = torch.zeros(num_seqs, 3, dtype=torch.int32)
        seq_lens = torch.full((num_seqs,), max_seq_len, dtype=torch.int32)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * (tokens // num_seqs)
        for _ in range(3):  # three layers
            plan.launch(q, k, k, tables, seq_lens, qsl, torch.zeros_like(q))
        return plan

    first = step(3, 10, 40)
    assert len(jit) == 1  # the first layer of the first step compiles; its later layers reuse
    second = step(2, 12, 33)  # another step, the same choices: not one JIT launch
    assert len(jit) == 1 and len(log) == 6
    assert log[3][1][18] == 2  # with its own step's arguments (parameter 18: num_seqs)
    assert second._compiled is first._compiled
    step(1, 1, 40, tokens=1)  # a decode-only plan specializes on its ints: the JIT, not the store
    assert len(jit) == 2 and len(store) == 1
