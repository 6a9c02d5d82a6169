"""The parts of disaggregated prefill and decode without processes: the block manager's chain import keeps
its invariants, the KV message decodes strictly, and KV exported from one engine and imported into another
gives the second engine the prefix hit and the greedy output of one engine computing everything."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from tokenmill.protocol.errors import ProtocolError
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.block_manager import BlockManager, extend_block_hashes, prefix_hashes
from tokenmill.worker.config import CacheConfig, EngineConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.kv_transfer.blocks import as_buffer, from_buffer
from tokenmill.worker.kv_transfer.frames import MAGIC, Geometry, KVHeader, check_payload, decode_header, encode_kv
from tokenmill.worker.request import Request

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engine(**cache: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu",
                                  cache=CacheConfig(**cache) if cache else CacheConfig()))


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    torch.set_num_threads(1)
    return _engine(), _engine(), _engine()


# ---- the block manager -----------------------------------------------------------------------------


def test_import_chain_keeps_cached_blocks_and_invariants() -> None:
    bm = BlockManager(8, 4)
    tokens = list(range(20))  # 5 full blocks
    hashes = prefix_hashes(tokens, 4)
    assert len(hashes) == 5
    owner = Request("r", tokens[:9], SamplingParams(), 0, 0)  # holds the first two blocks, hashed
    extend_block_hashes(owner, 4)
    assert bm.allocate(owner, 9)
    owner.num_computed_tokens = 9
    bm.cache_computed_blocks(owner)
    fresh = bm.import_chain(hashes)
    assert [i for i, _ in fresh] == [2, 3, 4]  # the first two were there already
    assert bm.cached_chain(hashes) == owner.block_ids[:2] + [b for _, b in fresh]
    bm.check_integrity([owner])
    assert bm.num_in_use == 3  # the owner's three; the imported ones are cached (evictable)
    bm.free(owner)
    bm.check_integrity()
    assert bm.num_cached == 5


def test_import_chain_stops_when_the_cache_is_full() -> None:
    bm = BlockManager(3, 4)
    hog = Request("hog", list(range(100, 108)), SamplingParams(), 0, 0)
    assert bm.allocate(hog, 8)  # 2 of the 3 blocks in use
    fresh = bm.import_chain(prefix_hashes(list(range(16)), 4))
    assert len(fresh) == 1 and len(bm.cached_chain(prefix_hashes(list(range(16)), 4))) == 1
    bm.check_integrity([hog])


# ---- the KV message --------------------------------------------------------------------------------

GEO = Geometry(2, 1, 4, 4, "float32")


def test_kv_message_round_trip_and_payload_check() -> None:
    kv = torch.arange(GEO.payload_bytes(2) // 4, dtype=torch.float32).view(*GEO.payload_shape(2))
    header = KVHeader("job-1", 3, list(range(8)), GEO)
    frames = encode_kv(header, as_buffer(kv))
    got = decode_header(frames[:2])
    assert got == header and got.blocks == 2 and got.request_id == "job-1#3"
    assert check_payload(got, len(frames[2]), GEO) is None
    assert torch.equal(from_buffer(frames[2], GEO.payload_shape(2), "float32"), kv)
    assert "differs" in (check_payload(got, len(frames[2]), Geometry(2, 2, 4, 4, "float32")) or "")
    assert "payload" in (check_payload(got, len(frames[2]) - 4, GEO) or "")


def _header(**over: object) -> list[bytes]:
    d = {"job_id": "j", "attempt": 0, "token_ids": [1, 2, 3, 4], "layers": 2, "kv_heads": 1, "head_dim": 4,
         "block_size": 4, "dtype": "float32", **over}
    return [MAGIC, msgpack.packb(d)]


@pytest.mark.parametrize("frames", [
    [b"TMKV0", _header()[1]], [MAGIC, b"\xc1"], [MAGIC, msgpack.packb([1, 2])], _header(extra=1),
    _header(token_ids=[1, 2, 3]), _header(token_ids=[-1, 2, 3, 4]), _header(dtype="object"), _header(layers=0),
    _header(job_id=""), _header(attempt=True), [MAGIC],
], ids=lambda f: repr(f)[:40])
def test_malformed_kv_headers_are_refused(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_header(frames)


# ---- engine to engine ---------------------------------------------------------------------------------


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    return [shared[: rng.randrange(10, 40)] + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 60))]
            for _ in range(n)]


def test_exported_kv_gives_the_decode_engine_a_prefix_hit_and_identical_output(
        engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    ref, prefill, decode = engines
    prompts = _prompts(8, seed=1)
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    got = []
    for prompt in prompts:
        prefill.generate([prompt], one)  # the prompt's KV is in the prefill engine's prefix cache now
        exported = prefill.export_prefix_kv(prompt)
        if len(prompt) <= 16:  # no full block before the last token: nothing to hand over
            assert exported is None
        else:
            assert exported is not None
            ids, kv = exported
            assert len(ids) == (len(prompt) - 1) // 16 * 16 and ids == prompt[: len(ids)]
            assert decode.import_prefix_kv(ids, kv) == len(ids) // 16
            decode.blocks.check_integrity()
        hits = decode.counters.prefix_cache_hits
        out = decode.generate([prompt], GREEDY)[0]
        assert decode.counters.prefix_cache_hits - hits >= (len(prompt) - 1) // 16
        assert out.usage is not None and out.usage.cached_tokens >= (len(prompt) - 1) // 16 * 16
        got.append(out.token_ids)
    assert got == expected


def test_imported_kv_under_other_tokens_is_never_used(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    """Blocks are content-addressed: KV filed under P's token ids is found only by the same tokens."""
    ref, prefill, decode = engines
    prompt = _prompts(1, seed=7)[0] + list(range(5, 45))
    prefill.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    exported = prefill.export_prefix_kv(prompt)
    assert exported is not None
    ids, kv = exported
    garbage = torch.randn_like(kv) * 50  # under P's ids, but not the KV of any other prompt
    other = [t + 1 for t in ids]
    decode.import_prefix_kv(other, garbage)
    hits = decode.counters.prefix_cache_hits
    out = decode.generate([prompt], GREEDY)[0]
    assert decode.counters.prefix_cache_hits == hits  # nothing of the garbage was found
    expected = ref.generate([prompt], GREEDY)[0].token_ids
    assert out.token_ids == expected
    # The same garbage under the prompt's own tokens is used (the decode side reads imported KV, it does not
    # recompute): the output changes.
    fresh = _engine()
    assert fresh.import_prefix_kv(ids, garbage) == len(ids) // 16
    assert fresh.generate([prompt], GREEDY)[0].token_ids != expected
