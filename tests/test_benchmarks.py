"""Benchmark plumbing: workload generators, latency/goodput math, request release order, plots, and the
suite end to end on a tiny dummy model. Behaviour only: no timing is asserted (benchmarks record numbers)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.benchmarks.common import RequestTiming, goodput, latency_summary, meets_slo, throughput_summary
from tokenmill.benchmarks.ladder import (
    QUANT_VARIANTS,
    SPEC_VARIANTS,
    accuracy_cell,
    add_accuracy,
    common_prefix,
    ladder_table,
    prefix_gain,
    prefix_rows,
    step_anatomy,
    variant_row,
    why_not,
)
from tokenmill.benchmarks.serving import arrival_offsets, parse_rates
from tokenmill.benchmarks.throughput import ModelSpec, StepTrace, _Releaser, build_engine, workload_tokenizer
from tokenmill.benchmarks.workloads import (
    BenchRequest,
    Workload,
    random_workload,
    shared_prefix_workload,
    sharegpt_workload,
)
from tokenmill.worker.engine import StepRecord
from tokenmill.worker.registry_fetch import embedded_model_path
from tokenmill.worker.scheduler import ScheduledBatch
from tokenmill.worker.tokenizer import Tokenizer

TINY = ModelSpec(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu", max_num_seqs=16,
                 max_num_batched_tokens=256, max_model_len=2048, cpu_kv_bytes=64 << 20, threads=1)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_file(embedded_model_path(quiet=True))


# -- workloads ---------------------------------------------------------------------------------------------


def test_random_workload_is_fixed_length_and_seeded() -> None:
    a, b = random_workload(5, 12, 7, 512, seed=1), random_workload(5, 12, 7, 512, seed=1)
    assert a == b and a != random_workload(5, 12, 7, 512, seed=2)
    assert all(r.prompt_len == 12 and r.output_len == 7 for r in a.requests)
    assert all(260 <= t < 512 for r in a.requests for t in r.prompt_ids)
    s = a.summary()
    assert (s["requests"], s["input_tokens"], s["output_tokens"]) == (5, 60, 35)


def test_sharegpt_text_and_id_prompts_have_the_sampled_lengths(tok: Tokenizer) -> None:
    text = sharegpt_workload(tok, 8, seed=3, max_input_len=256, max_output_len=128)
    ids = sharegpt_workload(tok, 8, seed=3, max_input_len=256, max_output_len=128, ids_vocab=128256)
    assert text == sharegpt_workload(tok, 8, seed=3, max_input_len=256, max_output_len=128)
    assert [r.prompt_len for r in text.requests] == [r.prompt_len for r in ids.requests]
    assert [r.output_len for r in text.requests] == [r.output_len for r in ids.requests]
    for r in text.requests:
        assert 4 <= r.prompt_len <= 256 and 4 <= r.output_len <= 128
    assert all(1000 <= t < 128256 for r in ids.requests for t in r.prompt_ids)
    assert text.subset(3).requests == text.requests[:3]


@pytest.mark.parametrize("ids_vocab", [None, 49152])
def test_shared_prefix_turns_extend_each_other(tok: Tokenizer, ids_vocab: int | None) -> None:
    wl = shared_prefix_workload(tok, 3, 3, seed=0, system_len=300, max_turn_len=24, ids_vocab=ids_vocab)
    assert wl == shared_prefix_workload(tok, 3, 3, seed=0, system_len=300, max_turn_len=24, ids_vocab=ids_vocab)
    assert len(wl) == 9 and [(r.session, r.turn) for r in wl.requests[:3]] == [(0, 0), (0, 1), (0, 2)]
    assert len(common_prefix(wl)) >= 295  # the system prompt (text mode adds the template around it)
    by_session: dict[int, list[BenchRequest]] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        for prev, nxt in itertools.pairwise(turns):
            # text mode: the rendered template may re-tokenize the last few tokens at the boundary
            shared = len(common_prefix(Workload("pair", (prev, nxt))))
            assert shared >= prev.prompt_len - 3 and nxt.prompt_len > prev.prompt_len
        assert all(4 <= r.output_len <= 24 for r in turns)


def test_length_tokenizer_for_dummy_models() -> None:
    tok, vocab, name = workload_tokenizer(ModelSpec(model="llama3-8b", load_format="dummy"))
    assert vocab == 128256 and name.startswith(("smollm2", "byte"))
    assert tok.encode("hello world")


# -- metrics -----------------------------------------------------------------------------------------------


def timing(sent: float, chunks: list[tuple[float, int]], done: float | None = None) -> RequestTiming:
    t = RequestTiming(sent, prompt_len=10)
    for at, n in chunks:
        t.on_tokens(at, n)
    t.done = done if done is not None else chunks[-1][0]
    return t


def test_request_timing_ttft_tpot_itl() -> None:
    t = timing(1.0, [(1.5, 1), (1.6, 1), (1.8, 2), (2.0, 1)])
    assert t.ok and t.output_len == 5
    assert t.ttft == pytest.approx(0.5) and t.e2e == pytest.approx(1.0)
    assert t.tpot == pytest.approx(0.5 / 4)  # (last - first chunk) / (tokens - 1)
    assert t.itls == pytest.approx([0.1, 0.2, 0.2])
    assert math.isnan(timing(0.0, [(0.2, 1)]).tpot)
    assert not RequestTiming(0.0, 3).ok


def test_summaries_goodput_and_slo() -> None:
    fast = timing(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)])  # TTFT 100 ms, TPOT 100 ms
    slow_start = timing(0.0, [(2.0, 1), (2.1, 1)])  # TTFT 2 s
    slow_tokens = timing(0.0, [(0.1, 1), (1.1, 1)])  # TPOT 1 s
    failed = RequestTiming(0.0, 10, error="boom")
    ts = [fast, slow_start, slow_tokens, failed]
    assert [meets_slo(t, 0.5, 0.2) for t in ts] == [True, False, False, False]
    assert goodput(ts, 2.0, 0.5, 0.2) == pytest.approx(0.5)
    assert goodput(ts, 2.0, None, None) == pytest.approx(1.5)
    th = throughput_summary(ts, 2.0)
    assert (th["completed"], th["failed"], th["output_tokens"], th["input_tokens"]) == (3, 1, 7, 30)
    assert th["requests_per_s"] == pytest.approx(1.5) and th["total_tok_per_s"] == pytest.approx(18.5)
    lat = latency_summary(ts)
    assert lat["ttft_ms"]["p50"] == pytest.approx(100.0) and lat["ttft_ms"]["mean"] == pytest.approx(2200 / 3)
    assert lat["tpot_ms"]["p99"] == pytest.approx(100 + 0.98 * 900)  # linear between [100, 100, 1000]
    assert lat["e2e_ms"]["p90"] == pytest.approx(2100 - 0.2 * 1000)


def test_prefix_gain_ratio() -> None:
    rows = [{"ttft_ms": {"p50": 900.0, "p90": 1200.0, "mean": 1000.0}},
            {"ttft_ms": {"p50": 100.0, "p90": 300.0, "mean": 250.0}}]
    assert prefix_gain(rows) == {"ttft_p50_ratio": 9.0, "ttft_p90_ratio": 4.0, "ttft_mean_ratio": 4.0}


# -- the quantization and speculative-decoding rungs ----------------------------------------------------------


def test_rung_variants_that_cannot_run_say_why_in_their_row() -> None:
    (int8, fp8), (ngram, eagle) = QUANT_VARIANTS, SPEC_VARIANTS
    embedded = ModelSpec()
    assert [why_not(v, embedded) for v in (int8, ngram, eagle)] == [None, None, None]
    assert why_not(fp8, embedded) == "needs a GPU with FP8 (compute capability >= 8.9)"  # the CPU
    assert why_not(eagle, TINY) == "no EAGLE head shipped for tiny-llama"
    wl = Workload("sharegpt", (BenchRequest((300, 301, 302), 2),))
    row = variant_row(TINY, eagle, wl)
    assert row == {"step": eagle.step, "variant": "eagle", "not_run": "no EAGLE head shipped for tiny-llama"}
    table = ladder_table([row])
    assert f"| {eagle.step} | not run: no EAGLE head shipped for tiny-llama |" in table
    assert "tok/s" not in table.splitlines()[-1]  # no numbers in the row


@pytest.mark.slow
def test_eagle_and_int8_rows_on_the_embedded_model() -> None:
    """EAGLE drafts with the shipped head (its weights counted beside the target's); INT8 halves and more
    the weights it quantizes. The same two requests for each variant, prefix caching off."""
    spec = replace(ModelSpec(), max_num_seqs=4, max_model_len=512, cpu_kv_bytes=64 << 20, threads=1)
    tok, vocab, _ = workload_tokenizer(spec)
    wl = sharegpt_workload(tok, 2, 0, ids_vocab=vocab, max_input_len=64, max_output_len=12)
    plain = build_engine(spec, prefix_caching=False)
    from tokenmill.benchmarks.throughput import memory_info

    dense = memory_info(plain)["weights_bytes"]
    del plain
    (int8, _), (_, eagle) = QUANT_VARIANTS, SPEC_VARIANTS
    e, q = variant_row(spec, eagle, wl), variant_row(spec, int8, wl)
    assert e["requests"] == q["requests"] == 2 and e["output_tok_per_s"] > 0 and q["output_tok_per_s"] > 0
    assert e["draft_tokens"] > 0 and 0 <= e["accepted_draft_tokens"] <= e["draft_tokens"]
    assert e["auto_switch"] is False  # the CPU default
    assert e["draft_weights_bytes"] > 0 and e["weights_bytes"] == dense + e["draft_weights_bytes"]
    assert q["draft_weights_bytes"] == 0 and q["weights_bytes"] < 0.6 * dense
    assert e["cached_prompt_tokens"] == q["cached_prompt_tokens"] == 0


def test_quantization_rung_accuracy_on_the_embedded_model_and_not_on_dummy_weights() -> None:
    """INT8 and emulated FP8 + FP8 KV against the unquantized embedded model on two held-out replies: small,
    measured changes (INT8's under 1%, as quant_accuracy's 200 replies show); dummy weights: none measured."""
    (int8, fp8), (ngram, _) = QUANT_VARIANTS, SPEC_VARIANTS
    rows: list[dict[str, Any]] = [{"step": int8.step, "variant": "int8"},
                                  {"step": fp8.step, "variant": "fp8", "not_run": "needs a GPU"},
                                  {"step": ngram.step, "variant": "ngram"}]
    add_accuracy(rows, (int8, fp8, ngram), ModelSpec(threads=1), 2)
    a8, f8 = rows[0]["accuracy"], rows[1]["accuracy"]
    assert a8["replies"] == f8["replies"] == 2 and a8["tokens"] == f8["tokens"] > 100
    assert abs(a8["ppl_delta_pct"]) < 1.0 and a8["greedy_agreement"] > 0.9 and 0 < a8["mean_kl"] < f8["mean_kl"]
    assert abs(f8["ppl_delta_pct"]) < 5.0 and f8["greedy_agreement"] > 0.8
    assert "accuracy" not in rows[2]
    assert "ppl +" in accuracy_cell(rows[0]) or "ppl -" in accuracy_cell(rows[0])
    table = ladder_table([rows[1]])
    assert "not run: needs a GPU" in table and "2 replies" in table  # FP8's accuracy is the CPU emulation's
    add_accuracy(rows, (int8, fp8), TINY, 2)
    assert rows[0]["accuracy"] == {"not_measured": "dummy weights"}
    assert accuracy_cell(rows[0]) == "not measured: dummy weights"


# -- release order and arrivals --------------------------------------------------------------------------------


def test_releaser_static_batches_and_sessions() -> None:
    reqs = tuple(BenchRequest((1, 2), 3) for _ in range(5))
    rel = _Releaser(reqs, batch_size=2, sessions=None)
    assert rel.initial() == [0, 1]
    assert rel.on_finish(1) == [] and rel.on_finish(0) == [2, 3]
    assert rel.on_finish(2) == [] and rel.on_finish(3) == [4] and rel.on_finish(4) == []
    chat = tuple(BenchRequest((1,), 2, session=s, turn=t) for s in range(3) for t in range(2))
    rel = _Releaser((*chat, BenchRequest((9,), 2)), batch_size=None, sessions=2)
    assert rel.initial() == [6, 0, 2]  # the independent request, then turn 0 of two sessions
    assert rel.on_finish(0) == [1]  # session 0 turn 1
    assert rel.on_finish(1) == [4]  # session 0 done: session 2 opens
    assert rel.on_finish(2) == [3] and rel.on_finish(3) == [] and rel.on_finish(6) == []


def test_releaser_window_and_session_ramp() -> None:
    singles = tuple(BenchRequest((1,), 2) for _ in range(5))
    rel = _Releaser(singles, batch_size=None, sessions=None, window=2)
    assert rel.initial() == [0, 1]
    assert rel.on_finish(1) == [2] and rel.on_finish(0) == [3] and rel.on_finish(2) == [4]
    assert rel.on_finish(3) == [] and rel.on_step() == []
    chat = tuple(BenchRequest((1,), 2, session=s, turn=t) for s in range(3) for t in range(2))
    rel = _Releaser(chat, batch_size=None, sessions=2, ramp=True)
    assert rel.initial() == [0]  # one session at the start, the next one a step later
    assert rel.on_step() == [2] and rel.on_step() == []  # two open: the limit
    assert rel.on_finish(0) == [1] and rel.on_finish(1) == [4]  # session 0 done: session 2 opens
    assert rel.on_step() == [] and rel.on_finish(2) == [3] and rel.on_finish(3) == [] and rel.on_finish(4) == [5]


def _batch(*items: tuple[str, int, int, int]) -> ScheduledBatch:
    """(request id, computed tokens, prompt tokens, new tokens) per scheduled request."""
    reqs = [SimpleNamespace(request_id=rid, num_computed_tokens=c, num_prompt_tokens=p) for rid, c, p, _ in items]
    return ScheduledBatch(reqs, [n for *_, n in items], [], [])  # type: ignore[arg-type]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_trace_counts_steps_to_first_token(async_scheduling: bool) -> None:
    """b0 arrives with a 10-token prompt that takes two chunks while b1 decodes; then b0 decodes."""
    trace = StepTrace(async_scheduling)
    trace.added[0] = 0
    calls = [_batch(("b0", 0, 10, 6), ("b1", 5, 4, 1)), _batch(("b0", 6, 10, 4), ("b1", 6, 4, 1)),
             _batch(("b0", 10, 10, 1)), _batch()]
    first = 3 if async_scheduling else 2  # the second chunk samples; async returns it one call later
    for k, b in enumerate(calls, 1):
        if b.requests:  # the engine's step observer sees launched steps only
            trace.on_step(StepRecord(b, 0.001))
        trace.on_call(0.01 * k)
        if k == first:
            trace.first_token[0] = k
    assert trace.launched == [(6, 1), (4, 1), (0, 1), (0, 0)]
    if async_scheduling:
        assert trace.completed == [(0, 0), (6, 1), (4, 1), (0, 1)]
    else:
        assert trace.completed == trace.launched
    ft = trace.first_token_summary({0: 0.5})
    assert ft["steps"]["p50"] == first and ft["prefill_in_several_chunks"] == 1 and ft["not_scheduled_next_step"] == 0
    assert ft["calls_ms"]["p50"] == pytest.approx(10 * sum(range(1, first + 1)))
    assert [c["call"] for c in ft["examples"]["p50"]["calls"]] == list(range(1, first + 1))
    st = trace.step_summary()
    assert st["with_prompt_tokens"] == 2 and st["prompt_tokens_per_step"]["p50"] == 5
    assert st["decode_only"] == 1  # sync: call 3; async: call 4, which drains call 3's decode


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cached_turns_get_their_first_token_after_one_step_or_two_async(async_scheduling: bool) -> None:
    """Engine behaviour the TTFT analysis rests on: with the system prompt and history cached, a new turn
    is scheduled in the very next step, in one chunk, and its first token comes back from that step
    (async scheduling: from the step() call after, since one step is in flight when it arrives)."""
    spec = replace(TINY, async_scheduling=async_scheduling)
    engine = build_engine(spec)
    assert engine.async_scheduling is async_scheduling
    tok, vocab, _ = workload_tokenizer(spec)
    wl = shared_prefix_workload(tok, 3, 2, seed=0, system_len=64, max_turn_len=8, ids_vocab=vocab)
    off, on = prefix_rows(engine, wl, sessions=2, ramp=True)
    for row in (off, on):
        assert row["requests"] == 6 and row["step_ms"]["async_scheduling"] is async_scheduling
        assert row["first_token"]["not_scheduled_next_step"] == 0
    ft = on["first_token"]
    assert ft["steps"]["max"] == ft["steps"]["p50"] == (2 if async_scheduling else 1)
    assert ft["prefill_in_several_chunks"] == 0
    assert on["uncached_prompt_tokens"]["p50"] < off["uncached_prompt_tokens"]["p50"]
    assert on["cached_prompt_tokens"] > 0 and on["system_prompt_tokens"] == 64
    an = step_anatomy(engine, wl, running=2, new_tokens=10, repeats=2)
    k = an["kinds"]
    assert [m["decodes"] for m in k.values()] == [2, 2, 2] and k["decode-only"]["prompt_tokens"] == 0
    # the cached request computes only its new tokens (the last block boundary: at most one block more)
    assert 10 <= k["new request, system prompt cached"]["prompt_tokens"] <= 10 + 16
    assert k["new request, nothing cached"]["prompt_tokens"] == 64 + 10
    assert engine.async_scheduling is async_scheduling and not engine.has_unfinished_requests()


def test_poisson_arrivals() -> None:
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    a = arrival_offsets(2000, 5.0, seed=1)
    assert a == arrival_offsets(2000, 5.0, seed=1) and a[0] == 0.0 and a == sorted(a)
    assert a[-1] / 1999 == pytest.approx(0.2, rel=0.1)  # mean gap 1/rate
    assert parse_rates("0.5, 2,inf") == (0.5, 2.0, math.inf)


# -- plots and the suite ------------------------------------------------------------------------------------


def _lat(v: float) -> dict[str, dict[str, float]]:
    d = {"mean": v, "p50": v, "p90": 1.5 * v, "p99": 2 * v}
    return {"ttft_ms": d, "tpot_ms": d, "itl_ms": d, "e2e_ms": d}


def test_plots_from_a_result(tmp_path: Path) -> None:
    from tokenmill.benchmarks.plots import plot_all

    rate = {"completed": 4, "requests_per_s": 1.0, "goodput_requests_per_s": 0.8, "output_tok_per_s": 50.0}
    row = {"step": "continuous batching", "workload": "sharegpt", "output_tok_per_s": 10.0, "ttft_ms": {"p50": 5.0},
           "tpot_ms": {"p50": 2.0}, "peak_kv_bytes": 1 << 20}
    result = {"device": {"cpu_count": 2}, "model": {"model": "m", "load_format": "dummy", "dtype": "float32"},
              "serving": {"rates": [rate | {"rate": 1.0, "latency": _lat(10)},
                                    rate | {"rate": "inf", "latency": _lat(20)},
                                    {"rate": 2.0, "skipped": "time budget"}]},
              "ladder": {"rows": [row, {"step": "quantization: FP8", "not_run": "needs a GPU with FP8"}]},
              "hf_compare": {"hf": {"requests": 4, "batch_size": 2, "output_tok_per_s": 3.0},
                             "engine": {"output_tok_per_s": 9.0}}}
    files = plot_all(result, tmp_path)
    assert sorted(p.name for p in files) == ["baselines.png", "ladder.png", "serving_latency.png",
                                             "serving_throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in files)


def test_merge_takes_each_section_from_the_last_run_where_it_ran(tmp_path: Path) -> None:
    from tokenmill.benchmarks.suite import merge_files, merge_results, suite_markdown

    dev = {"gpu": "NVIDIA H200"}
    full = {"command": "suite", "commit": "a", "device": dev, "model": {"model": "llama3-8b"},
            "workloads": {"sharegpt": {"requests": 200}}, "hf": {"requests": 64},
            "sharegpt": {"requests_per_s": 20.0, "completed": 200, "output_tok_per_s": 6000.0},
            "fixed": {"skipped": "time budget"}, "sections_s": {"hf": 80.0}}
    part = {"command": "suite --sections engine,fixed", "commit": "b", "device": dev, "interrupted": None,
            "workloads": {"fixed": {"requests": 1000}}, "hf": {"error": "boom"},
            "fixed": {"output_tok_per_s": 8000.0, "completed": 1000,
                      "workload": {"input_len": 1000, "output_len": 1000}}, "sections_s": {"fixed": 150.0}}
    m = merge_results([full, part], ["full.json", "part.json"])
    assert m["sharegpt"] == full["sharegpt"] and m["hf"] == full["hf"] and m["fixed"] == part["fixed"]
    assert m["sections_s"] == {"hf": 80.0, "fixed": 150.0} and set(m["workloads"]) == {"sharegpt", "fixed"}
    assert [x["sections"] for x in m["merged"]] == [["hf", "sharegpt"], ["fixed"]]
    assert m["device"] == dev and m["command"] == "suite"
    assert "## Runs merged here" in suite_markdown(m)
    with pytest.raises(SystemExit):
        merge_results([full, part | {"device": {}}], ["a", "b"])
    (tmp_path / "a.json").write_text(json.dumps(full))
    (tmp_path / "b.json").write_text(json.dumps(part))
    merge_files([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "out")
    written = json.loads((tmp_path / "out" / "suite.json").read_text())
    assert written["fixed"] == part["fixed"] and written["device"] == dev  # not this machine's


def test_interrupted_suite_writes_what_it_has(tmp_path: Path) -> None:
    from tokenmill.benchmarks.suite import CPU, Suite

    suite = Suite(replace(CPU, spec=TINY), tmp_path, ("engine", "fixed"))
    suite.result["engine"] = {"startup_s": 1.0}
    suite.current = "fixed"
    suite.interrupted("SystemExit(143)")
    result = json.loads((tmp_path / "suite.json").read_text())
    assert result["interrupted"] == "SystemExit(143)" and result["engine"] == {"startup_s": 1.0}
    assert result["fixed"]["error"].startswith("interrupted (SystemExit(143))")
    assert "- fixed: interrupted" in (tmp_path / "suite.md").read_text()


@pytest.mark.slow
def test_suite_smallest_config_writes_json_md_png(tmp_path: Path) -> None:
    """Every section of the suite on tiny-llama (dummy weights), serving through real processes."""
    from tokenmill.benchmarks.suite import CPU, SECTIONS, Suite

    cfg = replace(CPU, spec=TINY, sharegpt_prompts=6, sharegpt_max_input=64, sharegpt_max_output=12, hf_batch=4,
                  conversations=2, turns=2, system_len=64, max_turn_len=8, fixed_requests=4, fixed_in=16,
                  fixed_out=8, serving_rates=(4.0, math.inf), serving_prompts=4, serving_time_s=60,
                  serving_reserve_s=60, budget_s=300, more_system_lens=(96,))
    Suite(cfg, tmp_path, SECTIONS).run()
    result = json.loads((tmp_path / "suite.json").read_text())
    for name in SECTIONS:
        assert "error" not in result[name] and "skipped" not in result[name], (name, result[name])
    assert result["sharegpt"]["completed"] == 6 and result["fixed"]["output_tokens"] == 32
    assert result["hf_compare"]["hf"]["requests"] == 6 and result["hf_compare"]["ratio_output_tok_s"] > 0
    assert [r["rate"] for r in result["serving"]["rates"]] == [4.0, "inf"]
    assert all(r["completed"] == r["requests_sent"] for r in result["serving"]["rates"])
    # the worker logged no kernel compiled after its start-up (worker/compile_watch.py)
    assert result["serving"]["kernels_compiled_after_start_up"] == {"warm-up": 0, "4.0": 0, "inf": 0}
    for r in result["serving"]["rates"]:  # every TTFT taken apart with the worker's and the broker's timings
        assert r["slowest_ttft"] and all(math.isfinite(t["first_step_ms"]) and t["first_step_ms"] >= 0
                                         and math.isfinite(t["broker_queue_ms"]) for t in r["slowest_ttft"])
    on = result["prefix"]["rows"][1]
    assert on["prefix_caching"] and on["cached_prompt_tokens"] > 0
    assert on["first_token"]["steps"]["max"] == 1  # CPU: no async scheduling; cached turns in one step
    assert [v["system_len"] for v in result["prefix"]["variants"]] == [64, 96]
    assert result["fixed"]["requests_planned"] == 4 and not result["fixed"]["shrunk_for_budget"]
    rows = {r.get("variant"): r for r in result["ladder"]["rows"]}
    steps = [r["step"] for r in result["ladder"]["rows"]][-4:]
    assert steps[:2] == [v.step for v in QUANT_VARIANTS] and steps[3] == SPEC_VARIANTS[1].step
    assert steps[2] == f"{SPEC_VARIANTS[0].step}, automatic switch off"  # the CPU default
    cont = next(r for r in result["ladder"]["rows"] if r["step"] == "continuous batching")
    for key in ("int8", "ngram"):  # measured on the continuous step's requests, prefix caching off
        assert rows[key]["requests"] == cont["requests"] == 6 and rows[key]["output_tok_per_s"] > 0
        assert rows[key]["cached_prompt_tokens"] == 0 and "not_run" not in rows[key]
    assert rows["int8"]["weights_bytes"] < cont["weights_bytes"]  # the quantized projections are smaller
    assert rows["ngram"]["weights_bytes"] == cont["weights_bytes"] and rows["ngram"]["draft_tokens"] > 0
    assert rows["fp8"]["not_run"] == "needs a GPU with FP8 (compute capability >= 8.9)"
    assert rows["int8"]["accuracy"] == rows["fp8"]["accuracy"] == {"not_measured": "dummy weights"}
    assert rows["eagle"]["not_run"] == "no EAGLE head shipped for tiny-llama"
    md = (tmp_path / "suite.md").read_text()
    assert "## Headline" in md and "## Optimization ladder" in md and "![ladder](ladder.png)" in md
    assert {"ladder.png", "baselines.png", "serving_latency.png", "serving_throughput.png"} <= {
        p.name for p in tmp_path.glob("*.png")}
    assert "## Prefix caching: what TTFT is made of" in md and "system prompt 96 tok" in md


@pytest.mark.slow
def test_fixed_section_alone_at_full_size_then_merged(tmp_path: Path) -> None:
    """The second GPU call: `--sections engine,fixed` keeps nothing back for serving, runs every planned
    request, and its JSON merges into the whole suite's and plots."""
    from tokenmill.benchmarks.suite import CPU, Suite, merge_files

    cfg = replace(CPU, spec=TINY, sharegpt_prompts=6, sharegpt_max_input=64, sharegpt_max_output=12,
                  conversations=2, turns=2, system_len=64, max_turn_len=8, fixed_requests=40, fixed_in=16,
                  fixed_out=4, serving_reserve_s=10_000, budget_s=200)
    Suite(cfg, tmp_path / "full", ("engine", "sharegpt", "prefix")).run()
    Suite(cfg, tmp_path / "fixed", ("engine", "fixed")).run()  # reserve > budget: serving is not run here
    fixed = json.loads((tmp_path / "fixed" / "suite.json").read_text())["fixed"]
    assert fixed["completed"] == fixed["requests_planned"] == 40 and fixed["window"] == 2 * TINY.max_num_seqs
    merged = merge_files([tmp_path / "full" / "suite.json", tmp_path / "fixed" / "suite.json"], tmp_path / "m")
    assert merged["fixed"]["completed"] == 40 and "output_tok_per_s" in merged["sharegpt"]
    assert len(merged["prefix"]["rows"]) == 2 and "ladder.png" in merged["plots"]
    assert "fixed 16 in / 4 out x 40" in (tmp_path / "m" / "suite.md").read_text()


def test_trace_gaps_counts_overlapping_kernel_pairs() -> None:
    from tokenmill.benchmarks.trace_gaps import gap_stats

    def kernel(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        kernel("attn", 0.0, 10.0), kernel("reduce", 9.5, 2.0),  # overlaps by 0.5 us
        kernel("o_proj", 12.0, 5.0),  # starts 0.5 us after reduce ends
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 30.0},  # host events are ignored
        kernel("attn", 17.0, 3.0),
    ]}
    s = gap_stats(trace)
    assert (s.kernels, s.pairs, s.overlapping) == (4, 3, 1)
    assert s.median_gap_us == pytest.approx(0.0) and s.busy_ms == pytest.approx(0.020)
    assert ("reduce", "o_proj", 1) in s.no_overlap_pairs
    assert all(p[:2] != ("attn", "reduce") for p in s.no_overlap_pairs)
    with pytest.raises(ValueError, match="fewer than two"):
        gap_stats({"traceEvents": [kernel("attn", 0.0, 1.0)]})


