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
next-token distribution. Only the first draft is trained (no unrolled "training-time test" over draft steps)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenmill.worker.attention.backend import AttentionMetadata
from tokenmill.worker.model_runner import ModelRunner, attention_metadata
from tokenmill.worker.spec.eagle import DenseCausalBackend, EagleHead, FusionLayers, check_fusion_layers, draft_arch

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
    time_limit_s: float | None = None  # stop early (and keep the head) once training has run this long
    cache_features: bool = True  # the target's features computed once before training (else at every step)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_sequences < 1:
            raise ValueError("steps and batch_sequences must be >= 1")
        if not (self.lr > 0 and self.cls_weight >= 0 and self.noise >= 0 and self.grad_clip > 0):
            raise ValueError("lr and grad_clip must be > 0, cls_weight and noise >= 0")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError("time_limit_s must be > 0 (or None: no limit)")


class Rows(NamedTuple):
    """The head's training rows of a batch of sequences, flattened (R = sum(L_i - 1))."""

    token_embeds: Tensor  # [R, H] embed(x_{t+1})
    features: Tensor  # [R, H] f_t; with fusion layers [R, 3H] [s^low_t; s^mid_t; s^high_t] (the head fuses them)
    targets: Tensor  # [R, H] f_{t+1}
    positions: Tensor  # [R] t
    meta: AttentionMetadata  # one request per sequence, dense (each its whole sequence)


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
              features: Sequence[Tensor] | None = None, layers: Sequence[int] = ()) -> Rows:
    """The head's rows of `seqs` (a head with fusion `layers`: their states as its input); `features` (one
    target_features_batch row block [L_i, H (+ 3H)] per sequence, of the same layers) saves the target's forward."""
    embeds, feats, targets, positions, lens = [], [], [], [], []
    h = runner.arch.hidden_size
    for i, seq in enumerate(seqs):
        whole = target_features(runner, seq, layers) if features is None else features[i].float()  # [L, H (+ 3H)]
        f = whole[:, :h]  # [L, H] final-normed
        with torch.no_grad():
            embeds.append(runner.model.model.embed_tokens(torch.tensor(list(seq[1:]), device=runner.device)).float())
        x = whole[:-1, h:] if layers else f[:-1]
        if noise:
            x = x + (torch.rand(x.shape, generator=gen, device=x.device) * 2 - 1) * noise
        feats.append(x)
        targets.append(f[1:])
        positions.append(torch.arange(len(seq) - 1, device=runner.device))
        lens.append(len(seq) - 1)
    meta = attention_metadata(lens, lens, [[0]] * len(lens), [-1] * sum(lens), runner.device)
    return Rows(torch.cat(embeds), torch.cat(feats), torch.cat(targets), torch.cat(positions), meta)


def _logits(runner: ModelRunner, hidden: Tensor) -> Tensor:
    """float32 logits [R, V] of float32 hidden states through the target's LM head (in the target's dtype;
    the cast is differentiable, so the head's gradient flows through it)."""
    return runner.model.compute_logits(hidden.to(runner.dtype)).float()


def head_loss(runner: ModelRunner, head: EagleHead, rows: Rows, cls_weight: float) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, regression loss, token cross-entropy) of the head on `rows`. A fusion head: the cross-entropy
    alone (its regression loss reported as 0)."""
    pred = predict(head, rows)
    with torch.no_grad():
        p = _logits(runner, rows.targets).softmax(-1)  # [R, V] the target's next-token distribution
    cls = -(p * _logits(runner, pred).log_softmax(-1)).sum(-1).mean()
    if head.fusion_layers is not None:
        return cls, torch.zeros_like(cls), cls
    reg = F.smooth_l1_loss(pred, rows.targets)
    return reg + cls_weight * cls, reg, cls


def predict(head: EagleHead, rows: Rows) -> Tensor:
    """The head's predicted features [R, H] of `rows`, cache-free."""
    empty = torch.empty(0, device=rows.features.device)
    return head(rows.token_embeds, head.fuse(rows.features), rows.positions, (empty, empty), rows.meta)


