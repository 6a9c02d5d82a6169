"""The settings table (cli/settings.py): every environment variable parses strictly and lands in its config
field; bad values are one line naming the variable (through the real CLI in a subprocess too); the table
agrees with the config dataclasses, the product code's environment variables, docker-compose.yml and the
README; precedence is command line > environment > --config file > default."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill.broker import BrokerConfig
from tokenmill.cli import settings as st
from tokenmill.cli.main import build_parser, main
from tokenmill.cli.settings import SETTINGS, Setting, SettingError, build_config, settings_for, to_argv
from tokenmill.gateway.config import GatewayConfig
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.process import WorkerOptions

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, type] = {"EngineConfig": EngineConfig, "BrokerConfig": BrokerConfig, "WorkerOptions": WorkerOptions,
                             "GatewayConfig": GatewayConfig}
# Fields of the config dataclasses that are not user settings, and why.
NOT_SETTINGS = {
    "BrokerConfig.affinity_chunk_chars": "routing policy internals",
    "BrokerConfig.affinity_max_chunks": "routing policy internals",
    "BrokerConfig.affinity_slack": "routing policy internals",
    "BrokerConfig.max_body_bytes": "the protocol's limit",
    "BrokerConfig.hwm": "socket internals",
    "BrokerConfig.max_batch": "loop fairness internals",
    "BrokerConfig.gc_tuning": "tests turn it off",
    "BrokerConfig.unknown_model_grace": "start-up grace before unknown models are refused (docs/protocol.md)",
    "BrokerConfig.reply_budget.control_burst": "per-client bounds (docs/protocol.md)",
    "BrokerConfig.reply_budget.control_rate": "per-client bounds (docs/protocol.md)",
    "BrokerConfig.reply_budget.reject_burst": "per-client bounds (docs/protocol.md)",
    "BrokerConfig.reply_budget.reject_rate": "per-client bounds (docs/protocol.md)",
    "BrokerConfig.trim_interval": "memory upkeep internals (broker/memory.py)",
    "WorkerOptions.aliases": "from --model",
    "WorkerOptions.capacity": "from --max-num-seqs",
    "WorkerOptions.curve_server_key": "loaded from --curve-server-key",
    "WorkerOptions.curve_keypair": "loaded from --curve-secret",
    "WorkerOptions.idle_wait": "loop internals",
    "GatewayConfig.api_keys": "from --api-key and --api-key-file",
    "GatewayConfig.curve_server_key": "from --curve-server-key",
    "GatewayConfig.curve_secret_key": "from --curve-secret",
    "GatewayConfig.models": "from --model (repeatable; serve: the model it serves)",
    "GatewayConfig.stats_interval": "polling internals",
    "GatewayConfig.max_n": "the HTTP API's limit",
    "GatewayConfig.max_body_bytes": "the HTTP API's limit",
}
PRODUCT = ("protocol", "client", "broker", "worker", "kernels", "cli", "gateway")
# Variables whose test value EngineConfig refuses alone, and the other variables that value needs.
COMPANIONS = {"TOKENMILL_KV_CACHE_ROTATION": {"TOKENMILL_KV_CACHE_DTYPE": "fp8"}}


@pytest.fixture(autouse=True)
def _no_tokenmill_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without TOKENMILL_* variables."""
    for k in list(os.environ):
        if k.startswith("TOKENMILL_"):
            monkeypatch.delenv(k)


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _argv(command: str) -> list[str]:
    return [command, "a prompt"] if command == "generate" else [command]


def _command(s: Setting) -> str:
    return sorted(s.commands)[0]


# ---- values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["true", "TRUE", "True", "1", "yes", "Yes", "on", " on "])
def test_true_words(text: str) -> None:
    assert st.BOOL.parse(text) is True


@pytest.mark.parametrize("text", ["false", "FALSE", "0", "no", "NO", "off", "Off"])
def test_false_words(text: str) -> None:
    assert st.BOOL.parse(text) is False


@pytest.mark.parametrize("text", ["maybe", "2", "-1", "enabled", "t", "f", "nope", "true!", "0.0"])
def test_other_words_are_not_booleans(text: str) -> None:
    with pytest.raises(ValueError, match="expected a boolean"):
        st.BOOL.parse(text)


