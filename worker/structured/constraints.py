"""The matchers of an engine's live constrained requests, by request id, and the step's bitmask of them.

The backend (and its tokenizer, ~0.3 s to build for a 49k vocabulary) is made on the first constrained
request, so an engine that never sees one pays nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenmill.protocol.errors import InvalidRequest
from tokenmill.protocol.structured import StructuredOutput
from tokenmill.worker.request import Request
from tokenmill.worker.structured.backend import GrammarBackend, GrammarMatcher
from tokenmill.worker.structured.bitmask import StepBitmask


class Constraints:
    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._unavailable: InvalidRequest | None = None  # why no backend could be made (kept: not retried)
        self._matchers: dict[str, GrammarMatcher] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, constraint: StructuredOutput, delivered: Sequence[int]) -> None:
        """A matcher for a new request, moved past the output tokens an earlier attempt delivered (a resumed
        request). InvalidRequest when the constraint does not compile or refuses those tokens."""
        matcher = self._backend_or_raise().matcher(constraint)
        for i, token in enumerate(delivered):
            if not matcher.advance(token):
                raise InvalidRequest(f"delivered output token {i} ({token}) breaks the structured output "
                                     f"constraint: {matcher.error}")
        self._matchers[request_id] = matcher

    def _backend_or_raise(self) -> GrammarBackend:
        if self._backend is None:
            if self._unavailable is not None:
                raise InvalidRequest(str(self._unavailable))
            try:
                self._backend = self._make_backend()
            except InvalidRequest as e:
                self._unavailable = e
                raise
        return self._backend

    def discard(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def any_running(self, running: Sequence[Request]) -> bool:
        return bool(self._matchers) and any(r.request_id in self._matchers for r in running)

    def step_bitmask(self, sampling: Sequence[Request]) -> StepBitmask | None:
        """The masks of the constrained requests among a step's sampling requests (None when there are none).
        Each matcher is at the request's known tokens: no constrained request has a token in flight."""
        reqs = [r for r in sampling if r.request_id in self._matchers]
        if not reqs:
            return None
        assert self._backend is not None
        assert not any(r.num_inflight for r in reqs), "a constrained request's mask needs its previous token"
        return StepBitmask(reqs, self._backend.fill_bitmask([self._matchers[r.request_id] for r in reqs]))

    def advance(self, request_id: str, tokens: Sequence[int]) -> str | None:
        """Move the request's matcher past its newly committed tokens. Returns None while the constraint
        goes on, "" once it is complete, or the error when a token breaks it (a token sampled against an
        empty mask: the constraint and the request's bans, e.g. min_tokens, left nothing)."""
        matcher = self._matchers[request_id]
        for token in tokens:
            if not matcher.advance(token):
                return f"the structured output constraint refused token {token}: {matcher.error}"
        return "" if matcher.is_finished() else None
