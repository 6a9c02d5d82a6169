"""A request's output constraint (structured outputs, "guided decoding"), validated at construction.

On the wire it is a mapping of exactly one kind to its value (vLLM's guided_* parameters, OpenAI's
response_format map onto these):

    {"json_schema": {...}}       output is JSON valid against the schema (a JSON object or a boolean, or
                                 its JSON text: what to_wire sends, so a deep schema meets no nesting limit)
    {"json_object": true}        output is one JSON object (any keys)
    {"regex": "..."}             output matches the regular expression (whole output)
    {"choice": ["a", "b"]}       output is exactly one of the strings
    {"grammar": "..."}           output is in the language of a Lark grammar (llguidance's dialect)

These checks are structural only (kind, types, sizes, JSON-serializable): whether a schema, a regex or a
grammar compiles is decided by the worker, which refuses the request alone (InvalidRequest) when it does
not. Torch-free and grammar-library-free, like all of protocol/."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.protocol.errors import InvalidRequest

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[StructuredKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, all choices together
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """`spec` is canonical text: a schema's compact JSON text (its keys in their order, which is the
    output's); the regex; the grammar; for choices, the tuple of strings; "" for json_object. Equal
    constraints have equal (kind, spec) (the worker's compiled-grammar cache key)."""

    kind: StructuredKind
    spec: str | tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            _check_choices(self.spec)
        elif not isinstance(self.spec, str):
            raise InvalidRequest(f"structured output {self.kind}: spec must be a string")
        elif self.kind in ("regex", "grammar") and not self.spec:
            raise InvalidRequest(f"structured output {self.kind} must be a non-empty string")
        size = sum(map(len, self.spec)) if isinstance(self.spec, tuple) else len(self.spec)
        if size > MAX_SPEC_CHARS:
            raise InvalidRequest(f"structured output {self.kind} is {size} characters, at most {MAX_SPEC_CHARS}")

    @property
    def schema(self) -> Any:
        """The JSON schema (json_schema only)."""
        assert self.kind == "json_schema" and isinstance(self.spec, str)
        return json.loads(self.spec)

    def to_wire(self) -> dict[str, Any]:
        if self.kind == "json_object":
            return {"json_object": True}
        return {self.kind: list(self.spec) if isinstance(self.spec, tuple) else self.spec}

    @classmethod
    def from_wire(cls, value: object) -> StructuredOutput:
        """From untrusted wire data: a mapping of exactly one kind to its value."""
        if isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, dict) or len(value) != 1:
            raise InvalidRequest(f"structured_output must be a mapping of exactly one of {list(KINDS)} to its value")
        ((kind, v),) = value.items()
        if kind == "json_schema":
            return cls("json_schema", schema_text(_parsed(v) if isinstance(v, str) else v))
        if kind == "json_object":
            if v is not True:
                raise InvalidRequest("structured output json_object must be true")
            return cls("json_object", "")
        if kind == "choice":
            if not isinstance(v, list | tuple):
                raise InvalidRequest("structured output choice must be a list of strings")
            return cls("choice", tuple(v))
        if kind in ("regex", "grammar"):
            return cls(kind, v)
        raise InvalidRequest(f"structured output kind must be one of {list(KINDS)}, got {kind!r}")


def schema_text(schema: object) -> str:
    """The compact JSON text of a JSON schema (an object or a boolean); InvalidRequest otherwise."""
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(f"a JSON schema must be a JSON object (or a boolean), got {type(schema).__name__}")
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidRequest(f"the JSON schema is not JSON-serializable: {e}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"the JSON schema is {len(text)} characters of JSON, at most {MAX_SPEC_CHARS}")
    return text


def _parsed(text: str) -> Any:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"the JSON schema is {len(text)} characters of JSON, at most {MAX_SPEC_CHARS}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"the JSON schema's text is not JSON: {e}") from None


def _check_choices(choices: object) -> None:
    if not (isinstance(choices, tuple) and 0 < len(choices) <= MAX_CHOICES
            and all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequest(f"structured output choice must be 1 to {MAX_CHOICES} non-empty strings")
