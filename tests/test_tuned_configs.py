"""The per-device tuned launch configs of the weight-only quantized kernels (kernels/tuned.py): the table's
parsing and errors, the lookup and its fallback to the default rules (the launchers choose exactly what they
chose before when no table or entry applies), a launch through a table entry under the Triton interpreter, and
the plumbing of `gpu_quant --sweep` on tiny shapes with a tiny candidate grid (no timing is asserted)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.kernels import tuned
from tokenmill.kernels.gemv import default_config
from tokenmill.kernels.launch import num_sms
from tokenmill.kernels.quant_gemm import default_gemm_config, gemm_config, quant_matmul
from tokenmill.kernels.quant_gemv import quant_skinny_matmul, skinny_config
from tokenmill.kernels.quant_weight import PackedWeight, pack_int4, quant_matmul_ref
from tokenmill.kernels.tuned import GemmConfig, QuantSkinnyConfig, TunedTableError

DEV = torch.device("cpu")  # the tables are looked up by device name: tests fake one for the CPU
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
NAME = "Test GPU 9000"
N, K = 40, 128


def _int4(n: int = N, k: int = K, group: int = 32, zeros: bool = False, perm: bool = False) -> PackedWeight:
    gen = torch.Generator().manual_seed(0)
    groups = -(-k // group)
    return PackedWeight(pack_int4(torch.randint(0, 16, (n, k), generator=gen)),
                        (torch.rand(n, groups, generator=gen) + 0.5) / (4 * k**0.5),
                        torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8) if zeros else None,
                        torch.randperm(k, generator=gen).to(torch.int32) if perm else None, 4, group)


def _skinny(block_n: int, block_k: int = 32, use_dot: bool = True, split_k: int = 1) -> dict[str, Any]:
    return {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 2, "use_dot": use_dot,
            "split_k": split_k}


def _tiled(block_m: int, split_k: int = 1) -> dict[str, Any]:
    return {"block_m": block_m, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2, "group_m": 2,
            "split_k": split_k}


def _table(**over: Any) -> dict[str, Any]:
    table = {"version": 1, "device": NAME, "dtype": "float32",
             "skinny": {"int4-g32-sym": {f"{N}x{K}": {"1": _skinny(8, use_dot=False), "8": _skinny(16, 64),
                                                       "16": _skinny(32, split_k=2)}}},
             "tiled": {"int4-g32-sym": {f"{N}x{K}": {"64": _tiled(16), "512": _tiled(32, split_k=3)}}}}
    table.update(over)
    return table


@pytest.fixture
def device_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fake device name for the CPU and a table folder of this test; returns a writer of its table."""
    monkeypatch.setattr(tuned, "device_name", lambda device: NAME)
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    tuned.table_for.cache_clear()

    def write(table: Any) -> Path:
        path = tmp_path / "test-gpu-9000.json"
        path.write_text(table if isinstance(table, str) else json.dumps(table))
        tuned.table_for.cache_clear()
        return path

    yield write
    tuned.table_for.cache_clear()


def _x(m: int, k: int = K, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)


def _rules(x: torch.Tensor, w: PackedWeight) -> tuple[Any, Any]:
    n, k = w.shape
    return default_config(x.shape[0], n, k, 1, num_sms(x.device)), default_gemm_config(x.shape[0], n, k)


# ---- names --------------------------------------------------------------------------------------------------


def test_device_slug_and_format_keys() -> None:
    assert tuned.device_slug("NVIDIA H200") == "nvidia-h200"
    assert tuned.device_slug("NVIDIA GeForce RTX 4090 (laptop)") == "nvidia-geforce-rtx-4090-laptop"
    assert tuned.table_path("NVIDIA H200", Path("d")) == Path("d/nvidia-h200.json")
    with pytest.raises(ValueError, match="no letters"):
        tuned.device_slug(" -- ")
    int8 = PackedWeight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), None, None, 8, 64)
    q8_0 = PackedWeight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), None, None, 8, 32)
    q4_1 = PackedWeight(torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, 2), None, None, 4, 32, torch.ones(4, 2))
    assert [tuned.format_key(w) for w in (int8, q8_0, q4_1)] == ["int8-ch-sym", "int8-g32-sym", "int4-g32-min"]
    assert tuned.format_key(_int4(group=64, zeros=True)) == "int4-g64-zp"
    assert tuned.format_key(_int4(perm=True)) is None  # act-order: never tuned


