"""The one table of settings behind the serving commands (`tokenmill broker`, `worker`, `up`) and the
in-process engine commands (`generate`, `chat`).

Each row (`Setting`) is one setting: its name (the key in a `--config` TOML file and the attribute of the
parsed arguments), its command-line flag, its environment variable, its parser, default and help, the
commands that take it and the config dataclass field(s) it fills ("EngineConfig.cache.block_size").
`add_settings` makes the argparse options from the rows; `SettingsParser` resolves every row once, when
the arguments are parsed: command line > environment > config file > default. A bad value in the
environment or the file raises `SettingError` naming where it came from, which `tokenmill` prints as one
line (exit status 2); on the command line argparse reports it. `build_config` fills a config dataclass
from the resolved rows. tests/test_settings.py checks the table against the dataclasses and the README.

This module imports nothing of the worker (a broker host needs no torch): fields are named, not imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenmill.cli.errors import OneLineErrorParser

ENV_PREFIX = "TOKENMILL_"
CONFIG_ENV = "TOKENMILL_CONFIG"
PRECEDENCE = "command line > environment (TOKENMILL_*) > --config file > default"
_SOURCES = "_setting_sources"  # parsed-arguments attribute: setting name -> where its value came from

T = TypeVar("T")


class SettingError(ValueError):
    """A setting's value is invalid; the message names the variable, file key or flag it came from."""


# ---- parsers: text (environment, file) -> value; ValueError with a short reason ------------------------

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class Kind:
    """How a setting's text is parsed: `parse(text)` returns the value or raises ValueError."""

    describe: str  # for help and the README table: "integer >= 1", "boolean", "one of: a, b"
    parse: Callable[[str], Any]
    is_bool: bool = False
    values: tuple[str, ...] = ()  # a choice's values


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), got {text!r}")


def _auto_bool(text: str) -> bool | None:
    return None if text.strip().lower() == "auto" else _bool(text)


def _number(convert: Callable[[str], Any], what: str, low: float | None, low_open: bool,
            high: float | None) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = convert(text.strip())
        except ValueError:
            raise ValueError(f"expected {what}, got {text!r}") from None
        if v != v or (low is not None and (v <= low if low_open else v < low)) or (high is not None and v > high):
            raise ValueError(f"expected {what}, got {text!r}")
        return v

    return parse


def _bounds(low: float | None, low_open: bool, high: float | None) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"<= {high:g}" if high is not None else ""


def integer(low: int | None = None, high: int | None = None) -> Kind:
    what = f"an integer {_bounds(low, False, high)}".strip()
    return Kind(what.removeprefix("an "), _number(int, what, low, False, high))


def number(low: float | None = None, *, low_open: bool = False, high: float | None = None) -> Kind:
    what = f"a number {_bounds(low, low_open, high)}".strip()
    return Kind(what.removeprefix("a "), _number(float, what, low, low_open, high))


def choice(*values: str) -> Kind:
    def parse(text: str) -> str:
        t = text.strip().lower()
        if t not in values:
            raise ValueError(f"expected one of {', '.join(values)}, got {text!r}")
        return t

    return Kind(f"one of: {', '.join(values)}", parse, values=values)


def _text(text: str) -> str:
    return text


TEXT = Kind("text", _text)
BOOL = Kind("boolean", _bool, is_bool=True)
AUTO_BOOL = Kind("boolean or auto", _auto_bool, is_bool=True)  # None (auto): the config's own choice


# ---- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    name: str  # config-file key and parsed-argument attribute
    kind: Kind
    default: Any
    help: str
    commands: frozenset[str]
    fields: tuple[str, ...] = ()  # dataclass fields it fills: "EngineConfig.cache.block_size"
    env_name: str = ""  # default: TOKENMILL_<NAME>
    flag_name: str = ""  # default: --<name with dashes>; "-" for none (environment only)
    hidden: bool = False  # not in --help (test and benchmark hooks)
    default_text: str = ""  # how --help and the README show the default, where `default` says too little
    # (command, default) pairs of commands whose default differs: one chat needs no 128 sequences
    command_defaults: tuple[tuple[str, Any], ...] = ()

    @property
    def env(self) -> str:
        return self.env_name or ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str | None:
        if self.flag_name == "-":
            return None
        return self.flag_name or "--" + self.name.replace("_", "-")

    def default_for(self, command: str) -> Any:
        return dict(self.command_defaults).get(command, self.default)

    def shown_default(self, command: str | None = None) -> str:
        if self.default_text:
            return self.default_text
        value = self.default if command is None else self.default_for(command)
        if isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = "unset" if value is None else str(value)
        if command is None and self.command_defaults:
            text += "".join(f"; {c}: {v}" for c, v in self.command_defaults)
        return text


