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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tokenmill.benchmarks.common import (
    RequestTiming,
    dist,
    latency_summary,
    peak_rss_bytes,
    throughput_summary,
    write_results,
)
from tokenmill.benchmarks.workloads import BenchRequest, Workload, length_tokenizer, sharegpt_workload
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine, StepObserver, StepRecord
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
    whole_step_graphs: bool = EngineConfig.whole_step_graphs  # mixed steps of <= 2,048 tokens: one graph
    threads: int = 0  # torch CPU threads (0: torch's default); the worker process gets the same
    async_scheduling: bool | None = None  # None: the engine's default (on for CUDA only)
    quantization: str = "auto"  # EngineConfig.quantization: auto, int8, int4, fp8
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: auto, fp8
    speculative: str = "off"  # SpeculativeConfig.method: off, ngram, eagle (the head shipped for the model)

    @property
    def dummy(self) -> bool:
        return self.load_format == "dummy"

    def engine_config(self, prefix_caching: bool = True) -> EngineConfig:
        return EngineConfig(
            model=self.model, load_format=self.load_format, dtype=self.dtype, device=self.device,  # type: ignore[arg-type]
            max_model_len=self.max_model_len, cuda_graphs=self.cuda_graphs, async_scheduling=self.async_scheduling,
            whole_step_graphs=self.whole_step_graphs,
            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
            speculative=SpeculativeConfig(method=self.speculative),  # type: ignore[arg-type]
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
    """Bytes of the weights (the target's parameters, plus an EAGLE draft head's own: `draft_weights_bytes`)
    and of the KV cache."""
    r = engine.runner
    draft = sum(_param_bytes(m) for m in [getattr(engine.proposer, "head", None)] if m is not None)
    info: dict[str, Any] = {"weights_bytes": _param_bytes(r.model) + draft, "draft_weights_bytes": draft,
                            "kv_blocks": r.num_blocks, "block_size": r.block_size,
                            "kv_bytes_per_block": r.bytes_per_block, "kv_bytes": r.num_blocks * r.bytes_per_block}
    info.update(peak_memory(r.device.type))
    return info


def _param_bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def peak_memory(device_type: str) -> dict[str, int]:
    if device_type == "cuda":
        import torch

        return {"peak_device_bytes": int(torch.cuda.max_memory_allocated())}
    return {"peak_rss_bytes": peak_rss_bytes()}


# -- driving the engine ------------------------------------------------------------------------------------


Composition = tuple[int, int]  # (prompt tokens computed, decodes) of one scheduled batch
_NONE: Composition = (0, 0)


@dataclass
class StepTrace:
    """What each `engine.step()` call of a run did, and where every request's first token came from.

    Calls are numbered from 1. `launched[k]` is the batch call k scheduled and launched, `completed[k]`
    the batch whose tokens call k returned: the same batch without async scheduling, the one launched
    in the call before with it (one step stays in flight). A request added after call k returned and
    whose first token came back from call f waited f - k calls; their wall times add up to its TTFT,
    less the driver's own work between calls."""

    async_scheduling: bool
    wall: list[float] = field(default_factory=list)  # seconds of each call
    launched: list[Composition] = field(default_factory=list)
    completed: list[Composition] = field(default_factory=list)
    added: dict[int, int] = field(default_factory=dict)  # request -> calls done when it was added
    first_scheduled: dict[int, int] = field(default_factory=dict)  # request -> call that first scheduled it
    first_token: dict[int, int] = field(default_factory=dict)  # request -> call that returned its first token
    prefill_chunks: dict[int, int] = field(default_factory=dict)  # request -> steps that computed its prompt
    _in_flight: Composition | None = None
    _launch: Composition | None = None

    @property
    def calls(self) -> int:
        return len(self.wall)

    def on_step(self, record: StepRecord) -> None:
        """The step the call in progress launched (the engine's step observer, see `observing`)."""
        batch = record.batch
        prompt = decodes = 0
        call = self.calls + 1
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                decodes += 1
                continue
            prompt += n
            if req.request_id.startswith("b"):
                i = int(req.request_id[1:])
                self.first_scheduled.setdefault(i, call)
                self.prefill_chunks[i] = self.prefill_chunks.get(i, 0) + 1
        self._launch = (prompt, decodes)

    def on_call(self, seconds: float) -> None:
        """A step() call has returned after `seconds`."""
        launch, self._launch = self._launch, None
        self.wall.append(seconds)
        self.launched.append(launch or _NONE)
        if not self.async_scheduling:
            done = launch
        else:  # a launch keeps one step in flight; without one the engine drains it
            done, self._in_flight = self._in_flight, launch
        self.completed.append(done or _NONE)

    def path(self, i: int) -> list[dict[str, Any]]:
        """The calls from request i's arrival to its first token: wall ms and what was launched/completed."""
        return [{"call": k, "ms": self.wall[k - 1] * 1e3, "launched": self.launched[k - 1],
                 "completed": self.completed[k - 1]} for k in range(self.added[i] + 1, self.first_token[i] + 1)]

    def first_token_summary(self, ttft: dict[int, float]) -> dict[str, Any]:
        """Steps (calls) to the first token, how many waited in the queue or were chunked, the wall time of
        the calls on the way (vs TTFT), and the whole path of the requests at the TTFT p50 and p90."""
        got = [i for i in self.first_token if i in self.added]
        if not got:
            return {}
        steps = [float(self.first_token[i] - self.added[i]) for i in got]
        path_s = [sum(self.wall[self.added[i]:self.first_token[i]]) for i in got]
        by_ttft = sorted((i for i in got if i in ttft), key=lambda i: ttft[i])
        examples = {}
        for q in (50, 90):
            if by_ttft:
                i = by_ttft[(len(by_ttft) - 1) * q // 100]  # the rank at or below the percentile
                examples[f"p{q}"] = {"request": i, "ttft_ms": ttft[i] * 1e3, "calls": self.path(i)}
        return {"steps": dist(steps, 1.0) | {"max": max(steps)},
                "not_scheduled_next_step": sum(self.first_scheduled.get(i, 0) > self.added[i] + 1 for i in got),
                "prefill_in_several_chunks": sum(self.prefill_chunks.get(i, 0) > 1 for i in got),
                "calls_ms": dist(path_s), "examples": examples}

    def step_summary(self) -> dict[str, Any]:
        """Wall time of the calls by what they did: decode-only calls (nothing with prompt tokens launched
        or returned), calls that launched prompt tokens and calls that returned them (the same calls
        without async scheduling; with it, the launching call pays the host work of the step and the
        returning one waits for the device to finish it)."""
        calls = list(zip(self.wall, self.launched, self.completed))
        decode = [w for w, la, co in calls if la[0] == 0 and co[0] == 0 and (la[1] or co[1])]
        launching = [w for w, la, _ in calls if la[0] > 0]
        returning = [w for w, _, co in calls if co[0] > 0]
        return {"calls": self.calls, "async_scheduling": self.async_scheduling, "decode_only": len(decode),
                "with_prompt_tokens": len(launching), "decode_only_ms": dist(decode),
                "launching_prompt_tokens_ms": dist(launching), "returning_prompt_tokens_ms": dist(returning),
                "prompt_tokens_per_step": dist([float(la[0]) for la in self.launched if la[0] > 0], 1.0),
                "decodes_per_step": dist([float(la[1]) for la in self.launched if la[1] > 0], 1.0)}


@contextmanager
def observing(engine: LLMEngine, observer: StepObserver) -> Iterator[None]:
    """Make `observer` the engine's step observer for the block (the previous one is restored)."""
    previous, engine.step_observer = engine.step_observer, observer
    try:
        yield
    finally:
        engine.step_observer = previous


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
    trace: StepTrace | None = None

    def summary(self, bytes_per_block: int) -> dict[str, Any]:
        out = {**throughput_summary(self.timings, self.duration_s), "latency": latency_summary(self.timings),
               "steps": self.steps, "peak_kv_blocks": self.peak_kv_blocks,
               "peak_kv_bytes": self.peak_kv_blocks * bytes_per_block, "preemptions": self.preemptions,
               "prefix_hit_blocks": self.prefix_hit_blocks, "prefix_query_blocks": self.prefix_query_blocks,
               "cached_prompt_tokens": sum(t.cached_tokens for t in self.timings)}
        if self.trace is not None:
            ttft = {i: t.ttft for i, t in zip(self.sent, self.timings) if t.ok}
            out |= {"first_token": self.trace.first_token_summary(ttft), "step_ms": self.trace.step_summary()}
        return out


class _Releaser:
    """Decides when each request is sent: all at once (or at most `window` unfinished at a time), in
    static batches of `batch_size` (the next batch when the previous one has finished), or turn by turn
    within a session (turn t+1 after turn t), with at most `sessions` conversations open at once (None:
    all). `ramp` opens those sessions one per engine step instead of all at the start."""

    def __init__(self, reqs: tuple[BenchRequest, ...], batch_size: int | None, sessions: int | None, *,
                 window: int | None = None, ramp: bool = False) -> None:
        self.reqs, self.batch_size, self.window, self.ramp = reqs, batch_size, window, ramp
        self.next_batch = 0
        self.in_batch = 0
        self.turns: dict[int, deque[int]] = {}  # session -> its request indices in turn order
        for i, r in enumerate(reqs):
            if r.session >= 0:
                self.turns.setdefault(r.session, deque()).append(i)
        self.unopened = deque(self.turns)
        self.limit = sessions or len(self.unopened)
        self.open = 0  # sessions opened and not finished
        self.single = deque(i for i, r in enumerate(reqs) if r.session < 0)  # independent requests not sent

    def initial(self) -> list[int]:
        if self.batch_size:
            return self._batch()
        first = self._singles(self.window or len(self.single))
        return first + self._open_sessions(1 if self.ramp else self.limit)

    def on_step(self) -> list[int]:
        """After every engine step: the next session while ramping up."""
        return self._open_sessions(1) if self.ramp else []

    def on_finish(self, i: int) -> list[int]:
        if self.batch_size:
            self.in_batch -= 1
            return self._batch() if self.in_batch == 0 else []
        session = self.reqs[i].session
        if session < 0:
            return self._singles(1) if self.window else []
        if self.turns[session]:
            return [self.turns[session].popleft()]
        self.open -= 1
        return self._open_sessions(1)

    def _singles(self, n: int) -> list[int]:
        return [self.single.popleft() for _ in range(min(n, len(self.single)))]

    def _open_sessions(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self.unopened and self.open < self.limit:
            self.open += 1
            out.append(self.turns[self.unopened.popleft()].popleft())
        return out

    def _batch(self) -> list[int]:
        start = self.next_batch
        self.next_batch = min(start + (self.batch_size or 0), len(self.reqs))
        self.in_batch = self.next_batch - start
        return list(range(start, self.next_batch))


def drive(engine: LLMEngine, workload: Workload, *, batch_size: int | None = None, sessions: int | None = None,
          window: int | None = None, ramp: bool = False, desc: str = "engine",
          deadline: float | None = None) -> EngineRun:
    """Run `workload` through `engine` (greedy, ignore_eos, each request's own output length), timing
    every request from the moment it is added (see `_Releaser` for when that is; in static batches
    from the start, when they all arrived). Past `deadline` (time.monotonic) no new request is sent,
    nor one that would not finish by then at the longest end-to-end time seen so far; those in flight
    finish and only the sent ones are reported. Every step is traced (`StepTrace`)."""
    reqs = workload.requests
    rel = _Releaser(reqs, batch_size, sessions, window=window, ramp=ramp)
    timings: list[RequestTiming | None] = [None] * len(reqs)
    trace = StepTrace(engine.async_scheduling)
    counters0 = replace(engine.counters)
    peak, longest = 0, 0.0  # longest: hand-over to finish, the most any request took so far
    handed: dict[int, float] = {}
    start = time.perf_counter()

    def send(indices: list[int]) -> None:
        if deadline is not None and time.monotonic() + longest >= deadline:
            return
        for i in indices:
            r = reqs[i]
            handed[i] = time.perf_counter()
            # Static batches: every request arrived at the start and waits for its batch.
            timings[i] = RequestTiming(start if batch_size else handed[i], r.prompt_len)
            trace.added[i] = trace.calls
            engine.add_request(f"b{i}", prompt_token_ids=list(r.prompt_ids),
                               params=SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))

    send(rel.initial())
    with tqdm(total=len(reqs), desc=desc, unit="req", leave=False) as bar, observing(engine, trace.on_step):
        while engine.has_unfinished_requests():
            before = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            trace.on_call(now - before)
            peak = max(peak, engine.blocks.num_in_use)
            for out in outs:
                i = int(out.request_id[1:])
                t = timings[i]
                assert t is not None
                if out.new_token_ids and not t.chunk_times:
                    trace.first_token[i] = trace.calls
                t.on_tokens(now, len(out.new_token_ids))
                if out.finished:
                    t.done, t.error = now, out.error
                    t.cached_tokens = out.usage.cached_tokens if out.usage else 0
                    longest = max(longest, now - handed[i])
                    bar.update(1)
                    send(rel.on_finish(i))
            send(rel.on_step())
    duration = time.perf_counter() - start
    sent = [i for i, t in enumerate(timings) if t is not None]
    return EngineRun([t for t in timings if t is not None], sent, duration, trace.calls, peak,
                     engine.counters.preemptions - counters0.preemptions,
                     engine.counters.prefix_cache_hits - counters0.prefix_cache_hits,
                     engine.counters.prefix_cache_queries - counters0.prefix_cache_queries, trace)


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
    ap.add_argument("--dtype", default="auto", help="auto: the engine's choice (bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--device", default="auto", help="auto: the engine's choice (cuda where there is one, else cpu)")
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    ap.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    ap.add_argument("--quantization", default=d.quantization, choices=["auto", "int8", "int4", "fp8"],
                    help="decoder-layer weights (auto: the checkpoint's own; else quantized on load)")
    ap.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "fp8"],
                    help="auto: the model dtype; fp8: e4m3 (an FP8 GPU)")
    ap.add_argument("--speculative", default=d.speculative, choices=["off", "ngram", "eagle"],
                    help="speculative decoding: n-gram prompt lookup or the EAGLE head shipped for the model")
    ap.add_argument("--async-scheduling", type=int, choices=[0, 1], default=None,
                    help="force async scheduling off (0) or on (1; e.g. on CPU to count the steps a GPU takes)")


def resolved_device(device: str, dtype: str) -> tuple[str, str]:
    """The engine's choice for "auto" (as the model runner makes it), so results name what ran."""
    from tokenmill.worker.model_runner import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return dev.type if device == "auto" else device, str(resolve_dtype(dtype, dev)).removeprefix("torch.")


def where_it_runs(spec: ModelSpec) -> str:
    weights = "dummy weights" if spec.dummy else "weights"
    return f"{spec.model} ({weights}) on {spec.device}, {spec.dtype}"


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    device, dtype = resolved_device(args.device, args.dtype)
    return replace(ModelSpec(), model=args.model, load_format=args.load_format, dtype=dtype,
                   device=device, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
                   kv_cache_dtype=args.kv_cache_dtype, speculative=args.speculative,
                   async_scheduling=None if args.async_scheduling is None else bool(args.async_scheduling))


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
    print(f"bench throughput: {where_it_runs(spec)}, in this process", flush=True)
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
