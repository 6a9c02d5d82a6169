"""`tokenmill train-eagle`: train an EAGLE draft head for a model (worker/spec/eagle_train.py).

    tokenmill train-eagle --model embedded --data sharegpt --out heads/smollm2 --steps 2000
    tokenmill train-eagle --model /models/llama --data chats.jsonl --out heads/llama --device cuda

--data is `sharegpt` (the ShareGPT wheel of the package registry: each first human turn and its reply through
the model's chat template), a ShareGPT-format .json file (read the same way) or a JSON-lines file, one object
per line with "token_ids" (a list of ints) or "text". With --replies self, each ShareGPT reply is replaced by
the target's own greedy reply to the same prompt (up to --max-len tokens in all), so the head learns the
distribution it will draft for. The last --heldout sequences are held out (none of them is trained on). The
head, its config and the training summary go to --out (model.safetensors, eagle_config.json).

--unroll U trains the draft steps past the first as the engine runs them (the training-time test: step j reads the
head's own prediction of step j-1; without it the head only ever sees the target's real features, and its second
and later drafts are rarely right). --loss-rows reply keeps the loss on the rows after the chat template's
reply marker (the rows the engine drafts on); the held-out figures are then on reply rows too, and include the
chain acceptance tau at --eval-depth drafts. --init-head DIR goes on training a saved head.

--fusion-layers auto|L,M,H trains an EAGLE-3-style head instead: its input fuses the target's residual streams
after decoder layers L, M and H (0-based; auto: 2, n // 2, n - 3 of an n-layer target), trained on token
cross-entropy alone. Serve it with --no-cuda-graphs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenmill.cli.helptext import show_defaults

FEATURE_BATCH = 32  # sequences per target forward while caching features (the KV cache holds that many)


def register(sub: Any) -> None:
    p = sub.add_parser("train-eagle", help="train an EAGLE draft head for a model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded", help="HF folder, .gguf file, or 'embedded'")
    p.add_argument("--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    p.add_argument("--data", default="sharegpt",
                   help="'sharegpt', a ShareGPT .json file, or a JSON-lines file (token_ids or text)")
    p.add_argument("--out", required=True, type=Path, help="folder for the head")
    p.add_argument("--num-sequences", type=int, default=2000, help="sequences to read (held-out ones included)")
    p.add_argument("--heldout", type=int, default=64, help="sequences held out for the agreement measure")
    p.add_argument("--max-len", type=int, default=512, help="tokens per sequence at most (longer ones are cut)")
    p.add_argument("--replies", default="data", choices=["data", "self"],
                   help="sharegpt: the dataset's replies, or the target's own greedy ones")
    p.add_argument("--save-sequences", type=Path, default=None,
                   help="write the token sequences read or generated (JSON lines, token_ids) here, to reuse")
    p.add_argument("--online-features", action="store_true",
                   help="run the target at every step instead of caching its features once (less memory)")
    p.add_argument("--fusion-layers", default=None,
                   help="EAGLE-3 fusion of three target layers: 'auto' (2, n // 2, n - 3) or L,M,H (0-based); "
                        "default: none (EAGLE-1)")
    p.add_argument("--unroll", type=int, default=1, help="draft steps trained per row (the training-time test)")
    p.add_argument("--loss-rows", default="all", choices=["all", "reply"],
                   help="the rows in the loss: all, or those after the chat template's reply marker")
    p.add_argument("--eval-depth", type=int, default=4, help="drafts per chain of the held-out tau")
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
                   help="cosine: linear warm-up, then a cosine decay to 0 over --steps or --time-limit-s")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--init-head", type=Path, default=None, help="go on training this saved head (its folder)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the saved head")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="stop training once its steps have run this long (the head is kept; the feature caching "
                        "before them not counted)")
    p.add_argument("--batch-sequences", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--cls-weight", type=float, default=0.1, help="weight of the token cross-entropy")
    p.add_argument("--noise", type=float, default=0.1, help="half-width of the uniform noise on input features")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="torch device (auto: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="the target's dtype (the head trains in float32)")
    show_defaults(p)
    p.set_defaults(func=cmd_train_eagle)


def cmd_train_eagle(args: argparse.Namespace) -> int:
    from tokenmill.protocol.logs import configure_from_env

    configure_from_env("info")
    import torch

    from tokenmill.worker.spec.eagle_train import EagleTrainConfig, train

    try:
        config = EagleTrainConfig(steps=args.steps, batch_sequences=args.batch_sequences, lr=args.lr,
                                  cls_weight=args.cls_weight, noise=args.noise, seed=args.seed,
                                  time_limit_s=args.time_limit_s, cache_features=not args.online_features,
                                  unroll=args.unroll, lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                                  eval_depth=args.eval_depth)
        if args.max_len < 2 or args.heldout < 1 or args.num_sequences <= args.heldout:
            raise ValueError("need --max-len >= 2, --heldout >= 1 and --num-sequences > --heldout")
        if args.replies == "self" and not _is_sharegpt(args.data):
            raise ValueError("--replies self needs ShareGPT data (--data sharegpt or a .json file): the prompts")
    except ValueError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    try:
        # --replies self: the replies first, from a batch engine of their own that is gone before the training
        # engine loads the model again (one copy of it in memory at a time)
        if args.replies == "self":
            seqs = _self_replies(args, args.num_sequences, args.max_len)
            engine = _training_engine(args)
        else:
            engine = _training_engine(args)
            seqs = _sequences(engine, args.data, args.num_sequences, args.max_len)
    except (OSError, ValueError) as e:
        print(f"tokenmill: error: --data {args.data}: {e}", file=sys.stderr)
        return 2
    if len(seqs) <= args.heldout:
        print(f"tokenmill: error: --data {args.data}: {len(seqs)} sequences, not more than --heldout", file=sys.stderr)
        return 2
    if args.save_sequences is not None:  # written whole, then renamed: a reader never sees part of the file
        partial = args.save_sequences.with_name(args.save_sequences.name + ".partial")
        with open(partial, "w") as f:
            f.writelines(json.dumps({"token_ids": s}) + "\n" for s in seqs)
        partial.replace(args.save_sequences)
    train_seqs, heldout = seqs[: -args.heldout], seqs[-args.heldout :]
    try:
        fusion = _fusion_layers(args.fusion_layers, engine.runner.arch.num_layers)
    except ValueError as e:
        print(f"tokenmill: error: --fusion-layers: {e}", file=sys.stderr)
        return 2
    starts: tuple[list[int] | None, list[int] | None] = (None, None)
    if args.loss_rows == "reply":
        try:
            train_seqs, train_starts = _with_replies(engine.tokenizer, train_seqs)
            heldout, heldout_starts = _with_replies(engine.tokenizer, heldout)
        except ValueError as e:
            print(f"tokenmill: error: --loss-rows reply: {e}", file=sys.stderr)
            return 2
        starts = train_starts, heldout_starts
    head, summary = train(engine.runner, train_seqs, heldout, config,
                          progress=lambda h: print(json.dumps(h), file=sys.stderr, flush=True), fusion_layers=fusion,
                          loss_starts=starts[0], heldout_loss_starts=starts[1], init_from=args.init_head)
    arch = engine.runner.arch
    target = {"model": engine.model_name, "arch": arch.arch, "vocab_size": arch.vocab_size,
              "hidden_size": arch.hidden_size, "num_layers": arch.num_layers}
    training = {"command": " ".join(["tokenmill", *sys.argv[1:]]), "data": args.data, "replies": args.replies,
                "max_len": args.max_len, "fusion_layers": None if fusion is None else list(fusion),
                "loss_rows": args.loss_rows, "init_head": None if args.init_head is None else str(args.init_head),
                **{k: getattr(config, k) for k in ("steps", "batch_sequences", "lr", "cls_weight", "noise", "seed",
                                                   "unroll", "lr_schedule", "warmup_steps", "eval_depth")},
                "summary": summary}
    if args.init_head is not None:  # the training the head started from (spec_gpu.heldout_offset reads it)
        training["init_head_training"] = _head_training(args.init_head)
    head.to(getattr(torch, args.save_dtype)).save(args.out, target, training)
    print(json.dumps(summary))
    return 0


def _head_training(folder: Path) -> Any:
    """The "training" section of a saved head's config (None if it has none)."""
    from tokenmill.worker.spec.eagle import CONFIG_FILE

    return json.loads((folder / CONFIG_FILE).read_text()).get("training")


