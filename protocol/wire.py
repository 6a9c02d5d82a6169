"""tokenmill wire protocol: the message types and their one encode/decode pair, shared by the client SDK, the
broker and the worker.

Every message is a ZeroMQ multipart message of exactly three frames:

    [HEADER (b"TM2"), command (1 byte), body (msgpack)]

A ROUTER socket prepends the peer's routing id, which the broker strips before decoding. Bodies are
msgpack maps (control messages) or arrays of arrays (the per-step TOKENS batches and STREAM relays, where
positional encoding keeps per-token overhead low). Decoding is strict: a wrong header, an unknown or
unexpected command, a body over the size limit, bad msgpack, a wrong type, an out-of-range number or a
nesting deeper than the limit all raise `ProtocolError`; nothing is ever unpickled or evaluated.

docs/protocol.md describes each message; this module is the executable definition.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, NamedTuple, TypeVar

import msgpack

from tokenmill.protocol.errors import ProtocolError

HEADER = b"TM2"  # version 2: TOKENS bodies are [attempts, entries] (was one 6-item array per chunk)
PROTOCOL_VERSION = 2

# Hard limits on what a decoder accepts. Sockets get MAXMSGSIZE = 2 * MAX_BODY_BYTES so that a frame
# between the two is still delivered, dropped and counted here rather than silently cutting the peer off.
MAX_BODY_BYTES = 16 << 20
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 1024
MAX_DEPTH = 16  # free-form values (sampling params, stats) nest at most this deep
MAX_ID_LEN = 128  # job ids, owner tokens, worker names
MAX_TOKEN_ID = (1 << 31) - 1
MAX_ATTEMPT = 1 << 16
MAX_MESSAGES = 4096  # chat turns in one request
MAX_TOKEN_BYTES = 256  # bytes of one token in a logprobs entry
# The roles a chat message may have (OpenAI's, plus Llama 3's "ipython" for tool output).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "ipython"})

# A worker's role (Ready.role): "both" runs whole jobs; with disaggregated serving the broker sends a new job's
# prompt to a "prefill" worker, which hands its KV blocks to the "decode" worker that streams the tokens.
WORKER_ROLES = ("both", "prefill", "decode")

# Ready.sampling_defaults: the fields a model's generation config may default, with their ranges (ints for
# max_tokens and top_k, numbers otherwise); a value outside fails the READY as malformed.
SAMPLING_DEFAULT_FIELDS: dict[str, tuple[type, float, float]] = {
    "max_tokens": (int, 1, 1 << 24), "temperature": (float, 0.0, 100.0), "top_p": (float, 1e-9, 1.0),
    "top_k": (int, 0, 1 << 24), "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 1e-9, 100.0)}

FINISH_REASONS = frozenset({"stop", "length", "abort", "error"})

# Codes of a FAIL reply; each maps to one exception class of tokenmill.protocol.errors.
FAIL_CODES = frozenset(
    {"overloaded", "deadline", "cancelled", "invalid", "failed", "forbidden", "unknown_job", "unavailable",
     "protocol", "conflict"}
)


class Cmd(IntEnum):
    """Command byte of the second frame. The high nibble names the direction."""

    # client -> broker
    SUBMIT = 0x01
    CANCEL = 0x02
    SUBSCRIBE = 0x03
    PING = 0x04
    BYE = 0x05
    STATS = 0x06
    # broker -> client
    ACK = 0x11
    STREAM = 0x12
    DONE = 0x13
    FAIL = 0x14
    PONG = 0x15
    STATS_REPLY = 0x16
    # worker -> broker
    W_READY = 0x21
    W_HEARTBEAT = 0x22
    W_TOKENS = 0x23
    W_FINISHED = 0x24
    W_ERROR = 0x25
    W_DISCONNECT = 0x26
    W_PREFILLED = 0x27
    # broker -> worker
    B_SUBMIT = 0x31
    B_CANCEL = 0x32
    B_HEARTBEAT = 0x33
    B_DISCONNECT = 0x34
    B_KV_LOST = 0x35


CLIENT_TO_BROKER = frozenset({Cmd.SUBMIT, Cmd.CANCEL, Cmd.SUBSCRIBE, Cmd.PING, Cmd.BYE, Cmd.STATS})
BROKER_TO_CLIENT = frozenset({Cmd.ACK, Cmd.STREAM, Cmd.DONE, Cmd.FAIL, Cmd.PONG, Cmd.STATS_REPLY})
WORKER_TO_BROKER = frozenset(
    {Cmd.W_READY, Cmd.W_HEARTBEAT, Cmd.W_TOKENS, Cmd.W_FINISHED, Cmd.W_ERROR, Cmd.W_DISCONNECT, Cmd.W_PREFILLED}
)
BROKER_TO_WORKER = frozenset({Cmd.B_SUBMIT, Cmd.B_CANCEL, Cmd.B_HEARTBEAT, Cmd.B_DISCONNECT, Cmd.B_KV_LOST})


# ----------------------------------------------------------------------------------------------------
# Field validators: each returns the value (possibly normalised) or raises ProtocolError.


def _fail(msg: str) -> ProtocolError:
    return ProtocolError(msg)


def _map(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(f"{name}: expected a map, got {type(v).__name__}")
    return v


def _str(v: Any, name: str, max_len: int = MAX_BODY_BYTES, min_len: int = 0) -> str:
    if not isinstance(v, str):
        raise _fail(f"{name}: expected a string, got {type(v).__name__}")
    if not min_len <= len(v) <= max_len:
        raise _fail(f"{name}: length {len(v)} outside [{min_len}, {max_len}]")
    return v


def _ident(v: Any, name: str) -> str:
    s = _str(v, name, MAX_ID_LEN, 1)
    if not s.isprintable():
        raise _fail(f"{name}: must be printable")
    return s


def _int(v: Any, name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if type(v) is not int:
        raise _fail(f"{name}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _fail(f"{name}: {v} outside [{lo}, {hi}]")
    return v


def _float(v: Any, name: str, lo: float = 0.0, hi: float = 1e9) -> float:
    if type(v) not in (int, float):
        raise _fail(f"{name}: expected a number, got {type(v).__name__}")
    f = float(v)
    if not (math.isfinite(f) and lo <= f <= hi):
        raise _fail(f"{name}: {v} outside [{lo}, {hi}]")
    return f


def _opt_float(v: Any, name: str, lo: float = 0.0, hi: float = 1e9) -> float | None:
    return None if v is None else _float(v, name, lo, hi)


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise _fail(f"{name}: expected a boolean, got {type(v).__name__}")
    return v


def _token_ids(v: Any, name: str) -> list[int]:
    if not isinstance(v, list):
        raise _fail(f"{name}: expected a list of token ids")
    # One pass over C-level builtins keeps this cheap on the TOKENS hot path.
    if v and (not all(type(t) is int for t in v) or min(v) < 0 or max(v) > MAX_TOKEN_ID):
        raise _fail(f"{name}: token ids must be integers in [0, {MAX_TOKEN_ID}]")
    return v


def valid_token_ids(v: Any) -> bool:
    """True for a list of valid token ids (the hot path's check; _token_ids explains failures)."""
    if type(v) is not list:
        return False
    if len(v) == 1:
        t = v[0]
        return type(t) is int and 0 <= t <= MAX_TOKEN_ID
    return not v or (all(type(t) is int for t in v) and min(v) >= 0 and max(v) <= MAX_TOKEN_ID)


def plain_entry(job_id: Any, seq: Any, token_ids: Any, text: Any, logprobs: Any) -> bool:
    """True for the fields of a STREAM entry [job_id, seq, token_ids, text, logprobs] in the common plain shape
    (no logprobs) that the strict validators accept as they are: the hot paths' check."""
    return (type(job_id) is str and 0 < len(job_id) <= MAX_ID_LEN and type(seq) is int and 0 <= seq < 1 << 63
            and type(text) is str and logprobs is None and valid_token_ids(token_ids))


def _list(v: Any, name: str, max_len: int = MAX_ARRAY_LEN) -> list[Any]:
    if not isinstance(v, list):
        raise _fail(f"{name}: expected a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise _fail(f"{name}: {len(v)} items, at most {max_len}")
    return v


def check_depth(v: Any, name: str, limit: int = MAX_DEPTH) -> None:
    """Raise ProtocolError if containers in `v` nest deeper than `limit` (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(v, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise _fail(f"{name}: nested deeper than {limit}")
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


_SCALARS = (type(None), bool, int, float, str)


def _params(v: Any, name: str = "params") -> dict[str, Any]:
    """Sampling params: a map of str keys to scalars, lists of scalars, or (for `extra`) a nested map.
    The semantic check is SamplingParams.from_dict at the broker and the worker."""
    d = _map(v, name)
    if len(d) > 64:
        raise _fail(f"{name}: too many keys")
    for k, x in d.items():
        _str(k, f"{name} key", 64, 1)
        if isinstance(x, list):
            if len(x) > 1024 or not all(isinstance(e, _SCALARS) for e in x):
                raise _fail(f"{name}.{k}: a list of at most 1024 scalars expected")
        elif isinstance(x, dict):
            check_depth(x, f"{name}.{k}", 8)
        elif not isinstance(x, _SCALARS):
            raise _fail(f"{name}.{k}: unsupported type {type(x).__name__}")
    return d


def _chat_messages(v: Any, name: str = "messages") -> list[dict[str, str]]:
    msgs = _list(v, name, MAX_MESSAGES)
    if not msgs:
        raise _fail(f"{name}: empty")
    out = []
    for i, m in enumerate(msgs):
        m = _map(m, f"{name}[{i}]")
        if set(m) != {"role", "content"}:
            raise _fail(f"{name}[{i}]: exactly the keys 'role' and 'content' are allowed")
        role = _str(m["role"], f"{name}[{i}].role", 64, 1)
        if role not in CHAT_ROLES:
            raise _fail(f"{name}[{i}].role: {role[:64]!r} is not one of {sorted(CHAT_ROLES)}")
        out.append({"role": role, "content": _str(m["content"], f"{name}[{i}].content")})
    return out


def _logprobs(v: Any, name: str, n_tokens: int) -> list[list[list[Any]]] | None:
    """Per token a list of [token_id, logprob] pairs (sampled token first); msgpack map keys must be
    strings, so {id: logprob} travels as pairs. A worker may add each token's bytes as a third item,
    [token_id, logprob, [byte, ...]], so that a client without the tokenizer can show the token."""
    if v is None:
        return None
    per_tok = _list(v, name)
    if len(per_tok) != n_tokens:
        raise _fail(f"{name}: {len(per_tok)} entries for {n_tokens} tokens")
    for pairs in per_tok:
        for p in _list(pairs, name, 64):
            if not (isinstance(p, list) and len(p) in (2, 3)):
                raise _fail(f"{name}: entries must be [token_id, logprob] or [token_id, logprob, bytes] items")
            _int(p[0], f"{name} token id", 0, MAX_TOKEN_ID)
            if type(p[1]) not in (int, float):
                raise _fail(f"{name}: logprob must be a number")
            if len(p) == 3:
                _token_bytes(p[2], f"{name} token bytes")
    return per_tok


def _token_bytes(v: Any, name: str) -> list[int]:
    """A token's bytes as a list of ints (msgpack bin is not accepted on the wire)."""
    b = _list(v, name, MAX_TOKEN_BYTES)
    if not all(type(x) is int and 0 <= x <= 255 for x in b):
        raise _fail(f"{name}: expected a list of byte values 0..255")
    return b


def _keys(d: dict[str, Any], name: str, required: Sequence[str], optional: Sequence[str] = ()) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise _fail(f"{name}: missing {missing}")
    extra = set(d) - set(required) - set(optional)
    if extra:
        raise _fail(f"{name}: unknown keys {sorted(map(str, extra))}")


def _tuple(v: Any, name: str, n: int) -> list[Any]:
    if not isinstance(v, list) or len(v) != n:
        raise _fail(f"{name}: expected an array of {n} items")
    return v


def max_tokens_error(max_tokens: int, max_model_len: int) -> str | None:
    """Why `max_tokens` output tokens can never fit a context of `max_model_len` (the prompt takes at least
    one), or None."""
    if max_tokens >= max_model_len:
        return (f"max_tokens={max_tokens} can never be reached: the model's context is {max_model_len} tokens, "
                "prompt included")
    return None


@dataclass(frozen=True, slots=True)
class RequestInput:
    """What to generate from: exactly one of a prompt string, chat messages, or prompt token ids."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        if given != 1:
            raise ProtocolError("exactly one of prompt, messages, prompt_token_ids must be given")

    def to_wire(self, d: dict[str, Any]) -> None:
        if self.prompt is not None:
            d["prompt"] = self.prompt
        elif self.messages is not None:
            d["messages"] = self.messages
        else:
            d["prompt_token_ids"] = self.prompt_token_ids

    @staticmethod
    def from_wire(d: dict[str, Any]) -> RequestInput:
        prompt = _str(d["prompt"], "prompt") if "prompt" in d else None
        messages = _chat_messages(d["messages"]) if "messages" in d else None
        ids = _token_ids(d["prompt_token_ids"], "prompt_token_ids") if "prompt_token_ids" in d else None
        return RequestInput(prompt, messages, ids)

    def text_chars(self) -> int:
        """Characters of text to tokenize (the prompt, or every message's content); 0 for token ids. What a
        prompt-length bound (Ready.max_prompt_chars) is checked against; O(1) for a prompt."""
        if self.prompt is not None:
            return len(self.prompt)
        if self.messages is not None:
            return sum(len(m["content"]) for m in self.messages)
        return 0

    def fit_error(self, max_model_len: int, max_prompt_chars: int = 0, max_tokens: int | None = None) -> str | None:
        """Why this input (with `max_tokens`, if given) can never run on a worker of context `max_model_len`
        whose text bound is `max_prompt_chars` (0: none; Ready.max_prompt_chars), judged from lengths
        alone (O(1) for a prompt or token ids: no tokenizing); None when it may fit. The one rule the
        broker (before dispatch) and the worker (before tokenizing) apply."""
        if max_tokens is not None and (why := max_tokens_error(max_tokens, max_model_len)) is not None:
            return why
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) >= max_model_len:
            return (f"the prompt has {len(self.prompt_token_ids)} tokens but the model's context is "
                    f"{max_model_len} tokens (at least one must be left to generate)")
        chars = self.text_chars()
        if max_prompt_chars and chars > max_prompt_chars:
            return (f"the prompt has {chars} characters; no prompt over {max_prompt_chars} characters fits "
                    f"the model's context of {max_model_len} tokens")
        return None

    def affinity_text(self) -> str:
        """A string whose leading chunks identify the request's prefix (used for cache affinity)."""
        if self.prompt is not None:
            return self.prompt
        if self.messages is not None:
            return "".join(f"<{m['role']}>{m['content']}" for m in self.messages)
        assert self.prompt_token_ids is not None
        return ",".join(map(str, self.prompt_token_ids))


_INPUT_KEYS = ("prompt", "messages", "prompt_token_ids")


# ----------------------------------------------------------------------------------------------------
# Messages. Each has CMD, to_wire() -> msgpack-able object, and from_wire(obj) -> instance (strict).

M = TypeVar("M", bound="Message")


class Message:
    """Base of all protocol messages."""

    CMD: ClassVar[Cmd]

    def to_wire(self) -> Any:
        raise NotImplementedError

    @classmethod
    def from_wire(cls: type[M], obj: Any) -> M:
        raise NotImplementedError


# ---- client -> broker ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submit(Message):
    """Start a job (idempotent by job_id: a repeat from the same owner re-subscribes from `from_seq`).

    `timeout` is seconds from arrival at the broker to the job's deadline (None: the broker's default).
    `owner` identifies who may cancel or subscribe when CURVE is off (with CURVE, the client key does).
    `cancel_on_disconnect`: cancel the job when the submitting connection goes away."""

    CMD: ClassVar[Cmd] = Cmd.SUBMIT
    job_id: str
    model: str
    input: RequestInput
    params: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    priority: int = 0
    owner: str = ""
    from_seq: int = 0
    cancel_on_disconnect: bool = True

    def to_wire(self) -> Any:
        d: dict[str, Any] = {"job_id": self.job_id, "model": self.model, "params": self.params,
                             "timeout": self.timeout, "priority": self.priority, "owner": self.owner,
                             "from_seq": self.from_seq, "cancel_on_disconnect": self.cancel_on_disconnect}
        self.input.to_wire(d)
        return d

    @classmethod
    def from_wire(cls, obj: Any) -> Submit:
        d = _map(obj, "submit")
        _keys(d, "submit", ("job_id", "model", "params"),
              ("timeout", "priority", "owner", "from_seq", "cancel_on_disconnect", *_INPUT_KEYS))
        return cls(
            job_id=_ident(d["job_id"], "job_id"),
            model=_str(d["model"], "model", 512),
            input=RequestInput.from_wire(d),
            params=_params(d["params"]),
            timeout=_opt_float(d.get("timeout"), "timeout", 0.0, 7 * 86400.0),
            priority=_int(d.get("priority", 0), "priority", -(1 << 31), 1 << 31),
            owner=_str(d.get("owner", ""), "owner", MAX_ID_LEN),
            from_seq=_int(d.get("from_seq", 0), "from_seq"),
            cancel_on_disconnect=_bool(d.get("cancel_on_disconnect", True), "cancel_on_disconnect"),
        )


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Cancel a job; allowed for its owner only (unless the broker runs with open jobs)."""

    CMD: ClassVar[Cmd] = Cmd.CANCEL
    job_id: str
    owner: str = ""

    def to_wire(self) -> Any:
        return {"job_id": self.job_id, "owner": self.owner}

    @classmethod
    def from_wire(cls, obj: Any) -> Cancel:
        d = _map(obj, "cancel")
        _keys(d, "cancel", ("job_id",), ("owner",))
        return cls(_ident(d["job_id"], "job_id"), _str(d.get("owner", ""), "owner", MAX_ID_LEN))


@dataclass(frozen=True, slots=True)
class Subscribe(Message):
    """Receive a job's tokens from sequence number `from_seq` (replayed from the broker's token log)."""

    CMD: ClassVar[Cmd] = Cmd.SUBSCRIBE
    job_id: str
    owner: str = ""
    from_seq: int = 0

    def to_wire(self) -> Any:
        return {"job_id": self.job_id, "owner": self.owner, "from_seq": self.from_seq}

    @classmethod
    def from_wire(cls, obj: Any) -> Subscribe:
        d = _map(obj, "subscribe")
        _keys(d, "subscribe", ("job_id",), ("owner", "from_seq"))
        return cls(_ident(d["job_id"], "job_id"), _str(d.get("owner", ""), "owner", MAX_ID_LEN),
                   _int(d.get("from_seq", 0), "from_seq"))


@dataclass(frozen=True, slots=True)
class _Empty(Message):
    def to_wire(self) -> Any:
        return {}

    @classmethod
    def from_wire(cls: type[M], obj: Any) -> M:
        d = _map(obj, cls.__name__.lower())
        _keys(d, cls.__name__.lower(), ())
        return cls()


@dataclass(frozen=True, slots=True)
class Ping(_Empty):
    """Client liveness; the broker answers PONG. Sent while the client has jobs open."""

    CMD: ClassVar[Cmd] = Cmd.PING


@dataclass(frozen=True, slots=True)
class Bye(_Empty):
    """The client is closing: cancel its cancel-on-disconnect jobs and drop its subscriptions."""

    CMD: ClassVar[Cmd] = Cmd.BYE


@dataclass(frozen=True, slots=True)
class StatsRequest(_Empty):
    """Ask the broker for its counters, queues and workers."""

    CMD: ClassVar[Cmd] = Cmd.STATS


# ---- broker -> client ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ack(Message):
    """A SUBMIT was accepted (queued or running); `duplicate` when the job id was already known.
    `instance`: the id of the broker instance that holds the job ("" from a broker that sends none)."""

    CMD: ClassVar[Cmd] = Cmd.ACK
    job_id: str
    duplicate: bool = False
    instance: str = ""

    def to_wire(self) -> Any:
        d: dict[str, Any] = {"job_id": self.job_id, "duplicate": self.duplicate}
        if self.instance:
            d["instance"] = self.instance
        return d

    @classmethod
    def from_wire(cls, obj: Any) -> Ack:
        d = _map(obj, "ack")
        _keys(d, "ack", ("job_id",), ("duplicate", "instance"))
        return cls(_ident(d["job_id"], "job_id"), _bool(d.get("duplicate", False), "duplicate"),
                   _instance(d))


class StreamChunk(NamedTuple):
    """Tokens of one job: token_ids[0] is output position `seq`; chunks of a job are gap-free."""

    job_id: str
    seq: int
    token_ids: list[int]
    text: str
    logprobs: list[list[list[Any]]] | None = None

    def to_wire(self) -> list[Any]:
        return [self.job_id, self.seq, self.token_ids, self.text, self.logprobs]

    @staticmethod
    def from_wire(obj: Any) -> StreamChunk:
        if type(obj) is list and len(obj) == 5 and plain_entry(*obj):
            return StreamChunk(*obj)
        job_id, seq, ids, text, lps = _tuple(obj, "stream chunk", 5)
        ids = _token_ids(ids, "token_ids")
        return StreamChunk(_ident(job_id, "job_id"), _int(seq, "seq"), ids, _str(text, "text"),
                           _logprobs(lps, "logprobs", len(ids)))


@dataclass(frozen=True, slots=True)
class Stream(Message):
    """Token chunks for one client, possibly of several jobs, in sequence order per job."""

    CMD: ClassVar[Cmd] = Cmd.STREAM
    chunks: list[StreamChunk]

    def to_wire(self) -> Any:
        return [c.to_wire() for c in self.chunks]

    @classmethod
    def from_wire(cls, obj: Any) -> Stream:
        return cls([StreamChunk.from_wire(c) for c in _list(obj, "stream")])


def _usage(v: Any, name: str = "usage") -> tuple[int, int, int]:
    p, c, k = _tuple(v, name, 3)
    return (_int(p, f"{name}.prompt_tokens"), _int(c, f"{name}.completion_tokens"),
            _int(k, f"{name}.cached_tokens"))


class WorkerTimeline(NamedTuple):
    """Where a job's first token came from on the worker, in seconds since the worker received the job
    (its own clock): `admitted` when the engine took it (after tokenizing), `first_scheduled` when a step
    first computed its tokens, `first_token` when its first output token left the engine. Each is >= the one
    before (a job that never got a token has first_token = its finish)."""

    admitted: float
    first_scheduled: float
    first_token: float

    def to_wire(self) -> list[float]:
        return [self.admitted, self.first_scheduled, self.first_token]

    @staticmethod
    def from_wire(v: Any, name: str = "timeline") -> WorkerTimeline:
        a, s, t = (_float(x, f"{name}[{i}]", 0.0, 1e7) for i, x in enumerate(_tuple(v, name, 3)))
        return WorkerTimeline(a, s, t)


def _opt_timeline(v: Any) -> WorkerTimeline | None:
    return None if v is None else WorkerTimeline.from_wire(v)


def _stop_reason(v: Any) -> str | int | None:
    if v is None or type(v) is int:
        return v
    return _str(v, "stop_reason", 4096)


def _finish_reason(v: Any) -> str:
    if v not in FINISH_REASONS:
        raise _fail(f"finish_reason: {v!r} not in {sorted(FINISH_REASONS)}")
    return str(v)


@dataclass(frozen=True, slots=True)
class Done(Message):
    """A job finished normally; terminal. `num_tokens` = total output tokens (last seq + 1).
    `queue_time`: seconds from the broker's accepting the job to its first dispatch (None: not known).
    `worker_timeline`: the first-token timeline of the attempt that finished it (None: not known)."""

    CMD: ClassVar[Cmd] = Cmd.DONE
    job_id: str
    finish_reason: str
    stop_reason: str | int | None
    usage: tuple[int, int, int]
    num_tokens: int
    queue_time: float | None = None
    worker_timeline: WorkerTimeline | None = None

    def to_wire(self) -> Any:
        d: dict[str, Any] = {"job_id": self.job_id, "finish_reason": self.finish_reason,
                             "stop_reason": self.stop_reason, "usage": list(self.usage), "num_tokens": self.num_tokens}
        if self.queue_time is not None:
            d["queue_time"] = self.queue_time
        if self.worker_timeline is not None:
            d["worker_timeline"] = self.worker_timeline.to_wire()
        return d

    @classmethod
    def from_wire(cls, obj: Any) -> Done:
        d = _map(obj, "done")
        _keys(d, "done", ("job_id", "finish_reason", "stop_reason", "usage", "num_tokens"),
              ("queue_time", "worker_timeline"))
        return cls(_ident(d["job_id"], "job_id"), _finish_reason(d["finish_reason"]),
                   _stop_reason(d["stop_reason"]), _usage(d["usage"]), _int(d["num_tokens"], "num_tokens"),
                   _opt_float(d.get("queue_time"), "queue_time", 0.0, 1e7), _opt_timeline(d.get("worker_timeline")))


@dataclass(frozen=True, slots=True)
class Fail(Message):
    """A job (or a request about a job) failed; terminal for the job. `code` is in FAIL_CODES;
    `retry_after` (seconds) comes with code "overloaded"."""

    CMD: ClassVar[Cmd] = Cmd.FAIL
    job_id: str
    code: str
    message: str = ""
    retry_after: float | None = None

    def to_wire(self) -> Any:
        return {"job_id": self.job_id, "code": self.code, "message": self.message,
                "retry_after": self.retry_after}

    @classmethod
    def from_wire(cls, obj: Any) -> Fail:
        d = _map(obj, "fail")
        _keys(d, "fail", ("job_id", "code"), ("message", "retry_after"))
        code = d["code"]
        if code not in FAIL_CODES:
            raise _fail(f"fail.code: unknown {code!r}")
        return cls(_str(d["job_id"], "job_id", MAX_ID_LEN), str(code), _str(d.get("message", ""), "message", 4096),
                   _opt_float(d.get("retry_after"), "retry_after", 0.0, 3600.0))


def _instance(d: dict[str, Any]) -> str:
    return _ident(d["instance"], "instance") if "instance" in d else ""


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """Answer to PING: the broker is alive. `instance`: the broker instance's id, new at every start, so
    a client whose jobs another instance accepted learns they are gone ("" from a broker that sends none)."""

    CMD: ClassVar[Cmd] = Cmd.PONG
    instance: str = ""

    def to_wire(self) -> Any:
        return {"instance": self.instance} if self.instance else {}

    @classmethod
    def from_wire(cls, obj: Any) -> Pong:
        d = _map(obj, "pong")
        _keys(d, "pong", (), ("instance",))
        return cls(_instance(d))


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    """Broker counters, queue depths and per-worker load (a free-form map, depth-limited)."""

    CMD: ClassVar[Cmd] = Cmd.STATS_REPLY
    stats: dict[str, Any]

    def to_wire(self) -> Any:
        return self.stats

    @classmethod
    def from_wire(cls, obj: Any) -> StatsReply:
        d = _map(obj, "stats")
        check_depth(d, "stats")
        return cls(d)


# ---- worker -> broker ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """A worker (re-)registers. `models`: names it answers to (engine name first, then aliases).
    `heartbeat_interval`: seconds between heartbeats both ways for this worker. `sampling_defaults`: the
    model's own defaults for sampling fields a request leaves unset (SAMPLING_DEFAULT_FIELDS; from its
    generation config, as vLLM applies them; {} for none). `data_id`: the routing id
    of the worker's second DEALER (its engine loop's, carrying TOKENS / FINISHED / ERROR straight from the
    engine thread); "" when everything comes over the socket that sent this READY. `max_prompt_chars`: a
    text prompt (or chat contents) longer than this many characters can never fit `max_model_len` on this
    worker (0: no bound known); the broker refuses such a job before it costs the worker anything. `role`: one
    of WORKER_ROLES; `kv_address`: where a decode worker receives KV blocks (worker/kv_transfer/), "" if none."""

    CMD: ClassVar[Cmd] = Cmd.W_READY
    name: str
    models: list[str]
    capacity: int
    kv_blocks: int
    block_size: int
    max_model_len: int
    heartbeat_interval: float
    data_id: str = ""
    max_prompt_chars: int = 0
    role: str = "both"
    kv_address: str = ""
    sampling_defaults: dict[str, int | float] = field(default_factory=dict)

    def to_wire(self) -> Any:
        d = {"name": self.name, "models": self.models, "capacity": self.capacity, "kv_blocks": self.kv_blocks,
             "block_size": self.block_size, "max_model_len": self.max_model_len,
             "heartbeat_interval": self.heartbeat_interval}
        if self.data_id:
            d["data_id"] = self.data_id
        if self.max_prompt_chars:
            d["max_prompt_chars"] = self.max_prompt_chars
        if self.role != "both":
            d["role"] = self.role
        if self.kv_address:
            d["kv_address"] = self.kv_address
        if self.sampling_defaults:
            d["sampling_defaults"] = dict(self.sampling_defaults)
        return d

    @classmethod
    def from_wire(cls, obj: Any) -> Ready:
        d = _map(obj, "ready")
        _keys(d, "ready", ("name", "models", "capacity", "kv_blocks", "block_size", "max_model_len",
                           "heartbeat_interval"), ("data_id", "max_prompt_chars", "role", "kv_address",
                                                   "sampling_defaults"))
        role = d.get("role", "both")
        if role not in WORKER_ROLES:
            raise _fail(f"ready.role: {str(role)[:64]!r} is not one of {list(WORKER_ROLES)}")
        models = [_str(m, "models[]", 512, 1) for m in _list(d["models"], "models", 16)]
        if not models:
            raise _fail("ready.models: empty")
        return cls(_ident(d["name"], "name"), models, _int(d["capacity"], "capacity", 1, 1 << 20),
                   _int(d["kv_blocks"], "kv_blocks"), _int(d["block_size"], "block_size", 1, 1 << 20),
                   _int(d["max_model_len"], "max_model_len", 1),
                   _float(d["heartbeat_interval"], "heartbeat_interval", 0.01, 60.0),
                   _ident(d["data_id"], "data_id") if "data_id" in d else "",
                   _int(d.get("max_prompt_chars", 0), "max_prompt_chars"), role,
                   _str(d.get("kv_address", ""), "kv_address", 512),
                   _sampling_defaults(d.get("sampling_defaults", {})))


def _sampling_defaults(v: Any) -> dict[str, int | float]:
    d = _map(v, "ready.sampling_defaults")
    out: dict[str, int | float] = {}
    for key, value in d.items():
        if key not in SAMPLING_DEFAULT_FIELDS:
            raise _fail(f"ready.sampling_defaults: {str(key)[:64]!r} is not one of {list(SAMPLING_DEFAULT_FIELDS)}")
        kind, lo, hi = SAMPLING_DEFAULT_FIELDS[key]
        name = f"ready.sampling_defaults.{key}"
        out[key] = _int(value, name, int(lo), int(hi)) if kind is int else _float(value, name, lo, hi)
    return out


@dataclass(frozen=True, slots=True)
class WorkerHeartbeat(Message):
    """Worker liveness plus its engine's load, sent by the worker's IO thread every interval.

    The last four fields are cumulative counters since the worker started: engine steps run (a hung
    engine loop stops advancing it while the IO thread keeps beating), prefix-cache lookups and hits
    (full prompt blocks) and preemptions. On the wire: 4 items (load only, counters 0) or 8."""

    CMD: ClassVar[Cmd] = Cmd.W_HEARTBEAT
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    steps: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0

    def to_wire(self) -> Any:
        return [self.running, self.waiting, self.free_blocks, self.cached_blocks, self.steps,
                self.prefix_queries, self.prefix_hits, self.preemptions]

    @classmethod
    def from_wire(cls, obj: Any) -> WorkerHeartbeat:
        if not (isinstance(obj, list) and len(obj) in (4, 8)):
            raise _fail("heartbeat: expected an array of 4 or 8 items")
        names = ("running", "waiting", "free_blocks", "cached_blocks", "steps", "prefix_queries", "prefix_hits",
                 "preemptions")
        return cls(*(_int(v, n) for v, n in zip(obj, names)))


class TokenChunk(NamedTuple):
    """One job's new tokens of one engine step; `seq` = output index of token_ids[0] (counting tokens
    an earlier attempt delivered). A NamedTuple: this is the relay hot path. On the wire a chunk is
    split in two (see Tokens): its attempt, and its STREAM entry [job_id, seq, token_ids, text, logprobs]."""

    job_id: str
    attempt: int
    seq: int
    token_ids: list[int]
    text: str
    logprobs: list[list[list[Any]]] | None = None

    def entry(self) -> list[Any]:
        """The chunk's STREAM entry: what the broker relays to subscribers, byte for byte."""
        return [self.job_id, self.seq, self.token_ids, self.text, self.logprobs]

    @staticmethod
    def from_wire(attempt: Any, entry: Any) -> TokenChunk:
        """A chunk from its attempt and STREAM entry (strict)."""
        c = StreamChunk.from_wire(entry)
        return TokenChunk(c.job_id, _int(attempt, "attempt", 0, MAX_ATTEMPT), c.seq, c.token_ids, c.text, c.logprobs)


