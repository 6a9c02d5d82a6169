"""EAGLE tree drafts (worker/spec/eagle_tree.py, worker/spec/eagle_proposer.py) on CPU with random heads saved in a
temp dir: the choice of nodes; each tree node's head output equals the head run cache-free on the node's
root-to-node path as a chain (so the head's tree mask is right); the engine's trees equal a cache-free reference
of the whole rule across rounds (so the catch-up and the feature moves of accepted off-branch paths are right);
width 1 gives the chain's drafts; greedy and seeded outputs token-identical to decoding without speculation on
every tiny architecture (alone, batched, mixed with requests of other k and without speculation), on the Triton
backend, and on the embedded model with its shipped head; bad settings are clear errors."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernels are decorated (as tests/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from test_async_scheduling import Job, make_engine, results, run
from test_eagle_spec import head_inputs, mixed_prompts, save_head, shipped_head_chats_are_identical, spec_and_plain
from test_spec import repetitive
from test_spec_tree import recording_moves
from tiny_hf import ARCHS, save_tiny_model
from torch import Tensor

from tokenmill.protocol import SamplingParams
from tokenmill.worker.config import SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.request import Request
from tokenmill.worker.spec.eagle import DenseCausalBackend, EagleHead, load_eagle_head
from tokenmill.worker.spec.eagle_proposer import EagleProposer
from tokenmill.worker.spec.eagle_tree import select_tree, tree_levels
from tokenmill.worker.spec.tree import TreeDrafts, kv_moves


def eagle_tree(head: Path, k: int = 5, width: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle", num_speculative_tokens=k, draft_model=str(head), tree_width=width)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle_tree")
    model = save_tiny_model("llama", root)
    return model, save_head(model, root / "head")


def proposer_of(engine: LLMEngine) -> EagleProposer:
    assert isinstance(engine.proposer, EagleProposer)
    return engine.proposer


def recording_proposals(engine: LLMEngine) -> list[tuple[list[int], int, list[int]]]:
    """(the request's tokens, its budget k, its drafts) of every proposal the engine asks for."""
    calls: list[tuple[list[int], int, list[int]]] = []
    proposer = proposer_of(engine)
    propose = proposer.propose

    def recording(reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        drafts = propose(reqs, ks)
        calls.extend((list(r.token_ids), k, d) for r, k, d in zip(reqs, ks, drafts))
        return drafts

    proposer.propose = recording  # type: ignore[method-assign]
    return calls


# -- the rule ---------------------------------------------------------------------------------------------------


def test_select_tree_keeps_the_k_best_nodes_breadth_first() -> None:
    # W = 2, three levels: per level (tokens, parent slots in the level above, cumulative log-probs)
    tokens = [[10, 11], [20, 21], [30, 31]]
    parents = [[0, 0], [0, 1], [1, 0]]  # 20 under 10, 21 under 11; 30 under 21, 31 under 20
    scores = [[-0.1, -0.2], [-0.5, -0.3], [-0.4, -2.0]]
    tree = select_tree(tokens, parents, scores, 4)  # best: 10, 11, 21, 30
    assert list(tree) == [10, 11, 21, 30] and tree.parents == [-1, -1, 1, 2]
    tree = select_tree(tokens, parents, scores, 5)  # and 20, breadth first
    assert list(tree) == [10, 11, 20, 21, 30] and tree.parents == [-1, -1, 0, 1, 3]
    tie = select_tree([[1, 2], [3, 4]], [[0, 0], [0, 0]], [[0.0, -1.0], [0.0, -1.0]], 2)
    assert list(tie) == [1, 3] and tie.parents == [-1, 0]  # a tie takes the shallower (the parent) first
    chain = select_tree([[5], [6], [7]], [[0], [0], [0]], [[-1.0], [-2.0], [-3.0]], 3)
    assert list(chain) == [5, 6, 7] and chain.parents == [-1, 0, 1]
    assert tree_levels(5, 3) == 5 and tree_levels(16, 8) == 8 and tree_levels(16, 1) == 16


# -- the head's tree attention and the whole rule against cache-free references -----------------------------


class PathReference:
    """The head run cache-free (dense causal attention) on a request's tokens x_0..x_m: F(path) is the head's
    output of the row that reads the path's last draft when the root-to-node path is drafted as a chain (rows
    t < m from the target's real features f_t and embed(x_{t+1}); row m + i from embed(path[i]) and
    F(path[:i])); F(()) is f^_m."""

    def __init__(self, engine: LLMEngine, head: EagleHead, tokens: Sequence[int]) -> None:
        self.runner, self.head, self.tokens = engine.runner, head, list(tokens)
        self.real = head_inputs(self.runner, head, self.tokens[:-1])  # [m, H]
        self.memo: dict[tuple[int, ...], Tensor] = {}

    def out(self, path: tuple[int, ...]) -> Tensor:
        if path not in self.memo:
            feats = torch.cat([self.real, *(self.out(path[:i]) for i in range(len(path)))])  # [m + L, H]
            ids = torch.tensor(self.tokens[1:] + list(path))
            n = feats.shape[0]
            meta = attention_metadata([n], [n], [[0]], [-1] * n, self.runner.device)
            empty = torch.empty(0)
            with torch.no_grad():
                rows = self.head(self.runner.model.model.embed_tokens(ids), feats, torch.arange(n), (empty, empty),
                                 meta)
            self.memo[path] = rows[-1:]
        return self.memo[path]

    def log_probs(self, path: tuple[int, ...]) -> Tensor:
        return torch.log_softmax(self.runner.model.compute_logits(self.out(path)).float(), dim=-1)[0]  # [V]

    def tree(self, k: int, width: int) -> TreeDrafts:
        """The rule of eagle_tree.py, node by node: each node's children from F of its own path."""
        score, tok = self.log_probs(()).topk(width)
        # the frontier: (path, cumulative log-prob) per node
        frontier: list[tuple[tuple[int, ...], float]] = [((int(t),), float(s)) for s, t in zip(score, tok)]
        levels = [([p[-1] for p, _ in frontier], [0] * width, [s for _, s in frontier])]
        for _ in range(1, tree_levels(k, width)):
            child_s, child_t = zip(*(self.log_probs(p).topk(width) for p, _ in frontier))
            total = torch.stack([s + c for (_, s), c in zip(frontier, child_s)]).flatten()  # [W * W]
            best, pick = total.topk(width)
            frontier = [(frontier[int(i) // width][0] + (int(torch.stack(child_t).flatten()[i]),), float(b))
                        for b, i in zip(best, pick)]
            levels.append(([p[-1] for p, _ in frontier], [int(i) // width for i in pick], [s for _, s in frontier]))
        return select_tree(*(list(x) for x in zip(*levels)), k)


def dense_head(engine: LLMEngine, head_dir: Path) -> EagleHead:
    runner = engine.runner
    return load_eagle_head(head_dir, runner.arch, DenseCausalBackend(), dtype=torch.float32, device=runner.device)


def test_each_tree_rows_head_output_equals_the_head_on_its_root_to_node_path(tiny: tuple[Path, Path]) -> None:
    model, head_dir = tiny
    engine = make_engine(str(model), False, speculative=eagle_tree(head_dir, k=4, width=3))
    proposer = proposer_of(engine)
    rounds: list[dict[str, Any]] = []  # per draft round: the request's tokens, the rows of each level
    propose, step, expand = proposer.propose, proposer._tree_step, proposer._expand

    def recording_propose(reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        (req,) = reqs
        rounds.append({"tokens": list(req.token_ids), "rows": [], "parents": []})
        return propose(reqs, ks)

    def recording_step(plan: Any, level: int, n: int, tokens: Tensor, *args: Tensor) -> Tensor:
        out = step(plan, level, n, tokens, *args)
        rounds[-1]["rows"].append((tokens.tolist(), out.clone()))
        return out

    def recording_expand(log_probs: Tensor, score: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        best, tokens, parent = expand(log_probs, score)
        rounds[-1]["parents"].append(parent[0].tolist())
        return best, tokens, parent

    proposer.propose = recording_propose  # type: ignore[method-assign]
    proposer._tree_step = recording_step  # type: ignore[method-assign]
    proposer._expand = recording_expand  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    run(engine, [("r", mixed_prompts(3, seed=4)[2], params)])  # alone: one request per round
    ref_engine, head = make_engine(str(model), False), dense_head(engine, head_dir)
    checked = 0
    for r in rounds:
        ref = PathReference(ref_engine, head, r["tokens"])
        paths: list[tuple[int, ...]] = []
        for level, (tokens, out) in enumerate(r["rows"]):  # level 0: depth 1 (the root's children)
            up = r["parents"][level - 1] if level else [0] * len(tokens)
            paths = [(paths[p] if level else ()) + (t,) for t, p in zip(tokens, up)]
            for w, path in enumerate(paths):
                torch.testing.assert_close(out[w : w + 1], ref.out(path), rtol=1e-4, atol=1e-4)
                checked += 1
    # k = 4: rows at depths 1..3, three each (fewer once the budget shrinks near max_tokens)
    assert sum(len(r["rows"]) == 3 for r in rounds) >= 3 and checked >= 27


def test_the_engines_trees_equal_the_cache_free_rule_across_rounds(tiny: tuple[Path, Path]) -> None:
    assert_trees_are_the_rule(*tiny)


def assert_trees_are_the_rule(model: Path, head_dir: Path) -> None:
    """Batched, chunked, with requests of other k: every tree the engine drafts is the rule applied node by
    node to a cache-free head (so the catch-up after a tree round and the moved features of accepted paths off
    the first branch feed the head the target's real features)."""
    engine = make_engine(str(model), False, speculative=eagle_tree(head_dir, k=6, width=3),
                         scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4))
    calls, paths = recording_proposals(engine), recording_moves(engine)
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                        num_speculative_tokens=[None, 2, None, 4, None][i]))
            for i, p in enumerate(repetitive(384, 2, seed=3) + mixed_prompts(3, seed=3))]
    run(engine, jobs)
    assert len(calls) > 20 and all(isinstance(d, TreeDrafts) and len(d) == k for _, k, d in calls)
    assert any(kv_moves(p) for p in paths), "some accepted path left the first branch (its features were moved)"
    ref_engine, head = make_engine(str(model), False), dense_head(engine, head_dir)
    for tokens, k, drafts in calls:
        want = PathReference(ref_engine, head, tokens).tree(k, 3)
        assert (list(drafts), drafts.parents) == (list(want), want.parents), f"after {len(tokens)} tokens"  # type: ignore[attr-defined]


def test_width_one_drafts_the_chain(tiny: tuple[Path, Path]) -> None:
    """The tree round at width 1 (forced: the proposer drafts chains there) gives the chain round's drafts."""
    model, head_dir = tiny
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            for i, p in enumerate(mixed_prompts(4, seed=5))]
    drafted: list[list[tuple[list[int], int, list[int]]]] = []
    for force_tree in (False, True):
        engine = make_engine(str(model), False, speculative=eagle_tree(head_dir, k=4, width=1))
        if force_tree:
            proposer_of(engine)._draft = proposer_of(engine)._draft_tree  # type: ignore[method-assign]
        drafted.append(recording_proposals(engine))
        run(engine, jobs)
    chains, trees = drafted
    assert len(chains) > 10 and [(t, list(d)) for t, _, d in trees] == [(t, d) for t, _, d in chains]
    assert all(isinstance(d, TreeDrafts) and d.parents == list(range(-1, len(d) - 1)) for _, _, d in trees)


# -- token-identical output ---------------------------------------------------------------------------------


def identical(model: Path, jobs: list[Job], spec: SpeculativeConfig, **config: Any) -> LLMEngine:
    """Runs `jobs` with `spec` and without speculation; asserts the same outputs and that tree rounds ran."""
    got, want, engine = spec_and_plain(model, jobs, spec, **config)
    assert got == want
    assert engine.counters.draft_tokens > 0
    return engine


@pytest.mark.parametrize("arch", sorted(a for a in ARCHS if a != "mistral-swa"))
def test_greedy_with_eagle_trees_is_identical_on_every_tiny_architecture(arch: str, tmp_path: Path) -> None:
    model = save_tiny_model(arch, tmp_path)
    head = save_head(model, tmp_path / "head")
    ks = [None, 0, 1, None, 5, None, 2, None, None]  # mixed with requests of their own k, and without speculation
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_speculative_tokens=k))
            for i, (p, k) in enumerate(zip(repetitive(384, 6, seed=1) + mixed_prompts(3, seed=1), ks))]
    small = dict(scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8))  # chunks and mixes
    identical(model, jobs, eagle_tree(head, k=6, width=3), **small)
    identical(model, jobs[:1], eagle_tree(head, k=8, width=2))  # alone


