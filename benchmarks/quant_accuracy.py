"""Accuracy of the quantized formats on real weights (issue 16): the embedded SmolLM2-135M-Instruct, whose own
weights are 4-bit (Q4_1, blocks of 32), dequantized to float32 as the reference; INT4 uses groups of 128, so
its grid is not the file's own.

For each held-out ShareGPT exchange (the last N pairs of the file; GPTQ calibrates on the first ones), the
chat-formatted human turn and the gpt reply run through every model teacher-forced, and over the reply tokens:
    perplexity            exp(mean NLL of the reply tokens), and its change against the reference in %
    mean KL               KL(P_ref || P_quant) of the next-token distributions, nats per token
    greedy agreement      the share of positions whose argmax equals the reference's (teacher-forced)
Formats: INT8 (W8A16 per channel, online), FP8 W8A8 (EMULATED on the CPU: weights and per-token activations rounded
to e4m3 and multiplied in fp32; fp8_gptq: the weights rounded by GPTQ instead of to nearest, a checkpoint of
`tokenmill quantize --method fp8 --gptq` calibrated like INT4 GPTQ), INT4 RTN g128 and INT4 GPTQ g128 (symmetric,
checkpoints written by `tokenmill quantize` and read back through the GPTQ loader, dense tensors in float32 like
the reference), and FP8 KV cache (the reference's weights, keys and values stored as e4m3 with per-head scales: the
torch reference backend, whose rounding `quantize_kv_fp8` the Triton KV-write kernels match bit for bit, since the
CPU engine refuses --kv-cache-dtype fp8; the scales are calibrated once, as the engine's first step does, on the
file's first exchange and then fixed for every held-out reply); fp8_kv_hadamard is the same cache with
--kv-cache-rotation hadamard.
Not a timed test: a benchmark (minutes on the CPU).

    python -m tokenmill.benchmarks.quant_accuracy --num-replies 200 --out benchmarks/results/cpu
    python -m tokenmill.benchmarks.quant_accuracy --formats fp8_kv --name quant_accuracy_fp8_kv --out ...
    python -m tokenmill.benchmarks.quant_accuracy --formats fp8_kv,fp8_kv_hadamard --name \
        quant_accuracy_fp8_kv_hadamard --out ...
    python -m tokenmill.benchmarks.quant_accuracy --formats int4_rtn,int4_gptq --int4-asymmetric --act-order \
        --num-calibration 64 --clip 0.5 --name quant_accuracy_int4_clip --out ...   # GPTQ's rounding options
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.benchmarks.common import git_commit, write_results
from tokenmill.benchmarks.datasets import ChatExchange, chat_exchanges
from tokenmill.kernels.attention_ref import FP8_KV
from tokenmill.worker.attention.kv_rotation import kv_rotation_matrix
from tokenmill.worker.attention.torch_ref import TorchRefBackend
from tokenmill.worker.engine import load_tokenizer
from tokenmill.worker.loader import ModelSource, build_model, resolve_model
from tokenmill.worker.model_runner import attention_metadata
from tokenmill.worker.models.layers import Linear
from tokenmill.worker.models.llama import LlamaForCausalLM
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.fp8 import quantize_fp8_rows
from tokenmill.worker.quant.packed import PackedLinearMethod

FORMATS = ("int8", "fp8", "fp8_gptq", "int4_rtn", "int4_gptq", "fp8_kv", "fp8_kv_hadamard")
# formats whose difference is the KV cache's dtype (float32 otherwise), and those of them with a kv_cache_rotation
KV_DTYPES = {"fp8_kv": FP8_KV, "fp8_kv_hadamard": FP8_KV}
KV_ROTATIONS = {"fp8_kv_hadamard": "hadamard"}
BLOCK = 16
GROUP_SIZE = 128


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="embedded")
    p.add_argument("--num-replies", type=int, default=200, help="held-out ShareGPT exchanges (the file's last)")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="the prompt's last tokens")
    p.add_argument("--max-reply-tokens", type=int, default=128, help="the reply's first tokens")
    p.add_argument("--num-calibration", type=int, default=16, help="GPTQ calibration exchanges (the file's first)")
    p.add_argument("--calibration-tokens", type=int, default=512)
    p.add_argument("--int4-asymmetric", action="store_true", help="INT4 with zero points (default: symmetric)")
    p.add_argument("--act-order", action="store_true", help="GPTQ quantizes columns in descending Hessian order")
    p.add_argument("--true-sequential", action="store_true", help="GPTQ: o / down Hessians after qkv / gate_up")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ: fraction of mean(diag H) on H's diagonal")
    p.add_argument("--clip", type=float, nargs="?", const=0.75, default=None, metavar="MIN_SHRINK",
                   help="GPTQ: each group's range by least H-weighted squared error, shrunk down to MIN_SHRINK")
    p.add_argument("--rtn-clip", type=float, nargs="?", const=0.75, default=None, metavar="MIN_SHRINK",
                   help="INT4 RTN: each group's range by least squared error, shrunk down to MIN_SHRINK")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--work", default=None, help="folder for the INT4 checkpoints (default: a temporary one)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="dequantize at every call (the methods' own CPU path)")
    p.add_argument("--out", default=None, help="results folder (<name>.json / .md); summary.json merged")
    p.add_argument("--name", default="quant_accuracy", help="results file stem (a run of some formats apart)")
    return p


class _Stats:
    def __init__(self) -> None:
        self.nll = 0.0
        self.kl = 0.0
        self.agree = 0
        self.tokens = 0

    def add(self, logp: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None) -> None:
        self.nll -= float(logp.gather(1, targets[:, None]).sum())
        self.tokens += targets.numel()
        if ref_logp is not None:
            self.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            self.agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())

    def summary(self, ref_ppl: float | None) -> dict[str, float]:
        ppl = math.exp(self.nll / self.tokens)
        out = {"ppl": ppl, "tokens": self.tokens}
        if ref_ppl is not None:
            out |= {"ppl_delta_pct": 100.0 * (ppl / ref_ppl - 1.0), "mean_kl": self.kl / self.tokens,
                    "greedy_agreement": self.agree / self.tokens}
        return out


def reply_logprobs(model: LlamaForCausalLM, ex: ChatExchange, kv_dtype: torch.dtype = torch.float32,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [R, vocab] of the reply's R tokens, the tokens [R]) in one teacher-forced forward (its
    keys and values written to, and read back from, a KV cache of kv_dtype)."""
    ids = list(ex.prompt_ids + ex.reply_ids)
    n, blocks = len(ids), -(-len(ids) // BLOCK)
    a = model.arch
    shape = (blocks, BLOCK, a.num_kv_heads, a.head_dim)
    caches = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)) for _ in range(a.num_layers)]
    meta = attention_metadata([n], [n], [list(range(blocks))], list(range(n)), torch.device("cpu"))
    hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
    rows = torch.arange(len(ex.prompt_ids) - 1, n - 1)
    return F.log_softmax(model.compute_logits(hidden[rows]).float(), dim=-1), torch.tensor(ex.reply_ids)


