"""Quantization's bad input gets a clear error naming the problem, and an engine already serving a request keeps
serving it: an unsupported quantization method, packed tensors of the wrong shape or dtype, a quantized
checkpoint asked to load as another format, FP8 weights or an FP8 KV cache on a device without FP8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_bad_input import check_rejected_beside_neighbour
from tiny_hf import save_tiny_model

from tokenmill.cli.main import main
from tokenmill.protocol import InvalidRequest
from tokenmill.worker.config import EngineConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError

DUMMY = dict(model="tiny-llama", load_format="dummy", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(**DUMMY))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny dense HF model and its INT4 (GPTQ layout) and INT8 (compressed-tensors) checkpoints."""
    root = tmp_path_factory.mktemp("quant")
    hf = save_tiny_model("llama", root)
    out = {"hf": hf}
    for method, fmt in (("int4", "gptq"), ("int8", "compressed-tensors")):
        out[method] = root / method
        assert main(["quantize", "--model", str(hf), "--method", method, "--group-size", "32", "--format", fmt,
                     "--dtype", "float32", "--out", str(out[method])]) == 0
    return out


def _variant(src: Path, dst: Path, *, config: dict[str, object] | None = None,
             cut: tuple[tuple[str, slice], ...] = ()) -> Path:
    """A copy of checkpoint `src` with its quantization_config replaced and/or tensors cut to slices."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = config
        (dst / "config.json").write_text(json.dumps(cfg))
    if cut:
        state = load_file(str(dst / "model.safetensors"))
        for name, rows in cut:
            state[name] = state[name][rows].contiguous()
        save_file(state, str(dst / "model.safetensors"))
    return dst


def _bad_configs(ck: dict[str, Path], tmp: Path) -> dict[str, tuple[EngineConfig, str]]:
    q_scales = "model.layers.0.self_attn.q_proj.scales"
    q_int8 = "model.layers.0.self_attn.q_proj.weight"
    return {
        "fp8_without_fp8": (EngineConfig(**DUMMY, quantization="fp8"),  # type: ignore[arg-type]
                            r"FP8 W8A8 \(--quantization fp8\) needs a GPU with FP8 tensor cores \(CUDA compute "
                            r"capability >= 8.9"),
        "fp8_kv_cache_on_cpu": (EngineConfig(**DUMMY, kv_cache_dtype="fp8"),  # type: ignore[arg-type]
                                r"--kv-cache-dtype fp8 needs a GPU with FP8 .* the cpu device has none"),
        "unsupported_method": (EngineConfig(model=str(_variant(ck["hf"], tmp / "bnb", config={
            "quant_method": "bitsandbytes", "load_in_4bit": True})), device="cpu"),
            r"quantization method 'bitsandbytes' is not supported \(supported: gptq, awq, compressed-tensors, fp8\)"),
        "unsupported_bits": (EngineConfig(model=str(_variant(ck["int4"], tmp / "gptq3", config={
            "quant_method": "gptq", "bits": 3, "group_size": 32})), device="cpu"), "GPTQ with bits=3"),
        "packed_tensor_wrong_shape": (EngineConfig(model=str(_variant(ck["int4"], tmp / "cut", cut=(
            (q_scales, slice(0, 1)),))), device="cpu"),
            r"model\.layers\.0\.self_attn\.q_proj: scales is \(1, 64\) torch\.float16, expected \(2, 64\)"),
        "int8_weight_wrong_shape": (EngineConfig(model=str(_variant(ck["int8"], tmp / "cut8", cut=(
            (q_int8, slice(0, 8)), (q_int8 + "_scale", slice(0, 8))))), device="cpu"),
            r"weight 'model\.layers\.0\.self_attn\.q_proj\.qweight' has shape \(8, 64\), the model expects \(64, 64\)"),
        "scales_disagree_with_weight": (EngineConfig(model=str(_variant(ck["int8"], tmp / "cut8s", cut=(
            (q_int8, slice(0, 8)),))), device="cpu"),
            r"q_proj: weight is \(8, 64\) torch\.int8 but weight_scale \(64, 1\): one scale per output row"),
        "checkpoint_as_other_method": (EngineConfig(model=str(ck["int4"]), device="cpu", quantization="int8"),
                                       "is a gptq int4 checkpoint; it cannot be loaded as int8"),
    }


def test_bad_quantization_fails_clearly_while_an_engine_keeps_serving(engine: LLMEngine, checkpoints: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    for case, (config, match) in _bad_configs(checkpoints, tmp_path).items():
        def load(config: EngineConfig = config) -> None:
            try:
                LLMEngine(config)
            except ModelLoadError as e:
                raise InvalidRequest(str(e)) from e

        check_rejected_beside_neighbour(engine, load, match, f"good-{case}")


def test_the_good_checkpoints_load(checkpoints: dict[str, Path]) -> None:
    for method in ("int4", "int8"):
        engine = LLMEngine(EngineConfig(model=str(checkpoints[method]), device="cpu", max_model_len=64))
        assert engine.runner.model.model.layers[0].mlp.down_proj.method.name == method


def test_unknown_quantization_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        EngineConfig(quantization="int3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")  # type: ignore[arg-type]


def test_cli_fp8_on_cpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                 "--quantization", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: error: FP8 W8A8") and err.count("\n") == 1 and "Traceback" not in err


def test_quantize_refuses_bad_options(checkpoints: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    cases = [(["--method", "int8", "--gptq"], "int4 or fp8, not int8"),
             (["--method", "fp8", "--act-order"], "INT4 options"),
             (["--method", "int4", "--act-order"], "--act-order needs --gptq"),
             (["--method", "int8", "--format", "awq"], "the awq layout holds INT4 weights"),
             (["--method", "int4", "--model", str(checkpoints["int4"])], "already a gptq checkpoint")]
    for args, match in cases:
        argv = ["quantize", "--model", str(checkpoints["hf"]), *args, "--out", str(tmp_path / "x")]
        assert main(argv) == 2, args
        assert match in capsys.readouterr().err
