"""`tokenmill bench ...`: the benchmark suite and its parts (see benchmarks/README.md).

    tokenmill bench suite --device cpu          # the whole CPU suite -> benchmarks/results/cpu/
    tokenmill bench throughput --num-prompts 32 # offline throughput + the HF baseline
    tokenmill bench serving --rates 0.5,1,inf   # broker + worker + client SDK
    tokenmill bench ladder                      # static -> continuous -> prefix caching
    tokenmill bench plots benchmarks/results/cpu/suite.json
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from tokenmill.cli.errors import OneLineErrorParser

# command -> (module, help); each module has build_parser(parser) and run_cli(args) -> int. Their arguments
# are parsed by the module's own parser when the command runs, so `tokenmill` itself never imports torch.
COMMANDS = {
    "suite": ("tokenmill.benchmarks.suite", "the whole suite for one device (JSON, Markdown, PNGs)"),
    "throughput": ("tokenmill.benchmarks.throughput", "offline throughput and the HF generate() baseline"),
    "serving": ("tokenmill.benchmarks.serving", "serving through the broker: TTFT/TPOT/ITL at request rates"),
    "ladder": ("tokenmill.benchmarks.ladder", "the optimization ladder: static, continuous, prefix caching"),
}


def register(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks (results under benchmarks/results/<device>/)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, (module, text) in COMMANDS.items():
        # No option prefix: every word after the command (--help included) goes to the module's parser.
        p = bsub.add_parser(name, help=text, add_help=False, prefix_chars="\x00")
        p.add_argument("bench_args", nargs="*", help=f"arguments of {module} (see --help)")
        p.set_defaults(func=_runner(module, f"tokenmill bench {name}"))
    pl = bsub.add_parser("plots", help="draw the PNGs of a suite JSON")
    pl.add_argument("result", help="a suite.json")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default: beside the JSON)")
    pl.set_defaults(func=cmd_plots)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and every option's default."""


def bench_parser(module: str, prog: str) -> argparse.ArgumentParser:
    """The parser of a benchmark module as `tokenmill bench NAME` shows it: its usage lines say `prog`, not
    `python -m MODULE`, and every option shows its default."""
    mod = importlib.import_module(module)
    description = (mod.__doc__ or "").replace(f"python -m {module}", prog)
    parser: argparse.ArgumentParser = mod.build_parser(
        OneLineErrorParser(prog=prog, description=description, formatter_class=HelpFormatter))
    for action in parser._actions:
        if action.help is None and action.option_strings:
            action.help = "default: %(default)s"  # the formatter adds defaults only to options with a help text
    return parser


def _check(ns: argparse.Namespace) -> None:
    """The user errors of `generate` and `up` (a missing model, CUDA where there is none) are one line here
    too, before the benchmark loads anything (suite's --model without --load-format keeps each spec's own)."""
    from tokenmill.cli.errors import UserError, check_device, check_model

    device = getattr(ns, "device", None)
    if isinstance(device, str) and device.startswith("cuda"):
        check_device(device)
    model, load_format = getattr(ns, "model", None), getattr(ns, "load_format", None)
    if model and load_format:
        try:
            check_model(model, load_format)
        except UserError as e:
            if getattr(ns, "base_url", None):  # the server's model, but its tokenizer makes the prompts here
                raise UserError(f"{e}; with --base-url, --model must also load here (it tokenizes the "
                                "prompts)") from None
            raise


def _runner(module: str, prog: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        mod = importlib.import_module(module)
        ns = bench_parser(module, prog).parse_args(args.bench_args)
        _check(ns)
        return int(mod.run_cli(ns))

    return run


def cmd_plots(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from tokenmill.benchmarks.plots import plot_all

    path = Path(args.result)
    for p in plot_all(json.loads(path.read_text()), Path(args.out) if args.out else path.parent):
        print(p)
    return 0