# formats read back from a checkpoint that `tokenmill quantize` writes: (method, GPTQ)
CHECKPOINTS = {"int4_rtn": ("int4", False), "int4_gptq": ("int4", True), "fp8_gptq": ("fp8", True)}


def _checkpoint(model: str, work: Path, fmt: str, args: argparse.Namespace) -> Path:
    """The checkpoint of CHECKPOINTS format `fmt` by `tokenmill quantize` (INT4 in groups of 128; written once per
    work folder: a new folder for new options)."""
    from tokenmill.cli.quantize import quantize

    method, gptq = CHECKPOINTS[fmt]
    int4 = method == "int4"
    out = work / fmt
    if not (out / "model.safetensors").is_file():
        ns = argparse.Namespace(model=model, load_format="auto", method=method, group_size=GROUP_SIZE,
                                asymmetric=int4 and args.int4_asymmetric, gptq=gptq,
                                act_order=int4 and gptq and args.act_order, calibration="sharegpt",
                                true_sequential=gptq and args.true_sequential, damp=args.damp,
                                clip=(args.clip if gptq else args.rtn_clip) if int4 else None,
                                num_calibration=args.num_calibration, calibration_tokens=args.calibration_tokens,
                                format="gptq" if int4 else None, dtype="float32", out=str(out))
        quantize(ns)
    return out