@dataclass(frozen=True, slots=True)
class Tokens(Message):
    """Everything one engine step produced: one chunk per job that produced tokens.

    Body: [attempts, entries], two arrays of equal length; chunk i is attempts[i] (an int) and entries[i]
    (its STREAM entry [job_id, seq, token_ids, text, logprobs]). `entries` is exactly a STREAM body: when
    every chunk goes to one caught-up subscriber, the broker validates the batch and forwards those bytes
    as they came (no per-chunk re-encoding before the send)."""

    CMD: ClassVar[Cmd] = Cmd.W_TOKENS
    chunks: list[TokenChunk]

    def to_wire(self) -> Any:
        return [[c.attempt for c in self.chunks], [c.entry() for c in self.chunks]]

    @classmethod
    def from_wire(cls, obj: Any) -> Tokens:
        attempts, entries = _tuple(obj, "tokens", 2)
        _list(attempts, "tokens.attempts")
        _list(entries, "tokens.entries")
        if len(attempts) != len(entries):
            raise _fail(f"tokens: {len(attempts)} attempts for {len(entries)} entries")
        return cls([TokenChunk.from_wire(a, e) for a, e in zip(attempts, entries)])


@dataclass(frozen=True, slots=True)
class FinishedJob:
    """A job's attempt ended on the worker with `finish_reason`; sent after its last TOKENS chunk.
    `timeline`: where its first token came from on the worker (None: not measured)."""

    job_id: str
    attempt: int
    finish_reason: str
    stop_reason: str | int | None
    usage: tuple[int, int, int]
    timeline: WorkerTimeline | None = None

    def to_wire(self) -> list[Any]:
        tl = None if self.timeline is None else self.timeline.to_wire()
        return [self.job_id, self.attempt, self.finish_reason, self.stop_reason, list(self.usage), tl]

    @staticmethod
    def from_wire(obj: Any) -> FinishedJob:
        if isinstance(obj, list) and len(obj) == 5:  # from a worker that does not measure timelines
            obj = [*obj, None]
        job_id, attempt, reason, stop, usage, tl = _tuple(obj, "finished job", 6)
        return FinishedJob(_ident(job_id, "job_id"), _int(attempt, "attempt", 0, MAX_ATTEMPT),
                           _finish_reason(reason), _stop_reason(stop), _usage(usage), _opt_timeline(tl))


