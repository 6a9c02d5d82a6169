"""Logging for every tokenmill process (broker, worker, gateway, CLI): structlog, one line per event.

`configure(level, fmt)` routes both structlog's loggers and the stdlib's (`logging.getLogger(...)`: the
engine's, the model runner's, uvicorn's, libraries') through one stdlib handler on stderr whose
`structlog.stdlib.ProcessorFormatter` renders every record the same way: JSON lines (`fmt="json"`, or
`"auto"` when stderr is not a terminal) or console text (`"console"`, or `"auto"` on a terminal). Every
line carries a timestamp (UTC, ISO 8601), the level, the logger name and whatever is bound in the
context: `bind_job(job_id=...)` (structlog's contextvars) where a request or job is handled, so one
request's lines can be grepped across processes by its id (the gateway's job ids are the request id
plus the choice index: `chatcmpl-...-0`).

No secrets in logs: values under key-like names (api_key, authorization, secret, password, token, ...)
are replaced by `[redacted]` before rendering, and tracebacks are printed plainly (no local variables,
which may hold key material).

Child processes inherit the settings through the environment (TOKENMILL_LOG_LEVEL, TOKENMILL_LOG_FORMAT,
TOKENMILL_LOG_JSON=1 for JSON), which `configure` exports and `configure_from_env` reads."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("auto", "json", "console")
LEVEL_ENV, FORMAT_ENV, JSON_ENV = "TOKENMILL_LOG_LEVEL", "TOKENMILL_LOG_FORMAT", "TOKENMILL_LOG_JSON"
REDACTED = "[redacted]"
# Keys whose values never reach a log line (compared lower-case, '-' as '_'); also any key ending in one.
SECRET_KEYS = ("api_key", "api_keys", "authorization", "password", "secret", "secret_key", "curve_secret",
               "curve_secret_key", "token", "bearer", "key_secret")
_HANDLER_NAME = "tokenmill"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever sys.stderr is when a record comes (test runners swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def is_secret_key(key: str) -> bool:
    k = key.lower().replace("-", "_")
    return any(k == s or k.endswith("_" + s) for s in SECRET_KEYS)


def redact_secrets(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: blank the values of secret-looking keys."""
    for key in event_dict:
        if is_secret_key(key):
            event_dict[key] = REDACTED
    return event_dict


def resolve_format(fmt: str, stream: TextIO) -> str:
    """'json' or 'console' for `fmt` ('auto': console on a terminal, JSON otherwise)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def _level_number(level: str) -> int:
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    return int(getattr(logging, level.upper()))


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None, *, export: bool = True) -> str:
    """Set up logging for this process (again: replaces the previous set-up); returns the format used.
    `export`: also put the settings in os.environ for the processes this one starts."""
    lvl = _level_number(level)
    chosen = resolve_format(fmt, stream if stream is not None else sys.stderr)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
    ]
    renderer: Any
    if chosen == "json":
        renderer = structlog.processors.JSONRenderer()
        tail: list[Any] = [structlog.processors.format_exc_info]  # a plain traceback string, no locals
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
        tail = []
    structlog.configure(
        processors=[structlog.stdlib.PositionalArgumentsFormatter(), *shared,
                    structlog.processors.StackInfoRenderer(), structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(lvl),  # a call below the level returns at once
        cache_logger_on_first_use=False,  # a later configure() (a test, a CLI re-run in-process) takes effect
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],  # records of stdlib loggers
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
    )
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    if export:
        os.environ[LEVEL_ENV], os.environ[FORMAT_ENV] = level.lower(), chosen
    return chosen


def configure_from_env(default_level: str = "info", level: str | None = None, *, export: bool = True) -> str:
    """`configure` from TOKENMILL_LOG_LEVEL (else `default_level`; `level` overrides both) and
    TOKENMILL_LOG_FORMAT (TOKENMILL_LOG_JSON=1 means json). A value it cannot use falls back to the default
    (the command's settings parser reports it, as one line)."""
    env = os.environ
    fmt = env.get(FORMAT_ENV, "auto").strip().lower() or "auto"
    if env.get(JSON_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        fmt = "json"
    lvl = level or env.get(LEVEL_ENV, "").strip().lower() or default_level
    if lvl not in LEVELS:
        lvl = default_level
    return configure(lvl, fmt if fmt in FORMATS else "auto", export=export)


def bind_job(**ids: Any) -> None:
    """Bind ids (request_id=, job_id=, worker=...) into this task's or thread's log context."""
    structlog.contextvars.bind_contextvars(**ids)


@contextmanager
def job_context(**ids: Any) -> Iterator[None]:
    """The ids bound for the `with` block only (restored after, also on an exception)."""
    tokens = structlog.contextvars.bind_contextvars(**ids)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
