"""`tokenmill generate` and `tokenmill chat`: the engine in-process (or through a broker with --broker).
Generated text alone goes to stdout, as it is produced; logs, the spinner and errors go to stderr."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tokenmill.cli.errors import EXIT_USAGE, check_device, check_model, flag_hints, say
from tokenmill.cli.sampling_args import add_sampling_args, model_generation_defaults, parse_value, resolve_sampling
from tokenmill.cli.settings import CHAT, GENERATE, add_settings, build_config


def _add_model_args(p: argparse.ArgumentParser, command: str) -> None:
    add_settings(p, command)  # the engine's settings (cli/settings.py)
    p.add_argument("--broker", default=None,
                   help="go through a tokenmill broker (its frontend) at this address (default: none, the engine "
                        "runs in this process)")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr (default: off)")


def register(sub: Any) -> None:
    g = sub.add_parser("generate", help="complete raw text")
    g.add_argument("prompt")
    _add_model_args(g, GENERATE)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="answer through the model's chat template (interactive without PROMPT)")
    c.add_argument("prompt", nargs="?", default=None)
    c.add_argument("--system", default=None, help="system message (default: the chat template's)")
    _add_model_args(c, CHAT)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)


def history_file() -> Path:
    """Where the interactive chat keeps its input history (the user state directory)."""
    from platformdirs import user_state_path

    return user_state_path("tokenmill") / "chat_history"


def _params(args: argparse.Namespace) -> dict[str, Any]:
    """The request's sampling parameters: flags > the model's generation config > chat defaults."""
    return resolve_sampling(args, model_generation_defaults(args.model, args.load_format,
                                                            download=args.broker is None))


def _engine(args: argparse.Namespace) -> Any:
    from tokenmill.protocol.logs import configure_from_env

    configure_from_env("warning", level="info" if args.verbose else None)
    from tokenmill.client.chat_repl import Spinner
    from tokenmill.worker.config import EngineConfig
    from tokenmill.worker.engine import LLMEngine

    config = build_config(EngineConfig, args, args.command)
    check_device(config.device)
    check_model(config.model, config.load_format)
    with Spinner(f"loading {config.model}"):
        return LLMEngine(config)


def _engine_reply(engine: Any) -> Callable[..., Iterator[Any]]:
    """A chat_repl Reply over the in-process engine: its deltas; an error of the request raises."""
    from tokenmill.client.chat_repl import Delta
    from tokenmill.protocol import InvalidRequest, SamplingParams

    def reply(prompt: str | None, messages: list[dict[str, str]] | None, params: dict[str, Any]) -> Iterator[Delta]:
        outputs = engine.stream(prompt, SamplingParams(**params), messages=messages)
        try:
            for out in outputs:
                if out.finished and out.error:
                    raise InvalidRequest(out.error)
                yield Delta(out.text_delta, out.finish_reason if out.finished else None)
        finally:
            outputs.close()  # aborts the request when the reply is left early (Ctrl-C)

    return reply


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """User-facing errors become one clear line on stderr: exit status 2 for a bad request or model, 1 for
    an error of the pool."""

    def run(args: argparse.Namespace) -> int:
        from tokenmill.protocol import InvalidRequest, TokenmillError

        try:
            return int(fn(args))
        except InvalidRequest as e:
            say(str(e))
            return EXIT_USAGE
        except TokenmillError as e:
            say(f"{type(e).__name__}: {e}")
            return 1
        except FileNotFoundError as e:
            say(str(e))
            return EXIT_USAGE
        except RuntimeError as e:  # ModelLoadError (a RuntimeError; importing it would import torch)
            if type(e).__name__ != "ModelLoadError":
                raise
            say(str(e))
            return EXIT_USAGE

    return run


@_guard
def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.client.chat_repl import print_reply

    params = _params(args)
    if args.broker:
        from tokenmill.client.remote_cli import run_remote_generate

        return run_remote_generate(args, params)
    reply = _engine_reply(_engine(args))
    print_reply(reply(args.prompt, None, params))
    return 0


@_guard
def cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.client.chat_repl import ChatSession, chat_loop, print_reply

    params = _params(args)
    if args.broker:
        from tokenmill.client.remote_cli import run_remote_chat

        return run_remote_chat(args, params, parse_value, history_file(), flag_hints)
    reply = _engine_reply(_engine(args))
    session = ChatSession(params, parse_value, system=args.system, explain=flag_hints)
    if args.prompt is not None:
        print_reply(reply(None, session.messages(args.prompt), params))
        return 0
    return chat_loop(session, lambda messages, p: reply(None, messages, p), history_file())
