"""Tensor parallelism (worker/parallel/): TP = 2 over gloo on the CPU against TP = 1 (greedy tokens equal,
logits close), the shards of every weight format against the whole layer, refusals of what cannot split,
and TP = 1 building nothing of it. The TP = 2 engines start a second process on 127.0.0.1 that exits with
the engine (close) or with this process (PR_SET_PDEATHSIG).

fp32 sums run in another order at TP = 2 (each rank's partial products, then the all-reduce), so logits
differ from TP = 1 by rounding (~1e-6 here); greedy tokens are compared exactly, on models whose weights
(normal 0.15) keep the top-2 logit gap far above that.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_hf import save_tiny_model

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.worker.engine import LLMEngine
from tokenmill.worker.loader import ModelLoadError, resolve_model
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.models.layers import Linear
from tokenmill.worker.parallel.follower import config_from_dict
from tokenmill.worker.parallel.group import RankSpec, TPGroup
from tokenmill.worker.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    check_row_split,
)
from tokenmill.worker.parallel.runner import check_tensor_parallel
from tokenmill.worker.quant.base import LinearMethod
from tokenmill.worker.quant.fp8 import Fp8LinearMethod
from tokenmill.worker.quant.int4 import Int4LinearMethod
from tokenmill.worker.quant.int8 import Int8LinearMethod
from tokenmill.worker.quant.unquantized import UnquantizedLinearMethod

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, logprobs=2)
HF_ARCHS = ["llama", "llama3-rope", "mistral-swa", "qwen2-bias", "qwen3-qknorm"]  # 2 KV heads each


@contextmanager
def engine(model: str, tp: int, **kw: Any) -> Iterator[LLMEngine]:
    """An engine that is closed (its other ranks stopped, the process group left) whatever the test does."""
    e = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", tensor_parallel_size=tp, **kw))
    try:
        yield e
    finally:
        e.close()


def prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 40, 70)]


def run_both(model: str, tp: int, ps: list[list[int]], **kw: Any) -> tuple[list[list[int]], list[Any], Any]:
    """Greedy tokens (a batch with chunked prefill), seeded samples with logprobs, and all-token logits of
    the first long prompt."""
    with engine(model, tp, scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8), **kw) as e:
        greedy = [o.token_ids for o in e.generate(ps, GREEDY)]
        seeded = [(o.token_ids, o.logprobs) for o in e.generate(ps[:3], SEEDED)]
        logits = all_logits(e, ps[3])
    return greedy, seeded, logits


def all_logits(e: LLMEngine, ids: list[int]) -> torch.Tensor:
    from tokenmill.worker.request import Request
    from tokenmill.worker.scheduler import ScheduledBatch

    req = Request("logits", ids, GREEDY, seed=0, arrival_seq=0)
    assert e.blocks.allocate(req, len(ids))
    batch = ScheduledBatch([req], [len(ids)], [], [])
    try:
        return e.runner.logits_for_all(batch)
    finally:
        e.blocks.free(req)


def assert_same(one: tuple[Any, ...], two: tuple[Any, ...]) -> None:
    greedy1, seeded1, logits1 = one
    greedy2, seeded2, logits2 = two
    torch.testing.assert_close(logits2, logits1, rtol=1e-4, atol=1e-4)
    assert greedy2 == greedy1
    for (ids1, lp1), (ids2, lp2) in zip(seeded1, seeded2, strict=True):
        assert ids2 == ids1  # the sampler runs on rank 0 alone, on the gathered logits
        for a, b in zip(lp1, lp2, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_tp2_matches_tp1_on_tiny_hf_models(arch: str, tmp_path: Path) -> None:
    path = str(save_tiny_model(arch, tmp_path))
    ps = prompts(384, seed=len(arch))
    assert_same(run_both(path, 1, ps), run_both(path, 2, ps))


@pytest.mark.parametrize("extra", [{"quantization": "int8"}, {"async_scheduling": True},
                                   {"speculative": SpeculativeConfig(method="ngram")}],
                         ids=["int8", "async", "ngram"])
def test_tp2_matches_tp1_dummy_tied(extra: dict[str, Any]) -> None:
    """tiny-qwen2 (tied embeddings, qkv bias) with INT8 weights, with tokens in flight (async scheduling: the
    other rank reads them from the sampled ids' broadcast), and with drafts verified (ngram)."""
    ps = prompts(512, seed=3)
    ps[2] = ps[2][:6] * 3  # repeats: prompt lookup finds drafts
    assert_same(run_both("tiny-qwen2", 1, ps, load_format="dummy", **extra),
                run_both("tiny-qwen2", 2, ps, load_format="dummy", **extra))


def test_tp1_builds_no_parallel_layer() -> None:
    with engine("tiny-llama", 1, load_format="dummy") as e:
        assert type(e.runner) is ModelRunner and e.runner.tp is None
        kinds = {type(m) for m in e.runner.model.modules()}
        assert not kinds & {ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead}


def test_tp2_kv_cache_holds_half_the_heads() -> None:
    with engine("tiny-llama", 2, load_format="dummy", cache=_cache(64)) as e:
        k, _ = e.runner.kv_caches[0]
        assert tuple(k.shape) == (64, 16, 1, 16)  # tiny-llama: 2 KV heads of 16, one per rank
        assert e.runner.num_heads == 2 and e.blocks.num_blocks == 64


def _cache(num_blocks: int) -> Any:
    from tokenmill.worker.config import CacheConfig

    return CacheConfig(num_blocks=num_blocks)


# -- refusals (before any other rank starts) ---------------------------------------------------------------


def test_sizes_that_do_not_divide_the_kv_heads_are_refused(tmp_path: Path) -> None:
    path = str(save_tiny_model("smollm2-tied", tmp_path))  # one KV head
    with pytest.raises(ModelLoadError, match=r"--tensor-parallel-size 2 must divide the 1 KV heads.*use 1$"):
        LLMEngine(EngineConfig(model=path, device="cpu", tensor_parallel_size=2))
    with pytest.raises(ModelLoadError, match="must divide the 2 KV heads"):
        LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", tensor_parallel_size=4))


def test_int4_groups_that_a_rank_would_cut_are_refused() -> None:
    # tiny-llama's o_proj has 64 input columns: 32 per rank, not a whole group of 128
    with pytest.raises(ModelLoadError, match=r"int4 groups of 128 columns cannot split .* over 2 ranks"):
        LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", quantization="int4",
                               tensor_parallel_size=2))