@dataclass(frozen=True, slots=True)
class Finished(Message):
    """The jobs that finished in one engine step."""

    CMD: ClassVar[Cmd] = Cmd.W_FINISHED
    jobs: list[FinishedJob]

    def to_wire(self) -> Any:
        return [j.to_wire() for j in self.jobs]

    @classmethod
    def from_wire(cls, obj: Any) -> Finished:
        return cls([FinishedJob.from_wire(j) for j in _list(obj, "finished")])


@dataclass(frozen=True, slots=True)
class JobError(Message):
    """One job failed on the worker (`code` "invalid" for a request that can never run, else "failed")."""

    CMD: ClassVar[Cmd] = Cmd.W_ERROR
    job_id: str
    attempt: int
    code: str
    message: str

    def to_wire(self) -> Any:
        return {"job_id": self.job_id, "attempt": self.attempt, "code": self.code, "message": self.message}

    @classmethod
    def from_wire(cls, obj: Any) -> JobError:
        d = _map(obj, "error")
        _keys(d, "error", ("job_id", "attempt", "code", "message"))
        if d["code"] not in ("invalid", "failed"):
            raise _fail(f"error.code: {d['code']!r} not in ['failed', 'invalid']")
        return cls(_str(d["job_id"], "job_id", MAX_ID_LEN), _int(d["attempt"], "attempt", 0, MAX_ATTEMPT),
                   str(d["code"]), _str(d["message"], "message", 4096))


