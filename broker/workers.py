"""The worker table: registration (READY), liveness (heartbeats), and the routing ids workers send from.

A worker registers from its control socket (the routing id that sent READY, the only one the broker
sends to); READY may name a second, data socket (`data_id`) whose messages count as the worker's.
Invariants:
- every routing id in the table (control or data) belongs to exactly one registered worker;
- a worker silent for `liveness` x its heartbeat interval is due to be declared dead (`silent`), and
  one that is not gets a broker heartbeat once per interval (`heartbeats_due`);
- a removed worker never comes back: a READY from the same socket registers a new WorkerInfo.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenmill.protocol.wire import Ready, WorkerHeartbeat


@dataclass(eq=False)
class WorkerInfo:
    """What the broker knows about one registered worker (keyed by its routing id; its output may also
    come from its data socket, `data_ident`, b"" if none)."""

    ident: bytes
    name: str
    models: frozenset[str]
    capacity: int  # jobs the broker may have in flight on it at once
    kv_blocks: int
    block_size: int
    max_model_len: int
    interval: float  # heartbeat interval both ways, announced by the worker
    last_seen: float
    next_heartbeat: float
    jobs: set[str] = field(default_factory=set)  # job ids whose current attempt runs here
    load: WorkerHeartbeat = field(default_factory=WorkerHeartbeat)
    dispatched: int = 0
    data_ident: bytes = b""
    max_prompt_chars: int = 0  # Ready.max_prompt_chars: longer text never fits (0: no bound known)
    role: str = "both"  # Ready.role: "prefill" / "decode" workers serve jobs disaggregated (dispatch.py)
    kv_address: str = ""  # Ready.kv_address: where a decode worker receives KV blocks
    prefills: set[str] = field(default_factory=set)  # job ids whose prompt it computes for another worker
    sampling_defaults: dict[str, int | float] = field(default_factory=dict)  # Ready.sampling_defaults

    @classmethod
    def from_ready(cls, ident: bytes, msg: Ready, now: float) -> WorkerInfo:
        return cls(ident, msg.name, frozenset(msg.models), msg.capacity, msg.kv_blocks, msg.block_size,
                   msg.max_model_len, msg.heartbeat_interval, now, now + msg.heartbeat_interval,
                   load=WorkerHeartbeat(0, 0, msg.kv_blocks, 0), data_ident=msg.data_id.encode(),
                   max_prompt_chars=msg.max_prompt_chars, role=msg.role, kv_address=msg.kv_address,
                   sampling_defaults=dict(msg.sampling_defaults))

    def serves(self, model: str) -> bool:
        """An empty model name means "any model"."""
        return not model or model in self.models

    def has_room(self) -> bool:
        return len(self.jobs) + len(self.prefills) < self.capacity

    def load_score(self) -> float:
        """Lower is better: share of capacity in use, plus KV pressure from the last heartbeat."""
        busy = (len(self.jobs) + len(self.prefills)) / self.capacity
        if self.kv_blocks > 0:
            free = (self.load.free_blocks + self.load.cached_blocks) / self.kv_blocks
            busy += 0.5 * max(0.0, 1.0 - free)
        return busy

    def assign(self, job_id: str) -> None:
        """The job's current attempt now runs here."""
        self.jobs.add(job_id)
        self.dispatched += 1

    def describe(self, now: float) -> dict[str, object]:
        return {"name": self.name, "models": sorted(self.models), "capacity": self.capacity,
                "inflight": len(self.jobs), "kv_blocks": self.kv_blocks, "block_size": self.block_size,
                "max_model_len": self.max_model_len, "max_prompt_chars": self.max_prompt_chars,
                "running": self.load.running, "waiting": self.load.waiting,
                "free_blocks": self.load.free_blocks, "cached_blocks": self.load.cached_blocks,
                "dispatched": self.dispatched, "last_seen_ago": round(now - self.last_seen, 3),
                # cumulative counters from the worker's heartbeat (the gateway's /health and /metrics)
                "steps": self.load.steps, "prefix_queries": self.load.prefix_queries,
                "prefix_hits": self.load.prefix_hits, "preemptions": self.load.preemptions,
                "role": self.role, "prefilling": len(self.prefills), "sampling_defaults": self.sampling_defaults}


