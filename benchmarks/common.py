"""Shared bits of the benchmark scripts: where results go and what they record about the run."""

from __future__ import annotations

import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """HEAD (short), "-dirty" when tracked files other than results differ; TOKENMILL_COMMIT wins where set
    (a device copy of the tree can carry a stale .git: say there which commit it is)."""
    if os.environ.get("TOKENMILL_COMMIT"):
        return os.environ["TOKENMILL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        # results/ left out: a run rewrites its own tracked result files as it goes
        tree = ["--", ":/", ":(top,exclude)benchmarks/results"]
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *tree],
                               capture_output=True, text=True, check=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_info() -> dict[str, Any]:
    """The machine and software a result was measured on: platform, Python, torch, Triton, cores; on CUDA
    also the GPU, the CUDA version torch was built for and the driver."""
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "triton": _version("triton"), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info |= {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "driver": _nvidia_driver()}
    return info


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.split()[0] if out.split() else None
    except (OSError, subprocess.SubprocessError):
        return None


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def write_results(out_dir: Path, name: str, payload: dict[str, Any], table_md: str, echo: bool = True,
                  stamp: bool = True) -> None:
    """<name>.json and <name>.md in `out_dir`. `stamp`: record this process's command, commit, device and
    the time (off for results measured elsewhere, e.g. merged ones, which carry their own)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if stamp:
        payload = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(),
                   "device": device_info(),
                   "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **payload}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    when = f", measured {payload['measured']}" if payload.get("measured") else ""
    header = (f"# {name}\n\ncommit `{payload.get('commit')}`{when}, device `{payload.get('device')}`\n\n"
              f"command: `{payload.get('command')}`\n\n")
    (out_dir / f"{name}.md").write_text(header + table_md + "\n")
    if echo:
        print(table_md)


# -- per-request latency metrics (shared by the offline, ladder and serving benchmarks) ----------------


@dataclass
class RequestTiming:
    """When one request was sent, when each of its output chunks arrived, and how long it was.
    Times are seconds on one monotonic clock (time.perf_counter)."""

    sent: float
    prompt_len: int
    output_len: int = 0  # tokens received
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    chunk_sizes: list[int] = field(default_factory=list)
    done: float = float("nan")
    cached_tokens: int = 0
    error: str | None = None
    queue_time: float = float("nan")  # seconds the job waited at the broker for a worker (from its DONE)
    worker: tuple[float, float, float] | None = None  # the DONE's worker timeline (WorkerTimeline), seconds

    def on_tokens(self, t: float, n: int) -> None:
        if n > 0:
            self.chunk_times.append(t)
            self.chunk_sizes.append(n)
            self.output_len += n

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times) and math.isfinite(self.done)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (vLLM's TPOT); NaN for a single token."""
        n = self.output_len
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1) if n > 1 else float("nan")

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks (vLLM's ITL: one value per chunk after the first)."""
        ts = self.chunk_times
        return [b - a for a, b in itertools.pairwise(ts)]


    def timeline(self) -> dict[str, float]:
        """The request's TTFT (ms) taken apart: broker queue (accept -> dispatch), worker admission (SUBMIT
        received -> in the engine: tokenizing, the engine loop finishing its step), wait for a step (-> first
        scheduled), first step (-> first token out of the engine), and the rest (client -> broker -> worker and
        back, on no one clock: TTFT minus the others). NaN where the DONE did not say."""
        nan = float("nan")
        admitted, scheduled, first = self.worker if self.worker is not None else (nan, nan, nan)
        ttft = self.ttft
        return {"ttft_ms": 1e3 * ttft, "broker_queue_ms": 1e3 * self.queue_time, "worker_admission_ms": 1e3 * admitted,
                "wait_for_step_ms": 1e3 * (scheduled - admitted), "first_step_ms": 1e3 * (first - scheduled),
                "transit_ms": 1e3 * (ttft - self.queue_time - first)}


def slowest_timelines(timings: list[RequestTiming], n: int = 5) -> list[dict[str, float]]:
    """The timelines of the n successful requests with the longest TTFT, slowest first."""
    ok = sorted((t for t in timings if t.ok), key=lambda t: t.ttft, reverse=True)
    return [t.timeline() for t in ok[:n]]


PCTS = (50, 90, 99)


def dist(xs: list[float], scale: float = 1e3) -> dict[str, float]:
    """mean and p50/p90/p99 of `xs` times `scale` (default: seconds -> ms); NaNs dropped."""
    v = [x * scale for x in xs if math.isfinite(x)]
    out = {"mean": sum(v) / len(v) if v else float("nan")}
    out.update({f"p{q}": percentile(v, q) for q in PCTS})
    return out


def latency_summary(timings: list[RequestTiming]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT, ITL and end-to-end latency distributions (ms) over the successful requests."""
    ok = [t for t in timings if t.ok]
    return {"ttft_ms": dist([t.ttft for t in ok]), "tpot_ms": dist([t.tpot for t in ok]),
            "itl_ms": dist([x for t in ok for x in t.itls]), "e2e_ms": dist([t.e2e for t in ok])}


def meets_slo(t: RequestTiming, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    if not t.ok:
        return False
    if ttft_slo_s is not None and t.ttft > ttft_slo_s:
        return False
    tpot = t.tpot
    return tpot_slo_s is None or not math.isfinite(tpot) or tpot <= tpot_slo_s


def goodput(timings: list[RequestTiming], duration_s: float, ttft_slo_s: float | None,
            tpot_slo_s: float | None) -> float:
    """Requests per second that finished within both SLOs (vLLM's goodput definition)."""
    if duration_s <= 0:
        return float("nan")
    return sum(meets_slo(t, ttft_slo_s, tpot_slo_s) for t in timings) / duration_s


def throughput_summary(timings: list[RequestTiming], duration_s: float) -> dict[str, float]:
    """Request, output-token and total-token rates of the successful requests over `duration_s`."""
    ok = [t for t in timings if t.ok]
    out_tok = sum(t.output_len for t in ok)
    in_tok = sum(t.prompt_len for t in ok)
    d = duration_s if duration_s > 0 else float("nan")
    return {"duration_s": duration_s, "completed": len(ok), "failed": len(timings) - len(ok),
            "input_tokens": in_tok, "output_tokens": out_tok, "requests_per_s": len(ok) / d,
            "output_tok_per_s": out_tok / d, "total_tok_per_s": (in_tok + out_tok) / d}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