@dataclass(frozen=True, slots=True)
class WorkerDisconnect(_Empty):
    """The worker is leaving cleanly; its unfinished jobs migrate at once."""

    CMD: ClassVar[Cmd] = Cmd.W_DISCONNECT


@dataclass(frozen=True, slots=True)
class Prefilled(Message):
    """A prefill worker is done with a job's attempt (WorkerSubmit.kv_send): `blocks` KV blocks went to the
    decode worker (0: none could be sent; the broker then tells the decode worker, KV_LOST)."""

    CMD: ClassVar[Cmd] = Cmd.W_PREFILLED
    job_id: str
    attempt: int
    blocks: int

    def to_wire(self) -> Any:
        return [self.job_id, self.attempt, self.blocks]

    @classmethod
    def from_wire(cls, obj: Any) -> Prefilled:
        job_id, attempt, blocks = _tuple(obj, "prefilled", 3)
        return cls(_ident(job_id, "job_id"), _int(attempt, "attempt", 0, MAX_ATTEMPT), _int(blocks, "blocks"))


# ---- broker -> worker ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSubmit(Message):
    """Run attempt `attempt` of a job. `resume_token_ids`: output tokens earlier attempts delivered
    (they count toward max_tokens; output continues at seq len(resume_token_ids)).

    Disaggregated serving: `kv_send` (to a prefill worker) = compute the prompt's KV blocks, send them to
    this KV address (the decode worker's Ready.kv_address), answer PREFILLED, emit no tokens; `kv_wait` (to
    the decode worker) = wait for those blocks before computing the prompt (KV_LOST, or no blocks in time:
    compute it all)."""

    CMD: ClassVar[Cmd] = Cmd.B_SUBMIT
    job_id: str
    attempt: int
    input: RequestInput
    params: dict[str, Any]
    resume_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    kv_send: str = ""
    kv_wait: bool = False

    def to_wire(self) -> Any:
        d: dict[str, Any] = {"job_id": self.job_id, "attempt": self.attempt, "params": self.params,
                             "resume_token_ids": self.resume_token_ids, "priority": self.priority}
        if self.kv_send:
            d["kv_send"] = self.kv_send
        if self.kv_wait:
            d["kv_wait"] = True
        self.input.to_wire(d)
        return d

    @classmethod
    def from_wire(cls, obj: Any) -> WorkerSubmit:
        d = _map(obj, "worker submit")
        _keys(d, "worker submit", ("job_id", "attempt", "params"),
              ("resume_token_ids", "priority", "kv_send", "kv_wait", *_INPUT_KEYS))
        return cls(_ident(d["job_id"], "job_id"), _int(d["attempt"], "attempt", 0, MAX_ATTEMPT),
                   RequestInput.from_wire(d), _params(d["params"]),
                   _token_ids(d.get("resume_token_ids", []), "resume_token_ids"),
                   _int(d.get("priority", 0), "priority", -(1 << 31), 1 << 31),
                   _str(d.get("kv_send", ""), "kv_send", 512), _bool(d.get("kv_wait", False), "kv_wait"))


