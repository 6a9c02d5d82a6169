"""Serving benchmark through the broker and the client SDK, as vLLM's benchmark_serving measures it.

A broker and one worker start as subprocesses on 127.0.0.1 (free ports); requests are sent with
Poisson arrivals at each request rate (`inf`: all at once) and/or a bounded concurrency, streamed back
through `AsyncClient`, and timed at the client: TTFT, TPOT, ITL, end-to-end latency (p50/p90/p99),
request and token throughput, and goodput under a TTFT/TPOT SLO. The processes are always stopped at
the end, and every rate has a time limit (requests still open then count as failed).

With --base-url, nothing is started: the requests go to a running OpenAI-compatible server (a tokenmill
gateway, vLLM, ...) as `vllm bench serve` sends them: streamed POST /v1/completions with the prompt as
token ids, ignore_eos, and the usage of the last chunk as the output length (ITL: one gap per chunk).

    python -m tokenmill.benchmarks.serving --model embedded --rates 0.5,1,inf --num-prompts 24
    python -m tokenmill.benchmarks.serving --base-url http://127.0.0.1:8000 --model embedded --rates 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tokenmill.benchmarks.common import (
    RequestTiming,
    goodput,
    latency_summary,
    slowest_timelines,
    throughput_summary,
    write_results,
)
from tokenmill.benchmarks.throughput import (
    ModelSpec,
    add_model_args,
    build_engine,
    spec_from_args,
    where_it_runs,
    workload_tokenizer,
)
from tokenmill.benchmarks.workloads import BenchRequest, Workload, sharegpt_workload
from tokenmill.worker.compile_watch import EVENT as COMPILE_EVENT

SPEC_ENV = "TOKENMILL_BENCH_SPEC"
HOST = "127.0.0.1"


def engine_from_env(args: argparse.Namespace) -> Any:
    """`tokenmill worker --engine-factory` hook: the engine described by $TOKENMILL_BENCH_SPEC (JSON), with the
    worker's --prefix-caching setting."""
    spec = ModelSpec(**json.loads(os.environ[SPEC_ENV]))
    return build_engine(spec, prefix_caching=args.prefix_caching)


# -- processes ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A broker and one worker on 127.0.0.1; `stop()` (always called by `cluster()`) ends both."""

    frontend: str
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.logs / f"{name}.log", "wb") as f:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", *argv], stdout=f,
                                               stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def compiles(self) -> int:
        """Lines of the worker's log that report a kernel compiled after start-up (worker/compile_watch.py)."""
        path = self.logs / "worker.log"
        return path.read_text(errors="replace").count(COMPILE_EVENT) if path.exists() else 0

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def tail(self, n: int = 3000) -> str:
        files = sorted(self.logs.glob("*.log"))
        return "\n".join(f"---- {f.name}\n{f.read_text(errors='replace')[-n:]}" for f in files)

    def stop(self) -> None:
        """SIGTERM the broker (it drains) and the worker, then SIGKILL whatever is left after 20 s."""
        for pr in self.procs:
            if pr.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    pr.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20.0
        for pr in self.procs:
            try:
                pr.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pr.pid, signal.SIGKILL)
                pr.wait(10)


@contextlib.contextmanager
def cluster(spec: ModelSpec, prefix_caching: bool = True, ready_timeout: float = 300.0) -> Iterator[Cluster]:
    """Start a broker and a worker running `spec`; yield once the worker has registered."""
    front, back = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
    logs = Path(tempfile.mkdtemp(prefix="tokenmill-serving-"))
    env = {**os.environ, SPEC_ENV: json.dumps(spec.describe()), "PYTHONUNBUFFERED": "1",
           "TOKENMILL_LOG_LEVEL": "warning"}
    c = Cluster(front, logs)
    try:
        c.spawn("broker", ["broker", "--frontend", front, "--backend", back, "--queue-size", "4096",
                           "--queue-timeout", "3600"], env)
        c.spawn("worker", ["worker", "--broker", back, "--model", spec.model, "--max-num-seqs",
                           str(spec.max_num_seqs), "--engine-factory", "tokenmill.benchmarks.serving:engine_from_env",
                           "--prefix-caching" if prefix_caching else "--no-prefix-caching", "--name", "bench-worker"],
                env)
        _wait_ready(c, ready_timeout)
        yield c
    finally:
        c.stop()


