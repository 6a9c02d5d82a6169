"""The broker's counters: how many times each event happened since start (STATS "counters"), and the
running mean of job durations behind the retry-after hint of an OVERLOADED reply.

A key appears once its event first happens. The keys (docs/protocol.md names the ones clients rely on):
- jobs: submits, accepted, duplicate_submits, dispatches, completed, failed_<code> (one per FAIL code),
  cancels, disconnect_cancels, deadline_expired, queue_timeouts, migrations, migration_limit_failures,
  subscribes; refused submits: rejected_draining, rejected_invalid, rejected_overloaded,
  rejected_conflict; forbidden (a CANCEL or SUBSCRIBE of another owner's job)
- relay: tokens_in (stored in token logs), tokens_out (sent to subscribers), batches_forwarded
  (TOKENS batches sent on as they came), client_send_blocked (a client's queue was full)
- dropped input: malformed_client_messages, oversized_frames, malformed_worker_messages,
  stale_messages_dropped and stale_tokens_dropped (output of an attempt that no longer runs there),
  stale_worker_messages (from a worker not registered), seq_mismatch (a chunk that would leave a gap
  or repeat tokens), handler_errors (a bug caught by the loop)
- workers: workers_registered, workers_lost
- garbage collection: gc_full_collections, gc_full_collections_busy
"""

from __future__ import annotations

from collections import Counter

from tokenmill.protocol.wire import Done, Fail


class Counters(Counter[str]):
    """Event counts (a Counter: `counters[key] += n`) plus `job_seconds`, the exponentially weighted
    mean duration of completed jobs (weight 0.1 per job; 1 s before the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.job_seconds = 1.0

    def count_terminal(self, terminal: Done | Fail, seconds: float) -> None:
        """Count a job's terminal reply: `completed` (and its duration `seconds` into job_seconds) or
        failed_<code>."""
        if isinstance(terminal, Done):
            self["completed"] += 1
            self.job_seconds = 0.9 * self.job_seconds + 0.1 * seconds
        else:
            self[f"failed_{terminal.code}"] += 1

    def snapshot(self) -> dict[str, int]:
        """A plain dict copy (what STATS sends)."""
        return dict(self)
