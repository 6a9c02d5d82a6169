"""Ranks 1..N-1 of a tensor-parallel worker: `python -m tokenmill.worker.parallel.follower`, started by rank 0
(worker/parallel/runner.py), which writes one JSON line on its stdin: the engine config, this rank, the
group size, the TCPStore port on 127.0.0.1, max_model_len, rank 0's pid and its log level.

A rank builds the same ModelRunner as rank 0 (its shards of the model and of the KV cache, the same CUDA
graphs) and then runs what rank 0 sends, step after step, until OP_STOP: the forward, the logits of the
rows rank 0 samples (its part of the all-gather), and the broadcast that gives it the sampled ids. It keeps
no request state. It dies with rank 0 (PR_SET_PDEATHSIG on Linux, which fires when the thread that started
it ends: rank 0 builds its engine on a thread that lives as long as the engine; elsewhere the host group's
sockets close and its receive fails).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import logging
import os
import signal
import sys
import typing
from typing import Any

import torch

from tokenmill.worker.config import EngineConfig
from tokenmill.worker.loader import resolve_model
from tokenmill.worker.model_runner import ModelRunner, PendingStep, _HostInputs, resolve_device
from tokenmill.worker.parallel.group import RankSpec, TPGroup, join_group, leave_group, open_store, rank_device
from tokenmill.worker.parallel.runner import STARTED_KEY
from tokenmill.worker.parallel.step_sync import OP_LOGITS_ALL, OP_STOP, StepChannel
from tokenmill.worker.transfer import ship

log = logging.getLogger("tokenmill.parallel")

_PR_SET_PDEATHSIG = 1


def config_from_dict(cls: type[Any], data: dict[str, Any]) -> Any:
    """A (nested) frozen config dataclass from dataclasses.asdict output read back from JSON (lists become
    the tuples they were)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, kind = data[f.name], hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(value, dict):
            value = config_from_dict(kind, value)  # type: ignore[arg-type]
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def serve_rank(runner: ModelRunner, group: TPGroup) -> None:
    """Run rank 0's steps until it sends OP_STOP."""
    channel = StepChannel(group)
    prev: PendingStep | None = None
    while True:
        op, host = channel.recv()
        if op == OP_STOP:
            return
        with torch.inference_mode():
            prev = run_step(runner, group, op, host, prev)


def run_step(runner: ModelRunner, group: TPGroup, op: int, host: dict[str, torch.Tensor],
             prev: PendingStep | None) -> PendingStep | None:
    """One step of rank 0's on this rank; returns what holds its sampled ids (None: it sampled nothing)."""
    q_lens = torch.diff(host["query_start_loc"]).tolist()
    inputs = _HostInputs(host, q_lens, host["seq_lens"].tolist())
    dev = ship(host, runner.device, runner.staging)
    hidden = runner._forward(*runner._device_inputs(dev, inputs, prev))
    if op == OP_LOGITS_ALL:
        runner.model.compute_logits(hidden)
        return None
    rows = dev["logits_rows"]
    if not rows.numel():
        return None
    runner.model.compute_logits(hidden[rows])  # this rank's vocabulary columns, all-gathered to every rank
    sampled = group.broadcast(torch.empty(rows.numel(), dtype=torch.int64, device=runner.device))
    return PendingStep(0, {}, [], [], sampled, None)


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # rank 0 died before the signal was armed
        sys.exit(1)


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    rank, size = int(spec["rank"]), int(spec["size"])
    _die_with_parent(int(spec["parent"]))
    logging.basicConfig(level=int(spec.get("log_level", logging.INFO)), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    config: EngineConfig = config_from_dict(EngineConfig, spec["config"])
    store = open_store(size, int(spec["port"]))
    source = resolve_model(config.model, config.load_format)
    store.set(STARTED_KEY.format(rank=rank), "1")
    group = join_group(store, RankSpec(rank, size), rank_device(resolve_device(config.device), rank))
    try:
        runner = ModelRunner(config, source, int(spec["max_model_len"]), tp=group)
        log.info("rank %d of %d ready on %s", rank, size, runner.device)
        serve_rank(runner, group)
    finally:
        leave_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
