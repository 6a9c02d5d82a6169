"""IncrementalDetokenizer: deltas add up to the full decode and never split a character."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.benchmarks.datasets import sharegpt_pairs
from tokenmill.worker.detokenizer import MAX_WINDOW_TOKENS, IncrementalDetokenizer
from tokenmill.worker.registry_fetch import embedded_model_path
from tokenmill.worker.tokenizer import Tokenizer

Encoded = list[tuple[str, list[int]]]

EXTRA_TEXTS = [
    "Hello 👋🏽 world 🇺🇸 ❤️‍🔥 👨‍👩‍👧‍👦!",
    "你好，世界！这是一个测试。日本語のテキストとカタカナ。한국어 텍스트입니다",
    "e\u0301 n\u0303 \u0915\u094d\u0937 a\u0308\u0304 Ångström naïve",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 \U0001f9ec\U0001fae0 \u200d\u200d",
    "  \t\n mixed Россия مرحبا  ",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_file(embedded_model_path(quiet=True))


@pytest.fixture(scope="module")
def encoded(tok: Tokenizer) -> Encoded:
    texts = [human for human, _ in sharegpt_pairs()[:500]] + EXTRA_TEXTS
    return list(zip(texts, tok.encode_batch(texts, add_special_tokens=False)))


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int] = (1,)) -> list[str]:
    """Push `ids` in chunks of the given sizes (cycled); return the deltas, flush included."""
    deltas, pos, k = [], 0, 0
    while pos < len(ids):
        size = sizes[k % len(sizes)]
        deltas.append(detok.push(ids[pos:pos + size]))
        pos, k = pos + size, k + 1
    deltas.append(detok.flush())
    return deltas


def assert_clean(deltas: list[str], full: str) -> None:
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("strategy", ["auto", "window"])
def test_token_by_token_matches_decode(tok: Tokenizer, encoded: Encoded, strategy: Any) -> None:
    held_back = 0
    for text, ids in encoded:
        detok = IncrementalDetokenizer(tok, strategy=strategy)
        deltas = stream(detok, ids)
        assert_clean(deltas, tok.decode(ids))
        assert deltas[-1] == "" and detok.output_text == text and detok.num_tokens == len(ids)
        held_back += deltas[:-1].count("")
    assert held_back > 0  # multi-token characters were held back somewhere


@pytest.mark.parametrize("strategy", ["auto", "window"])
def test_random_chunks_match_decode(tok: Tokenizer, encoded: Encoded, strategy: Any) -> None:
    rng = random.Random(7)
    for _, ids in encoded[::3] + encoded[-len(EXTRA_TEXTS):]:
        sizes = [rng.randint(1, 9) for _ in range(16)]
        assert_clean(stream(IncrementalDetokenizer(tok, strategy=strategy), ids, sizes), tok.decode(ids))


def test_emoji_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("\U0001fae0")  # one character, several byte-level tokens
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "\U0001fae0"


@pytest.mark.parametrize("strategy", ["auto", "window"])
def test_skip_special_tokens(tok: Tokenizer, strategy: Any) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi 👋<|im_end|><|endoftext|>")
    skipped = stream(IncrementalDetokenizer(tok, strategy=strategy), ids)
    assert "".join(skipped) == "assistant\nHi 👋" == tok.decode(ids)
    kept = stream(IncrementalDetokenizer(tok, skip_special_tokens=False, strategy=strategy), ids)
    assert "".join(kept) == "<|im_start|>assistant\nHi 👋<|im_end|><|endoftext|>"


@pytest.mark.parametrize("strategy", ["auto", "window"])
def test_prompt_context_does_not_change_byte_level_text(tok: Tokenizer, strategy: Any) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    ids = tok.encode(" Hello there, 世界", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, strategy=strategy)
    assert "".join(stream(detok, ids)) == " Hello there, 世界"


def test_truncated_stream_flushes_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok \U0001fae0")[:-1]
    for strategy in ("auto", "window"):
        detok = IncrementalDetokenizer(tok, strategy=strategy)  # type: ignore[arg-type]
        deltas = [detok.push([i]) for i in ids]
        assert "\ufffd" not in "".join(deltas)
        tail = detok.flush()
        assert tail.endswith("\ufffd") and "".join(deltas) + tail == tok.decode(ids)


def test_bytes_strategy_never_calls_decode(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode("some text 🙂 " * 50)
    detok = IncrementalDetokenizer(tok)
    expected = tok.decode(ids)
    monkeypatch.setattr(tok, "decode", lambda *a, **k: pytest.fail("decode called"))
    assert "".join(stream(detok, ids)) == expected


def test_window_stays_bounded(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-token cost must not grow with the output: every decode call sees a short window."""
    ids = tok.encode("word 🙂 " * 1500 + "<|im_end|>" * 100 + "end")
    expected = tok.decode(ids)
    decode = tok.decode
    longest = [0]

    def counting(window: Sequence[int], skip: bool = True) -> str:
        longest[0] = max(longest[0], len(window))
        return decode(window, skip)

    monkeypatch.setattr(tok, "decode", counting)
    detok = IncrementalDetokenizer(tok, strategy="window")
    assert "".join(stream(detok, ids)) == expected
    assert longest[0] <= MAX_WINDOW_TOKENS + 2
    assert len(detok._stream._ids) <= 8 * MAX_WINDOW_TOKENS  # type: ignore[attr-defined]


