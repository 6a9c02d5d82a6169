"""Per-model FIFO queues of the jobs waiting for a worker (migrated jobs go first in line).

A job leaves its queue when it is dispatched, or, lazily, when it is finished while queued (cancelled,
expired): its entry stays in the deque until it reaches the head or the deque is compacted. Invariant:
`waiting(model)` == the number of QUEUED jobs of that model in its deque.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable
from typing import TypeVar

from tokenmill.broker.jobs import Job, JobState

W = TypeVar("W")


class JobQueues:
    def __init__(self) -> None:
        self._queues: defaultdict[str, deque[Job]] = defaultdict(deque)
        self._waiting: Counter[str] = Counter()

    def waiting(self, model: str) -> int:
        return self._waiting[model]

    def depths(self) -> dict[str, int]:
        """Queued jobs per model, for the models that have any."""
        return {m: n for m, n in self._waiting.items() if n}

    def push(self, job: Job, now: float, front: bool = False) -> None:
        """Queue the job (at the head with `front`: a migrated one goes before newer work)."""
        job.state = JobState.QUEUED
        job.queued_at = now
        q = self._queues[job.model]
        if front:
            q.appendleft(job)
        else:
            q.append(job)
        self._waiting[job.model] += 1

    def remove(self, job: Job) -> None:
        """The queued job is being finished: it no longer counts (its entry goes lazily)."""
        assert job.state is JobState.QUEUED
        self._waiting[job.model] -= 1
        q = self._queues[job.model]
        if len(q) > 2 * self._waiting[job.model] + 64:  # mostly finished entries: compact
            self._queues[job.model] = deque(j for j in q if j.state is JobState.QUEUED and j is not job)

    def dispatch(self, pick: Callable[[Job], W | None], start: Callable[[Job, W], None]) -> None:
        """For each model, offer the queued jobs in order to `pick` until it finds no worker for one;
        each job picked leaves the queue, then `start` runs it there (which may queue jobs again, e.g.
        when the send fails and the worker's jobs migrate: they are offered in this same pass)."""
        for model, q in list(self._queues.items()):
            while q:
                job = q[0]
                if job.state is not JobState.QUEUED:
                    q.popleft()  # finished while queued
                    continue
                worker = pick(job)
                if worker is None:
                    break
                q.popleft()
                self._waiting[model] -= 1
                start(job, worker)
