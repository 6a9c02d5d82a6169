"""The JSON of OpenAI answers: whole completions and chat completions, their streamed chunks (server-sent
events, `data: {...}` lines ending with `data: [DONE]`), usage and logprobs.

Tokens are shown from the bytes the worker sends with each logprob (decoded as UTF-8 with replacement
for a token that is part of a character); the gateway has no tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.client import StreamEvent, Usage

DONE_LINE = "data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


# ---- logprobs --------------------------------------------------------------------------------------


def token_str(token_id: int, raw: bytes | None) -> str:
    """How a token is shown: its bytes as text, or `token_id:N` when the worker sent no bytes."""
    return raw.decode("utf-8", errors="replace") if raw is not None else f"token_id:{token_id}"


@dataclass
class TokenLogprobs:
    """One output token's logprob and its top alternatives (id, logprob, bytes), best first."""

    token_id: int
    logprob: float
    raw: bytes | None
    top: list[tuple[int, float, bytes | None]]


def event_logprobs(ev: StreamEvent, k: int) -> list[TokenLogprobs]:
    """The event's tokens with their top-`k` alternatives (k = 0: the sampled token alone)."""
    if ev.logprobs is None:
        return []
    out = []
    for j, tid in enumerate(ev.token_ids):
        lps = ev.logprobs[j] if j < len(ev.logprobs) else {}
        raws = ev.token_bytes[j] if ev.token_bytes is not None and j < len(ev.token_bytes) else {}
        lp = lps.get(tid, float("-inf"))
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:k] if k > 0 else [(tid, lp)]
        out.append(TokenLogprobs(tid, lp, raws.get(tid), [(t, v, raws.get(t)) for t, v in ranked]))
    return out


def _finite(x: float) -> float:
    return x if x != float("-inf") else -9999.0  # JSON has no -Infinity; OpenAI clients expect numbers


def chat_logprobs(tokens: list[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(tid: int, lp: float, raw: bytes | None) -> dict[str, Any]:
        return {"token": token_str(tid, raw), "logprob": _finite(lp), "bytes": list(raw) if raw is not None else None}

    return {"content": [{**one(t.token_id, t.logprob, t.raw), "top_logprobs": [one(*x) for x in t.top]}
                        for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprobs], offset: int) -> dict[str, Any]:
    """OpenAI completions shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset
    (`offset`: characters of text before the first token)."""
    strs = [token_str(t.token_id, t.raw) for t in tokens]
    offsets = []
    for s in strs:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": strs, "token_logprobs": [_finite(t.logprob) for t in tokens],
            "top_logprobs": [{token_str(tid, raw): _finite(lp) for tid, lp, raw in t.top} for t in tokens],
            "text_offset": offsets}


# ---- usage -----------------------------------------------------------------------------------------


def usage_json(per_prompt: dict[int, list[Usage]]) -> dict[str, Any]:
    """Usage of a request: each prompt counted once (its choices share it; cached tokens: the fewest any
    of its choices had), completion tokens summed over every choice."""
    prompt = cached = completion = 0
    for usages in per_prompt.values():
        prompt += max(u.prompt_tokens for u in usages)
        cached += min(u.cached_tokens for u in usages)
        completion += sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- whole answers ---------------------------------------------------------------------------------


@dataclass
class ChoiceResult:
    """A choice accumulated from its events."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None

    def add(self, ev: StreamEvent, k: int | None) -> None:
        self.text += ev.text
        if k is not None:
            self.logprobs.extend(event_logprobs(ev, k))
        if ev.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.usage = ev.finish_reason, ev.stop_reason, ev.usage


def completion_json(rid: str, created: int, model: str, choices: list[ChoiceResult], usage: dict[str, Any],
                    logprobs: bool, echo_prefix: dict[int, str]) -> dict[str, Any]:
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        prefix = echo_prefix.get(c.index, "")
        out.append({"index": c.index, "text": prefix + c.text,
                    "logprobs": completion_logprobs(c.logprobs, len(prefix)) if logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage}


def chat_json(rid: str, created: int, model: str, choices: list[ChoiceResult], usage: dict[str, Any],
              logprobs: bool) -> dict[str, Any]:
    out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
           for c in sorted(choices, key=lambda c: c.index)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage}


# ---- streamed chunks -------------------------------------------------------------------------------


class ChunkWriter:
    """The SSE lines of one streamed answer (`chat`: chat.completion.chunk, else text_completion).

    A plain text delta (the common case, once per choice per engine step) is the cached text around the
    choice's index plus the JSON of the text; everything else builds the whole object."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = {"id": rid, "object": self.obj, "created": created, "model": model}
        self.include_usage = include_usage
        self._plain: dict[int, tuple[str, str]] = {}

    def _chunk(self, choice: dict[str, Any]) -> str:
        body = {**self.head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def _choice(self, index: int, text: str | None, logprobs: Any, finish: str | None,
                stop_reason: str | int | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": stop_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}

    def start(self, index: int) -> str:
        """The chat's first chunk of a choice: the assistant role."""
        return self._chunk(self._choice(index, None, None, None, None, role=True))

    def text(self, index: int, text: str, logprobs: Any = None) -> str:
        if logprobs is not None:
            return self._chunk(self._choice(index, text, logprobs, None, None))
        parts = self._plain.get(index)
        if parts is None:
            marker = "\x00TEXT\x00"
            line = self._chunk(self._choice(index, marker, None, None, None))
            before, _, after = line.partition(_dumps(marker))
            parts = self._plain[index] = (before, after)
        return parts[0] + _dumps(text) + parts[1]

    def finish(self, index: int, reason: str | None, stop_reason: str | int | None) -> str:
        return self._chunk(self._choice(index, None if self.chat else "", None, reason, stop_reason))

    def usage(self, usage: dict[str, Any]) -> str:
        return sse({**self.head, "choices": [], "usage": usage})

    def error(self, err: dict[str, Any]) -> str:
        return sse(err)
