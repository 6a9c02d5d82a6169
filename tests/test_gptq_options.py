"""The rounding options of INT4 quantization (worker/quant/rtn.py MseClip, worker/quant/gptq.py GptqOptions):
the clipped group range's rounding error against min-max's, and true-sequential GPTQ's layer output error
against the one-pass Hessians', on small synthetic matrices and a tiny model on the CPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tiny_hf import save_tiny_model

from tokenmill.kernels.quant_weight import PackedWeight, dequantize_packed, pack_int4
from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.loader import build_model, resolve_model
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.models.llama import LlamaForCausalLM
from tokenmill.worker.quant.config import QuantConfig
from tokenmill.worker.quant.gptq import GptqOptions, Hessian, gptq_quantize
from tokenmill.worker.quant.quantizer import gptq_quantize_model, rtn_quantize_model
from tokenmill.worker.quant.rtn import MseClip, int4_group_params, quantize_int4

CPU = torch.device("cpu")


def _with_outliers(n: int, k: int, seed: int) -> torch.Tensor:
    """w [n, k] ~ N(0, 1) with one entry per row 8x larger (the case min-max ranges handle worst)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[torch.arange(n), torch.randint(0, k, (n,), generator=gen)] *= 8.0
    return w


def _dequant(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g: int, perm: torch.Tensor | None = None,
             ) -> torch.Tensor:  # fmt: skip
    return dequantize_packed(PackedWeight(pack_int4(q), s, z, None if perm is None else perm.to(torch.int32), 4, g))


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_clip_lowers_the_rounding_error_of_groups_with_outliers(symmetric: bool) -> None:
    w = _with_outliers(64, 256, 0)
    errs = []
    for clip in (None, MseClip()):
        q, s, z = quantize_int4(w, 128, symmetric, torch.float32, clip)
        assert int(q.max()) <= 15 and s.shape == z.shape == (64, 2)
        errs.append(float(((_dequant(q, s, z, 128) - w) ** 2).sum()))
    assert errs[1] < 0.95 * errs[0], errs


def test_mse_clip_weights_columns_and_never_widens_the_range() -> None:
    """Per row the chosen range is min-max's shrunk by a factor in [min_shrink, 1]; weighting a column
    heavily makes its error no larger than unweighted search's."""
    w = _with_outliers(32, 128, 1)
    s_full, _ = int4_group_params(w, True, torch.float32)
    s_clip, _ = int4_group_params(w, True, torch.float32, MseClip(0.5, 11))
    assert bool((s_clip <= s_full).all()) and bool((s_clip >= 0.5 * s_full * (1 - 1e-6)).all())
    assert bool((s_clip < s_full).any())
    cw = torch.ones(128)
    cw[:4] = 1000.0  # the first 4 columns dominate the loss
    s_w, z_w = int4_group_params(w, True, torch.float32, MseClip(0.5, 11), cw)
    z = torch.full_like(s_clip, 8.0)

    def first_cols_err(s: torch.Tensor, z: torch.Tensor) -> float:
        q = (torch.round(w[:, :4] / s) + z).clamp(0, 15)
        return float((((q - z) * s - w[:, :4]) ** 2).sum())

    assert first_cols_err(s_w, z_w) <= first_cols_err(s_clip, z)


def test_clip_options_are_validated() -> None:
    with pytest.raises(ValueError, match="min_shrink"):
        MseClip(0.0)
    with pytest.raises(ValueError, match="steps"):
        MseClip(0.8, 0)
    with pytest.raises(ValueError, match="damp"):
        GptqOptions(damp=0.0)
    assert MseClip(0.5, 3).factors() == [1.0, 0.75, 0.5] and MseClip(0.5, 1).factors() == [1.0]


def test_gptq_with_clip_lowers_the_output_error_on_outlier_weights() -> None:
    k, n = 256, 64
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2048, k, generator=gen) * torch.rand(k, generator=gen) * 2
    w = _with_outliers(n, k, 3) / k**0.5
    h = Hessian(k)
    h.add(x)
    errs = []
    for clip in (None, MseClip()):
        r = gptq_quantize(w, h.value(), 128, False, True, torch.float32, clip=clip)
        errs.append(float(((_dequant(r.q, r.scales, r.zeros, 128, r.perm) - w) @ x.T).norm()))
    assert errs[1] < 0.98 * errs[0], errs


