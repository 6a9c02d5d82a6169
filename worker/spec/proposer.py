"""The draft-proposer interface, and how many drafts a request may take in a step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from tokenmill.worker.request import Request


class DraftProposer(ABC):
    """Proposes draft tokens to follow each request's known tokens. A proposer is deterministic (the
    drafts are a function of the request's tokens): the verifier relies on that (q is a point mass)."""

    name: str
    # Whether the proposer reads the target's features (final-normed hidden states) of the requests that
    # speculate: the engine then has the model runner keep them and hands them to `observe`.
    wants_features: ClassVar[bool] = False

    def observe(self, requests: Sequence[Request], starts: Sequence[int], features: Any, lens: Sequence[int]) -> None:
        """Once a step: the target computed requests[i]'s positions starts[i] .. starts[i] + lens[i] - 1; features
        [sum lens, F] (a device tensor) are their rows there, request after request. Only called when
        `wants_features`."""
        return None

    def accept_paths(self, requests: Sequence[Request], paths: dict[int, list[int]]) -> None:
        """After a verify step of tree drafts, before its tokens are committed: `paths` maps a batch index of
        `requests` to its accepted nodes, root-first (spec/tree.py). For a proposer that keeps per-position
        state of the target's rows (the EAGLE features)."""
        return None

    def expected_tau(self, k: int) -> float | None:
        """What the proposer expects of itself before any verify step: tau (accepted drafts + 1 per request and
        verify step) of chains of k drafts, e.g. measured on held-out data when it was made; None: no idea."""
        return None

    @abstractmethod
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Per request, at most `num_drafts[i]` (>= 1) tokens to follow `requests[i].token_ids`; [] for none."""


def draft_budget(req: Request, k: int, max_model_len: int) -> int:
    """Drafts `req` may verify in its next step: at most `k`, and few enough that every token the step can
    yield (the accepted drafts and one more) is still within max_tokens and the model's context. 0 unless
    the request is decoding: no token in flight and every known token but the last computed."""
    if req.num_inflight or req.num_computed_tokens != req.num_known_tokens - 1:
        return 0
    outputs_left = req.params.max_tokens - (req.num_known_tokens - req.num_prompt_tokens)
    return max(0, min(k, outputs_left - 1, max_model_len - req.num_known_tokens - 1))
