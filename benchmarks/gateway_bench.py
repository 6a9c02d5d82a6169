"""HTTP gateway benchmark: the latency per token the gateway adds over the SDK path, with 64 concurrent
streams, and a load generator this project did not write (aiperf) against the gateway.

One run, one pool: a broker (`tokenmill broker`), a worker (the real worker process code around
broker_bench's PacedEngine: a fake engine at a fixed step rate that holds the GIL for part of each step,
one token per request per step, its text the time of the step's return in ns) and a gateway
(`tokenmill gateway`), each its own process on 127.0.0.1. No model runs: this measures the gateway
and the wire, not generation.

1. Added latency per token, in rounds alternating the paths, each time `--streams` concurrent streams of
   `--tokens` tokens from load-generator processes of their own (`--load-procs`, the same for every path):
   - sdk: `AsyncClient.stream` against the broker;
   - sse: a lean SSE reader (SSEReader: asyncio protocol callbacks) through the gateway; sse_readline:
     the earlier reader (asyncio streams); openai: the official `openai` async client.
   Each token's latency is its arrival at the load generator's code minus its emit time (one monotonic
   clock); the gateway's added latency per token is the difference of the two paths' percentiles. A
   step's tokens arrive as one burst; the report also gives each path's first and last token of a burst.
2. aiperf (`--aiperf`), installed by this script into its own virtual environment (never a tokenmill
   dependency), profiles the gateway's streamed chat completions at the same concurrency: TTFT,
   inter-token latency, throughput as aiperf reports them (its token counts use the server's usage).

    python -m tokenmill.benchmarks.gateway_bench [--streams 64 --tokens 200 --step-rate 50 --rounds 2]
    python -m tokenmill.benchmarks.gateway_bench --aiperf --aiperf-venv /tmp/aiperf-venv
Results: benchmarks/results/cpu/gateway.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from tokenmill.benchmarks.broker_bench import PacedEngine
from tokenmill.benchmarks.common import percentile, write_results

MODEL = "bench"


def paced_engine(args: Any) -> PacedEngine:
    """The worker's engine (`--engine-factory tokenmill.benchmarks.gateway_bench:paced_engine`), set from
    TOKENMILL_BENCH_STEP_RATE / _BUSY / _START_JOBS."""
    env = os.environ
    return PacedEngine(float(env.get("TOKENMILL_BENCH_STEP_RATE", "50")), float(env.get("TOKENMILL_BENCH_BUSY", "0.3")),
                       int(env.get("TOKENMILL_BENCH_START_JOBS", "1")))


# ---- load generators (each runs in its own process: --load sdk|openai) ---------------------------------


class _Recorder:
    """Per-token records of one load-generator process: the latency (arrival at this code minus the engine
    step's return, whose time in ns is the token's text) and the step it came from (its burst)."""

    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.steps_ns: list[int] = []

    def add(self, text: str) -> int:
        """Record a token whose text is `text` at this moment; 1 if it was a timed token, else 0."""
        now = time.perf_counter_ns()
        if not text.isdigit():
            return 0
        step = int(text)
        self.latencies_ms.append((now - step) / 1e6)
        self.steps_ns.append(step)
        return 1


async def _timed(streams: int, one: Callable[[_Recorder], Awaitable[int]]) -> dict[str, Any]:
    """Run `streams` copies of `one` (which records per-token latencies and returns its token count)."""
    rec = _Recorder()
    t0, cpu0 = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(one(rec) for _ in range(streams)))
    return {"latencies_ms": rec.latencies_ms, "steps_ns": rec.steps_ns, "tokens": sum(counts),
            "wall_s": time.perf_counter() - t0, "client_cpu_s": time.process_time() - cpu0,
            "loop": type(asyncio.get_running_loop()).__module__.split(".")[0]}


async def _sdk_load(address: str, streams: int, tokens: int) -> dict[str, Any]:
    from tokenmill.client import AsyncClient

    async with AsyncClient(address) as c:
        async def one(rec: _Recorder) -> int:
            n = 0
            async for ev in c.stream("x", model=MODEL, max_tokens=tokens):
                if ev.text:
                    n += rec.add(ev.text)
            return n

        return await _timed(streams, one)


async def _openai_load(base_url: str, streams: int, tokens: int) -> dict[str, Any]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600) as c:
        async def one(rec: _Recorder) -> int:
            n = 0
            stream = await c.completions.create(model=MODEL, prompt="x", max_tokens=tokens, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    n += rec.add(chunk.choices[0].text)
            return n

        return await _timed(streams, one)


class SSEReader(asyncio.Protocol):
    """One streamed /v1/completions response, read in the transport's callbacks: each `data: {...}` line is
    parsed (one JSON parse) and recorded when its bytes arrive, with no stream reader and no task wake-up
    per event in between, as lean as an SSE client in Python gets (the SDK path's client is the SDK).
    Lines are split on LF over the raw bytes: the gateway writes each event whole inside one chunk of its
    chunked body, so a chunk's size line never falls inside a `data:` line. `done` resolves at
    `data: [DONE]` and fails if the response is not a 200 or the connection ends before it."""

    def __init__(self, request: bytes, rec: _Recorder) -> None:
        self.request, self.rec = request, rec
        self.tokens = 0
        self._buf = b""
        self._status_checked = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TCP transport is no asyncio.WriteTransport subclass, but it writes)
        cast(asyncio.WriteTransport, transport).write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self._lines(data)
        except Exception as e:  # a bad event fails this stream (its `done`), never hangs it
            self._finish(e)

    def _lines(self, data: bytes) -> None:
        lines = (self._buf + data).split(b"\n") if self._buf else data.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line.startswith(b"data: {"):
                self.tokens += self.rec.add(json.loads(line[6:])["choices"][0]["text"])
            elif line.startswith(b"data: [DONE]"):
                self._finish(None)
            elif not self._status_checked:
                self._status_checked = True
                if not line.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the gateway answered {line.decode(errors='replace').strip()!r}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("the gateway closed the stream before data: [DONE]"))

    def _finish(self, exc: BaseException | None) -> None:
        if self.done.done():
            return
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)


def _completion_request(base_url: str, tokens: int) -> tuple[str, int, bytes]:
    """(host, port, the bytes of a streamed /v1/completions request for `tokens` tokens) for `base_url`."""
    host, port = base_url.removeprefix("http://").split("/")[0].split(":")
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": tokens, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return host, int(port), head + body


async def _sse_load(base_url: str, streams: int, tokens: int) -> dict[str, Any]:
    """The lean SSE reader (SSEReader) on `streams` connections: what the gateway adds with the least
    client-side cost on top."""
    host, port, request = _completion_request(base_url, tokens)
    loop = asyncio.get_running_loop()

    async def one(rec: _Recorder) -> int:
        transport, reader = await loop.create_connection(lambda: SSEReader(request, rec), host, port)
        try:
            await reader.done
        finally:
            transport.close()
        return reader.tokens

    return await _timed(streams, one)


async def _sse_readline_load(base_url: str, streams: int, tokens: int) -> dict[str, Any]:
    """The earlier SSE reader (asyncio streams: `readline` per line, a task wake-up per event), kept to
    show what the reader itself costs beside SSEReader in the same runs."""
    host, port, request = _completion_request(base_url, tokens)

    async def one(rec: _Recorder) -> int:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        n = 0
        while line := await reader.readline():
            if line.startswith(b"data: {"):
                n += rec.add(json.loads(line[6:])["choices"][0]["text"])
            elif line.startswith(b"data: [DONE]"):
                break
        writer.close()
        return n

    return await _timed(streams, one)


LOADS = {"sdk": _sdk_load, "sse": _sse_load, "sse_readline": _sse_readline_load, "openai": _openai_load}
GENERATORS = {"sdk": "AsyncClient.stream, against the broker",
              "sse": "a lean SSE reader (asyncio protocol callbacks), through the gateway",
              "sse_readline": "the earlier SSE reader (asyncio streams, readline), through the gateway",
              "openai": "official `openai` AsyncOpenAI, through the gateway",
              "sse_baseline": "the lean SSE reader, through the baseline gateway (--baseline-src)",
              "openai_baseline": "official `openai` AsyncOpenAI, through the baseline gateway (--baseline-src)"}


def run_load(args: argparse.Namespace) -> None:
    """The load-generator child: its result goes to a file (a 300 KB line on a pipe came back cut short at
    128 KiB after the openai client's run, once in a few)."""
    from tokenmill.client import run

    result = run(LOADS[args.load](args.target, args.streams, args.tokens))
    Path(args.result_file).write_text(json.dumps(result))


# ---- the pool --------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pool:
    """broker + paced worker + gateway processes (and a second, baseline gateway from `baseline_src`, a
    source tree of another commit, when given); `close()` stops them."""

    def __init__(self, step_rate: float, busy: float, start_jobs: int, log_dir: Path,
                 gateway_args: tuple[str, ...] = (), baseline_src: Path | None = None) -> None:
        self.front, self.back = _free_port(), _free_port()
        self.address = f"tcp://127.0.0.1:{self.front}"
        env = {**os.environ, "TOKENMILL_BENCH_STEP_RATE": str(step_rate), "TOKENMILL_BENCH_BUSY": str(busy),
               "TOKENMILL_BENCH_START_JOBS": str(start_jobs), "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gateway_pid: dict[str, int] = {}  # base URL -> the gateway's process id
        self._start(log_dir, "broker", env, ["broker", "--frontend", self.address, "--backend",
                                             f"tcp://127.0.0.1:{self.back}"])
        self._start(log_dir, "worker", env, ["worker", "--broker", f"tcp://127.0.0.1:{self.back}", "--model", MODEL,
                                             "--engine-factory", "tokenmill.benchmarks.gateway_bench:paced_engine",
                                             "--max-num-seqs", "256"])
        self.base_url = self._gateway(log_dir, "gateway", env, gateway_args)
        self.baseline_url = None
        if baseline_src is not None:
            env_b = {**env, "PYTHONPATH": str(_package_of(baseline_src, log_dir / "baseline-pkg"))}
            self.baseline_url = self._gateway(log_dir, "gateway-baseline", env_b, ())

    def _start(self, log_dir: Path, name: str, env: dict[str, str], argv: list[str]) -> None:
        with open(log_dir / f"{name}.log", "wb") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", *argv], stdout=log,
                                               stderr=subprocess.STDOUT, env=env))

    def _gateway(self, log_dir: Path, name: str, env: dict[str, str], extra: tuple[str, ...]) -> str:
        port = _free_port()
        self._start(log_dir, name, env, ["gateway", "--broker", self.address, "--port", str(port), *extra])
        self._wait_healthy(port)
        url = f"http://127.0.0.1:{port}/v1"
        self.gateway_pid[url] = self.procs[-1].pid
        return url

    def _wait_healthy(self, port: int, timeout: float = 60.0) -> None:
        import http.client

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the pool did not become healthy")

    def close(self) -> None:
        for pr in reversed(self.procs):
            pr.terminate()
        for pr in self.procs:
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                pr.kill()


def _package_of(src: Path, folder: Path) -> Path:
    """A PYTHONPATH entry under which `tokenmill.*` imports from the source tree `src` (a checkout of another
    commit: its top-level folders linked into a regular `tokenmill` package, found before the editable
    install's finder)."""
    pkg = folder / "tokenmill"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for sub in ("protocol", "broker", "worker", "kernels", "client", "gateway", "cli", "benchmarks"):
        if (src / sub).is_dir() and not (pkg / sub).exists():
            (pkg / sub).symlink_to((src / sub).resolve(), target_is_directory=True)
    return folder


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and its live descendants, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu s)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo.extend(c for c, (parent, _) in stats.items() if parent == p)
    return total


