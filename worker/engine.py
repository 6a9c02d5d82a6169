"""The engine: requests in, token deltas out. schedule -> forward -> sample -> detokenize, one step at
a time, or with async scheduling one step ahead (the host schedules step N+1 while the device runs
step N). With speculative decoding, a proposer drafts tokens for the decoding requests before each
schedule and the step verifies them (worker/spec/). Structured outputs (worker/structured/) mask each
constrained request's next token by its grammar. Not thread-safe: one thread drives it (the worker
process's engine loop, or the caller)."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.protocol.wire import max_tokens_error
from tokenmill.worker.block_manager import BlockManager, prefix_hashes
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.detokenizer import IncrementalDetokenizer
from tokenmill.worker.generation_defaults import from_gguf_metadata, model_sampling_defaults
from tokenmill.worker.kv_transfer.blocks import dtype_name, gather_blocks, scatter_blocks
from tokenmill.worker.kv_transfer.frames import Geometry
from tokenmill.worker.loader import ModelLoadError, ModelSource, resolve_model
from tokenmill.worker.metrics import EngineCounters, EngineStats
from tokenmill.worker.model_runner import ModelRunner, PendingStep
from tokenmill.worker.outputs import CompletionOutput, RequestOutput, RequestTimeline, Usage
from tokenmill.worker.parallel.runner import make_model_runner
from tokenmill.worker.request import Request
from tokenmill.worker.scheduler import ScheduledBatch, Scheduler
from tokenmill.worker.spec.eagle_proposer import EagleProposer
from tokenmill.worker.spec.ngram import NgramProposer
from tokenmill.worker.spec.proposer import DraftProposer, draft_budget
from tokenmill.worker.spec.switch import SpeculationSwitch, measure_step_costs
from tokenmill.worker.structured.backend import GrammarBackend
from tokenmill.worker.structured.constraints import Constraints
from tokenmill.worker.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class StepRecord:
    """One launched step, as a step observer sees it: the scheduler's batch (read it before the observer
    returns: the engine updates its requests afterwards) and the host seconds `ModelRunner.launch` took to
    enqueue it (the device may still be running it)."""

    batch: ScheduledBatch
    launch_s: float


StepObserver = Callable[[StepRecord], None]


class _Launched(NamedTuple):
    batch: ScheduledBatch
    pending: PendingStep


@dataclass(eq=False)
class _Live:
    """Engine-side state of a request beside its scheduling state."""

    req: Request
    detok: IncrementalDetokenizer
    emitted: int = 0  # output tokens emitted so far (counting those an earlier attempt delivered)
    held: str = ""  # decoded text not yet emitted: it may be the start of a stop string
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # its timeline, time.monotonic(): queued (add_request), first in a launched step, first output token
    added: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    error: str | None = None  # why it finished with an error (a structured output's token refused)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.kind == "hf":
        assert source.path is not None
        if (source.path / "tokenizer.json").is_file():
            return Tokenizer.from_hf_folder(source.path)
        log.warning("%s has no tokenizer.json: using a byte-level tokenizer (token-id prompts work)", source.path)
    if source.kind == "gguf":
        assert source.gguf_metadata is not None
        return Tokenizer.from_gguf_metadata(source.gguf_metadata)
    return Tokenizer.byte_fallback(source.arch.vocab_size)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache with prefix caching and chunked prefill.

    `add_request` + `step` is the serving interface; `generate` (offline batch) and `stream` (one
    request) are built on it. `step_observer` (None by default), if set, is called with a StepRecord right
    after each launch (benchmarks use it to trace the steps)."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = replace(config or EngineConfig(), **overrides)
        self.config = config
        source = resolve_model(config.model, config.load_format)
        self.model_name = source.name
        # what the model ships as its sampling defaults (announced in READY; the gateway fills unset fields)
        self.sampling_defaults = (from_gguf_metadata(source.gguf_metadata) if source.gguf_metadata is not None
                                  else model_sampling_defaults(source.path, source.kind))
        self.tokenizer = load_tokenizer(source)
        arch = source.arch
        self.max_model_len = min(config.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        self.runner = make_model_runner(config, source, self.max_model_len)  # tensor-parallel ranks too
        self.eos_token_ids = tuple(arch.eos_token_ids or self.tokenizer.eos_token_ids)
        self.counters = EngineCounters()
        self.blocks = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching, self.counters)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len, self.eos_token_ids,
                                   self.counters)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self.proposer = make_proposer(config, self.runner, self.model_name)
        self.switch = make_switch(config, self.runner, self.proposer, self.max_model_len)
        self._inflight: deque[_Launched] = deque()  # launched, not yet completed; at most 1 kept between steps
        self._live: dict[str, _Live] = {}
        self.constraints = Constraints(self._grammar_backend)  # matchers of the live constrained requests
        self._pending: list[RequestOutput] = []  # outputs produced outside a step (aborts)
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self.step_observer: StepObserver | None = None
        log.info("engine ready: model=%s device=%s dtype=%s kv_blocks=%d x %d tokens, max_model_len=%d, "
                 "async_scheduling=%s, speculative=%s", self.model_name, self.runner.device, self.runner.dtype,
                 self.runner.num_blocks, config.cache.block_size, self.max_model_len, self.async_scheduling,
                 config.speculative.method)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        priority: int = 0,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request. Exactly one of prompt / prompt_token_ids / messages. `resume_token_ids` are
        output tokens an earlier attempt already delivered: they count toward max_tokens and the sampling
        positions continue after them. Raises InvalidRequest; nothing else is affected."""
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be SamplingParams or a mapping of its fields")
        ids = self._prompt_ids(prompt, prompt_token_ids, messages, _template_kwargs(params))
        resume = list(resume_token_ids)
        self._validate(ids, resume, params)
        if params.structured_output is not None:  # compiled (or refused) now: a bad schema fails here alone
            self.constraints.add(request_id, params.structured_output, resume)
        req = Request(request_id, ids, params,
                      seed=params.seed if params.seed is not None else self._seeds.getrandbits(62),
                      arrival_seq=next(self._arrivals), priority=int(priority), token_ids=ids + resume)
        # Replaying the delivered tokens leaves the detokenizer (a half UTF-8 character) and the
        # stop-string hold-back exactly where the earlier attempt left them, so no text is lost.
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        live = _Live(req, detok, emitted=len(resume), added=time.monotonic())
        if resume:
            delivered = detok.push(resume)
            keep = _stop_prefix_len(delivered, params.stop) if params.stop else 0
            live.held = delivered[len(delivered) - keep :] if keep else ""
        self._live[request_id] = live
        self.scheduler.add(req)

    @property
    def max_prompt_chars(self) -> int:
        """A text prompt (or chat contents) longer than this many characters cannot fit max_model_len: a
        bound checked before tokenizing (a token stands for at most max_chars_per_token characters)."""
        return self.max_model_len * self.tokenizer.max_chars_per_token

    def tokenize_prompt(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                        params: SamplingParams) -> list[int]:
        """The prompt ids add_request makes of a text `prompt` or of chat `messages` (exactly one given) for a
        request with `params`, computed without holding the GIL while the tokenizer runs: for a caller on
        another thread, so that the engine loop and the worker's heartbeats go on while a long prompt is
        tokenized."""
        return self._text_ids(prompt, messages, _template_kwargs(params), release_gil=True)

    def _text_ids(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None, release_gil: bool) -> list[int]:
        if messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_kwargs or {}))
            return self.tokenizer.encode(text, add_special_tokens=False, release_gil=release_gil)
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string")
        return self.tokenizer.encode(prompt, release_gil=release_gil)

    def _prompt_ids(self, prompt: str | None, token_ids: Sequence[int] | None,
                    messages: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
            raise InvalidRequest("give exactly one of prompt, prompt_token_ids or messages")
        if messages is not None or prompt is not None:
            return self._text_ids(prompt, messages, template_kwargs, release_gil=False)
        assert token_ids is not None
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise InvalidRequest("prompt_token_ids must be integers")
        return list(token_ids)

    def _validate(self, ids: list[int], resume: list[int], params: SamplingParams) -> None:
        vocab = self.runner.arch.vocab_size
        if not ids:
            raise InvalidRequest("the prompt is empty")
        bad = [t for t in ids + resume if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        unknown = [t for t in params.stop_token_ids if t >= vocab]
        if unknown:
            raise InvalidRequest(f"stop token id {unknown[0]} is not in the vocabulary (size {vocab})")
        if (why := max_tokens_error(params.max_tokens, self.max_model_len)) is not None:
            raise InvalidRequest(why)
        n = len(ids) + len(resume)
        if n >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len} tokens "
                "(at least one must be left to generate)")
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and n > sched.max_num_batched_tokens:
            raise InvalidRequest(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                                      f"{sched.max_num_batched_tokens}, and chunked prefill is off")
        if len(resume) >= params.max_tokens:
            raise InvalidRequest(f"{len(resume)} tokens already delivered, max_tokens is {params.max_tokens}")
        worst = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_for(worst) > self.blocks.num_blocks:
            raise InvalidRequest(
                f"the request needs up to {worst} tokens of KV cache but the cache holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}; lower max_tokens or the prompt")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks at once; its final output (finish_reason "abort")
        comes with the next `step()`. Returns False for an unknown or finished id."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self.constraints.discard(request_id)
        self.scheduler.finish(live.req, "abort")
        self._pending.append(self._final(live, [], "", live.req.num_output_tokens))
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request is live, an output is pending or a launched step is not completed."""
        return bool(self._live or self._pending or self._inflight)

    # -- the step -----------------------------------------------------------------------------------
    # Synchronous: schedule, launch, wait, update. Async scheduling keeps one step in flight: step()
    # schedules and launches step N+1 (with the tokens step N is sampling still in flight), then
    # waits for step N and emits its outputs while N+1 runs on the device. While a request speculates,
    # steps run synchronously: drafts follow known tokens only (the proposer reads them on the host). So do
    # they while a constrained request runs: its next token's mask is computed from its previous token.
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        speculating = self.proposer is not None and self._speculating()
        sync = speculating or self.constraints.any_running(self.scheduler.running)
        drafted = accepted = 0
        if sync:
            while self._inflight:
                outputs += self._complete(self._inflight.popleft())
        # A plain async step that completes nothing (the first after a synchronous one) is not timed for the switch.
        t0, completes = time.perf_counter(), sync or bool(self._inflight) or not self.async_scheduling
        if speculating:
            drafted, accepted = self._propose_drafts(), self.counters.accepted_draft_tokens
        launched = self._schedule_and_launch(outputs)
        # Read before the step completes: committing its tokens clears the drafts it verified.
        timed_batch = (len(launched.batch.requests) if self.switch is not None and completes and launched is not None
                       and _decode_only(launched.batch) else 0)
        if launched is not None:
            self._inflight.append(launched)
        sync = sync or self.constraints.any_running(self.scheduler.running)  # one admitted by this step
        keep = 1 if self.async_scheduling and launched is not None and not sync else 0
        while len(self._inflight) > keep:
            outputs += self._complete(self._inflight.popleft())
        if self.switch is not None:
            if drafted:
                self.switch.record(drafted, self.counters.accepted_draft_tokens - accepted)
            if timed_batch:
                self.switch.observe_step(timed_batch, speculating, time.perf_counter() - t0)
        return outputs

    def _num_drafts(self, params: SamplingParams) -> int:
        """Draft tokens a request verifies per step: none for a constrained one (its drafts would need masks
        of their own, one per draft position; it decodes plainly)."""
        if params.structured_output is not None:
            return 0
        k = params.num_speculative_tokens
        return self.config.speculative.num_speculative_tokens if k is None else k

    def _speculating(self) -> bool:
        if not any(self._num_drafts(r.params) for r in self.scheduler.running):
            return False
        return self.switch is None or self.switch.should_speculate(len(self.scheduler.running))

    def _propose_drafts(self) -> int:
        """Drafts for every decoding request that speculates, as many as its budget allows (none in flight).
        Returns how many requests got drafts."""
        assert self.proposer is not None and not self._inflight
        reqs, budgets = [], []
        for req in self.scheduler.running:
            req.draft_token_ids = []
            k = draft_budget(req, self._num_drafts(req.params), self.max_model_len)
            if k:
                reqs.append(req)
                budgets.append(k)
        if reqs:
            for req, k, drafts in zip(reqs, budgets, self.proposer.propose(reqs, budgets), strict=True):
                assert len(drafts) <= k, f"{self.proposer.name} proposed {len(drafts)} drafts, at most {k} asked"
                req.draft_token_ids = drafts
        return sum(bool(r.draft_token_ids) for r in reqs)

    def _keeps_features(self) -> bool:
        """Whether this step keeps target features for the proposer (the switch keeps none over most of a pause)."""
        if self.proposer is None or not self.proposer.wants_features:
            return False
        return self.switch is None or self.switch.keeps_features()

    def _feature_requests(self, batch: ScheduledBatch) -> list[int]:
        """The batch's requests whose target features the proposer reads: those that speculate."""
        return [i for i, r in enumerate(batch.requests) if self._num_drafts(r.params)]

    def _schedule_and_launch(self, outputs: list[RequestOutput]) -> _Launched | None:
        batch = self.scheduler.schedule()
        for req in batch.failed:
            live = self._live.pop(req.request_id)
            self.constraints.discard(req.request_id)
            outputs.append(self._final(live, [], "", req.num_output_tokens, error=str(req.stop_reason)))
        if not batch.requests:
            return None
        self._note_first_scheduled(batch)
        prev = self._inflight[-1].pending if self._inflight else None
        observer = self.step_observer
        keep = self._feature_requests(batch) if self._keeps_features() else ()
        bitmask = None
        if len(self.constraints):
            bitmask = self.constraints.step_bitmask([r for i, r in enumerate(batch.requests) if batch.samples(i)])
        if observer is None:
            pending = self.runner.launch(batch, self.eos_token_ids, prev, keep, bitmask)
        else:
            t0 = time.perf_counter()
            pending = self.runner.launch(batch, self.eos_token_ids, prev, keep, bitmask)
            observer(StepRecord(batch, time.perf_counter() - t0))
        if keep:
            assert self.proposer is not None and pending.features is not None
            reqs = [batch.requests[i] for i in keep]
            self.proposer.observe(reqs, [r.num_computed_tokens for r in reqs], pending.features,
                                  pending.feature_lens)
        self.scheduler.begin_step(batch)
        return _Launched(batch, pending)

    def _note_first_scheduled(self, batch: ScheduledBatch) -> None:
        """Stamp the requests this batch computes for the first time. The scheduler admits waiting requests after
        the running ones, and a request it had preempted (at the head of the queue) before those new to it, so the
        new ones are the batch's tail: walking back stops at the first request already stamped (O(new requests)).
        A new request of higher priority admitted ahead of a re-admitted one is missed; _final then takes its
        first token as its first step."""
        now = None
        for req in reversed(batch.requests):
            live = self._live[req.request_id]
            if live.first_scheduled is not None:
                break
            live.first_scheduled = now = now or time.monotonic()

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step, append its tokens to their requests and emit them."""
        result = launched.pending.result()
        batch = launched.batch
        if result.tree_paths:  # before commit: the accepted nodes' KV (and features) onto their tokens' slots
            self.runner.move_tree_kv(batch.requests, result.tree_paths)
            if self.proposer is not None:
                self.proposer.accept_paths(batch.requests, result.tree_paths)
        logprobs = dict(zip(batch.requests, result.logprobs))
        outputs = []
        constrained = len(self.constraints) > 0
        for req in self.scheduler.commit(batch, result.sampled):
            live = self._live[req.request_id]
            assert live.req is req, "a committed request is the live one (finished ones are skipped)"
            lp = logprobs[req]
            if lp is not None:  # one per token it got (a stop drops the tokens after it)
                live.logprobs += lp[: req.num_known_tokens - req.num_prompt_tokens - live.emitted]
            if constrained and not req.is_finished and req.request_id in self.constraints:
                self._advance_constraint(live)
            outputs.append(self._emit(live))
        return outputs

    def _advance_constraint(self, live: _Live) -> None:
        """Move a constrained request's matcher past its committed tokens: a complete constraint finishes it
        ("stop", as EOS would: nothing but EOS could follow, even before min_tokens), a refused token (sampled
        from an empty mask) with an error."""
        req = live.req
        verdict = self.constraints.advance(req.request_id, req.token_ids[req.num_prompt_tokens + live.emitted :])
        if verdict == "":
            self.scheduler.finish(req, "stop")
        elif verdict is not None:
            live.error = verdict
            self.scheduler.finish(req, "error", verdict)

    def _emit(self, live: _Live) -> RequestOutput:
        """The delta of the request's known output tokens not emitted yet (stop strings applied)."""
        req, first_index = live.req, live.emitted
        new_ids = req.token_ids[req.num_prompt_tokens + first_index :]
        if req.params.stop and len(new_ids) > 1:  # several tokens of a verified step: as plain decoding would
            text, stop = self._stop_scan(live, new_ids)
            new_ids = req.token_ids[req.num_prompt_tokens + first_index :]
        else:
            text, stop = self._push_text(live, new_ids, req.is_finished)
        live.emitted += len(new_ids)
        if new_ids and live.first_token is None:
            live.first_token = time.monotonic()
        if req.is_finished:
            self._live.pop(req.request_id)
            self.constraints.discard(req.request_id)
            if stop is None:
                text += live.detok.flush()
            return self._final(live, new_ids, text, first_index, live.error)
        logprobs, live.logprobs = live.logprobs or None, []
        return RequestOutput(req.request_id, new_ids, text, first_index, logprobs=logprobs)

    def _push_text(self, live: _Live, ids: list[int], finished: bool) -> tuple[str, tuple[int, str] | None]:
        """Text of `ids` after the held text, stop strings applied (unless the request finished on these ids):
        a stop string found finishes the request and cuts the text there; a tail that may start one is held."""
        req = live.req
        text = live.held + live.detok.push(ids)
        live.held = ""
        stop = self._find_stop(text, req.params.stop) if req.params.stop else None
        if stop is not None and not finished:
            cut, stop_str = stop
            self.scheduler.finish(req, "stop", stop_str)
            text = text[:cut]
        elif req.params.stop and not finished:
            keep = _stop_prefix_len(text, req.params.stop)
            text, live.held = text[: len(text) - keep], text[len(text) - keep :]
        return text, stop

    def _stop_scan(self, live: _Live, ids: list[int]) -> tuple[str, tuple[int, str] | None]:
        """`_push_text` one token at a time: a stop string completed by token j finishes the request there and
        drops the tokens after j (and their logprobs), exactly as one token per step would have. Only the last
        token may be one the scheduler finished the request on."""
        req = live.req
        finished_on_last = req.is_finished
        parts: list[str] = []
        stop = None
        for j, token in enumerate(ids):
            last = j == len(ids) - 1
            text, stop = self._push_text(live, [token], finished_on_last and last)
            parts.append(text)
            if stop is not None and not last:  # a stop string ended it at token j
                del req.token_ids[req.num_known_tokens - (len(ids) - 1 - j) :]
                del live.logprobs[j + 1 :]
                break
        return "".join(parts), stop

    @staticmethod
    def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
        hits = [(text.find(s), s) for s in stops if s in text]
        return min(hits) if hits else None

    def _final(self, live: _Live, new_ids: list[int], text: str, first_index: int,
               error: str | None = None) -> RequestOutput:
        req = live.req
        usage = Usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens)
        reason = "error" if error else req.finish_reason
        first = live.first_token if live.first_token is not None else time.monotonic()
        # not stamped (a priority admission behind a re-admitted request, see _note_first_scheduled): its first token
        scheduled = min(first, live.first_scheduled) if live.first_scheduled is not None else first
        timeline = RequestTimeline(live.added, scheduled, first)
        return RequestOutput(req.request_id, new_ids, text, first_index, finished=True,
                             finish_reason=reason,  # type: ignore[arg-type]
                             stop_reason=None if error else req.stop_reason, error=error,
                             logprobs=live.logprobs or None, usage=usage, timeline=timeline)

    def _grammar_backend(self) -> GrammarBackend:
        """The structured outputs' backend (made on the first constrained request): llguidance on the model
        tokenizer's tokenizer.json text and the logits' vocabulary."""
        try:
            from tokenmill.worker.structured.llguidance_backend import LLGuidanceBackend
        except ImportError:
            raise InvalidRequest("structured outputs need llguidance on the worker "
                                 "(pip install 'tokenmill[worker]')") from None
        return LLGuidanceBackend(self.tokenizer.backend.to_str(), self.runner.arch.vocab_size, self.eos_token_ids)

    # -- convenience ----------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run a batch of prompts (text or token ids) to completion; results in input order."""
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        results: dict[str, CompletionOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, plist):
            rid = f"gen-{next(self._ids)}"
            if isinstance(prompt, str):
                self.add_request(rid, prompt, params=p)
            else:
                self.add_request(rid, prompt_token_ids=prompt, params=p)
            order.append(rid)
            results[rid] = CompletionOutput(rid, self._live[rid].req.prompt_token_ids)
        while any(rid in self._live for rid in order):
            for out in self.step():
                if out.request_id in results:
                    _accumulate(results[out.request_id], out)
        return [results[rid] for rid in order]

    def stream(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
               messages: list[dict[str, Any]] | None = None) -> Iterator[RequestOutput]:
        """Yield one request's deltas as they are produced; the last one has finished=True."""
        rid = f"stream-{next(self._ids)}"
        if messages is not None:
            self.add_request(rid, messages=messages, params=params)
        elif isinstance(prompt, str):
            self.add_request(rid, prompt, params=params)
        else:
            self.add_request(rid, prompt_token_ids=prompt, params=params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort_request(rid)

    def close(self) -> None:
        """Stop what the engine started beside this process (tensor-parallel ranks); the engine is unusable
        afterwards. Also done at interpreter exit."""
        self.runner.close()

    # -- KV blocks handed between workers (disaggregated prefill and decode: worker/kv_transfer/) --------
    def request_token_ids(self, request_id: str) -> list[int]:
        """The known tokens (prompt, then output) of a live request."""
        return list(self._live[request_id].req.token_ids)

    def kv_geometry(self) -> Geometry:
        key = self.runner.kv_caches[0][0]  # [num_blocks, block_size, kv_heads, head_dim]
        return Geometry(len(self.runner.kv_caches), key.shape[2], key.shape[3], self.blocks.block_size,
                        dtype_name(key))

    def export_prefix_kv(self, token_ids: Sequence[int]) -> tuple[list[int], Any] | None:
        """The KV of the cached prefix of `token_ids` in whole blocks, never covering the last token (what a
        prefix hit of these tokens uses): (the token ids it covers, a host tensor [layers, 2, blocks,
        block_size, kv_heads, head_dim]), or None when no block of it is cached."""
        bs = self.blocks.block_size
        ids = self.blocks.cached_chain(prefix_hashes(token_ids[: len(token_ids) - 1], bs))
        if not ids:
            return None
        return list(token_ids[: len(ids) * bs]), gather_blocks(self.runner.kv_caches, ids)

    def import_prefix_kv(self, token_ids: Sequence[int], kv: Any) -> int:
        """Cache KV computed elsewhere for `token_ids` (whole blocks; `kv` as export_prefix_kv gives it), where
        a request with the same leading tokens finds it as a prefix hit. Returns how many blocks of the chain
        are cached now (fewer when the cache has no room; 0 with prefix caching off)."""
        if not self.blocks.enable_prefix_caching:
            return 0
        hashes = prefix_hashes(token_ids, self.blocks.block_size)
        fresh = self.blocks.import_chain(hashes)
        if fresh:
            rows = [i for i, _ in fresh]
            part = kv[:, :, : len(rows)] if rows == list(range(len(rows))) else kv[:, :, rows]
            scatter_blocks(self.runner.kv_caches, [b for _, b in fresh], part)
        return len(self.blocks.cached_chain(hashes))

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=b.num_free, num_cached_blocks=b.num_cached, num_total_blocks=b.num_blocks,
            block_size=b.block_size, prefix_cache_queries=self.counters.prefix_cache_queries,
            prefix_cache_hits=self.counters.prefix_cache_hits, num_preemptions=self.counters.preemptions,
        )


