"""The client table: who is connected, which jobs each one follows, who may touch a job, and sending.

Clients talk to the frontend ROUTER. Subscriptions are served over it (rather than a PUB socket): each
subscriber has a cursor into its job's token log (Job.subscribers), and a send never blocks: the
socket runs with ROUTER_MANDATORY, so a full queue (zmq.Again) and a vanished peer (EHOSTUNREACH) are
reported instead of silently losing messages.
Invariants:
- `jobs_of(cid)` holds every job cid is subscribed to (cid in job.subscribers) and no other retained
  one; a client that leaves loses all its subscriptions at once (`leave`);
- a job whose data or terminal reply a send could not deliver (queue full) is in `lagging` until the
  fan-out resends it from its cursors; nothing is dropped;
- a send that finds the client gone calls `on_gone(cid, "unreachable")` (the broker cancels its jobs),
  for `send` and `send_frames` before they return; `send_raw` leaves that to its caller.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from tokenmill.broker.counters import Counters
from tokenmill.broker.jobs import Job
from tokenmill.protocol import wire as p


class Sent(enum.Enum):
    """What became of a non-blocking send to a client."""

    SENT = "sent"
    BLOCKED = "blocked"  # its queue is full: retry later
    GONE = "gone"  # it is no longer connected


class FrameSender(Protocol):
    """The part of a ROUTER socket the table sends through (a fake one in tests)."""

    def send_multipart(self, msg_parts: list[Any], flags: int = ...) -> Any: ...


class ClientTable:
    """Connected clients (routing id -> last time heard), their subscriptions, and sends to them."""

    def __init__(self, counters: Counters, on_gone: Callable[[bytes, str], None], open_jobs: bool = False,
                 on_send: Callable[[], None] | None = None) -> None:
        self.counters = counters
        self.on_gone = on_gone
        self.open_jobs = open_jobs  # anyone may cancel or subscribe to any job
        self.on_send = on_send  # called after each send call returns (an observer's hook)
        self.sock: FrameSender | None = None  # the frontend socket, once bound
        self.lagging: set[str] = set()  # job ids with data or a terminal reply not yet delivered
        self._seen: dict[bytes, float] = {}
        self._jobs_of: defaultdict[bytes, set[str]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self._seen)

    def heard(self, cid: bytes, now: float) -> None:
        self._seen[cid] = now

    def silent(self, now: float, timeout: float) -> list[bytes]:
        """The clients not heard from for more than `timeout` seconds."""
        return [cid for cid, seen in self._seen.items() if now - seen > timeout]

    def may_access(self, job: Job, owner: str) -> bool:
        """Whether `owner` may cancel or subscribe to `job` (its own, or any with open_jobs)."""
        return self.open_jobs or job.owner == owner

    def jobs_of(self, cid: bytes) -> set[str]:
        return self._jobs_of.get(cid, set())

    def subscribe(self, job: Job, cid: bytes, from_seq: int = 0) -> None:
        """Subscribe cid to job from output position `from_seq` (the chunk holding it is replayed
        whole); the caller flushes the job."""
        job.subscribers[cid] = job.chunk_index(from_seq)
        self._jobs_of[cid].add(job.job_id)

    def unsubscribe(self, job: Job, cid: bytes) -> None:
        """End cid's subscription to job (it has been sent everything, terminal reply included)."""
        job.subscribers.pop(cid, None)
        if (ids := self._jobs_of.get(cid)) is not None:
            ids.discard(job.job_id)

    def leave(self, cid: bytes) -> list[str]:
        """Forget the client: returns the ids of the jobs it followed (sorted), whose subscriptions the
        caller ends (one by one, cancelling what it must in between)."""
        self._seen.pop(cid, None)
        return sorted(self._jobs_of.pop(cid, set()))

    def forget(self, job: Job) -> None:
        """The job left the broker (retention over): drop it from its subscribers' job sets."""
        for cid in job.subscribers:
            if (ids := self._jobs_of.get(cid)) is not None:
                ids.discard(job.job_id)

    def take_lagging(self) -> set[str]:
        lagging, self.lagging = self.lagging, set()
        return lagging

    def send_raw(self, cid: bytes, frames: list[Any]) -> Sent:
        """Non-blocking send with no side effect on jobs. Raises a ZMQError other than a full queue or
        a gone peer."""
        assert self.sock is not None, "no frontend socket"
        try:
            self.sock.send_multipart([cid, *frames], zmq.NOBLOCK)
            status = Sent.SENT
        except zmq.Again:
            self.counters["client_send_blocked"] += 1
            status = Sent.BLOCKED
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            status = Sent.GONE
        if self.on_send is not None:
            self.on_send()
        return status

    def send_frames(self, cid: bytes, frames: list[Any]) -> bool:
        """Send; False when the client's queue is full (the caller retries) or it is gone (then on_gone
        ran before this returns)."""
        status = self.send_raw(cid, frames)
        if status is Sent.GONE:
            self.on_gone(cid, "unreachable")
        return status is Sent.SENT

    def send(self, cid: bytes, msg: p.Message) -> bool:
        return self.send_frames(cid, p.encode(msg))
