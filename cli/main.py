"""`tokenmill` command line: one parser, each command group registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tokenmill.cli.errors import EXIT_FAILURE, EXIT_USAGE, CommandFailed, UserError, say
from tokenmill.cli.settings import SettingError, SettingsParser

# Each module has `register(subparsers) -> None`; commands set `func(args) -> int` as their default.
COMMAND_MODULES = ("tokenmill.cli.engine_cmds", "tokenmill.cli.serve", "tokenmill.cli.gateway_cmds",
                   "tokenmill.cli.models_cmds", "tokenmill.cli.bench",
                   "tokenmill.cli.quantize", "tokenmill.cli.train_eagle")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tokenmill")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser is a SettingsParser: parsing resolves its settings (cli/settings.py) and raises
    SettingError on a bad value in the environment or a config file."""
    parser = SettingsParser(prog="tokenmill", description="LLM inference worker pool")
    parser.add_argument("--version", action="version", version=f"tokenmill {version()}")
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
    from tokenmill.protocol.logs import configure_from_env

    try:
        # Every command logs through structlog to stderr (stdout stays the command's output); the serving
        # commands set their own level and format from their settings when they start.
        configure_from_env("warning", export=False)
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (SettingError, UserError) as e:  # one line naming the variable, file key or flag; no traceback
        say(str(e), hints=False)
        return EXIT_USAGE
    except CommandFailed as e:
        say(str(e), hints=False)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
