"""User errors of the `tokenmill` command: one line on stderr, exit status 2, never a traceback; and the
checks a command makes before it starts anything (the model exists, the device is there, the ports are
free), so that a mistake is reported by the process the user started.

Messages from the engine name Python keywords (`max_tokens`, `load_format='dummy'`); `flag_hints` rewrites
them as the command line's flags (`--max-tokens`, `--load-format dummy`)."""

from __future__ import annotations

import argparse
import re
import socket
import sys
from functools import cache
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

EXIT_USAGE = 2  # a user error (argparse's status for a bad command line)
EXIT_FAILURE = 1  # the command could not do its work (a port in use, no broker)


class UserError(Exception):
    """A mistake of the user's, said in one line (exit status 2)."""


class CommandFailed(Exception):
    """The command cannot run here and now (a port in use, no broker): one line, exit status 1."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose command-line errors are one line, as every other user error of `tokenmill` is
    (argparse prints the whole usage first: ~50 lines for `serve`), with a pointer to --help; exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@cache
def _flag_names() -> dict[str, str]:
    from tokenmill.cli.sampling_args import FLAGS
    from tokenmill.cli.settings import SETTINGS

    names = {s.name: s.flag for s in SETTINGS if s.flag and "_" in s.name}
    names |= {f.name: f.flag for f in FLAGS if "_" in f.name}
    return names


@cache
def _word_flag_names() -> dict[str, str]:
    """The one-word names ("temperature", "seed"), rewritten only where a message starts with one (in prose
    they are plain words)."""
    from tokenmill.cli.sampling_args import FLAGS
    from tokenmill.cli.settings import SETTINGS

    names = {s.name: s.flag for s in SETTINGS if s.flag and "_" not in s.name}
    names |= {f.name: f.flag for f in FLAGS if "_" not in f.name}
    return names


@cache
def _hint_pattern() -> re.Pattern[str]:
    names = sorted(_flag_names(), key=len, reverse=True)
    return re.compile(r"(?<![\w-])(" + "|".join(names) + r")\b(?:=('[^']*'|\"[^\"]*\"|[^\s,;)]+))?")


def flag_hints(message: str) -> str:
    """`message` with each setting or sampling keyword spelled as its flag: "lower max_tokens" -> "lower
    --max-tokens", "load_format='dummy'" -> "--load-format dummy"."""
    flags = _flag_names()

    def repl(m: re.Match[str]) -> str:
        value = m.group(2)
        flag = flags[m.group(1)]
        return flag if value is None else f"{flag} {value.strip(chr(39) + chr(34))}"

    message = _hint_pattern().sub(repl, message)
    first, sep, rest = message.partition(" must ")
    if sep and first in _word_flag_names():  # "temperature must be in [0, 100]"
        return f"{_word_flag_names()[first]}{sep}{rest}"
    return message


def say(message: str, hints: bool = True) -> None:
    """Print a one-line error; `hints`: rewrite the engine's keyword names as flags."""
    print(f"tokenmill: error: {flag_hints(message) if hints else message}", file=sys.stderr)


# ---- checks before a command starts anything ---------------------------------------------------------


def check_device(device: str) -> None:
    """A CUDA device where this machine has none is a user error (torch would fail deep in the load)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise UserError(f"--device {device}: CUDA is not available on this machine ({why}); "
                        "use --device cpu or --device auto")
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_model(model: str, load_format: str) -> None:
    """The model names something that exists (a path, a dummy shape, the embedded model); what the file
    holds is checked when it loads."""
    if load_format == "dummy":
        from tokenmill.worker.loader.dummy import DUMMY_SHAPES

        if model not in DUMMY_SHAPES:
            raise UserError(f"--model {model}: unknown dummy shape; known: {', '.join(DUMMY_SHAPES)}")
        return
    if model == "embedded":
        return
    path = Path(model).expanduser()
    if not path.exists():
        from tokenmill.worker.loader.dummy import DUMMY_SHAPES

        if model in DUMMY_SHAPES:
            raise UserError(f"--model {model}: a dummy shape name needs --load-format dummy")
        raise UserError(f"--model {model}: no such file or folder (a .gguf file, a Hugging Face folder, "
                        "'embedded', or a dummy shape with --load-format dummy)")


def tcp_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// ZeroMQ address or an http(s) URL; None for other transports."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        host = "0.0.0.0" if host in ("*", "") else host.strip("[]")
        return (host, int(port)) if port.isdigit() else None
    parts = urlsplit(address)
    if parts.scheme in ("http", "https") and parts.hostname:
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    return None


def port_in_use(host: str, port: int) -> bool:
    """Whether binding (host, port) fails now. SO_REUSEADDR as ZeroMQ and uvicorn set it, so a port left in
    TIME_WAIT by a process that just stopped counts as free, and one that something listens on does not."""
    if port == 0:
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_ports_free(*addresses: str) -> None:
    """Raises CommandFailed naming the first address some other process holds."""
    for address in addresses:
        ep = tcp_endpoint(address)
        if ep is not None and port_in_use(*ep):
            raise CommandFailed(f"{address}: port {ep[1]} is already in use (another tokenmill up/serve or "
                                "broker?); stop it or choose other ports")
