"""`tokenmill generate --broker ADDR` and `tokenmill chat --broker ADDR`: the same flags and output as
the in-process commands, through a broker. Text deltas go to stdout as they arrive; errors to stderr."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from tokenmill.client.client import Client, StreamEvent
from tokenmill.protocol.errors import TokenmillError


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "top_p": args.top_p, "top_k": args.top_k, "stop": list(args.stop or [])}
    if args.seed is not None:
        params["seed"] = args.seed
    return params


def _print_events(events: Any) -> str:
    text = []
    ev: StreamEvent
    for ev in events:
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            text.append(ev.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


def _client(args: argparse.Namespace) -> Client:
    return Client(args.broker, curve_server_key=getattr(args, "curve_server_key", None),
                  curve_secret_key=getattr(args, "curve_secret", None))


def run_remote_generate(args: argparse.Namespace) -> int:
    """Stream one completion of `args.prompt` from the broker at `args.broker`; exit status 0/1."""
    try:
        with _client(args) as c:
            _print_events(c.stream(args.prompt, model=args.model, params=_sampling(args)))
    except TokenmillError as e:
        print(f"\ntokenmill: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def run_remote_chat(args: argparse.Namespace) -> int:
    """One chat turn (with `args.prompt`) or an interactive chat on stdin, through the broker."""
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    try:
        with _client(args) as c:
            if args.prompt is not None:
                _print_events(c.stream(messages=[*history, {"role": "user", "content": args.prompt}],
                                       model=args.model, params=_sampling(args)))
                return 0
            return _interactive(c, args, history)
    except TokenmillError as e:
        print(f"\ntokenmill: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _interactive(c: Client, args: argparse.Namespace, history: list[dict[str, str]]) -> int:
    return chat_loop(history, lambda h: _print_events(c.stream(messages=h, model=args.model,
                                                                params=_sampling(args))))


def chat_loop(history: list[dict[str, str]], answer: Callable[[list[dict[str, str]]], str]) -> int:
    """Interactive chat on stdin: each non-empty line is a user turn; `answer(history)` prints the reply
    as it streams and returns its text, which joins the history. Ends at end of input."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        history.append({"role": "assistant", "content": answer(history)})
