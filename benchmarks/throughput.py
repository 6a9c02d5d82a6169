"""Offline throughput: every request at once through LLMEngine (outputs forced to their lengths with
ignore_eos), and the Hugging Face transformers `generate()` baseline with static batches on the same
prompts and output lengths, in the same run.

HF baseline: batches of `--hf-batch-size` requests in workload order, left padding, greedy,
min_new_tokens = max_new_tokens = the batch's longest output. Only each request's own output length
counts as useful tokens (what a static-batching server delivers); the padding work is reported apart.

    python -m tokenmill.benchmarks.throughput --model embedded --num-prompts 32 --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tokenmill.benchmarks.common import (
    RequestTiming,
    latency_summary,
    peak_rss_bytes,
    throughput_summary,
    write_results,
)
from tokenmill.benchmarks.workloads import BenchRequest, Workload, length_tokenizer, sharegpt_workload
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.sampling_params import SamplingParams
from tokenmill.worker.tokenizer import Tokenizer

GIB = float(1 << 30)


# -- the engine under test ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """What engine a benchmark builds (in this process or in a worker process)."""

    model: str = "embedded"
    load_format: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = 4096
    gpu_memory_utilization: float = 0.9
    cpu_kv_bytes: int = 1 << 30
    cuda_graphs: bool = True
    threads: int = 0  # torch CPU threads (0: torch's default); the worker process gets the same

    @property
    def dummy(self) -> bool:
        return self.load_format == "dummy"

    def engine_config(self, prefix_caching: bool = True) -> EngineConfig:
        return EngineConfig(
            model=self.model, load_format=self.load_format, dtype=self.dtype, device=self.device,  # type: ignore[arg-type]
            max_model_len=self.max_model_len, cuda_graphs=self.cuda_graphs,
            cache=CacheConfig(gpu_memory_utilization=self.gpu_memory_utilization, cpu_kv_bytes=self.cpu_kv_bytes,
                              enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs))

    def describe(self) -> dict[str, Any]:
        return dict(self.__dict__)


def workload_tokenizer(spec: ModelSpec) -> tuple[Tokenizer, int | None, str]:
    """(tokenizer that measures lengths, vocab for random-id prompts or None for text, its name)."""
    if spec.dummy:
        from tokenmill.worker.loader.dummy import dummy_arch

        arch = dummy_arch(spec.model)
        if arch is None:
            raise ValueError(f"unknown dummy shape {spec.model!r}")
        tok, name = length_tokenizer()
        return tok, arch.vocab_size, name
    from tokenmill.worker.engine import load_tokenizer
    from tokenmill.worker.loader import resolve_model

    return load_tokenizer(resolve_model(spec.model, spec.load_format)), None, "model"  # type: ignore[arg-type]


def apply_threads(spec: ModelSpec) -> None:
    if spec.threads > 0:
        import torch

        torch.set_num_threads(spec.threads)


def build_engine(spec: ModelSpec, prefix_caching: bool = True) -> LLMEngine:
    apply_threads(spec)
    engine = LLMEngine(spec.engine_config(prefix_caching))
    warm_up(engine)
    return engine


def warm_up(engine: LLMEngine) -> None:
    """A few short requests of different lengths so kernels are compiled before anything is timed."""
    vocab = engine.runner.arch.vocab_size
    prompts = [[(7 * i + j) % (vocab - 300) + 260 for j in range(n)] for i, n in enumerate((5, 40, 130))]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.blocks.reset_prefix_cache()


def set_prefix_caching(engine: LLMEngine, on: bool) -> None:
    """Switch prefix caching between runs (nothing may be in flight) and start from an empty cache."""
    assert not engine.has_unfinished_requests()
    engine.blocks.enable_prefix_caching = on
    engine.blocks.reset_prefix_cache()


def free_device_memory() -> None:
    """Return freed device memory (a dropped engine's KV cache and CUDA graphs) before the next model."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory_info(engine: LLMEngine) -> dict[str, Any]:
    r = engine.runner
    weights = sum(p.numel() * p.element_size() for p in r.model.parameters())
    info: dict[str, Any] = {"weights_bytes": weights, "kv_blocks": r.num_blocks, "block_size": r.block_size,
                            "kv_bytes_per_block": r.bytes_per_block, "kv_bytes": r.num_blocks * r.bytes_per_block}
    info.update(peak_memory(r.device.type))
    return info


def peak_memory(device_type: str) -> dict[str, int]:
    if device_type == "cuda":
        import torch

        return {"peak_device_bytes": int(torch.cuda.max_memory_allocated())}
    return {"peak_rss_bytes": peak_rss_bytes()}


# -- driving the engine ------------------------------------------------------------------------------------


@dataclass
class EngineRun:
    timings: list[RequestTiming]  # of the requests sent, in workload order
    sent: list[int]  # their indices in the workload
    duration_s: float
    steps: int
    peak_kv_blocks: int  # most KV blocks in use at once
    preemptions: int
    prefix_hit_blocks: int
    prefix_query_blocks: int

    def summary(self, bytes_per_block: int) -> dict[str, Any]:
        return {**throughput_summary(self.timings, self.duration_s), "latency": latency_summary(self.timings),
                "steps": self.steps, "peak_kv_blocks": self.peak_kv_blocks,
                "peak_kv_bytes": self.peak_kv_blocks * bytes_per_block, "preemptions": self.preemptions,
                "prefix_hit_blocks": self.prefix_hit_blocks, "prefix_query_blocks": self.prefix_query_blocks,
                "cached_prompt_tokens": sum(t.cached_tokens for t in self.timings)}


class _Releaser:
    """Decides when each request is sent: all at once, in static batches of `batch_size` (the next batch
    when the previous one has finished), or turn by turn within a session (turn t+1 after turn t), with
    at most `sessions` conversations open at once (None: all)."""

    def __init__(self, reqs: tuple[BenchRequest, ...], batch_size: int | None, sessions: int | None) -> None:
        self.reqs, self.batch_size, self.sessions = reqs, batch_size, sessions
        self.next_batch = 0
        self.in_batch = 0
        self.turns: dict[int, deque[int]] = {}  # session -> its request indices in turn order
        for i, r in enumerate(reqs):
            if r.session >= 0:
                self.turns.setdefault(r.session, deque()).append(i)
        self.unopened = deque(self.turns)

    def initial(self) -> list[int]:
        if self.batch_size:
            return self._batch()
        first = [i for i, r in enumerate(self.reqs) if r.session < 0]
        for _ in range(min(self.sessions or len(self.unopened), len(self.unopened))):
            first.append(self._open())
        return first

    def on_finish(self, i: int) -> list[int]:
        if self.batch_size:
            self.in_batch -= 1
            return self._batch() if self.in_batch == 0 else []
        session = self.reqs[i].session
        if session < 0:
            return []
        if self.turns[session]:
            return [self.turns[session].popleft()]
        return [self._open()] if self.unopened else []

    def _open(self) -> int:
        return self.turns[self.unopened.popleft()].popleft()

    def _batch(self) -> list[int]:
        start = self.next_batch
        self.next_batch = min(start + (self.batch_size or 0), len(self.reqs))
        self.in_batch = self.next_batch - start
        return list(range(start, self.next_batch))


def drive(engine: LLMEngine, workload: Workload, *, batch_size: int | None = None, sessions: int | None = None,
          desc: str = "engine", deadline: float | None = None) -> EngineRun:
    """Run `workload` through `engine` (greedy, ignore_eos, each request's own output length), timing
    every request from the moment it is added (see `_Releaser` for when that is; in static batches
    from the start, when they all arrived). Past `deadline` (time.monotonic) no new request is sent;
    those in flight finish and only the sent ones are reported."""
    reqs = workload.requests
    rel = _Releaser(reqs, batch_size, sessions)
    timings: list[RequestTiming | None] = [None] * len(reqs)
    hits0, queries0, pre0 = engine.blocks.prefix_hits, engine.blocks.prefix_queries, engine.scheduler.num_preemptions
    steps, peak = 0, 0
    start = time.perf_counter()

    def send(indices: list[int]) -> None:
        for i in indices:
            r = reqs[i]
            # Static batches: every request arrived at the start and waits for its batch.
            timings[i] = RequestTiming(start if batch_size else time.perf_counter(), r.prompt_len)
            engine.add_request(f"b{i}", prompt_token_ids=list(r.prompt_ids),
                               params=SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))

    send(rel.initial())
    with tqdm(total=len(reqs), desc=desc, unit="req", leave=False) as bar:
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            steps += 1
            peak = max(peak, engine.blocks.num_in_use)
            for out in outs:
                i = int(out.request_id[1:])
                t = timings[i]
                assert t is not None
                t.on_tokens(now, len(out.new_token_ids))
                if out.finished:
                    t.done, t.error = now, out.error
                    t.cached_tokens = out.usage.cached_tokens if out.usage else 0
                    bar.update(1)
                    nxt = rel.on_finish(i)
                    if deadline is None or time.monotonic() < deadline:
                        send(nxt)
    duration = time.perf_counter() - start
    sent = [i for i, t in enumerate(timings) if t is not None]
    return EngineRun([t for t in timings if t is not None], sent, duration, steps, peak,
                     engine.scheduler.num_preemptions - pre0, engine.blocks.prefix_hits - hits0,
                     engine.blocks.prefix_queries - queries0)


