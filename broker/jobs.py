"""A job as the broker tracks it: its request, where it runs, and its token log.

Invariants:
- `chunks` is the token log: wire-ready STREAM entries [job_id, seq, token_ids, text, logprobs] in
  order, gap-free: chunks[i+1].seq == chunks[i].seq + len(chunks[i].token_ids); `num_tokens` is the
  end of the last one and `tokens` their concatenation (what a migrated attempt resumes from).
- `subscribers` maps a client routing id to the index of the next chunk that client has not been sent;
  a subscriber leaves once it has been sent every chunk and the terminal reply.
- Exactly one terminal reply (`terminal`) is set, once; after that the job never changes again and is
  kept until the retention period ends (late subscribers replay the log and get the terminal reply).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenmill.client.protocol import Done, Fail, RequestInput


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class Job:
    job_id: str
    owner: str
    model: str
    input: RequestInput
    params: dict[str, Any]
    max_tokens: int
    priority: int
    client: bytes  # routing id of the connection that submitted it
    cancel_on_disconnect: bool
    created: float
    deadline: float | None  # monotonic time; None: none
    prefix_hashes: list[bytes]
    state: JobState = JobState.QUEUED
    worker: bytes | None = None
    attempt: int = 0
    failures: int = 0  # workers that died while running it
    queued_at: float = 0.0
    chunks: list[list[Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    num_tokens: int = 0
    subscribers: dict[bytes, int] = field(default_factory=dict)
    terminal: Done | Fail | None = None
    finished_at: float = 0.0

    @property
    def is_terminal(self) -> bool:
        return self.terminal is not None

    def append(self, seq: int, token_ids: list[int], text: str, logprobs: Any) -> None:
        """Append one chunk; the caller checked seq == num_tokens (the gap-free invariant)."""
        self.chunks.append([self.job_id, seq, token_ids, text, logprobs])
        self.tokens.extend(token_ids)
        self.num_tokens += len(token_ids)

    def chunk_index(self, from_seq: int) -> int:
        """Index of the first chunk a subscriber starting at output position `from_seq` needs (the
        chunk containing from_seq, so a mid-chunk start replays that whole chunk)."""
        for i, c in enumerate(self.chunks):
            if c[1] + len(c[2]) > from_seq or (c[1] >= from_seq):
                return i
        return len(self.chunks)