def _load(kind: str, target: str, streams: int, tokens: int, procs: int = 1) -> dict[str, Any]:
    """`streams` streams of `tokens` tokens from `procs` load-generator processes started together (the
    streams split as evenly as they go), their results merged: latencies and tokens summed over them, wall
    time the longest, CPU time summed."""
    shares = [streams // procs + (i < streams % procs) for i in range(procs)]
    with tempfile.TemporaryDirectory(prefix="tokenmill-gateway-load-") as tmp:
        files = [Path(tmp) / f"result-{i}.json" for i in range(procs)]
        children = [subprocess.Popen([sys.executable, "-m", "tokenmill.benchmarks.gateway_bench", "--load", kind,
                                      "--target", target, "--streams", str(n), "--tokens", str(tokens),
                                      "--result-file", str(file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    for n, file in zip(shares, files) if n > 0]
        for child in children:
            _, err = child.communicate(timeout=900)
            if child.returncode != 0:
                raise RuntimeError(f"load generator {kind} failed ({child.returncode}): {err.decode()[-2000:]}")
        parts = [json.loads(file.read_text()) for file in files if file.exists()]
    return {"latencies_ms": [x for r in parts for x in r["latencies_ms"]],
            "steps_ns": [x for r in parts for x in r["steps_ns"]], "tokens": sum(r["tokens"] for r in parts),
            "wall_s": max(r["wall_s"] for r in parts), "client_cpu_s": sum(r["client_cpu_s"] for r in parts),
            "loop": parts[0]["loop"], "load_procs": len(parts)}


def burst_ends(latencies: list[float], steps: list[int]) -> dict[str, float]:
    """The burst positions: over the engine steps, the median latency of a step's first token to arrive
    and of its last one (each step's tokens are one burst of `streams` tokens)."""
    by_step: dict[int, list[float]] = {}
    for lat, step in zip(latencies, steps):
        by_step.setdefault(step, []).append(lat)
    full = max((len(v) for v in by_step.values()), default=0)
    bursts = [v for v in by_step.values() if len(v) == full]  # whole bursts only (not a stream's start or end)
    return {"first_p50": round(percentile([min(v) for v in bursts], 50), 4),
            "last_p50": round(percentile([max(v) for v in bursts], 50), 4), "steps": len(bursts)}


def _summary(latencies: list[float]) -> dict[str, float]:
    return {f"p{q}": round(percentile(latencies, q), 4) for q in (50, 90, 99)} | {
        "mean": round(sum(latencies) / len(latencies), 4) if latencies else float("nan")}


# ---- aiperf ----------------------------------------------------------------------------------------


def ensure_aiperf(venv: Path) -> Path:
    """aiperf's executable in its own virtual environment at `venv` (created and installed if missing)."""
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "aiperf"], check=True, timeout=1800)
    return exe


def export_tokenizer(folder: Path) -> Path:
    """The embedded model's tokenizer as a Hugging Face tokenizer folder (aiperf counts prompt tokens with
    it; its `builtin` tokenizer would download an encoding, and nothing is fetched here)."""
    from tokenmill.worker.registry_fetch import embedded_model_path
    from tokenmill.worker.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer.from_gguf_file(embedded_model_path()).backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def run_aiperf(exe: Path, pool: Pool, streams: int, tokens: int, requests: int, work: Path) -> dict[str, Any]:
    """aiperf against the gateway; returns its JSON summary (the metrics it exported)."""
    art = work / "aiperf"
    tokenizer = export_tokenizer(work / "tokenizer")
    cmd = [str(exe), "profile", "--model", MODEL, "--url", pool.base_url.removesuffix("/v1"),
           "--endpoint-type", "chat", "--streaming", "--concurrency", str(streams),
           "--request-count", str(requests), "--synthetic-input-tokens-mean", "16",
           "--output-tokens-mean", str(tokens), "--extra-inputs", f"max_tokens:{tokens}",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--artifact-dir", str(art),
           "--tokenizer", str(tokenizer)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = sorted(art.rglob("profile_export_aiperf.json")) if art.exists() else []
    result: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
                              "stdout_tail": proc.stdout[-3000:], "stderr_tail": proc.stderr[-3000:]}
    if found:
        result["export"] = json.loads(found[0].read_text())
    return result


# ---- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--step-rate", type=float, default=50.0, help="engine steps per second")
    ap.add_argument("--busy", type=float, default=0.3, help="share of each step the engine holds the GIL")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the load generators in turn")
    ap.add_argument("--paths", default="sdk,sse,openai",
                    help="load generators, in each round's order: sdk, sse, sse_readline, openai (sdk always included)")
    ap.add_argument("--gateway-workers", type=int, default=1, help="the gateway's --gateway-workers")
    ap.add_argument("--load-procs", type=int, default=1,
                    help="load-generator processes per path, the streams split over them (the same for every path)")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="a source tree of another commit (e.g. `git archive` of it): a second gateway runs from "
                         "it on the same broker, measured in the same rounds through the same HTTP clients (paths "
                         "sse_baseline, openai_baseline)")
    ap.add_argument("--aiperf", action="store_true", help="also profile the gateway with aiperf")
    ap.add_argument("--aiperf-venv", default=str(Path(tempfile.gettempdir()) / "tokenmill-aiperf-venv"))
    ap.add_argument("--aiperf-requests", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/cpu")
    ap.add_argument("--name", default="gateway")
    ap.add_argument("--record", action="store_true",
                    help="merge the headline figure (gateway_added_p50_ms) into the summary.json of --out")
    ap.add_argument("--load", choices=sorted(LOADS), help=argparse.SUPPRESS)  # the load-generator child
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.load:
        run_load(args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="tokenmill-gateway-bench-"))
    gateway_args = ("--gateway-workers", str(args.gateway_workers)) if args.gateway_workers != 1 else ()
    pool = Pool(args.step_rate, args.busy, 1, work, gateway_args, args.baseline_src)
    rounds: list[dict[str, Any]] = []
    aiperf: dict[str, Any] | None = None
    try:
        targets = _targets(pool, args.paths)
        for kind, target in targets.values():  # warm-up
            _load(kind, target, args.streams, 8, args.load_procs)
        for r in range(args.rounds):
            for path, (kind, target) in targets.items():
                gw = pool.gateway_pid.get(target)
                cpu0 = tree_cpu_seconds(gw) if gw else 0.0
                res = _load(kind, target, args.streams, args.tokens, args.load_procs)
                res["gateway_cpu_s"] = round(tree_cpu_seconds(gw) - cpu0, 3) if gw else None
                rounds.append({"round": r, "path": path, **res})
                print(f"round {r} {path}: {_summary(res['latencies_ms'])} ({res['tokens']} tokens)", flush=True)
        if args.aiperf:
            aiperf = run_aiperf(ensure_aiperf(Path(args.aiperf_venv)), pool, args.streams, args.tokens,
                                args.aiperf_requests, work)
    finally:
        pool.close()
    report(args, list(targets), rounds, aiperf)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _targets(pool: Pool, paths: str) -> dict[str, tuple[str, str]]:
    """path name -> (load generator kind, its target), in round order."""
    names = ["sdk", *(x for x in paths.split(",") if x and x != "sdk")]
    unknown = set(names) - set(LOADS)
    if unknown:
        raise SystemExit(f"--paths: unknown {sorted(unknown)} (choose from {sorted(LOADS)})")
    out = {name: (name, pool.address if name == "sdk" else pool.base_url) for name in names}
    if pool.baseline_url is not None:  # the baseline gateway, through the same HTTP clients
        out.update({f"{name}_baseline": (name, pool.baseline_url) for name in ("sse", "openai") if name in out})
    return out


def _gateway_loop() -> str:
    """The event loop the gateway runs on (uvicorn_config's choice, in this environment)."""
    import importlib.util

    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def _us_per_token(cpu_s: float | None, tokens: int) -> float | None:
    return round(cpu_s / tokens * 1e6, 1) if cpu_s is not None and tokens else None


def _median(xs: list[float]) -> float:
    return round(percentile(xs, 50), 4) if xs else float("nan")


def report(args: argparse.Namespace, path_names: list[str], rounds: list[dict[str, Any]],
           aiperf: dict[str, Any] | None) -> None:
    paths: dict[str, dict[str, Any]] = {}
    for path in path_names:
        lat = [x for r in rounds if r["path"] == path for x in r["latencies_ms"]]
        toks = sum(r["tokens"] for r in rounds if r["path"] == path)
        wall = sum(r["wall_s"] for r in rounds if r["path"] == path)
        steps = [x for r in rounds if r["path"] == path for x in r["steps_ns"]]
        loops = sorted({r["loop"] for r in rounds if r["path"] == path})
        paths[path] = {"latency_ms": _summary(lat), "burst_ms": burst_ends(lat, steps), "tokens": toks,
                       "tokens_per_s": round(toks / wall, 1), "loop": ",".join(loops)}
    per_round = [{"round": r["round"], "path": r["path"], **_summary(r["latencies_ms"]), "tokens": r["tokens"],
                  "client_us_per_token": _us_per_token(r.get("client_cpu_s"), r["tokens"]),
                  "gateway_us_per_token": _us_per_token(r.get("gateway_cpu_s"), r["tokens"])} for r in rounds]
    http_paths = [p for p in path_names if p != "sdk"]
    added = {path: {q: round(paths[path]["latency_ms"][q] - paths["sdk"]["latency_ms"][q], 4)
                    for q in ("p50", "p90", "p99")} for path in http_paths}
    sdk_p50 = {r["round"]: r["p50"] for r in per_round if r["path"] == "sdk"}
    for path in http_paths:  # each round's p50 against the same round's SDK p50: the pairing that load drift spares
        pairs = [r["p50"] - sdk_p50[r["round"]] for r in per_round if r["path"] == path]
        added[path]["p50_median_of_rounds"] = _median(pairs)
    load = tuple(round(x, 2) for x in os.getloadavg())
    payload = {"benchmark": "gateway", "streams": args.streams, "tokens_per_stream": args.tokens,
               "step_rate": args.step_rate, "busy": args.busy, "gateway_workers": args.gateway_workers,
               "load_procs": args.load_procs, "gateway_loop": _gateway_loop(),
               "load_average": load, "paths": paths, "added_ms": added, "rounds": per_round, "aiperf": aiperf}
    lines = [
        f"Fake engine at {args.step_rate:g} steps/s (holding the GIL {args.busy:.0%} of each step), {args.streams} "
        f"concurrent streams x {args.tokens} tokens, gateway workers {args.gateway_workers} (event loop "
        f"{_gateway_loop()}), load-generator processes per path {args.load_procs}, {args.rounds} rounds of the load "
        f"generators in turn; load average at the end {load}. Latency per token = arrival at the load generator's "
        "code minus the engine step's return (one monotonic clock). A step's tokens arrive as one burst: "
        "`first` / `last` = median over steps of the latency of its first / last token to arrive.",
        "",
        "| path | load generator (loop) | p50 ms | p90 ms | p99 ms | first ms | last ms | tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path, s in paths.items():
        lines.append(f"| {path} | {GENERATORS[path]} ({s['loop']}) | {s['latency_ms']['p50']} | "
                     f"{s['latency_ms']['p90']} | {s['latency_ms']['p99']} | {s['burst_ms']['first_p50']} | "
                     f"{s['burst_ms']['last_p50']} | {s['tokens_per_s']} |")
    lines += [""]
    for path in http_paths:
        a = added[path]
        b, b0 = paths[path]["burst_ms"], paths["sdk"]["burst_ms"]
        first, last = round(b["first_p50"] - b0["first_p50"], 4), round(b["last_p50"] - b0["last_p50"], 4)
        lines.append(f"- **Added over the SDK path per token ({path}): p50 {a['p50']} ms** (median of the rounds' "
                     f"paired p50 differences {a['p50_median_of_rounds']} ms), p90 {a['p90']} ms, p99 {a['p99']} ms "
                     f"(goal: p50 <= 0.3 ms at 64 streams); to a burst's first token "
                     f"{first} ms, to its last {last} ms.")
    lines += ["", "CPU per token: the load generator's process time, and the gateway's (its process tree, from /proc) "
              "over the round.", "", "| round | path | p50 | p90 | p99 | client CPU us/token | gateway CPU us/token |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['round']} | {r['path']} | {r['p50']} | {r['p90']} | {r['p99']} | {r['client_us_per_token']} | "
              f"{r['gateway_us_per_token'] if r['gateway_us_per_token'] is not None else ''} |" for r in per_round]
    if aiperf is not None:
        lines += ["", "## aiperf against the gateway", "",
                  f"`aiperf {aiperf['command']}` (exit {aiperf['returncode']})", ""]
        lines += _aiperf_table(aiperf.get("export"))
    write_results(Path(args.out), args.name, payload, "\n".join(lines))
    if args.record:
        from tokenmill.benchmarks.summary import record_file

        print("summary:", record_file(Path(args.out) / f"{args.name}.json"))


AIPERF_METRICS = ("time_to_first_token", "inter_token_latency", "inter_chunk_latency", "request_latency",
                  "output_token_throughput", "output_token_throughput_per_user", "request_throughput",
                  "output_sequence_length", "request_count")


def _aiperf_table(export: dict[str, Any] | None) -> list[str]:
    if not export:
        return ["aiperf wrote no JSON export (see stdout_tail / stderr_tail in the JSON)."]
    rows = ["| metric | unit | avg | p50 | p90 | p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for key in AIPERF_METRICS:
        m = export.get(key)
        if isinstance(m, dict) and "avg" in m:
            rows.append(f"| {key} | {m.get('unit', '')} | " + " | ".join(
                str(round(m[k], 4)) if isinstance(m.get(k), int | float) else "" for k in ("avg", "p50", "p90", "p99"))
                + " |")
    return rows


if __name__ == "__main__":
    sys.exit(main())
