"""Broker relay benchmark: tokens/s the broker relays on one CPU core with batched TOKENS messages, and
the latency per token the worker -> broker -> client path adds over consuming an engine in-process.

The worker here is SYNTHETIC: a process speaking the worker protocol that emits TOKENS batches (one
chunk per active job per "step") at full speed (throughput) or at a fixed step rate carrying the emit
time in each chunk's text (latency; steps start once all the run's jobs are running). No model runs:
this measures the broker and the wire, not generation. The broker is the real `Broker` class in its own
process, pinned to one core (its Python loop and its ZeroMQ IO thread; `--broker-io-core` moves the IO
thread elsewhere), started through `_broker` below with an observer (broker/observer.py) that only
timestamps each worker message (on entry to the broker's handler, after its first client send, on
exit) and records the broker's GC pauses (`--untraced` runs the plain `tokenmill broker` command
instead, without the per-hop breakdown). The client is a raw DEALER that decodes every message
(msgpack) and checks sequence numbers. The broker keeps the throughput run's jobs (256 x 1000 chunks)
for its retention period, so the latency run sees that heap.

Per-hop breakdown of the latency run (one clock, CLOCK_MONOTONIC, across the processes):
    worker emit -> broker recv   the worker's msgpack + send, both IO threads, TCP, the broker's wake-up
                                 (or the time it was busy with something else, e.g. a GC pause)
    broker recv -> broker sent   the broker's own work on the message up to the return of its (first)
                                 STREAM send: decode, checks, STREAM send (its IO thread shares its
                                 core, so this can include the TCP send)
    broker sent -> client recv   the rest of the way to the client (negative when the client had the
                                 message before the broker's send call returned)
    (broker sent -> handler returned: what the broker does after that send, e.g. the token log
    append of a batch forwarded as it came; off the message's path, listed for completeness)

Cores (`--layout`, see _layout): with 3+ cores the broker, the synthetic worker and the client get one
core each (off the broker core's SMT siblings when possible), so nothing else runs on the broker's core;
with 2 the worker and the client share the second core. The synthetic worker and the client run with
their cyclic GC off (they stand in for an engine and an application; their pauses are not the broker's).

`--worker real` runs the latency part through the real worker process code instead (worker/process.py:
its IO thread, the engine loop and its data socket, its encoding) around PacedEngine, a fake engine that
holds the GIL for `--engine-busy` of each step as a scheduler and model launch do; with 4+ cores the
worker gets two (the engine loop on one, its IO threads on the other). `--busy-poll S` sets the broker's
BrokerConfig.busy_poll.

    python -m tokenmill.benchmarks.broker_bench [--jobs 256 --steps 1000 --tokens-per-chunk 1]
    python -m tokenmill.benchmarks.broker_bench --latency-steps 6000   # 60 s: p99.9 from 6 messages
    python -m tokenmill.benchmarks.broker_bench --latency-steps 6000 --busy-poll 0.02   # a broker core spinning
    python -m tokenmill.benchmarks.broker_bench --latency-steps 3000 --worker real
Results: benchmarks/results/cpu/broker_relay.{json,md}; `--dump-trace` adds every message's timestamps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import zmq

from tokenmill.protocol import wire as p

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"
PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin_io(ctx: zmq.Context, cores: list[int] | None) -> None:
    """Pin the context's IO thread (created with its first socket) to `cores`."""
    for c in cores or ():
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, c)


def _split_cores(cores: list[int]) -> tuple[list[int], list[int] | None]:
    """A process's cores: the Python thread on the first, its ZeroMQ IO thread on the rest (if any)."""
    return cores[:1], (cores[1:] or None)


# ---- the synthetic worker ---------------------------------------------------------------------------