@dataclass(frozen=True, slots=True)
class WorkerCancel(Message):
    """Abort a job's attempt on the worker (frees its KV blocks); no reply."""

    CMD: ClassVar[Cmd] = Cmd.B_CANCEL
    job_id: str
    attempt: int

    def to_wire(self) -> Any:
        return [self.job_id, self.attempt]

    @classmethod
    def from_wire(cls, obj: Any) -> WorkerCancel:
        job_id, attempt = _tuple(obj, "worker cancel", 2)
        return cls(_ident(job_id, "job_id"), _int(attempt, "attempt", 0, MAX_ATTEMPT))


@dataclass(frozen=True, slots=True)
class BrokerHeartbeat(_Empty):
    """Broker liveness, sent to each worker every its heartbeat interval."""

    CMD: ClassVar[Cmd] = Cmd.B_HEARTBEAT


@dataclass(frozen=True, slots=True)
class BrokerDisconnect(Message):
    """The broker does not know this worker (declared dead, or broker restarted) or is shutting down:
    abort everything and send READY again."""

    CMD: ClassVar[Cmd] = Cmd.B_DISCONNECT
    reason: str = "reregister"

    def to_wire(self) -> Any:
        return {"reason": self.reason}

    @classmethod
    def from_wire(cls, obj: Any) -> BrokerDisconnect:
        d = _map(obj, "disconnect")
        _keys(d, "disconnect", (), ("reason",))
        return cls(_str(d.get("reason", "reregister"), "reason", 256))