def make_proposer(config: EngineConfig, runner: ModelRunner, model_name: str) -> DraftProposer | None:
    spec = config.speculative
    if spec.tree_width > 1:
        check_tree_support(runner)
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.tree_width)
    if spec.method == "eagle":
        from tokenmill.worker.spec.eagle import EagleHeadError, head_folder

        try:
            lookup = (spec.eagle_lookup_min, spec.prompt_lookup_max) if spec.eagle_lookup_min else None
            proposer = EagleProposer(runner, head_folder(spec.draft_model, model_name), config.scheduler.max_num_seqs,
                                     spec.tree_width, lookup)
        except EagleHeadError as e:
            raise ModelLoadError(f"speculative eagle: {e}") from None
        if runner.device.type == "cuda":  # the head's Triton variants, built now rather than inside a step
            proposer.warm_up(spec.num_speculative_tokens)
            if runner.graphs is not None and spec.tree_width == 1:
                proposer.capture_graphs(spec.num_speculative_tokens)  # whole chain rounds (catch-up and steps)
        return proposer
    assert spec.method == "off", spec.method
    return None


def check_tree_support(runner: ModelRunner) -> None:
    """Tree drafts (speculative tree_width > 1) where they are built: ModelLoadError naming what is missing."""
    missing = []
    if runner.tp is not None:
        missing.append("tensor parallelism")
    if runner.arch.sliding_window is not None:
        missing.append("sliding-window attention")
    if missing:
        raise ModelLoadError("speculative tree drafts (tree_width > 1) are not built for " + ", ".join(missing))


