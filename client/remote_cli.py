"""`tokenmill generate --broker ADDR` and `tokenmill chat --broker ADDR`: the same flags and output as
the in-process commands, through a broker. Text deltas go to stdout as they arrive; errors to stderr.

`params` are SamplingParams fields, resolved by the command line (cli/sampling_args.py); errors are the
SDK's typed errors, which the command prints."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tokenmill.client.chat_repl import ChatSession, Delta, chat_loop, print_reply
from tokenmill.client.client import Client


def _client(args: argparse.Namespace) -> Client:
    return Client(args.broker, curve_server_key=getattr(args, "curve_server_key", None),
                  curve_secret_key=getattr(args, "curve_secret", None))


def _deltas(events: Iterator[Any]) -> Iterator[Delta]:
    """StreamEvents as Deltas; the stream's finally (on close) cancels an unfinished job."""
    with contextlib.closing(events):  # type: ignore[type-var]
        for ev in events:
            yield Delta(ev.text, ev.finish_reason)


def run_remote_generate(args: argparse.Namespace, params: dict[str, Any]) -> int:
    """Stream one completion of `args.prompt` from the broker at `args.broker`. Raises the job's typed error."""
    with _client(args) as c:
        print_reply(_deltas(c.stream(args.prompt, model=args.model, params=params)))
    return 0


def run_remote_chat(args: argparse.Namespace, params: dict[str, Any], parse: Callable[[str, str], Any],
                    history_file: Path | None = None, explain: Callable[[str], str] = str) -> int:
    """One chat turn (with `args.prompt`) or an interactive chat on stdin, through the broker. A one-turn
    chat raises the job's typed error; the interactive one prints it and goes on."""
    session = ChatSession(params, parse, system=args.system, raise_at_once=True, explain=explain)
    with _client(args) as c:
        def reply(messages: list[dict[str, str]], p: dict[str, Any]) -> Iterator[Delta]:
            return _deltas(c.stream(messages=messages, model=args.model, params=p))

        if args.prompt is not None:
            print_reply(reply(session.messages(args.prompt), params))
            return 0
        return chat_loop(session, reply, history_file)
