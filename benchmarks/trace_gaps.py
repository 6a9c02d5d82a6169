"""Gaps between consecutive GPU kernels in a torch.profiler Chrome trace (gpu_e2e --profile writes one).

A negative gap means the next kernel started before the previous one ended: programmatic dependent launch
(PDL) let its programs in while the previous kernel drained. Used to tell whether a captured decode graph
keeps its PDL overlap (issue 12's decode-speed bisection).

    python -m tokenmill.benchmarks.trace_gaps decode_b1_trace.json [more traces ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GapStats:
    kernels: int
    pairs: int
    overlapping: int  # pairs whose next kernel starts before the previous one ends
    median_gap_us: float
    mean_gap_us: float
    span_ms: float  # first kernel start to last kernel end
    busy_ms: float  # sum of kernel durations
    no_overlap_pairs: list[tuple[str, str, int]]  # most frequent (prev, next, count) pairs that never overlap


def _short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:40]


def gap_stats(trace: dict, top: int = 6) -> GapStats:
    """Statistics over the trace's device events of category kernel / gpu_memcpy / gpu_memset, in start order."""
    events = sorted((e for e in trace.get("traceEvents", [])
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    if len(events) < 2:
        raise ValueError("the trace holds fewer than two GPU kernels: was it recorded with CUDA activity?")
    gaps, overlapped, total = [], Counter[tuple[str, str]](), Counter[tuple[str, str]]()
    for prev, nxt in itertools.pairwise(events):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        gaps.append(gap)
        key = (_short(prev["name"]), _short(nxt["name"]))
        total[key] += 1
        if gap < 0:
            overlapped[key] += 1
    never = [(a, b, n) for (a, b), n in total.most_common() if overlapped[(a, b)] == 0][:top]
    return GapStats(
        kernels=len(events), pairs=len(gaps), overlapping=sum(g < 0 for g in gaps),
        median_gap_us=statistics.median(gaps), mean_gap_us=statistics.fmean(gaps),
        span_ms=(events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / 1e3,
        busy_ms=sum(e["dur"] for e in events) / 1e3, no_overlap_pairs=never,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path, help="Chrome trace JSON files")
    ap.add_argument("--top", type=int, default=6, help="kernel pairs that never overlap, most frequent first")
    args = ap.parse_args(argv)
    for path in args.traces:
        s = gap_stats(json.loads(path.read_text()), args.top)
        print(f"{path}: {s.kernels} kernels, {s.overlapping}/{s.pairs} pairs overlap, gap median "
              f"{s.median_gap_us:+.2f} us mean {s.mean_gap_us:+.2f} us, span {s.span_ms:.2f} ms, "
              f"busy {s.busy_ms:.2f} ms")
        for a, b, n in s.no_overlap_pairs:
            print(f"    never overlap: {a} -> {b} x{n}")


if __name__ == "__main__":
    main()