def fake_worker(broker: str, tokens_per_chunk: int, step_rate: float, cores: list[int] | None,
                start_jobs: int = 1) -> None:
    """Register, then on every step emit one TOKENS message with a chunk per active job (text = emit
    time in ns when paced) and a FINISHED message for jobs that reached max_tokens. Steps start once
    `start_jobs` jobs are running (the latency run measures the relay, not the admission of its jobs)."""
    gc.disable()  # the synthetic engine's own pauses are not the broker's (it makes no cyclic garbage)
    ctx = zmq.Context()
    if cores:
        main_core, io_cores = _split_cores(cores)
        _pin_io(ctx, io_cores)
        os.sched_setaffinity(0, main_core)
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(broker)
    s.send_multipart(p.encode(p.Ready("synthetic", ["bench"], 1 << 20, 1 << 20, 16, 1 << 20, 5.0)))
    jobs: dict[str, list[int]] = {}  # job id -> [attempt, next seq, max tokens]
    head = [p.HEADER, bytes((p.Cmd.W_TOKENS,))]
    fin_head = [p.HEADER, bytes((p.Cmd.W_FINISHED,))]
    period = 1.0 / step_rate if step_rate > 0 else 0.0
    next_step = next_beat = time.monotonic()
    started = False
    while True:
        if started and period:  # paced: sleep to the next step (a poll timeout is too coarse here)
            time.sleep(max(0.0, next_step - time.monotonic()))
        if s.poll(0 if started else 500):
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = p.decode(frames, p.BROKER_TO_WORKER)
                if isinstance(msg, p.WorkerSubmit):
                    jobs[msg.job_id] = [msg.attempt, len(msg.resume_token_ids), int(msg.params["max_tokens"])]
                elif isinstance(msg, p.WorkerCancel):
                    jobs.pop(msg.job_id, None)
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + 1.0
            s.send_multipart(p.encode(p.WorkerHeartbeat(len(jobs), 0, 1 << 20, 0)))
        if not jobs:
            started = False
            continue
        if not started:
            if len(jobs) < start_jobs:
                continue
            started, next_step = True, now  # pacing starts with the jobs, not at process start
        if now < next_step:
            continue
        # An engine that is late steps once, late; it does not emit a burst of the steps it missed (nor
        # after an idle spell: the first job after one starts a fresh schedule).
        next_step = max(next_step + period, now) if period else now
        text = str(time.perf_counter_ns()) if period else ""
        attempts, entries, finished = [], [], []  # the TOKENS body: [attempts, STREAM entries]
        for job_id, st in list(jobs.items()):
            attempt, seq, max_tokens = st
            n = min(tokens_per_chunk, max_tokens - seq)
            attempts.append(attempt)
            entries.append([job_id, seq, [7] * n, text, None])
            st[1] = seq + n
            if st[1] >= max_tokens:
                finished.append([job_id, attempt, "length", None, [1, st[1], 0]])
                del jobs[job_id]
        s.send_multipart([*head, msgpack.packb([attempts, entries])])
        if finished:
            s.send_multipart([*fin_head, msgpack.packb(finished)])


# ---- the real worker process code around a paced fake engine --------------------------------------


class PacedEngine:
    """An EngineLike (worker/process.py) that stands in for a GPU engine at a fixed step rate: each
    step first holds the GIL for `busy` of the step period (a scheduler, model launch and sampling
    running Python), then waits with the GIL released until the step is due (the GPU), then returns
    one token per request, its text the time of the return in ns (what an in-process consumer would
    get at that moment). Steps start once `start_jobs` requests are in."""

    model_name = "bench"
    max_model_len = 1 << 20

    def __init__(self, step_rate: float, busy: float, start_jobs: int) -> None:
        self.period = 1.0 / step_rate
        self.busy = busy * self.period
        self.start_jobs = start_jobs
        self.reqs: dict[str, list[int]] = {}  # request id -> [next index, max tokens]
        self.next_step = 0.0
        self.started = False
        self.pin_to: list[int] | None = None  # cores the calling thread moves to at the first step

    def add_request(self, request_id: str, prompt: str | None = None, *, prompt_token_ids: Any = None,
                    messages: Any = None, params: Any = None, priority: int = 0, resume_token_ids: Any = ()) -> None:
        self.reqs[request_id] = [len(resume_token_ids), int(params.max_tokens)]

    def abort_request(self, request_id: str) -> bool:
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def stats(self) -> Any:
        from tokenmill.worker.metrics import EngineStats

        return EngineStats(len(self.reqs), 0, 1 << 20, 0, 1 << 20, 16, 0, 0, 0)

    def step(self) -> list[Any]:
        from tokenmill.worker.outputs import RequestOutput, Usage

        if self.pin_to:
            os.sched_setaffinity(0, self.pin_to)  # this thread only
            self.pin_to = None
        now = time.monotonic()
        if not self.started:
            if len(self.reqs) < self.start_jobs:
                time.sleep(0.001)
                return []
            self.started, self.next_step = True, now
        end = now + self.busy
        while time.monotonic() < end:  # Python holding the GIL
            pass
        self.next_step = max(self.next_step + self.period, time.monotonic())
        time.sleep(max(0.0, self.next_step - time.monotonic()))  # the GPU: GIL released
        text = str(time.perf_counter_ns())
        out = []
        for rid, st in list(self.reqs.items()):
            index, max_tokens = st
            st[0] = index + 1
            if st[0] >= max_tokens:
                del self.reqs[rid]
                out.append(RequestOutput(rid, [7], text, index, finished=True, finish_reason="length",
                                         usage=Usage(1, st[0], 0)))
            else:
                out.append(RequestOutput(rid, [7], text, index))
        if not self.reqs:
            self.started = False
        return out