class WorkerTable:
    """The registered workers by control routing id, and by data routing id."""

    REREGISTER_EVERY = 1.0  # s: at most one "reregister" answer per unknown routing id this often
    _MAX_REREGISTER_MARKS = 10_000

    def __init__(self) -> None:
        self._control: dict[bytes, WorkerInfo] = {}
        self._data: dict[bytes, WorkerInfo] = {}
        self._reregister_sent: dict[bytes, float] = {}  # unknown routing id -> when it was last asked

    def __len__(self) -> int:
        return len(self._control)

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self._control.values()))  # a copy: callers may remove workers meanwhile

    def get(self, ident: bytes) -> WorkerInfo | None:
        """The worker whose control socket has routing id `ident`."""
        return self._control.get(ident)

    def sender(self, ident: bytes) -> WorkerInfo | None:
        """The worker whose control or data socket has routing id `ident`."""
        return self._control.get(ident) or self._data.get(ident)

    def control_idents(self) -> list[bytes]:
        return list(self._control)

    def data_idents(self) -> list[bytes]:
        return list(self._data)

    def conflicts(self, ident: bytes, msg: Ready) -> bool:
        """Whether a READY from `ident` claims a routing id in use by another socket: `ident` is some
        worker's data socket, or its data_id is `ident` itself or some worker's control socket."""
        data_ident = msg.data_id.encode()
        return ident in self._data or data_ident == ident or data_ident in self._control

    def replaced_by(self, ident: bytes, msg: Ready) -> list[WorkerInfo]:
        """The registered workers a READY from `ident` replaces (same control or data socket: the worker
        reset itself, so whatever it ran is gone)."""
        found = (self._control.get(ident), self._data.get(msg.data_id.encode()) if msg.data_id else None)
        return list({id(w): w for w in found if w is not None}.values())

    def register(self, ident: bytes, msg: Ready, now: float) -> WorkerInfo:
        """Register a worker (after `conflicts` said no and the workers it replaces were removed)."""
        w = WorkerInfo.from_ready(ident, msg, now)
        assert ident not in self._control and (not w.data_ident or w.data_ident not in self._data)
        self._control[ident] = w
        if w.data_ident:
            self._data[w.data_ident] = w
        self._reregister_sent.pop(ident, None)
        return w

    def remove(self, w: WorkerInfo) -> bool:
        """Forget `w`; False if it was not registered (already removed, or replaced)."""
        if self._control.get(w.ident) is not w:
            return False
        del self._control[w.ident]
        if self._data.get(w.data_ident) is w:
            del self._data[w.data_ident]
        return True

    def silent(self, now: float, liveness: int) -> list[WorkerInfo]:
        """The workers not heard from for `liveness` heartbeat intervals."""
        return [w for w in self._control.values() if now - w.last_seen > w.interval * liveness]

    def heartbeats_due(self, now: float) -> list[WorkerInfo]:
        """The workers owed a broker heartbeat now; each one's next is scheduled an interval on."""
        due = [w for w in self._control.values() if now >= w.next_heartbeat]
        for w in due:
            w.next_heartbeat = now + w.interval
        return due

    def poll_interval(self, longest: float) -> float:
        """How long the loop may sleep: a fifth of the shortest heartbeat interval, at most `longest`."""
        return min([longest, *(w.interval / 5 for w in self._control.values())])

    def serving(self, model: str) -> list[WorkerInfo]:
        return [w for w in self._control.values() if w.serves(model)]

    def capacity(self, model: str) -> int:
        """Jobs the workers serving `model` may run at once, together."""
        return sum(w.capacity for w in self.serving(model))

    def should_ask_reregister(self, ident: bytes, now: float) -> bool:
        """Whether to answer output from unknown routing id `ident` with DISCONNECT reregister: at most
        once per REREGISTER_EVERY per id (a stream of stale output is not answered in kind)."""
        if now - self._reregister_sent.get(ident, -1e9) < self.REREGISTER_EVERY:
            return False
        if len(self._reregister_sent) >= self._MAX_REREGISTER_MARKS:
            self._reregister_sent.clear()
        self._reregister_sent[ident] = now
        return True
