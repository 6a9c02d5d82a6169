"""Text <-> token ids, built on the Hugging Face `tokenizers` library.

A `Tokenizer` comes from a Hugging Face model folder (tokenizer.json), from GGUF metadata (vocabulary,
merges and special ids as llama.cpp stores them), or is a byte-level stand-in for models with dummy
weights. It also renders chat templates the way transformers does.

Invariants kept by every constructor:
- the backend's special added tokens are exactly `all_special_ids`, so `decode(skip_special_tokens=True)`
  drops exactly those ids, and bos/eos/unk/pad are among them;
- `encode` never lets the backend post-processor add tokens; a BOS is prepended here iff `add_bos`.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.protocol import InvalidRequest

log = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pre-tokenizer splits by tokenizer.ggml.pre, following llama.cpp (llama-vocab.cpp), which derives each
# from the model's own tokenizer.json. The GPT-2 split is the one ByteLevel(use_regex=True) applies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"})
_DIGITS_GPT2_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"})
_LLAMA3_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"})

# Control tokens that end a turn, which llama.cpp also treats as end of generation.
_END_OF_GENERATION_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
    "<|end_of_text|>", "<|endofturn|>", "<EOT>", "<|return|>", "<|call|>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
})


# ---------------------------------------------------------------------------------------------- GGUF reading


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (v2/v3) as plain Python values: str (lossy UTF-8), int, float,
    bool, and lists of those. Only the header is read; tensors are not touched."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{os.fspath(path)} is not a GGUF file")
        endian = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        version = struct.unpack_from(endian + "I", buf, 4)[0]
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (need 2 or later)")
        reader = _GGUFHeaderReader(buf, endian, offset=8)
        reader.scalar("Q")  # tensor count
        kv_count = reader.scalar("Q")
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = reader.string()
            meta[key] = reader.value(reader.scalar("I"))
        return meta


# GGUF value type -> struct format of its scalars (8 is STRING, 9 is ARRAY).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _GGUFHeaderReader:
    """A cursor over a GGUF header; `pos` always sits at the start of the next unread item."""

    def __init__(self, buf: mmap.mmap, endian: str, offset: int) -> None:
        self.buf, self.endian, self.pos = buf, endian, offset

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(self.endian + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            return self.array()
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_GGUF_SCALARS[vtype])

    def array(self) -> list[Any]:
        vtype, n = self.scalar("I"), self.scalar("Q")
        if vtype in _GGUF_SCALARS:
            dtype = np.dtype(self.endian + _GGUF_SCALARS[vtype])
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
            self.pos += n * dtype.itemsize
            return list(values)
        return [self.value(vtype) for _ in range(n)]


# ------------------------------------------------------------------------------------------ byte-level maps


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def byte_level_token_bytes(token: str) -> bytes:
    """The bytes the ByteLevel decoder produces for one token: mapped per character when every
    character is in the byte alphabet, else the token's raw UTF-8 (as `tokenizers` does)."""
    table = unicode_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


# ------------------------------------------------------------------------------------------------ tokenizer


