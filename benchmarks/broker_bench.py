"""Broker relay benchmark: tokens/s the broker relays on one CPU core with batched TOKENS messages, and
the latency per token the worker -> broker -> client path adds over consuming an engine in-process.

The worker here is SYNTHETIC: a process speaking the worker protocol that emits TOKENS batches (one
chunk per active job per "step") at full speed (throughput) or at a fixed step rate carrying the emit
time (latency). No model runs: this measures the broker and the wire, not generation. The broker is a
real `tokenmill broker` process pinned to one core; the client is a raw DEALER that decodes every
message (msgpack) and checks sequence numbers.

    python -m tokenmill.benchmarks.broker_bench [--jobs 256 --steps 1000 --tokens-per-chunk 1]
Results: benchmarks/results/cpu/broker_relay.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from tokenmill.client import protocol as p

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the synthetic worker ---------------------------------------------------------------------------


def fake_worker(broker: str, tokens_per_chunk: int, step_rate: float) -> None:
    """Register, then on every step emit one TOKENS message with a chunk per active job (text = emit
    time in ns when paced) and a FINISHED message for jobs that reached max_tokens."""
    ctx = zmq.Context()
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
    while True:
        if jobs and period:  # paced: sleep to the next step (a poll timeout is too coarse here)
            time.sleep(max(0.0, next_step - time.monotonic()))
        if s.poll(0 if jobs else 500):
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
            next_step = now  # pacing starts with the first job, not at process start
            continue
        if now < next_step:
            continue
        next_step = (next_step + period) if period else now
        text = str(time.perf_counter_ns()) if period else ""
        chunks, finished = [], []
        for job_id, st in list(jobs.items()):
            attempt, seq, max_tokens = st
            n = min(tokens_per_chunk, max_tokens - seq)
            chunks.append([job_id, attempt, seq, [7] * n, text, None])
            st[1] = seq + n
            if st[1] >= max_tokens:
                finished.append([job_id, attempt, "length", None, [1, st[1], 0]])
                del jobs[job_id]
        s.send_multipart([*head, msgpack.packb(chunks)])
        if finished:
            s.send_multipart([*fin_head, msgpack.packb(finished)])


# ---- the client side --------------------------------------------------------------------------------


def _run_jobs(address: str, n_jobs: int, max_tokens: int, tag: str) -> dict[str, Any]:
    """Submit n_jobs, receive every STREAM/DONE; returns token count, span and per-token latencies."""
    ctx = zmq.Context()
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
    t_first = t_last = 0.0
    while done < n_jobs:
        if not s.poll(30_000):
            raise TimeoutError("relay stalled")
        frames = s.recv_multipart()
        cmd = frames[1][0]
        if cmd == p.Cmd.STREAM:
            now_ns = time.perf_counter_ns()
            t_last = time.perf_counter()
            t_first = t_first or t_last
            messages += 1
            for job_id, seq, ids, text, _ in msgpack.unpackb(frames[2]):
                assert seq == expected[job_id], "gap or duplicate"
                expected[job_id] = seq + len(ids)
                tokens += len(ids)
                if text:
                    latencies.extend([now_ns - int(text)] * len(ids))
        elif cmd in (p.Cmd.DONE, p.Cmd.FAIL):
            msg = p.decode(frames, p.BROKER_TO_CLIENT)
            assert isinstance(msg, p.Done), msg
            done += 1
    s.close()
    ctx.term()
    return {"tokens": tokens, "seconds": t_last - t_first, "stream_messages": messages, "latencies_ns": latencies}


def _pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000.0


def _in_process_latency(n: int) -> list[int]:
    """Baseline: an engine consumed in-process hands its step output over by a function return."""
    out: list[int] = []
    for _ in range(n):
        t = time.perf_counter_ns()
        delta = [(f"job-{i}", [7], "") for i in range(1)]  # what step() would return
        _ = delta[0]
        out.append(time.perf_counter_ns() - t)
    return out


def _spawn(argv: list[str], core: int | None) -> subprocess.Popen[bytes]:
    def pin() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})

    return subprocess.Popen([sys.executable, *argv], preexec_fn=pin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run(args: argparse.Namespace) -> dict[str, Any]:
    front, back = _port(), _port()
    cores = sorted(os.sched_getaffinity(0))
    broker_core = cores[0] if args.pin else None
    other = cores[1] if args.pin and len(cores) > 1 else None
    procs = [_spawn(["-m", "tokenmill.cli.main", "broker", "--frontend", f"tcp://127.0.0.1:{front}",
                     "--backend", f"tcp://127.0.0.1:{back}", "--log-level", "warning",
                     "--queue-size", str(1 << 20)], broker_core)]
    try:
        procs.append(_spawn(["-m", "tokenmill.benchmarks.broker_bench", "_fake-worker", f"tcp://127.0.0.1:{back}",
                             str(args.tokens_per_chunk), "0"], other))
        time.sleep(2.0)
        address = f"tcp://127.0.0.1:{front}"
        _run_jobs(address, 8, 8, "warmup")
        tp = _run_jobs(address, args.jobs, args.steps * args.tokens_per_chunk, "tp")
        procs[-1].kill()
        procs.append(_spawn(["-m", "tokenmill.benchmarks.broker_bench", "_fake-worker", f"tcp://127.0.0.1:{back}",
                             "1", str(args.step_rate)], other))
        time.sleep(2.0)
        lat = _run_jobs(address, args.latency_jobs, args.latency_steps, "lat")
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()
    base = _in_process_latency(100_000)
    tokens_per_s = tp["tokens"] / tp["seconds"]
    return {
        "benchmark": "broker_relay",
        "worker": "synthetic (protocol-level fake worker emitting TOKENS batches; no model)",
        "machine": {"platform": platform.platform(), "cpus_visible": len(cores), "broker_pinned_core": broker_core,
                    "load_avg_at_end": os.getloadavg()},
        "commit": _commit(),
        "command": "python -m tokenmill.benchmarks.broker_bench " + " ".join(sys.argv[1:]),
        "throughput": {"jobs": args.jobs, "steps": args.steps, "tokens_per_chunk": args.tokens_per_chunk,
                       "tokens": tp["tokens"], "seconds": round(tp["seconds"], 4),
                       "tokens_per_s": round(tokens_per_s), "stream_messages": tp["stream_messages"],
                       "goal_tokens_per_s": 200_000, "meets_goal": tokens_per_s >= 200_000},
        "latency": {"jobs": args.latency_jobs, "step_rate_hz": args.step_rate, "tokens": len(lat["latencies_ns"]),
                    "added_p50_ms": round(_pct(lat["latencies_ns"], 0.5) / 1000, 4),
                    "added_p99_ms": round(_pct(lat["latencies_ns"], 0.99) / 1000, 4),
                    "added_mean_ms": round(statistics.fmean(lat["latencies_ns"]) / 1e6, 4),
                    "in_process_p50_ms": round(_pct(base, 0.5) / 1000, 6),
                    "in_process_p99_ms": round(_pct(base, 0.99) / 1000, 6),
                    "goal_p99_ms": 1.0, "meets_goal": _pct(lat["latencies_ns"], 0.99) / 1000 <= 1.0},
    }


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _markdown(r: dict[str, Any]) -> str:
    t, lat = r["throughput"], r["latency"]
    return "\n".join([
        "# Broker relay benchmark (CPU)", "",
        f"Worker: {r['worker']}. Broker pinned to core: {r['machine']['broker_pinned_core']} of "
        f"{r['machine']['cpus_visible']} visible; load average at the end {r['machine']['load_avg_at_end']}.",
        f"Commit `{r['commit']}`; command `{r['command']}`.", "",
        "| metric | value | goal |", "| --- | --- | --- |",
        f"| relayed tokens/s ({t['jobs']} jobs, {t['tokens_per_chunk']} token/chunk, one TOKENS message per step) "
        f"| {t['tokens_per_s']:,} | >= 200,000 |",
        f"| added latency per token p50 (ms) | {lat['added_p50_ms']} | |",
        f"| added latency per token p99 (ms) | {lat['added_p99_ms']} | <= 1 |",
        f"| in-process hand-over p50 / p99 (ms) | {lat['in_process_p50_ms']} / {lat['in_process_p99_ms']} | |",
        "",
        f"Latency: {lat['jobs']} jobs at {lat['step_rate_hz']} steps/s ({lat['tokens']} tokens), measured from the "
        "synthetic worker's send to the client's receive (same machine, one monotonic clock): the whole "
        "worker socket -> broker -> client path that an in-process engine does not have.", "",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_fake-worker":
        fake_worker(argv[1], int(argv[2]), float(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--latency-jobs", type=int, default=64)
    ap.add_argument("--latency-steps", type=int, default=300)
    ap.add_argument("--step-rate", type=float, default=100.0)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin the broker to one core (and the synthetic worker to another)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "broker_relay.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "broker_relay.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