def offline_throughput(engine: LLMEngine, workload: Workload, desc: str = "offline") -> dict[str, Any]:
    """All requests at once; requests/s, output tokens/s, total tokens/s, latencies and KV use."""
    run = drive(engine, workload, desc=desc)
    return {"workload": workload.summary(), **run.summary(engine.runner.bytes_per_block),
            **peak_memory(engine.runner.device.type)}


# -- the Hugging Face baseline ---------------------------------------------------------------------------


def hf_model(spec: ModelSpec) -> Any:
    """The same model in transformers: the embedded GGUF dequantized, or a LlamaForCausalLM of the dummy
    shape with random weights in the spec's dtype on its device."""
    import torch

    apply_threads(spec)
    if not spec.dummy:
        from tokenmill.benchmarks.engine_cpu import load_hf

        model = load_hf()
        return model.to(device=spec.device, dtype=getattr(torch, spec.dtype)).eval()
    return _hf_dummy(spec)


def _hf_dummy(spec: ModelSpec) -> Any:
    import torch
    import transformers

    from tokenmill.worker.loader.dummy import dummy_arch

    a = dummy_arch(spec.model)
    if a is None or a.arch != "llama" or a.rope_scaling.kind != "none":
        raise ValueError(f"the HF baseline builds plain Llama shapes only, not {spec.model!r}")
    kw: dict[str, Any] = dict(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
        bos_token_id=a.bos_token_id, eos_token_id=list(a.eos_token_ids) or None, pad_token_id=0)
    cfg = transformers.LlamaConfig(**kw)
    dtype = getattr(torch, spec.dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(spec.device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.to(dtype).eval()


def hf_static(model: Any, workload: Workload, batch_size: int, device: str, *,
              time_limit_s: float | None = None) -> dict[str, Any]:
    """Static batches through `model.generate()`; stops starting batches when the next one would end past
    `time_limit_s` (at least one batch runs). Reports how many requests were served."""
    reqs = workload.requests
    useful = generated = done = 0
    spent, per_step = 0.0, 0.0
    batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
    for batch in tqdm(batches, desc=f"HF generate, batch {batch_size}", unit="batch", leave=False):
        steps = max(r.output_len for r in batch)
        if done and time_limit_s is not None and spent + per_step * steps > time_limit_s:
            break
        elapsed = _hf_batch(model, batch, steps, device)
        spent += elapsed
        per_step = max(per_step, elapsed / steps)
        useful += sum(r.output_len for r in batch)
        generated += steps * len(batch)
        done += len(batch)
    return {"batch_size": batch_size, "requests": done, "of_requests": len(reqs), "duration_s": spent,
            "useful_output_tokens": useful, "generated_tokens": generated,
            "input_tokens": sum(r.prompt_len for r in reqs[:done]),
            "requests_per_s": done / spent, "output_tok_per_s": useful / spent,
            "generated_tok_per_s": generated / spent}


def _hf_batch(model: Any, batch: tuple[BenchRequest, ...], steps: int, device: str) -> float:
    import torch

    width = max(r.prompt_len for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):  # left padding
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_ids)
        mask[row, width - r.prompt_len:] = 1
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=0)
    _sync(device)
    assert out.shape[1] == width + steps, "HF stopped early"
    return time.perf_counter() - start


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def compare_with_hf(spec: ModelSpec, workload: Workload, hf_batch: int, engine_factory: Callable[[], LLMEngine],
                    time_limit_s: float | None = None) -> dict[str, Any]:
    """HF first (its model is freed afterwards), then the engine on exactly the requests HF served."""
    model = hf_model(spec)
    hf = hf_static(model, workload, hf_batch, spec.device, time_limit_s=time_limit_s)
    del model
    free_device_memory()
    served = workload.subset(hf["requests"])
    engine = engine_factory()
    mine = offline_throughput(engine, served, desc="engine on the HF requests")
    return {"hf": hf, "engine": mine, "ratio_output_tok_s": mine["output_tok_per_s"] / hf["output_tok_per_s"],
            "ratio_requests_s": mine["requests_per_s"] / hf["requests_per_s"]}


