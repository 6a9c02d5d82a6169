"""What the engine needs of a grammar library: compile a request's constraint (cached by its key), give it
a matcher of its own that follows its tokens, and fill the step's bitmask of several matchers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from tokenmill.protocol.structured import StructuredOutput


class GrammarMatcher(Protocol):
    """One request's position in its constraint. A token it refuses puts it in an error state for good."""

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False (and `error` says why) when the constraint forbids it."""

    def is_finished(self) -> bool:
        """The constraint is complete: no further token but EOS can follow."""

    @property
    def error(self) -> str:
        """Why the matcher is in an error state ("" when it is not)."""


class GrammarBackend(Protocol):
    @property
    def vocab_size(self) -> int:
        """V of the masks: the model's logits width."""

    def matcher(self, constraint: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher of the constraint, compiled once per distinct constraint. InvalidRequest when the
        constraint does not compile (a bad schema, regex or grammar)."""

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher]) -> Tensor:
        """The next-token masks of `matchers`: CPU int32 [N, ceil(V/32)] (worker/structured/bitmask.py)."""
