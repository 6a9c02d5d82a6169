"""Batched, seeded token sampling.

Every sampled token is a function of (seed, position, logits row) alone: batch neighbours, batch order,
batch size and the process or device a request runs on never change it. Random rows use the
exponential race ("Gumbel-max"): token = argmax_i p_i / E_i with E_i ~ Exp(1), where E_i comes from a
counter-based hash of (seed, position, i) computed with int64 tensor ops on the logits' device. No
torch.Generator and no host synchronisation happen inside `Sampler.__call__`.

Pipeline of `Sampler.__call__` (all rows, vectorised over N):
  1. penalties: repetition (HF: on prompt+output tokens, positive logits divided, negative multiplied),
     then frequency/presence (OpenAI: on output tokens, subtracted);
  2. min_tokens: ban EOS / stop ids (-inf) for requests that are still shorter than min_tokens;
     structured outputs: tokens a constrained row's bitmask forbids are -inf too (worker/structured/);
  3. greedy rows take argmax of these logits;
  4. random rows: divide by temperature, top-k, top-p (on the renormalised top-k distribution),
     min-p, then the exponential race.
Logprobs (when asked for) are log_softmax of the raw logits given to the sampler (vLLM's default): before
penalties, bans and a structured-output mask, so a constrained row's logprobs are the model's own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.structured.bitmask import apply_token_bitmask
from tokenmill.worker.transfer import from_numpy

log = logging.getLogger("tokenmill.sampler")

# Temperatures below this are treated as greedy (dividing by them would overflow float32).
GREEDY_TEMPERATURE_EPS = 1e-5

_NEG_INF = float("-inf")
_U64 = 1 << 64
_MASK64 = _U64 - 1


def _i64(c: int) -> int:
    """The int64 (two's complement) value with the same 64 bits as the unsigned constant `c`."""
    c &= _MASK64
    return c - _U64 if c >= 1 << 63 else c


# splitmix64 constants (Steele, Lea & Flood; finalizer "Mix13" by Stafford).
_GAMMA = _i64(0x9E3779B97F4A7C15)
_MIX_M1 = _i64(0xBF58476D1CE4E5B9)
_MIX_M2 = _i64(0x94D049BB133111EB)
# Distinct odd increment for the position counter, so (seed, pos) and (seed', pos') streams decorrelate.
_POS_GAMMA = _i64(0xD1B54A32D192ED03)
_UNIFORM_BITS = 23  # u = (m + 0.5) * 2**-23 is exact in float32 and lies strictly inside (0, 1)


# ---------------------------------------------------------------------------------------------------
# Counter-based random numbers
# ---------------------------------------------------------------------------------------------------


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 `x` read as uint64 (torch's >> is arithmetic: clear the sign fill)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64 finalizer on int64 tensors.

    Invariant relied on: torch's int64 add/mul wrap modulo 2**64 (two's complement) on CPU and CUDA,
    so these ops equal the uint64 reference bit for bit (checked against pure Python in the tests)."""
    z = (z ^ _shr(z, 30)) * _MIX_M1
    z = (z ^ _shr(z, 27)) * _MIX_M2
    return z ^ _shr(z, 31)


def vocab_counters(vocab_size: int, device: torch.device) -> Tensor:
    """[V] i64: (i + 1) * gamma mod 2**64, the splitmix64 counter of vocab index i.

    Kept as a tensor input (not an arange inside a compiled graph: Inductor folds that into 32-bit
    index arithmetic, which cannot hold the 64-bit gamma)."""
    return torch.arange(1, vocab_size + 1, device=device, dtype=torch.int64) * _GAMMA


def random_bits(seeds: Tensor, positions: Tensor, counters: Tensor) -> Tensor:
    """64 hashed bits per (row, vocab index): [N] i64, [N] i64, [V] i64 (vocab_counters) -> [N, V] i64.

    Element (r, i) depends only on (seeds[r], positions[r], i)."""
    key = _mix64(_mix64(seeds + _GAMMA) + (positions + 1) * _POS_GAMMA)  # [N] one stream key per row
    return _mix64(key[:, None] + counters[None, :])  # [N, V]: splitmix64 stream of the key


def gumbel_noise(seeds: Tensor, positions: Tensor, counters: Tensor) -> Tensor:
    """-log(E), E ~ Exp(1), per (row, vocab index): [N] i64, [N] i64, [V] i64 -> [N, V] f32, finite.

    argmax(x + gumbel) == argmax(softmax(x) / E): the exponential race in log space."""
    m = _shr(random_bits(seeds, positions, counters), 64 - _UNIFORM_BITS)  # [N, V] in [0, 2**23)
    u = (m.to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)  # [N, V] in [2**-24, 1 - 2**-24]
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------------------------------------------
# Per-step metadata
# ---------------------------------------------------------------------------------------------------


@dataclass
class SamplingMetadata:
    """Sampling inputs of the N requests that sample a token this step (row r = request r).

    All tensors live on the logits' device. Padded id tensors use `vocab_size` as the pad id.
    The host-side flags let `Sampler` skip unused work without reading device memory."""

    # The per-row numbers in two tensors (one host-to-device copy each; the properties below are their rows):
    # [6, N] f32: temperature (rows with is_greedy hold 1.0, never divided by ~0), top_p in (0, 1] (1 = off),
    # min_p in [0, 1] (0 = off), repetition_penalty > 0 (1 = off), presence_penalty, frequency_penalty;
    # [3, N] i64: top_k in [1, V] (V = off), seeds (the 64 seed bits, two's complement), positions (index of the
    # token being sampled within the request's output).
    rows_f32: Tensor
    rows_i64: Tensor
    is_greedy: Tensor  # [N] bool: temperature < GREEDY_TEMPERATURE_EPS
    prompt_ids: Tensor  # [N, Lp] i64, pad = V; Lp = 0 when no row has a repetition penalty
    output_ids: Tensor  # [N, Lo] i64, pad = V; Lo = 0 when no row has any penalty
    banned_ids: Tensor  # [N, Lb] i64, pad = V: ids a row must not sample now (min_tokens)
    vocab_size: int
    max_num_logprobs: int | None  # max requested top-n over rows; None: no row wants logprobs
    max_top_k: int  # max of top_k over rows (host copy, sizes torch.topk)
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_repetition_penalty: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_banned: bool
    # Structured outputs: row bitmask_rows[m] may sample only the tokens set in bitmask[m] (None: no row is
    # constrained). [M] i64 and [M, ceil(V/32)] int32 (worker/structured/bitmask.py).
    bitmask_rows: Tensor | None = None
    bitmask: Tensor | None = None
    # Every row's temperature (rows_f32[0]) is exactly 1.0: dividing by it would change no bit, so it is skipped.
    unit_temperature: bool = False

    @property
    def num_rows(self) -> int:
        return int(self.rows_f32.shape[1])

    @property
    def temperature(self) -> Tensor:
        return self.rows_f32[0]

    @property
    def top_p(self) -> Tensor:
        return self.rows_f32[1]

    @property
    def min_p(self) -> Tensor:
        return self.rows_f32[2]

    @property
    def repetition_penalty(self) -> Tensor:
        return self.rows_f32[3]

    @property
    def presence_penalty(self) -> Tensor:
        return self.rows_f32[4]

    @property
    def frequency_penalty(self) -> Tensor:
        return self.rows_f32[5]

    @property
    def top_k(self) -> Tensor:
        return self.rows_i64[0]

    @property
    def seeds(self) -> Tensor:
        return self.rows_i64[1]

    @property
    def positions(self) -> Tensor:
        return self.rows_i64[2]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
        bitmask: tuple[Sequence[int], Tensor] | None = None,
    ) -> SamplingMetadata:
        """Gather the per-request inputs; `seeds` are resolved by the engine, positions = len(output).
        `bitmask`: (rows, [M, ceil(V/32)] int32 masks) of the constrained rows."""
        n = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(seeds) == n):
            raise ValueError("params, prompt_ids, output_ids and seeds must have one entry per row")
        host = HostSampling.build(params, seeds, [len(o) for o in output_ids], eos_token_ids, vocab_size,
                                  lambda: prompt_ids, lambda: output_ids, bitmask)
        return host.metadata({k: _to_tensor(a, device) for k, a in host.arrays.items()}, device)


def _to_tensor(a: np.ndarray | Tensor, device: torch.device) -> Tensor:
    t = from_numpy(a) if isinstance(a, np.ndarray) else a
    return t if device.type == "cpu" else t.to(device)


# Bits of _Row.uses: what a row needs of the sampler beyond argmax / the plain race.
_REP, _PEN, _TOP_K, _TOP_P, _MIN_P = 1, 2, 4, 8, 16


class _Row(NamedTuple):
    """What a SamplingParams contributes to a step's metadata, for a vocabulary size."""

    f32: tuple[float, float, float, float, float, float]  # a column of SamplingMetadata.rows_f32
    top_k: int  # in [1, V]
    greedy: bool
    uses: int  # _REP | _PEN (any row) and _TOP_K | _TOP_P | _MIN_P (random rows only)
    min_tokens: int
    logprobs: int | None


def _row(p: SamplingParams, vocab_size: int) -> _Row:
    greedy = p.temperature < GREEDY_TEMPERATURE_EPS
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    uses = (_REP if p.repetition_penalty != 1.0 else 0) | \
        (_PEN if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 else 0)
    if not greedy:
        uses |= (_TOP_K if top_k != vocab_size else 0) | (_TOP_P if p.top_p < 1.0 else 0) | \
            (_MIN_P if p.min_p > 0.0 else 0)
    f32 = (1.0 if greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
           p.frequency_penalty)
    return _Row(f32, top_k, greedy, uses, p.min_tokens, p.logprobs)


class _RowCache:
    """_row of each SamplingParams object, computed once: a request keeps its params object for its whole life,
    and every step of it reads the same row. Keyed by id, checked by identity (params are frozen)."""

    def __init__(self, limit: int = 8192) -> None:
        self._rows: dict[tuple[int, int], tuple[SamplingParams, _Row]] = {}
        self._limit = limit

    def rows(self, params: Sequence[SamplingParams], vocab_size: int) -> list[_Row]:
        cache = self._rows
        out = []
        for p in params:
            hit = cache.get((id(p), vocab_size))
            if hit is None or hit[0] is not p:
                if len(cache) >= self._limit:  # finished requests' params: drop them all, refill from the live ones
                    cache.clear()
                hit = cache[(id(p), vocab_size)] = (p, _row(p, vocab_size))
            out.append(hit[1])
        return out


_ROWS = _RowCache()


@dataclass(slots=True)
class HostSampling:
    """A step's SamplingMetadata before its host-to-device copy: the tensor fields that its rows need, as host
    arrays (`arrays`: rows_f32 and rows_i64 always, is_greedy when greedy and random rows mix, prompt_ids /
    output_ids / banned_ids only when some row uses them, bitmask_rows / bitmask with constrained rows) and the
    host fields (`flags`)."""

    arrays: dict[str, np.ndarray | Tensor]
    flags: dict[str, Any]  # the non-tensor fields of SamplingMetadata
    num_rows: int

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        num_outputs: Sequence[int],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        prompt_ids: Callable[[], Sequence[Sequence[int]]],
        output_ids: Callable[[], Sequence[Sequence[int]]],
        bitmask: tuple[Sequence[int], Tensor] | None = None,
    ) -> HostSampling:
        """SamplingMetadata.build's inputs, with `num_outputs` (the positions) instead of the output ids: those
        (with in-flight outputs as pad id V) and the prompts are asked for only when a row has a penalty."""
        n = len(params)
        rows = _ROWS.rows(params, vocab_size)
        uses = 0
        for r in rows:
            uses |= r.uses
        greedy = [r.greedy for r in rows]
        top_k = [r.top_k for r in rows]
        rows_i64 = np.empty((3, n), dtype=np.int64)
        rows_i64[0] = top_k
        rows_i64[1] = _seed_bits(seeds)
        rows_i64[2] = num_outputs
        arrays: dict[str, np.ndarray | Tensor] = {
            "rows_f32": np.array([r.f32 for r in rows], dtype=np.float32).reshape(n, 6).T,
            "rows_i64": rows_i64,
        }
        all_greedy, any_greedy = all(greedy), any(greedy)
        if any_greedy and not all_greedy:  # else is_greedy is one value, made on the device once (_same_bools)
            arrays["is_greedy"] = np.array(greedy, dtype=np.bool_)
        if uses & _REP:
            arrays["prompt_ids"] = _pad_ids(prompt_ids(), n, vocab_size)
        if uses & (_REP | _PEN):
            arrays["output_ids"] = _pad_ids(output_ids(), n, vocab_size)
        banned = [_banned_ids(p, k, eos_token_ids, vocab_size) if r.min_tokens > k else []
                  for p, r, k in zip(params, rows, num_outputs)] if any(r.min_tokens for r in rows) else []
        if any(banned):
            arrays["banned_ids"] = _pad_ids(banned, n, vocab_size)
        if bitmask is not None:
            arrays["bitmask_rows"] = np.array(bitmask[0], dtype=np.int64)
            arrays["bitmask"] = bitmask[1]
        logprobs = [r.logprobs for r in rows if r.logprobs is not None]
        flags = {
            "vocab_size": vocab_size,
            "max_num_logprobs": max(logprobs) if logprobs else None,
            "max_top_k": max(top_k, default=vocab_size),
            "all_greedy": all_greedy,
            "all_random": not any_greedy,
            "no_penalties": not uses & (_REP | _PEN),
            "no_repetition_penalty": not uses & _REP,
            "no_top_k": not uses & _TOP_K,
            "no_top_p": not uses & _TOP_P,
            "no_min_p": not uses & _MIN_P,
            "no_banned": "banned_ids" not in arrays,
            "unit_temperature": all(r.f32[0] == 1.0 for r in rows),
        }
        return cls(arrays, flags, n)

    def metadata(self, tensors: Mapping[str, Tensor], device: torch.device) -> SamplingMetadata:
        """The SamplingMetadata of `tensors` (`arrays` on the device, by name); id tensors the rows do not use
        are [N, 0]."""
        none = _no_ids(self.num_rows, device)
        is_greedy = tensors.get("is_greedy")
        if is_greedy is None:
            is_greedy = _same_bools(self.num_rows, self.flags["all_greedy"], device)
        return SamplingMetadata(
            rows_f32=tensors["rows_f32"], rows_i64=tensors["rows_i64"], is_greedy=is_greedy,
            prompt_ids=tensors.get("prompt_ids", none), output_ids=tensors.get("output_ids", none),
            banned_ids=tensors.get("banned_ids", none), bitmask_rows=tensors.get("bitmask_rows"),
            bitmask=tensors.get("bitmask"), **self.flags)


