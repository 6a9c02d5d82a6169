"""Request bodies of the OpenAI endpoints (pydantic models; FastAPI shows them in /docs) and their
translation into tokenmill sampling parameters.

Parameters follow vLLM's OpenAI server: the OpenAI ones plus top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, skip_special_tokens and chat_template_kwargs. Structured outputs:
OpenAI's response_format (json_object, json_schema), vLLM's guided_json, guided_regex, guided_choice and
guided_grammar (a Lark grammar) and its newer structured_outputs object, on both endpoints, at most one per
request. Fields OpenAI defines that
tokenmill cannot honour (logit_bias, suffix, tools, images) are refused with 400 rather than silently
ignored; unknown fields are ignored, as vLLM does."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.gateway.errors import APIError
from tokenmill.protocol import InvalidRequest
from tokenmill.protocol.structured import StructuredOutput

MAX_TOKEN_ID = (1 << 31) - 1
MAX_COUNT = 1 << 31  # bound on every count, so any accepted value fits the wire (msgpack integers)
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Seed = Annotated[int, Field(ge=0, lt=1 << 63)]


class StreamOptions(BaseModel):
    """`include_usage`: one last chunk (with empty `choices`) carries the request's usage."""

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema the output must satisfy (`strict` is accepted: the
    output is always held to the schema)."""

    model_config = ConfigDict(extra="allow")

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`{"type": "text"}` (no constraint), `{"type": "json_object"}` (one JSON object) or
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}`."""

    model_config = ConfigDict(extra="allow")

    type: str
    json_schema: JsonSchemaFormat | None = None

    def wire(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            return {"json_schema": self.json_schema.schema_}
        raise APIError(400, f"response_format type {self.type!r} is not supported "
                       "(text, json_object or json_schema)", param="response_format")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` body field: one of json (a schema or its text), regex, choice, grammar,
    json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def wire(self) -> dict[str, Any]:
        given = {k: v for k, v in (("json_schema", self.json_), ("regex", self.regex), ("choice", self.choice),
                                   ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if v is not None}
        if len(given) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, json_object",
                           param="structured_outputs")
        if self.json_ is not None:
            return {"json_schema": _schema(self.json_, "structured_outputs")}
        return given


class _Sampling(BaseModel):
    """The sampling parameters both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=512, description="a model name from GET /v1/models")
    n: int = Field(1, ge=1, le=MAX_COUNT, description="choices to generate (one job each)")
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0: greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_COUNT, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: Seed | None = Field(None, description="choice i samples with seed + i: the same request repeats exactly")
    stop: str | list[str] | None = Field(None, description="strings that end a choice (not included in it)")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_COUNT)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = Field(None, description="vLLM: a JSON schema (or its text)")
    guided_regex: str | None = Field(None, description="vLLM: a regular expression the output matches")
    guided_choice: list[str] | None = Field(None, description="vLLM: the output is one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM: a Lark grammar of the output")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM: one of json, regex, choice, "
                                                         "grammar, json_object")

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 1024 or not all(stops):
            raise APIError(400, "stop: at most 1024 non-empty strings", param="stop")
        return stops

    def check_common(self, max_n: int) -> None:
        """400 for what tokenmill refuses rather than ignores."""
        if self.n > max_n:
            raise APIError(400, f"n must be at most {max_n}", param="n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (give n alone)", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        self.structured_output()

    def structured_output(self) -> dict[str, Any] | None:
        """The wire's structured_output of the request (protocol/structured.py), or None; 400 for more than one
        constraint or a malformed one. Whether a schema, regex or grammar compiles the worker decides (400 too)."""
        given = {name: value for name, value in (
            ("response_format", self.response_format.wire() if self.response_format is not None else None),
            ("guided_json", None if self.guided_json is None else {"json_schema": _schema(self.guided_json)}),
            ("structured_outputs", None if self.structured_outputs is None else self.structured_outputs.wire()),
            ("guided_regex", None if self.guided_regex is None else {"regex": self.guided_regex}),
            ("guided_choice", None if self.guided_choice is None else {"choice": self.guided_choice}),
            ("guided_grammar", None if self.guided_grammar is None else {"grammar": self.guided_grammar}),
        ) if value is not None}
        if len(given) > 1:
            raise APIError(400, f"give at most one structured output constraint, got {sorted(given)}",
                           param=sorted(given)[1])
        if not given:
            return None
        ((param, wire),) = given.items()
        try:
            return StructuredOutput.from_wire(wire).to_wire()
        except InvalidRequest as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """The wire's sampling parameters (tokenmill.protocol.SamplingParams fields; defaults left out).
        The broker validates them again and answers InvalidRequest (-> 400) for a bad combination."""
        out: dict[str, Any] = {"max_tokens": max_tokens}
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value)
        if self.top_k is not None and self.top_k > 0:
            out["top_k"] = self.top_k
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        stops = self.stop_list()
        if stops:
            out["stop"] = stops
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        if (constraint := self.structured_output()) is not None:
            out["structured_output"] = constraint
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions: text (or token ids) in, text out."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists (one prompt each)")
    max_tokens: int | None = Field(16, ge=1, le=MAX_COUNT)
    logprobs: int | None = Field(None, ge=0, le=20, description="top logprobs per token (0: the sampled one)")
    echo: bool = Field(False, description="put the prompt in front of each choice's text")
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)  # type: ignore[arg-type]
        raise APIError(400, "prompt: mix of strings and token ids", param="prompt")

    def check(self, max_n: int) -> None:
        self.check_common(max_n)
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.echo and any(not isinstance(p, str) for p in self.prompts()):
            raise APIError(400, "echo needs text prompts (the gateway has no tokenizer to show token ids)",
                           param="echo")


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat turn. `content` is a string or a list of text parts (joined with newlines). Tool turns and
    assistant turns that carry tool calls are passed to the chat template with their text only."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"] | str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{index}]: only text content parts are supported, got {part.type!r}",
                               param="messages")
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages in, an assistant message out (rendered by the model's chat
    template on the worker)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="default: what the model's context leaves")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT,
                                              description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def wire_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def check(self, max_n: int) -> None:
        self.check_common(max_n)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.tools and self.tool_choice != "none":
            raise APIError(400, "tools are not supported (tool calls are not parsed; a JSON schema in "
                           "response_format constrains the output instead)", param="tools")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _schema(value: dict[str, Any] | bool | str, param: str = "guided_json") -> dict[str, Any] | bool:
    """A schema parameter's schema: a JSON object, a boolean, or the JSON text of one (as vLLM accepts)."""
    if not isinstance(value, str):
        return value
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise APIError(400, f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise APIError(400, f"{param} must be a JSON schema (an object)", param=param)
    return schema  # type: ignore[no-any-return]