@dataclass(frozen=True, slots=True)
class KvLost(Message):
    """To a decode worker waiting for a job's KV blocks (WorkerSubmit.kv_wait): they will not come (the
    prefill worker died or could not send them); compute the prompt itself."""

    CMD: ClassVar[Cmd] = Cmd.B_KV_LOST
    job_id: str
    attempt: int

    def to_wire(self) -> Any:
        return [self.job_id, self.attempt]

    @classmethod
    def from_wire(cls, obj: Any) -> KvLost:
        job_id, attempt = _tuple(obj, "kv lost", 2)
        return cls(_ident(job_id, "job_id"), _int(attempt, "attempt", 0, MAX_ATTEMPT))


MESSAGE_TYPES: dict[Cmd, type[Message]] = {
    cls.CMD: cls
    for cls in (Submit, Cancel, Subscribe, Ping, Bye, StatsRequest, Ack, Stream, Done, Fail, Pong, StatsReply,
                Ready, WorkerHeartbeat, Tokens, Finished, JobError, WorkerDisconnect, Prefilled, WorkerSubmit,
                WorkerCancel, BrokerHeartbeat, BrokerDisconnect, KvLost)
}
assert len(MESSAGE_TYPES) == len(Cmd), "every command has exactly one message type"


# ----------------------------------------------------------------------------------------------------
# The one encode/decode pair.