def _seed_bits(seeds: Sequence[int]) -> np.ndarray:
    """[N] int64 holding the 64 bits of each seed (two's complement of seed mod 2**64)."""
    try:
        return np.array(seeds, dtype=np.uint64).view(np.int64)
    except OverflowError:  # negative or wider than 64 bits
        return np.array([_i64(s) for s in seeds], dtype=np.int64)


@functools.lru_cache(maxsize=1024)
def _no_ids(n: int, device: torch.device) -> Tensor:
    """[n, 0] i64 on `device`: shared by every step (an empty tensor has no data anything could write)."""
    return torch.empty((n, 0), dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=1024)
def _same_bools(n: int, value: bool, device: torch.device) -> Tensor:
    """[n] bool, all `value`, on `device`: shared by every step (nothing writes is_greedy)."""
    return torch.full((n,), value, dtype=torch.bool, device=device)


def _banned_ids(p: SamplingParams, num_output: int, eos: Sequence[int], vocab_size: int) -> list[int]:
    """Ids a request may not sample yet: its stop ids (and EOS unless ignore_eos) before min_tokens."""
    if num_output >= p.min_tokens:
        return []
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
    return sorted(i for i in ids if 0 <= i < vocab_size)  # out-of-vocab ids can never be sampled anyway


def _pad_ids(rows: Sequence[Sequence[int]], n: int, vocab_size: int) -> np.ndarray:
    """[n, L] i64 of the rows right-padded with vocab_size."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((n, width), vocab_size, dtype=np.int64)
    for r, ids in enumerate(rows):
        if ids:
            out[r, : len(ids)] = ids
    return out


# ---------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------


class SamplerOutput(NamedTuple):
    sampled_token_ids: Tensor  # [N] i64, always in [0, V)
    # [N, k+1]: column 0 the sampled token, then the top-k by logprob (k = max_num_logprobs); else None.
    logprobs_token_ids: Tensor | None
    logprobs: Tensor | None  # [N, k+1] f32, log_softmax of the raw logits at logprobs_token_ids


# (scaled logits [N, V], min_p [N], seeds [N], positions [N], counters [V]) -> token ids [N]
RaceFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class Sampler:
    """Call with [N, V] logits and the step's metadata. Never modifies `logits`.

    `use_compile`: fuse the min-p filter and the exponential race with torch.compile (several times faster
    on CUDA; integer hashing makes it bit-identical to eager). None = only for CUDA logits. If compiling
    fails, the sampler logs it and stays eager."""

    def __init__(self, use_compile: bool | None = None) -> None:
        self._compile = use_compile
        self._compiled: RaceFn | None = None
        self._counters: dict[tuple[torch.device, int], Tensor] = {}  # vocab_counters per device, V

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.shape != (meta.num_rows, meta.vocab_size):  # pad id V must be out of range
            raise ValueError(f"logits {tuple(logits.shape)} != [N={meta.num_rows}, V={meta.vocab_size}]")
        raw = logits if logits.dtype == torch.float32 else logits.float()  # [N, V]
        x = raw if meta.no_penalties else apply_penalties(raw, meta)
        if not meta.no_banned:
            x = x.masked_fill(_id_mask(meta.banned_ids, x.shape[1]), _NEG_INF)
        if meta.bitmask is not None:
            assert meta.bitmask_rows is not None
            x = apply_token_bitmask(x, meta.bitmask_rows, meta.bitmask)
        sampled = self._sample(x, meta)
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None)
        ids, lps = gather_logprobs(raw, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps)

    def _sample(self, x: Tensor, meta: SamplingMetadata) -> Tensor:
        """[N, V] penalised logits -> [N] i64 token ids."""
        if meta.all_greedy:  # also the empty batch
            return greedy_argmax(x)
        x_scaled = apply_top_k_top_p(x if meta.unit_temperature else x / meta.temperature[:, None], meta)
        random = self._race(x_scaled, meta.min_p, meta.seeds, meta.positions, meta.no_min_p)
        return random if meta.all_random else torch.where(meta.is_greedy, greedy_argmax(x), random)

    def _uses_compile(self, device: torch.device) -> bool:
        return self._compile is True or (self._compile is None and device.type == "cuda")

    def _race(self, x: Tensor, min_p: Tensor, seeds: Tensor, positions: Tensor, no_min_p: bool) -> Tensor:
        """Min-p, then the exponential race, compiled when enabled: [N, V] scaled logits -> [N] i64."""
        key = (x.device, x.shape[1])
        if key not in self._counters:
            self._counters[key] = vocab_counters(x.shape[1], x.device)
        counters = self._counters[key]
        if not self._uses_compile(x.device):
            return min_p_race(x, min_p, seeds, positions, counters, no_min_p)
        if self._compiled is None:
            self._compiled = torch.compile(min_p_race, dynamic=True)
        try:
            return self._compiled(x, min_p, seeds, positions, counters)
        except Exception:  # a compiler failure must not fail the step: eager gives the same tokens
            log.exception("torch.compile of the sampler failed; sampling eagerly from now on")
            self._compile = False
            return self._race(x, min_p, seeds, positions, no_min_p)

    def warm_up(self, vocab_size: int, device: torch.device) -> None:
        """Compile the race now (engine start-up) for one row and for several (torch specialises
        size 1), so that no request's first sampled token waits for the compiler."""
        if not self._uses_compile(device):
            return
        for n in (1, 2):
            x = torch.zeros((n, vocab_size), dtype=torch.float32, device=device)
            zeros = torch.zeros(n, dtype=torch.int64, device=device)
            self._race(x, torch.zeros(n, device=device), zeros, zeros, False)


