"""Prompt lookup (n-gram) drafts: no draft model, no training. The request's last n tokens are looked up
earlier in its own tokens (prompt and output), longest n first; the tokens that followed the latest earlier
occurrence are the drafts. Strong where output copies its input (code edits, summaries, quotes).

With `tree_width` w > 1, the continuations of up to w earlier occurrences (the latest longest first, each
distinct) are merged into one tree of at most k nodes, breadth first (spec/tree.py): the target's own token then
picks among them. w = 1 gives the chain of `lookup`.

The proposers look up through a `SuffixIndex` per request (the drafts of `lookup`, in time that does not grow with
the request's length): `lookup` scans the whole list every step, which at batch 128 costs the host more than the
GPU's decode step it waits on (benchmarks/results/cpu/NOTES.md)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from tokenmill.worker.request import Request
from tokenmill.worker.spec.proposer import DraftProposer
from tokenmill.worker.spec.tree import TreeDrafts


class NgramProposer(DraftProposer):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4, tree_width: int = 1) -> None:
        assert 1 <= min_n <= max_n, f"n-gram sizes {min_n}..{max_n}"
        assert tree_width >= 1, f"tree width {tree_width}"
        self.min_n, self.max_n, self.tree_width = min_n, max_n, tree_width
        self.index = SuffixIndexes(min_n, max_n)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        if self.tree_width == 1:
            return [self.index.lookup(r, k) for r, k in zip(requests, num_drafts)]
        return [lookup_tree(r.token_ids, k, self.min_n, self.max_n, self.tree_width)
                for r, k in zip(requests, num_drafts)]


def lookup(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    min_n..max_n tokens; [] when none occurs earlier. A continuation that runs into the end of `tokens` reads
    on through the drafts themselves (a repeating pattern continues with its period)."""
    found = continuations(tokens, k, min_n, max_n, 1)
    return found[0] if found else []


def continuations(tokens: Sequence[int], k: int, min_n: int, max_n: int, width: int) -> list[list[int]]:
    """Up to `width` distinct continuations of up to `k` tokens: after the earlier occurrences of the longest
    suffix first, latest first, then of shorter suffixes (the first is `lookup`'s).

    One pass over the tokens: every earlier occurrence of the last token is a candidate end, and its match length
    (how many tokens before it equal the suffix's, up to max_n) is grown backwards over the candidates still
    matching, so a step costs O(L + candidates x max_n) rather than a window comparison per suffix length."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    if length < 2:
        return []
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # [C] e: seq[e] == the last token, e <= L - 2
    span = min(max_n, length - 1)
    matched = np.ones(len(ends), dtype=np.int64)  # [C] tokens of the suffix that end at e
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, span):
        if not alive.any():
            break
        idx = ends - j
        alive &= idx >= 0
        alive[alive] = seq[idx[alive]] == seq[length - 1 - j]
        matched += alive
    keep = matched >= min_n
    hits, lengths = ends[keep], matched[keep]
    found: list[list[int]] = []
    for e in hits[np.lexsort((-hits, -lengths))]:  # longest match first, then latest
        cont = _continuation(tokens, int(e) + 1, k)
        if cont not in found:
            found.append(cont)
            if len(found) == width:
                return found
    return found


def _continuation(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """The k tokens from `start` (< len(tokens)) on, reading on through themselves past the end (a repeating
    pattern continues with its period)."""
    length = len(tokens)
    cont = list(tokens[start:start + k])
    while len(cont) < k:  # seq[start + j] for j >= L - start is cont[j - (L - start)]
        cont.append(cont[len(cont) - (length - start)])
    return cont


class SuffixIndex:
    """`lookup(tokens, k, min_n, max_n)` of a token list that only grows, in time independent of its length: the
    end positions of every min_n-gram are kept as tokens arrive (each token indexed once), so a lookup reads only
    the earlier occurrences of the last min_n tokens and grows their matches backwards up to max_n, latest first.
    A different list, or a shorter one (a request finished on a stop string), starts the index again."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, f"n-gram sizes {min_n}..{max_n}"
        self.min_n, self.max_n = min_n, max_n
        self._tokens: Sequence[int] | None = None
        self._ends: dict[tuple[int, ...], list[int]] = {}  # min_n-gram -> the positions it ends at, ascending
        self._indexed = 0  # the min_n-grams ending before this position are in _ends

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        length, n = len(tokens), self.min_n
        if tokens is not self._tokens or length <= self._indexed:  # indexed at a longer length: shrunk since
            self._tokens, self._ends, self._indexed = tokens, {}, 0
        for e in range(max(self._indexed, n - 1), length - 1):  # ends e <= L - 2: earlier than the suffix's own
            self._ends.setdefault(tuple(tokens[e - n + 1 : e + 1]), []).append(e)
        self._indexed = max(self._indexed, length - 1)
        ends = self._ends.get(tuple(tokens[length - n :])) if length > n else None
        if not ends:
            return []
        span = min(self.max_n, length - 1)
        best, best_len = -1, 0
        for e in reversed(ends):  # latest first; a longer match replaces it
            m = n
            while m < span and e - m >= 0 and tokens[e - m] == tokens[length - 1 - m]:
                m += 1
            if m > best_len:
                best, best_len = e, m
                if m == span:
                    break
        return _continuation(tokens, best + 1, k)


class SuffixIndexes:
    """A SuffixIndex per live request (dropped with the request)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._of: weakref.WeakKeyDictionary[Request, SuffixIndex] = weakref.WeakKeyDictionary()

    def lookup(self, req: Request, k: int) -> list[int]:
        """lookup(req.token_ids, k, min_n, max_n)."""
        index = self._of.get(req)
        if index is None:
            index = self._of[req] = SuffixIndex(self.min_n, self.max_n)
        return index.lookup(req.token_ids, k)


def lookup_tree(tokens: Sequence[int], k: int, min_n: int, max_n: int, width: int) -> TreeDrafts:
    """The trie of `continuations`, breadth first (depth 1 of every continuation, then depth 2, ...), cut at k
    nodes; empty when the suffix occurs nowhere earlier."""
    conts = continuations(tokens, k, min_n, max_n, width)
    node_of: dict[tuple[int, ...], int] = {}
    out: list[int] = []
    parents: list[int] = []
    for depth in range(k):
        for cont in conts:
            prefix = tuple(cont[: depth + 1])
            if depth < len(cont) and prefix not in node_of and len(out) < k:
                node_of[prefix] = len(out)
                out.append(cont[depth])
                parents.append(node_of[prefix[:-1]] if depth else -1)
    return TreeDrafts(out, parents)
