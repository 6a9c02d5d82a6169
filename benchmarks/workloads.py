"""Benchmark workloads: lists of (prompt token ids, output length), deterministic under a seed.

- `sharegpt_workload`: vLLM's ShareGPT sampling (prompt = first human turn, output length = the token
  count of the gpt reply, vLLM's length filters), see `datasets.sample_sharegpt_requests`.
- `random_workload`: random token ids, fixed input and output lengths (trtllm-bench / vLLM "random").
- `shared_prefix_workload`: one long common system prompt (~1,000 tokens) in front of multi-turn ShareGPT
  conversations; turn t+1 of a conversation extends turn t's prompt (its reply included), so a prefix
  cache can serve the system prompt and the history.

Models with real tokenizers get the real text's token ids. Dummy-weight models only have a byte-level
tokenizer, so their prompts are random token ids of the lengths a real BPE tokenizer gives the text
(`length_tokenizer()`: SmolLM2's tokenizer, exported to a small tokenizer.json so it can travel to a
machine without the 98 MB GGUF).

    python -m tokenmill.benchmarks.workloads --export-tokenizer .cache/smollm2-tokenizer.json
"""

from __future__ import annotations

import argparse
import logging
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.datasets import iter_sharegpt, sample_sharegpt_requests
from tokenmill.worker.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.bench")

LENGTH_TOKENIZER_ENV = "TOKENMILL_LENGTH_TOKENIZER"
DEFAULT_LENGTH_TOKENIZER = Path(".cache/smollm2-tokenizer.json")
_FIRST_ID = 1000  # random prompt ids start here: clear of byte and special ids of every model we ship


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt as token ids and how many tokens to generate (forced with ignore_eos).
    `session` >= 0 ties the turns of one conversation (turn t+1 is sent after turn t finished)."""

    prompt_ids: tuple[int, ...]
    output_len: int
    session: int = -1
    turn: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    params: dict[str, Any] = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return len(self.requests)

    def subset(self, n: int) -> Workload:
        return Workload(self.name, self.requests[:n], {**self.params, "subset_of": len(self.requests)})

    def summary(self) -> dict[str, Any]:
        ins = [r.prompt_len for r in self.requests]
        outs = [r.output_len for r in self.requests]
        n = max(len(ins), 1)
        return {"name": self.name, "requests": len(ins), "input_tokens": sum(ins), "output_tokens": sum(outs),
                "mean_input": sum(ins) / n, "mean_output": sum(outs) / n, **self.params}


# -- tokenizers --------------------------------------------------------------------------------------------


def export_length_tokenizer(dest: Path) -> Path:
    """Write the embedded model's tokenizer as a tokenizer.json (a few MB) for `length_tokenizer`."""
    from tokenmill.worker.registry_fetch import embedded_model_path

    tok = Tokenizer.from_gguf_file(embedded_model_path(quiet=True))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tok.backend.save(os.fspath(dest))
    return dest


def length_tokenizer() -> tuple[Tokenizer, str]:
    """The tokenizer that counts ShareGPT lengths for dummy models, and its name for the record:
    $TOKENMILL_LENGTH_TOKENIZER or .cache/smollm2-tokenizer.json, else the embedded GGUF's when it is
    cached, else a byte-level tokenizer (lengths then come out ~4x longer than a BPE's)."""
    from tokenizers import Tokenizer as BackendTokenizer

    path = Path(os.environ.get(LENGTH_TOKENIZER_ENV) or DEFAULT_LENGTH_TOKENIZER)
    if path.is_file():
        backend = BackendTokenizer.from_file(os.fspath(path))
        tok = Tokenizer(backend, vocab_size=backend.get_vocab_size(), bos_token_id=None, eos_token_ids=())
        return tok, f"smollm2-bpe ({path.name})"
    try:
        from tokenmill.worker.registry_fetch import EMBEDDED_MODEL, cache_dir

        gguf = cache_dir() / EMBEDDED_MODEL.package / EMBEDDED_MODEL.version / Path(EMBEDDED_MODEL.member).name
        if gguf.is_file():
            return Tokenizer.from_gguf_file(gguf), "smollm2-bpe (embedded gguf)"
    except ImportError:
        pass
    log.warning("no BPE tokenizer found for ShareGPT lengths: counting bytes")
    return Tokenizer.byte_fallback(512), "byte-level"


def random_ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    hi = vocab_size - 1
    lo = _FIRST_ID if vocab_size > 2 * _FIRST_ID else min(260, hi)
    return tuple(rng.randint(lo, hi) for _ in range(n))


# -- ShareGPT ------------------------------------------------------------------------------------------------


def sharegpt_workload(tokenizer: Tokenizer, n: int, seed: int = 0, *, ids_vocab: int | None = None,
                      max_input_len: int = 1024, max_output_len: int | None = None, max_total_len: int = 2048,
                      path: str | os.PathLike[str] | None = None) -> Workload:
    """`n` ShareGPT requests sampled as vLLM samples them. With `ids_vocab` (dummy models) the prompts
    are random ids in that vocabulary, of the lengths `tokenizer` gives the real prompts."""
    sampled = sample_sharegpt_requests(tokenizer, n, seed, max_input_len, max_output_len,
                                       max_total_len=max_total_len, path=path)
    rng = random.Random(seed)
    reqs = []
    for s in sampled:
        ids = random_ids(rng, s.prompt_len, ids_vocab) if ids_vocab else tuple(tokenizer.encode(s.prompt))
        reqs.append(BenchRequest(ids, s.output_len))
    params = {"seed": seed, "max_input_len": max_input_len, "max_output_len": max_output_len,
              "max_total_len": max_total_len, "prompts": "random ids" if ids_vocab else "text"}
    return Workload("sharegpt", tuple(reqs), params)


