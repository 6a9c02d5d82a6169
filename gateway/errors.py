"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with HTTP statuses:
400 bad request, 401 bad key, 404 unknown model, 429 overloaded (with Retry-After), 503 no worker or no
broker, 504 deadline, 500 a failed job."""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.protocol.errors import (
    BrokerUnavailable,
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    TokenmillError,
)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


class APIError(Exception):
    """An error answer: HTTP `status`, OpenAI error `message` / `type` / `param` / `code`, extra headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_tokenmill(e: TokenmillError) -> APIError:
    """The HTTP answer for a typed SDK error."""
    msg = str(e) or type(e).__name__
    if isinstance(e, Overloaded):
        retry = max(1, math.ceil(e.retry_after)) if e.retry_after is not None else 1
        return APIError(429, f"overloaded: {msg}", code="overloaded", headers={"Retry-After": str(retry)})
    if isinstance(e, InvalidRequest):
        return APIError(400, msg, code="invalid")
    if isinstance(e, BrokerUnavailable):
        return APIError(503, f"broker unavailable: {msg}", code="unavailable", headers={"Retry-After": "1"})
    if isinstance(e, DeadlineExceeded):
        return APIError(504, f"deadline exceeded: {msg}", code="deadline")
    if isinstance(e, Cancelled):
        return APIError(503, f"cancelled: {msg}", code="cancelled")
    return APIError(500, f"generation failed: {msg}", code=e.code)