BROKER, WORKER, UP, GENERATE, CHAT = "broker", "worker", "up", "generate", "chat"
SERVE, GATEWAY = "serve", "gateway"  # serve: every setting of up, plus the gateway's
ENGINE_CMDS = frozenset({WORKER, UP, GENERATE, CHAT})  # the engine's settings
SERVING = frozenset({BROKER, WORKER, UP, GATEWAY})


def _s(name: str, kind: Kind, default: Any, help: str, commands: Iterable[str], *fields: str,
       **kw: Any) -> Setting:
    return Setting(name, kind, default, help, frozenset(commands), tuple(fields), **kw)


_B, _W, _U = (BROKER,), (WORKER,), (UP,)
SETTINGS: tuple[Setting, ...] = (
    # -- every serving process
    _s("log_level", choice("debug", "info", "warning", "error", "critical"), "info", "log level", SERVING),
    _s("log_json", BOOL, False, "log JSON lines (one object per line) instead of text", SERVING),
    _s("log_format", choice("auto", "json", "console"), "auto", "log lines as JSON or console text (auto: console "
       "on a terminal, JSON otherwise; --log-json forces JSON)", SERVING),
    # -- broker
    _s("frontend", TEXT, "tcp://127.0.0.1:5555", "address clients connect to", (BROKER, UP), "BrokerConfig.frontend"),
    _s("backend", TEXT, "tcp://127.0.0.1:5556", "address workers connect to", (BROKER, UP), "BrokerConfig.backend"),
    _s("queue_size", integer(1), 256, "queued jobs per model past which new ones get OVERLOADED", (BROKER, UP),
       "BrokerConfig.queue_size"),
    _s("queue_timeout", number(0, low_open=True), 60.0, "seconds a job may wait for a worker before it fails "
       "(deadline)", (BROKER, UP), "BrokerConfig.queue_timeout"),
    _s("default_timeout", number(0, low_open=True), None, "deadline in seconds of a job that names none",
       (BROKER, UP), "BrokerConfig.default_timeout", default_text="none"),
    _s("client_timeout", number(0, low_open=True), 10.0, "seconds of silence after which a client with open jobs "
       "is gone (its jobs are cancelled)", (BROKER, UP), "BrokerConfig.client_timeout"),
    _s("liveness", integer(1), 3, "heartbeat intervals of silence after which the other side is dead",
       (BROKER, WORKER, UP), "BrokerConfig.liveness", "WorkerOptions.liveness"),
    _s("retention", number(0), 60.0, "seconds finished jobs (and their token logs) are kept for subscribers",
       (BROKER, UP), "BrokerConfig.retention"),
    _s("max_retained", integer(0), 10_000, "finished jobs kept at most", (BROKER, UP), "BrokerConfig.max_retained"),
    _s("migration_limit", integer(0), 3, "dying workers a job may run on before it fails", (BROKER, UP),
       "BrokerConfig.migration_limit"),
    _s("drain_timeout", number(0), 30.0, "seconds SIGTERM / Ctrl-C waits for in-flight jobs (a gateway: for its "
       "requests in flight) before it cuts them", (BROKER, UP, GATEWAY),
       "BrokerConfig.drain_timeout", "GatewayConfig.drain_timeout"),
    _s("busy_poll", number(0, high=1), 0.0, "seconds to keep polling without sleeping after each message (0: off); "
       "lower relay latency for a broker that owns a core, at 100% of that core while tokens flow",
       (BROKER, UP), "BrokerConfig.busy_poll"),
    _s("open_jobs", BOOL, False, "let any client cancel or subscribe to any job", (BROKER, UP),
       "BrokerConfig.open_jobs"),
    _s("curve_secret", TEXT, None, "this process's NAME.key_secret file: the broker's turns CURVE on for both its "
       "sockets; a worker's or gateway's needs --curve-server-key too", (BROKER, WORKER, GATEWAY),
       "BrokerConfig.curve_secret_file"),
    _s("curve_allow", TEXT, None, "broker: directory of the admitted public *.key files", _B,
       "BrokerConfig.curve_allow_dir"),
    # -- worker process
    _s("broker", TEXT, "tcp://127.0.0.1:5556", "the broker's backend address", _W, "WorkerOptions.broker"),
    _s("name", TEXT, "", "worker name", _W, "WorkerOptions.name",
       env_name="TOKENMILL_WORKER_NAME", default_text="worker-<pid>"),
    _s("heartbeat_interval", number(0, low_open=True), 1.0, "seconds between heartbeats", (WORKER, UP),
       "WorkerOptions.heartbeat_interval"),
    _s("curve_server_key", TEXT, None, "worker, gateway: the broker's public key (a file or z85 text)",
       (WORKER, GATEWAY)),
    _s("role", choice("both", "prefill", "decode"), "both", "disaggregated serving: a prefill worker computes prompts "
       "and hands their KV blocks to a decode worker, which streams the tokens (both: whole jobs; the broker uses "
       "prefill + decode workers when it has both kinds)", _W, "WorkerOptions.role"),
    _s("kv_address", TEXT, "tcp://127.0.0.1:*", "decode worker: where it receives KV blocks (* = a free port); "
       "prefill workers connect to it", _W, "WorkerOptions.kv_address"),
    _s("kv_timeout", number(0, low_open=True), 30.0, "decode worker: seconds to wait for a job's KV blocks before "
       "computing its prompt itself", _W, "WorkerOptions.kv_timeout"),
    _s("engine_factory", TEXT, None, "module:callable building the engine from the parsed arguments (tests, "
       "benchmarks)", _W, hidden=True),
    # -- engine
    _s("model", TEXT, "embedded", "HF folder, .gguf file, dummy shape name, or 'embedded' (SmolLM2-135M-Instruct)",
       ENGINE_CMDS, "EngineConfig.model"),
    _s("load_format", choice("auto", "hf", "gguf", "dummy"), "auto", "how to read --model", ENGINE_CMDS,
       "EngineConfig.load_format"),
    _s("gguf_native", choice("auto", "on", "off"), "auto", "GGUF Q8_0 / Q4_0 / Q4_1 projections: run from their "
       "blocks (on), or dequantize on load (off); auto: native on CUDA when all projections share one of these "
       "types, dequantized on the CPU (faster there)", ENGINE_CMDS, "EngineConfig.gguf_native"),
    _s("dtype", choice("auto", "float32", "float16", "bfloat16"), "auto", "weights and activations (auto: "
       "bfloat16 on CUDA, float32 on CPU)", ENGINE_CMDS, "EngineConfig.dtype"),
    _s("device", TEXT, "auto", "torch device (auto: cuda if available, else cpu)", ENGINE_CMDS, "EngineConfig.device"),
    _s("quantization", choice("auto", "int8", "int4", "fp8"), "auto", "decoder-layer weights: auto (the "
       "checkpoint's own: dense, or its GPTQ / AWQ / compressed-tensors / fp8 quantization_config), or quantize a "
       "dense checkpoint on load: int8 (W8A16 per channel), int4 (W4A16, groups of 128), fp8 (W8A8 e4m3, needs a "
       "GPU of compute capability >= 8.9)", ENGINE_CMDS, "EngineConfig.quantization"),
    _s("kv_cache_dtype", choice("auto", "fp8"), "auto", "KV-cache element type (auto: the model dtype; fp8: "
       "e4m3 with per-head scales calibrated on the first step, twice the blocks; needs a GPU of compute "
       "capability >= 8.9)", ENGINE_CMDS,
       "EngineConfig.kv_cache_dtype"),
    _s("kv_cache_rotation", choice("none", "hadamard"), "none", "with --kv-cache-dtype fp8 only: hadamard rotates "
       "keys (after rotary, queries alike) and values by an orthonormal Hadamard matrix before they are cached, and "
       "the attention output back: outlier channels spread over the head, so less e4m3 rounding error. Needs a "
       "power-of-two head dim; decode steps then take the unfused rotary path, whose GPU speed cost is unmeasured",
       ENGINE_CMDS, "EngineConfig.kv_cache_rotation"),
    _s("tensor_parallel_size", integer(1), 1, "ranks the model is split over, one process and device each (on CUDA "
       "GPUs k..k+N-1 of --device cuda:k); N must divide the model's KV heads; the broker sees one worker",
       ENGINE_CMDS, "EngineConfig.tensor_parallel_size"),
    _s("max_model_len", integer(1), None, "context length", ENGINE_CMDS,
       "EngineConfig.max_model_len", default_text="the model's"),
    _s("seed", integer(), 0, "seed of the per-request seeds of requests that name none", (WORKER, UP),
       "EngineConfig.seed"),  # (generate and chat: --seed is the request's own)
    _s("attention_backend", choice("auto", "torch", "triton"), "auto", "attention (auto: triton on CUDA)",
       ENGINE_CMDS, "EngineConfig.attention_backend"),
    _s("decode_rope", BOOL, True, "triton: decode-only steps rotate q/k and write the KV cache in the attention "
       "kernel (off: a separate rotary kernel)", ENGINE_CMDS, "EngineConfig.decode_rope_in_attention"),
    _s("pdl", BOOL, True, "programmatic dependent launch of the Triton kernels on Hopper and later", ENGINE_CMDS,
       "EngineConfig.kernels.pdl"),
    _s("fp8_skinny_kernel", BOOL, False, "--quantization fp8: matmuls of up to 16 tokens through the fused Triton "
       "kernel instead of torch._scaled_mm (slower on the H200 so far)", ENGINE_CMDS,
       "EngineConfig.kernels.fp8_skinny"),
    _s("cuda_graphs", BOOL, True, "replay decode-only steps from captured CUDA graphs", ENGINE_CMDS,
       "EngineConfig.cuda_graphs"),
    _s("piecewise_graphs", BOOL, True, "with cuda_graphs: steps with prompt tokens replay piecewise CUDA graphs "
       "(attention launched between the pieces)", ENGINE_CMDS, "EngineConfig.piecewise_graphs"),
    _s("whole_step_graphs", BOOL, True, "with piecewise_graphs: steps of up to 2,048 tokens whose attention launch "
       "was captured replay one whole-step CUDA graph, attention inside (more graphs captured at start-up)",
       ENGINE_CMDS, "EngineConfig.whole_step_graphs"),
    _s("async_scheduling", AUTO_BOOL, None, "schedule step N+1 while step N runs on the device", ENGINE_CMDS,
       "EngineConfig.async_scheduling", default_text="auto (on for CUDA)"),
    _s("block_size", integer(1), 16, "tokens per KV-cache block (a power of two)", ENGINE_CMDS,
       "EngineConfig.cache.block_size"),
    _s("gpu_memory_utilization", number(0, low_open=True, high=1), 0.9, "share of the GPU's memory the worker may "
       "use (weights, activations, KV cache)", ENGINE_CMDS, "EngineConfig.cache.gpu_memory_utilization"),
    _s("cpu_kv_bytes", integer(1), 1 << 30, "KV-cache bytes on CPU at most (the cache is sized for max_num_seqs "
       "requests of max_model_len tokens, up to this)", ENGINE_CMDS, "EngineConfig.cache.cpu_kv_bytes"),
    _s("num_blocks", integer(1), None, "KV-cache blocks (overrides the two sizes above)", ENGINE_CMDS,
       "EngineConfig.cache.num_blocks", default_text="from the memory"),
    _s("prefix_caching", BOOL, True, "reuse the KV blocks of shared prompt prefixes", ENGINE_CMDS,
       "EngineConfig.cache.enable_prefix_caching"),
    _s("max_num_batched_tokens", integer(1), 2048, "tokens one step computes at most", ENGINE_CMDS,
       "EngineConfig.scheduler.max_num_batched_tokens"),
    _s("max_num_seqs", integer(1), 128, "requests one step runs at most (also the worker's capacity; on CPU the KV "
       "cache holds max_num_seqs x max_model_len tokens, within cpu_kv_bytes)", ENGINE_CMDS,
       "EngineConfig.scheduler.max_num_seqs", command_defaults=((GENERATE, 1), (CHAT, 1))),
    _s("scheduling_policy", choice("fcfs", "priority"), "fcfs", "order of the waiting requests", ENGINE_CMDS,
       "EngineConfig.scheduler.policy"),
    _s("chunked_prefill", BOOL, True, "split long prompts over several steps", ENGINE_CMDS,
       "EngineConfig.scheduler.enable_chunked_prefill"),
    _s("long_prefill_token_threshold", integer(0), 0, "cut prefill chunks longer than this (0: no extra cap)",
       ENGINE_CMDS, "EngineConfig.scheduler.long_prefill_token_threshold"),
    _s("speculative", choice("off", "ngram", "eagle"), "off", "speculative decoding: draft tokens verified in one "
       "target forward, output unchanged (ngram: prompt lookup in the request's own tokens; eagle: an EAGLE-1 "
       "draft head)", ENGINE_CMDS, "EngineConfig.speculative.method"),
    _s("draft_model", TEXT, None, "eagle: folder of the draft head (made by `tokenmill train-eagle`)", ENGINE_CMDS,
       "EngineConfig.speculative.draft_model", default_text="the head shipped for the model"),
    _s("speculative_auto_switch", AUTO_BOOL, None, "with --speculative: pause speculation while the batch is large "
       "enough that verifying drafts costs more than it saves (costs measured at start-up)", ENGINE_CMDS,
       "EngineConfig.speculative.auto_switch", default_text="auto (on for CUDA)"),
    _s("num_speculative_tokens", integer(1), 3, "with --speculative: draft tokens per request and step, 1..16 "
       "(a request's num_speculative_tokens overrides it; 0 there turns it off)", ENGINE_CMDS,
       "EngineConfig.speculative.num_speculative_tokens"),
    _s("prompt_lookup_max", integer(1), 8, "ngram: longest suffix looked up", ENGINE_CMDS,
       "EngineConfig.speculative.prompt_lookup_max"),
    _s("prompt_lookup_min", integer(1), 1, "ngram: shortest suffix looked up", ENGINE_CMDS,
       "EngineConfig.speculative.prompt_lookup_min"),
    _s("eagle_lookup_min", integer(0), 0, "eagle: a request whose last N (up to --prompt-lookup-max) tokens occur "
       "earlier in its own tokens drafts by prompt lookup in that step, the others by the head (0: the head alone)",
       ENGINE_CMDS, "EngineConfig.speculative.eagle_lookup_min"),
    _s("speculative_tree_width", integer(1), 1, "draft a tree of at most --num-speculative-tokens nodes, verified "
       "in one forward (1: a chain); ngram: merge up to this many different continuations; eagle: the head's top "
       "this-many per level, the best nodes by cumulative log-prob", ENGINE_CMDS,
       "EngineConfig.speculative.tree_width"),
    # -- up
    _s("workers", integer(1), 1, "workers to start", _U),
    _s("ready_timeout", number(0, low_open=True), 600.0, "seconds to wait for the workers", _U),
    # -- the HTTP gateway (serve, gateway)
    _s("broker_address", TEXT, "tcp://127.0.0.1:5555", "gateway: the broker's client (frontend) address",
       (GATEWAY,), "GatewayConfig.broker", flag_name="--broker"),
    _s("host", TEXT, "127.0.0.1", "HTTP address the gateway binds", (SERVE, GATEWAY), "GatewayConfig.host"),
    _s("port", integer(0, 65535), 8000, "HTTP port of the gateway", (SERVE, GATEWAY), "GatewayConfig.port"),
    _s("api_key_file", TEXT, None, "file of accepted API keys, one per line (with --api-key: requests need "
       "'Authorization: Bearer KEY'; each key is its own tenant)", (SERVE, GATEWAY)),
    _s("request_timeout", number(0, low_open=True), None, "deadline in seconds of each HTTP request's jobs",
       (SERVE, GATEWAY), "GatewayConfig.request_timeout", default_text="the broker's"),
    _s("health_stale", number(0, low_open=True), 2.5, "/health: seconds without a worker heartbeat before the "
       "worker counts as down", (SERVE, GATEWAY), "GatewayConfig.heartbeat_stale"),
    _s("progress_stall", number(0, low_open=True), 10.0, "/health: seconds a worker with work may go without an "
       "engine step", (SERVE, GATEWAY), "GatewayConfig.progress_stall"),
    _s("access_log", BOOL, False, "log every HTTP request", (SERVE, GATEWAY), "GatewayConfig.log_requests"),
    _s("gateway_workers", integer(1), 1, "gateway processes sharing the HTTP port (SO_REUSEPORT), each with its "
       "own event loop", (SERVE, GATEWAY), "GatewayConfig.workers"),
    # -- read where it is used (worker/registry_fetch.py), listed for the README and the tests
    _s("cache", TEXT, None, "folder of the fetched embedded model", (), env_name="TOKENMILL_CACHE", flag_name="-",
       default_text="the user cache directory"),
)
# `serve` is `up` plus the gateway: it takes every row of `up`.
SETTINGS = tuple(dataclasses.replace(s, commands=s.commands | {SERVE}) if UP in s.commands else s for s in SETTINGS)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def settings_for(command: str) -> list[Setting]:
    return [s for s in SETTINGS if command in s.commands]


