"""Prometheus metrics of the gateway (prometheus-client), named as vLLM names them with the `tokenmill:`
prefix in place of `vllm:` (so a vLLM dashboard ports by renaming the prefix).

Per request, measured here: requests by finish reason, prompt / generation tokens, prefix-cache queries
and hits (tokens, from each job's usage), TTFT, inter-token latency, time per output token, end-to-end
latency, queue time (from the broker's DONE). Of the pool, read from the broker's STATS at scrape time
(`PoolCollector`): running and waiting requests, KV-cache usage, preemptions, migrations, per-worker
load and prefix-cache block counters, workers registered."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.gateway.pool import PoolView

P = "tokenmill:"
# Bucket edges as vLLM's, with finer ones below 10 ms for per-token latencies on a GPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, *REQUEST_BUCKETS)


class GatewayMetrics:
    """The metric objects of one gateway, in their own registry (several apps may live in one process)."""

    def __init__(self, pool: PoolView) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lbl = self.registry, ["model_name"]
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=r)
        self.request_errors = Counter(P + "request_errors", "Requests answered with an error, by HTTP status",
                                      ["model_name", "status"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed", lbl, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generation tokens produced", lbl, registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lbl, registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache", lbl,
                                   registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive output chunks", lbl,
                             buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Per request: decode time per output token",
                              lbl, buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency", lbl,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time a job waited at the broker", lbl,
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(P + "request_prompt_tokens", "Prompt tokens per request", lbl,
                                               buckets=_token_count_buckets(), registry=r)
        self.request_generation_tokens = Histogram(P + "request_generation_tokens", "Output tokens per request",
                                                   lbl, buckets=_token_count_buckets(), registry=r)
        r.register(PoolCollector(pool))
        self._pending: list[tuple[Any, float]] = []  # (histogram child, value) to observe soon
        self._multiprocess: CollectorRegistry | None = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # one of several gateway processes (gateway/server.py)
            from prometheus_client.multiprocess import MultiProcessCollector

            self._multiprocess = CollectorRegistry(auto_describe=True)
            MultiProcessCollector(self._multiprocess)  # every process's counters and histograms, summed
            self._multiprocess.register(PoolCollector(pool))

    def observe_soon(self, histogram: Any, value: float) -> None:
        """Observe `value` once the callbacks ready now have run: a step's tokens for every stream are
        written first, their per-token observations (~3 us each) after."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((histogram, value))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for histogram, value in pending:
            histogram.observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self._multiprocess or self.registry)


def _token_count_buckets() -> tuple[float, ...]:
    return tuple(float(x * 10**e) for e in range(6) for x in (1, 2, 5))


class PoolCollector(Collector):
    """Pool metrics from the latest STATS reply (nothing when the broker never answered)."""

    def __init__(self, pool: PoolView) -> None:
        self.pool = pool

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families depend on the pool

    def collect(self) -> Iterator[Any]:
        stats = self.pool.stats
        if stats is None:
            return
        workers = stats.get("workers") or []
        queued = sum(int(n) for n in (stats.get("queues") or {}).values())
        counters = stats.get("counters") or {}
        yield _gauge("num_requests_running", "Requests running on the workers' engines",
                     sum(int(w.get("running", 0)) for w in workers))
        yield _gauge("num_requests_waiting", "Requests waiting in the workers' engines and the broker's queues",
                     queued + sum(int(w.get("waiting", 0)) for w in workers))
        total = sum(int(w.get("kv_blocks", 0)) for w in workers)
        yield _gauge("kv_cache_usage_perc", "KV-cache usage of the pool (1 = full)",
                     sum(_used_blocks(w) for w in workers) / total if total else 0.0)
        yield _counter("num_preemptions", "Preemptions on the workers registered now",
                       sum(int(w.get("preemptions", 0)) for w in workers))
        yield _counter("num_migrations", "Jobs migrated from a lost worker (broker)",
                       int(counters.get("migrations", 0)))
        yield _counter("broker_rejected_overloaded", "Submits the broker refused with OVERLOADED",
                       int(counters.get("rejected_overloaded", 0)))
        yield _gauge("num_workers", "Workers registered with the broker", len(workers))
        yield _gauge("broker_queued_jobs", "Jobs queued at the broker for a worker", queued)
        yield from _per_worker(workers)


def _used_blocks(w: dict[str, Any]) -> int:
    return max(0, int(w.get("kv_blocks", 0)) - int(w.get("free_blocks", 0)) - int(w.get("cached_blocks", 0)))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, value=value)


def _per_worker(workers: list[dict[str, Any]]) -> Iterator[Any]:
    labels = ["worker"]
    usage = GaugeMetricFamily(P + "worker_kv_cache_usage_perc", "KV-cache usage per worker", labels=labels)
    running = GaugeMetricFamily(P + "worker_num_requests_running", "Running requests per worker", labels=labels)
    waiting = GaugeMetricFamily(P + "worker_num_requests_waiting", "Waiting requests per worker", labels=labels)
    queries = CounterMetricFamily(P + "worker_prefix_cache_queries_blocks",
                                  "Full prompt blocks looked up in the worker's prefix cache", labels=labels)
    hits = CounterMetricFamily(P + "worker_prefix_cache_hits_blocks", "Of those, found cached", labels=labels)
    steps = CounterMetricFamily(P + "worker_engine_steps", "Engine steps run by the worker", labels=labels)
    for w in workers:
        name = [str(w.get("name"))]
        blocks = int(w.get("kv_blocks", 0))
        usage.add_metric(name, _used_blocks(w) / blocks if blocks else 0.0)
        running.add_metric(name, int(w.get("running", 0)))
        waiting.add_metric(name, int(w.get("waiting", 0)))
        queries.add_metric(name, int(w.get("prefix_queries", 0)))
        hits.add_metric(name, int(w.get("prefix_hits", 0)))
        steps.add_metric(name, int(w.get("steps", 0)))
    yield from (usage, running, waiting, queries, hits, steps)
