"""What a worker does with a prompt before the engine sees it: refuse one that cannot fit, cheaply, and
tokenize a long one off the engine loop.

A prompt costs the worker before it is ever scheduled: tokenizing a few MB of text takes seconds, and a
tokenizer that holds the GIL for that long starves the IO thread's heartbeats, so the broker declares the
worker dead and migrates the prompt to the next victim. So:
- the worker refuses a prompt that cannot fit `max_model_len` from its length alone, before any
  tokenizing (protocol RequestInput.fit_error: token ids by count, text by characters against
  `max_prompt_chars`, since no token stands for more characters than that bound assumes; the broker
  applies the same rule before dispatch);
- `TokenizerThread` tokenizes a long text prompt on its own thread with the GIL released, handing the ids
  to the engine loop through its inbound queue, so the loop keeps stepping the other requests and the IO
  thread keeps heartbeating meanwhile. Short prompts are tokenized inline as before (a thread hop would
  only add latency).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.protocol import wire as p

log = structlog.get_logger("tokenmill.worker")

# Text prompts of more characters than this are tokenized on the TokenizerThread; shorter ones inline,
# where even the worst case (no whitespace: a token per character or two) holds the loop for tens of ms,
# well inside a heartbeat interval.
INLINE_TOKENIZE_CHARS = 32_768


@dataclass(frozen=True)
class Tokenized:
    """Inbound-queue item: the TokenizerThread's result for engine request `rid` (ids, or the error)."""

    rid: str
    generation: int  # the loop's reset count when it was asked: a result from before a reset is stale
    ids: list[int] | None
    error: Exception | None


class TokenizerThread(threading.Thread):
    """Tokenizes text prompts one at a time, in order, with `tokenize(prompt, messages, params)` (which must
    not hold the GIL while it works: LLMEngine.tokenize_prompt), and hands each result to `deliver`."""

    def __init__(self, tokenize: Callable[[str | None, list[dict[str, Any]] | None, SamplingParams], list[int]],
                 deliver: Callable[[Tokenized], None]) -> None:
        super().__init__(name="tokenmill-worker-tokenizer", daemon=True)
        self._tokenize, self._deliver = tokenize, deliver
        self._jobs: queue.Queue[tuple[str, int, p.RequestInput, SamplingParams] | None] = queue.Queue()

    def submit(self, rid: str, generation: int, inp: p.RequestInput, params: SamplingParams) -> None:
        if not self.is_alive():
            self.start()
        self._jobs.put((rid, generation, inp, params))

    def stop(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            rid, generation, inp, params = job
            try:
                ids: list[int] | None = self._tokenize(inp.prompt, inp.messages, params)
                error: Exception | None = None
            except (InvalidRequest, ValueError, TypeError) as e:
                ids, error = None, e
            except Exception as e:  # not the request's fault: it fails alone, and the log says why
                log.exception("tokenizer_error", request=rid)
                ids, error = None, e
            self._deliver(Tokenized(rid, generation, ids, error))