def test_more_ranks_than_gpus_is_refused() -> None:
    source = resolve_model("tiny-llama", "dummy")
    config = EngineConfig(model="tiny-llama", load_format="dummy", tensor_parallel_size=2)
    visible = torch.cuda.device_count()
    with pytest.raises(ModelLoadError, match=f"needs 2 GPUs from cuda:{visible - 1 if visible else 0}"):
        check_tensor_parallel(config, source, torch.device("cuda", max(visible - 1, 0)))


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_tensor_parallel_size_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=bad)


def test_config_travels_to_the_other_ranks_as_json() -> None:
    import dataclasses
    import json

    from tokenmill.kernels.config import KernelConfig

    config = EngineConfig(model="m", tensor_parallel_size=2, scheduler=SchedulerConfig(max_num_seqs=3),
                          speculative=SpeculativeConfig(method="ngram"), kernels=KernelConfig(pdl=False))
    assert config_from_dict(EngineConfig, json.loads(json.dumps(dataclasses.asdict(config)))) == config


# -- the shards of each weight format, without processes ----------------------------------------------------

METHODS: dict[str, Any] = {
    "dense": UnquantizedLinearMethod,
    "int8": Int8LinearMethod,
    "int4-g32": lambda: Int4LinearMethod(32),
    "int4-g32-asym": lambda: Int4LinearMethod(32, symmetric=False),
    "fp8-emulated": lambda: Fp8LinearMethod(torch.device("cpu"), emulate=True),
}