def test_open_jobs_false_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old parser turned any non-empty value but "0" on: TOKENMILL_OPEN_JOBS=false let any client cancel or
    read any job."""
    for text, want in (("false", False), ("off", False), ("0", False), ("true", True), ("yes", True), ("", False)):
        monkeypatch.setenv("TOKENMILL_OPEN_JOBS", text)
        assert build_config(BrokerConfig, parse(["broker"]), "broker").open_jobs is want, text
    monkeypatch.delenv("TOKENMILL_OPEN_JOBS")
    assert build_config(BrokerConfig, parse(["broker"]), "broker").open_jobs is False
    assert build_config(BrokerConfig, parse(["broker", "--open-jobs"]), "broker").open_jobs is True


def _good(s: Setting) -> tuple[str, Any]:
    """A valid text for the setting and the value it parses to (valid for its config dataclass too)."""
    k = s.kind
    if k.values:
        return k.values[-1], k.values[-1]
    if k is st.AUTO_BOOL:
        return "auto", None
    if k.is_bool:
        return ("off", False) if s.default else ("on", True)
    if k.describe.startswith("integer"):
        return "8", 8
    if k.describe.startswith("number"):
        return "0.5", 0.5
    return "some text", "some text"


def _bad(s: Setting) -> str | None:
    k = s.kind
    if k.values or k.is_bool:
        return "maybe"
    if k.describe.startswith("integer"):
        return "1.5"
    if k.describe.startswith("number"):
        return "fast"
    return None  # any text is valid text


ENV_ROWS = [s for s in SETTINGS if s.commands]


@pytest.mark.parametrize("s", ENV_ROWS, ids=lambda s: s.env)
def test_each_variable_parses_into_its_field(s: Setting, monkeypatch: pytest.MonkeyPatch) -> None:
    text, want = _good(s)
    for env, value in COMPANIONS.get(s.env, {}).items():
        monkeypatch.setenv(env, value)
    for command in sorted(s.commands):
        monkeypatch.setenv(s.env, text)
        ns = parse(_argv(command))
        assert getattr(ns, s.name) == want
        for path in s.fields:
            cls_name, *attrs = path.split(".")
            obj: Any = build_config(CONFIGS[cls_name], ns, command)
            for a in attrs:
                obj = getattr(obj, a)
            assert obj == want, (command, path)
        monkeypatch.delenv(s.env)
        assert getattr(parse(_argv(command)), s.name) == s.default_for(command)  # unset: the (command's) default


@pytest.mark.parametrize("s", [s for s in ENV_ROWS if _bad(s) is not None], ids=lambda s: s.env)
def test_each_bad_variable_is_one_line_naming_it(s: Setting, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(s.env, str(_bad(s)))
    with pytest.raises(SettingError, match=f"^{s.env}: expected"):
        parse([_command(s)])
    assert main([_command(s)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tokenmill: error: {s.env}: ") and "Traceback" not in err


def test_integer_and_number_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    for env, text in (("TOKENMILL_MAX_NUM_SEQS", "0"), ("TOKENMILL_QUEUE_TIMEOUT", "0"),
                      ("TOKENMILL_BUSY_POLL", "1.5"), ("TOKENMILL_GPU_MEMORY_UTILIZATION", "0"),
                      ("TOKENMILL_HEARTBEAT_INTERVAL", "-1"), ("TOKENMILL_RETENTION", "nan")):
        monkeypatch.setenv(env, text)
        command = "up" if env != "TOKENMILL_GPU_MEMORY_UTILIZATION" else "worker"
        with pytest.raises(SettingError, match=env):
            parse([command])
        monkeypatch.delenv(env)
    monkeypatch.setenv("TOKENMILL_RETENTION", "0")
    assert parse(["broker"]).retention == 0.0


def test_cache_variable_is_read_where_it_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tokenmill.worker.registry_fetch import cache_dir

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("TOKENMILL_CACHE", "")  # empty: unset, as for every other variable
    assert cache_dir() != tmp_path and cache_dir().name == "tokenmill"


def test_a_value_the_config_refuses_names_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingError, match=r"^--block-size: block_size must be a positive power of two"):
        build_config(EngineConfig, parse(["worker", "--block-size", "12"]), "worker")
    monkeypatch.setenv("TOKENMILL_BLOCK_SIZE", "24")
    with pytest.raises(SettingError, match=r"^TOKENMILL_BLOCK_SIZE: block_size must be"):
        build_config(EngineConfig, parse(["worker"]), "worker")


# ---- through the real CLI --------------------------------------------------------------------------


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(("args", "env", "named"), [
    (["broker"], {"TOKENMILL_OPEN_JOBS": "maybe"}, "TOKENMILL_OPEN_JOBS"),
    (["broker"], {"TOKENMILL_QUEUE_SIZE": "many"}, "TOKENMILL_QUEUE_SIZE"),
    (["worker"], {"TOKENMILL_MAX_NUM_SEQS": "lots"}, "TOKENMILL_MAX_NUM_SEQS"),
    (["worker"], {"TOKENMILL_BLOCK_SIZE": "12"}, "TOKENMILL_BLOCK_SIZE"),  # refused by CacheConfig
    (["up"], {"TOKENMILL_PREFIX_CACHING": "sometimes"}, "TOKENMILL_PREFIX_CACHING"),
    (["generate", "hi"], {"TOKENMILL_DTYPE": "int3"}, "TOKENMILL_DTYPE"),
])
def test_bad_variable_through_the_cli(args: list[str], env: dict[str, str], named: str) -> None:
    proc = _cli(args, env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"tokenmill: error: {named}"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bad_config_file_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "tm.toml"
    path.write_text('open_jobs = "maybe"\n')
    proc = _cli(["broker", "--config", str(path)], {})
    assert proc.returncode == 2 and proc.stderr == f"tokenmill: error: {path}: open_jobs: expected a boolean " \
        "(true/1/yes/on or false/0/no/off), got 'maybe'\n"


# ---- config file and precedence --------------------------------------------------------------------


def test_precedence_command_line_environment_file_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tm.toml"
    path.write_text("max_num_seqs = 4\nprefix_caching = false\nqueue_size = 9\ngpu_memory_utilization = 0.5\n")
    assert parse(["worker"]).max_num_seqs == 128  # default
    ns = parse(["worker", "--config", str(path)])
    assert (ns.max_num_seqs, ns.prefix_caching, ns.gpu_memory_utilization) == (4, False, 0.5)  # the file
    monkeypatch.setenv("TOKENMILL_MAX_NUM_SEQS", "5")
    assert parse(["worker", "--config", str(path)]).max_num_seqs == 5  # environment over file
    assert parse(["worker", "--config", str(path), "--max-num-seqs", "6"]).max_num_seqs == 6  # flag over both
    assert parse(["worker", "--config", str(path), "--prefix-caching"]).prefix_caching is True
    monkeypatch.setenv("TOKENMILL_CONFIG", str(path))  # the file named by the environment
    assert parse(["broker"]).queue_size == 9 and parse(["worker"]).prefix_caching is False


@pytest.mark.parametrize(("text", "error"), [
    ("max_num_seq = 4\n", "unknown setting 'max_num_seq'"),
    ("cache = '/tmp'\n", "unknown setting 'cache'"),  # environment only
    ("max_num_seqs = [1, 2]\n", "max_num_seqs: expected a single value"),
    ("max_num_seqs = 1.5\n", "max_num_seqs: expected an integer"),
    ("max_num_seqs = \n", "not valid TOML"),
])
def test_bad_config_files(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "tm.toml"
    path.write_text(text)
    with pytest.raises(SettingError, match=re.escape(error)):
        parse(["worker", "--config", str(path)])


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingError, match=r"config file .*nope\.toml"):
        parse(["broker", "--config", str(tmp_path / "nope.toml")])


def test_up_hands_its_resolved_settings_to_the_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tm.toml"
    path.write_text("max_num_seqs = 4\nbusy_poll = 0.02\n")
    monkeypatch.setenv("TOKENMILL_OPEN_JOBS", "yes")
    monkeypatch.setenv("TOKENMILL_CUDA_GRAPHS", "off")
    up = parse(["up", "--config", str(path), "--queue-size", "7", "--no-async-scheduling", "--liveness", "5"])
    broker_argv, worker_argv = to_argv(up, "broker"), to_argv(up, "worker")
    monkeypatch.delenv("TOKENMILL_OPEN_JOBS")
    monkeypatch.delenv("TOKENMILL_CUDA_GRAPHS")
    broker, worker = parse(["broker", *broker_argv]), parse(["worker", *worker_argv])
    for child, command in ((broker, "broker"), (worker, "worker")):
        shared = [s.name for s in settings_for(command) if "up" in s.commands]
        assert {n: getattr(child, n) for n in shared} == {n: getattr(up, n) for n in shared}
    assert (broker.open_jobs, broker.busy_poll, broker.queue_size, broker.liveness) == (True, 0.02, 7, 5)
    assert (worker.max_num_seqs, worker.cuda_graphs, worker.async_scheduling) == (4, False, False)


# ---- the table against the code --------------------------------------------------------------------


def _field_defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """'EngineConfig.cache.block_size' -> default, for every leaf field (nested config dataclasses walked)."""
    out: dict[str, Any] = {}
    obj = cls()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix or cls.__name__}.{f.name}"
        if dataclasses.is_dataclass(value):
            out |= _field_defaults(type(value), path)
        else:
            out[path] = value
    return out


def test_every_tunable_field_has_a_row_and_every_row_a_field() -> None:
    fields: dict[str, Any] = {}
    for cls in CONFIGS.values():
        fields |= _field_defaults(cls)
    covered = {f: s for s in SETTINGS for f in s.fields}
    assert set(covered) <= set(fields), set(covered) - set(fields)
    assert set(fields) - set(covered) == set(NOT_SETTINGS), "classify new config fields: a row or NOT_SETTINGS"
    for f, s in covered.items():  # one default, in the table and in the dataclass
        assert s.default == fields[f] and type(s.default) is type(fields[f]), (f, s.default, fields[f])


def test_worker_exposes_what_a_user_tunes() -> None:
    names = {s.name for s in settings_for("worker")}
    assert {"gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
            "dtype", "prefix_caching", "async_scheduling", "cuda_graphs", "pdl", "decode_rope"} <= names


def test_options_are_generated_from_the_rows() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("broker", "worker", "up", "generate", "chat"):
        parser = sub.choices[command]
        flags = {o for a in parser._actions for o in a.option_strings}
        want = {"-h", "--help", "--config"}
        for s in settings_for(command):
            assert s.flag is not None
            want |= {s.flag, "--no-" + s.flag[2:]} if s.kind.is_bool else {s.flag}
        from tokenmill.cli.sampling_args import FLAGS, STRUCTURED_FLAGS

        extra = {"generate": {"--broker", "-v", "--verbose", *(f.flag for f in FLAGS), *STRUCTURED_FLAGS.values()}}
        extra["chat"] = extra["generate"] | {"--system"}
        assert flags == want | extra.get(command, set()), command


def test_names_and_variables_are_unique() -> None:
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)
    assert all(s.env.startswith("TOKENMILL_") and re.fullmatch(r"[a-z][a-z0-9_]*", s.name) for s in SETTINGS)


def test_every_variable_the_product_reads_is_a_row() -> None:
    """The product packages name no TOKENMILL_* variable that the table lacks (benchmarks and tests have
    their own)."""
    known = {s.env for s in SETTINGS} | {st.CONFIG_ENV}
    found: dict[str, str] = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for name in re.findall(r"TOKENMILL_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
                found.setdefault(name, str(path.relative_to(ROOT)))
    assert {n: p for n, p in found.items() if n not in known} == {}


def test_compose_variables_are_rows_with_valid_values() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    by_env = {s.env: s for s in SETTINGS}
    seen = 0
    for svc in compose["services"].values():
        command = svc["command"][1]
        for env, value in svc["environment"].items():
            assert env in by_env and command in by_env[env].commands, (command, env)
            text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))  # ${X:-default} -> default
            by_env[env].kind.parse(text)
            seen += 1
    assert seen > 20


def test_readme_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert st.settings_markdown() in readme, "regenerate it: python -m tokenmill.cli.settings"
    assert st.PRECEDENCE in readme.replace("\n", " ")