def _wait_ready(c: Cluster, timeout: float, workers: int = 1) -> None:
    """Until `workers` workers have registered (RuntimeError if a process exits, TimeoutError)."""
    from tokenmill.client import BrokerUnavailable, Client

    deadline = time.monotonic() + timeout
    with Client(c.frontend) as client:
        while time.monotonic() < deadline:
            if not c.alive():
                raise RuntimeError(f"the broker or worker exited during start-up\n{c.tail()}")
            with contextlib.suppress(BrokerUnavailable):
                if len(client.stats(timeout=2.0)["workers"]) >= workers:
                    return
            time.sleep(0.5 if workers == 1 else 0.2)
    raise TimeoutError(f"{workers} worker(s) not registered within {timeout}s\n{c.tail()}")


# -- one request rate ----------------------------------------------------------------------------------------


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of `n` requests: a Poisson process at `rate`/s; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(client: Any, r: BenchRequest, t: RequestTiming, sem: asyncio.Semaphore | None) -> None:
    async with sem if sem is not None else contextlib.nullcontext():
        t.sent = time.perf_counter()
        try:
            async for ev in client.stream(prompt_token_ids=list(r.prompt_ids), max_tokens=r.output_len,
                                          temperature=0.0, ignore_eos=True):
                now = time.perf_counter()
                t.on_tokens(now, len(ev.token_ids))
                if ev.finished:
                    t.done = now
                    t.cached_tokens = ev.usage.cached_tokens if ev.usage else 0
                    t.queue_time = ev.queue_time if ev.queue_time is not None else math.nan
                    t.worker = tuple(ev.worker_timeline) if ev.worker_timeline is not None else None
        except Exception as e:  # a typed SDK error fails this request alone
            t.error = f"{type(e).__name__}: {e}"[:200]


async def _one_http(client: Any, model: str, r: BenchRequest, t: RequestTiming,
                    sem: asyncio.Semaphore | None) -> None:
    """One streamed /v1/completions request through the official openai client."""
    async with sem if sem is not None else contextlib.nullcontext():
        t.sent = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=model, prompt=list(r.prompt_ids), max_tokens=r.output_len, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    t.on_tokens(now, 1)
                if chunk.usage is not None:
                    t.output_len = chunk.usage.completion_tokens
                    t.done = now
        except Exception as e:  # an HTTP error fails this request alone
            t.error = f"{type(e).__name__}: {e}"[:200]


@contextlib.asynccontextmanager
async def _target(address: str, model: str) -> Any:
    """A function sending one request: through the SDK to a broker (tcp://...), or through HTTP to an
    OpenAI-compatible server (http://...)."""
    if address.startswith(("http://", "https://")):
        from openai import AsyncOpenAI

        base = address.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        async with AsyncOpenAI(base_url=base, api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                               max_retries=0, timeout=600.0) as http:
            yield lambda r, t, sem: _one_http(http, model, r, t, sem)
        return
    from tokenmill.client import AsyncClient

    async with AsyncClient(address, broker_timeout=60.0) as client:
        yield lambda r, t, sem: _one(client, r, t, sem)


async def run_rate(address: str, workload: Workload, rate: float, *, seed: int = 0, concurrency: int | None = None,
                   time_limit_s: float = 300.0, desc: str = "", model: str = "") -> tuple[list[RequestTiming], float]:
    """Send `workload` at `rate` req/s (Poisson) with at most `concurrency` in flight to a broker or an HTTP
    server (`address`; `model`: the model the HTTP requests name); returns the timings and the duration from
    the first send to the last completion."""
    reqs = workload.requests
    offsets = arrival_offsets(len(reqs), rate, seed)
    timings = [RequestTiming(math.nan, r.prompt_len) for r in reqs]
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    async with _target(address, model) as send:
        start = time.perf_counter()
        tasks = [asyncio.create_task(_delayed(send, r, t, sem, start + off))
                 for r, t, off in zip(reqs, timings, offsets)]
        await _wait_all(tasks, start + time_limit_s, desc or f"rate {rate}")
    for t in timings:
        if not t.ok and t.error is None:
            t.error = f"time limit ({time_limit_s:g} s, --time-limit-s)"
    ends = [t.done for t in timings if t.ok]
    return timings, (max(ends) if ends else time.perf_counter()) - start


