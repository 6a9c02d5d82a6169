"""The engine's metrics in one place: the counters its parts add to, and the snapshot it reports.

`EngineCounters` holds monotonic event counts; the engine makes one and hands it to the block manager
(prefix-cache lookups) and the scheduler (preemptions, verified drafts). `EngineStats` is what
`LLMEngine.stats()` returns: those counts beside the current queue and cache gauges; the worker process
sends parts of it in its READY and heartbeat messages. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineCounters:
    """Counts since the engine started (never reset)."""

    prefix_cache_queries: int = 0  # full prompt blocks looked up at admission
    prefix_cache_hits: int = 0  # of those, found in the prefix cache
    preemptions: int = 0  # requests preempted (by recompute) to free KV blocks
    draft_tokens: int = 0  # draft tokens verified (speculative decoding)
    accepted_draft_tokens: int = 0  # of those, accepted


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_cached_blocks: int  # unreferenced blocks kept for prefix reuse (evictable)
    num_total_blocks: int
    block_size: int
    prefix_cache_queries: int  # full prompt blocks looked up
    prefix_cache_hits: int  # of those, found cached
    num_preemptions: int
