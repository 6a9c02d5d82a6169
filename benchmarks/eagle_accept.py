"""Offline acceptance of an EAGLE head on held-out sequences (issue 17): how often its drafts would be accepted,
measured with the real target and no engine.

For each held-out sequence (the last --heldout of a JSON-lines file of token ids, e.g. train-eagle's
--save-sequences: those train-eagle held out) the target runs once cache-free for its features f_t and its greedy
tokens g_{t+1} = argmax lm_head(f_t). Then, on the reply rows (the tokens after the chat template's
"<|im_start|>assistant\\n"):
  (a) teacher-forced agreement: the share of rows whose first draft (the head over (embed(x_{t+1}), f_t), every
      earlier row from real features) is the target's greedy token g_{t+2};
  (b) chain acceptance as the engine drafts (worker/spec/eagle_proposer.py): at every reply position m (tokens
      x_0..x_m known, features f_0..f_{m-1}) the head drafts d_1..d_K autoregressively (draft j+1 reads
      (embed(d_j), f^_{m+j-1}), attending to the head's rows of the real prefix and of the drafts before it);
      the accepted length a_k(m) is the number of leading drafts equal to g_{m+1}..g_{m+k}, and
      tau_k = 1 + mean a_k (tokens per verify step with k drafts, as spec_cpu.py reports it).
All chains of a sequence run batched through `ChainBackend`, which keeps the head's keys and values of the
teacher-forced pass and of each chain's drafts (the proposer's paged KV cache, without the pages).

    nice -n 10 python -m tokenmill.benchmarks.eagle_accept --data .cache/eagle_seqs.jsonl.gz --heldout 200 \\
        --sequences 40 --threads 1 --out benchmarks/results/cpu --name eagle_accept
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenmill.benchmarks.common import write_results
from tokenmill.kernels.attention_ref import rotary_embedding_ref
from tokenmill.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata, KVCache
from tokenmill.worker.config import CacheConfig, EngineConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.model_runner import ModelRunner, attention_metadata
from tokenmill.worker.spec.eagle import EagleHead, head_folder, load_eagle_head
from tokenmill.worker.spec.eagle_train import assistant_marker, reply_start, target_features
from tokenmill.worker.spec.ngram import lookup

MAX_K = 5
LOOKUP_MAX = SpeculativeConfig().prompt_lookup_max  # the engine's default longest suffix


class ChainBackend(AttentionBackend):
    """The head's one attention layer for an offline acceptance run over one sequence. `prefix()` mode: the
    teacher-forced rows 0..n-1 (dense causal), their rotated keys and values kept. `chains(starts)` mode: one
    query row per chain b, its draft step j at position starts[b] + j - 1, attending to the kept rows
    < starts[b] and to its own rows of the steps so far (itself included)."""

    name = "chain"

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # [n, Hkv, D] rotated, of the prefix rows
        self.values: Tensor | None = None
        self.starts: Tensor | None = None  # [B] m per chain
        self.chain_k: list[Tensor] = []  # per step so far: [B, Hkv, D]
        self.chain_v: list[Tensor] = []

    def prefix(self) -> None:
        self.keys = self.values = self.starts = None
        self.chain_k, self.chain_v = [], []

    def chains(self, starts: Tensor) -> None:
        self.starts, self.chain_k, self.chain_v = starts, [], []

    def forward(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> Tensor:
        q, k = rotary_embedding_ref(q, k, layer.cos_sin_cache, positions)
        group = q.shape[1] // k.shape[1]
        if self.starts is None:  # the teacher-forced pass: [n, H, D]
            self.keys, self.values = k, v
            qs, ks, vs = (t.transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=layer.scale).transpose(0, 1)
        assert self.keys is not None and self.values is not None
        self.chain_k.append(k)
        self.chain_v.append(v)
        pk, pv = self.keys.repeat_interleave(group, 1), self.values.repeat_interleave(group, 1)  # [n, H, D]
        ck = torch.stack(self.chain_k, 1).repeat_interleave(group, 2)  # [B, j, H, D]
        cv = torch.stack(self.chain_v, 1).repeat_interleave(group, 2)
        s_prefix = torch.einsum("bhd,nhd->bhn", q, pk) * layer.scale  # [B, H, n]
        hidden = torch.arange(pk.shape[0], device=q.device)[None, :] >= self.starts[:, None]  # [B, n]
        s_prefix = s_prefix.masked_fill(hidden[:, None, :], float("-inf"))
        s_chain = torch.einsum("bhd,bjhd->bhj", q, ck) * layer.scale  # [B, H, j]
        p = torch.cat([s_prefix, s_chain], -1).float().softmax(-1).to(q.dtype)
        n = pk.shape[0]
        return torch.einsum("bhn,nhd->bhd", p[..., :n], pv) + torch.einsum("bhj,bjhd->bhd", p[..., n:], cv)


@torch.no_grad()
def measure_sequence(runner: ModelRunner, head: EagleHead, backend: ChainBackend, seq: Sequence[int],
                     start: int, k_max: int, stride: int, window: int, lookup_min: int = 0) -> dict[str, Any]:
    """(a) and (b) of the module docstring on one sequence whose reply starts at index `start`; the keys with
    "early_" count only the first `window` reply tokens (what a short live reply drafts on). `lookup_min` > 0: the
    chains are the engine's with --eagle-lookup-min (prompt lookup's drafts where x_0..x_m's last lookup_min..8
    tokens occur earlier, the head's elsewhere)."""
    embed, logits = runner.model.model.embed_tokens, runner.model.compute_logits
    whole = target_features(runner, seq, head.fusion_layers or ())  # [L, H] f_t (+ [L, 3H] a fusion head's states)
    feats = whole[:, : runner.arch.hidden_size]
    greedy = logits(feats).argmax(-1)  # [L] g_{t+1}
    ids = torch.tensor(list(seq), device=runner.device)
    n = len(seq) - 1  # head rows t = 0..L-2
    backend.prefix()
    meta = attention_metadata([n], [n], [[0]], [-1] * n, runner.device)
    empty = (torch.empty(0), torch.empty(0))  # no KV cache: ChainBackend keeps the head's keys and values
    inputs = whole[:-1, runner.arch.hidden_size :] if head.fusion_layers else feats[:-1]
    rows = head(embed(ids[1:]), head.fuse(inputs), torch.arange(n, device=runner.device), empty, meta)
    first = logits(rows).argmax(-1)  # [n] row t: the draft of x_{t+2}
    hit = first == greedy[1:]  # [n] row t right
    reply_rows = torch.arange(max(start - 2, 0), n, device=runner.device)  # rows t with t + 2 in the reply
    early_rows = reply_rows[reply_rows + 2 < start + window]
    # chains at m: known x_0..x_m, drafts d_j of x_{m+j} checked against g_{m+j} = greedy[m + j - 1]
    starts = torch.arange(max(start, 1), len(seq) - k_max + 1, stride, device=runner.device)
    right = torch.zeros(len(starts), dtype=torch.int64, device=runner.device)  # leading drafts right per chain
    if len(starts):
        backend.chains(starts)
        hidden, tokens = rows[starts - 1], first[starts - 1]  # f^_m [B, H], d_1 [B]
        alive = torch.ones(len(starts), dtype=torch.bool, device=runner.device)
        for j in range(1, k_max + 1):
            alive &= tokens == greedy[starts + j - 1]
            right += alive
            if j == k_max or not bool(alive.any()):
                break
            hidden = head(embed(tokens), hidden, starts + j - 1, empty, meta)
            tokens = logits(hidden).argmax(-1)
    if lookup_min:
        for c, m in enumerate(starts.tolist()):
            drafts = lookup(seq[: m + 1], k_max, lookup_min, LOOKUP_MAX)
            if drafts:
                want = greedy[m : m + k_max].tolist()  # g_{m+1}..g_{m+k}
                right[c] = next((j for j, (d, g) in enumerate(zip(drafts, want)) if d != g), k_max)
    early = starts < start + window
    walk = {str(k): _walk(right.tolist(), int(starts[0]) if len(starts) else 0, start, k, window)
            for k in range(1, k_max + 1)} if stride == 1 else {}
    return {"length": len(seq), "reply_start": start,
            "tf_all_rows": n, "tf_all_hits": int(hit.sum()),
            "tf_reply_rows": len(reply_rows), "tf_reply_hits": int(hit[reply_rows].sum()),
            "early_tf_reply_rows": len(early_rows), "early_tf_reply_hits": int(hit[early_rows].sum()),
            "data_tokens": len(seq) - start - 1,
            "data_equals_greedy": int((ids[start + 1 :] == greedy[start:-1]).sum()),
            "chains": len(starts), "chain_accepted": _accepted_counts(right, k_max),
            "early_chains": int(early.sum()), "early_chain_accepted": _accepted_counts(right[early], k_max),
            "walk": walk}


