"""Training an EAGLE head (worker/spec/eagle.py) on a target model, its hidden states computed online.

Each step runs the target over a batch of token sequences (its paged KV cache as scratch) for its features
f_t (final-normed hidden states), then trains the head on rows t = 0..L-2 of each sequence: input
(embed(x_{t+1}), f_t + uniform noise), output f^_{t+1}. Loss as EAGLE's: smooth-L1 regression of f^_{t+1}
on f_{t+1}, plus `cls_weight` x the cross-entropy of the target's next-token distribution
softmax(lm_head(f_{t+1})) under lm_head(f^_{t+1}). Held-out sequences measure how often the head's token
(argmax of lm_head(f^_{t+1})) is the target's greedy token: the share of first drafts a greedy verifier
would accept, given the target's features.

A head with fusion layers (EAGLE-3) reads the target's residual streams after those layers, s^low, s^mid,
s^high at t (+ the same noise), fused into g_t; its loss is the token cross-entropy alone (as EAGLE-3: no
regression, its feature space is its own), with the target's final features f_{t+1} still giving the target's
next-token distribution.

`unroll` U > 1 also trains the draft steps past the first as the engine runs them ("training-time test", as
EAGLE-3 and HASS do): the row of chain step j (2..U) of row t reads (embed(x_{t+j}), the head's own prediction
f^_{t+j-1} of step j-1) at position t+j-1 and predicts f_{t+j}; it attends to the first step's rows 0..t (real
features) and to its own chain's rows of steps 2..j (`UnrolledDenseBackend`), exactly the rows the engine's
draft step attends to (worker/spec/eagle_proposer.py). Without it the head only ever reads real features and
its drafts past the first, made from its own predictions, are rarely right. The losses of the U steps are
averaged. `loss_starts` (one per sequence, e.g. the reply's first token: `reply_start`) keeps the loss on the
rows whose predicted token is at or past it (a chat's reply rows, the ones the engine drafts on); the held-out
figures are on the same rows, and include the chain acceptance `tau` at `eval_depth` drafts."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenmill.kernels.attention_ref import rotary_embedding_ref
from tokenmill.worker.attention.backend import AttentionLayer, AttentionMetadata, KVCache
from tokenmill.worker.model_runner import ModelRunner, attention_metadata
from tokenmill.worker.spec.eagle import (
    DenseCausalBackend,
    EagleHead,
    FusionLayers,
    check_fusion_layers,
    draft_arch,
    load_eagle_head,
)

log = logging.getLogger("tokenmill.eagle")


@dataclass(frozen=True)
class EagleTrainConfig:
    steps: int = 1000
    batch_sequences: int = 4
    lr: float = 3e-4
    cls_weight: float = 0.1  # weight of the token cross-entropy beside the feature regression
    noise: float = 0.1  # half-width of the uniform noise on the input features
    grad_clip: float = 0.5
    seed: int = 0
    log_every: int = 50
    time_limit_s: float | None = None  # stop early (and keep the head) once the steps have run this long
    cache_features: bool = True  # the target's features computed once before training (else at every step)
    unroll: int = 1  # draft steps trained per row (1: the first draft only; > 1: the training-time test)
    lr_schedule: str = "constant"  # or "cosine": linear warm-up, then cosine decay to 0 over steps or the time limit
    warmup_steps: int = 0
    eval_depth: int = 4  # the held-out chain acceptance is measured with this many drafts

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_sequences < 1:
            raise ValueError("steps and batch_sequences must be >= 1")
        if self.unroll < 1 or self.eval_depth < 1 or self.warmup_steps < 0:
            raise ValueError("unroll and eval_depth must be >= 1, warmup_steps >= 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if not (self.lr > 0 and self.cls_weight >= 0 and self.noise >= 0 and self.grad_clip > 0):
            raise ValueError("lr and grad_clip must be > 0, cls_weight and noise >= 0")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError("time_limit_s must be > 0 (or None: no limit)")


class Rows(NamedTuple):
    """The head's training rows of a batch of sequences, flattened (R = sum(L_i - 1)). Chain step j (1-based) of
    row t reads embed(x_{t+j}) and predicts f_{t+j}; the lists hold steps 1..depth (steps past the sequence's
    end are padding, never in the loss)."""

    token_embeds: Tensor  # [R, H] embed(x_{t+1})
    features: Tensor  # [R, H] f_t; with fusion layers [R, 3H] [s^low_t; s^mid_t; s^high_t] (the head fuses them)
    targets: Tensor  # [R, H] f_{t+1}
    positions: Tensor  # [R] t
    meta: AttentionMetadata  # one request per sequence, dense (each its whole sequence)
    step_embeds: list[Tensor]  # per step j: [R, H] embed(x_{t+j}) (step 1: token_embeds)
    step_targets: list[Tensor]  # per step j: [R, H] f_{t+j} (step 1: targets)
    step_masks: list[Tensor]  # per step j: [R] bool, the row's step j is in the loss (x_{t+j+1} at or past the
    # sequence's loss start, t + j within the sequence)


class Tokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = ...) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def assistant_marker(tokenizer: Tokenizer) -> list[int]:
    """The token ids the chat template puts right before a reply (the generation prompt; SmolLM2's
    "<|im_start|>assistant\\n")."""
    chat = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(chat, add_generation_prompt=False)
    if not (with_prompt.startswith(without) and len(with_prompt) > len(without)):
        raise ValueError("the chat template's generation prompt is not a suffix of the prompt: no reply marker")
    return tokenizer.encode(with_prompt[len(without) :], add_special_tokens=False)


def reply_start(seq: Sequence[int], marker: Sequence[int]) -> int | None:
    """Index of the first reply token of `seq`: just after the first `marker`, else None."""
    n, want = len(marker), list(marker)
    for i in range(len(seq) - n + 1):
        if list(seq[i : i + n]) == want:
            return i + n
    return None


class UnrolledDenseBackend(DenseCausalBackend):
    """Cache-free attention for the training-time test. Dense causal per request (DenseCausalBackend), except
    between `begin()` and `end()`: there the first forward (the first draft step: rows from real features) keeps
    its rotated keys and values, and each later forward is chain step j of every row t (the same [T] row
    layout), attending to the first step's rows 0..t of its request and to row t's own keys of steps 2..j
    (itself included). Differentiable."""

    name = "dense-unrolled"

    def __init__(self) -> None:
        self.end()

    def begin(self) -> None:
        self.unrolling = True

    def end(self) -> None:
        self.unrolling = False
        self.first: tuple[Tensor, Tensor] | None = None  # [T, Hkv, D] rotated keys, values of step 1
        self.chain: list[tuple[Tensor, Tensor]] = []  # per step 2..j: [T, Hkv, D] rotated keys, values

    def forward(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> Tensor:
        if not self.unrolling or self.first is None:
            out = super().forward(layer, q, k, v, positions, kv_cache, meta)
            if self.unrolling:
                self.first = (rotary_embedding_ref(k, k, layer.cos_sin_cache, positions)[1], v)
            return out
        q, k = rotary_embedding_ref(q, k, layer.cos_sin_cache, positions)
        self.chain.append((k, v))
        group = q.shape[1] // k.shape[1]
        ck = torch.stack([c[0] for c in self.chain], 1).repeat_interleave(group, 2)  # [T, j-1, H, D]
        cv = torch.stack([c[1] for c in self.chain], 1).repeat_interleave(group, 2)
        own = torch.einsum("thd,tjhd->thj", q, ck) * layer.scale  # [T, H, j-1]
        outs, start = [], 0
        for n in meta.query_lens_cpu:  # per request: [n, H, D] queries over its n first-step keys
            qs = q[start : start + n]
            fk, fv = (t[start : start + n].repeat_interleave(group, 1) for t in self.first)
            scores = torch.einsum("thd,shd->hts", qs, fk) * layer.scale  # [H, n, n]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            p = torch.cat([scores, own[start : start + n].transpose(0, 1)], -1).softmax(-1)  # [H, n, n + j - 1]
            out = torch.einsum("hts,shd->thd", p[..., :n], fv)
            outs.append(out + torch.einsum("htj,tjhd->thd", p[..., n:], cv[start : start + n]))
            start += n
        return torch.cat(outs)


@torch.no_grad()
def target_features_batch(runner: ModelRunner, seqs: Sequence[Sequence[int]],
                          layers: Sequence[int] = ()) -> list[Tensor]:
    """The target's final-normed hidden states [L_i, H] (its dtype) of each sequence, all in one forward: each
    sequence in blocks of its own of the runner's KV cache, which is overwritten. With `layers`: [L_i, H + n H],
    the final features followed by the residual streams after those n layers (forward_recording)."""
    lens = [len(s) for s in seqs]
    blocks = [-(-n // runner.block_size) for n in lens]
    if max(lens) > runner.max_model_len or sum(blocks) > runner.num_blocks:
        raise ValueError(f"{len(seqs)} sequences of up to {max(lens)} tokens do not fit the target's context "
                         "or KV cache")
    first = [sum(blocks[:i]) for i in range(len(seqs))]
    tables = [list(range(b, b + nb)) for b, nb in zip(first, blocks)]
    slots = [b * runner.block_size + t for b, n in zip(first, lens) for t in range(n)]
    meta = attention_metadata(lens, lens, tables, slots, runner.device)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=runner.device)
    positions = torch.tensor([t for n in lens for t in range(n)], dtype=torch.int64, device=runner.device)
    hidden, states = runner.model.forward_recording(ids, positions, runner.kv_caches, meta, layers)
    return list((torch.cat([hidden, *states], dim=-1) if states else hidden).split(lens))


def target_features(runner: ModelRunner, seq: Sequence[int], layers: Sequence[int] = ()) -> Tensor:
    """target_features_batch of one sequence, float32 (its KV cache is overwritten)."""
    return target_features_batch(runner, [seq], layers)[0].float()


def all_features(runner: ModelRunner, seqs: Sequence[Sequence[int]], layers: Sequence[int] = ()) -> list[Tensor]:
    """target_features_batch over every sequence, as many per forward as the KV cache holds; kept on the
    runner's device in its dtype (EAGLE trains on fixed target features: computed once, not every step)."""
    need = sum(map(len, seqs)) * (1 + len(layers)) * runner.arch.hidden_size * runner.dtype.itemsize
    if runner.device.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(runner.device)[0]:
        raise ValueError(f"the target features of {len(seqs)} sequences take {need / 2**30:.1f} GiB, more than "
                         "the device has free: train on fewer or shorter sequences, or with online features")
    out: list[Tensor] = []
    group: list[Sequence[int]] = []
    blocks = 0  # of the sequences in `group`
    for seq in seqs:
        need_blocks = -(-len(seq) // runner.block_size)
        if group and blocks + need_blocks > runner.num_blocks:
            out += target_features_batch(runner, group, layers)
            group, blocks = [], 0
        group.append(seq)
        blocks += need_blocks
    if group:
        out += target_features_batch(runner, group, layers)
    return out


def head_rows(runner: ModelRunner, seqs: Sequence[Sequence[int]], noise: float, gen: torch.Generator | None,
              features: Sequence[Tensor] | None = None, layers: Sequence[int] = (), *,
              loss_starts: Sequence[int] | None = None, depth: int = 1) -> Rows:
    """The head's rows of `seqs` (a head with fusion `layers`: their states as its input) for chains of `depth`
    steps, the loss on rows predicting tokens at or past `loss_starts` (default: every row); `features` (one
    target_features_batch row block [L_i, H (+ 3H)] per sequence, of the same layers) saves the target's forward."""
    embeds, feats, positions, lens = [], [], [], []
    step_embeds: list[list[Tensor]] = [[] for _ in range(depth)]
    step_targets: list[list[Tensor]] = [[] for _ in range(depth)]
    step_masks: list[list[Tensor]] = [[] for _ in range(depth)]
    h = runner.arch.hidden_size
    for i, seq in enumerate(seqs):
        whole = target_features(runner, seq, layers) if features is None else features[i].float()  # [L, H (+ 3H)]
        f = whole[:, :h]  # [L, H] final-normed
        n = len(seq) - 1
        with torch.no_grad():
            e = runner.model.model.embed_tokens(torch.tensor(list(seq[1:]), device=runner.device)).float()  # [n, H]
        x = whole[:-1, h:] if layers else f[:-1]
        if noise:
            x = x + (torch.rand(x.shape, generator=gen, device=x.device) * 2 - 1) * noise
        feats.append(x)
        rows = torch.arange(n, device=runner.device)
        start = 0 if loss_starts is None else loss_starts[i]
        for j in range(depth):  # step j + 1 of row t: embed(x_{t+j+1}), target f_{t+j+1}, token x_{t+j+2}
            step_embeds[j].append(_shifted(e, j))
            step_targets[j].append(_shifted(f[1:], j))
            step_masks[j].append((rows + j < n) & (rows + j + 2 >= start))
        embeds.append(e)
        positions.append(rows)
        lens.append(n)
    meta = attention_metadata(lens, lens, [[0]] * len(lens), [-1] * sum(lens), runner.device)
    cat = [torch.cat(t) for t in step_embeds], [torch.cat(t) for t in step_targets], [torch.cat(t) for t in step_masks]
    return Rows(cat[0][0], torch.cat(feats), cat[1][0], torch.cat(positions), meta, *cat)


def _shifted(x: Tensor, j: int) -> Tensor:
    """x [n, ...] moved j rows up (row t holds x[t + j]), zero past the end."""
    return x if j == 0 else torch.cat([x[j:], x.new_zeros((min(j, x.shape[0]), *x.shape[1:]))])


def _logits(runner: ModelRunner, hidden: Tensor) -> Tensor:
    """float32 logits [R, V] of float32 hidden states through the target's LM head (in the target's dtype;
    the cast is differentiable, so the head's gradient flows through it)."""
    return runner.model.compute_logits(hidden.to(runner.dtype)).float()


def head_loss(runner: ModelRunner, head: EagleHead, rows: Rows, cls_weight: float) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, regression loss, token cross-entropy) of the head on `rows`, each the mean over the chain steps of
    `rows` (its depth) of that step's mean over its loss rows. A fusion head: the cross-entropy alone (its
    regression loss reported as 0)."""
    return _loss(runner, head, predict_steps(head, rows), rows, cls_weight)


def _loss(runner: ModelRunner, head: EagleHead, preds: Sequence[Tensor], rows: Rows, cls_weight: float,
          ) -> tuple[Tensor, Tensor, Tensor]:
    """head_loss of the head's predictions `preds` (one [R, H] per chain step) of `rows`."""
    regs, clss = [], []
    first = rows.step_masks[0]
    with torch.no_grad():  # [R1, V] the target's next-token distribution at step 1's loss rows, computed once:
        # step j's target of row t is step 1's of row t + j (same sequence, in the loss where step j's row is)
        p_first = _logits(runner, rows.step_targets[0][first]).softmax(-1)
    where = torch.full_like(first, -1, dtype=torch.int64)  # [R] row -> its row of p_first, -1 if none
    where[first] = torch.arange(int(first.sum()), device=first.device)
    for j, (pred, target, mask) in enumerate(zip(preds, rows.step_targets, rows.step_masks)):
        picked = mask.nonzero().squeeze(1)  # [R'] this step's loss rows
        if not len(picked):
            continue
        at = where[picked + j]
        assert bool((at >= 0).all()), "a loss row of a later step whose target is outside step 1's loss rows"
        p = p_first if j == 0 else p_first[at]  # [R', V]
        pred, target = pred[picked], target[picked]
        clss.append(-(p * _logits(runner, pred).log_softmax(-1)).sum(-1).mean())
        regs.append(F.smooth_l1_loss(pred, target))
    if not clss:  # no row of the batch is in the loss
        zero = preds[0].sum() * 0
        return zero, zero, zero
    cls = torch.stack(clss).mean()
    if head.fusion_layers is not None:
        return cls, torch.zeros_like(cls), cls
    reg = torch.stack(regs).mean()
    return reg + cls_weight * cls, reg, cls