# -- command line ----------------------------------------------------------------------------------------


def add_model_args(ap: argparse.ArgumentParser) -> None:
    d = ModelSpec()
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--load-format", default=d.load_format, choices=["auto", "hf", "gguf", "dummy"])
    ap.add_argument("--dtype", default=d.dtype)
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    ap.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    return replace(ModelSpec(), model=args.model, load_format=args.load_format, dtype=args.dtype,
                   device=args.device, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   gpu_memory_utilization=args.gpu_memory_utilization)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=8, help="0 skips the HF baseline")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    return ap


def run_cli(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    tok, vocab, tok_name = workload_tokenizer(spec)
    wl = sharegpt_workload(tok, args.num_prompts, args.seed, ids_vocab=vocab, max_input_len=args.max_input_len,
                           max_output_len=args.max_output_len)
    engine = build_engine(spec, prefix_caching=False)
    result: dict[str, Any] = {"model": spec.describe(), "length_tokenizer": tok_name,
                              "offline": offline_throughput(engine, wl), "memory": memory_info(engine)}
    if args.hf_batch_size:
        result["hf_compare"] = compare_with_hf(spec, wl, args.hf_batch_size, lambda: engine)
    o = result["offline"]
    rows = ["| measure | value |", "|---|---|",
            f"| requests | {o['completed']} ({o['input_tokens']} in, {o['output_tokens']} out tokens) |",
            f"| requests/s | {o['requests_per_s']:.2f} |", f"| output tok/s | {o['output_tok_per_s']:.1f} |",
            f"| total tok/s | {o['total_tok_per_s']:.1f} |"]
    if "hf_compare" in result:
        c = result["hf_compare"]
        rows.append(f"| HF static batch {c['hf']['batch_size']}: output tok/s | {c['hf']['output_tok_per_s']:.1f}"
                    f" (engine {c['engine']['output_tok_per_s']:.1f}, {c['ratio_output_tok_s']:.2f}x) |")
    write_results(args.out, "throughput", result, "\n".join(rows))
    return 0


def main() -> None:
    raise SystemExit(run_cli(build_parser().parse_args()))


if __name__ == "__main__":
    main()