# ---- argparse ---------------------------------------------------------------------------------------


def _arg_type(s: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return s.kind.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = s.name  # argparse names the type in some messages
    return parse


def add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of `command`'s rows, plus --config. Nothing is defaulted here: SettingsParser resolves
    each setting left off the command line from the environment, the file or the row's default."""
    assert isinstance(parser, SettingsParser), "add_subparsers of a SettingsParser makes SettingsParsers"
    rows = settings_for(command)
    parser.setting_rows = rows
    parser.setting_command = command
    parser.epilog = (f"Each option also reads its environment variable; precedence: {PRECEDENCE}. Booleans: "
                     f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}.")
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML file of settings (keys: the option names with underscores) "
                             f"[env {CONFIG_ENV}; default none]")
    for s in rows:
        if s.flag is None:
            continue
        text = argparse.SUPPRESS if s.hidden else f"{s.help} [env {s.env}; default {s.shown_default(command)}]".replace(
            "%", "%%")
        if s.kind.is_bool:
            parser.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(s.flag, dest=s.name, type=_arg_type(s), default=argparse.SUPPRESS, help=text,
                                metavar="{" + ",".join(s.kind.values) + "}" if s.kind.values else s.name.upper())


class SettingsParser(OneLineErrorParser):
    """An ArgumentParser that, after parsing, gives each of its rows (`add_settings`) its value from the
    environment, the --config file or the default when the command line left it off."""

    setting_rows: Sequence[Setting] = ()  # set per instance by add_settings
    setting_command: str = ""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        if self.setting_rows:
            resolve(ns, self.setting_rows, os.environ, self.setting_command)
        return ns, rest


