"""A job as the broker tracks it: its request, where it runs, and its token log.

Invariants:
- The token log is the job's STREAM entries [job_id, seq, token_ids, text, logprobs], each msgpack-encoded
  once on arrival and stored back to back in `log` (entry i ends at byte `ends[i]`; its first token is
  output position `seqs[i]`), in order and gap-free: seqs[i+1] == seqs[i] + len(token_ids of entry i);
  `num_tokens` is the end of the last one. Relaying copies these bytes into a STREAM body; nothing is
  re-encoded, and the log holds no Python object per chunk (so the cyclic GC never walks it).
- `subscribers` maps a client routing id to the index of the next chunk that client has not been sent;
  a subscriber leaves once it has been sent every chunk and the terminal reply.
- Exactly one terminal reply (`terminal`) is set, once; after that the job never changes again and is
  kept until the retention period ends (late subscribers replay the log and get the terminal reply).
"""

from __future__ import annotations

import enum
from array import array
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
    prefix_hashes: list[bytes]
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

    @property
    def is_terminal(self) -> bool:
        return self.terminal is not None

    @property
    def num_chunks(self) -> int:
        return len(self.ends)

    def append(self, seq: int, token_ids: list[int], text: str, logprobs: Any) -> bytes:
        """Append one chunk (the caller checked seq == num_tokens: the gap-free invariant); returns its
        encoded STREAM entry."""
        entry: bytes = _pack((self.job_id, seq, token_ids, text, logprobs))
        self._log_entry(entry, seq, len(token_ids))
        return entry

    def append_entry(self, entry: list[Any]) -> int:
        """Append one chunk given as its (validated) STREAM entry [job_id, seq, token_ids, text, logprobs]
        with seq == num_tokens; returns its number of tokens."""
        n = len(entry[2])
        self._log_entry(_pack(entry), entry[1], n)
        return n

    def _log_entry(self, encoded: bytes, seq: int, n_tokens: int) -> None:
        log = self.log
        log += encoded  # in place
        self.ends.append(len(log))
        self.seqs.append(seq)
        self.num_tokens += n_tokens

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