class CachedDequantized(LinearMethod):
    """The CPU path of a quantized layer with its dequantized weight computed once instead of at every call:
    the same numbers (INT8 / INT4: W dequantized in fp32 and rounded to x's dtype, then F.linear; FP8: x
    quantized per token, the e4m3 weight times its scales, F.linear in fp32), in far less CPU time."""

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError("evaluation only")

    def create_weights(self, layer: Any, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | None) -> None:
        raise NotImplementedError("evaluation only")

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        w, bias = layer.cached_weight, layer.bias
        if not layer.cached_fp8:
            return F.linear(x, w.to(x.dtype), bias)
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize_fp8_rows(x2)
        y = F.linear(qx.float() * sx, w)
        y = y if bias is None else y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def cache_dequantized(model: LlamaForCausalLM) -> None:
    """Give every quantized projection of `model` its dequantized weight, computed once (CachedDequantized)."""
    from tokenmill.kernels.quant_weight import dequantize_packed

    cached = CachedDequantized()
    for m in model.modules():
        if not isinstance(m, Linear) or m.method.name == "none":
            continue
        if isinstance(m.method, PackedLinearMethod):
            m.cached_weight, m.cached_fp8 = dequantize_packed(m.method.packed(m)), False  # type: ignore[arg-type]
        else:
            m.cached_weight, m.cached_fp8 = m.qweight.float() * m.scales, True
        m.method = cached


def calibrate_fp8_kv(model: LlamaForCausalLM, backend: TorchRefBackend, ex: ChatExchange) -> None:
    """Set every layer's FP8 KV scales from one exchange's prefill, as the engine's first step does."""
    backend.calibrate_kv_scales = True
    try:
        reply_logprobs(model, ex, FP8_KV)
    finally:
        backend.calibrate_kv_scales = False


def build_models(args: argparse.Namespace, formats: list[str], work: Path) -> dict[str, LlamaForCausalLM]:
    source = resolve_model(args.model)
    lens = (args.max_prompt_tokens, args.max_reply_tokens)
    models = {"reference": variant_model(source, "auto", False)}
    for fmt in formats:
        if fmt in ("int8", "fp8") or fmt in KV_DTYPES:  # FP8 KV: the reference's weights, its K/V as e4m3
            models[fmt] = variant_model(source, "auto" if fmt in KV_DTYPES else fmt, fmt in KV_DTYPES,
                                        cache=not args.no_cache, calibration_lens=lens,
                                        kv_rotation=KV_ROTATIONS.get(fmt, "none"))
            continue
        path = _checkpoint(args.model, work, fmt, args)
        models[fmt] = build_model(resolve_model(str(path)), TorchRefBackend(), torch.device("cpu"), torch.float32,
                                  fp8_emulation=CHECKPOINTS[fmt][0] == "fp8")
        if not args.no_cache:
            cache_dequantized(models[fmt])
    return models