def resolve(ns: argparse.Namespace, rows: Sequence[Setting], environ: Mapping[str, str], command: str = "") -> None:
    """Fill every row left off the command line: environment > config file > default (`command`'s own, where
    the row has one). Records where each value came from (for error messages). Raises SettingError."""
    sources: dict[str, str] = {}
    path = getattr(ns, "config", None) or environ.get(CONFIG_ENV) or None
    ns.config = path
    from_file = read_config_file(path) if path else {}
    for s in rows:
        if hasattr(ns, s.name):
            sources[s.name] = s.flag or s.name
            continue
        raw = environ.get(s.env, "")
        if raw != "":  # empty: unset (as docker compose writes `${X:-}`)
            setattr(ns, s.name, _parse(s, raw, s.env))
            sources[s.name] = s.env
        elif s.name in from_file:
            setattr(ns, s.name, _parse(s, from_file[s.name], f"{path}: {s.name}"))
            sources[s.name] = f"{path}: {s.name}"
        else:
            setattr(ns, s.name, s.default_for(command))
    setattr(ns, _SOURCES, sources)


def _parse(s: Setting, raw: str, where: str) -> Any:
    try:
        return s.kind.parse(raw)
    except ValueError as e:
        raise SettingError(f"{where}: {e}") from None


def read_config_file(path: str) -> dict[str, str]:
    """A TOML file of `name = value` settings, values as text for the rows' parsers. Unknown names (typos)
    are errors; names of other commands' settings are allowed (one file can serve `up` and every process)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise SettingError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingError(f"config file {path}: not valid TOML ({e})") from None
    out: dict[str, str] = {}
    for key, value in data.items():
        if key not in BY_NAME or BY_NAME[key].flag is None:
            raise SettingError(f"{path}: unknown setting {key!r}")
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, int | float | str):
            out[key] = str(value)
        else:
            raise SettingError(f"{path}: {key}: expected a single value, got {type(value).__name__}")
    return out


def to_argv(ns: argparse.Namespace, command: str, skip: Iterable[str] = ()) -> list[str]:
    """Command-line flags giving `command`'s rows their resolved values in `ns` (for a child process):
    rows unset (None) are left off, so the child resolves them as this process did."""
    argv: list[str] = []
    skipped = set(skip)
    for s in settings_for(command):
        if s.flag is None or s.name in skipped or not hasattr(ns, s.name):
            continue
        value = getattr(ns, s.name)
        if value is None:
            continue
        if s.kind.is_bool:
            argv.append(s.flag if value else "--no-" + s.flag[2:])
        else:
            argv += [s.flag, str(value)]
    return argv


# ---- config dataclasses -----------------------------------------------------------------------------


def build_config(cls: type[T], ns: argparse.Namespace, command: str, **extra: Any) -> T:
    """`cls()` with every field that `command`'s rows fill set from `ns` (plus `extra` top-level fields).
    The dataclass validates; a ValueError becomes a SettingError naming the setting and its source."""
    values = {path: getattr(ns, s.name) for s in settings_for(command) for path in _paths(s, cls)}
    try:
        return _with_values(cls(), values, extra)
    except (TypeError, ValueError) as e:
        raise SettingError(_blame(cls, ns, command, e)) from None


def _paths(s: Setting, cls: type) -> list[tuple[str, ...]]:
    prefix = cls.__name__ + "."
    return [tuple(f.removeprefix(prefix).split(".")) for f in s.fields if f.startswith(prefix)]


def _with_values(obj: Any, values: Mapping[tuple[str, ...], Any], extra: Mapping[str, Any]) -> Any:
    top: dict[str, Any] = dict(extra)
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, v in values.items():
        if len(path) == 1:
            top[path[0]] = v
        else:
            nested.setdefault(path[0], {})[path[1:]] = v
    for name, sub in nested.items():
        top[name] = _with_values(getattr(obj, name), sub, {})
    return dataclasses.replace(obj, **top)


def _blame(cls: type, ns: argparse.Namespace, command: str, err: Exception) -> str:
    """The first setting that fails on its own, with where its value came from; else the error alone."""
    sources = getattr(ns, _SOURCES, {})
    for s in settings_for(command):
        paths = _paths(s, cls)
        if not paths:
            continue
        try:
            _with_values(cls(), {p: getattr(ns, s.name) for p in paths}, {})
        except (TypeError, ValueError):
            where = sources.get(s.name, f"default of {s.name}")
            return f"{where}: {err}"
    return f"{cls.__name__}: {err}"


# ---- documentation ----------------------------------------------------------------------------------


def settings_markdown() -> str:
    """The README's table of settings (tests/test_settings.py checks that the README holds this text)."""
    rows = ["| setting (file key) | flag | environment | value | default | commands | fills |",
            "|---|---|---|---|---|---|---|"]
    for s in SETTINGS:
        if s.hidden:
            continue
        flag = "" if s.flag is None else f"`{s.flag}`" + (f" / `--no-{s.flag[2:]}`" if s.kind.is_bool else "")
        commands = ", ".join(c for c in (BROKER, WORKER, UP, GENERATE, CHAT) if c in s.commands) or "-"
        fills = ", ".join(f"`{f}`" for f in s.fields) or "-"
        rows.append(f"| `{s.name}` | {flag or '-'} | `{s.env}` | {s.kind.describe} | {s.shown_default()} | "
                    f"{commands} | {fills} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(settings_markdown(), end="")
