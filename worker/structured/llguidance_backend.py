"""The grammar backend on llguidance (https://github.com/guidance-ai/llguidance): its LLTokenizer is built
from the model's tokenizer.json text, each distinct constraint is compiled once into a pristine LLMatcher
(an LRU cache keyed by (kind, spec)) and every request gets a deep copy of it.

JSON schemas are compiled with the separators ", " and ": " and no other whitespace: the JSON a chat model
writes anyway, and a small model cannot fill an object with whitespace forever (a schema's "x-guidance"
options override this)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np
import torch
from torch import Tensor

from tokenmill.protocol.errors import InvalidRequest
from tokenmill.protocol.structured import StructuredOutput
from tokenmill.worker.structured.backend import GrammarMatcher
from tokenmill.worker.structured.bitmask import bitmask_words

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                               "key_separator": ": "}
COMPILED_CACHE_SIZE = 128  # distinct constraints kept compiled


def grammar_text(constraint: StructuredOutput) -> str:
    """llguidance's grammar text of a constraint (not yet checked: LLMatcher does)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        assert isinstance(spec, str)
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        assert isinstance(spec, str)
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so json.dumps quotes any string exactly.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    assert kind == "grammar" and isinstance(spec, str), kind
    return llguidance.LLMatcher.grammar_from_lark(spec)


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.llmatcher = matcher

    def advance(self, token: int) -> bool:
        return self.llmatcher.consume_token(token)

    def is_finished(self) -> bool:
        return self.llmatcher.is_stopped()

    @property
    def error(self) -> str:
        return first_line(self.llmatcher.get_error())


class LLGuidanceBackend:
    """`tokenizer_json`: the model tokenizer's tokenizer.json text; `vocab_size`: the logits' width (the
    mask covers it; ids past the tokenizer's vocabulary are never allowed)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 num_threads: int = 2) -> None:
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                     eos_token=list(eos_token_ids))
        except (ValueError, RuntimeError) as e:
            raise InvalidRequest(f"structured outputs are unavailable: llguidance cannot use this model's "
                                 f"tokenizer ({e})") from None
        self._vocab_size = vocab_size
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # errors name the cause, not the state
        self._compiled: OrderedDict[tuple[str, str | tuple[str, ...]], llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor(num_threads=num_threads)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def matcher(self, constraint: StructuredOutput) -> LLGuidanceMatcher:
        key = (constraint.kind, constraint.spec)
        pristine = self._compiled.get(key)
        if pristine is None:
            pristine = self._compile(constraint)
            self._compiled[key] = pristine
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return LLGuidanceMatcher(pristine.deep_copy())

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(constraint)
        except ValueError as e:
            raise InvalidRequest(f"structured output {constraint.kind}: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise InvalidRequest(f"structured output {constraint.kind} does not compile: "
                                 f"{first_line(matcher.get_error())}")
        return matcher

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher]) -> Tensor:
        bits = np.full((len(matchers), bitmask_words(self._vocab_size)), -1, dtype=np.int32)  # [N, W]
        rows = []
        for i, m in enumerate(matchers):
            assert isinstance(m, LLGuidanceMatcher), "a matcher of this backend"
            rows.append((m.llmatcher, i))
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, bits)
        return torch.from_numpy(bits)


def first_line(message: str, limit: int = 500) -> str:
    return message.strip().split("\n", 1)[0][:limit]