def random_workload(n: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    reqs = tuple(BenchRequest(random_ids(rng, input_len, vocab_size), output_len) for _ in range(n))
    return Workload(f"random-{input_len}in-{output_len}out", reqs,
                    {"seed": seed, "input_len": input_len, "output_len": output_len})


# -- shared-prefix chat ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Turn:
    human: tuple[int, ...]  # ids of the user message (text mode: rendered later from `human_text`)
    reply: tuple[int, ...]
    human_text: str = ""
    reply_text: str = ""


def _conversations(min_turns: int, seed: int, path: str | os.PathLike[str] | None) -> Iterator[list[tuple[str, str]]]:
    """ShareGPT conversations with at least `min_turns` (human, gpt) exchanges, in seeded order."""
    convs = []
    for record in iter_sharegpt(path):
        turns = record.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2 * min_turns:
            continue
        pairs = _exchanges(turns)
        if len(pairs) >= min_turns:
            convs.append(pairs[:min_turns])
    random.Random(seed).shuffle(convs)
    yield from convs


def _exchanges(turns: list[Any]) -> list[tuple[str, str]]:
    pairs = []
    for h, g in zip(turns[0::2], turns[1::2]):
        if not (isinstance(h, dict) and isinstance(g, dict)) or (h.get("from"), g.get("from")) != ("human", "gpt"):
            break
        hv, gv = h.get("value"), g.get("value")
        if not (isinstance(hv, str) and isinstance(gv, str) and hv.strip() and gv.strip()):
            break
        pairs.append((hv, gv))
    return pairs


def _cut(tokenizer: Tokenizer, text: str, max_tokens: int) -> tuple[tuple[int, ...], str]:
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    return tuple(ids), tokenizer.decode(ids)


def _system_text(tokenizer: Tokenizer, n_tokens: int, path: str | os.PathLike[str] | None) -> str:
    """A deterministic ~n_tokens system prompt: an instruction and a reference document made of ShareGPT
    replies (the same text on every run)."""
    head = "You are a helpful assistant. Answer using the reference document below when it is relevant.\n\n"
    body, count = [], 0
    for record in iter_sharegpt(path):
        turns = record.get("conversations") or []
        text = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "gpt"), None)
        if isinstance(text, str) and text.strip():
            body.append(text.strip())
            count += len(tokenizer.encode(text, add_special_tokens=False))
            if count > 2 * n_tokens:
                break
    ids = tokenizer.encode(head + "\n\n".join(body), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def shared_prefix_workload(tokenizer: Tokenizer, conversations: int, turns: int, seed: int = 0, *,
                           system_len: int = 1000, max_turn_len: int = 128, ids_vocab: int | None = None,
                           path: str | os.PathLike[str] | None = None) -> Workload:
    """`conversations` x `turns` chat requests that all start with the same ~`system_len`-token system
    prompt. Each user message and reply is cut to `max_turn_len` tokens; a turn's output length is its
    reply's token count. Text mode renders the chat template; `ids_vocab` mode uses random ids of the
    same lengths (the system prompt's ids are shared, the history's ids repeat turn to turn)."""
    rng = random.Random(seed)
    sys_ids = random_ids(rng, system_len, ids_vocab) if ids_vocab else ()
    sys_text = "" if ids_vocab else _system_text(tokenizer, system_len, path)
    reqs: list[BenchRequest] = []
    for c, conv in enumerate(_take(_conversations(turns, seed, path), conversations)):
        history: list[_Turn] = []
        for t, (human, reply) in enumerate(conv):
            h_ids, h_text = _cut(tokenizer, human, max_turn_len)
            r_ids, r_text = _cut(tokenizer, reply, max_turn_len)
            if ids_vocab:
                h_ids, r_ids = random_ids(rng, len(h_ids), ids_vocab), random_ids(rng, len(r_ids), ids_vocab)
            history.append(_Turn(h_ids, r_ids, h_text, r_text))
            prompt = _prompt_ids(tokenizer, sys_ids, sys_text, history, ids_vocab is not None)
            reqs.append(BenchRequest(prompt, max(len(r_ids), 4), session=c, turn=t))
    if len(reqs) < conversations * turns:
        raise ValueError(f"only {len(reqs) // max(turns, 1)} ShareGPT conversations have {turns} turns")
    params = {"seed": seed, "conversations": conversations, "turns": turns, "system_len": system_len,
              "max_turn_len": max_turn_len, "prompts": "random ids" if ids_vocab else "chat template"}
    return Workload("shared-prefix-chat", tuple(reqs), params)


def _take(it: Iterator[list[tuple[str, str]]], n: int) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for conv in it:
        if len(out) == n:
            break
        out.append(conv)
    return out


def _prompt_ids(tokenizer: Tokenizer, sys_ids: Sequence[int], sys_text: str, history: list[_Turn],
                ids_mode: bool) -> tuple[int, ...]:
    """The prompt of the last turn in `history`: system + earlier exchanges + the new user message."""
    if ids_mode:
        ids = list(sys_ids)
        for turn in history[:-1]:
            ids += [*turn.human, *turn.reply]
        return (*ids, *history[-1].human)
    messages = [{"role": "system", "content": sys_text}]
    for turn in history[:-1]:
        messages += [{"role": "user", "content": turn.human_text}, {"role": "assistant", "content": turn.reply_text}]
    messages.append({"role": "user", "content": history[-1].human_text})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export-tokenizer", type=Path, default=DEFAULT_LENGTH_TOKENIZER,
                    help="where to write the SmolLM2 tokenizer.json that counts ShareGPT lengths")
    args = ap.parse_args()
    print(export_length_tokenizer(args.export_tokenizer))


if __name__ == "__main__":
    main()
