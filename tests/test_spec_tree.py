"""Tree drafts (worker/spec/tree.py) on CPU: the tree helpers, the n-gram tree proposer, the tree mask of the
reference attention against a dense per-node computation, and the engine: greedy and seeded outputs with n-gram
trees token-identical to decoding without speculation, with accepted paths off the first branch (their KV moved
onto consecutive slots); where trees are not built, a clear error."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernels are decorated (as tests/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random
from pathlib import Path
from typing import Any

import pytest
from test_async_scheduling import make_engine, results, run
from test_spec import repetitive, spec_and_plain
from tiny_hf import ARCHS, save_tiny_model

from tokenmill.kernels.attention_ref import paged_attention_ref
from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError
from tokenmill.worker.registry_fetch import embedded_model_path
from tokenmill.worker.spec.ngram import continuations, lookup, lookup_tree
from tokenmill.worker.spec.tree import (
    TreeDrafts,
    accept_path,
    ancestor_masks,
    depths,
    kv_moves,
    parents_of,
    path_tokens,
)

TREE = SpeculativeConfig(method="ngram", num_speculative_tokens=8, tree_width=3)
TORCH = dict(attention_backend="torch")


# -- the helpers -------------------------------------------------------------------------------------------


def test_tree_helpers() -> None:
    #        root
    #       /    \
    #   0:5      1:6
    #   /  \       \
    # 2:7  3:8     4:9
    #  |
    # 5:1
    tree = TreeDrafts([5, 6, 7, 8, 9, 1], [-1, -1, 0, 0, 1, 2])
    assert depths(tree.parents) == [1, 1, 2, 2, 2, 3]
    assert ancestor_masks(tree.parents) == [0b1, 0b10, 0b101, 0b1001, 0b10010, 0b100101]
    assert path_tokens(tree, tree.parents, 5) == [5, 7, 1] and path_tokens(tree, tree.parents, -1) == []
    # sampled[0]: the target's token at the root's row, sampled[1 + i]: at node i's row.
    assert accept_path(tree, tree.parents, [5, 7, 0, 1, 0, 0, 4]) == [0, 2, 5]
    assert accept_path(tree, tree.parents, [6, 0, 9, 0, 0, 3, 0]) == [1, 4]
    assert accept_path(tree, tree.parents, [3, 0, 0, 0, 0, 0, 0]) == []
    assert kv_moves([0, 2, 5]) == [(2, 1), (5, 2)] and kv_moves([0, 1]) == [] and kv_moves([1, 4]) == [(1, 0), (4, 1)]
    assert parents_of([4, 4, 4]) == [-1, 0, 1] and parents_of(tree) == tree.parents
    del tree[3:]  # the scheduler's trim keeps a tree
    assert list(tree) == [5, 6, 7] and tree.parents == [-1, -1, 0]
    with pytest.raises(AssertionError):
        TreeDrafts([1, 2], [-1, 1])  # a parent must come first


def test_ngram_tree_merges_the_continuations_breadth_first() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 5, 6, 1, 2]  # "1 2" followed by 3, 4, 5 earlier: latest first
    assert continuations(tokens, 4, 1, 3, 3) == [[5, 6, 1, 2], [4, 8, 1, 2], [3, 9, 1, 2]]
    tree = lookup_tree(tokens, 6, 1, 3, 3)
    assert list(tree) == [5, 4, 3, 6, 8, 9] and tree.parents == [-1, -1, -1, 0, 1, 2]
    one = lookup_tree(tokens, 4, 1, 3, 1)
    assert list(one) == lookup(tokens, 4, 1, 3) and one.parents == [-1, 0, 1, 2]
    shared = lookup_tree([7, 1, 2, 7, 1, 3, 7], 4, 1, 1, 2)  # two continuations sharing their first token
    assert list(shared) == [1, 3, 2, 7] and shared.parents == [-1, 0, 0, 1]  # cut at k = 4 nodes
    assert list(lookup_tree([1, 2, 3], 4, 1, 3, 2)) == []


# -- the tree mask of the reference attention ---------------------------------------------------------------


def test_reference_attention_with_a_tree_mask_equals_each_nodes_own_path() -> None:
    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 8, 4
    ctx = 6  # known tokens before the root
    tree = TreeDrafts([0, 0, 0, 0, 0], [-1, -1, 0, 1, 2])
    n = 1 + len(tree)  # the root and the nodes are this step's queries
    seq_len = ctx + n
    k_cache = torch.randn(8, bs, hkv, d)
    v_cache = torch.randn(8, bs, hkv, d)
    table = torch.tensor([[3, 1, 5, 0]], dtype=torch.int32)
    q = torch.randn(n, hq, d)
    start = ctx + 1  # node j at cache index start + j
    masks = torch.tensor([0, *ancestor_masks(tree.parents)], dtype=torch.int64)
    out = paged_attention_ref(q, k_cache, v_cache, table, torch.tensor([seq_len], dtype=torch.int32),
                              torch.tensor([0, n], dtype=torch.int32), 0.3, tree_mask=masks,
                              tree_start=torch.tensor([start], dtype=torch.int32))
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    slot = [int(table[0, c // bs]) * bs + c % bs for c in range(seq_len)]
    for row in range(n):  # row 0: the root; row 1 + j: node j
        seen = list(range(start))  # the context and the root
        node = row - 1
        while node >= 0:
            seen.append(start + node)
            node = tree.parents[node]
        if row == 0:
            seen = list(range(ctx + 1))
        k = flat_k[[slot[c] for c in seen]].repeat_interleave(hq // hkv, dim=1)  # [S, Hq, D]
        v = flat_v[[slot[c] for c in seen]].repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[row], k) * 0.3, dim=-1)
        torch.testing.assert_close(out[row], torch.einsum("hs,shd->hd", p, v), rtol=1e-5, atol=1e-5)


# -- the engine ---------------------------------------------------------------------------------------------


def recording_moves(engine: LLMEngine) -> list[list[int]]:
    """The accepted paths the engine moves KV for (a wrapper around the runner's move_tree_kv)."""
    paths: list[list[int]] = []
    move = engine.runner.move_tree_kv

    def record(reqs: Any, by_index: dict[int, list[int]]) -> None:
        paths.extend(by_index.values())
        move(reqs, by_index)

    engine.runner.move_tree_kv = record  # type: ignore[method-assign]
    return paths


def branching(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts in which one phrase recurs with different continuations (an n-gram tree has branches)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(2)]
        tails = [[rng.randrange(3, vocab) for _ in range(3)] for _ in range(3)]
        out.append([t for tail in tails for t in phrase + tail] * 2 + phrase)
    return out


@pytest.mark.parametrize("arch", sorted(a for a in ARCHS if a != "mistral-swa"))
def test_greedy_with_tree_drafts_is_identical_on_every_tiny_architecture(arch: str, tmp_path: Path) -> None:
    model = str(save_tiny_model(arch, tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 6, seed=1) + branching(384, 4, seed=2))]
    small = dict(scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8), **TORCH)
    engine = make_engine(model, False, speculative=TREE, **small)
    paths = recording_moves(engine)
    got = results(run(engine, jobs))
    assert got == results(run(make_engine(model, False, **small), jobs))
    assert engine.counters.accepted_draft_tokens > 0
    assert paths, "tree steps ran"