def _id_mask(ids: Tensor, vocab_size: int) -> Tensor:
    """[N, L] i64 ids (pad = V) -> [N, V] bool, True where the id occurs in the row."""
    mask = torch.zeros((ids.shape[0], vocab_size + 1), dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def _id_counts(ids: Tensor, vocab_size: int) -> Tensor:
    """[N, L] i64 ids (pad = V) -> [N, V] f32 occurrence counts."""
    counts = torch.zeros((ids.shape[0], vocab_size + 1), dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
    return counts[:, :vocab_size]


def apply_penalties(x: Tensor, meta: SamplingMetadata) -> Tensor:
    """Repetition (HF), then frequency and presence (OpenAI) penalties: [N, V] -> new [N, V]."""
    v = x.shape[1]
    counts = _id_counts(meta.output_ids, v)  # [N, V]
    if not meta.no_repetition_penalty:
        seen = _id_mask(meta.prompt_ids, v) | (counts > 0)  # [N, V]
        rp = meta.repetition_penalty[:, None]  # [N, 1]
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    x = x - meta.frequency_penalty[:, None] * counts
    return x - meta.presence_penalty[:, None] * (counts > 0).to(x.dtype)


_ARGMAX_CHUNK = 1024


def greedy_argmax(x: Tensor, two_stage: bool | None = None) -> Tensor:
    """x.argmax(-1) of [N, V] -> [N] i64 (first index of the maximum), in two stages for a large
    vocabulary on CUDA: torch reduces a whole row in one thread block, while [N, V/C, C] chunk maxima then a
    max over chunks spread the row over many blocks (C about _ARGMAX_CHUNK: a larger C makes too few chunks to
    fill the GPU; a divisor of V when one is close, so that no padded copy of x is made). H200 figures:
    benchmarks/results/h200/NOTES.md, "Figures behind the code's rules"."""
    n, v = x.shape
    if two_stage is None:
        two_stage = x.is_cuda and v >= 32 * _ARGMAX_CHUNK
    if not two_stage or n == 0:
        return x.argmax(dim=-1)
    size = _argmax_chunk(v)
    chunks = -(-v // size)
    if chunks * size != v:
        x = torch.nn.functional.pad(x, (0, chunks * size - v), value=float("-inf"))
    best, where = x.view(n, chunks, size).max(dim=-1)  # [N, chunks] each
    chunk = best.argmax(dim=-1, keepdim=True)  # first chunk holding the row maximum
    return torch.add(where.gather(1, chunk), chunk, alpha=size).squeeze(1)  # [N, 1] -> [N]


@functools.lru_cache(maxsize=64)
def _argmax_chunk(v: int) -> int:
    """The chunk size of greedy_argmax for vocabulary size v: its largest divisor in [C/2, C] (C = _ARGMAX_CHUNK;
    Llama 3's 128256 = 128 x 1002), else C with the last chunk padded."""
    return next((c for c in range(_ARGMAX_CHUNK, _ARGMAX_CHUNK // 2 - 1, -1) if v % c == 0), _ARGMAX_CHUNK)


def min_p_race(
    x: Tensor, min_p: Tensor, seeds: Tensor, positions: Tensor, counters: Tensor, skip_min_p: bool = False
) -> Tensor:
    """Min-p filter, then argmax(softmax(x) / E): [N, V] scaled logits, [N] x3, [V] -> [N] i64.

    min_p = 0 masks nothing, so skipping the filter for such rows changes no token."""
    if not skip_min_p:
        x = apply_min_p(x, min_p)
    noise = gumbel_noise(seeds, positions, counters)  # [N, V] finite
    # Excluded tokens stay -inf; the row max is never excluded, so the argmax is a kept token.
    return (x + noise).argmax(dim=-1)


def apply_top_k_top_p(x: Tensor, meta: SamplingMetadata) -> Tensor:
    """Mask (to -inf) tokens outside top-k, then outside top-p of the renormalised remainder.

    Both filters are logit thresholds: a token is kept iff its logit >= the threshold of its row (ties
    with the last kept token are kept too). The row's top token is always kept."""
    if meta.no_top_p:
        if meta.no_top_k:
            return x
        vals = torch.topk(x, meta.max_top_k, dim=-1).values  # [N, K] descending
        kth = vals.gather(1, (meta.top_k.clamp(1, meta.max_top_k) - 1)[:, None])  # [N, 1]
        return x.masked_fill(x < kth, _NEG_INF)
    v = x.shape[1]
    sorted_x = torch.sort(x, dim=-1, descending=True).values  # [N, V]
    rank = torch.arange(v, device=x.device)[None, :]  # [1, V]
    k = meta.top_k[:, None]  # [N, 1] in [1, V]
    sorted_x = sorted_x.masked_fill(rank >= k, _NEG_INF)
    probs = sorted_x.softmax(dim=-1)  # [N, V] renormalised over the top-k
    cum = probs.cumsum(dim=-1)  # [N, V] float cumsum of non-negatives: monotone
    mass_before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # [N, V] mass of strictly higher ranks
    # Keep the smallest prefix whose mass reaches top_p: ranks whose preceding mass is < top_p.
    # cumsum is monotone, so this is a prefix; it always holds rank 0 (mass 0 < top_p).
    keep = (mass_before < meta.top_p[:, None]) | (meta.top_p[:, None] >= 1.0)
    count = torch.minimum(keep.sum(dim=-1, keepdim=True), k).clamp(min=1)  # [N, 1]
    threshold = sorted_x.gather(1, count - 1)  # [N, 1] logit of the last kept rank
    return x.masked_fill(x < threshold, _NEG_INF)


def apply_min_p(x: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose probability is < min_p * (max probability): [N, V], [N] -> [N, V]."""
    row_max = x.amax(dim=-1, keepdim=True)  # [N, 1]; p_i / p_max = exp(x_i - max)
    return x.masked_fill(torch.exp(x - row_max) < min_p[:, None], _NEG_INF)


def gather_logprobs(raw: Tensor, sampled: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """[N, V] raw logits, [N] sampled ids -> ids [N, k+1] i64 and logprobs [N, k+1] f32.

    Column 0 is the sampled token, columns 1..k the top-k tokens by logprob, descending."""
    lp = torch.log_softmax(raw, dim=-1)  # [N, V]
    ids = sampled[:, None]  # [N, 1]
    if k > 0:
        top = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
        ids = torch.cat([ids, top.indices], dim=1)
    return ids, lp.gather(1, ids)