def variant_model(source: ModelSource, weights: str, fp8_kv: bool, *, cache: bool = True,
                  calibration_lens: tuple[int, int] = (128, 128), kv_rotation: str = "none") -> LlamaForCausalLM:
    """The model on the CPU in float32 with its decoder projections quantized on load to `weights` ("auto": as
    the checkpoint holds them; "int8"; "fp8", emulated; `cache`: dequantized once, CachedDequantized) and, with
    `fp8_kv`, its keys and values stored as e4m3 with scales calibrated on the file's first exchange (cut to
    `calibration_lens` prompt / reply tokens) and its own backend (the calibration flag is the backend's), which
    rotates them first by EngineConfig.kv_cache_rotation `kv_rotation` (as the engine's backend)."""
    assert fp8_kv or kv_rotation == "none", "EngineConfig refuses a rotation without an fp8 cache"
    backend = TorchRefBackend(kv_rotation_matrix(kv_rotation, source.arch.head_dim, torch.device("cpu")))
    out = build_model(source, backend, torch.device("cpu"), torch.float32, weights, fp8_emulation=weights == "fp8")
    if weights != "auto" and cache:
        cache_dequantized(out)
    if fp8_kv:
        first = chat_exchanges(load_tokenizer(source), range(0, 1), *calibration_lens)[0]
        calibrate_fp8_kv(out, backend, first)
    return out