def test_suite_engine_overrides_reach_the_model_spec() -> None:
    from tokenmill.benchmarks.suite import GPU, build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--device", "gpu", "--max-num-seqs", "512",
                                                      "--kv-cache-dtype", "fp8"]))
    assert (cfg.spec.max_num_seqs, cfg.spec.kv_cache_dtype) == (512, "fp8")
    assert replace(cfg.spec, max_num_seqs=GPU.spec.max_num_seqs, kv_cache_dtype="auto") == GPU.spec
    assert config_from_args(build_parser().parse_args(["--device", "gpu"])).spec == GPU.spec
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-dtype", "int8"])


def test_host_step_times_every_phase_of_each_kind_of_step(tmp_path: Path) -> None:
    """benchmarks/host_step.py on a small anatomy: each kind of step has every phase it wraps (the runner methods
    and module names it patches still exist) and a launch that covers them; the JSON holds the medians."""
    from tokenmill.benchmarks import host_step

    host_step.main(["--repeats", "2", "--running", "3", "--system-tokens", "40", "--new-tokens", "8",
                    "--out", str(tmp_path)])
    medians = json.loads((tmp_path / "host_step.json").read_text())["median_us"]
    assert set(medians) == set(host_step.KINDS)
    wrapped = {*host_step.RUNNER_PHASES, *host_step.MODULE_PHASES, "compute_logits", "sampler"}
    for kind, phases in medians.items():
        assert wrapped <= set(phases), (kind, wrapped - set(phases))
        assert phases["launch"] > 0 and phases["rest"] >= 0, kind  # the phases run inside the launch
