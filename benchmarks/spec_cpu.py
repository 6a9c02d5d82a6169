"""CPU benchmark of speculative decoding at batch 1 on the embedded model (issue 17): n-gram (prompt lookup)
and EAGLE (the head shipped for the model, or --draft-model).

One engine with `--speculative ngram` and prefix caching off; each request runs twice, once with
`num_speculative_tokens=0` (plain decoding) and once with k drafts per step, in alternating order, one
request at a time (batch 1), greedy, up to --max-tokens tokens or EOS. Both runs yield the same tokens
(checked): the speed-up is the ratio of their wall times. Two workloads of ShareGPT human turns: `chat`
(the turn through the chat template) and `copy` (a completion prompt asking for the turn again: prompt
lookup's good case, output copying input; see `workload_text`). Also recorded: drafts accepted per verify step,
and the time of a decode step against a verify step (the host times a step synchronously on the CPU).
EAGLE runs the `chat` workload on a second engine (`--speculative eagle`), its prompts taken from after the
ShareGPT pairs the head was trained on (spec_gpu.heldout_offset); its step times include the drafting. With
`--tree-width W ...`, one EAGLE engine per width (1: chains; W > 1: trees of at most k nodes, the head's top W
per level: worker/spec/eagle_tree.py); "drafts accepted" of a tree counts every node it drafted.

    python -m tokenmill.benchmarks.spec_cpu --out benchmarks/results/cpu
    python -m tokenmill.benchmarks.spec_cpu --methods eagle --requests 4 --max-tokens 64 --threads 1 \
        --name spec_cpu_eagle --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks import summary
from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.datasets import sharegpt_pairs
from tokenmill.benchmarks.spec_gpu import heldout_offset, heldout_prompts
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine, StepRecord
from tokenmill.worker.registry_fetch import sharegpt_path
from tokenmill.worker.spec.eagle import CONFIG_FILE, head_folder

WORKLOADS = ("chat", "copy")


def workload_text(engine: LLMEngine, workload: str, turn: str) -> tuple[str, bool]:
    """(prompt text, whether it is already templated). `chat`: the turn through the chat template. `copy`:
    a raw completion prompt, the turn, then "The text above, repeated word for word:" and its first six
    words (SmolLM2-135M-Instruct does not follow a "repeat this" instruction through its chat template: it
    answers the text; as a completion it copies it)."""
    if workload == "chat":
        return engine.tokenizer.apply_chat_template([{"role": "user", "content": turn}]), True
    return f"{turn}\n\nThe text above, repeated word for word:\n\n{' '.join(turn.split()[:6])}", False


def prompts(engine: LLMEngine, workload: str, n: int, max_prompt: int) -> list[list[int]]:
    out = []
    for human, _ in sharegpt_pairs(sharegpt_path()):
        text, templated = workload_text(engine, workload, human)
        ids = engine.tokenizer.encode(text, add_special_tokens=not templated)
        if 16 <= len(ids) <= max_prompt:
            out.append(ids)
        if len(out) == n:
            return out
    raise RuntimeError("not enough ShareGPT prompts")


class StepLog:
    """Step observer: the host time of each step (synchronous on the CPU: the whole step) by its width."""

    def __init__(self) -> None:
        self.decode_s: list[float] = []  # one request computing one token
        self.verify_s: dict[int, list[float]] = {}  # tokens scored (1 + drafts) -> times
        self.steps = 0

    def __call__(self, rec: StepRecord) -> None:
        self.steps += 1
        (req,), (n,) = rec.batch.requests, rec.batch.num_new_tokens
        if req.num_computed_tokens < req.num_prompt_tokens:
            return  # the prefill
        if req.draft_token_ids:
            self.verify_s.setdefault(n, []).append(rec.launch_s)
        else:
            self.decode_s.append(rec.launch_s)


def timed(engine: LLMEngine, ids: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    (out,) = engine.generate([ids], params)
    return time.perf_counter() - start, out.token_ids


def run_workload(engine: LLMEngine, reqs: list[list[int]], k: int, max_tokens: int) -> dict[str, Any]:
    plain_p = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=0)
    spec_p = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=k)
    c = engine.counters
    log = StepLog()
    engine.step_observer = log
    plain_s = spec_s = 0.0
    tokens = drafted = accepted = spec_steps = 0
    for i, ids in enumerate(reqs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got: dict[bool, list[int]] = {}
        for spec in order:
            d0, a0, s0 = c.draft_tokens, c.accepted_draft_tokens, log.steps
            elapsed, got[spec] = timed(engine, ids, spec_p if spec else plain_p)
            if spec:
                spec_s += elapsed
                drafted, accepted = drafted + c.draft_tokens - d0, accepted + c.accepted_draft_tokens - a0
                spec_steps += log.steps - s0
            else:
                plain_s += elapsed
        assert got[True] == got[False], f"request {i}: speculation changed the greedy output"
        tokens += len(got[False])
    engine.step_observer = None
    verify = {n: statistics.median(ts) for n, ts in sorted(log.verify_s.items())}
    decode = statistics.median(log.decode_s)
    return {
        "requests": len(reqs), "output_tokens": tokens, "k": k,
        "plain_s": plain_s, "spec_s": spec_s, "speedup": plain_s / spec_s,
        "plain_tok_s": tokens / plain_s, "spec_tok_s": tokens / spec_s,
        "draft_tokens": drafted, "accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        # after the prefill (one token per request): tokens per decode or verify step, tau
        "tokens_per_spec_step": (tokens - len(reqs)) / (spec_steps - len(reqs)),
        "decode_step_ms_p50": decode * 1e3,
        "verify_step_ms_p50": {str(n): t * 1e3 for n, t in verify.items()},
        "verify_step_cost_vs_decode": {str(n): t / decode for n, t in verify.items()},
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| method | workload | k | requests | output tokens | plain tok/s | spec tok/s | speed-up | "
            "drafts accepted | tokens / step | decode step p50 | verify step p50 (tokens scored: ms, x decode) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        verify = ", ".join(f"{n}: {ms:.1f} ms ({r['verify_step_cost_vs_decode'][n]:.2f}x)"
                           for n, ms in r["verify_step_ms_p50"].items())
        base = name.split("_k")[0]
        method, workload = base.split("_") if base.startswith("eagle_") else ("ngram", base)
        if r.get("tree_width", 1) > 1:
            method += f" (tree w{r['tree_width']})"
        if r.get("eagle_lookup_min"):
            method += f" (prompt lookup first, n >= {r['eagle_lookup_min']})"
        rows.append(f"| {method} | {workload} | {r['k']} | {r['requests']} | {r['output_tokens']} | "
                    f"{r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
                    f"{r['acceptance_rate']:.0%} | {r['tokens_per_spec_step']:.2f} | "
                    f"{r['decode_step_ms_p50']:.1f} ms | {verify} |")
    return "\n".join(rows)


def spec_engine(spec: SpeculativeConfig) -> LLMEngine:
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(enable_prefix_caching=False),
                                    speculative=spec))
    timed(engine, [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    return engine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--k", type=int, nargs="+", default=[3], help="draft tokens per step (one run each)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--methods", nargs="+", default=["ngram", "eagle"], choices=["ngram", "eagle"])
    ap.add_argument("--draft-model", default=None, help="eagle: head folder (default: the one shipped)")
    ap.add_argument("--tree-width", type=int, nargs="+", default=[1],
                    help="eagle: tree widths, one engine each (1: chain drafts)")
    ap.add_argument("--prompt-offset", type=int, default=None,
                    help="eagle: first ShareGPT pair of its prompts (default: after the head's training pairs)")
    ap.add_argument("--eagle-lookup-min", type=int, default=0,
                    help="eagle chains: also run prompt lookup first from suffixes of this many tokens (0: not)")
    ap.add_argument("--name", default="spec_cpu", help="result file name (<name>.json / .md in --out)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    head = head_folder(args.draft_model, "embedded") if "eagle" in args.methods else None  # fails early if none
    load = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    if "ngram" in args.methods:
        engine = spec_engine(SpeculativeConfig(method="ngram"))
        results |= {f"{w}_k{k}": run_workload(engine, prompts(engine, w, args.requests, args.max_prompt), k,
                                              args.max_tokens)
                    for w in args.workloads for k in args.k}
    if head is not None:
        for width in args.tree_width:
            engine = spec_engine(SpeculativeConfig(method="eagle", draft_model=str(head), tree_width=width))
            offset = heldout_offset(head) if args.prompt_offset is None else args.prompt_offset
            chats = heldout_prompts(engine, offset, args.requests, args.max_prompt)
            tail = "" if width == 1 else f"_w{width}"
            results |= {f"eagle_chat_k{k}{tail}": {**run_workload(engine, chats, k, args.max_tokens),
                                                    "tree_width": width} for k in args.k}
            if width == 1 and args.eagle_lookup_min:
                n = args.eagle_lookup_min
                engine = spec_engine(SpeculativeConfig(method="eagle", draft_model=str(head), eagle_lookup_min=n))
                results |= {f"eagle_chat_k{k}_lookup{n}": {**run_workload(engine, chats, k, args.max_tokens),
                                                           "eagle_lookup_min": n} for k in args.k}
    payload = {"benchmark": "spec_cpu", "config": vars(args) | {"out": str(args.out)},
               "eagle_head": None if head is None else str(head),
               "eagle_head_training": None if head is None else
               json.loads((head / CONFIG_FILE).read_text()).get("training"),
               "torch_threads": torch.get_num_threads(),
               "load_average_before_after": [load, os.getloadavg()], "results": results}
    write_results(args.out, args.name, payload, table(results))
    print("summary.json:", summary.record_file(args.out / f"{args.name}.json"))


if __name__ == "__main__":
    main()