def predict(head: EagleHead, rows: Rows) -> Tensor:
    """The head's predicted features [R, H] of `rows` (the first draft step), cache-free."""
    empty = torch.empty(0, device=rows.features.device)
    return head(rows.token_embeds, head.fuse(rows.features), rows.positions, (empty, empty), rows.meta)


def predict_steps(head: EagleHead, rows: Rows) -> list[Tensor]:
    """The head's predictions [R, H] of each chain step of `rows` (step j of row t: f^_{t+j}), cache-free; more
    than one step needs the head's layer on an UnrolledDenseBackend."""
    if len(rows.step_embeds) == 1:
        return [predict(head, rows)]
    backend = head.layer.self_attn.backend
    assert isinstance(backend, UnrolledDenseBackend), "chain steps need the unrolled attention"
    empty = torch.empty(0, device=rows.features.device)
    backend.begin()
    try:
        preds = [predict(head, rows)]
        for j, embeds in enumerate(rows.step_embeds[1:], 1):
            preds.append(head(embeds, preds[-1], rows.positions + j, (empty, empty), rows.meta))
    finally:
        backend.end()
    return preds


@torch.no_grad()
def evaluate(runner: ModelRunner, head: EagleHead, seqs: Sequence[Sequence[int]], cls_weight: float,
             loss_starts: Sequence[int] | None = None, depth: int = 1) -> dict[str, float]:
    """On held-out sequences (no noise), over their loss rows (`loss_starts`; default all): the loss of the
    first draft step, the share of rows whose first-draft token equals the target's greedy token (`agreement`),
    and with `depth` > 1 (the head on an UnrolledDenseBackend) the chain acceptance: tau = 1 + the mean number
    of leading drafts of a `depth`-draft chain, drafted as the engine does, that the target's greedy tokens
    accept, over the rows whose whole chain is in the loss rows."""
    hits = total = chains = accepted = 0
    loss = 0.0
    for i, seq in enumerate(seqs):
        starts = None if loss_starts is None else [loss_starts[i]]
        rows = head_rows(runner, [seq], 0.0, None, layers=head.fusion_layers or (), loss_starts=starts,
                         depth=depth)
        preds = predict_steps(head, rows)
        right = torch.stack([_logits(runner, pred).argmax(-1) == _logits(runner, target).argmax(-1)
                             for pred, target in zip(preds, rows.step_targets)])  # [depth, R]
        mask = rows.step_masks[0]
        hits += int((right[0] & mask).sum())
        total += int(mask.sum())
        first = rows._replace(step_targets=rows.step_targets[:1], step_masks=[mask])
        loss += _loss(runner, head, preds[:1], first, cls_weight)[0].item() * int(mask.sum())
        whole = rows.step_masks[0] & rows.step_masks[-1]  # chains inside the sequence and the loss rows
        chains += int(whole.sum())
        accepted += int(right.int().cumprod(0).sum(0)[whole].sum())  # leading drafts right, per chain
    return {"loss": loss / max(total, 1), "agreement": hits / max(total, 1), "rows": total,
            "tau": 1 + accepted / max(chains, 1), "tau_depth": depth}


