"""Per-client bounds on what the broker queues for a client that does not read.

A reply the broker sends waits in the client's ZeroMQ pipe (up to its high-water mark) until the client
reads it; a client that sends requests and never reads would make the broker hold every answer. Job
output needs no bound here: it lives in the job's token log and is sent from a cursor as the client keeps
up. What is bounded are the answers that exist only as queued messages, each kind by a token bucket per
client (`Budget`): past it the answer is dropped and counted, never queued.

- CONTROL: PONG and STATS_REPLY (answers to PING and STATS);
- REJECT: the FAIL that refuses a message outright (malformed, or a SUBMIT not accepted: invalid,
  overloaded, conflict, draining) or answers a CANCEL / SUBSCRIBE about a job it may not touch.

The SDK never comes near these rates (one PING per heartbeat interval, STATS on demand, a FAIL per
refused job), and what it does not get it learns from its own deadlines (no ACK within broker_timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class ReplyKind(Enum):
    CONTROL = "control"
    REJECT = "reject"


@dataclass(frozen=True)
class BudgetConfig:
    """Token buckets per client: `burst` replies at once, refilled at `rate` per second."""

    control_burst: int = 64
    control_rate: float = 32.0
    reject_burst: int = 4096
    reject_rate: float = 2048.0

    def __post_init__(self) -> None:
        if min(self.control_burst, self.reject_burst) < 1 or min(self.control_rate, self.reject_rate) <= 0:
            raise ValueError("reply budgets need burst >= 1 and rate > 0")


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


@dataclass
class Budget:
    """The buckets of every client, by routing id; `forget` a client when it goes away."""

    cfg: BudgetConfig = field(default_factory=BudgetConfig)
    _buckets: dict[tuple[bytes, ReplyKind], _Bucket] = field(default_factory=dict)

    def allow(self, client: bytes, kind: ReplyKind, now: float) -> bool:
        """Take one token of `kind` for `client` if it has one (monotonic `now`, seconds)."""
        burst, rate = self._limits(kind)
        b = self._buckets.get((client, kind))
        if b is None:
            b = self._buckets[(client, kind)] = _Bucket(float(burst), now)
        else:
            b.tokens = min(float(burst), b.tokens + (now - b.stamp) * rate)
            b.stamp = now
        if b.tokens < 1.0:
            return False
        b.tokens -= 1.0
        return True

    def _limits(self, kind: ReplyKind) -> tuple[int, float]:
        cfg = self.cfg
        if kind is ReplyKind.CONTROL:
            return cfg.control_burst, cfg.control_rate
        return cfg.reject_burst, cfg.reject_rate

    def forget(self, client: bytes) -> None:
        for kind in ReplyKind:
            self._buckets.pop((client, kind), None)

    def prune(self, now: float) -> None:
        """Drop the buckets that have refilled completely: a full bucket is what a new client gets, so this
        changes no decision, and the table stays as small as the set of recently busy clients."""
        full = [k for k, b in self._buckets.items() if (now - b.stamp) * self._limits(k[1])[1] + b.tokens
                >= self._limits(k[1])[0]]
        for k in full:
            del self._buckets[k]

    def __len__(self) -> int:
        return len(self._buckets)
