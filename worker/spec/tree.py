"""Tree drafts: several guesses verified in one target forward.

A tree of k draft tokens hangs under the request's last known token (the root). Node i holds token
tokens[i] and follows parents[i]: -1 for the root, else an earlier node (parents[i] < i, so every prefix of
the nodes is a tree and the scheduler may trim a tail). A chain is the tree parents = [-1, 0, 1, ...].

In the verify step the nodes take the cache slots after the root's, in node order (cache index
tree_start + i, tree_start = the request's known tokens), but the rotary position of their depth (root
position + depth): node i attends to the request's context and to its ancestors-or-self only
(`ancestor_masks`, bit j = node j). After the step the accepted path's KV is moved to the consecutive slots
its tokens now own (`kv_moves`), so the cache reads as if the path had been decoded one token at a time.

Acceptance walks from the root (`accept_path`): the target's token of the current node's row is sampled
exactly as plain decoding samples that output position (the seeded race, penalties over the path so far); a
child holding that token is accepted and the walk goes on from it, otherwise the walk stops and that token
is the step's last. With deterministic drafts this is the chain rule of spec/verifier.py applied along the
path the target takes, so it is lossless and token-identical to plain decoding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import SupportsIndex

MAX_TREE_NODES = 63  # ancestor masks are int64 bit sets


class TreeDrafts(list[int]):
    """Draft tokens that form a tree (see the module docstring): a list of tokens, plus `parents`. Deleting a
    tail (`del drafts[n:]`, the scheduler's trim) trims the parents with it and leaves a tree."""

    def __init__(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        super().__init__(tokens)
        assert len(tokens) == len(parents) <= MAX_TREE_NODES, f"{len(tokens)} tokens, {len(parents)} parents"
        assert all(-1 <= p < i for i, p in enumerate(parents)), f"parents must point backwards: {parents}"
        self.parents = list(parents)

    def __delitem__(self, key: SupportsIndex | slice) -> None:
        assert isinstance(key, slice) and key.step is None and key.stop is None, "only a tail can be dropped"
        super().__delitem__(key)
        del self.parents[key]


def parents_of(drafts: Sequence[int]) -> list[int]:
    """The parents of a request's drafts: a TreeDrafts' own, or the chain's."""
    return drafts.parents if isinstance(drafts, TreeDrafts) else list(range(-1, len(drafts) - 1))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (a child of the root: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_masks(parents: Sequence[int]) -> list[int]:
    """Per node, the bit set of the nodes it may attend to: its ancestors and itself."""
    out: list[int] = []
    for i, p in enumerate(parents):
        out.append((0 if p < 0 else out[p]) | (1 << i))
    return out


def path_tokens(tokens: Sequence[int], parents: Sequence[int], node: int) -> list[int]:
    """The tokens from the root's first child down to `node` (inclusive); [] for the root (node -1)."""
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def accept_path(tokens: Sequence[int], parents: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The accepted nodes, root-first. sampled[0] is the target's token of the root's row, sampled[1 + i] that of
    node i's row."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(t, i)  # the first node of a token under a parent wins
    path, node = [], -1
    while (nxt := children.get(node, {}).get(sampled[node + 1])) is not None:
        path.append(nxt)
        node = nxt
    return path


def kv_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) offsets past tree_start that put the accepted path's KV on consecutive slots: node path[d]
    to offset d. Every source is past every earlier destination (path[d] >= d, increasing), so the moves may be
    done at once."""
    return [(n, d) for d, n in enumerate(path) if n != d]
