"""What the broker knows about models before it queues a job for one: which models workers have ever
announced, and what fits the workers that serve them.

A job is refused at SUBMIT (FAIL invalid, before it costs a worker anything) when
- it names a model no worker has ever announced, once the broker is past its start-up grace (the first
  `grace` seconds after its first worker registered, while the others are still coming); or
- it can never run on any worker that serves its model, by the protocol's one length rule
  (RequestInput.fit_error against each worker's max_model_len and max_prompt_chars): the registered
  ones, or, while none is registered, the most permissive limits ever announced for that model.
At dispatch a job goes only to a worker it fits (`fits`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.broker.workers import WorkerInfo
from tokenmill.protocol.wire import RequestInput


def fits(w: WorkerInfo, inp: RequestInput, max_tokens: int) -> bool:
    return inp.fit_error(w.max_model_len, w.max_prompt_chars, max_tokens) is None


def fit_refusal(workers: Iterable[WorkerInfo], inp: RequestInput, max_tokens: int) -> str | None:
    """Why the job fits none of `workers` (the reason for the most permissive one), or None when it fits one
    of them or there are none."""
    reasons = []
    for w in workers:
        why = inp.fit_error(w.max_model_len, w.max_prompt_chars, max_tokens)
        if why is None:
            return None
        reasons.append((w.max_model_len, why))
    return max(reasons)[1] if reasons else None


@dataclass
class Limits:
    """The most permissive limits announced for a model: the longest context, and the largest text bound
    (0: some worker announced none, so text is not bounded)."""

    max_model_len: int
    max_prompt_chars: int


@dataclass
class ModelCatalog:
    """Every model name workers have announced since the broker started, with its most permissive limits."""

    grace: float  # seconds after the first READY during which an unknown model is still queued
    first_ready: float | None = None
    limits: dict[str, Limits] = field(default_factory=dict)

    def note_ready(self, w: WorkerInfo, now: float) -> None:
        if self.first_ready is None:
            self.first_ready = now
        for model in (*w.models, ""):  # "" (any model) is served by every worker
            lim = self.limits.get(model)
            if lim is None:
                self.limits[model] = Limits(w.max_model_len, w.max_prompt_chars)
            else:
                lim.max_model_len = max(lim.max_model_len, w.max_model_len)
                lim.max_prompt_chars = (0 if 0 in (lim.max_prompt_chars, w.max_prompt_chars)
                                        else max(lim.max_prompt_chars, w.max_prompt_chars))

    def grace_left(self, now: float) -> float:
        """Seconds until unknown models are refused (the grace counts from the first READY)."""
        return self.grace if self.first_ready is None else max(0.0, self.first_ready + self.grace - now)

    def refusal(self, model: str, inp: RequestInput, max_tokens: int, serving: list[WorkerInfo],
                now: float) -> str | None:
        """Why a job for `model` must be refused now (see the module docstring), or None. `serving`: the
        registered workers that serve `model`."""
        lim = self.limits.get(model)
        if lim is None:
            if model and self.first_ready is not None and now - self.first_ready > self.grace:
                return f"no worker has ever served model {model[:200]!r}"
            return None
        if serving:
            return fit_refusal(serving, inp, max_tokens)
        return inp.fit_error(lim.max_model_len, lim.max_prompt_chars, max_tokens)