def _walk(right: list[int], first: int, start: int, k: int, window: int) -> list[int]:
    """[verify steps, tokens they gave] of the engine's walk over the first `window` reply tokens with k drafts
    per step: the prefill gives x_start, then at each m (chains from `first`: right[m - first] leading drafts
    right) a step accepts a = min(right, k) drafts and the bonus token, and the next step is at m + a + 1."""
    steps = tokens = 0
    m = start
    while m - start + 1 < window and 0 <= m - first < len(right):
        a = min(right[m - first], k, window - (m - start + 1) - 1)
        steps, tokens, m = steps + 1, tokens + a + 1, m + a + 1
    return [steps, tokens]


def _accepted_counts(right: Tensor, k_max: int) -> list[int]:
    """[j]: the chains whose first j drafts are all right, j = 0..k_max."""
    return [int((right >= j).sum()) for j in range(k_max + 1)]




def summarize(per_seq: list[dict[str, Any]], k_max: int) -> dict[str, Any]:
    def ratio(hits: str, rows: str) -> float:
        total = sum(r[rows] for r in per_seq)
        return sum(r[hits] for r in per_seq) / total if total else 0.0

    def chain_stats(prefix: str) -> dict[str, Any]:
        chains = sum(r[prefix + "chains"] for r in per_seq)
        acc = [sum(r[prefix + "chain_accepted"][j] for r in per_seq) for j in range(k_max + 1)]
        # tau_k = 1 + sum_{j<=k} P(first j drafts right); conditional: P(draft j right | the drafts before it right)
        return {prefix + "chains": chains,
                prefix + "chain_tau": {str(k): 1 + sum(acc[1 : k + 1]) / chains if chains else 0.0
                                       for k in range(1, k_max + 1)},
                prefix + "chain_draft_accept_given_previous": {str(j): acc[j] / acc[j - 1] if acc[j - 1] else 0.0
                                                               for j in range(1, k_max + 1)}}

    walks = {k: [sum(r["walk"][k][i] for r in per_seq) for i in (0, 1)] for k in per_seq[0]["walk"]} if per_seq else {}
    return {"sequences": len(per_seq),
            # tokens per verify step of the engine's own walk over each reply's first `window` tokens (spec_cpu.py's
            # tokens / step when the replies are the target's greedy ones)
            "walk_tau": {k: t / n if n else 0.0 for k, (n, t) in walks.items()},
            "teacher_forced_all_rows_agreement": ratio("tf_all_hits", "tf_all_rows"),
            "teacher_forced_reply_agreement": ratio("tf_reply_hits", "tf_reply_rows"),
            "early_teacher_forced_reply_agreement": ratio("early_tf_reply_hits", "early_tf_reply_rows"),
            "reply_tokens_equal_target_greedy": ratio("data_equals_greedy", "data_tokens"),
            **chain_stats(""), **chain_stats("early_")}


