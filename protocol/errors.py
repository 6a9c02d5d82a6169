"""Typed errors of tokenmill, shared by the SDK, the broker and the worker. Every FAIL code of the protocol
maps to one class; `InvalidRequest` is also a ValueError (the engine raises it for a bad request)."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base of every error the SDK raises. `job_id` is set when the error concerns one job."""

    code = "failed"

    def __init__(self, message: str = "", *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class ProtocolError(TokenmillError):
    """A message broke the wire protocol (bad header, msgpack, type, size or nesting)."""

    code = "protocol"


class Overloaded(TokenmillError):
    """The model's queue is full; try again after `retry_after` seconds."""

    code = "overloaded"

    def __init__(self, message: str = "", *, job_id: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, job_id=job_id)
        self.retry_after = retry_after


class DeadlineExceeded(TokenmillError):
    """The job's deadline (or the call's timeout, or the broker's queue timeout) passed."""

    code = "deadline"


class Cancelled(TokenmillError):
    """The job was cancelled (by its owner, or because its client disconnected)."""

    code = "cancelled"


class InvalidRequest(TokenmillError, ValueError):
    """The request can never be served as given (bad sampling parameters, prompt too long, ...)."""

    code = "invalid"


class JobFailed(TokenmillError):
    """The job failed terminally (a worker error, or it reached the broker's migration limit)."""

    code = "failed"


class Forbidden(TokenmillError):
    """The job belongs to another client: it may not be cancelled or subscribed to from here."""

    code = "forbidden"


class UnknownJob(TokenmillError):
    """The broker does not know the job id (never submitted, or expired from its log)."""

    code = "unknown_job"


class JobConflict(TokenmillError):
    """A job with this id already exists and belongs to another owner."""

    code = "conflict"


class BrokerUnavailable(TokenmillError):
    """The broker did not answer in time, went away, or is draining and refuses new work."""

    code = "unavailable"


class AuthenticationFailed(BrokerUnavailable):
    """The broker refused this peer's CURVE handshake: its key is not admitted (or not for this socket),
    or CURVE is on at one end only. Not an outage: retrying with the same key cannot succeed. Raised by
    the SDK (no FAIL reply carries it: the broker never talks to an unauthenticated peer)."""

    code = "unauthenticated"


_BY_CODE: dict[str, type[TokenmillError]] = {
    cls.code: cls
    for cls in (ProtocolError, Overloaded, DeadlineExceeded, Cancelled, InvalidRequest, JobFailed, Forbidden,
                UnknownJob, JobConflict, BrokerUnavailable)
}


def error_from_fail(code: str, message: str, job_id: str | None, retry_after: float | None = None) -> TokenmillError:
    """Build the exception for a FAIL reply's code (unknown codes become JobFailed)."""
    if code == "overloaded":
        return Overloaded(message, job_id=job_id, retry_after=retry_after)
    return _BY_CODE.get(code, JobFailed)(message, job_id=job_id)
