"""EAGLE-2-style tree drafts from the EAGLE head: the rule, the head's tree mask, the final choice of nodes.

A request with a budget of k draft nodes and tree width W is drafted over `tree_levels(k, W)` levels (depth 1
is the root's children):
  - depth 1: the W most likely tokens of the head's distribution after the root;
  - depth L+1: each of the W depth-L nodes (the frontier) proposes its W most likely children; of those W * W,
    the W of highest cumulative log-prob (the sum of the head's log-probs along the root-to-node path) are the
    next frontier;
  - the tree: the k nodes of highest cumulative log-prob over all levels (ties: the shallower first, then the
    frontier order). A child scores at most its parent (log-probs <= 0, sums rounded monotonically), so a
    chosen node's parent is chosen too; the nodes are ordered by depth (breadth first), so the scheduler's trim
    of a tail leaves a tree.
Width 1 is the chain of k greedy drafts. Everything is the head's top-k, no sampling: the tree is a
deterministic function of the request's tokens and the target's features, so the verifier's walk
(spec/tree.py) is lossless.

The head's own rows for tree nodes (worker/spec/eagle_proposer.py): the row of frontier node w at depth L
reads (embed(its token), the head output of its parent's row) at rotary position m + L - 1 (m: the root's
position), takes cache index m + (L - 1) * W + w of the head's KV and attends to the real prefix (indices < m)
and to its ancestors-or-self only: the same tree mask (AttentionMetadata.tree_mask, bit j = index m + j) the
target's verify step uses. Those indices are >= m, which the next catch-up overwrites with rows from real
features. The mask is an int64 bit set, so a tree has at most 63 such rows: at most 1 + 63 // W levels."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.worker.spec.tree import MAX_TREE_NODES, TreeDrafts


def tree_levels(k: int, width: int) -> int:
    """Depth of the tree drafted for a budget of k nodes: k, at most as many levels as the head's tree mask
    holds rows for ((levels - 1) * width <= 63)."""
    assert k >= 1 and width >= 1, (k, width)
    return min(k, 1 + MAX_TREE_NODES // width)


def head_tree_rows(k: int, width: int) -> int:
    """Head rows a tree round writes at cache indices >= m: `width` per level but the deepest."""
    return (tree_levels(k, width) - 1) * width


def row_bit(level: int, slot: int, width: int) -> int:
    """The tree-mask bit of the head row of frontier node `slot` at depth `level` (1-based)."""
    return 1 << ((level - 1) * width + slot)


def select_tree(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]],
                scores: Sequence[Sequence[float]], k: int) -> TreeDrafts:
    """The tree of the k best nodes (module docstring). Per depth L (list index L - 1), the frontier's W nodes:
    their tokens, their parents' slots in the frontier above (ignored at depth 1) and cumulative log-probs."""
    ranked = sorted((-s, level, w) for level, row in enumerate(scores) for w, s in enumerate(row))
    chosen = sorted((level, w) for _, level, w in ranked[:k])
    index = {node: i for i, node in enumerate(chosen)}
    out_parents = []
    for level, w in chosen:
        parent = (level - 1, parents[level][w]) if level else None
        assert parent is None or parent in index, f"node {(level, w)} chosen without its parent {parent}"
        out_parents.append(-1 if parent is None else index[parent])
    return TreeDrafts([tokens[level][w] for level, w in chosen], out_parents)