# ---- lookup and fallback --------------------------------------------------------------------------------------


def test_without_a_table_the_launchers_choose_the_default_rules(device_table: Any) -> None:
    w = _int4()
    for m in (1, 8, 16, 64):
        x = _x(m)
        rule, gemm_rule = _rules(x, w)
        assert tuned.tuned_config("skinny", x, w) is None
        if m <= 16:
            assert skinny_config(x, w, None) == rule
        assert gemm_config(x, w, None) == gemm_rule


def test_off_cuda_no_table_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    (tmp_path / "cpu.json").write_text("not json")  # would fail if anything read it
    tuned.table_for.cache_clear()
    x, w = _x(1), _int4()
    assert tuned.device_name(x.device) is None
    assert skinny_config(x, w, None) == _rules(x, w)[0]


def test_the_table_entry_is_chosen_by_m_bucket(device_table: Any) -> None:
    device_table(_table())
    w = _int4()
    want = {1: QuantSkinnyConfig(8, 32, 4, 2, use_dot=False), 2: QuantSkinnyConfig(16, 64, 4, 2),
            8: QuantSkinnyConfig(16, 64, 4, 2), 9: QuantSkinnyConfig(32, 32, 4, 2, split_k=2),
            16: QuantSkinnyConfig(32, 32, 4, 2, split_k=2)}
    for m, cfg in want.items():
        assert skinny_config(_x(m), w, None) == cfg
    assert gemm_config(_x(17), w, None) == GemmConfig(16, 16, 32, 4, 2, 2)
    assert gemm_config(_x(600), w, None) == GemmConfig(32, 16, 32, 4, 2, 2, split_k=3)  # above all keys: the last
    explicit = QuantSkinnyConfig(16, 32, 4, 2)
    assert skinny_config(_x(1), w, explicit) is explicit  # a per-call config wins over the table


def test_entries_that_do_not_apply_fall_back_to_the_rules(device_table: Any) -> None:
    device_table(_table(skinny={"int4-g32-sym": {f"{N}x{K}": {"1": _skinny(8, use_dot=False)}}}))
    w = _int4()
    x8 = _x(8)
    assert skinny_config(x8, w, None) == _rules(x8, w)[0]  # the M = 1 variant is never taken for 8 rows
    for x, wt in ((_x(1, dtype=torch.float16), w),  # another dtype than the table's
                  (_x(1), _int4(zeros=True)),  # a format not in it
                  (_x(1, 96), _int4(k=96)),  # a shape not in it
                  (_x(1), _int4(perm=True))):  # act-order
        assert skinny_config(x, wt, None) == _rules(x, wt)[0]
        assert gemm_config(x, wt, None) == _rules(x, wt)[1]


