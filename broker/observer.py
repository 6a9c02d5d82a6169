"""Hooks on the broker loop's events, for tracing and benchmarks (benchmarks/broker_bench.py uses them).

Pass an observer to Broker(..., observer=...). Its methods run on the broker's thread, inline: they must
be quick and must not raise. Every method here does nothing; a subclass overrides what it traces.
"""

from __future__ import annotations

from typing import Any


class BrokerObserver:
    def worker_message(self, frames: list[Any]) -> None:
        """A worker's message (routing id + frames) is about to be handled."""

    def worker_message_handled(self, frames: list[Any]) -> None:
        """The handler of that message returned (or raised)."""

    def client_send(self) -> None:
        """A send to a client returned (sent, or found its queue full or the client gone)."""

    def tick_started(self) -> None:
        """The loop's timer work (deadlines, liveness, heartbeats, retention, resends, dispatch) begins."""

    def tick_finished(self) -> None:
        """... and ended."""

    def stats(self) -> dict[str, Any]:
        """Top-level keys the observer adds to the broker's STATS reply (none here)."""
        return {}
