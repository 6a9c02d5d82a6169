"""A request's scheduling state. Torch-free: the scheduler and block manager are tested on CPU alone."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.protocol.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Invariant: `token_ids == prompt + known output`, followed by `num_inflight` output tokens that
    launched steps are still sampling (async scheduling: one per step in flight, at most two; they land
    in launch order). `num_tokens` counts both: the scheduler plans with the in-flight ones. The first
    `num_computed_tokens` of them have their keys/values in the blocks `block_ids` (block j holds tokens
    j*block_size ..). A request is scheduled until `num_computed_tokens == num_tokens`; the step that
    reaches it samples one token.

    Speculative decoding: `draft_token_ids` are proposed tokens that trail the known ones (only ever with no
    token in flight and every known token but the last computed). `num_tokens` counts them, so the
    scheduler's catch-up rule schedules them; the step that reaches the end verifies them and yields the
    accepted drafts plus one token of the target's own (1 to k+1 tokens); the KV of rejected drafts is
    then uncounted (`num_computed_tokens` falls back) and later writes overwrite it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved sampling seed: token k is a function of (seed, k, logits)
    arrival_seq: int  # engine-wide admission counter: FCFS order and "latest arrived" for preemption
    priority: int = 0  # lower is served first under the "priority" policy
    token_ids: list[int] = field(default_factory=list)  # known tokens only
    num_inflight: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # proposed, not yet verified
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full token blocks
    # leading blocks of block_ids the prefix cache has settled, up to the first duplicate (BlockManager's cursor)
    num_hashed_blocks: int = 0
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
        """Known, in-flight and draft tokens."""
        return len(self.token_ids) + self.num_inflight + len(self.draft_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The known output tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Known, in-flight and draft output tokens."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self, by_priority: bool) -> tuple[int, int]:
        return (self.priority, self.arrival_seq) if by_priority else (0, self.arrival_seq)