def new_head(runner: ModelRunner, seed: int, fusion_layers: FusionLayers | None = None,
             init_from: Path | None = None) -> EagleHead:
    """A float32 head for the runner's target (its attention an UnrolledDenseBackend, which is dense causal for
    a single step): the one saved in `init_from` if given (its fusion layers, not `fusion_layers`), else new:
    layer weights N(0, 0.02) and norms 1 (as HF initialises Llama), fc the identity on the feature half and
    small on the embedding half, so that the untrained head starts from "the next feature is this one"; with
    fusion layers (checked against the target's), the fusion fc the identity on the high layer's normed state and
    small on the others, the output norm the target's final one (the untrained head reads the high layer's state
    through the target's LM head)."""
    torch.manual_seed(seed)
    if init_from is not None:
        loaded = load_eagle_head(init_from, runner.arch, UnrolledDenseBackend(), dtype=torch.float32,
                                 device=runner.device)
        for p in loaded.parameters():
            p.requires_grad_(True)
        return loaded
    if fusion_layers is not None:
        fusion_layers = check_fusion_layers(fusion_layers, runner.arch.num_layers)
    head = EagleHead(draft_arch(runner.arch), UnrolledDenseBackend(), dtype=torch.float32, device=runner.device,
                     fusion_layers=fusion_layers)
    h = runner.arch.hidden_size
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
        w = torch.cat([torch.randn(h, h) * 0.02, torch.eye(h)], dim=1)  # [H, 2H]: [embedding | feature]
        head.fc.weight.copy_(w)
        head.fc.bias.zero_()
        if head.fuse_fc is not None and head.out_norm is not None:  # [H, 3H]: [low | mid | high]
            head.fuse_fc.weight.copy_(torch.cat([torch.randn(h, 2 * h) * 0.02, torch.eye(h)], dim=1))
            head.out_norm.weight.copy_(runner.model.model.norm.weight)  # starts as the target's own final norm
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def learning_rate(config: EagleTrainConfig, step: int, elapsed_s: float) -> float:
    """The learning rate of `step` (1-based): constant, or a linear warm-up over warmup_steps and then a cosine
    decay to 0 at the end of training (steps, or the time limit when it comes first)."""
    if config.lr_schedule == "constant":
        return config.lr
    warm = min(1.0, step / config.warmup_steps) if config.warmup_steps else 1.0
    done = step / config.steps
    if config.time_limit_s is not None:
        done = max(done, elapsed_s / config.time_limit_s)
    return config.lr * warm * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def train(runner: ModelRunner, train_seqs: Sequence[Sequence[int]], heldout: Sequence[Sequence[int]],
          config: EagleTrainConfig, progress: Callable[[dict[str, Any]], None] | None = None,
          fusion_layers: FusionLayers | None = None, loss_starts: Sequence[int] | None = None,
          heldout_loss_starts: Sequence[int] | None = None, init_from: Path | None = None,
          ) -> tuple[EagleHead, dict[str, Any]]:
    """Train a new head (EAGLE-3's fusion of `fusion_layers` if given; or go on training the one saved in
    `init_from`), the loss on the rows from `loss_starts` (one per training sequence; default all rows);
    returns it and a summary (losses; held-out loss, agreement and chain tau before and after, on the held-out
    rows from `heldout_loss_starts`)."""
    if not train_seqs or not heldout:
        raise ValueError("training needs sequences to train on and held-out ones")
    if min(map(len, [*train_seqs, *heldout])) < 2:
        raise ValueError("every sequence needs at least two tokens")
    for starts, seqs in ((loss_starts, train_seqs), (heldout_loss_starts, heldout)):
        if starts is not None and len(starts) != len(seqs):
            raise ValueError(f"{len(starts)} loss starts for {len(seqs)} sequences")
    head = new_head(runner, config.seed, fusion_layers, init_from)
    layers = head.fusion_layers or ()
    before = evaluate(runner, head, heldout, config.cls_weight, heldout_loss_starts, config.eval_depth)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr)
    rng, gen = random.Random(config.seed), torch.Generator(runner.device).manual_seed(config.seed)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    cached = all_features(runner, train_seqs, layers) if config.cache_features else None
    if cached is not None:
        log.info("target features of %d sequences cached in %.1f s", len(cached), time.perf_counter() - start)
    steps_start = time.perf_counter()  # the time limit and the schedule count from here
    for step in range(1, config.steps + 1):
        picks = rng.sample(range(len(train_seqs)), min(config.batch_sequences, len(train_seqs)))
        rows = head_rows(runner, [train_seqs[i] for i in picks], config.noise, gen,
                         None if cached is None else [cached[i] for i in picks], layers,
                         loss_starts=None if loss_starts is None else [loss_starts[i] for i in picks],
                         depth=config.unroll)
        loss, reg, cls = head_loss(runner, head, rows, config.cls_weight)
        lr = learning_rate(config, step, time.perf_counter() - steps_start)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
        opt.step()
        history.append({"step": step, "loss": loss.item(), "regression": reg.item(), "token_ce": cls.item(), "lr": lr})
        if progress is not None and (step % config.log_every == 0 or step == config.steps):
            progress(history[-1])
        if config.time_limit_s is not None and time.perf_counter() - steps_start > config.time_limit_s:
            log.info("time limit reached after %d of %d steps", step, config.steps)
            break
    after = evaluate(runner, head, heldout, config.cls_weight, heldout_loss_starts, config.eval_depth)
    window = max(1, min(50, len(history) // 4))
    summary = {"steps": len(history), "train_sequences": len(train_seqs), "heldout_sequences": len(heldout),
               "loss_first": sum(h["loss"] for h in history[:window]) / window,
               "loss_last": sum(h["loss"] for h in history[-window:]) / window,
               "heldout_loss_before": before["loss"], "heldout_loss_after": after["loss"],
               "heldout_agreement_before": before["agreement"], "heldout_agreement_after": after["agreement"],
               "heldout_rows": after["rows"], "heldout_tau_depth": after["tau_depth"],
               "heldout_tau_before": before["tau"], "heldout_tau_after": after["tau"],
               "seconds": time.perf_counter() - start}
    log.info("eagle head trained: %s", summary)
    return head, summary