def variant_accuracy(model: str, variants: dict[str, tuple[str, bool]], num_replies: int,
                     ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Perplexity change, mean KL and greedy agreement against the unquantized model of each variant
    (name -> (weights, fp8_kv) as variant_model takes them) on the last `num_replies` held-out exchanges."""
    source = resolve_model(model)
    models = {"reference": variant_model(source, "auto", False)}
    models |= {name: variant_model(source, w, kv) for name, (w, kv) in variants.items()}
    exchanges = chat_exchanges(load_tokenizer(source), range(-num_replies, 0), 128, 128)
    kv_dtypes = {name: FP8_KV for name, (_, kv) in variants.items() if kv}
    return evaluate(models, exchanges, kv_dtypes)


@torch.inference_mode()
def evaluate(models: dict[str, LlamaForCausalLM], exchanges: list[ChatExchange],
             kv_dtypes: dict[str, torch.dtype] = KV_DTYPES) -> dict[str, dict[str, float]]:
    stats = {name: _Stats() for name in models}
    for i, ex in enumerate(exchanges):
        ref_logp, targets = reply_logprobs(models["reference"], ex)
        stats["reference"].add(ref_logp, targets, None)
        for name, model in models.items():
            if name != "reference":
                stats[name].add(reply_logprobs(model, ex, kv_dtypes.get(name, torch.float32))[0], targets, ref_logp)
        if (i + 1) % 20 == 0:
            print(f"{i + 1}/{len(exchanges)} exchanges", flush=True)
    ref_ppl = stats["reference"].summary(None)["ppl"]
    return {name: s.summary(None if name == "reference" else ref_ppl) for name, s in stats.items()}


def reference_label(model: str) -> str:
    """What the reference is: the embedded model's Q4_1 blocks, or another model's weights, dequantized."""
    if model == "embedded":
        return "embedded GGUF Q4_1 dequantized, float32"
    return f"{Path(model).name}, its weights dequantized to float32"


def table(results: dict[str, dict[str, float]], n: int, asymmetric: bool = False, act_order: bool = False,
          gptq_extra: tuple[str, ...] = (), rtn_extra: tuple[str, ...] = (), model: str = "embedded") -> str:
    """The results as a markdown table; *_extra: the INT4 options to name in the rows' labels."""
    grid = "asym" if asymmetric else "sym"
    head = ("SmolLM2-135M-Instruct (embedded; its weights are Q4_1 blocks of 32, dequantized = the reference; "
            if model == "embedded" else f"{reference_label(model)} = the reference (")
    labels = {"reference": "reference (Q4_1 dequantized, fp32)" if model == "embedded" else "reference (fp32)",
              "int8": "INT8 W8A16 per channel",
              "fp8": "FP8 W8A8 e4m3 (CPU emulation)",
              "fp8_gptq": "FP8 W8A8 e4m3, weights by GPTQ (CPU emulation" + "".join(
                  f", {e}" for e in gptq_extra if "clip" not in e) + ")",
              "int4_rtn": f"INT4 RTN g128 {grid}" + "".join(
                  f", {e}" for e in rtn_extra),
              "int4_gptq": f"INT4 GPTQ g128 {grid}" + (", act-order" if act_order else "") + "".join(
                  f", {e}" for e in gptq_extra),
              "fp8_kv": "FP8 KV cache e4m3, per-head scales (torch reference of the kernels' rounding)",
              "fp8_kv_hadamard": "the same, keys and values rotated by a Hadamard matrix (--kv-cache-rotation)"}
    rows = [f"{head}INT4 in groups of 128), {n} held-out ShareGPT replies, teacher-forced.", "",
            "| format | perplexity | ppl delta | mean KL (nats/token) | greedy agreement |", "|---|---|---|---|---|"]
    for name, r in results.items():
        if name == "reference":
            rows.append(f"| {labels[name]} | {r['ppl']:.4f} | - | - | - |")
        else:
            rows.append(f"| {labels[name]} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.2f}% | {r['mean_kl']:.5f} | "
                        f"{100 * r['greedy_agreement']:.2f}% |")
    return "\n".join(rows)


def _gptq_labels(args: argparse.Namespace) -> tuple[str, ...]:
    out = [f"{args.num_calibration} calibration exchanges"]
    if args.true_sequential:
        out.append("true-sequential")
    if args.clip is not None:
        out.append(f"H-weighted MSE clip >= {args.clip}")
    if args.damp != 0.01:
        out.append(f"damp {args.damp}")
    return tuple(out)


def run_cli(args: argparse.Namespace) -> int:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise SystemExit(f"unknown formats {sorted(unknown)}; known: {', '.join(FORMATS)}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        models = build_models(args, formats, work)
        tokenizer = load_tokenizer(resolve_model(args.model))
        exchanges = chat_exchanges(tokenizer, range(-args.num_replies, 0), args.max_prompt_tokens,
                                   args.max_reply_tokens)
        results = evaluate(models, exchanges)
    payload: dict[str, Any] = {
        "benchmark": "quant_accuracy", "model": args.model, "reference": reference_label(args.model),
        "group_size": GROUP_SIZE, "replies": len(exchanges), "max_prompt_tokens": args.max_prompt_tokens,
        "max_reply_tokens": args.max_reply_tokens, "gptq_calibration": {
            "exchanges": args.num_calibration, "tokens_each": args.calibration_tokens, "damp": args.damp,
            "act_order": args.act_order, "true_sequential": args.true_sequential, "clip_min_shrink": args.clip},
        "int4_rtn_clip_min_shrink": args.rtn_clip, "int4_asymmetric": args.int4_asymmetric,
        "fp8": "emulated on the CPU (fake-quantized weights and activations)",
        "fp8_kv": "the reference's weights; K/V stored as e4m3 with per-kv-head power-of-two scales, calibrated on the "
                  "file's first exchange, read back by the torch reference backend (the kernels' rounding, bit-exact)",
        "fp8_kv_hadamard": "fp8_kv with --kv-cache-rotation hadamard: keys (after rotary; queries alike) and values "
                           "rotated by H / sqrt(head_dim) before the cache write, the attention output rotated back",
        "dequantized_weights_cached": not args.no_cache, "results": results, "seconds": time.perf_counter() - t0}
    md = table(results, len(exchanges), args.int4_asymmetric, args.act_order, _gptq_labels(args),
               () if args.rtn_clip is None else (f"MSE clip >= {args.rtn_clip}",), args.model)
    if args.out:
        out = Path(args.out)
        write_results(out, args.name, payload, md)
        from tokenmill.benchmarks.summary import record_file

        record_file(out / f"{args.name}.json", commit=git_commit())
    else:
        print(md)
    return 0


def main() -> None:
    parser = build_parser(argparse.ArgumentParser(description=__doc__,
                                                  formatter_class=argparse.RawDescriptionHelpFormatter))
    raise SystemExit(run_cli(parser.parse_args()))


if __name__ == "__main__":
    main()