class _PartialGroup(TPGroup):
    """A rank whose collectives return its own part: the test combines the ranks' parts itself."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _ranks(size: int) -> list[TPGroup]:
    return [_PartialGroup(RankSpec(r, size), torch.device("cpu")) for r in range(size)]


def _canonical(method: LinearMethod, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    return method.quantize(weight)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_column_shards_concatenate_to_the_whole_layer(name: str) -> None:
    torch.manual_seed(0)
    parts, hidden = [64, 32, 32], 64
    weights = [torch.randn(n, hidden) for n in parts]
    bias = [torch.randn(n) for n in parts]
    whole = Linear(hidden, sum(parts), True, METHODS[name](), dtype=torch.float32)
    shards = [ColumnParallelLinear(g, hidden, parts, True, METHODS[name](), dtype=torch.float32) for g in _ranks(2)]
    starts = [0, 64, 96]
    for w, b, start in zip(weights, bias, starts, strict=True):
        rows = (start, start + w.shape[0])
        for layer in [whole, *shards]:
            for key, t in _canonical(layer.method, w).items():
                layer.load_part(key, t, rows)
            layer.load_part("bias", b, rows)
    x = torch.randn(5, hidden)
    full = whole(x).split(parts, dim=-1)
    outs = [s(x).split([n // 2 for n in parts], dim=-1) for s in shards]
    for i in range(len(parts)):  # part i of the whole = rank 0's part i, then rank 1's
        torch.testing.assert_close(torch.cat([o[i] for o in outs], dim=-1), full[i], rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_row_shards_sum_to_the_whole_layer(name: str) -> None:
    torch.manual_seed(1)
    fan_in, fan_out = 128, 48
    w = torch.randn(fan_out, fan_in)
    whole = Linear(fan_in, fan_out, False, METHODS[name](), dtype=torch.float32)
    shards = [RowParallelLinear(g, fan_in, fan_out, False, METHODS[name](), dtype=torch.float32) for g in _ranks(2)]
    for layer in [whole, *shards]:
        for key, t in _canonical(whole.method, w).items():  # quantized once, whole: the ranks slice it
            layer.load_part(key, t, None)
    x = torch.randn(3, fan_in)
    if name.startswith("fp8"):
        # W8A8 quantizes each token over the columns it reads: per rank, not over the whole row
        quantized = shards[0].method.quantize(w)  # type: ignore[union-attr]
        ref = sum(torch.nn.functional.linear(_fp8_tokens(xs), wq.float() * quantized["scales"])
                  for xs, wq in zip(x.chunk(2, -1), quantized["qweight"].chunk(2, -1), strict=True))
    else:
        ref = whole(x)
    torch.testing.assert_close(sum(s(x.chunk(2, -1)[r]) for r, s in enumerate(shards)), ref,
                               rtol=1e-5, atol=1e-4)


def _fp8_tokens(x: torch.Tensor) -> torch.Tensor:
    from tokenmill.worker.quant.fp8 import quantize_fp8_rows

    q, s = quantize_fp8_rows(x)
    return q.float() * s


def test_row_split_refusals() -> None:
    with pytest.raises(ValueError, match="int4 groups of 64 columns cannot split a projection of 64 input"):
        check_row_split(Int4LinearMethod(64), 64, 32, 2)
    with pytest.raises(ValueError, match="act-order weights cannot be split by input columns"):
        check_row_split(Int4LinearMethod(32, act_order=True), 128, 64, 2)
    with pytest.raises(ValueError, match="with a bias is not supported"):
        RowParallelLinear(_ranks(2)[0], 64, 8, True, None, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"output rows \(33\) evenly"):
        ColumnParallelLinear(_ranks(2)[0], 64, [33], False, None, dtype=torch.float32)


def test_act_order_int4_splits_by_columns() -> None:
    """The permutation is over the input, which column layers keep whole: each rank loads it unchanged."""
    perm = torch.randperm(64).to(torch.int32)
    layer = ColumnParallelLinear(_ranks(2)[1], 64, [16, 16], False, Int4LinearMethod(32, act_order=True),
                                 dtype=torch.float32)
    layer.load_part("perm", perm, (0, 16))
    layer.load_part("perm", perm, (16, 32))
    assert torch.equal(layer.perm, perm)


def test_vocab_shards_with_padding() -> None:
    """Vocabulary 10 over 3 ranks: 4 rows each, the last rank's 2 real rows padded with zeros."""
    torch.manual_seed(2)
    table = torch.randn(10, 8)
    ids = torch.tensor([0, 3, 4, 7, 8, 9])
    hidden = torch.randn(4, 8)
    embeds, heads = [], []
    for g in _ranks(3):
        emb = VocabParallelEmbedding(g, 10, 8, dtype=torch.float32)
        head = VocabParallelHead(g, 10, 8, dtype=torch.float32)
        emb.load_part("weight", table, None)
        head.load_part("weight", table, None)
        embeds.append(emb(ids))
        heads.append(head(hidden))
    torch.testing.assert_close(sum(embeds), table[ids], rtol=0, atol=0)  # one rank has each id, the others 0
    assert heads[2].shape == (4, 4) and torch.equal(heads[2][:, 2:], torch.zeros(4, 2))
    torch.testing.assert_close(torch.cat(heads, -1)[:, :10], hidden @ table.T)


