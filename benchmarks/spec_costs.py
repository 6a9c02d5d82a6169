"""The costs the EAGLE automatic switch weighs, on the GPU without the real model: a decode step, a verify step of
k + 1 tokens and a draft round of k, at batch 1 / 8 / 32 / 128, for SmolLM2-135M's shape with dummy target weights
and the shipped head (worker/spec/heads/smollm2-135m-instruct); and the draft round from the chain CUDA graphs
against eagerly. Step costs do not depend on the weights (acceptance does: spec_gpu.py measures that with the
real model). The head is loaded from a copy whose config takes the dummy target's rms_norm_eps (1e-05; the GGUF's
is its float32 rounding, which the head-fit check would refuse).

    python -m tokenmill.benchmarks.spec_costs --out /tmp/spec_costs
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.spec_gpu import draft_round_costs
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.spec.eagle import CONFIG_FILE, head_folder


def head_for_dummy_target(head: Path) -> Path:
    out = Path(tempfile.mkdtemp(prefix="spec_costs_head_"))
    for f in head.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / CONFIG_FILE).read_text())
    config["arch"]["rms_norm_eps"] = 1e-05
    (out / CONFIG_FILE).write_text(json.dumps(config))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    sizes = (1, 8, 32, 128) if cuda else (1, 2)
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=args.k, auto_switch=cuda or None,
                             draft_model=str(head_for_dummy_target(head_folder(None, "embedded"))))
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model="smollm2-135m", load_format="dummy", device="auto", dtype="auto", max_model_len=800,
        cache=CacheConfig(enable_prefix_caching=False), speculative=spec,
        scheduler=SchedulerConfig(max_num_seqs=max(sizes))))
    ready_s = time.perf_counter() - start
    rounds = draft_round_costs(engine, args.k, sizes, 256)
    sw = engine.switch
    costs = None if sw is None else {
        "batch_sizes": list(sw.costs.batch_sizes), "decode_ms": [t * 1e3 for t in sw.costs.decode_s],
        "verify_ms": [t * 1e3 for t in sw.costs.verify_s], "draft_ms": [t * 1e3 for t in sw.costs.draft_s]}
    lines = [f"SmolLM2-135M shape, dummy target weights, shipped head, k = {args.k}; engine ready in {ready_s:.1f} s",
             "", "draft round (ms, 256 tokens of context, one catch-up row a request): graphs / eager", "",
             "| batch | graphs | eager |", "|---|---|---|"]
    for b, row in rounds.items():
        g = row.get("graphs")
        lines.append(f"| {b} | {'-' if g is None else f'{g:.2f}'} | {row['eager']:.2f} |")
    if costs:
        lines += ["", "the switch's start-up costs (ms): batch / decode / verify k+1 / draft round, and the tau at "
                  "which speculating breaks even, (verify + draft) / decode", "",
                  "| batch | decode | verify | draft | break-even tau |", "|---|---|---|---|---|"]
        for b, d, v, r in zip(costs["batch_sizes"], costs["decode_ms"], costs["verify_ms"], costs["draft_ms"]):
            lines.append(f"| {b} | {d:.2f} | {v:.2f} | {r:.2f} | {(v + r) / d:.2f} |")
    payload = {"benchmark": "spec_costs", "k": args.k, "engine_ready_s": ready_s, "draft_round_ms": rounds,
               "switch_costs": costs}
    write_results(args.out, "spec_costs", payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
