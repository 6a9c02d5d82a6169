"""Rank 0 of a tensor-parallel worker: the engine's ModelRunner, plus the other ranks it starts and feeds.

Rank 0 is the worker process: it owns the scheduler, the block manager, the sampler and the socket, exactly
as a one-device worker does (the broker sees one worker). It starts ranks 1..N-1 as child processes
(worker/parallel/follower.py), which build their shards of the same model and KV cache; every step it sends
them the step's inputs (worker/parallel/step_sync.py) before it launches its own forward, and after
sampling it broadcasts the sampled ids (the next step's tokens in flight are read from them on every rank).
The collectives of a step are therefore issued in the same order on every rank: the forward's all-reduces,
the logits' all-gather, the sampled ids' broadcast.

`make_model_runner` returns the plain ModelRunner for tensor_parallel_size 1: nothing of this module runs
on a one-device worker's steps.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from tokenmill.worker.config import EngineConfig
from tokenmill.worker.loader import ModelLoadError, ModelSource, empty_model
from tokenmill.worker.model_runner import ModelRunner, PendingStep, make_backend, resolve_device, resolve_dtype
from tokenmill.worker.parallel.group import RankSpec, TPGroup, join_group, leave_group, open_store, rank_device
from tokenmill.worker.parallel.layers import TensorParallelLayers
from tokenmill.worker.parallel.step_sync import OP_LOGITS_ALL, OP_STEP, OP_STOP, STEP_KEYS, StepChannel
from tokenmill.worker.scheduler import ScheduledBatch
from tokenmill.worker.structured.bitmask import StepBitmask
from tokenmill.worker.transfer import HostArray, as_tensors

log = logging.getLogger("tokenmill.parallel")

START_TIMEOUT_S = 600.0  # the other ranks resolve the model within this (a checkpoint read, imports)
STOP_TIMEOUT_S = 30.0
STARTED_KEY = "tp/started/{rank}"


def make_model_runner(config: EngineConfig, source: ModelSource, max_model_len: int) -> ModelRunner:
    """The engine's runner: one device, or rank 0 of config.tensor_parallel_size ranks."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, source, max_model_len)
    return TPModelRunner.start(config, source, max_model_len)


def check_tensor_parallel(config: EngineConfig, source: ModelSource, device: torch.device) -> None:
    """ModelLoadError (one line) unless the model splits over config.tensor_parallel_size ranks on `device`'s
    kind: whole KV heads per rank, enough GPUs, every layer's shards (built on the meta device) valid."""
    n, arch = config.tensor_parallel_size, source.arch
    if arch.num_kv_heads % n:
        sizes = [d for d in range(1, arch.num_kv_heads + 1) if arch.num_kv_heads % d == 0]
        raise ModelLoadError(f"--tensor-parallel-size {n} must divide the {arch.num_kv_heads} KV heads of "
                             f"{source.name} (each rank keeps whole KV heads and the query heads that share them): "
                             f"use {', '.join(map(str, sizes))}")
    if arch.intermediate_size % n:
        raise ModelLoadError(f"--tensor-parallel-size {n} must divide the {arch.intermediate_size} MLP columns "
                             f"(intermediate_size) of {source.name}")
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + n > count:
            raise ModelLoadError(f"--tensor-parallel-size {n} needs {n} GPUs from cuda:{first}, but {count} "
                                 "are visible (CUDA_VISIBLE_DEVICES)")
    elif device.type != "cpu":
        raise ModelLoadError(f"tensor parallelism runs on CUDA (NCCL) or the CPU (gloo), not {device.type}")
    meta = TPGroup(RankSpec(0, n), torch.device("meta"))
    empty_model(source, make_backend("torch", device), torch.device("meta"), resolve_dtype(config.dtype, device),
                config.quantization, layers=TensorParallelLayers(meta))


class TPModelRunner(ModelRunner):
    """Rank 0's ModelRunner of a tensor-parallel group (`start` builds it with its other ranks)."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, group: TPGroup,
                 ranks: list[subprocess.Popen[bytes]]) -> None:
        super().__init__(config, source, max_model_len, tp=group)
        self.group = group
        self.ranks = ranks  # ranks 1..N-1, in order
        self.channel = StepChannel(group)
        self._closed = False
        atexit.register(self.close)
        log.info("tensor parallel over %d ranks (%s): %d of %d query heads and %d of %d KV heads per rank",
                 group.size, "nccl" if self.device.type == "cuda" else "gloo", self.num_heads, self.arch.num_heads,
                 self.num_kv_heads, self.arch.num_kv_heads)

    @classmethod
    def start(cls, config: EngineConfig, source: ModelSource, max_model_len: int) -> TPModelRunner:
        """Check the split, start ranks 1..N-1, join them and build rank 0; on any failure the started
        ranks are stopped before the error propagates."""
        base = resolve_device(config.device)
        check_tensor_parallel(config, source, base)
        size = config.tensor_parallel_size
        store = open_store(size, None)
        ranks = start_ranks(config, size, store.port, max_model_len)
        try:
            wait_started(store, ranks)
            group = join_group(store, RankSpec(0, size), rank_device(base, 0))
            return cls(config, source, max_model_len, group, ranks)
        except BaseException:
            stop_ranks(ranks, 0.0)
            leave_group()
            raise

    def _ship(self, tensors: dict[str, HostArray]) -> dict[str, Tensor]:
        self.channel.send(OP_STEP if "logits_rows" in tensors else OP_LOGITS_ALL, as_tensors(tensors, STEP_KEYS))
        return super()._ship(tensors)

    def launch(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...],
               prev: PendingStep | None = None, keep_features: Sequence[int] = (),
               bitmask: StepBitmask | None = None) -> PendingStep:
        pending = super().launch(batch, eos_token_ids, prev, keep_features, bitmask)
        if pending.sampled is not None:  # one id per logits row: the other ranks' tokens in flight
            self.group.broadcast(pending.sampled)
        return pending

    def close(self) -> None:
        """Stop the other ranks (they leave their loop at OP_STOP) and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self.channel.send(OP_STOP, {})
        except RuntimeError as e:  # a rank is gone already
            log.warning("tensor-parallel stop: %s", e)
        stop_ranks(self.ranks, STOP_TIMEOUT_S)
        leave_group()


def start_ranks(config: EngineConfig, size: int, port: int, max_model_len: int) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..size-1 as `python -m tokenmill.worker.parallel.follower`, each told (a JSON line on stdin)
    the engine config, its rank, the store's port, max_model_len, this process's pid and log level."""
    spec = {"config": dataclasses.asdict(config), "size": size, "port": port, "max_model_len": max_model_len,
            "parent": os.getpid(), "log_level": logging.getLogger().getEffectiveLevel()}
    ranks = []
    for rank in range(1, size):
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.worker.parallel.follower"], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write((json.dumps({**spec, "rank": rank}) + "\n").encode())
        proc.stdin.close()
        ranks.append(proc)
    return ranks


def wait_started(store: torch.distributed.TCPStore, ranks: list[subprocess.Popen[bytes]]) -> None:
    """Wait until every rank has resolved the model and is about to join (RuntimeError if one exits first)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = {r: p for r, p in enumerate(ranks, start=1)}
    while waiting:
        for rank, proc in list(waiting.items()):
            if store.check([STARTED_KEY.format(rank=rank)]):
                del waiting[rank]
            elif proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with status {proc.returncode} before "
                                   "joining (its error is on stderr above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks {sorted(waiting)} did not start in {START_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def stop_ranks(ranks: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait up to `timeout` seconds for each rank to exit, then kill it."""
    deadline = time.monotonic() + timeout
    for proc in ranks:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