# ---- whole model ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("hf"))


def _hidden(model: LlamaForCausalLM, seqs: list[list[int]]) -> torch.Tensor:
    """The final hidden states of every sequence, concatenated [tokens, hidden]."""
    a, outs = model.arch, []
    with torch.no_grad():
        for ids in seqs:
            n = len(ids)
            blocks = -(-n // 16)
            caches = [(torch.zeros(blocks, 16, a.num_kv_heads, a.head_dim),
                       torch.zeros(blocks, 16, a.num_kv_heads, a.head_dim)) for _ in range(a.num_layers)]
            meta = attention_metadata([n], [n], [list(range(blocks))], list(range(n)), CPU)
            outs.append(model(torch.tensor(ids), torch.arange(n), caches, meta))
    return torch.cat(outs)


def test_true_sequential_gptq_lowers_the_output_error(tiny: Path) -> None:
    """Hessians of o / down collected with qkv / gate_up already quantized fit the inputs those projections
    will see: the quantized model's hidden states are nearer the dense ones on the calibration sequences."""
    dense = build_model(resolve_model(str(tiny)), TorchRefBackend(), CPU, torch.float32)
    seqs = [[(13 * i + 7 * j * j) % 380 + 2 for j in range(64)] for i in range(8)]
    want = _hidden(dense, seqs)
    errs = []
    for true_sequential in (False, True):
        model = copy.deepcopy(dense)
        gptq_quantize_model(model, QuantConfig("int4", 32, act_order=True), seqs,
                            options=GptqOptions(true_sequential=true_sequential))
        errs.append(float((_hidden(model, seqs) - want).norm()))
    assert errs[1] < errs[0], errs


def test_rtn_clip_is_an_int4_option(tiny: Path) -> None:
    dense = build_model(resolve_model(str(tiny)), TorchRefBackend(), CPU, torch.float32)
    with pytest.raises(ValueError, match="INT4 option"):
        rtn_quantize_model(dense, QuantConfig("int8"), clip=MseClip())
    plain = rtn_quantize_model(dense, QuantConfig("int4", 32))
    clipped = rtn_quantize_model(dense, QuantConfig("int4", 32), clip=MseClip())
    assert plain.keys() == clipped.keys()
    assert any(not torch.equal(plain[k]["scales"], clipped[k]["scales"]) for k in plain)


def test_quantize_cli_options_reach_the_quantizer(capsys: pytest.CaptureFixture[str]) -> None:
    """`tokenmill quantize`'s rounding flags: their defaults are the library's; misuse fails with exit 2."""
    from tokenmill.cli import quantize as cq
    from tokenmill.cli.main import build_parser, main
    from tokenmill.worker.quant.gptq import DAMP

    assert (DAMP, MseClip().min_shrink) == (cq.DAMP, cq.CLIP_MIN_SHRINK)
    parse = build_parser().parse_args
    args = parse(["quantize", "--method", "int4", "--gptq", "--out", "x"])
    assert (args.clip, args.true_sequential, args.damp) == (None, False, DAMP)
    args = parse(["quantize", "--method", "int4", "--gptq", "--clip", "--true-sequential", "--damp", "0.1",
                  "--out", "x"])
    assert (args.clip, args.true_sequential, args.damp) == (0.75, True, 0.1)
    assert parse(["quantize", "--method", "int4", "--clip", "0.6", "--out", "x"]).clip == 0.6
    for argv, message in ((["--method", "int8", "--clip"], "INT4 options"),
                          (["--method", "int4", "--true-sequential"], "--damp need --gptq"),
                          (["--method", "int4", "--damp", "0.1"], "--damp need --gptq"),
                          (["--method", "int4", "--clip", "1.5"], "min_shrink"),
                          (["--method", "int4", "--gptq", "--damp", "0"], "damp")):
        assert main(["quantize", "--model", "embedded", *argv, "--out", "unused"]) == 2
        assert message in capsys.readouterr().err
