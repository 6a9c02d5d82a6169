"""What the SDK sends, checked before it goes out with the rules the broker applies: the wire decoder's
(protocol.wire, through encode_checked) and the sampling rules (protocol.sampling.SamplingParams). A call
the broker would refuse raises InvalidRequest in the caller's thread at once, instead of going out to be
answered by a FAIL that may name no job. Also the checks of the SDK's own wait arguments."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import InvalidRequest, ProtocolError
from tokenmill.protocol.sampling import SamplingParams


def checked_frames(msg: p.Message) -> list[bytes]:
    """The frames of a client -> broker message, or InvalidRequest naming what the broker would refuse."""
    try:
        return p.encode_checked(msg, p.CLIENT_TO_BROKER)
    except ProtocolError as e:
        raise InvalidRequest(str(e)[:1000], job_id=_readable_id(msg)) from None


def _readable_id(msg: p.Message) -> str | None:
    job_id = getattr(msg, "job_id", None)
    return job_id if isinstance(job_id, str) and len(job_id) <= p.MAX_ID_LEN else None


def build_params(params: Mapping[str, Any] | None, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling parameters for the wire: `params` updated by keyword arguments (None values omitted)."""
    if params is not None and not isinstance(params, Mapping):
        raise InvalidRequest(f"params must be a mapping of sampling parameters, got {type(params).__name__}")
    out = dict(params or {})
    out.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in sampling.items() if v is not None})
    return out


def make_submit(job_id: str | None, model: str, prompt: str | None, messages: list[dict[str, str]] | None,
                prompt_token_ids: list[int] | None, params: dict[str, Any], timeout: float | None,
                priority: int, owner: str, cancel_on_disconnect: bool) -> tuple[p.Submit, list[bytes]]:
    """The SUBMIT message of a call and its frames, checked as the broker checks them (InvalidRequest)."""
    ids = list(prompt_token_ids) if isinstance(prompt_token_ids, list | tuple) else prompt_token_ids
    try:
        inp = p.RequestInput(prompt, messages, ids)
    except ProtocolError as e:
        raise InvalidRequest(str(e)) from None
    job_id = uuid.uuid4().hex if job_id is None or job_id == "" else job_id
    msg = p.Submit(job_id, model, inp, params, timeout, priority, owner, cancel_on_disconnect=cancel_on_disconnect)
    frames = checked_frames(msg)
    try:
        SamplingParams.from_dict(params)  # the broker's rule for params (they passed the wire's)
    except InvalidRequest as e:
        raise InvalidRequest(str(e), job_id=msg.job_id) from None
    return msg, frames


MAX_WAIT = 7 * 86400.0  # the longest wait the SDK accepts, as the longest job timeout the wire does


def wait_seconds(timeout: Any, default: float, name: str = "timeout") -> float:
    """A wait bound in seconds: `timeout` (a number in [0, MAX_WAIT]), or `default` for None."""
    if timeout is None:
        return default
    if type(timeout) not in (int, float) or not 0 <= timeout <= MAX_WAIT:  # (NaN fails the comparison)
        raise InvalidRequest(f"{name} must be a number of seconds in [0, {MAX_WAIT:.0f}], got {timeout!r}")
    return float(timeout)


def positive_seconds(value: Any, name: str) -> float:
    """A client setting in seconds: a number in (0, MAX_WAIT] (InvalidRequest otherwise)."""
    if type(value) not in (int, float) or not 0 < value <= MAX_WAIT:
        raise InvalidRequest(f"{name} must be a number of seconds in (0, {MAX_WAIT:.0f}], got {value!r}")
    return float(value)