@torch.no_grad()
def evaluate(runner: ModelRunner, head: EagleHead, seqs: Sequence[Sequence[int]], cls_weight: float,
             ) -> dict[str, float]:
    """On held-out sequences (no noise): the loss, and the share of rows whose head token equals the target's
    greedy token (`agreement`)."""
    hits = total = 0
    loss = 0.0
    for seq in seqs:
        rows = head_rows(runner, [seq], 0.0, None, layers=head.fusion_layers or ())
        pred = predict(head, rows)
        got = _logits(runner, pred).argmax(-1)
        want = _logits(runner, rows.targets).argmax(-1)
        hits += int((got == want).sum())
        total += len(seq) - 1
        loss += head_loss(runner, head, rows, cls_weight)[0].item() * (len(seq) - 1)
    return {"loss": loss / total, "agreement": hits / total}


def new_head(runner: ModelRunner, seed: int, fusion_layers: FusionLayers | None = None) -> EagleHead:
    """A float32 head for the runner's target: layer weights N(0, 0.02) and norms 1 (as HF initialises
    Llama), fc the identity on the feature half and small on the embedding half, so that the untrained head
    starts from "the next feature is this one"; with fusion layers (checked against the target's), the fusion
    fc the identity on the high layer's state and small on the others."""
    torch.manual_seed(seed)
    if fusion_layers is not None:
        fusion_layers = check_fusion_layers(fusion_layers, runner.arch.num_layers)
    head = EagleHead(draft_arch(runner.arch), DenseCausalBackend(), dtype=torch.float32, device=runner.device,
                     fusion_layers=fusion_layers)
    h = runner.arch.hidden_size
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
        w = torch.cat([torch.randn(h, h) * 0.02, torch.eye(h)], dim=1)  # [H, 2H]: [embedding | feature]
        head.fc.weight.copy_(w)
        head.fc.bias.zero_()
        if head.fuse_fc is not None:  # [H, 3H]: [low | mid | high]
            head.fuse_fc.weight.copy_(torch.cat([torch.randn(h, 2 * h) * 0.02, torch.eye(h)], dim=1))
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def train(runner: ModelRunner, train_seqs: Sequence[Sequence[int]], heldout: Sequence[Sequence[int]],
          config: EagleTrainConfig, progress: Callable[[dict[str, Any]], None] | None = None,
          fusion_layers: FusionLayers | None = None) -> tuple[EagleHead, dict[str, Any]]:
    """Train a new head (EAGLE-3's fusion of `fusion_layers` if given); returns it and a summary (losses;
    held-out loss and agreement before and after)."""
    if not train_seqs or not heldout:
        raise ValueError("training needs sequences to train on and held-out ones")
    if min(map(len, [*train_seqs, *heldout])) < 2:
        raise ValueError("every sequence needs at least two tokens")
    head = new_head(runner, config.seed, fusion_layers)
    layers = head.fusion_layers or ()
    before = evaluate(runner, head, heldout, config.cls_weight)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr)
    rng, gen = random.Random(config.seed), torch.Generator(runner.device).manual_seed(config.seed)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    cached = all_features(runner, train_seqs, layers) if config.cache_features else None
    if cached is not None:
        log.info("target features of %d sequences cached in %.1f s", len(cached), time.perf_counter() - start)
    for step in range(1, config.steps + 1):
        picks = rng.sample(range(len(train_seqs)), min(config.batch_sequences, len(train_seqs)))
        rows = head_rows(runner, [train_seqs[i] for i in picks], config.noise, gen,
                         None if cached is None else [cached[i] for i in picks], layers)
        loss, reg, cls = head_loss(runner, head, rows, config.cls_weight)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
        opt.step()
        history.append({"step": step, "loss": loss.item(), "regression": reg.item(), "token_ce": cls.item()})
        if progress is not None and (step % config.log_every == 0 or step == config.steps):
            progress(history[-1])
        if config.time_limit_s is not None and time.perf_counter() - start > config.time_limit_s:
            log.info("time limit reached after %d of %d steps", step, config.steps)
            break
    after = evaluate(runner, head, heldout, config.cls_weight)
    window = max(1, min(50, len(history) // 4))
    summary = {"steps": len(history), "train_sequences": len(train_seqs), "heldout_sequences": len(heldout),
               "loss_first": sum(h["loss"] for h in history[:window]) / window,
               "loss_last": sum(h["loss"] for h in history[-window:]) / window,
               "heldout_loss_before": before["loss"], "heldout_loss_after": after["loss"],
               "heldout_agreement_before": before["agreement"], "heldout_agreement_after": after["agreement"],
               "seconds": time.perf_counter() - start}
    log.info("eagle head trained: %s", summary)
    return head, summary
