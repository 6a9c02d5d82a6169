"""A job as the broker tracks it (its request, where it runs, its token log) and the table of all jobs.

Invariants of a Job:
- The token log is the job's STREAM entries [job_id, seq, token_ids, text, logprobs], each msgpack-encoded
  once on arrival and stored back to back in `log` (entry i ends at byte `ends[i]`; its first token is
  output position `seqs[i]`), in order and gap-free: seqs[i+1] == seqs[i] + len(token_ids of entry i).
  `num_tokens` is the end of the last one: where the next chunk must start (`store` appends only
  such a chunk). Relaying copies the stored bytes into a STREAM body; nothing is re-encoded, and the log
  holds no Python object per chunk (so the cyclic GC never walks it).
- `subscribers` maps a client routing id to its cursor: the index of the next chunk that client has not
  been sent; a subscriber leaves once it has been sent every chunk and the terminal reply.
- Exactly one terminal reply (`terminal`) is set, once; after that the job never changes again and is
  kept until the retention period ends (late subscribers replay the log and get the terminal reply).
- A job's output counts only from the attempt that runs now, on the worker that runs it (`runs`).
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tokenmill.protocol.wire import Done, Fail, RequestInput

_pack = msgpack.Packer(use_bin_type=True).pack  # the broker is single-threaded; one Packer serves it


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False, slots=True)
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
    prefix_hashes: list[bytes]  # the prompt's prefix key (dispatch.prefix_hashes), for prefix affinity
    state: JobState = JobState.QUEUED
    worker: bytes | None = None
    attempt: int = 0
    failures: int = 0  # workers that died while running it, that were charged to it (broker/blame.py)
    dispatched_tokens: int = 0  # num_tokens when its current attempt was dispatched
    queued_at: float = 0.0
    dispatched_at: float | None = None  # first dispatch (monotonic); DONE's queue_time
    log: bytearray = field(default_factory=bytearray)
    ends: array[int] = field(default_factory=lambda: array("Q"))
    seqs: array[int] = field(default_factory=lambda: array("q"))
    num_tokens: int = 0
    subscribers: dict[bytes, int] = field(default_factory=dict)
    terminal: Done | Fail | None = None
    finished_at: float = 0.0
    relay_batch: int = 0  # number of the last TOKENS batch Fanout.relay saw this job in (a job twice in one)
    prefill: bytes | None = None  # the worker computing the current attempt's prompt for `worker` (disaggregated)

    @property
    def is_terminal(self) -> bool:
        return self.terminal is not None

    @property
    def num_chunks(self) -> int:
        return len(self.ends)

    def runs(self, worker: bytes, attempt: int) -> bool:
        """Whether `worker` runs this job's current attempt `attempt` (its output counts; else stale)."""
        return self.state is JobState.RUNNING and self.worker == worker and self.attempt == attempt

    def store(self, entry: Sequence[Any]) -> bytes:
        """Append a chunk given as its (validated) STREAM entry [job_id, seq, token_ids, text, logprobs]
        whose seq is num_tokens (the caller checked: never a gap or a duplicate); returns its encoding."""
        encoded: bytes = _pack(entry)
        log = self.log
        log += encoded  # in place
        self.ends.append(len(log))
        self.seqs.append(entry[1])
        self.num_tokens = entry[1] + len(entry[2])
        return encoded

    def append(self, seq: int, token_ids: list[int], text: str, logprobs: Any) -> bytes:
        """Store one chunk (ValueError if it does not start where the log ends)."""
        if seq != self.num_tokens:
            raise ValueError(f"chunk at {seq}: the log of {self.job_id!r} ends at {self.num_tokens}")
        return self.store([self.job_id, seq, token_ids, text, logprobs])

    def entries(self, start: int) -> bytearray:
        """The encoded STREAM entries of chunks start.. (concatenated; an array header makes a body)."""
        return self.log[self.ends[start - 1]:] if start else self.log[:]

    def tokens_from(self, start: int) -> int:
        """How many tokens chunks start.. hold (start < num_chunks)."""
        return self.num_tokens - self.seqs[start]

    def chunks(self) -> list[list[Any]]:
        """The token log decoded: [job_id, seq, token_ids, text, logprobs] per chunk (not the hot path)."""
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(self.log), 1 << 20))
        unpacker.feed(self.log)
        return list(unpacker)

    @property
    def tokens(self) -> list[int]:
        """Every output token so far (what a migrated attempt resumes from)."""
        return [t for c in self.chunks() for t in c[2]]

    def chunk_index(self, from_seq: int) -> int:
        """Index of the first chunk a subscriber starting at output position `from_seq` needs (the
        chunk containing from_seq, so a mid-chunk start replays that whole chunk; an empty chunk at
        from_seq is included)."""
        seqs, n = self.seqs, len(self.seqs)
        lo, hi = 0, n
        while lo < hi:  # first i with end(i) > from_seq or seqs[i] >= from_seq (monotone in i)
            mid = (lo + hi) // 2
            end = seqs[mid + 1] if mid + 1 < n else self.num_tokens
            if end > from_seq or seqs[mid] >= from_seq:
                hi = mid
            else:
                lo = mid + 1
        return lo


class JobTable:
    """Every job the broker knows by id: the live ones, and the finished ones for `retention` seconds
    after their terminal reply (at most `max_retained` of those; the oldest go first).

    Invariant: `active` == the number of jobs in the table that are not terminal."""

    def __init__(self, retention: float, max_retained: int) -> None:
        self.retention = retention
        self.max_retained = max_retained
        self._jobs: dict[str, Job] = {}
        self._retired: deque[tuple[float, str]] = deque()  # (finished at, job id), oldest first
        self.active = 0
        # The hot path's lookup: the dict's own get (the table never replaces its dict).
        self.get: Callable[[str], Job | None] = self._jobs.get

    def __getitem__(self, job_id: str) -> Job:
        return self._jobs[job_id]

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._jobs.values())

    def add(self, job: Job) -> None:
        """Add a new (not terminal) job under an id not in the table."""
        assert job.job_id not in self._jobs and not job.is_terminal
        self._jobs[job.job_id] = job
        self.active += 1

    def current(self, worker: bytes, job_id: str, attempt: int) -> Job | None:
        """The job if `worker` runs its current attempt `attempt`; else None (the output is stale)."""
        job = self._jobs.get(job_id)
        return job if job is not None and job.runs(worker, attempt) else None

    def finish(self, job: Job, terminal: Done | Fail, now: float) -> None:
        """Make `terminal` the job's one terminal reply; it is retained from `now`."""
        assert job.terminal is None and self._jobs.get(job.job_id) is job
        job.state, job.terminal, job.finished_at = JobState.DONE, terminal, now
        self.active -= 1
        self._retired.append((now, job.job_id))

    def expire(self, now: float) -> list[Job]:
        """Remove and return the finished jobs past their retention (or past `max_retained`)."""
        horizon, retired, out = now - self.retention, self._retired, []
        while retired and (retired[0][0] < horizon or len(retired) > self.max_retained):
            job = self._jobs.pop(retired.popleft()[1], None)
            if job is not None:
                out.append(job)
        return out

    def unfinished(self) -> list[Job]:
        return [j for j in self._jobs.values() if not j.is_terminal]
