"""benchmarks/results/<device>/summary.json: the committed files parse, hold figures derived from the result
files beside them, use only keys that benchmarks/README.md defines; the merge and the per-benchmark
extraction keep to the keys' definitions."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tokenmill.benchmarks import summary
from tokenmill.benchmarks.common import device_info, git_commit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SUMMARIES = sorted(RESULTS.glob("*/summary.json"))
ISSUE_12_KEYS = ("sharegpt_200_req_s", "fixed_1000x1000_out_tok_s", "decode_b1_ms", "latency_config_ms",
                 "prefix_ttft_gain_1k", "prefix_ttft_gain_2k", "mixed_step_host_ms", "serving_ttft_p99_ms_25pct",
                 "serving_ttft_p99_ms_50pct", "hf_static_ratio", "broker_relay_tok_s", "broker_added_p99_ms")


def _readme_keys() -> list[str]:
    text = (ROOT / "benchmarks" / "README.md").read_text()
    table = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M)


def test_readme_defines_exactly_the_known_keys() -> None:
    assert sorted(_readme_keys()) == sorted(summary.KEYS)
    assert set(ISSUE_12_KEYS) <= set(summary.KEYS)


@pytest.mark.parametrize("path", SUMMARIES, ids=lambda p: p.parent.name)
def test_committed_summary_parses_and_matches_its_sources(path: Path) -> None:
    data = summary.load(path)
    assert data, path
    for key, rec in data.items():
        source = json.loads((path.parent / rec["source"]).read_text())
        derived = summary.figures_of(source)
        assert key in derived, (key, rec["source"])
        assert rec["value"] == pytest.approx(derived[key], abs=1e-3), key
    assert (path.parent / "summary.md").read_text() == summary.markdown(path.parent, data)
    assert (path.parent / "NOTES.md").is_file()


def test_h200_summary_holds_every_issue_12_key() -> None:
    data = summary.load(RESULTS / "h200" / "summary.json")
    assert set(ISSUE_12_KEYS) <= set(data)


# -- the merge --------------------------------------------------------------------------------------------


def test_update_merges_and_keeps_other_keys(tmp_path: Path) -> None:
    summary.update(tmp_path, {"decode_b1_ms": 4.16512, "latency_config_ms": 620.0}, commit="aaa",
                   date="2026-12-01", source="gpu_e2e_llama3-8b.json")
    data = summary.update(tmp_path, {"broker_relay_tok_s": 649746, "decode_b1_ms": 4.1}, commit="bbb",
                          date="2026-12-02", source="broker_relay.json")
    assert data == summary.load(tmp_path / "summary.json")
    assert list(data) == ["decode_b1_ms", "latency_config_ms", "broker_relay_tok_s"]  # KEYS order
    assert data["latency_config_ms"] == {"value": 620.0, "commit": "aaa", "date": "2026-12-01",
                                         "source": "gpu_e2e_llama3-8b.json"}
    assert data["decode_b1_ms"] == {"value": 4.1, "commit": "bbb", "date": "2026-12-02", "source": "broker_relay.json"}
    assert data["broker_relay_tok_s"]["value"] == 649746
    md = (tmp_path / "summary.md").read_text()
    assert "| `decode_b1_ms` | 4.1 | ms | bbb | 2026-12-02 |" in md
    assert "| broker_relay.json | (not in this folder) | |" in md


@pytest.mark.parametrize(("figures", "kw", "match"), [
    ({"not_a_key": 1.0}, {}, "not a known key"),
    ({"decode_b1_ms": math.nan}, {}, "finite"),
    ({"decode_b1_ms": True}, {}, "finite"),
    ({"decode_b1_ms": 4.0}, {"date": "1 Dec"}, "YYYY-MM-DD"),
    ({"decode_b1_ms": 4.0}, {"commit": " "}, "commit"),
])
def test_update_refuses_bad_figures_and_writes_nothing(tmp_path: Path, figures: dict[str, Any],
                                                       kw: dict[str, str], match: str) -> None:
    args = {"commit": "aaa", "date": "2026-12-01", "source": "x.json"} | kw
    with pytest.raises(ValueError, match=match):
        summary.update(tmp_path, figures, **args)
    assert not (tmp_path / "summary.json").exists()


def test_load_refuses_unknown_keys_and_bad_records(tmp_path: Path) -> None:
    p = tmp_path / "summary.json"
    p.write_text(json.dumps({"made_up": {"value": 1, "commit": "a", "date": "2026-12-01", "source": "x"}}))
    with pytest.raises(ValueError, match="not a known key"):
        summary.load(p)
    p.write_text(json.dumps({"decode_b1_ms": 4.2}))
    with pytest.raises(ValueError, match="want"):
        summary.load(p)


# -- figures from result files ---------------------------------------------------------------------------------


def _rate(ttft_p99: float, failed: int = 0) -> dict[str, Any]:
    return {"rate": 1.0, "completed": 10, "failed": failed, "latency": {"ttft_ms": {"p99": ttft_p99}}}


def _gpu_suite(commit: str = "abc1234") -> dict[str, Any]:
    return {
        "command": "python -m tokenmill.benchmarks.suite --device gpu", "commit": commit,
        "measured": "2026-12-02T10:00:00+00:00", "device": {"gpu": "NVIDIA H200", "triton": "3.6.0"},
        "sections_s": {},
        "config": {"sharegpt_prompts": 200, "sharegpt_max_input": 1024, "sharegpt_max_output": None,
                   "fixed_in": 1000, "fixed_out": 1000, "serving_rates": [],
                   "serving_rate_fractions": [0.25, 0.5, 0.75, "inf"]},
        "sharegpt": {"completed": 200, "failed": 0, "requests_per_s": 28.8},
        "fixed": {"completed": 1000, "failed": 0, "output_tok_per_s": 9863.0},
        "hf_compare": {"ratio_output_tok_s": 20.5},
        "prefix": {"variants": [{"system_len": 1000, "gain": {"ttft_p50_ratio": 1.45}},
                                {"system_len": 2048, "gain": {"ttft_p50_ratio": 2.87}}],
                   "anatomy": {"device": "cuda", "running": 16, "system_prompt_tokens": 1000, "new_tokens": 136,
                               "kinds": {"decode-only": {"host_ms": 1.3, "prompt_tokens": 0},
                                         "cached": {"host_ms": 15.7, "prompt_tokens": 144},
                                         "uncached": {"host_ms": 16.4, "prompt_tokens": 1136}}}},
        "serving": {"rates": [_rate(2404.0), _rate(974.0), _rate(500.0), _rate(600.0)]},
    }


def test_suite_figures_of_the_gpu_configuration() -> None:
    assert summary.figures_of(_gpu_suite()) == {
        "sharegpt_200_req_s": 28.8, "fixed_1000x1000_out_tok_s": 9863.0, "hf_static_ratio": 20.5,
        "prefix_ttft_gain_1k": 1.45, "prefix_ttft_gain_2k": 2.87, "mixed_step_host_ms": 16.4,
        "serving_ttft_p99_ms_25pct": 2404.0, "serving_ttft_p99_ms_50pct": 974.0}


def test_suite_figures_only_where_the_run_matches_the_definition() -> None:
    r = _gpu_suite()
    r["config"] |= {"sharegpt_prompts": 32, "fixed_in": 128, "serving_rates": [0.5, 1.0, "inf"]}
    r["fixed"] = {"skipped": "time budget"}
    r["serving"]["rates"][1] = _rate(974.0, failed=3)
    r["prefix"]["anatomy"]["device"] = "cpu"
    r["prefix"]["variants"] = r["prefix"]["variants"][1:]
    r["hf_compare"] = {"error": "boom"}
    assert summary.figures_of(r) == {"prefix_ttft_gain_2k": 2.87}
    r = _gpu_suite()
    r["fixed"]["completed"] = 640  # shrunk for the budget
    r["serving"]["rates"][1] = _rate(974.0, failed=3)
    assert {"fixed_1000x1000_out_tok_s", "serving_ttft_p99_ms_50pct"}.isdisjoint(summary.figures_of(r))


def test_record_file_takes_each_figure_from_the_run_that_measured_it(tmp_path: Path) -> None:
    merged = _gpu_suite("first") | {"merged": [
        {"commit": "first", "measured": "2026-12-01T08:00:00+00:00", "sections": ["sharegpt", "prefix", "serving"]},
        {"commit": "second", "measured": "2026-12-02T09:00:00+00:00", "sections": ["fixed"]}]}
    (tmp_path / "suite.json").write_text(json.dumps(merged))
    summary.record_file(tmp_path / "suite.json")
    data = summary.load(tmp_path / "summary.json")
    assert (data["fixed_1000x1000_out_tok_s"]["commit"], data["fixed_1000x1000_out_tok_s"]["date"]) == (
        "second", "2026-12-02")
    assert (data["sharegpt_200_req_s"]["commit"], data["sharegpt_200_req_s"]["date"]) == ("first", "2026-12-01")
    assert data["hf_static_ratio"]["commit"] == "first"  # its section is in no run's list: the first run's
    assert "triton 3.6.0" in (tmp_path / "summary.md").read_text()
    summary.main([str(tmp_path / "suite.json"), "--commit", "fixed1", "--date", "2026-12-03"])
    assert {r["commit"] for r in summary.load(tmp_path / "summary.json").values()} == {"fixed1"}


def test_record_file_needs_a_date(tmp_path: Path) -> None:
    r = _gpu_suite()
    del r["measured"]
    (tmp_path / "suite.json").write_text(json.dumps(r))
    with pytest.raises(ValueError, match="measured date"):
        summary.record_file(tmp_path / "suite.json")
    assert summary.record_file(tmp_path / "suite.json", date="2026-12-02")


def _broker(**over: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "benchmark": "broker_relay", "worker": "synthetic (fake worker)", "broker": "Broker class + timestamps",
        "commit": "abc", "throughput": {"jobs": 256, "tokens_per_chunk": 1, "tokens_per_s": 650000},
        "latency": {"jobs": 64, "step_rate_hz": 100.0, "added_p99_ms": 1.03, "hops": {}}}
    for k, v in over.items():
        section, _, field = k.partition("__")
        if field:
            r[section][field] = v
        else:
            r[section] = v
    return r


def test_broker_figures_only_in_the_headline_configuration() -> None:
    assert summary.figures_of(_broker()) == {"broker_relay_tok_s": 650000, "broker_added_p99_ms": 1.03}
    for variant in ({"broker": "Broker class; busy_poll 0.02 s"}, {"worker": "real (throughput: synthetic)"},
                    {"throughput__tokens_per_chunk": 4}, {"latency__hops": None}, {"latency__jobs": 8}):
        assert summary.figures_of(_broker(**variant)) == {}, variant


def test_spec_gpu_figures_only_for_the_head_alone_in_the_headline_configuration() -> None:
    config = {"k": 4, "max_tokens": 256, "max_prompt": 512, "eagle_lookup_min": 0, "method": "eagle"}
    r = {"benchmark": "spec_gpu", "smoke": False, "config": config, "tau": {"4": {"tau": 1.33}},
         "throughput": {str(b): {"speedup": s} for b, s in ((1, 0.97), (32, 1.01), (128, 0.97))}}
    assert summary.figures_of(r) == {"eagle_b1_speedup": 0.97, "eagle_b32_speedup": 1.01,
                                     "eagle_b128_speedup": 0.97, "eagle_tau_k4": 1.33}
    for variant in ({"eagle_lookup_min": 3}, {"method": "ngram"}, {"k": 3}, {"cuda_graphs": False}):
        assert summary.figures_of(r | {"config": config | variant}) == {}, variant
    assert summary.figures_of(r | {"smoke": True}) == {}


def test_e2e_figures() -> None:
    r = {"command": "gpu_e2e.py --model llama3-8b", "model": "llama3-8b", "latency_b8_in32_out128_s": 0.6207,
         "decode": {"1": {"ms_per_step_p50": 4.165}, "8": {"ms_per_step_p50": 4.61}}}
    assert summary.figures_of(r) == pytest.approx({"decode_b1_ms": 4.165, "latency_config_ms": 620.7})
    assert summary.figures_of(r | {"model": "tiny-llama"}) == {}
    assert summary.figures_of(r | {"command": "gpu_e2e.py --sync-scheduling"}) == {}
    assert summary.figures_of({"command": "engine_cpu.py"}) == {}


def test_results_record_versions_and_an_overridable_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    info = device_info()
    assert info["triton"] and info["torch"] and info["cpu_count"]
    monkeypatch.setenv("TOKENMILL_COMMIT", "0123abc")
    assert git_commit() == "0123abc"


def test_commit_is_dirty_for_code_changes_not_for_result_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    git = ["git", "-c", "user.email=t@127.0.0.1", "-c", "user.name=t"]
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "suite.json").write_text("{}")
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "engine.py").write_text("x = 1\n")
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "base"]):
        subprocess.run([*git, *cmd], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.delenv("TOKENMILL_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path / "worker")
    (tmp_path / "benchmarks" / "results" / "suite.json").write_text('{"new": 1}')
    assert git_commit() == head
    (tmp_path / "worker" / "engine.py").write_text("x = 2\n")
    assert git_commit() == head + "-dirty"


def test_suite_merge_records_the_merged_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`suite --merge` of the committed H200 run and a later fixed-only run: each figure with its run's commit."""
    from tokenmill.benchmarks import suite

    monkeypatch.setattr(suite, "make_plots", lambda result, out: [])
    full = json.loads((RESULTS / "h200" / "suite.json").read_text()) | {"measured": "2026-11-30T23:00:00+00:00"}
    part = {k: v for k, v in full.items() if k not in ("sharegpt", "hf", "hf_compare", "prefix", "serving")}
    part |= {"commit": "second", "measured": "2026-12-02T11:00:00+00:00",
             "fixed": full["fixed"] | {"output_tok_per_s": 14000.0}}
    for name, r in (("a.json", full), ("b.json", part)):
        (tmp_path / name).write_text(json.dumps(r))
    suite.run_cli(suite.build_parser().parse_args(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                                   "--out", str(tmp_path / "m")]))
    data = summary.load(tmp_path / "m" / "summary.json")
    assert data["fixed_1000x1000_out_tok_s"] == {"value": 14000.0, "commit": "second", "date": "2026-12-02",
                                                 "source": "suite.json"}
    assert data["sharegpt_200_req_s"]["commit"] == full["commit"]
    assert data["sharegpt_200_req_s"]["date"] == "2026-11-30"
