"""Streaming detokenization: token ids in, text deltas out, at a cost per token independent of the
output length.

Invariants (for a stream that is complete once `flush()` has been called):
- a delta never ends inside a character: text whose tail may still be completed by later tokens (a
  UTF-8 sequence split across byte-level tokens, a run of byte-fallback tokens) is held back;
- with a byte-level tokenizer (ByteLevel decoder, e.g. GPT-2/Llama-3/SmolLM/Qwen vocabularies) the
  concatenated deltas equal `tokenizer.decode(output_ids, skip_special_tokens)` exactly, invalid bytes
  included;
- with any other decoder (SentencePiece-style) they equal it whenever the output is valid text, except
  that a leading space of the first output word is kept when the prompt gives it context (decode() of the
  output alone strips it, which would glue a completion to its prompt).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Literal, Protocol

from tokenmill.worker.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output by the windowed strategy, as vLLM does.
PROMPT_CONTEXT_TOKENS = 5
# The windowed strategy stops holding text back after this many tokens past the read offset: a
# character is at most 4 bytes, so such a tail is invalid, not incomplete.
MAX_HELD_TOKENS = 8
# Longest window of tokens that decode to nothing (skipped special tokens) kept as decoding context.
MAX_WINDOW_TOKENS = 32

Strategy = Literal["auto", "bytes", "window"]


class _Stream(Protocol):
    def push(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Turns the output ids of one request into text deltas; see the module invariants."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        *,
        strategy: Strategy = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._parts: list[str] = []
        self._num_tokens = 0
        self._stream = self._make_stream(tokenizer, prompt_token_ids, strategy)

    def _make_stream(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], strategy: Strategy) -> _Stream:
        table = tokenizer.token_bytes
        if strategy == "bytes" and table is None:
            raise ValueError("the 'bytes' strategy needs a byte-level tokenizer")
        skipped = tokenizer.all_special_ids if self.skip_special_tokens else frozenset()
        if table is not None and strategy != "window":
            return _ByteStream(table, skipped)
        return _WindowStream(tokenizer, prompt_ids, self.skip_special_tokens, skipped)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add output ids; return the text they complete (possibly "")."""
        self._num_tokens += len(new_ids)
        return self._record(self._stream.push(new_ids))

    def flush(self) -> str:
        """End of stream: return whatever was held back (normally "")."""
        return self._record(self._stream.flush())

    def _record(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta

    @property
    def output_text(self) -> str:
        """All text emitted so far (O(length) to build; stream the deltas instead where it matters)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_tokens(self) -> int:
        return self._num_tokens


class _ByteStream:
    """Byte-level decoders emit the lossy UTF-8 decoding of the concatenated token bytes, so an
    incremental UTF-8 decoder with the same replacement rule reproduces decode() exactly."""

    def __init__(self, table: Sequence[bytes], skipped: frozenset[int]) -> None:
        self._table = table
        self._skipped = skipped
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        table, size = self._table, len(self._table)
        # Unknown ids decode to nothing, as in tokenizers' decode().
        data = b"".join(table[i] for i in ids if 0 <= i < size and i not in self._skipped)
        return str(self._decoder.decode(data))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))


class _WindowStream:
    """vLLM-style: decode ids[prefix:read] and ids[prefix:]; the delta is what the new tokens add.

    Invariants: ids[prefix:read] was fully emitted and holds a token that decode() renders (so a
    leading-space strip hits the same token in both windows), unless the window grew past
    MAX_WINDOW_TOKENS or came from the prompt; ids[read:] is held back."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip: bool, skipped: frozenset[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip
        self._skipped = skipped
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        # One id at a time, so that the hold-back limit counts the tokens of one unfinished tail.
        deltas = []
        for i in ids:
            self._ids.append(i)
            deltas.append(self._advance(final=False))
        return "".join(deltas)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix:self._read], self._skip)
        full_text = decode(self._ids[self._prefix:], self._skip)
        held = len(self._ids) - self._read
        if not final and full_text.endswith("\ufffd") and held <= MAX_HELD_TOKENS:
            return ""
        self._move_window()
        return full_text[len(prefix_text):]

    def _move_window(self) -> None:
        emitted = self._ids[self._read:]
        renders = any(i not in self._skipped for i in emitted)
        if renders or self._read - self._prefix >= MAX_WINDOW_TOKENS:
            self._prefix = self._read
        self._read = len(self._ids)
        # Drop ids before the window so memory, like time, stays bounded per token.
        if self._prefix > 4 * MAX_WINDOW_TOKENS:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
