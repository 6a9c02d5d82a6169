"""`tokenmill` command line: one parser, each command group registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module has `register(subparsers) -> None`; commands set `func(args) -> int` as their default.
COMMAND_MODULES = ("tokenmill.cli.engine_cmds", "tokenmill.cli.serve", "tokenmill.cli.gateway_cmds",
                   "tokenmill.cli.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference worker pool")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