def test_tree_paths_off_the_first_branch_are_accepted_and_outputs_stay_identical() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    jobs = [(f"b{i}", p, params) for i, p in enumerate(branching(384, 12, seed=3) + repetitive(384, 8, seed=4))]
    engine = make_engine("tiny-llama", False, speculative=TREE, **TORCH)
    paths = recording_moves(engine)
    got = results(run(engine, jobs))
    assert got == results(run(make_engine("tiny-llama", False, **TORCH), jobs))
    assert any(kv_moves(p) for p in paths), "some accepted path left the first branch (its KV was moved)"


def test_seeded_sampling_with_tree_drafts_is_identical() -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=30, seed=7, ignore_eos=True,
                            repetition_penalty=1.1)
    jobs = [(f"s{i}", p, params) for i, p in enumerate(branching(384, 6, seed=5))]
    with_tree, plain, _ = spec_and_plain("tiny-llama", jobs, spec=TREE, **TORCH)
    assert with_tree == plain


def test_tree_drafts_on_the_embedded_model_are_identical() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    jobs = [(f"e{i}", p, params) for i, p in enumerate([*branching(49152, 3, seed=6), [504, 2723, 11] * 8])]
    with_tree, plain, engine = spec_and_plain(str(embedded_model_path()), jobs, spec=TREE, **TORCH)
    assert with_tree == plain
    assert engine.counters.accepted_draft_tokens > 0


@pytest.mark.parametrize("kw", [dict(tree_width=0), dict(tree_width=9), dict(method="eagle", tree_width=9)])
def test_bad_tree_settings_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="tree"):
        SpeculativeConfig(**{"method": "ngram", **kw})


def test_greedy_with_tree_drafts_on_the_triton_backend_is_identical() -> None:
    # the Triton kernels (the interpreter here) with the tree mask, against the torch backend without speculation
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    jobs = [(f"t{i}", p, params) for i, p in enumerate(branching(384, 3, seed=7) + repetitive(384, 2, seed=8))]
    engine = make_engine("tiny-llama", False, speculative=TREE, attention_backend="triton")
    paths = recording_moves(engine)
    got = results(run(engine, jobs))
    assert got == results(run(make_engine("tiny-llama", False, **TORCH), jobs))
    assert paths and engine.counters.accepted_draft_tokens > 0


def test_tree_drafts_with_a_sliding_window_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tree drafts"):
        make_engine(str(save_tiny_model("mistral-swa", tmp_path)), False, speculative=TREE, **TORCH)
