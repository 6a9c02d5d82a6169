"""Job timers: a job's deadline (end to end) and the queue timeout of one queued attempt.

A timer names its job and the attempt it was set for; it fires once, at or after its time, and the
broker ignores one whose job is gone or terminal (timers are never cancelled, only outlived).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterator

from tokenmill.broker.jobs import Job


class Timer(enum.Enum):
    DEADLINE = "deadline"  # the job's own deadline: it fails wherever it is
    QUEUE = "queue"  # an attempt queued this long without a worker fails


class Timers:
    """A heap of (when, order, kind, job id, attempt): due timers come out in time order (ties: in the
    order they were set)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer, str, int]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def set(self, when: float, kind: Timer, job: Job) -> None:
        heapq.heappush(self._heap, (when, next(self._order), kind, job.job_id, job.attempt))

    def next_at(self) -> float | None:
        """When the earliest timer is due (None: none set)."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterator[tuple[Timer, str, int]]:
        """Pop (kind, job id, attempt) of each timer due at `now`, earliest first; a timer set while
        this runs fires here too if it is due."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, kind, job_id, attempt = heapq.heappop(heap)
            yield kind, job_id, attempt