def test_the_table_is_read_once_per_device(device_table: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    device_table(_table())
    reads = []
    real = tuned.load_table
    monkeypatch.setattr(tuned, "load_table", lambda path: reads.append(path) or real(path))
    w = _int4()
    for m in (1, 8, 64):
        tuned.tuned_config("skinny", _x(m), w)
        tuned.tuned_config("tiled", _x(m), w)
    assert len(reads) == 1


@pytest.mark.parametrize("m", [1, 8, 16, 64, 600])
def test_launches_through_table_entries_match_the_reference(device_table: Any, m: int) -> None:
    device_table(_table())
    w, x = _int4(), _x(m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    got = quant_skinny_matmul(x, w, bias) if m <= 16 else quant_matmul(x, w, bias)
    torch.testing.assert_close(got, quant_matmul_ref(x, w, bias), atol=2e-5, rtol=2e-5)


# ---- malformed tables -------------------------------------------------------------------------------------------

MALFORMED = {
    "not_json": ("{", "Expecting"),
    "version": (_table(version=2), "version must be 1"),
    "dtype": (_table(dtype="int8"), "dtype must be"),
    "unknown_key": (_table(extra=1), "unknown top-level keys"),
    "fields": (_table(skinny={"int4-g32-sym": {"40x128": {"1": {"block_n": 16}}}}), r"skinny\.int4-g32-sym"),
    "value": (_table(skinny={"int4-g32-sym": {"40x128": {"8": _skinny(12)}}}), "power of two"),
    "bool_for_int": (_table(tiled={"f": {"40x128": {"64": {**_tiled(16), "split_k": True}}}}), "want an int"),
    "fma_above_1": (_table(skinny={"f": {"40x128": {"8": _skinny(16, use_dot=False)}}}), "M = 1 only"),
    "shape_key": (_table(tiled={"f": {"40by128": {"64": _tiled(16)}}}), "not 'NxK'"),
    "m_key": (_table(tiled={"f": {"40x128": {"0": _tiled(16)}}}), "not a positive integer"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_table_fails_the_launch_naming_the_file(device_table: Any, case: str) -> None:
    table, detail = MALFORMED[case]
    path = device_table(table)
    with pytest.raises(TunedTableError, match=detail) as err:
        quant_skinny_matmul(_x(1), _int4())
    assert str(path) in str(err.value)


# ---- the sweep's plumbing (tiny shapes, tiny grid, interpreter; no timing asserted) --------------------------------


def _sweep(out: Path, *extra: str) -> None:
    from tokenmill.benchmarks import gpu_quant

    gpu_quant.main(["--sweep", "--out", str(out), "--shapes", "tiny", "--grid", "tiny", "--dtype", "float32",
                    "--skinny-rows", "1", "8", "--tiled-rows", "32", *extra])


@pytest.mark.slow
def test_sweep_writes_a_table_the_launchers_read(tmp_path: Path) -> None:
    from tokenmill.benchmarks import gpu_quant

    _sweep(tmp_path, "--formats", "int4-g128-sym")
    _sweep(tmp_path, "--formats", "int8-g32-sym")  # a second call adds its format to the same table
    table = tuned.load_table(tmp_path / "cpu.json")
    assert table.dtype == torch.float32
    for fmt in ("int4-g128-sym", "int8-g32-sym"):
        for n, k in gpu_quant.TINY_SHAPES.values():
            assert [m for m, _ in table.entries[("skinny", fmt, n, k)]] == [1, 8]
            assert [m for m, _ in table.entries[("tiled", fmt, n, k)]] == [32]
    payload = json.loads((tmp_path / "gpu_quant_sweep.json").read_text())
    assert payload["complete"] and len(payload["cells"]) == 2 * 3  # the last call's cells: 2 shapes x 3 rows
    assert all(len(c["times_ms"]) == 3 and not c["rejected"] for c in payload["cells"])  # 2 candidates + the rule
    md = (tmp_path / "gpu_quant_sweep.md").read_text()
    # skinny cells go through the entry point decode launches for their projection; tiled cells through the plain one
    assert "| skinny | int8-g32-sym | qkv | norm | 1 |" in md and "| skinny | int8-g32-sym | down | silu | 8 |" in md
    assert "| tiled | int8-g32-sym | down | plain | 32 |" in md
    assert {(c["proj"], c["kernel"], c["prologue"]) for c in payload["cells"]} == {
        ("qkv", "skinny", "norm"), ("down", "skinny", "silu"), ("qkv", "tiled", "plain"), ("down", "tiled", "plain")}


@pytest.mark.slow
def test_sweep_checks_each_candidate_before_timing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.benchmarks import gpu_quant

    timed = []
    monkeypatch.setattr(gpu_quant, "SWEEP_TOL", -1.0)  # every output "wrong": nothing may be timed
    monkeypatch.setattr(gpu_quant, "wall_timer", lambda fn, *a: timed.append(fn) or 1.0)
    cells, complete = gpu_quant.sweep(DEV, torch.float32, ["int4-g32-min"], {"o": (24, 96)}, (1,), (), tiny=True,
                                      budget_s=600, bench=(1, 1), compile_workers=0)
    assert complete and len(cells) == 1 and not timed
    assert len(cells[0].rejected) == 3 and all("relative error" in why for why in cells[0].rejected.values())
    assert gpu_quant.sweep_table(cells, "cpu", torch.float32, None)["skinny"] == {}  # no entry from no timing


def test_sweep_stops_at_its_budget_and_keeps_what_it_has(tmp_path: Path) -> None:
    from tokenmill.benchmarks import gpu_quant

    cells, complete = gpu_quant.sweep(DEV, torch.float32, ["int4-g32-min"], {"o": (24, 96)}, (1,), (), tiny=True,
                                      budget_s=0.0, bench=(1, 1), compile_workers=0)
    assert not complete and cells == []
    assert "STOPPED AT THE BUDGET" in gpu_quant.sweep_md(cells, {}, complete, "test")


def test_full_grid_is_bounded_and_holds_the_bf16_kernels_choice() -> None:
    """The stage sizes the README's time estimate is built on; the bf16 skinny kernel's config is a candidate."""
    from tokenmill.benchmarks import gpu_quant

    w, x = gpu_quant.random_packed("int4-g128-sym", 4096, 4096, DEV), torch.zeros(8, 4096)
    cell = gpu_quant._Cell("skinny", "int4-g128-sym", "o", 4096, 4096, 8, (x,), [w], x,
                           gpu_quant._default("skinny", 8, w))
    stage0 = gpu_quant._stage_candidates(cell, 0, tiny=False)
    n, k = w.shape
    bf16 = default_config(8, n, k, 2, num_sms(DEV))
    assert any((c.block_n, c.block_k, c.use_dot) == (bf16.block_n, bf16.block_k, bf16.use_dot) for c in stage0)
    assert len(stage0) <= 15 and len(gpu_quant._pipelines(stage0[0])) == 9 and len(gpu_quant._splits(stage0[0])) == 3
    assert len(gpu_quant._tiles("tiled", 64)) == len(gpu_quant._tiles("tiled", 512)) == 6
    tiled = gpu_quant._Cell("tiled", "int4-g128-sym", "o", 4096, 4096, 64, (x,), [w], x,
                            gpu_quant._default("tiled", 64, w))
    magic = [c for c in gpu_quant._stage_candidates(tiled, 0, tiny=False) if getattr(c, "magic", False)]
    assert len(magic) == 3 and all(c.block_k % 128 == 0 for c in magic)
    one = gpu_quant._Cell("skinny", "int4-g128-sym", "o", 4096, 4096, 1, (x[:1],), [w], x[:1],
                          gpu_quant._default("skinny", 1, w))
    int8 = gpu_quant.random_packed("int8-ch-sym", 4096, 4096, DEV)
    cell8 = gpu_quant._Cell("skinny", "int8-ch-sym", "o", 4096, 4096, 1, (x[:1],), [int8], x[:1],
                            gpu_quant._default("skinny", 1, int8))
    for c, per_word in ((one, 8), (cell8, 4)):  # M = 1: the plane tiles as well, 2048-8192 words each
        planes = [p for p in gpu_quant._stage_candidates(c, 0, tiny=False) if getattr(p, "planes", False)
                  and not p.use_dot]
        assert len(planes) == 6 and all(2048 <= p.block_n * p.block_k // per_word <= 8192 for p in planes)
    magic = [p for p in stage0 if getattr(p, "planes", False)]  # M = 8: INT4 g128's tensor-core variant only
    assert len(magic) == 6 and all(p.use_dot and p.block_k % 128 == 0 for p in magic)
    assert not any(getattr(p, "planes", False) for p in gpu_quant._stage_candidates(cell8, 0, tiny=False)
                   if p.use_dot)  # int8: no magic_dot


@pytest.mark.slow
def test_precompile_workers_run_each_compiled_kernel_once() -> None:
    """The compile pool's plumbing (spawned workers, jobs pickled, one job per compiled kernel: split counts > 1
    share one); under the interpreter the workers just run the launches."""
    from tokenmill.benchmarks import gpu_quant

    cfg = QuantSkinnyConfig(16, 32, 4, 2, use_dot=False)
    jobs = [("int4-g32-min", 24, 96, 1, "skinny", "plain", c, "float32", "cpu")
            for c in (cfg, cfg, QuantSkinnyConfig(16, 32, 4, 2, use_dot=False, split_k=2),
                      QuantSkinnyConfig(16, 32, 4, 2, use_dot=False, split_k=4))]
    jobs.append(("int4-g32-min", 24, 96, 1, "skinny", "norm", cfg, "float32", "cpu"))  # another prologue: compiled
    pre = gpu_quant._Precompiler(1)
    try:
        assert pre.run(jobs, timeout_s=300) == [None, None, None]  # unsplit + split + the norm prologue's
        assert pre.run(jobs, timeout_s=300) == []  # nothing new
    finally:
        pre.close()
