"""What an engine step hands back: one delta per request that produced tokens or finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # includes tokens delivered by an earlier attempt when resumed
    cached_tokens: int  # prompt tokens served from the prefix cache


# Not frozen: a frozen dataclass's __init__ costs 4x, and a step builds one per request. Read-only by convention.
@dataclass(slots=True)
class RequestOutput:
    """A step's new output of one request (read-only by convention).

    `first_index` is the output position (0-based, counting tokens an earlier attempt delivered when the
    request was resumed) of new_token_ids[0]; consecutive deltas of one request are gap-free.
    `text_delta` never ends inside a UTF-8 character and never contains a stop string."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    first_index: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended the request
    error: str | None = None
    # Per new token: {token_id: logprob} with the sampled token first, then the top-n.
    logprobs: list[dict[int, float]] | None = None
    usage: Usage | None = None
    timeline: RequestTimeline | None = None  # on the final output


class RequestTimeline(NamedTuple):
    """A request's first token in the engine, time.monotonic() seconds: when it was added, when a launched
    step first computed its tokens, and when its first output token was emitted (each the request's end
    when it never got there)."""

    added: float
    first_scheduled: float
    first_token: float


@dataclass
class CompletionOutput:
    """The whole result of one request of an offline `generate()` batch."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    usage: Usage | None = None

