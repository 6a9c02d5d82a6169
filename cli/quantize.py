"""`tokenmill quantize`: write a quantized Hugging Face checkpoint of a dense model (HF folder, GGUF file,
dummy shape or the embedded model) that `--model DIR` then loads:

    tokenmill quantize --model embedded --method int4 --gptq --out smollm2-int4-gptq   # GPTQ, g128, ShareGPT
    tokenmill quantize --model M --method int4 --group-size 64 --asymmetric --format awq --out DIR
    tokenmill quantize --model M --method int8 --out DIR       # compressed-tensors int-quantized
    tokenmill quantize --model M --method fp8 --out DIR        # compressed-tensors float-quantized
    tokenmill quantize --model M --method fp8 --gptq --out DIR # the same layout, weights rounded by GPTQ

INT4 and FP8 are rounded to nearest unless --gptq (Hessian-based rounding calibrated on ShareGPT conversations,
worker/quant/gptq.py; --act-order: INT4 columns in descending Hessian order, the order FP8 always rounds in, which
its layout does not store; --true-sequential: each projection's Hessian from inputs with the projections before
it in its layer quantized). --clip: each INT4 group's range shrunk to the
least squared rounding error (GPTQ: weighted by the Hessian's diagonal) instead of its min-max; the checkpoint
layout is the same. Runs on the CPU in float32.

    tokenmill quantize --model embedded --method int4 --gptq --act-order --asymmetric --clip --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenmill.cli.helptext import show_defaults

# worker/quant's defaults (gptq.DAMP, rtn.MseClip().min_shrink), here without importing torch at registration
DAMP = 0.01
CLIP_MIN_SHRINK = 0.75


def register(sub: Any) -> None:
    p = sub.add_parser("quantize", help="write a quantized checkpoint (INT8, INT4 RTN / GPTQ, FP8)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded", help="HF folder, .gguf file, dummy shape name or 'embedded'")
    p.add_argument("--load-format", default="auto", choices=("auto", "hf", "gguf", "dummy"))
    p.add_argument("--method", required=True, choices=("int8", "int4", "fp8"))
    p.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128), help="INT4 columns per scale")
    p.add_argument("--asymmetric", action="store_true", help="INT4 with a zero point per group")
    p.add_argument("--gptq", action="store_true", help="INT4 or FP8 by GPTQ instead of round to nearest")
    p.add_argument("--act-order", action="store_true", help="GPTQ: columns in descending Hessian order")
    p.add_argument("--true-sequential", action="store_true",
                   help="GPTQ: o / down Hessians collected after qkv / gate_up are quantized")
    p.add_argument("--damp", type=float, default=DAMP, help="GPTQ: fraction of mean(diag H) added to H's diagonal")
    p.add_argument("--clip", type=float, nargs="?", const=CLIP_MIN_SHRINK, default=None, metavar="MIN_SHRINK",
                   help="INT4: search each group's range from min-max down to this fraction of it (bare flag: "
                        f"{CLIP_MIN_SHRINK}) for the least squared rounding error")
    p.add_argument("--calibration", default="sharegpt", choices=("sharegpt",), help="GPTQ calibration data")
    p.add_argument("--num-calibration", type=int, default=32, help="GPTQ: calibration conversations")
    p.add_argument("--calibration-tokens", type=int, default=512, help="GPTQ: tokens per conversation at most")
    p.add_argument("--format", default=None, choices=("gptq", "awq", "compressed-tensors"),
                   help="checkpoint layout (default: gptq for int4, compressed-tensors otherwise)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                   help="the dense tensors (embeddings, norms, lm_head)")
    p.add_argument("--out", required=True, help="output folder")
    show_defaults(p)
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from tokenmill.protocol.logs import configure_from_env
    from tokenmill.worker.loader import ModelLoadError

    configure_from_env("warning")
    try:
        out = quantize(args)
    except (ModelLoadError, ValueError, FileNotFoundError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def quantize(args: argparse.Namespace) -> Path:
    """Build the dense model, quantize it and write the folder; returns the folder."""
    import torch
    from tqdm import tqdm

    from tokenmill.worker.attention.torch_ref import TorchRefBackend
    from tokenmill.worker.engine import load_tokenizer
    from tokenmill.worker.loader import build_model, resolve_model
    from tokenmill.worker.quant.config import QuantConfig
    from tokenmill.worker.quant.export import check_format, default_format, write_folder
    from tokenmill.worker.quant.gptq import GptqOptions
    from tokenmill.worker.quant.quantizer import gptq_quantize_model, rtn_quantize_model
    from tokenmill.worker.quant.rtn import MseClip

    if args.method != "int4" and (args.asymmetric or args.act_order or args.clip is not None):
        raise ValueError("--asymmetric, --act-order and --clip are INT4 options")
    if args.method == "int8" and args.gptq:
        raise ValueError("--gptq quantizes to int4 or fp8, not int8")
    if args.act_order and not args.gptq:
        raise ValueError("--act-order needs --gptq (round to nearest has no column order)")
    if (args.true_sequential or args.damp != DAMP) and not args.gptq:
        raise ValueError("--true-sequential and --damp need --gptq (round to nearest has no calibration)")
    clip = None if args.clip is None else MseClip(args.clip)
    options = GptqOptions(args.damp, clip, args.true_sequential)
    config = QuantConfig(args.method, args.group_size, not args.asymmetric, args.act_order)
    fmt = args.format or default_format(config)
    check_format(config, fmt)
    source = resolve_model(args.model, args.load_format)
    if source.quant is not None:
        raise ValueError(f"{args.model} is already a {source.quant.format} checkpoint")
    model = build_model(source, TorchRefBackend(), torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(source)
    bar = tqdm(total=source.arch.num_layers, desc=f"quantize {config.describe()}", unit="layer", file=sys.stderr)
    step = lambda _msg: bar.update(1)
    if args.gptq:
        canonical = gptq_quantize_model(model, config, calibration_ids(tokenizer, args), step, options=options)
    else:
        canonical = rtn_quantize_model(model, config, step, clip=clip)
    bar.close()
    base = json.loads((source.path / "config.json").read_text()) if source.kind == "hf" and source.path else None
    out = Path(args.out)
    write_folder(out, model, canonical, config, fmt, getattr(torch, args.dtype), base,
                 source.path if source.kind == "hf" else None, tokenizer if source.kind == "gguf" else None)
    return out


def calibration_ids(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    """The first --num-calibration ShareGPT exchanges (chat-formatted prompt + reply), cut to --calibration-tokens."""
    from tokenmill.benchmarks.datasets import chat_exchanges

    half = max(1, args.calibration_tokens // 2)
    exchanges = chat_exchanges(tokenizer, range(args.num_calibration), half, args.calibration_tokens - half)
    return [list(e.prompt_ids + e.reply_ids) for e in exchanges]
