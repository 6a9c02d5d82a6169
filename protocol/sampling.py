"""Per-request sampling parameters, validated at construction (bad values fail the request alone).

The broker checks a SUBMIT's params with these rules before queueing it, and the worker builds its
sampler from them, so both sides accept exactly the same set."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.protocol.errors import InvalidRequest
from tokenmill.protocol.structured import StructuredOutput

MAX_SPECULATIVE_TOKENS = 16  # draft tokens one request may verify per step


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token (0: only the sampled token's)
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding on a worker that has a proposer: draft tokens per step (0: off for this request;
    # None: the worker's setting). Output is the same either way; a worker without a proposer decodes plainly.
    num_speculative_tokens: int | None = None
    # Constrained decoding (protocol/structured.py); on the wire a mapping such as {"json_schema": {...}},
    # left out when None (so a peer that predates it reads the same params). Such a request never speculates.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.structured_output is not None:
            object.__setattr__(self, "structured_output", StructuredOutput.from_wire(self.structured_output))
        # Lists from JSON/msgpack are accepted and frozen into tuples.
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, int, "stop_token_ids"))
        _check(_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be an integer >= 1")
        _check(_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens must be an integer in [0, max_tokens]")
        _check(_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]")
        _check(_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0 (0 disables)")
        _check(_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _check(_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _check(_num(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty must be > 0")
        _check(_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty must be in [-2, 2]")
        _check(_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty must be in [-2, 2]")
        _check(self.seed is None or (_int(self.seed) and 0 <= self.seed < 2**63),
               "seed must be an integer in [0, 2**63)")
        _check(all(s for s in self.stop), "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(type(self.ignore_eos) is bool, "ignore_eos must be a boolean")
        _check(type(self.skip_special_tokens) is bool, "skip_special_tokens must be a boolean")
        _check(isinstance(self.extra, dict), "extra must be a mapping")
        _check(self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs must be an integer in [0, 20]")
        _check_speculative(self.num_speculative_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        if self.structured_output is None:
            del d["structured_output"]
        else:
            d["structured_output"] = self.structured_output.to_wire()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from untrusted wire data; unknown keys are an error, not silently dropped."""
        if not isinstance(d, dict):
            raise InvalidRequest("sampling params must be a mapping")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise InvalidRequest(str(e)) from None


def _int(x: object) -> bool:
    """An integer that is not a boolean (booleans are never integers here, as on the wire)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_speculative(k: object) -> None:
    _check(k is None or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_SPECULATIVE_TOKENS),
           f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0: no speculation)")


def _num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # rejects NaN


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise InvalidRequest(msg)


def _as_tuple(v: object, typ: type, name: str) -> tuple:
    if isinstance(v, typ):
        v = (v,)
    if not isinstance(v, list | tuple) or not all(isinstance(x, typ) and not isinstance(x, bool) for x in v):
        raise InvalidRequest(f"{name} must be a list of {typ.__name__}")
    return tuple(v)
