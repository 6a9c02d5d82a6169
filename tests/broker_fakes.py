"""Socket stand-ins for the broker's in-process tests (no ZeroMQ sockets, no network)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq


class FakeRouter:
    """Stands in for one of the broker's ROUTER sockets (ROUTER_MANDATORY, non-blocking sends):
    send_multipart([routing id, *frames], flags) hands the frames to `on_send` (default: records them in
    `sent`), or raises what such a socket raises: zmq.Again for an id in `blocked` (its queue is full),
    ZMQError EHOSTUNREACH once for an id in `vanishing` (the peer is gone)."""

    def __init__(self, on_send: Callable[[bytes, list[bytes]], None] | None = None) -> None:
        self.sent: list[tuple[bytes, list[bytes]]] = []
        self.blocked: set[bytes] = set()
        self.vanishing: set[bytes] = set()
        self.on_send = on_send or (lambda ident, frames: self.sent.append((ident, frames)))

    def send_multipart(self, msg_parts: list[Any], flags: int = 0) -> None:
        ident, *frames = msg_parts
        if ident in self.vanishing:
            self.vanishing.discard(ident)
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        if ident in self.blocked:
            raise zmq.Again()
        self.on_send(ident, [bytes(f) for f in frames])


def make_job(job_id: str, client: bytes = b"c", worker: bytes | None = None, attempt: int = 0, **kw: Any) -> Any:
    """A Job (queued, or running attempt `attempt` on `worker`) of model "m" with prompt "x"."""
    from tokenmill.broker.jobs import Job, JobState
    from tokenmill.protocol import wire as p

    fields: dict[str, Any] = {"owner": "", "model": "m", "input": p.RequestInput(prompt="x"), "params": {},
                              "max_tokens": 100, "priority": 0, "client": client, "cancel_on_disconnect": True,
                              "created": 0.0, "deadline": None, "prefix_hashes": []}
    fields.update(kw)
    job = Job(job_id, **fields)
    job.attempt = attempt
    if worker is not None:
        job.state, job.worker = JobState.RUNNING, worker
    return job
