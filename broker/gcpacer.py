"""Paced garbage collection: full collections of CPython's cyclic GC at idle moments of the broker loop.

A collection stops the loop for as long as it takes, at whatever allocation happens to trigger it; a full
(generation 2) one walks every tracked object, i.e. pauses in proportion to the heap. Three measures keep
those pauses off the relay path (the broker makes almost no reference cycles; refcounting frees nearly
everything at once):
- token logs hold no Python objects per chunk (jobs.py), so the heap is a few objects per job;
- what exists after start-up (modules, ~30k objects) is frozen: never walked again;
- young collections (cheap: few survivors) stay automatic, but full ones are taken over: they run after
  a loop turn when they are due (as many young collections as CPython waits for) and no message waits,
  i.e. between bursts, or at the latest `MAX_DEFER` s after becoming due.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from tokenmill.broker.counters import Counters


class GcPacer:
    MAX_DEFER = 1.0  # s a due full collection may wait for an idle moment

    def __init__(self, counters: Counters, busy: Callable[[], bool]) -> None:
        self.counters = counters
        self.busy = busy  # whether a message waits on any socket
        self._threshold: tuple[int, int, int] | None = None  # automatic GC's thresholds before start()
        self._due_since: float | None = None

    @property
    def active(self) -> bool:
        return self._threshold is not None

    def start(self) -> None:
        """Collect, freeze the heap and take full collections over (unless the embedding process turned
        automatic GC off)."""
        gc.collect()
        gc.freeze()
        threshold = gc.get_threshold()
        if gc.isenabled() and threshold[0] > 0:
            self._threshold = threshold
            gc.set_threshold(threshold[0], threshold[1], 1 << 30)  # no automatic full collection

    def stop(self) -> None:
        """Give full collections back to CPython."""
        if self._threshold is not None:
            gc.set_threshold(*self._threshold)
            self._threshold = None

    def after_turn(self, now: float) -> None:
        """At the end of a loop turn: run the full collection if one is due and nothing is waiting (or it
        has waited MAX_DEFER)."""
        if self._threshold is None or gc.get_count()[2] < max(1, self._threshold[2]):
            return
        self.collect(now)

    def collect(self, now: float) -> None:
        """Run the due full collection now if no message waits (or it waited too long)."""
        if self._due_since is None:
            self._due_since = now
        busy = self.busy()
        if busy and now - self._due_since < self.MAX_DEFER:
            return
        gc.collect(2)
        self._due_since = None
        self.counters["gc_full_collections_busy" if busy else "gc_full_collections"] += 1