async def _delayed(send: Any, r: BenchRequest, t: RequestTiming, sem: asyncio.Semaphore | None,
                   at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    await send(r, t, sem)


async def _wait_all(tasks: list[asyncio.Task[None]], deadline: float, desc: str) -> None:
    pending = set(tasks)
    with tqdm(total=len(tasks), desc=desc, unit="req", leave=False) as bar:
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            done, pending = await asyncio.wait(pending, timeout=min(left, 1.0), return_when=asyncio.FIRST_COMPLETED)
            bar.update(len(done))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


# -- several rates --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingConfig:
    rates: tuple[float, ...] = (0.5, 1.0, math.inf)
    num_prompts: int = 24  # per rate (fewer when the rate's time share is short)
    concurrency: int | None = None
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 200.0
    seed: int = 0
    time_limit_s: float = 120.0  # per rate
    warmup_requests: int = 2
    saturation_hint: float | None = None  # req/s the server sustains offline: sizes the burst (inf) rate


def rate_result(timings: list[RequestTiming], duration: float, rate: float, cfg: ServingConfig) -> dict[str, Any]:
    slo = (cfg.ttft_slo_ms / 1e3, cfg.tpot_slo_ms / 1e3)
    return {"rate": "inf" if math.isinf(rate) else rate, **throughput_summary(timings, duration),
            "goodput_requests_per_s": goodput(timings, duration, *slo),
            "latency": latency_summary(timings), "slowest_ttft": slowest_timelines(timings),
            "errors": sorted({t.error for t in timings if t.error})[:5]}


@contextlib.contextmanager
def _pool(spec: ModelSpec, prefix_caching: bool, base_url: str | None) -> Iterator[tuple[str, Cluster | None]]:
    """The address to send to and the cluster behind it: a running server's (base_url; no cluster), or a cluster
    started here for the run."""
    if base_url:
        yield base_url, None
        return
    with cluster(spec, prefix_caching) as c:
        yield c.frontend, c


def serve_rates(spec: ModelSpec, workload: Workload, cfg: ServingConfig, prefix_caching: bool = True,
                deadline: float | None = None, base_url: str | None = None) -> dict[str, Any]:
    """Start the cluster (or use the server at `base_url`), warm it up, run each rate (a fresh sample order
    per rate is not needed: the same requests at every rate), stop the cluster. `deadline`
    (time.monotonic) skips rates that cannot start."""
    results: list[dict[str, Any]] = []
    compiles: dict[str, int] = {}  # kernels the worker logged as compiled after start-up, by phase
    with _pool(spec, prefix_caching, base_url) as (address, pool):
        asyncio.run(run_rate(address, workload.subset(cfg.warmup_requests), math.inf, desc="warm-up",
                             model=spec.model))
        seen = pool.compiles() if pool is not None else 0
        if pool is not None:
            compiles["warm-up"] = seen
        for i, rate in enumerate(cfg.rates):
            limit = cfg.time_limit_s
            if deadline is not None:
                limit = min(limit, deadline - time.monotonic())
                if limit < 5:
                    results.append({"rate": "inf" if math.isinf(rate) else rate, "skipped": "time budget"})
                    continue
            n = _prompts_for(rate, cfg.num_prompts, limit, len(workload), cfg.saturation_hint)
            timings, duration = asyncio.run(run_rate(address, workload.subset(n), rate, seed=cfg.seed + i,
                                                     concurrency=cfg.concurrency, time_limit_s=limit,
                                                     model=spec.model))
            results.append(rate_result(timings, duration, rate, cfg) | {"requests_sent": n})
            if pool is not None:
                now = pool.compiles()
                results[-1]["kernels_compiled"], seen = now - seen, now
            print(_rate_line(results[-1]), flush=True)
    out = {"config": {**cfg.__dict__, "rates": [str(r) for r in cfg.rates]}, "workload": workload.summary(),
           "rates": results}
    if compiles:
        out["kernels_compiled_after_start_up"] = compiles | {str(r["rate"]): r.get("kernels_compiled", 0)
                                                             for r in results if "skipped" not in r}
    return out


def _prompts_for(rate: float, n: int, limit_s: float, available: int, hint: float | None) -> int:
    """Keep the sends within ~60% of the time limit: n/rate s at a finite rate, n/hint s for a burst."""
    per_s = hint if math.isinf(rate) else rate
    if per_s is not None:
        n = min(n, max(4, int(per_s * limit_s * 0.6)))
    return min(n, available)


def _rate_line(r: dict[str, Any]) -> str:
    lat = r["latency"]
    line = (f"rate {r['rate']}: {r['completed']}/{r['requests_sent']} ok, {r['requests_per_s']:.2f} req/s, "
            f"{r['output_tok_per_s']:.1f} out tok/s, TTFT p50 {lat['ttft_ms']['p50']:.0f} ms, "
            f"TPOT p50 {lat['tpot_ms']['p50']:.1f} ms, goodput {r['goodput_requests_per_s']:.2f} req/s")
    if r["completed"] < r["requests_sent"]:
        line += f"; not done: {'; '.join(r['errors'])}"
    return line


def serving_table(res: dict[str, Any]) -> str:
    rows = ["| rate (req/s) | done | req/s | out tok/s | goodput req/s | TTFT p50/p90/p99 (ms) | "
            "TPOT p50/p90/p99 (ms) | ITL p50/p99 (ms) | E2E p50/p99 (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rates"]:
        if "skipped" in r:
            rows.append(f"| {r['rate']} | skipped ({r['skipped']}) | | | | | | | |")
            continue
        lat = r["latency"]
        t, p, i, e = lat["ttft_ms"], lat["tpot_ms"], lat["itl_ms"], lat["e2e_ms"]
        rows.append(f"| {r['rate']} | {r['completed']}/{r['requests_sent']} | {r['requests_per_s']:.2f} | "
                    f"{r['output_tok_per_s']:.1f} | {r['goodput_requests_per_s']:.2f} | "
                    f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {p['p50']:.1f} / {p['p90']:.1f} / "
                    f"{p['p99']:.1f} | {i['p50']:.1f} / {i['p99']:.1f} | {e['p50'] / 1e3:.2f} / {e['p99'] / 1e3:.2f} |")
    if "kernels_compiled_after_start_up" in res:
        seen = ", ".join(f"{k}: {v}" for k, v in res["kernels_compiled_after_start_up"].items())
        rows.append(f"\nKernels the worker logged as compiled after start-up ({COMPILE_EVENT}), by phase: {seen}.")
    return "\n".join(rows)


def timeline_table(res: dict[str, Any]) -> str:
    """Where the slowest first tokens of each rate waited (RequestTiming.timeline; ms)."""
    keys = ("ttft_ms", "broker_queue_ms", "worker_admission_ms", "wait_for_step_ms", "first_step_ms", "transit_ms")
    rows = ["| rate (req/s) | TTFT | broker queue | worker admission | wait for a step | first step | rest (transit) |",
            "|---|---|---|---|---|---|---|"]
    for r in res["rates"]:
        for tl in r.get("slowest_ttft", []):
            rows.append(f"| {r['rate']} | " + " | ".join(f"{tl[k]:.1f}" for k in keys) + " |")
    return "\n".join(rows)


def parse_rates(text: str) -> tuple[float, ...]:
    return tuple(math.inf if x.strip() in ("inf", "max") else float(x) for x in text.split(",") if x.strip())


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    d = ServingConfig()
    ap.add_argument("--rates", default="0.5,1,inf", help="comma-separated request rates per second; inf = burst")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_ms)
    ap.add_argument("--tpot-slo-ms", type=float, default=d.tpot_slo_ms)
    ap.add_argument("--time-limit-s", type=float, default=d.time_limit_s, help="per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    ap.add_argument("--base-url", default=None,
                    help="send to a running OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of starting "
                         "a broker and a worker; --model is the model the requests name, and its tokenizer (or, with "
                         "--load-format dummy, random ids) makes the prompts")
    return ap


def run_cli(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if args.base_url:
        print(f"bench serving: requests to {args.base_url} for model {spec.model!r}; the server runs it where it "
              "runs it", flush=True)
    else:
        print(f"bench serving: {where_it_runs(spec)}, in a worker process behind a broker on {HOST}", flush=True)
    tok, vocab, tok_name = workload_tokenizer(spec)
    wl = sharegpt_workload(tok, args.num_prompts, args.seed, ids_vocab=vocab, max_input_len=args.max_input_len,
                           max_output_len=args.max_output_len)
    cfg = ServingConfig(parse_rates(args.rates), args.num_prompts, args.concurrency, args.ttft_slo_ms,
                        args.tpot_slo_ms, args.seed, args.time_limit_s)
    res = serve_rates(spec, wl, cfg, base_url=args.base_url)
    if args.base_url:
        res["base_url"] = args.base_url
    write_results(args.out, "serving", {"model": spec.describe(), "length_tokenizer": tok_name, **res},
                  serving_table(res) + "\n\nThe slowest first tokens of each rate, taken apart (ms):\n\n"
                  + timeline_table(res))
    return 0


def main() -> None:
    raise SystemExit(run_cli(build_parser().parse_args()))


if __name__ == "__main__":
    main()
