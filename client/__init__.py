"""tokenmill client SDK (torch-free): submit generation jobs to a broker, stream or subscribe to tokens.

`Client` is synchronous and thread-safe; `AsyncClient` is its asyncio twin. Errors are typed
(`Overloaded`, `DeadlineExceeded`, `Cancelled`, `InvalidRequest`, `JobFailed`, `ProtocolError`,
`BrokerUnavailable`, ...); all derive from `TokenmillError`.
"""

from tokenmill.client.async_client import AsyncClient, AsyncJobHandle, run
from tokenmill.client.client import DEFAULT_ADDRESS, Client, JobHandle, Result, StreamEvent, Usage
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
)

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncClient",
    "AsyncJobHandle",
    "AuthenticationFailed",
    "BrokerUnavailable",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "Forbidden",
    "InvalidRequest",
    "JobConflict",
    "JobFailed",
    "JobHandle",
    "Overloaded",
    "ProtocolError",
    "Result",
    "StreamEvent",
    "TokenmillError",
    "UnknownJob",
    "Usage",
    "run",
]