def read_sequences(path: Path) -> list[list[int]]:
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line)["token_ids"] for line in f if line.strip()]


def measure(runner: ModelRunner, head_dir: Path, seqs: Sequence[Sequence[int]], marker: Sequence[int],
            k_max: int = MAX_K, stride: int = 1, window: int = 64, lookup_min: int = 0) -> dict[str, Any]:
    """summarize() of every sequence of `seqs` with a reply, through the head in `head_dir` (float32)."""
    backend = ChainBackend()
    head = load_eagle_head(head_dir, runner.arch, backend, dtype=torch.float32, device=runner.device)
    head.eval()
    per_seq = []
    for seq in seqs:
        start = reply_start(seq, marker)
        if start is not None and len(seq) - start > k_max + 1:
            per_seq.append(measure_sequence(runner, head, backend, seq, start, k_max, stride, window, lookup_min))
    return summarize(per_seq, k_max) | {"per_sequence": per_seq}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(".cache/eagle_seqs.jsonl.gz"),
                    help="JSON lines of token_ids (.gz or not): train-eagle's sequences")
    ap.add_argument("--heldout", type=int, default=200, help="the file's last N sequences are the held-out ones")
    ap.add_argument("--sequences", type=int, default=40, help="of those, the first N are measured")
    ap.add_argument("--draft-model", action="append", default=None,
                    help="head folder (repeatable; default: the head shipped for the embedded model)")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=MAX_K, help="longest chain measured")
    ap.add_argument("--stride", type=int, default=1, help="draft at every stride-th reply position")
    ap.add_argument("--window", type=int, default=64, help="the early_ figures: the first N reply tokens only")
    ap.add_argument("--lookup-min", type=int, default=0,
                    help="chains as with --eagle-lookup-min N: prompt lookup first, the head elsewhere (0: the head)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write <name>.json / .md here")
    ap.add_argument("--name", default="eagle_accept")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = read_sequences(args.data)[-args.heldout :][: args.sequences]
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device=args.device, max_model_len=1024,
                                    cuda_graphs=False,
                                    cache=CacheConfig(num_blocks=1024 // 16 + 1)))
    marker = assistant_marker(engine.tokenizer)
    heads = [Path(p) for p in args.draft_model] if args.draft_model else [head_folder(None, args.model)]
    results: dict[str, Any] = {}
    for head_dir in heads:
        t0 = time.perf_counter()
        results[str(head_dir)] = measure(engine.runner, head_dir, seqs, marker, args.k, args.stride,
                                        args.window, args.lookup_min)
        results[str(head_dir)]["seconds"] = time.perf_counter() - t0
        short = {k: v for k, v in results[str(head_dir)].items() if k != "per_sequence"}
        print(json.dumps({"head": str(head_dir), **short}), flush=True)
    if args.out is not None:
        payload = {"benchmark": "eagle_accept", "config": {k: str(v) for k, v in vars(args).items()},
                   "results": results}
        write_results(args.out, args.name, payload, table(results))


def table(results: dict[str, Any]) -> str:
    rows = ["| head | rows | sequences | chains | teacher-forced agreement | tau k = 1 / 2 / 3 / 4 / 5 | "
            "P(draft j right given the earlier ones), j = 1..5 |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for label, p in (("reply", ""), ("first reply tokens", "early_")):
            tau = " / ".join(f"{t:.2f}" for t in r[p + "chain_tau"].values())
            cond = " / ".join(f"{c:.0%}" for c in r[p + "chain_draft_accept_given_previous"].values())
            rows.append(f"| {Path(name).name} | {label} | {r['sequences']} | {r[p + 'chains']} | "
                        f"{r[p + 'teacher_forced_reply_agreement']:.1%} | {tau} | {cond} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