class Tokenizer:
    """A tokenizer with the ids an engine needs (bos/eos/pad), a chat template, and decoding helpers."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self._vocab_size = vocab_size
        self._bos = bos_token_id
        self._eos_ids = tuple(dict.fromkeys(eos_token_ids))
        self._pad = pad_token_id
        self._unk = unk_token_id
        self._add_bos = bool(add_bos and bos_token_id is not None)
        self._chat_template = chat_template
        self._register_special_ids()
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    # ---------------------------------------------------------------------------------------- construction

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json with tokenizer_config.json (chat template, special tokens, add_bos_token)."""
        folder = Path(path)
        backend = BackendTokenizer.from_file(os.fspath(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        def special_id(name: str) -> int | None:
            content = _token_content(config.get(name, special_map.get(name)))
            return backend.token_to_id(content) if content is not None else None

        bos, eos = special_id("bos_token"), special_id("eos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(backend, bos)
        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=bos,
            eos_token_ids=_hf_eos_ids(eos, generation.get("eos_token_id")),
            pad_token_id=special_id("pad_token"),
            unk_token_id=special_id("unk_token"),
            add_bos=bool(add_bos),
            chat_template=_hf_chat_template(folder, config),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata: "gpt2" (byte-level BPE) or "llama" (SentencePiece-style BPE)."""
        model = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if model == "gpt2":
            backend = _gguf_byte_level_backend(meta, tokens)
            default_add_bos = meta.get("tokenizer.ggml.pre") in _LLAMA3_PRE
        elif model == "llama":
            backend = _gguf_sentencepiece_backend(meta, tokens, types)
            default_add_bos = True
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {model!r}")
        _add_gguf_added_tokens(backend, tokens, types)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", default_add_bos)
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_gguf_eos_ids(meta, tokens, types),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
            add_bos=bool(add_bos),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_gguf_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        return cls.from_gguf_metadata(read_gguf_metadata(path))

    @classmethod
    def byte_fallback(cls, vocab_size: int) -> Tokenizer:
        """A byte-level tokenizer for models without one: ids 0..255 are bytes, 256 <|endoftext|>
        (bos/eos/pad), 257 <|im_start|>, 258 <|im_end|>; ids above decode to placeholder text."""
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if vocab_size < 256 + len(specials):
            raise ValueError(f"byte_fallback needs vocab_size >= {256 + len(specials)}, got {vocab_size}")
        alphabet = byte_to_unicode()
        vocab = {alphabet[b]: b for b in range(256)}
        vocab.update({tok: 256 + i for i, tok in enumerate(specials)})
        # Placeholders are never produced by encode (no merges reach them), only by a sampler.
        vocab.update({f"<|x{i}|>": i for i in range(256 + len(specials), vocab_size)})
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return cls(backend, vocab_size=vocab_size, bos_token_id=256, eos_token_ids=(256, 258),
                   pad_token_id=256, add_bos=False, chat_template=None)

    def _register_special_ids(self) -> None:
        """Make bos/eos/unk/pad special added tokens, so decode skips them like every control token."""
        ids = [self._bos, self._unk, self._pad, *self._eos_ids]
        added = self.backend.get_added_tokens_decoder()
        missing = []
        for i in dict.fromkeys(i for i in ids if i is not None):
            token = self.backend.id_to_token(i)
            if token is not None and not (i in added and added[i].special):
                missing.append(AddedToken(token, special=True, normalized=False))
        if missing:
            self.backend.add_special_tokens(missing)

    # ------------------------------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def unk_token_id(self) -> int | None:
        return self._unk

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of input text one token stands for: the longest token string
        (added tokens included; a byte-level token's string has one character per byte it covers), times 4
        when the backend normalizes (a normalizer such as NFKC may compose several characters into one)."""
        longest = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (4 if self.backend.normalizer is not None else 1)

    @cached_property
    def token_bytes(self) -> tuple[bytes, ...] | None:
        """Per id, the bytes decode() emits for it, when decode() is the lossy UTF-8 decoding of the
        concatenated per-token bytes (ByteLevel decoder); None for any other decoder."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        size = max(self._vocab_size, self.backend.get_vocab_size(with_added_tokens=True))
        return tuple(byte_level_token_bytes(self.backend.id_to_token(i) or "") for i in range(size))

    # ------------------------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True, release_gil: bool = False) -> list[int]:
        """Token ids of `text` (BOS first iff `add_special_tokens` and the model adds one). `release_gil`:
        run the backend without holding the GIL (its batch entry point), so other threads keep running
        while a long text is tokenized; the ids are the same."""
        if release_gil:
            ids: list[int] = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        if not add_special_tokens:
            return [e.ids for e in encodings]
        return [self._with_bos(e.ids) for e in encodings]

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self._add_bos and self._bos is not None:
            return [self._bos, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, i: int) -> str | None:
        token = self.backend.id_to_token(i)
        return None if token is None else str(token)

    def token_to_id(self, s: str) -> int | None:
        i = self.backend.token_to_id(s)
        return None if i is None else int(i)

    def token_text(self, name: str) -> str | None:
        """The text of the special token `name` ("bos", "eos", "unk", "pad"), or None."""
        i = {"bos": self._bos, "eos": self.eos_token_id, "unk": self._unk, "pad": self._pad}[name]
        return None if i is None else self.id_to_token(i)

    # ---------------------------------------------------------------------------------------- chat template

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (ChatML if it has none), as transformers does."""
        validate_messages(messages)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos", "eos", "unk", "pad"):
            text = self.token_text(name)
            if text is not None:
                variables[f"{name}_token"] = text
        variables.update(kwargs)
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        # Template failures (its own raise_exception, syntax, type errors) fail this request alone.
        try:
            template = _compile_template(self._chat_template or DEFAULT_CHAT_TEMPLATE)
            return str(template.render(**variables))
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise InvalidRequest(f"chat template failed: {e}") from None


def validate_messages(messages: object) -> None:
    """Raise InvalidRequest unless `messages` is a non-empty list of {role: str, content: str}."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role': str, 'content': str}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequest(f"messages[{i}]['{key}'] must be a string")


# ------------------------------------------------------------------------------------- chat template helpers


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's own tojson, this neither escapes HTML nor forbids options (as transformers does).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------------------------------- HF folder helpers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _post_processor_adds(backend: BackendTokenizer, bos: int | None) -> bool:
    return bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]


def _hf_eos_ids(eos: int | None, generation_eos: Any) -> list[int]:
    extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return [i for i in [eos, *extra] if isinstance(i, int)]


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------------------------------- GGUF helpers


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_PRE:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text as GPT-2 does", pre)
    return gpt2


def _gguf_byte_level_backend(meta: Mapping[str, Any], tokens: list[str]) -> BackendTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = meta.get("tokenizer.ggml.pre")
    bpe = models.BPE(vocab=_vocab(tokens), merges=merges, ignore_merges=pre in _LLAMA3_IGNORE_MERGES)
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    # As in llama.cpp's text -> id map: a duplicated string keeps its last id, an empty one gets a name.
    return {token or f"[EMPTY_{i}]": i for i, token in enumerate(tokens)}


def _gguf_sentencepiece_backend(
    meta: Mapping[str, Any], tokens: list[str], types: list[int]
) -> BackendTokenizer:
    scores: list[float] = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    bpe = models.BPE(vocab=_vocab(tokens), merges=sentencepiece_merges(tokens, scores, types),
                     unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(bpe)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    to_spm_space = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(SPM_SPACE), to_spm_space])
                          if space_prefix else to_spm_space)
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def sentencepiece_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging: every split of a normal token into
    two normal tokens, best merged-token score first (ties: shorter left piece first)."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], cut, i, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_gguf_added_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens match whole as special tokens; user-defined ones match whole but are
    ordinary text (llama.cpp parses both out of the text before BPE). Contents are the vocabulary
    entries themselves, so each keeps its GGUF id."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    if special:
        backend.add_special_tokens(special)
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
    if user:
        backend.add_tokens(user)


def _gguf_eos_ids(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> list[int]:
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [meta[f"tokenizer.ggml.{k}"] for k in keys if meta.get(f"tokenizer.ggml.{k}") is not None]
    ids += [i for i, (t, kind) in enumerate(zip(tokens, types))
            if kind == TOKEN_CONTROL and t in _END_OF_GENERATION_TEXTS]
    return ids