def real_worker(broker: str, step_rate: float, busy: float, cores: list[int] | None, start_jobs: int) -> None:
    """worker.process.run_worker (IO thread, engine loop, encoding) around a PacedEngine."""
    from tokenmill.worker.process import WorkerOptions, run_worker

    gc.disable()  # as for the synthetic worker: the engine's own pauses are not the relay's
    engine = PacedEngine(step_rate, busy, start_jobs)
    if cores and len(cores) > 1:
        # The IO threads (Python's and ZeroMQ's, started by run_worker) inherit this thread's cores, the
        # second; the engine loop (this thread) moves to the first at its first step. A GPU worker is
        # not confined to one core: on one, its IO threads would queue behind the engine's Python.
        os.sched_setaffinity(0, cores[1:])
        engine.pin_to = cores[:1]
    elif cores:
        os.sched_setaffinity(0, cores)
    run_worker(engine, WorkerOptions(broker=broker, name="bench-real", capacity=1 << 16))


# ---- the broker, with per-hop timestamps ------------------------------------------------------------


def traced_broker(frontend: str, backend: str, io_cores: list[int] | None, busy_poll: float = 0.0) -> None:
    """The real Broker with three timestamps per worker message (handler entry, return of its first
    send to a client, handler exit) and a record of its GC pauses; both are returned in its STATS reply
    under "bench"."""
    from tokenmill.broker import Broker, BrokerConfig
    from tokenmill.broker.observer import BrokerObserver

    w_tokens = bytes((p.Cmd.W_TOKENS,))

    class Tracer(BrokerObserver):
        def __init__(self) -> None:
            # (recv, sent, done, TOKENS body): handler entry, its first client send returned, handler exit
            self.trace: deque[tuple[int, int, int, bytes]] = deque(maxlen=200_000)
            self._recv_at = self._sent_at = self._tick_at = 0
            self.gc_pauses: deque[tuple[int, int, int]] = deque(maxlen=200_000)  # (start, ns, generation)
            self.slow_ticks: deque[tuple[int, int]] = deque(maxlen=10_000)  # (start, ns) of ticks > 100 us
            self._gc_start = 0
            gc.callbacks.append(self._on_gc)

        def _on_gc(self, phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self._gc_start = time.perf_counter_ns()
            else:
                self.gc_pauses.append((self._gc_start, time.perf_counter_ns() - self._gc_start, info["generation"]))

        def worker_message(self, frames: list[Any]) -> None:
            self._sent_at = 0
            self._recv_at = time.perf_counter_ns()

        def worker_message_handled(self, frames: list[Any]) -> None:
            if len(frames) == 4 and frames[2] == w_tokens:
                done = time.perf_counter_ns()
                self.trace.append((self._recv_at, self._sent_at or done, done, frames[3]))

        def client_send(self) -> None:
            if not self._sent_at:
                self._sent_at = time.perf_counter_ns()

        def tick_started(self) -> None:
            self._tick_at = time.perf_counter_ns()

        def tick_finished(self) -> None:
            d = time.perf_counter_ns() - self._tick_at
            if d > 100_000:
                self.slow_ticks.append((self._tick_at, d))

        def stats(self) -> dict[str, Any]:
            hops = []
            for recv, sent, done, body in self.trace:
                entries = msgpack.unpackb(body)[1]
                if entries and entries[0][3]:  # paced messages carry the emit time
                    hops.append([int(entries[0][3]), recv, sent, done])
            was = gc.isenabled()
            gc.disable()  # the GC callback appends to gc_pauses: no collection while it is copied
            try:
                pauses = [list(x) for x in self.gc_pauses]
            finally:
                if was:
                    gc.enable()
            return {"bench": {"hops": hops, "gc_pauses": pauses, "slow_ticks": [list(x) for x in self.slow_ticks],
                              "gc_threshold": list(gc.get_threshold()), "gc_enabled": gc.isenabled(),
                              "gc_frozen": gc.get_freeze_count()}}

    ctx = zmq.Context()
    _pin_io(ctx, io_cores)
    broker = Broker(BrokerConfig(frontend=frontend, backend=backend, queue_size=1 << 20, busy_poll=busy_poll),
                    ctx, observer=Tracer())
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    broker.serve_forever()


# ---- the client side --------------------------------------------------------------------------------


def _client_ctx(io_cores: list[int] | None) -> zmq.Context:
    ctx = zmq.Context()
    _pin_io(ctx, io_cores)
    return ctx


def _run_jobs(address: str, n_jobs: int, max_tokens: int, tag: str, io_cores: list[int] | None) -> dict[str, Any]:
    """Submit n_jobs, receive every STREAM/DONE; returns token count, span, per-token latencies and
    per-message (emit, receive) pairs."""
    ctx = _client_ctx(io_cores)
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(address)
    for i in range(n_jobs):
        s.send_multipart(p.encode(p.Submit(f"{tag}-{i}", "bench", p.RequestInput(prompt="x"),
                                           {"max_tokens": max_tokens})))
    expected = dict.fromkeys((f"{tag}-{i}" for i in range(n_jobs)), 0)
    done = tokens = messages = 0
    latencies: list[int] = []
    arrivals: list[tuple[int, int]] = []  # (emit ns of the message's first chunk, receive ns)
    t_first = t_last = 0.0
    next_ping = time.monotonic() + 1.0
    while done < n_jobs:
        if time.monotonic() >= next_ping:  # as the SDK does: a client silent for client_timeout is gone
            next_ping = time.monotonic() + 1.0
            s.send_multipart(p.encode(p.Ping()))
        if not s.poll(30_000):
            raise TimeoutError("relay stalled")
        frames = s.recv_multipart()
        now_ns = time.perf_counter_ns()
        cmd = frames[1][0]
        if cmd == p.Cmd.STREAM:
            t_last = time.perf_counter()
            t_first = t_first or t_last
            messages += 1
            entries = msgpack.unpackb(frames[2])
            for job_id, seq, ids, text, _ in entries:
                assert seq == expected[job_id], "gap or duplicate"
                expected[job_id] = seq + len(ids)
                tokens += len(ids)
                if text:
                    latencies.extend([now_ns - int(text)] * len(ids))
            if entries and entries[0][3]:
                arrivals.append((int(entries[0][3]), now_ns))
        elif cmd in (p.Cmd.DONE, p.Cmd.FAIL):
            msg = p.decode(frames, p.BROKER_TO_CLIENT)
            assert isinstance(msg, p.Done), msg
            done += 1
    assert all(n == max_tokens for n in expected.values()), "tokens missing"
    s.close()
    ctx.term()
    return {"tokens": tokens, "seconds": t_last - t_first, "stream_messages": messages, "latencies_ns": latencies,
            "arrivals": arrivals}


def _broker_stats(address: str) -> dict[str, Any]:
    ctx = _client_ctx(None)
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send_multipart(p.encode(p.StatsRequest()))
    if not s.poll(30_000):
        raise TimeoutError("no STATS reply")
    frames = s.recv_multipart()
    s.close()
    ctx.term()
    return msgpack.unpackb(frames[2])  # type: ignore[no-any-return]


def _pct(xs: list[int], q: float) -> float:
    """Percentile `q` of nanosecond samples, in microseconds (nearest rank on the sorted samples)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000.0


def _summary_ms(xs: list[int]) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean of nanosecond samples, in ms."""
    if not xs:
        return {}
    s = sorted(xs)
    out = {name: round(s[min(len(s) - 1, int(q * len(s)))] / 1e6, 4) for name, q in PERCENTILES}
    out["max"] = round(s[-1] / 1e6, 4)
    out["mean"] = round(statistics.fmean(s) / 1e6, 4)
    return out


def _in_process_latency(n: int) -> list[int]:
    """Baseline: an engine consumed in-process hands its step output over by a function return."""
    out: list[int] = []
    for _ in range(n):
        t = time.perf_counter_ns()
        delta = [(f"job-{i}", [7], "") for i in range(1)]  # what step() would return
        _ = delta[0]
        out.append(time.perf_counter_ns() - t)
    return out


def _spawn(argv: list[str], cores: list[int] | None) -> subprocess.Popen[bytes]:
    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    quiet = not os.environ.get("BROKER_BENCH_STDERR")  # set it to see the processes' logs and errors
    return subprocess.Popen([sys.executable, *argv], preexec_fn=pin, stdout=subprocess.DEVNULL if quiet else None,
                            stderr=subprocess.DEVNULL if quiet else None)


def _siblings(core: int) -> set[int]:
    """`core` and its SMT siblings (sysfs); just `core` where the topology is not exposed."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return {core}
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out | {core}


def _layout(args: argparse.Namespace) -> dict[str, Any]:
    """Which cores the broker (its loop; its IO thread), the synthetic worker and the client get.

    isolated: one core each (a process's IO thread shares its core: at a fixed step rate its threads
              take turns, and a wake-up on the same core needs no cross-core interrupt);
    spread:   the worker and the client get two cores each, the IO thread on the second;
    shared:   (2 cores) the worker and the client share the core next to the broker's. Left unpinned,
              the client is woken on the broker's core by the broker's send and runs in its time;
    none:     nothing pinned.
    Others avoid the broker core's SMT siblings when there are cores enough."""
    cores = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {"name": "none", "cores": cores, "broker": None, "broker_io": None, "worker": None,
                           "client": None}
    if args.layout == "none" or len(cores) < 2:
        return out
    broker, io = (args.broker_core if args.broker_core is not None else cores[0]), args.broker_io_core
    if broker not in cores or (io is not None and io not in cores):
        raise SystemExit(f"--broker-core/--broker-io-core must be among the visible cores {cores}")
    taken = {broker} | ({io} if io is not None else set())
    free = [c for c in cores if c not in taken and c not in _siblings(broker)]
    if len(free) < 2:
        free = [c for c in cores if c not in taken]
    name = args.layout if args.layout != "auto" else ("isolated" if len(free) >= 2 else "shared")
    need = {"isolated": 2, "spread": 4, "shared": 1}[name]
    if len(free) < need:
        raise SystemExit(f"--layout {name} needs {need} cores besides the broker's; {len(cores)} visible")
    out.update(name=name, broker=[broker], broker_io=[io] if io is not None else None,
               broker_siblings=sorted(_siblings(broker)))
    if name == "isolated" and getattr(args, "worker", "synthetic") == "real" and len(free) >= 3:
        out.update(worker=free[:2], client=free[2:3])  # the engine thread; the worker's IO threads
    elif name == "isolated":
        out.update(worker=free[:1], client=free[1:2])
    elif name == "spread":
        out.update(worker=free[0:2], client=free[2:4])
    else:
        out.update(worker=free[:1], client=free[:1])
    return out


def _hops(bench: dict[str, Any], arrivals: list[tuple[int, int]]) -> dict[str, Any]:
    """Join the broker's (emit, recv, sent, done) per TOKENS message with the client's (emit, recv)."""
    received = dict(arrivals)
    w2b, b, after, b2c, rows = [], [], [], [], []
    for emit, recv, sent, done in bench["hops"]:
        got = received.get(emit)
        if got is None:
            continue
        w2b.append(recv - emit)
        b.append(sent - recv)
        after.append(done - sent)
        b2c.append(got - sent)
        rows.append((emit, recv, sent, got, done))
    t0, t1 = (min(e for e, _ in arrivals), max(r for _, r in arrivals)) if arrivals else (0, 0)
    pauses = [(s, d, g) for s, d, g in bench["gc_pauses"] if t0 <= s <= t1]
    by_gen: dict[str, Any] = {}
    for g in (0, 1, 2):
        ds = [d for _, d, gen in pauses if gen == g]
        by_gen[f"gen{g}"] = {"count": len(ds), "max_ms": round(max(ds, default=0) / 1e6, 4),
                             "total_ms": round(sum(ds) / 1e6, 3)}
    ticks = [d for s, d in bench["slow_ticks"] if t0 <= s <= t1]
    # the slowest messages and what the broker was doing meanwhile
    worst = sorted(rows, key=lambda r: r[3] - r[0], reverse=True)[:5]
    worst_out = []
    for emit, recv, sent, got, _ in worst:
        worst_out.append({
            "at_s": round((emit - t0) / 1e9, 3), "added_ms": round((got - emit) / 1e6, 3),
            "worker_to_broker_ms": round((recv - emit) / 1e6, 3), "in_broker_ms": round((sent - recv) / 1e6, 3),
            "broker_to_client_ms": round((got - sent) / 1e6, 3),
            "broker_gc_ms_since_emit": [[round(d / 1e6, 3), g] for s, d, g in pauses if emit <= s <= got]})
    return {"messages": len(rows), "worker_to_broker": _summary_ms(w2b), "in_broker": _summary_ms(b),
            "in_broker_after_send": _summary_ms(after), "broker_to_client": _summary_ms(b2c), "gc_during_run": by_gen,
            "slow_ticks_over_100us": {"count": len(ticks), "max_ms": round(max(ticks, default=0) / 1e6, 4)},
            "worst_messages": worst_out, "rows": rows,
            "broker_gc": {k: bench[k] for k in ("gc_threshold", "gc_enabled", "gc_frozen")}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    front, back = _port(), _port()
    lay = _layout(args)
    address, backend = f"tcp://127.0.0.1:{front}", f"tcp://127.0.0.1:{back}"
    if args.untraced:
        procs = [_spawn(["-m", "tokenmill.cli.main", "broker", "--frontend", address, "--backend", backend,
                         "--log-level", "warning", "--queue-size", str(1 << 20)], lay["broker"])]
    else:
        io = ",".join(map(str, lay["broker_io"] or []))
        procs = [_spawn(["-m", "tokenmill.benchmarks.broker_bench", "_broker", address, backend, io,
                         str(args.busy_poll)], lay["broker"])]
    client_io = None
    if lay["client"]:
        main_core, client_io = _split_cores(lay["client"])
        os.sched_setaffinity(0, main_core)  # its IO threads start here too, unless client_io says otherwise
    worker_cores = ",".join(map(str, lay["worker"] or []))
    gc_was = gc.isenabled()
    gc.disable()
    try:
        procs.append(_spawn(["-m", "tokenmill.benchmarks.broker_bench", "_fake-worker", backend,
                             str(args.tokens_per_chunk), "0", worker_cores, "1"], lay["worker"]))
        time.sleep(2.0)
        _run_jobs(address, 8, 8, "warmup", client_io)
        tp = _run_jobs(address, args.jobs, args.steps * args.tokens_per_chunk, "tp", client_io)
        procs[-1].kill()
        if args.worker == "real":
            procs.append(_spawn(["-m", "tokenmill.benchmarks.broker_bench", "_real-worker", backend,
                                 str(args.step_rate), str(args.engine_busy), worker_cores, str(args.latency_jobs)],
                                lay["worker"]))
        else:
            procs.append(_spawn(["-m", "tokenmill.benchmarks.broker_bench", "_fake-worker", backend,
                                 "1", str(args.step_rate), worker_cores, str(args.latency_jobs)], lay["worker"]))
        time.sleep(2.0)
        lat = _run_jobs(address, args.latency_jobs, args.latency_steps, "lat", client_io)
        bench = None if args.untraced else _broker_stats(address)["bench"]
    finally:
        if gc_was:
            gc.enable()
        for pr in procs:
            pr.kill()
            pr.wait()
    base = _in_process_latency(100_000)
    tokens_per_s = tp["tokens"] / tp["seconds"]
    added = _summary_ms(lat["latencies_ns"])
    return {
        "benchmark": "broker_relay",
        "worker": ("synthetic (protocol-level fake worker emitting TOKENS batches; no model)"
                   if args.worker == "synthetic" else
                   "real (throughput: synthetic; latency: worker/process.py's run_worker around PacedEngine, "
                   f"a fake engine holding the GIL {args.engine_busy:.0%} of each step; output on the engine "
                   "loop's data socket)"),
        "broker": ("plain `tokenmill broker`" if args.untraced
                   else "Broker class + entry/send/exit timestamps per worker message and GC pause records"
                   + (f"; busy_poll {args.busy_poll} s" if args.busy_poll else "")),
        "note": args.note,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus_visible": len(lay["cores"]),
                    "layout": lay, "load_avg_at_end": os.getloadavg()},
        "commit": _commit(),
        "command": "python -m tokenmill.benchmarks.broker_bench " + shlex.join(sys.argv[1:]),
        "throughput": {"jobs": args.jobs, "steps": args.steps, "tokens_per_chunk": args.tokens_per_chunk,
                       "tokens": tp["tokens"], "seconds": round(tp["seconds"], 4),
                       "tokens_per_s": round(tokens_per_s), "stream_messages": tp["stream_messages"],
                       "goal_tokens_per_s": 200_000, "meets_goal": tokens_per_s >= 200_000},
        "latency": {"jobs": args.latency_jobs, "step_rate_hz": args.step_rate, "steps": args.latency_steps,
                    "tokens": len(lat["latencies_ns"]), "added_ms": added,
                    "added_p50_ms": added["p50"], "added_p99_ms": added["p99"],
                    "in_process_p50_ms": round(_pct(base, 0.5) / 1000, 6),
                    "in_process_p99_ms": round(_pct(base, 0.99) / 1000, 6),
                    "goal_p99_ms": 1.0, "meets_goal": added["p99"] <= 1.0,
                    "hops": _hops(bench, lat["arrivals"]) if bench is not None else None},
    }


def _commit() -> str:
    """HEAD, plus a mark when what this measures (broker, protocol, this file) differs from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                              timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        dirty = git("status", "--porcelain", "--", "broker", "client/protocol.py", "benchmarks/broker_bench.py")
        return head + (" + uncommitted broker/bench changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _row(name: str, s: dict[str, float]) -> str:
    return f"| {name} | " + " | ".join(str(s.get(k, "")) for k in ("p50", "p90", "p99", "p99.9", "max", "mean")) + " |"


def _markdown(r: dict[str, Any]) -> str:
    t, lat, m = r["throughput"], r["latency"], r["machine"]
    lay = m["layout"]
    lines = [
        "# Broker relay benchmark (CPU)", "",
        f"Worker: {r['worker']}. Broker: {r['broker']}. Python {m['python']}, {m['cpus_visible']} cores visible; "
        f"core layout `{lay['name']}`: broker {lay['broker']} (IO thread: {lay['broker_io'] or 'same core'}), "
        f"worker {lay['worker']}, client {lay['client'] or 'unpinned'}; load average at the end "
        f"{tuple(round(x, 2) for x in m['load_avg_at_end'])}.",
        f"Commit `{r['commit']}`; command `{r['command']}`.", *([f"Note: {r['note']}"] if r.get("note") else []), "",
        "| metric | value | goal |", "| --- | --- | --- |",
        f"| relayed tokens/s ({t['jobs']} jobs, {t['tokens_per_chunk']} token/chunk, one TOKENS message per step) "
        f"| {t['tokens_per_s']:,} | >= 200,000 |",
        f"| added latency per token p50 (ms) | {lat['added_ms']['p50']} | |",
        f"| added latency per token p99 (ms) | {lat['added_ms']['p99']} | <= 1 |",
        f"| in-process hand-over p50 / p99 (ms) | {lat['in_process_p50_ms']} / {lat['in_process_p99_ms']} | |",
        "",
        f"Latency: {lat['jobs']} jobs at {lat['step_rate_hz']} steps/s, {lat['steps']} steps ({lat['tokens']} "
        "tokens), measured from the worker's emit (synthetic: its send; real: the engine step's return) to the "
        "client's receive (same machine, one "
        "monotonic clock): the whole worker socket -> broker -> client path that an in-process engine does "
        "not have.", "",
        "| ms | p50 | p90 | p99 | p99.9 | max | mean |", "| --- | --- | --- | --- | --- | --- | --- |",
        _row("added per token", lat["added_ms"]),
    ]
    h = lat["hops"]
    if h:
        lines += [_row("worker emit -> broker recv", h["worker_to_broker"]),
                  _row("broker recv -> broker sent", h["in_broker"]),
                  _row("broker sent -> client recv", h["broker_to_client"]),
                  *([_row("(broker sent -> handler returned)", h["in_broker_after_send"])]
                    if h.get("in_broker_after_send") else []), "",
                  f"Per hop: {h['messages']} TOKENS messages joined by their emit time. Broker GC during the "
                  f"latency run: " + ", ".join(f"{g}: {v['count']} collections, max {v['max_ms']} ms"
                                               for g, v in h["gc_during_run"].items())
                  + f" (thresholds {h['broker_gc']['gc_threshold']}, enabled {h['broker_gc']['gc_enabled']}, "
                  f"frozen objects {h['broker_gc']['gc_frozen']}); broker timer ticks over 0.1 ms: "
                  f"{h['slow_ticks_over_100us']['count']} (max {h['slow_ticks_over_100us']['max_ms']} ms).", "",
                  "Slowest messages (s into the run: added = worker -> broker + in broker + broker -> client, ms): "
                  + "; ".join(f"{w['at_s']} s: {w['added_ms']} = {w['worker_to_broker_ms']} + {w['in_broker_ms']} + "
                              f"{w['broker_to_client_ms']}" + (f" (broker GC {w['broker_gc_ms_since_emit']})"
                                                               if w["broker_gc_ms_since_emit"] else "")
                              for w in h["worst_messages"][:3]) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_fake-worker":
        fake_worker(argv[1], int(argv[2]), float(argv[3]), [int(c) for c in argv[4].split(",")] if argv[4] else None,
                    int(argv[5]))
        return 0
    if argv and argv[0] == "_real-worker":
        real_worker(argv[1], float(argv[2]), float(argv[3]), [int(c) for c in argv[4].split(",")] if argv[4] else None,
                    int(argv[5]))
        return 0
    if argv and argv[0] == "_broker":
        traced_broker(argv[1], argv[2], [int(c) for c in argv[3].split(",")] if argv[3] else None,
                      float(argv[4]) if len(argv) > 4 else 0.0)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--latency-jobs", type=int, default=64)
    ap.add_argument("--latency-steps", type=int, default=1000)
    ap.add_argument("--step-rate", type=float, default=100.0)
    ap.add_argument("--layout", choices=("auto", "isolated", "spread", "shared", "none"), default="auto",
                    help="core layout (see _layout); auto: isolated with 3+ cores, else shared")
    ap.add_argument("--no-pin", dest="layout", action="store_const", const="none", help="same as --layout none")
    ap.add_argument("--broker-core", type=int, default=None, help="the broker's core (default: the first visible)")
    ap.add_argument("--broker-io-core", type=int, default=None,
                    help="put the broker's ZeroMQ IO thread on this core (default: the broker's one core)")
    ap.add_argument("--worker", choices=("synthetic", "real"), default="synthetic",
                    help="latency run's worker: the synthetic one, or worker/process.py's run_worker (IO thread, "
                         "engine loop) around PacedEngine (the throughput run always uses the synthetic one)")
    ap.add_argument("--engine-busy", type=float, default=0.3,
                    help="--worker real: share of each step the fake engine holds the GIL (runs Python)")
    ap.add_argument("--busy-poll", type=float, default=0.0,
                    help="BrokerConfig.busy_poll (s) of the broker (default 0, the broker's default: off)")
    ap.add_argument("--untraced", action="store_true", help="run the plain `tokenmill broker` (no per-hop data)")
    ap.add_argument("--dump-trace", action="store_true",
                    help="also write OUT/NAME_trace.json: the four timestamps of every latency message")
    ap.add_argument("--note", default="", help="a line about the machine for the markdown (e.g. what else ran)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="broker_relay", help="file name stem of the results in OUT")
    args = ap.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    hops = result["latency"]["hops"] or {}
    rows = hops.pop("rows", [])
    if args.dump_trace:  # per message: emit, broker recv, broker sent, client recv (ns)
        (args.out / f"{args.name}_trace.json").write_text(json.dumps({"rows": rows, "columns": [
            "worker_emit_ns", "broker_recv_ns", "broker_sent_ns", "client_recv_ns", "broker_done_ns"]}) + "\n")
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(_markdown(result))
    print(_markdown(result))
    from tokenmill.benchmarks import summary

    print("summary.json:", summary.record_file(args.out / f"{args.name}.json", date=summary.today()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