def test_seeded_sampling_with_eagle_trees_is_identical(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    kinds: list[dict[str, Any]] = [dict(temperature=0.9, top_p=0.9, seed=7), dict(temperature=0.3, top_k=20, seed=3),
                                   dict(temperature=0.5, min_p=0.05, repetition_penalty=1.2, seed=1)]
    jobs = [(f"s{i}", p, SamplingParams(max_tokens=18, ignore_eos=True, **kinds[i % len(kinds)]))
            for i, p in enumerate(repetitive(384, 4, seed=6) + mixed_prompts(2, seed=6))]
    identical(model, jobs, eagle_tree(head, k=5, width=4))


def test_greedy_with_eagle_trees_on_the_triton_backend_is_identical(tiny: tuple[Path, Path]) -> None:
    # the head's tree rows through the Triton kernel (the interpreter here), the target's verify too
    model, head = tiny
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    jobs = [(f"t{i}", p, params) for i, p in enumerate(repetitive(384, 2, seed=7) + mixed_prompts(1, seed=7))]
    engine = make_engine(str(model), False, speculative=eagle_tree(head, k=4, width=2), attention_backend="triton")
    got = results(run(engine, jobs))
    assert got == results(run(make_engine(str(model), False, attention_backend="torch"), jobs))
    assert engine.counters.draft_tokens > 0


def test_the_switch_measures_the_tree_rounds_draft_cost(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    spec = dataclasses.replace(eagle_tree(head, k=4, width=3), auto_switch=True)
    engine = make_engine(str(model), False, speculative=spec, scheduler=SchedulerConfig(max_num_seqs=4))
    assert engine.switch is not None and all(t > 0 for t in engine.switch.costs.draft_s)


@pytest.mark.slow
def test_eagle_trees_on_the_embedded_model_with_its_shipped_head_are_identical() -> None:
    shipped_head_chats_are_identical(SpeculativeConfig(method="eagle", num_speculative_tokens=4, tree_width=3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
def test_eagle_trees_on_cuda_with_the_triton_backend_are_identical(tiny: tuple[Path, Path], graphs: bool) -> None:
    """On the GPU (float32): the head's tree rows and the target's tree verify through the Triton kernels, with
    and without the target's CUDA graphs."""
    model, head = tiny
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jobs = [(f"r{i}", p, params) for i, p in enumerate(repetitive(384, 6, seed=8) + mixed_prompts(4, seed=8))]
    cuda = dict(device="cuda", dtype="float32", cuda_graphs=graphs)
    spec = dataclasses.replace(eagle_tree(head, k=6, width=3), auto_switch=False)
    engine = identical(model, jobs, spec, **cuda)
    assert engine.counters.accepted_draft_tokens > 0


# -- bad settings ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [0, 9, -1])
def test_an_eagle_tree_width_out_of_range_is_refused(width: int) -> None:
    with pytest.raises(ValueError, match=r"tree_width must be in \[1, 8\]"):
        SpeculativeConfig(method="eagle", tree_width=width)


def test_eagle_trees_with_a_sliding_window_are_a_clear_error(tmp_path: Path) -> None:
    model = save_tiny_model("mistral-swa", tmp_path)
    head = save_head(model, tmp_path / "head")
    with pytest.raises(ModelLoadError, match=r"tree drafts .* not built for sliding-window attention"):
        make_engine(str(model), False, speculative=eagle_tree(head))


