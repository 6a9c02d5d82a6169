"""Engine stand-ins for the hardening tests (worker subprocesses load them with --engine-factory)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tests.helpers_net import FakeEngine, fake_engine  # (imported in worker processes, from the repo root)


class PoisonEngine(FakeEngine):
    """A FakeEngine whose process dies at once (as a worker crashing on a request would) when it is given a
    prompt containing POISON; every other request runs as FakeEngine's."""

    def add_request(self, request_id: str, prompt: str | None = None, *,
                    prompt_token_ids: Sequence[int] | None = None, messages: list[dict[str, Any]] | None = None,
                    params: Any = None, priority: int = 0, resume_token_ids: Sequence[int] = ()) -> None:
        if prompt is not None and "POISON" in prompt:
            os._exit(17)
        super().add_request(request_id, prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                            params=params, priority=priority, resume_token_ids=resume_token_ids)


def poison_engine(args: Any) -> PoisonEngine:
    e = PoisonEngine(step_s=fake_engine(args).step_s)
    return e


class BoundedEngine(FakeEngine):
    """A FakeEngine that announces a text bound (Ready.max_prompt_chars) and counts what it was given."""

    max_prompt_chars = 10_000


def bounded_engine(args: Any) -> BoundedEngine:
    return BoundedEngine(step_s=fake_engine(args).step_s)
