"""tokenmill's wire protocol (torch-free; pyzmq and msgpack only), shared by the client SDK, the broker and
the worker:

    tokenmill.protocol.wire       message types, encode/decode and their limits (docs/protocol.md)
    tokenmill.protocol.errors     the typed errors, one per FAIL code
    tokenmill.protocol.sampling   SamplingParams: the one set of rules for a request's sampling parameters
    tokenmill.protocol.keys       CURVE key files

This package imports nothing else of the project's (a test enforces it).
"""

from tokenmill.protocol.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    Cancelled,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    JobConflict,
    JobFailed,
    Overloaded,
    ProtocolError,
    TokenmillError,
    UnknownJob,
    error_from_fail,
)
from tokenmill.protocol.sampling import SamplingParams

__all__ = [
    "AuthenticationFailed",
    "BrokerUnavailable",
    "Cancelled",
    "DeadlineExceeded",
    "Forbidden",
    "InvalidRequest",
    "JobConflict",
    "JobFailed",
    "Overloaded",
    "ProtocolError",
    "SamplingParams",
    "TokenmillError",
    "UnknownJob",
    "error_from_fail",
]