def _fusion_layers(value: str | None, num_layers: int) -> tuple[int, int, int] | None:
    """--fusion-layers: None (EAGLE-1), 'auto' or 'L,M,H', checked against the target's layers (ValueError)."""
    from tokenmill.worker.spec.eagle import auto_fusion_layers, check_fusion_layers

    if value is None:
        return None
    if value == "auto":
        return auto_fusion_layers(num_layers)
    try:
        layers = [int(v) for v in value.split(",")]
    except ValueError:
        raise ValueError(f"want 'auto' or three comma-separated layer indices, got {value!r}") from None
    return check_fusion_layers(layers, num_layers)


def _with_replies(tokenizer: Any, seqs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The sequences holding the chat template's reply marker and their replies' first indices (ValueError if
    none does)."""
    from tokenmill.worker.spec.eagle_train import assistant_marker, reply_start

    marker = assistant_marker(tokenizer)
    kept = [(s, i) for s in seqs if (i := reply_start(s, marker)) is not None and i < len(s)]
    if not kept:
        raise ValueError(f"none of {len(seqs)} sequences holds the chat template's reply marker {marker}")
    return [s for s, _ in kept], [i for _, i in kept]


def _training_engine(args: argparse.Namespace) -> Any:
    """The target whose features the head trains on: eager, its KV cache scratch for FEATURE_BATCH sequences."""
    from tokenmill.worker.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
        max_model_len=args.max_len, cuda_graphs=False, async_scheduling=False,
        cache=CacheConfig(num_blocks=FEATURE_BATCH * -(-args.max_len // 16) + 1),
        scheduler=SchedulerConfig(max_num_seqs=FEATURE_BATCH, max_num_batched_tokens=FEATURE_BATCH * args.max_len)))


def _is_sharegpt(data: str) -> bool:
    """--data names ShareGPT records: the packaged file ("sharegpt") or a ShareGPT-format .json file."""
    return data == "sharegpt" or data.endswith(".json")


def _sharegpt_path(data: str) -> str | None:
    """The ShareGPT file of --data for sharegpt_pairs (None: the packaged one)."""
    return None if data == "sharegpt" else data


def _self_replies(args: argparse.Namespace, n: int, max_len: int) -> list[list[int]]:
    """ShareGPT's first human turns through the chat template, each followed by the target's own greedy reply
    (prompt + reply <= max_len tokens; prompts longer than max_len / 2 are skipped), at most n, in dataset order.
    A batch engine of its own generates them; its memory is freed before training."""
    import gc

    import torch

    from tokenmill.benchmarks.datasets import sharegpt_pairs
    from tokenmill.protocol import SamplingParams
    from tokenmill.worker.config import EngineConfig, SchedulerConfig
    from tokenmill.worker.engine import LLMEngine

    gen = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                                 max_model_len=max_len, scheduler=SchedulerConfig(max_num_seqs=256)))
    tok = gen.tokenizer
    prompts: list[list[int]] = []
    for human, _ in sharegpt_pairs(_sharegpt_path(args.data)):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": human}], add_generation_prompt=True),
                         add_special_tokens=False)
        if 2 <= len(ids) <= max_len // 2:
            prompts.append(ids)
        if len(prompts) == n:
            break
    params = [SamplingParams(max_tokens=max_len - len(p), temperature=0.0) for p in prompts]
    outs = gen.generate(prompts, params)
    del gen
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [o.prompt_token_ids + o.token_ids for o in outs]


def _sequences(engine: Any, data: str, n: int, max_len: int) -> list[list[int]]:
    """Token sequences of at least 2 tokens, cut to max_len, at most n."""
    tok = engine.tokenizer
    out: list[list[int]] = []
    if _is_sharegpt(data):
        from tokenmill.benchmarks.datasets import sharegpt_pairs

        for human, reply in sharegpt_pairs(_sharegpt_path(data)):
            chat = [{"role": "user", "content": human}, {"role": "assistant", "content": reply}]
            text = tok.apply_chat_template(chat, add_generation_prompt=False)
            out.append(tok.encode(text, add_special_tokens=False)[:max_len])
            if len(out) == n:
                break
    else:
        vocab = engine.runner.arch.vocab_size
        with open(data) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                ids = rec.get("token_ids") if isinstance(rec, dict) else None
                if ids is None and isinstance(rec, dict) and isinstance(rec.get("text"), str):
                    ids = tok.encode(rec["text"])
                if not (isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < vocab for t in ids)):
                    raise ValueError(f"line {i}: want {{\"token_ids\": [ids < {vocab}]}} or {{\"text\": str}}")
                out.append(ids[:max_len])
                if len(out) == n:
                    break
    return [s for s in out if len(s) >= 2]
