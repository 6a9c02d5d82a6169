"""The terminal side of `tokenmill chat` and `tokenmill generate`, in-process or through a broker: replies
printed as they stream, a spinner while the user waits, and the interactive chat (line editing and history
through readline, Ctrl-C stops a reply, slash commands that never reach the model).

A reply is an iterator of `Delta`s (text, and the finish reason on the last one); leaving it early (Ctrl-C)
closes it, which cancels the job (client SDK) or aborts the request (in-process engine).
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NamedTuple, TextIO

from tokenmill.protocol.errors import TokenmillError
from tokenmill.protocol.sampling import SamplingParams

PROMPT = ">>> "
HISTORY_LINES = 1000
HELP = """\
Commands (never sent to the model):
  /set                  show the sampling parameters
  /set NAME VALUE       change one, e.g. /set temperature 0.2, /set max-tokens 512, /set seed none
  /set system TEXT      set the system message
  /clear                forget the conversation (the system message stays)
  /bye                  leave (Ctrl-D too)
  /help or /?           this help
Ctrl-C stops a reply and returns to the prompt; the conversation keeps what was said."""


class Delta(NamedTuple):
    text: str
    finish_reason: str | None = None  # set on the last delta of a reply


Reply = Callable[[list[dict[str, str]], dict[str, Any]], Iterator[Delta]]


class Spinner:
    """A spinner with a message on `stream` while a block runs (only where `stream` is a terminal); the line
    is cleared when the block ends, so the output that follows starts on a clean line."""

    FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, message: str, stream: TextIO | None = None, interval: float = 0.1) -> None:
        self.message = message
        self.stream = stream or sys.stderr
        self.interval = interval
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Spinner:
        if _isatty(self.stream):
            self._thread = threading.Thread(target=self._spin, name="spinner", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._done.set()
        self._thread.join()
        self._thread = None
        self.stream.write("\r\x1b[K")
        self.stream.flush()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _spin(self) -> None:
        for frame in itertools.cycle(self.FRAMES):
            self.stream.write(f"\r{frame} {self.message}")
            self.stream.flush()
            if self._done.wait(self.interval):
                return


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def print_reply(deltas: Iterator[Delta], out: TextIO | None = None, spinner: bool = False) -> str:
    """Print a reply as it streams, then a newline; returns its text. A reply cut by max_tokens inside a
    multi-byte character ends without the replacement character of the cut half. `spinner`: spin on stderr
    until the first text arrives."""
    out = out or sys.stdout
    parts: list[str] = []
    spin = Spinner("") if spinner else None
    try:
        if spin is not None:
            spin.__enter__()
        for d in deltas:
            text = d.text.rstrip("\ufffd") if d.finish_reason == "length" else d.text
            if text and spin is not None:
                spin.stop()
                spin = None
            if text:
                out.write(text)
                out.flush()
                parts.append(text)
    finally:
        if spin is not None:
            spin.stop()
        out.write("\n")
        out.flush()
    return "".join(parts)


@contextlib.contextmanager
def stop_on_ctrl_c(raise_at_once: bool) -> Iterator[threading.Event]:
    """While the block runs, Ctrl-C sets the yielded event (the caller stops at its next delta) instead of
    raising where it lands; `raise_at_once` (a reply waiting on a socket) raises KeyboardInterrupt too.
    Outside the main thread nothing changes."""
    stopped = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return

    def on_sigint(_sig: int, _frame: FrameType | None) -> None:
        stopped.set()
        if raise_at_once:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)


def until(stopped: threading.Event, deltas: Iterator[Delta]) -> Iterator[Delta]:
    """`deltas` until `stopped` is set (then closed: the job is cancelled)."""
    with contextlib.closing(deltas):  # type: ignore[type-var]
        for d in deltas:
            if stopped.is_set():
                return
            yield d


# ---- the interactive chat -------------------------------------------------------------------------


@dataclass
class ChatSession:
    """The state of an interactive chat: the conversation, the system message and the sampling parameters
    (SamplingParams fields). `parse(name, text)` turns a /set value into a parameter value (ValueError)."""

    params: dict[str, Any]
    parse: Callable[[str, str], Any]
    system: str | None = None
    history: list[dict[str, str]] = field(default_factory=list)
    raise_at_once: bool = False  # Ctrl-C: see stop_on_ctrl_c
    explain: Callable[[str], str] = str  # an error message as the user should read it

    def messages(self, line: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history, {"role": "user", "content": line}]


def chat_loop(session: ChatSession, reply: Reply, history_file: Path | None = None) -> int:
    """The interactive chat on stdin: each line is a user turn or a slash command. On a terminal the line
    is edited with readline and kept in `history_file`; Ctrl-C at the prompt says how to leave, Ctrl-D
    leaves (with a newline). Returns the exit status."""
    terminal = sys.stdin.isatty()
    if terminal:
        _start_readline(history_file)
        print("Type /help for commands, /bye or Ctrl-D to leave.", file=sys.stderr)
    try:
        while True:
            try:  # a Ctrl-C between two handlers (the line read, the turn's not yet set) drops this line only
                line = _read_line(terminal)
                if line is None:
                    if terminal:
                        sys.stdout.write("\n")  # the shell's prompt starts on a line of its own
                        sys.stdout.flush()
                    return 0
                if not _handle_line(session, reply, line.strip(), terminal):
                    return 0
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                sys.stdout.flush()
    finally:
        if terminal:
            _save_history(history_file)


def _read_line(terminal: bool) -> str | None:
    """The next line, or None at end of input."""
    while True:
        try:
            if terminal:
                return input(PROMPT)
            line = sys.stdin.readline()
            return line if line else None
        except EOFError:
            return None
        except KeyboardInterrupt:
            if not terminal:
                return None
            print("\nUse Ctrl-D or /bye to leave.", file=sys.stderr)


def _handle_line(session: ChatSession, reply: Reply, line: str, terminal: bool) -> bool:
    """One line typed at the prompt: a slash command or a user turn; False for /bye."""
    if line.startswith("/"):
        return _command(session, line)
    if line:
        _turn(session, reply, line, terminal)
    return True


def _turn(session: ChatSession, reply: Reply, line: str, terminal: bool) -> None:
    """Send one user line; the reply (whole or stopped by Ctrl-C) joins the conversation."""
    messages = session.messages(line)
    text = ""
    try:
        with stop_on_ctrl_c(session.raise_at_once) as stopped:
            text = print_reply(until(stopped, reply(messages, dict(session.params))), spinner=terminal)
    except KeyboardInterrupt:
        pass
    except TokenmillError as e:  # e.g. a conversation longer than the model's context: this turn only
        print(f"error: {session.explain(str(e))}", file=sys.stderr)
        return
    if text:
        session.history += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]


def _command(session: ChatSession, line: str) -> bool:
    """Run a slash command; False for /bye."""
    word, _, rest = line.partition(" ")
    word, rest = word.lower(), rest.strip()
    if word in ("/bye", "/exit", "/quit"):
        return False
    if word in ("/help", "/?"):
        print(HELP)
    elif word == "/clear":
        session.history.clear()
        print("Cleared the conversation.")
    elif word == "/set":
        _set(session, rest)
    else:
        print(f"Unknown command {word!r}. Type /help for the commands.")
    return True


def _set(session: ChatSession, rest: str) -> None:
    if not rest:
        shown = {k: v for k, v in session.params.items()}
        print("\n".join(f"  {k.replace('_', '-')} = {v}" for k, v in shown.items()))
        print(f"  system = {session.system!r}")
        return
    name, _, value = rest.partition(" ")
    if name == "parameter":  # Ollama's spelling: /set parameter NAME VALUE
        name, _, value = value.strip().partition(" ")
    if name == "system":
        session.system = value.strip() or None
        print("Set the system message.")
        return
    try:
        parsed = session.parse(name, value)
        key = name.strip().lstrip("-").replace("-", "_")
        SamplingParams(**{**session.params, key: parsed})  # refuse a value the request would fail with
    except (ValueError, TypeError) as e:
        print(f"error: {session.explain(str(e))}")
        return
    session.params[key] = parsed
    print(f"Set {key.replace('_', '-')} to {parsed}.")


def _start_readline(history_file: Path | None) -> None:
    try:
        import readline
    except ImportError:  # no GNU readline / libedit: input() still reads lines
        return
    readline.set_history_length(HISTORY_LINES)
    if history_file is not None and history_file.is_file():
        with contextlib.suppress(OSError):
            readline.read_history_file(history_file)


def _save_history(history_file: Path | None) -> None:
    if history_file is None:
        return
    try:
        import readline
    except ImportError:
        return
    with contextlib.suppress(OSError):
        history_file.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(history_file)