def encode(msg: Message) -> list[bytes]:
    """Encode a message as its three frames [HEADER, command, msgpack body]."""
    return [HEADER, bytes((msg.CMD,)), msgpack.packb(msg.to_wire(), use_bin_type=True)]


W_TOKENS_FRAME = bytes((Cmd.W_TOKENS,))  # the command frame of a TOKENS message


def encode_checked(msg: Message, allowed: frozenset[Cmd], max_bytes: int = MAX_BODY_BYTES) -> list[bytes]:
    """encode(msg), checked with the receiving side's rules: the frames, which decode(frames, allowed,
    max_bytes) accepts, or ProtocolError saying what the receiver would refuse, including what msgpack
    cannot encode (integers past 64 bits, lone surrogates, types it does not know). What a sender runs
    on a message built from untrusted input (the SDK: every request made from a caller's arguments)."""
    try:
        frames = encode(msg)
    except Exception as e:  # msgpack: TypeError, OverflowError, UnicodeEncodeError, ValueError (depth), ...
        raise ProtocolError(f"{msg.CMD.name} cannot be encoded: {type(e).__name__}: {str(e)[:200]}") from None
    decode(frames, allowed, max_bytes)
    return frames


def encode_tokens(attempts: list[int], entries: list[list[Any]]) -> list[bytes]:
    """encode(Tokens(chunks)) from the body's two columns (Tokens): the worker's per-step hot path,
    which builds them directly instead of a TokenChunk per job."""
    return [HEADER, W_TOKENS_FRAME, msgpack.packb([attempts, entries], use_bin_type=True)]


