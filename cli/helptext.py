"""Help text rules shared by the commands whose options are not settings rows (cli/settings.py)."""

from __future__ import annotations

import argparse


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to every option's help that does not state its default yet, as the settings
    rows' help does (tests/test_cli.py checks every command)."""
    for action in parser._actions:
        if action.default is not argparse.SUPPRESS and "default" not in (action.help or ""):
            action.help = f"{action.help or action.dest.replace('_', ' ')} (default: " + (
                "required)" if action.required else "%(default)s)")