# -- GPUs ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs 2 GPUs")
@pytest.mark.parametrize("arch", ["llama", "mistral-swa", "qwen2-bias", "qwen3-qknorm"])
def test_gpu_tp2_matches_tp1_greedy(arch: str, tmp_path: Path) -> None:
    """NCCL, Triton kernels, decode and piecewise CUDA graphs (collectives captured inside), float32."""
    path = str(save_tiny_model(arch, tmp_path))
    ps = prompts(384, seed=5)
    out = {}
    for tp in (1, 2):
        # a fixed small cache: no profiling, and room for the next engine while this one is collected
        e = LLMEngine(EngineConfig(model=path, dtype="float32", device="cuda", tensor_parallel_size=tp,
                                   cache=_cache(256), scheduler=SchedulerConfig(max_num_seqs=8)))
        try:
            out[tp] = [o.token_ids for o in e.generate(ps, GREEDY)]
        finally:
            e.close()
            del e
    assert out[2] == out[1]


# -- behind the broker -------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_tp2_worker_behind_the_broker_is_one_worker_and_its_rank_dies_with_it(tmp_path: Path) -> None:
    import signal

    from helpers_net import free_port, procs_ctx, reference_greedy, wait_until, wait_workers

    from tokenmill.client import Client

    texts = [f"tensor parallel prompt {i}" for i in range(6)]
    expected = reference_greedy(texts, 8)
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back)
        worker = ps.worker(back, "--tensor-parallel-size", "2", name="tp-worker")
        with Client(f"tcp://127.0.0.1:{front}") as c:
            stats = wait_workers(c, 1, timeout=180)
            assert [w["name"] for w in stats["workers"]] == ["tp-worker"]
            handles = [c.submit(t, max_tokens=8, temperature=0.0, ignore_eos=True) for t in texts]
            got = [(h.result(timeout=120).token_ids, h.result().text) for h in handles]
        assert got == expected
        rank1 = wait_until(lambda: [p for p in _children(worker.pid) if _alive(p)], 30, what="rank 1")
        worker.send_signal(signal.SIGKILL)  # rank 0 alone: rank 1 must follow it by itself
        wait_until(lambda: not any(_alive(p) for p in rank1), 30, what="rank 1 to exit with rank 0")


def test_eagle_drafts_are_refused_with_tensor_parallelism() -> None:
    from tokenmill.worker.config import EngineConfig, SpeculativeConfig

    with pytest.raises(ValueError, match="speculative eagle does not run with --tensor-parallel-size"):
        EngineConfig(tensor_parallel_size=2, speculative=SpeculativeConfig(method="eagle"))