@functools.lru_cache(maxsize=8)
def _unpack_limits(max_bytes: int) -> dict[str, Any]:
    """msgpack unpacking options for untrusted bodies: the module's limits, no bin or ext types, str map
    keys only (shared by unpack_body and split_tokens_body; read-only)."""
    return {"raw": False, "strict_map_key": True, "use_list": True, "max_str_len": max_bytes, "max_bin_len": 0,
            "max_array_len": MAX_ARRAY_LEN, "max_map_len": MAX_MAP_LEN, "max_ext_len": 0}


def _check_body_size(body: bytes, max_bytes: int) -> None:
    if len(body) > max_bytes:
        raise ProtocolError(f"body of {len(body)} bytes exceeds the limit of {max_bytes}")


def unpack_body(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """msgpack-decode an untrusted body under the module's limits (no ext types, str map keys only)."""
    _check_body_size(body, max_bytes)
    try:
        return msgpack.unpackb(body, **_unpack_limits(max_bytes))
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, StackError, ValueError, ...)
        raise ProtocolError(f"bad msgpack body: {type(e).__name__}: {e}") from None


def split_tokens_body(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> tuple[Any, Any, int]:
    """Unpack a TOKENS body [attempts, entries] under unpack_body's limits; returns (attempts, entries,
    offset) where body[offset:] is the msgpack of `entries` alone (a STREAM body). Checks the framing
    only (a two-item array, nothing after it), not the items: the caller validates them (or decodes
    strictly). Raises ProtocolError."""
    _check_body_size(body, max_bytes)
    up = msgpack.Unpacker(max_buffer_size=max(len(body), 1), **_unpack_limits(max_bytes))
    try:
        up.feed(body)
        if up.read_array_header() != 2:
            raise ProtocolError("tokens: expected an array of 2 items")
        attempts = up.unpack()
        offset = up.tell()
        entries = up.unpack()
    except ProtocolError:
        raise
    except Exception as e:  # OutOfData (truncated), FormatError, StackError, ValueError, ...
        raise ProtocolError(f"bad msgpack body: {type(e).__name__}: {e}") from None
    if up.tell() != len(body):
        raise ProtocolError("tokens: trailing bytes after the body")
    return attempts, entries, offset


def readable_job_id(frames: Sequence[bytes], max_bytes: int = MAX_BODY_BYTES) -> str:
    """The job id of a message that failed to decode, when one can be read: the body is a msgpack map
    (under the limits) whose "job_id" is a valid id; else "". What the broker echoes in its FAIL
    "protocol", so that the sender can tell which of its requests was refused."""
    if len(frames) != 3:
        return ""
    try:
        body = unpack_body(frames[2], max_bytes)
        return _ident(body["job_id"], "job_id") if isinstance(body, dict) and "job_id" in body else ""
    except ProtocolError:
        return ""


def decode(frames: Sequence[bytes], allowed: frozenset[Cmd] | None = None,
           max_bytes: int = MAX_BODY_BYTES) -> Message:
    """Decode the three frames of a message (routing id already stripped), accepting only `allowed`
    commands. Raises ProtocolError on anything malformed."""
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 frames, got {len(frames)}")
    header, cmd_frame, body = frames
    if header != HEADER:
        raise ProtocolError(f"bad header {bytes(header[:8])!r}; expected {HEADER!r}")
    if len(cmd_frame) != 1:
        raise ProtocolError("command frame must be one byte")
    try:
        cmd = Cmd(cmd_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown command 0x{cmd_frame[0]:02x}") from None
    if allowed is not None and cmd not in allowed:
        raise ProtocolError(f"command {cmd.name} not allowed here")
    obj = unpack_body(body, max_bytes)
    try:
        return MESSAGE_TYPES[cmd].from_wire(obj)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # defensive: a validator slipped
        raise ProtocolError(f"malformed {cmd.name}: {type(e).__name__}: {e}") from None