def make_switch(config: EngineConfig, runner: ModelRunner, proposer: DraftProposer | None,
                max_model_len: int) -> SpeculationSwitch | None:
    """The automatic switch (worker/spec/switch.py), its costs measured now on the runner's device: a decode
    step and a verify step of k+1 tokens at batch sizes 1, 8, 32, ... up to max_num_seqs (or as many as one
    step's token budget verifies), after 512 tokens. Past the largest size measured, costs are extrapolated."""
    spec = config.speculative
    on = spec.auto_switch if spec.auto_switch is not None else runner.device.type == "cuda"
    if proposer is None or not on:
        return None
    k, most = spec.num_speculative_tokens, config.scheduler.max_num_seqs
    # A verify step the scheduler can run: b (k + 1) tokens within the step budget (the memory profiled).
    most = max(1, min(most, config.scheduler.max_num_batched_tokens // (k + 1)))
    sizes = sorted({b for b in (1, 8, 32, 128, 256) if b < most} | {most})
    context = max(1, min(512, max_model_len - k - 1))
    draft = proposer.draft_seconds if isinstance(proposer, EagleProposer) else None
    t0 = time.perf_counter()
    costs = measure_step_costs(runner, k, sizes, context,
                               None if draft is None else (lambda b: draft(b, k, context)))
    switch = SpeculationSwitch(costs, prior_tau=proposer.expected_tau(k))
    log.info("speculation switch: costs measured in %.1f s at batch sizes %s (decode %s s, verify %s s, draft %s s); "
             "at tau %.1f it stops paying at batch %s", time.perf_counter() - t0, sizes,
             _fmt(costs.decode_s), _fmt(costs.verify_s), _fmt(costs.draft_s), switch.tau,
             switch.breakeven_batch(most) or "never")
    return switch


def _decode_only(batch: ScheduledBatch) -> bool:
    """Every request of the batch computes one token after its known ones, plus its drafts (no prompt chunk)."""
    return all(n == 1 + len(r.draft_token_ids) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True))


def _fmt(seconds: Sequence[float]) -> str:
    return "/".join(f"{s:.4f}" for s in seconds)


def _template_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Extra chat-template variables of a request (`params.extra["chat_template_kwargs"]`, as the HTTP
    gateway passes vLLM's parameter of that name)."""
    kw = params.extra.get("chat_template_kwargs") or {}
    if not (isinstance(kw, dict) and all(isinstance(k, str) and k.isidentifier() for k in kw)):
        raise InvalidRequest("chat_template_kwargs must be a mapping of variable names to values")
    return kw


def _accumulate(acc: CompletionOutput, out: RequestOutput) -> None:
    acc.token_ids.extend(out.new_token_ids)
    acc.text += out.text_delta
    if out.logprobs:
        acc.logprobs = (acc.logprobs or []) + out.logprobs
    if out.finished:
        acc.finish_reason, acc.stop_reason = out.finish_reason, out.stop_reason
        acc.error, acc.usage = out.error, out.usage


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