def test_bytes_strategy_needs_byte_level() -> None:
    spm = Tokenizer.from_gguf_metadata(_spm_meta())
    with pytest.raises(ValueError, match="byte-level"):
        IncrementalDetokenizer(spm, strategy="bytes")


# ------------------------------------------------------------------------------------------ byte fallback

_BYTE_TOK = Tokenizer.byte_fallback(512)


@settings(max_examples=200, deadline=None)
@given(st.text(), st.lists(st.integers(1, 7), min_size=1, max_size=8), st.sampled_from(["auto", "window"]))
def test_byte_fallback_random_text(text: str, sizes: list[int], strategy: Any) -> None:
    ids = _BYTE_TOK.encode(text)
    detok = IncrementalDetokenizer(_BYTE_TOK, skip_special_tokens=False, strategy=strategy)
    deltas = stream(detok, ids, sizes)
    assert_clean(deltas, text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 511), st.sampled_from([0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F]))),
       st.lists(st.integers(1, 5), min_size=1, max_size=6), st.booleans())
def test_byte_fallback_random_ids(ids: list[int], sizes: list[int], skip: bool) -> None:
    """Arbitrary (also invalid UTF-8) id streams: the byte strategy reproduces decode() exactly."""
    detok = IncrementalDetokenizer(_BYTE_TOK, skip_special_tokens=skip)
    assert "".join(stream(detok, ids, sizes)) == _BYTE_TOK.decode(ids, skip_special_tokens=skip)


# ------------------------------------------------------------------------------- SentencePiece (window)


def _spm_meta() -> dict[str, Any]:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "llo", "hello", "▁hello", "▁w", "or", "▁world"]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_stream() -> None:
    spm = Tokenizer.from_gguf_metadata(_spm_meta())
    ids = spm.encode("hello ñ world", add_special_tokens=False)
    detok = IncrementalDetokenizer(spm)
    deltas = [detok.push([i]) for i in ids]
    assert "" in deltas  # the two byte-fallback tokens of "ñ" are held until both arrived
    assert "".join(deltas) + detok.flush() == spm.decode(ids) == "hello ñ world"


def test_sentencepiece_keeps_space_after_prompt() -> None:
    spm = Tokenizer.from_gguf_metadata(_spm_meta())
    prompt = spm.encode("hello")
    out = [spm.token_to_id("▁world") or 0]
    assert spm.decode(out) == "world"  # decode() alone strips the SentencePiece prefix space
    assert IncrementalDetokenizer(spm, prompt_token_ids=prompt).push(out) == " world"
    assert IncrementalDetokenizer(spm).push(out) == "world"
