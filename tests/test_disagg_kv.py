"""The parts of disaggregated prefill and decode without processes: the block manager's chain import keeps
its invariants, the KV message decodes strictly, and KV exported from one engine and imported into another
gives the second engine the prefix hit and the greedy output of one engine computing everything."""

from __future__ import annotations

import queue
import random
import time

import msgpack
import pytest
import structlog
import torch
import zmq

from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.block_manager import BlockManager, extend_block_hashes, prefix_hashes
from tokenmill.worker.config import CacheConfig, EngineConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.kv_transfer.blocks import as_buffer, from_buffer
from tokenmill.worker.kv_transfer.channel import KVArrival, KVSender
from tokenmill.worker.kv_transfer.frames import MAGIC, Geometry, KVHeader, check_payload, decode_header, encode_kv
from tokenmill.worker.kv_transfer.roles import KVRoles
from tokenmill.worker.request import Request


@pytest.fixture(autouse=True)
def _fresh_logging() -> None:
    """structlog as it is by default: an earlier in-process CLI test may have pointed it at a stream that is
    closed now (cli/serve.py configure_logging), and these tests log from this process."""
    structlog.reset_defaults()


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


# ---- the engine loop's part (roles.py) and the channel, on 127.0.0.1 -----------------------------------


def _job(job_id: str, prompt: list[int], **kw: object) -> p.WorkerSubmit:
    return p.WorkerSubmit(job_id, 0, p.RequestInput(prompt_token_ids=prompt), {"max_tokens": 4},
                          **kw)  # type: ignore[arg-type]


def test_decode_role_waits_imports_and_falls_back(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    _, prefill, decode = engines
    ctx = zmq.Context()
    arrivals: queue.Queue[KVArrival] = queue.Queue()
    roles = KVRoles(decode, "decode", lambda m: None, ctx, arrivals.put, "tcp://127.0.0.1:*", kv_timeout=0.3)
    sender = KVSender(ctx)
    try:
        assert roles.address.startswith("tcp://127.0.0.1:")
        prompt = list(range(40, 90))
        prefill.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        exported = prefill.export_prefix_kv(prompt)
        assert exported is not None
        ids, kv = exported
        geo = roles.geometry
        assert geo is not None and geo == prefill.kv_geometry()
        # KV that comes first is imported; its job then starts at once.
        assert sender.send(roles.address, encode_kv(KVHeader("early", 0, ids, geo), as_buffer(kv)))
        a = arrivals.get(timeout=10)
        assert a.header.request_id == "early#0" and roles.arrived(a) is None
        assert decode.blocks.cached_chain(prefix_hashes(ids, 16)) != []
        assert not roles.park(_job("early", prompt, kv_wait=True))
        # A job waits for its KV; unusable KV (another geometry) releases it at once, as KV_LOST does.
        assert roles.park(_job("bad", prompt, kv_wait=True)) and roles.waiting
        other = Geometry(geo.layers, geo.kv_heads, geo.head_dim, 32, geo.dtype)
        one = as_buffer(kv[:, :, :1].contiguous())
        assert sender.send(roles.address, encode_kv(KVHeader("bad", 0, ids[:32], other), one))
        released = roles.arrived(arrivals.get(timeout=10))
        assert released is not None and released.job_id == "bad" and not released.kv_wait
        assert roles.counts["kv_unusable"] == 1
        assert roles.park(_job("lost", prompt, kv_wait=True))
        got = roles.lost(p.KvLost("lost", 0))
        assert got is not None and got.job_id == "lost" and roles.lost(p.KvLost("lost", 0)) is None
        # No KV within kv_timeout: the job starts and computes its prompt.
        assert roles.park(_job("late", prompt, kv_wait=True))
        assert roles.due(time.monotonic()) == []
        late = roles.due(time.monotonic() + 0.31)
        assert [j.job_id for j in late] == ["late"] and not late[0].kv_wait and roles.counts["kv_timeouts"] == 1
        roles.check()
    finally:
        sender.close()
        roles.close()
        ctx.term()


def test_prefill_role_turns_errors_into_prefilled_zero(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    _, prefill, _ = engines
    pushed: list[p.Message] = []
    ctx = zmq.Context()
    roles = KVRoles(prefill, "prefill", pushed.append, ctx, lambda a: None, "", kv_timeout=1.0)
    try:
        msg = _job("j", [5, 6, 7], kv_send="tcp://127.0.0.1:1", resume_token_ids=[9, 9])
        params = roles.prefill_params("j#0", msg, SamplingParams(max_tokens=50, min_tokens=20, stop=["x"]))
        assert (params.max_tokens, params.min_tokens, params.stop) == (3, 0, ())
        assert roles.converted(p.JobError("j", 0, "invalid", "bad")) == p.Prefilled("j", 0, 0)
        assert roles.converted(p.JobError("j", 0, "invalid", "bad")) == p.JobError("j", 0, "invalid", "bad")
    finally:
        roles.close()
        ctx.term()


def test_block_moves_keep_the_values_of_fp8_caches() -> None:
    """gather_blocks / scatter_blocks move fp8 blocks (scattered as bytes: no float8 index_copy_ on the CPU) in the
    logical [slots, Hkv, D] order whatever a cache's memory layout (here V dim-major inside each block)."""
    from tokenmill.kernels.kv_cache import FP8_KV, new_kv_cache
    from tokenmill.worker.kv_transfer.blocks import gather_blocks, scatter_blocks

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        k = new_kv_cache(6, 4, 2, 8, FP8_KV, "cpu")[0]
        return k, torch.zeros((6, 2, 8, 4), dtype=FP8_KV).permute(0, 3, 1, 2)

    src = [caches() for _ in range(2)]
    assert src[0][1].stride(1) == 1 and src[0][0].stride(3) == 1
    for k, v in src:
        k.copy_(torch.randn(k.shape).mul(10).to(FP8_KV))
        v.copy_(torch.randn(v.shape).mul(10).to(FP8_KV))
    moved = gather_blocks(src, [4, 1])
    assert moved.is_contiguous() and tuple(moved.shape) == (2, 2, 2, 4, 2, 8)
    dst = [caches() for _ in range(2)]
    scatter_blocks(dst, [0, 5], moved)
    for (ks, vs), (kd, vd) in zip(src, dst):
        for a, b in ((4, 0), (1, 5)):
            assert torch.equal(ks[a].view(torch.uint8), kd[b].view(torch.uint8))
            assert torch.equal(vs[a].view(torch.uint8), vd[b].view(torch.uint8))
        assert not vd[1:5].view(torch.uint8).any()
