"""A request's scheduling state. Torch-free: the scheduler and block manager are tested on CPU alone."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.protocol.sampling import SamplingParams

# Stands in `token_ids` for a token that a launched step is still sampling (async scheduling).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Invariant: `token_ids == prompt + output`; the first `num_computed_tokens` of them have their
    keys/values in the blocks `block_ids` (block j holds tokens j*block_size ..). A request is
    scheduled until `num_computed_tokens == num_tokens`; the step that reaches it samples one token.

    While steps are in flight, the last one or two output tokens may be PLACEHOLDERs: one per launched
    step that samples this request, in launch order, never before a real token. Counts include them
    (the scheduler plans with them); `num_known_tokens` does not."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved sampling seed: token k is a function of (seed, k, logits)
    arrival_seq: int  # engine-wide admission counter: FCFS order and "latest arrived" for preemption
    priority: int = 0  # lower is served first under the "priority" policy
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full token blocks
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_placeholders(self) -> int:
        """Trailing PLACEHOLDER tokens: output tokens whose sampling step has not come back yet."""
        n = 0
        while n < len(self.token_ids) and self.token_ids[-1 - n] == PLACEHOLDER:
            n += 1
        return n

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - self.num_placeholders

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self, by_priority: bool) -> tuple[int, int]:
        return (self.priority, self.arrival_seq) if by_priority else (0, self.arrival_seq)
